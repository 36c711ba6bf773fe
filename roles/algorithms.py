"""The RL algorithms as pure torch functions: advantages, losses, estimators and reductions.

Nothing here owns a process, a device or a model: every function takes tensors and returns
tensors, so the learner calls them and a test checks them against hand-computed values.

Conventions:

- A batch of sequences is a ``[B, T]`` tensor of per-token values with a float ``mask`` of the
  same shape: 1 for completion tokens that count, 0 for prompt tokens and padding.
- Per-sample quantities (a GRPO group's rewards) are 1-D tensors ``[N]``.
- Losses are returned as 0-dim tensors that carry gradients; statistics are detached 0-dim
  tensors, so reading them never forces a device synchronisation until someone calls ``.item()``.
- Functions that take a ``mask`` never let a masked position reach a result or a gradient:
  prompt and padding positions may hold garbage, even ``inf`` or ``nan``.
- A shape mismatch raises ``ValueError`` naming both shapes; a bad hyper-parameter raises
  ``ValueError`` naming the parameter and its value.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = [
    "Aggregation",
    "ImportanceCapMode",
    "KLKind",
    "Stats",
    "StdKind",
    "aggregate",
    "aggregate_weight",
    "decoupled_ppo_policy_loss",
    "entropy_from_logits",
    "gae",
    "grpo_advantages",
    "kl_estimator",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "ppo_policy_loss",
    "rloo_advantages",
    "token_logprobs",
    "token_rewards",
    "truncated_importance_weights",
    "value_loss",
    "whiten",
]

Aggregation = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
"""How a ``[B, T]`` tensor of per-token losses becomes one number; see ``aggregate``."""

KLKind = Literal["k1", "k2", "k3"]
"""Schulman's estimators of KL(policy || reference); see ``kl_estimator``."""

ImportanceCapMode = Literal["truncate", "mask"]
"""What ``decoupled_ppo_policy_loss`` does with an importance weight above its cap."""

StdKind = Literal["population", "unbiased"]
"""The standard deviation GRPO divides by: over n (population) or n - 1 (unbiased)."""

LOG_RATIO_CLAMP = 20.0
"""Log-ratios (and log importance weights) are clamped to +-20 before ``exp``, as verl does, so
a very stale token cannot overflow a loss; past the clamp a token sends no gradient."""

_AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
_KL_KINDS: tuple[str, ...] = get_args(KLKind)
_CAP_MODES: tuple[str, ...] = get_args(ImportanceCapMode)
_STD_KINDS: tuple[str, ...] = get_args(StdKind)


# --------------------------------------------------------------------------------------------
# Checks


def _check_same_shape(first_name: str, first: Tensor, **others: Tensor) -> None:
    """Raise ``ValueError`` naming both shapes if any of ``others`` differs from ``first``."""
    for name, other in others.items():
        if other.shape != first.shape:
            raise ValueError(
                f"{first_name} has shape {tuple(first.shape)} but {name} has shape "
                f"{tuple(other.shape)}; they must match"
            )


def _check_2d(name: str, tensor: Tensor) -> None:
    if tensor.dim() != 2:
        raise ValueError(
            f"{name} must be a [B, T] tensor, got shape {tuple(tensor.shape)}; "
            "add a batch dimension with .unsqueeze(0) for a single sequence"
        )


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def _valid(mask: Tensor) -> Tensor:
    """The positions that count, as a bool tensor."""
    return mask != 0


def _zero_outside(values: Tensor, valid: Tensor) -> Tensor:
    """``values`` with 0 wherever ``valid`` is False, so garbage there reaches no gradient."""
    return torch.where(valid, values, torch.zeros_like(values))


