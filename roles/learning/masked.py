"""Masked reductions over per-token tensors: sums, means, variance, whitening, aggregation.

The building blocks of ``asyncrl.roles.learning.algorithms`` (its docstring states the conventions:
``[B, T]`` values with a float ``mask`` of the same shape, garbage allowed at masked positions,
shape errors naming both shapes), and the argument checks the other algorithm modules share.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

__all__ = [
    "Aggregation",
    "aggregate",
    "aggregate_weight",
    "check_2d",
    "check_positive",
    "check_same_shape",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "valid_positions",
    "whiten",
    "zero_outside",
]

Aggregation = Literal[
    "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
"""How a ``[B, T]`` tensor of per-token losses becomes one number; see ``aggregate``."""

_AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


# --------------------------------------------------------------------------------------------
# Checks


def check_same_shape(first_name: str, first: Tensor, **others: Tensor) -> None:
    """Raise ``ValueError`` naming both shapes if any of ``others`` differs from ``first``."""
    for name, other in others.items():
        if other.shape != first.shape:
            raise ValueError(
                f"{first_name} has shape {tuple(first.shape)} but {name} has shape "
                f"{tuple(other.shape)}; they must match"
            )


def check_2d(name: str, tensor: Tensor) -> None:
    if tensor.dim() != 2:
        raise ValueError(
            f"{name} must be a [B, T] tensor, got shape {tuple(tensor.shape)}; "
            "add a batch dimension with .unsqueeze(0) for a single sequence"
        )


def check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def valid_positions(mask: Tensor) -> Tensor:
    """The positions that count, as a bool tensor."""
    return mask != 0


def zero_outside(values: Tensor, valid: Tensor) -> Tensor:
    """``values`` with 0 wherever ``valid`` is False, so garbage there reaches no gradient."""
    return torch.where(valid, values, torch.zeros_like(values))


# --------------------------------------------------------------------------------------------
# Masked reductions


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values * mask`` over all elements (``dim=None``) or along ``dim``.

    Positions where ``mask`` is 0 contribute exactly 0, even if ``values`` holds ``inf`` or
    ``nan`` there. ``values`` and ``mask`` must have the same shape.
    """
    check_same_shape("values", values, mask=mask)
    weighted = zero_outside(values * mask, valid_positions(mask))
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
    check_same_shape("values", values, mask=mask)
    values = zero_outside(values, valid_positions(mask))
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
    check_same_shape("values", values, mask=mask)
    values = zero_outside(values, valid_positions(mask))
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return zero_outside(whitened, valid_positions(mask))


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
    check_same_shape("values", values, mask=mask)
    check_2d("values", values)
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
        check_positive("norm_len", norm_len)
        per_seq = per_seq / norm_len
    nonempty = valid_positions(mask).any(-1).to(values.dtype)
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
    check_2d("mask", mask)
    if mode == "token_mean":
        return valid_positions(mask).sum()
    if mode not in _AGGREGATIONS:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {_AGGREGATIONS}")
    return valid_positions(mask).any(-1).sum()
