"""Policy and value losses: PPO's clipped surrogate, decoupled PPO, truncated importance
weights and PPO's clipped value loss. Conventions as in ``asyncrl.roles.learning.algorithms``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch
from torch import Tensor

from asyncrl.roles.learning.masked import (
    Aggregation,
    aggregate,
    check_2d,
    check_positive,
    check_same_shape,
    masked_mean,
    valid_positions,
    zero_outside,
)

__all__ = [
    "LOG_RATIO_CLAMP",
    "Importance",
    "ImportanceCapMode",
    "Stats",
    "decoupled_ppo_policy_loss",
    "ppo_policy_loss",
    "sequence_log_ratio",
    "sequence_token_log_ratio",
    "truncated_importance_weights",
    "value_loss",
]

ImportanceCapMode = Literal["truncate", "mask"]
"""What ``decoupled_ppo_policy_loss`` does with an importance weight above its cap."""

Importance = Literal["token", "sequence"]
"""The ratio PPO clips: each token's, or its sequence's (GSPO); see ``sequence_log_ratio``."""

LOG_RATIO_CLAMP = 20.0
"""Log-ratios (and log importance weights) are clamped to +-20 before ``exp``, as verl does, so
a very stale token cannot overflow a loss; past the clamp a token sends no gradient."""

_CAP_MODES: tuple[str, ...] = get_args(ImportanceCapMode)
_IMPORTANCE: tuple[str, ...] = get_args(Importance)


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


def _check_clip(
    clip_eps: float, clip_eps_high: float | None, dual_clip: float | None, importance: str
) -> None:
    if importance not in _IMPORTANCE:
        raise ValueError(f"unknown importance {importance!r}; expected one of {_IMPORTANCE}")
    check_positive("clip_eps", clip_eps)
    if clip_eps_high is not None:
        check_positive("clip_eps_high", clip_eps_high)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip!r}")


def sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """GSPO's sequence-level log importance ratio (Zheng et al. 2025), on every token.

    Input: per-token log-ratios ``log_ratio`` [B, T] (``log pi - log pi_old`` of the sampled
    tokens) and ``mask``. Output [B, T]: at each valid position of row i, the mean of row i's
    log-ratios over its valid positions, ``(1 / |y_i|) * sum_t log_ratio[i, t]``; 0 at masked
    positions. Its ``exp`` is the sequence's ratio ``(pi(y_i) / pi_old(y_i)) ** (1 / |y_i|)``,
    and the gradient reaches each valid token of the row with weight ``1 / |y_i|``. A row of
    one valid token keeps its token's log-ratio.
    """
    check_same_shape("log_ratio", log_ratio, mask=mask)
    check_2d("log_ratio", log_ratio)
    per_row = masked_mean(log_ratio, mask, dim=-1)
    return zero_outside(per_row[:, None].expand_as(log_ratio), valid_positions(mask))


def _token_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def sequence_token_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """GSPO-token's log-ratio (Zheng et al. 2025, as verl computes it), clamped to
    +-``LOG_RATIO_CLAMP``: ``log s_i,t = sg[log s_i] + l_t - sg[l_t]``.

    Input: per-token log-ratios ``log_ratio`` [B, T] (``l_t``) and ``mask``. Output [B, T]: its
    value is ``sequence_log_ratio`` at every valid position (clamped after the mean; 0 at masked
    ones), but the gradient reaches each valid token through its own log-ratio alone, with
    weight 1 (``d exp(log s_i,t) / d l_t = s_i``), where ``sequence_log_ratio`` spreads it
    evenly, ``1 / |y_i|``, over the row. So a per-token factor of the loss (a per-token
    advantage, decoupled PPO's behaviour weight) stays on its token's gradient; when the
    factors are constant over a sequence the gradient is GSPO's. A token whose own log-ratio is
    past the clamp sends no gradient, as at the token level.
    """
    check_same_shape("log_ratio", log_ratio, mask=mask)
    check_2d("log_ratio", log_ratio)
    own = _token_log_ratio(log_ratio, mask)
    sequence = sequence_log_ratio(log_ratio.detach(), mask)
    return (sequence + (own - own.detach())).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


_CLIPPED_LOG_RATIO: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token": _token_log_ratio,
    "sequence": sequence_token_log_ratio,
}
"""The log-ratio PPO clips at each ``Importance`` level, from the masked per-token log-ratios
(0 at masked positions); at the sequence level GSPO-token's, clamped after the mean."""


def _clipped_surrogate(
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float,
    clip_eps_high: float | None,
    dual_clip: float | None,
    importance: Importance = "token",
) -> tuple[Tensor, Stats]:
    """Per-token PPO loss [B, T] (0 at masked positions) and its stats, from log(new / old);
    ``importance="sequence"``: every token's ratio is its sequence's, in GSPO-token's form
    (``sequence_token_log_ratio``), clamped after the mean."""
    valid = valid_positions(mask)
    # Padding may hold -inf log-probs: exp of their difference would poison the gradient even
    # where the loss is zeroed afterwards.
    log_ratio = zero_outside(log_ratio, valid)
    token_log_ratio = _token_log_ratio(log_ratio, mask)
    ratio = _CLIPPED_LOG_RATIO[importance](log_ratio, mask).exp()
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
    loss = zero_outside(loss, valid)
    with torch.no_grad():
        dtype = loss.dtype
        stats = {
            "clip_fraction": masked_mean(clip_active.to(dtype), mask),
            "dual_clip_fraction": masked_mean(dual_active.to(dtype), mask),
            "approx_kl": masked_mean(torch.expm1(token_log_ratio) - token_log_ratio, mask),
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
    importance: Importance = "token",
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

    ``importance="sequence"`` (GSPO, Zheng et al. 2025) puts on every token its sequence's
    ratio ``exp(sequence_log_ratio(logprobs - old_logprobs, mask))``, so the clip acts on whole
    sequences; GSPO's paper pairs it with ``aggregation="seq_mean_token_mean"`` (each
    sequence's loss once) and clip ranges near 3e-4 / 4e-4. The ratio is GSPO-token's
    (``sequence_token_log_ratio``): each token's gradient carries its own advantage, and with
    an advantage constant over each sequence the loss and gradient are GSPO's. With one valid
    token per row the two importance levels are the same loss.

    Outputs ``(loss, stats)``: the 0-dim loss, and ``Stats`` with ``"clip_fraction"``,
    ``"dual_clip_fraction"`` and ``"approx_kl"``.
    """
    check_same_shape(
        "logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask
    )
    _check_clip(clip_eps, clip_eps_high, dual_clip, importance)
    per_token, stats = _clipped_surrogate(
        logprobs - old_logprobs.detach(),
        advantages.detach(),
        mask,
        clip_eps,
        clip_eps_high,
        dual_clip,
        importance,
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
    check_same_shape("logprobs", logprobs, behaviour_logprobs=behaviour_logprobs)
    check_positive("cap", cap)
    log_weight = (logprobs - behaviour_logprobs).detach()
    if mask is None:
        return log_weight.exp().clamp(max=cap)
    check_same_shape("logprobs", logprobs, mask=mask)
    valid = valid_positions(mask)
    return zero_outside(zero_outside(log_weight, valid).exp().clamp(max=cap), valid)


def _behaviour_weights(
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    importance_cap: float | None,
    cap_mode: ImportanceCapMode,
) -> tuple[Tensor, Tensor, Tensor]:
    """Decoupled PPO's per-token log weight log(proximal / behaviour) (clamped), its weight
    after the cap, and where it was above the cap; 0 and False at masked positions."""
    log_weight = zero_outside(proximal_logprobs - behaviour_logprobs, valid_positions(mask))
    log_weight = log_weight.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    weight = log_weight.exp()
    if importance_cap is None:
        return log_weight, weight, torch.zeros_like(weight, dtype=torch.bool)
    above_cap = weight > importance_cap
    if cap_mode == "truncate":
        return log_weight, weight.clamp(max=importance_cap), above_cap
    return log_weight, torch.where(above_cap, torch.zeros_like(weight), weight), above_cap


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
    importance: Importance = "token",
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
    and behaviour log-probs are equal this is exactly ``ppo_policy_loss``. ``importance``
    chooses the clipped ratio's level as in ``ppo_policy_loss``; the weight ``w`` stays per
    token (as in AReaL), and at the sequence level (GSPO-token) on its token's gradient.

    Outputs ``(loss, stats)``: the 0-dim loss reduced with ``aggregate``, and ``Stats`` with
    the keys of ``ppo_policy_loss`` plus ``"importance_weight_mean"``, ``"capped_fraction"``
    and ``"behaviour_kl"``.
    """
    check_same_shape(
        "logprobs",
        logprobs,
        proximal_logprobs=proximal_logprobs,
        behaviour_logprobs=behaviour_logprobs,
        advantages=advantages,
        mask=mask,
    )
    _check_clip(clip_eps, clip_eps_high, dual_clip, importance)
    if importance_cap is not None:
        check_positive("importance_cap", importance_cap)
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
        importance,
    )
    log_weight, weight, above_cap = _behaviour_weights(
        proximal_logprobs, behaviour_logprobs.detach(), mask, importance_cap, cap_mode
    )
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
    check_same_shape("values", values, old_values=old_values, returns=returns, mask=mask)
    if clip_eps is not None:
        check_positive("clip_eps", clip_eps)
    valid = valid_positions(mask)
    # A nan value at a padded position would reach the gradient through the squared error.
    values = zero_outside(values, valid)
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