# --------------------------------------------------------------------------------------------
# Masked reductions


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values * mask`` over all elements (``dim=None``) or along ``dim``.

    Positions where ``mask`` is 0 contribute exactly 0, even if ``values`` holds ``inf`` or
    ``nan`` there. ``values`` and ``mask`` must have the same shape.
    """
    _check_same_shape("values", values, mask=mask)
    weighted = _zero_outside(values * mask, _valid(mask))
    return weighted.sum() if dim is None else weighted.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over the positions where ``mask`` is set.

    Inputs: ``values`` and ``mask`` of the same shape. Output: a 0-dim tensor (``dim=None``)
    or the shape with ``dim`` removed. Where no position is set the mean is 0, not ``nan``,
    and it still carries a (zero) gradient to ``values``.
    """
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = False) -> Tensor:
    """Variance of ``values`` over all positions where ``mask`` is set, as a 0-dim tensor.

    ``unbiased=False`` (the default) divides by the count n: the population variance, the one
    that per-replica moments merged with Chan's formula reproduce. ``unbiased=True`` divides by
    n - 1. With too few positions (none, or one when unbiased) the variance is 0.
    """
    _check_same_shape("values", values, mask=mask)
    values = _zero_outside(values, _valid(mask))
    mean = masked_mean(values, mask)
    squared = masked_sum((values - mean) ** 2, mask)
    count = mask.sum()
    if unbiased:
        count = count - 1
    return squared / count.clamp(min=1)


def whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``values`` to unit variance (and zero mean) over the masked positions.

    Inputs: ``values`` and ``mask`` of the same shape. Output: the same shape, with
    ``(values - mean) / sqrt(var + eps)`` at masked positions, plus ``mean`` added back when
    ``shift_mean`` is False (scale only), and 0 at unmasked positions. The mean and variance are
    taken over every masked element of the whole tensor; the variance is the population one
    (see ``masked_var``).
    """
    _check_same_shape("values", values, mask=mask)
    values = _zero_outside(values, _valid(mask))
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _zero_outside(whitened, _valid(mask))


def aggregate(
    values: Tensor, mask: Tensor, mode: Aggregation, norm_len: float | None = None
) -> Tensor:
    """Reduce per-token ``values`` [B, T] to a 0-dim tensor over the masked tokens.

    Modes:

    - ``"token_mean"``: the sum over every valid token of the batch divided by their count.
      Each token weighs the same, so long sequences weigh more (DAPO's token-level loss).
    - ``"seq_mean_token_mean"``: the mean over each sequence's valid tokens, then the mean over
      sequences. Each sequence weighs the same (the original GRPO/PPO-for-LLM reduction).
    - ``"seq_mean_token_sum"``: the sum over each sequence's valid tokens, then the mean over
      sequences.
    - ``"seq_mean_token_sum_norm"``: the sum over each sequence's valid tokens divided by the
      constant ``norm_len`` (usually the maximum generation length), then the mean over
      sequences. The constant removes the length bias of a per-sequence mean (Dr. GRPO).

    In the ``seq_mean_*`` modes a row with no valid token is a padding row and is left out of
    the mean over sequences. With no valid token at all every mode returns 0 (with a zero
    gradient), never ``nan``. ``norm_len`` is required by, and only read by,
    ``"seq_mean_token_sum_norm"``.
    """
    _check_same_shape("values", values, mask=mask)
    _check_2d("values", values)
    if mode == "token_mean":
        return masked_mean(values, mask)
    if mode not in _AGGREGATIONS:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {_AGGREGATIONS}")
    per_seq = masked_sum(values, mask, dim=-1)
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1)
    elif mode == "seq_mean_token_sum_norm":
        if norm_len is None:
            raise ValueError("aggregation 'seq_mean_token_sum_norm' needs norm_len, got None")
        _check_positive("norm_len", norm_len)
        per_seq = per_seq / norm_len
    nonempty = _valid(mask).any(-1).to(values.dtype)
    return masked_mean(per_seq, nonempty)


def aggregate_weight(mask: Tensor, mode: Aggregation) -> Tensor:
    """What a batch's rows contribute to the denominator of ``aggregate``, as a 0-dim tensor.

    ``"token_mean"`` divides by the number of valid tokens, the ``seq_mean_*`` modes by the
    number of rows with at least one valid token. So for rows split into micro-batches
    ``m_1 .. m_k`` of one batch ``M``::

        aggregate(M) == sum_i aggregate(m_i) * aggregate_weight(m_i) / aggregate_weight(M)

    which is how a learner accumulates the gradient of the whole batch over micro-batches.
    An empty completion adds nothing in any mode.
    """
    _check_2d("mask", mask)
    if mode == "token_mean":
        return _valid(mask).sum()
    if mode not in _AGGREGATIONS:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {_AGGREGATIONS}")
    return _valid(mask).any(-1).sum()


# --------------------------------------------------------------------------------------------
# Per-token quantities from logits


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
    _check_same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs)
    log_ratio = ref_logprobs - logprobs
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {_KL_KINDS}")


# --------------------------------------------------------------------------------------------
# Advantages


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over each row's masked tokens.

    Inputs, all [B, T]: per-token ``rewards`` (usually only the last valid token carries the
    sequence's reward), value estimates ``values``, and ``mask``. ``gamma`` is the discount and
    ``lam`` the GAE lambda, both in [0, 1].

    Outputs ``(advantages, returns)``, both [B, T] and detached, 0 at masked positions. Walking
    each row backwards over its valid tokens only (prompt, padding or tool-output tokens in
    between are skipped, and one step of discount is one valid token)::

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next
        R_t     = A_t + V_t

    where ``V_next`` and ``A_next`` belong to the next valid token of the row, and are 0 after
    the last one (the sequence ended: no bootstrap). Rewards at masked positions are ignored.
    """
    _check_same_shape("rewards", rewards, values=values, mask=mask)
    _check_2d("rewards", rewards)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam!r}")
    valid = _valid(mask)
    rewards = rewards.detach()
    values = values.detach()
    zeros = torch.zeros_like(values[:, 0])
    next_value = zeros
    next_advantage = zeros
    advantages = torch.zeros_like(values)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        here = valid[:, t]
        next_value = torch.where(here, values[:, t], next_value)
        next_advantage = torch.where(here, advantage, next_advantage)
        advantages[:, t] = torch.where(here, advantage, zeros)
    returns = _zero_outside(advantages + values, valid)
    return advantages, returns


