"""Per-token quantities from logits and log-probs: the chosen tokens' log-probs, the
entropy, and Schulman's KL estimators. Conventions as in ``asyncrl.roles.learning.algorithms``."""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from asyncrl.roles.learning.masked import check_same_shape

__all__ = ["KLKind", "entropy_from_logits", "kl_estimator", "token_logprobs"]

KLKind = Literal["k1", "k2", "k3"]
"""Schulman's estimators of KL(policy || reference); see ``kl_estimator``."""

_KL_KINDS: tuple[str, ...] = get_args(KLKind)


def token_logprobs(logits: Tensor, token_ids: Tensor) -> Tensor:
    """Log-probability of each chosen token: ``log_softmax(logits)`` gathered at ``token_ids``.

    Inputs: ``logits`` [B, T, V] (any leading shape works) and integer ``token_ids`` [B, T]
    with the logits' leading shape. Output: [B, T] in the logits' dtype. Computed as
    ``logits[id] - logsumexp(logits)``, which is stable for large logits and never builds the
    full [B, T, V] log-softmax. Pass float32 logits when the result feeds a PPO ratio: bf16
    log-probs are too coarse for ratios near 1.
    """
    if logits.dim() < 1 or logits.shape[:-1] != token_ids.shape:
        raise ValueError(
            f"logits has shape {tuple(logits.shape)} but token_ids has shape "
            f"{tuple(token_ids.shape)}; token_ids must be the logits' shape without the "
            "vocabulary dimension"
        )
    if token_ids.is_floating_point() or token_ids.is_complex():
        raise ValueError(f"token_ids must be an integer tensor, got dtype {token_ids.dtype}")
    chosen = logits.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position: [B, T, V] -> [B, T].

    ``H = -sum_v p_v log p_v`` with ``log p = logits - logsumexp(logits)``, stable for large
    logits. Logits of ``-inf`` (tokens masked out of the vocabulary) contribute 0 to the value
    and to the gradient.
    """
    if logits.dim() < 1:
        raise ValueError(
            f"logits must have a vocabulary dimension, got shape {tuple(logits.shape)}"
        )
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    # 0 * -inf is nan; zero the log first so that neither the value nor the gradient sees it.
    safe_logp = logp.masked_fill(p == 0, 0.0)
    return -(p * safe_logp).sum(-1)


def kl_estimator(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind) -> Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs.

    Inputs: ``logprobs`` (the policy that sampled the tokens) and ``ref_logprobs``, both [B, T].
    Output: [B, T]. With ``x = ref_logprobs - logprobs`` (Schulman, "Approximating KL
    Divergence", 2020):

    - ``"k1"``: ``-x``. Unbiased, high variance, can be negative.
    - ``"k2"``: ``x**2 / 2``. Biased, low variance, >= 0.
    - ``"k3"``: ``exp(x) - x - 1``. Unbiased, low variance, >= 0; computed as
      ``expm1(x) - x`` for accuracy near 0. It overflows to ``inf`` for ``x`` above about 88
      (float32) or 709 (float64).

    Every estimator is 0 where the log-probs are equal. Masked positions are not special here:
    reduce with ``aggregate`` or ``masked_mean``.
    """
    check_same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs)
    log_ratio = ref_logprobs - logprobs
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {_KL_KINDS}")