def token_rewards(
    rewards: Tensor,
    mask: Tensor,
    logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    *,
    kl_coef: float = 0.0,
    kl_kind: KLKind = "k1",
) -> Tensor:
    """Per-token rewards for ``gae``: each sequence's reward on its last valid token, minus
    ``kl_coef * KL`` on every valid token (the KL penalty in the reward, as in InstructGPT).

    Inputs: ``rewards`` [B], ``mask`` [B, T], and with ``kl_coef`` != 0 the sampled tokens'
    ``logprobs`` and ``ref_logprobs`` [B, T] (the KL is ``kl_estimator(logprobs, ref_logprobs,
    kl_kind)``; a row with no reference should carry ``ref_logprobs == logprobs``, which every
    estimator maps to 0). Output: [B, T], detached, 0 at masked positions; a row with no valid
    token gets nothing.
    """
    _check_2d("mask", mask)
    if rewards.shape != mask.shape[:1]:
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)} but mask has shape {tuple(mask.shape)}; "
            "rewards must be [B] for a [B, T] mask"
        )
    valid = _valid(mask)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(-1)
    out = torch.zeros(mask.shape, dtype=torch.promote_types(rewards.dtype, mask.dtype))
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards.detach()[rows].to(out.dtype)
    if kl_coef:
        if logprobs is None or ref_logprobs is None:
            raise ValueError("token_rewards: kl_coef != 0 needs logprobs and ref_logprobs")
        _check_same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs, mask=mask)
        kl = kl_estimator(logprobs.detach(), ref_logprobs.detach(), kl_kind)
        out = out - kl_coef * _zero_outside(kl, valid)
    return _zero_outside(out, valid)


def _group_index(rewards: Tensor, group_ids: Tensor | None) -> tuple[Tensor, Tensor, int]:
    """Float rewards, each sample's dense group index [N], and the number of groups."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [N], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if group_ids is None:
        return rewards, torch.zeros_like(rewards, dtype=torch.long), 1
    _check_same_shape("rewards", rewards, group_ids=group_ids)
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    unique, index = torch.unique(group_ids, return_inverse=True)
    return rewards, index, int(unique.numel())


def _group_moments(rewards: Tensor, index: Tensor, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group size, group mean and population group variance, each [N]."""
    count = torch.zeros(groups, dtype=rewards.dtype, device=rewards.device)
    count.index_add_(0, index, torch.ones_like(rewards))
    total = torch.zeros_like(count).index_add_(0, index, rewards)
    mean = (total / count)[index]
    squared = torch.zeros_like(count).index_add_(0, index, (rewards - mean) ** 2)
    var = (squared / count)[index]
    return count[index], mean, var


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor | None = None,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    std: StdKind = "population",
) -> Tensor:
    """GRPO's group-relative advantage of each sample (Shao et al. 2024).

    Inputs: scalar ``rewards`` [N], and ``group_ids`` [N] (integers; groups may have any size
    and their samples any order). Without ``group_ids`` all N rewards form one group. Output:
    advantages [N], detached, in the rewards' float dtype (integer rewards are promoted).

    ``normalize_std=True``: ``(r - mean) / (std + eps)``. ``normalize_std=False``: ``r - mean``,
    the Dr. GRPO variant (Liu et al. 2025), which drops the per-group scaling. ``std="population"``
    (the default) divides the group's squared deviations by its size n, which is what
    split-mode reduction of (count, mean, M2) with Chan's formula yields; ``std="unbiased"``
    divides by n - 1, as TRL and verl do (``sqrt(n / (n - 1))`` times larger). A group of one
    sample, or of equal rewards, has advantage 0 (verl gives a lone sample its reward r: it has
    no baseline, so 0 is the only value that does not depend on the reward's offset).
    """
    rewards, index, groups = _group_index(rewards.detach(), group_ids)
    if normalize_std:
        _check_positive("eps", eps)
    if std not in _STD_KINDS:
        raise ValueError(f"unknown std {std!r}; expected one of {_STD_KINDS}")
    count, mean, var = _group_moments(rewards, index, groups)
    centred = torch.where(count > 1, rewards - mean, torch.zeros_like(rewards))
    if not normalize_std:
        return centred
    if std == "unbiased":
        var = var * count / (count - 1).clamp(min=1)
    return centred / (var.sqrt() + eps)


def rloo_advantages(rewards: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """REINFORCE leave-one-out advantage: each reward minus the mean of its group's others.

    Inputs and output as for ``grpo_advantages``. For a sample in a group of n > 1 samples
    ``A_i = r_i - (sum_group - r_i) / (n - 1)``, which equals ``n / (n - 1) * (r_i - mean)``
    (Ahmadian et al. 2024). A group of one sample has no baseline and gets advantage 0.
    """
    rewards, index, groups = _group_index(rewards.detach(), group_ids)
    count, mean, _ = _group_moments(rewards, index, groups)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return scale * (rewards - mean)


# --------------------------------------------------------------------------------------------
# Losses


Stats = dict[str, Tensor]
"""Diagnostics of a loss: name to a detached 0-dim tensor (``float(v)`` to log one).

Keys of ``ppo_policy_loss``, token means over the mask whatever the aggregation:

- ``"clip_fraction"``: share of tokens where the clipped ratio set the loss.
- ``"dual_clip_fraction"``: share of tokens where the dual-clip cap set the loss (0 without
  dual clip).
- ``"approx_kl"``: k3 estimate of KL(old || new), the mean of ``(ratio - 1) - log(ratio)``
  (for the decoupled loss, of the proximal policy against the new one).

``decoupled_ppo_policy_loss`` adds:

- ``"importance_weight_mean"``: mean proximal/behaviour weight, after the cap.
- ``"capped_fraction"``: share of tokens whose weight was above the cap (0 without a cap).
- ``"behaviour_kl"``: k3 estimate of KL(behaviour || proximal), how stale the samples are.

``value_loss`` has one key, ``"value_clip_fraction"``: share of tokens where the clipped
value's error set the loss.
"""


def _check_clip(clip_eps: float, clip_eps_high: float | None, dual_clip: float | None) -> None:
    _check_positive("clip_eps", clip_eps)
    if clip_eps_high is not None:
        _check_positive("clip_eps_high", clip_eps_high)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip!r}")


def _clipped_surrogate(
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float,
    clip_eps_high: float | None,
    dual_clip: float | None,
) -> tuple[Tensor, Stats]:
    """Per-token PPO loss [B, T] (0 at masked positions) and its stats, from log(new / old)."""
    valid = _valid(mask)
    # Padding may hold -inf log-probs: exp of their difference would poison the gradient even
    # where the loss is zeroed afterwards.
    log_ratio = _zero_outside(log_ratio, valid).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if dual_clip is None:
        dual_active = torch.zeros_like(clip_active)
    else:
        # Ye et al. 2020: for A < 0 the loss -A * ratio grows without bound in the ratio;
        # cap it at dual_clip * |A|.
        cap = -advantages * dual_clip
        dual_active = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_active, cap, loss)
    loss = _zero_outside(loss, valid)
    with torch.no_grad():
        dtype = loss.dtype
        stats = {
            "clip_fraction": masked_mean(clip_active.to(dtype), mask),
            "dual_clip_fraction": masked_mean(dual_active.to(dtype), mask),
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
        }
    return loss, stats


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float,
    dual_clip: float | None = None,
    aggregation: Aggregation = "token_mean",
    *,
    clip_eps_high: float | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, Stats]:
    """The PPO clipped surrogate loss (Schulman et al. 2017), optionally dual-clipped.

    Inputs, all [B, T]: ``logprobs`` of the sampled tokens under the policy being trained (the
    only input that carries gradients), ``old_logprobs`` under the policy that sampled them,
    per-token ``advantages`` (broadcast a per-sample advantage with
    ``adv[:, None].expand_as(mask)``), and ``mask``. With ``ratio = exp(logprobs -
    old_logprobs)`` the per-token loss is::

        max(-A * ratio, -A * clamp(ratio, 1 - clip_eps, 1 + clip_eps_high))

    ``clip_eps_high`` defaults to ``clip_eps`` (set it higher for DAPO's clip-higher). With
    ``dual_clip`` (> 1; Ye et al. 2020) a token with ``A < 0`` has its loss capped at
    ``dual_clip * |A|``, so a huge ratio cannot blow it up. The per-token loss is reduced with
    ``aggregate(loss, mask, aggregation, norm_len)``.

    Outputs ``(loss, stats)``: the 0-dim loss, and ``Stats`` with ``"clip_fraction"``,
    ``"dual_clip_fraction"`` and ``"approx_kl"``.
    """
    _check_same_shape(
        "logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask
    )
    _check_clip(clip_eps, clip_eps_high, dual_clip)
    per_token, stats = _clipped_surrogate(
        logprobs - old_logprobs.detach(),
        advantages.detach(),
        mask,
        clip_eps,
        clip_eps_high,
        dual_clip,
    )
    return aggregate(per_token, mask, aggregation, norm_len), stats


def truncated_importance_weights(
    logprobs: Tensor, behaviour_logprobs: Tensor, cap: float, *, mask: Tensor | None = None
) -> Tensor:
    """Importance weights ``min(exp(logprobs - behaviour_logprobs), cap)``, detached.

    Inputs: ``logprobs`` of the sampled tokens under the target policy and
    ``behaviour_logprobs`` under the policy that sampled them, both [B, T]; ``cap`` > 0
    (truncated importance sampling, as in IMPALA's rho-bar). Output: [B, T] weights, detached
    (a weight, not a path for gradients). With ``mask`` the weight is 0 at masked positions,
    whatever the log-probs hold there.
    """
    _check_same_shape("logprobs", logprobs, behaviour_logprobs=behaviour_logprobs)
    _check_positive("cap", cap)
    log_weight = (logprobs - behaviour_logprobs).detach()
    if mask is None:
        return log_weight.exp().clamp(max=cap)
    _check_same_shape("logprobs", logprobs, mask=mask)
    valid = _valid(mask)
    return _zero_outside(_zero_outside(log_weight, valid).exp().clamp(max=cap), valid)


def decoupled_ppo_policy_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float,
    dual_clip: float | None = None,
    aggregation: Aggregation = "token_mean",
    *,
    importance_cap: float | None = None,
    cap_mode: ImportanceCapMode = "truncate",
    clip_eps_high: float | None = None,
    norm_len: float | None = None,
) -> tuple[Tensor, Stats]:
    """Decoupled PPO for off-policy (stale) samples (Hilton et al. 2022; AReaL, Fu et al. 2025).

    The policy that sampled the tokens (behaviour) may be several versions old. The trust region
    is taken around a recent proximal policy instead, and the behaviour policy is corrected by an
    importance weight. Inputs, all [B, T]: ``logprobs`` under the policy being trained (the only
    input that carries gradients), ``proximal_logprobs`` under the proximal policy (usually the
    learner's weights before this step, recomputed on the batch), ``behaviour_logprobs`` as
    recorded by the rollout, ``advantages`` and ``mask``. The per-token loss is::

        w * ppo_token_loss(ratio = exp(logprobs - proximal_logprobs))
        w = exp(proximal_logprobs - behaviour_logprobs)    (detached)

    with the PPO token loss of ``ppo_policy_loss`` (``clip_eps``, ``clip_eps_high``,
    ``dual_clip``). With ``importance_cap``, a weight above the cap is either truncated to it
    (``cap_mode="truncate"``) or set to 0, dropping the token's gradient while it still counts
    in the aggregation's denominator (``cap_mode="mask"``, AReaL's behaviour). When the proximal
    and behaviour log-probs are equal this is exactly ``ppo_policy_loss``.

    Outputs ``(loss, stats)``: the 0-dim loss reduced with ``aggregate``, and ``Stats`` with
    the keys of ``ppo_policy_loss`` plus ``"importance_weight_mean"``, ``"capped_fraction"``
    and ``"behaviour_kl"``.
    """
    _check_same_shape(
        "logprobs",
        logprobs,
        proximal_logprobs=proximal_logprobs,
        behaviour_logprobs=behaviour_logprobs,
        advantages=advantages,
        mask=mask,
    )
    _check_clip(clip_eps, clip_eps_high, dual_clip)
    if importance_cap is not None:
        _check_positive("importance_cap", importance_cap)
    if cap_mode not in _CAP_MODES:
        raise ValueError(f"unknown cap_mode {cap_mode!r}; expected one of {_CAP_MODES}")
    proximal_logprobs = proximal_logprobs.detach()
    per_token, ppo_stats = _clipped_surrogate(
        logprobs - proximal_logprobs,
        advantages.detach(),
        mask,
        clip_eps,
        clip_eps_high,
        dual_clip,
    )
    log_weight = _zero_outside(proximal_logprobs - behaviour_logprobs.detach(), _valid(mask))
    log_weight = log_weight.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    weight = log_weight.exp()
    if importance_cap is None:
        above_cap = torch.zeros_like(weight, dtype=torch.bool)
    else:
        above_cap = weight > importance_cap
        if cap_mode == "truncate":
            weight = weight.clamp(max=importance_cap)
        else:
            weight = torch.where(above_cap, torch.zeros_like(weight), weight)
    loss = aggregate(per_token * weight, mask, aggregation, norm_len)
    with torch.no_grad():
        stats = {
            **ppo_stats,
            "importance_weight_mean": masked_mean(weight, mask),
            "capped_fraction": masked_mean(above_cap.to(weight.dtype), mask),
            "behaviour_kl": masked_mean(torch.expm1(log_weight) - log_weight, mask),
        }
    return loss, stats


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float | None,
    aggregation: Aggregation = "token_mean",
    *,
    norm_len: float | None = None,
) -> tuple[Tensor, Stats]:
    """PPO's clipped value loss.

    Inputs, all [B, T]: ``values`` from the critic being trained (the only input that carries
    gradients), ``old_values`` from the critic that scored the rollout, target ``returns`` (from
    ``gae``) and ``mask``. The per-token loss is::

        0.5 * max((V - R)**2, (V_clipped - R)**2)
        V_clipped = old_V + clamp(V - old_V, -clip_eps, clip_eps)

    and ``clip_eps=None`` gives the plain ``0.5 * (V - R)**2``. Reduced with
    ``aggregate(loss, mask, aggregation, norm_len)``. Outputs ``(loss, stats)``: the 0-dim loss
    and ``Stats`` with ``"value_clip_fraction"``.
    """
    _check_same_shape("values", values, old_values=old_values, returns=returns, mask=mask)
    if clip_eps is not None:
        _check_positive("clip_eps", clip_eps)
    valid = _valid(mask)
    # A nan value at a padded position would reach the gradient through the squared error.
    values = _zero_outside(values, valid)
    old_values = old_values.detach()
    returns = returns.detach()
    unclipped = (values - returns).square()
    if clip_eps is None:
        per_token = unclipped
        clip_active = torch.zeros_like(valid)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        clipped = (clipped_values - returns).square()
        per_token = torch.maximum(unclipped, clipped)
        clip_active = clipped > unclipped
    loss = 0.5 * aggregate(per_token, mask, aggregation, norm_len)
    with torch.no_grad():
        stats = {"value_clip_fraction": masked_mean(clip_active.to(per_token.dtype), mask)}
    return loss, stats
