"""Advantages: GAE (PPO), GRPO's group-relative and RLOO's leave-one-out advantages, and the
per-token rewards GAE walks. Conventions as in ``asyncrl.roles.learning.algorithms``."""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.roles.learning.estimators import KLKind, kl_estimator
from asyncrl.roles.learning.groups import StdKind, grouped_advantages
from asyncrl.roles.learning.masked import (
    check_2d,
    check_same_shape,
    valid_positions,
    zero_outside,
)

__all__ = ["StdKind", "gae", "grpo_advantages", "rloo_advantages", "token_rewards"]


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
    check_same_shape("rewards", rewards, values=values, mask=mask)
    check_2d("rewards", rewards)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam!r}")
    valid = valid_positions(mask)
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
    returns = zero_outside(advantages + values, valid)
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
    check_2d("mask", mask)
    if rewards.shape != mask.shape[:1]:
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)} but mask has shape {tuple(mask.shape)}; "
            "rewards must be [B] for a [B, T] mask"
        )
    valid = valid_positions(mask)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(-1)
    out = torch.zeros(mask.shape, dtype=torch.promote_types(rewards.dtype, mask.dtype))
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards.detach()[rows].to(out.dtype)
    if kl_coef:
        if logprobs is None or ref_logprobs is None:
            raise ValueError("token_rewards: kl_coef != 0 needs logprobs and ref_logprobs")
        check_same_shape("logprobs", logprobs, ref_logprobs=ref_logprobs, mask=mask)
        kl = kl_estimator(logprobs.detach(), ref_logprobs.detach(), kl_kind)
        out = out - kl_coef * zero_outside(kl, valid)
    return zero_outside(out, valid)


def _group_index(rewards: Tensor, group_ids: Tensor | None) -> tuple[Tensor, Tensor, int]:
    """Float rewards, each sample's dense group index [N], and the number of groups."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor [N], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if group_ids is None:
        return rewards, torch.zeros_like(rewards, dtype=torch.long), 1
    check_same_shape("rewards", rewards, group_ids=group_ids)
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
    """GRPO's group-relative advantage of each sample (Shao et al. 2024), on tensors.

    Inputs: scalar ``rewards`` [N], and ``group_ids`` [N] (integers; groups may have any size
    and their samples any order). Without ``group_ids`` all N rewards form one group. Output:
    advantages [N], detached, in the rewards' float dtype (integer rewards are promoted).

    Each group's advantages are ``groups.group_advantages`` of its rewards, the function the
    sample pipeline calls (computed in double precision, then cast): ``normalize_std=True``
    gives ``(r - mean) / (std + eps)``, ``normalize_std=False`` gives ``r - mean``, the Dr. GRPO
    variant (Liu et al. 2025), which drops the per-group scaling. ``std="population"`` (the
    default) divides the group's squared deviations by its size n; ``std="unbiased"`` divides
    by n - 1, as TRL and verl do (``sqrt(n / (n - 1))`` times larger). A group of one sample,
    or of equal rewards, has advantage 0 (verl gives a lone sample its reward r: it has no
    baseline, so 0 is the only value that does not depend on the reward's offset).
    """
    rewards, index, _ = _group_index(rewards.detach(), group_ids)
    advantages = grouped_advantages(
        index.tolist(), rewards.tolist(), normalize_std=normalize_std, eps=eps, std=std
    )
    return torch.tensor(advantages, dtype=rewards.dtype, device=rewards.device)


def rloo_advantages(rewards: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """REINFORCE leave-one-out advantage: each reward minus the mean of its group's others.

    Inputs and output as for ``grpo_advantages``. For a sample in a group of n > 1 samples
    ``A_i = r_i - (sum_group - r_i) / (n - 1)``, which equals ``n / (n - 1) * (r_i - mean)``
    (Ahmadian et al. 2024). A group of one sample has no baseline and gets advantage 0; so
    does a group whose rewards are all equal, exactly (``r_i - mean`` of equal rewards such as
    0.1 is float rounding, not a signal).
    """
    rewards, index, groups = _group_index(rewards.detach(), group_ids)
    count, mean, _ = _group_moments(rewards, index, groups)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    low, high = (
        torch.empty(groups, dtype=rewards.dtype).scatter_reduce(
            0, index, rewards, reduce, include_self=False
        )
        for reduce in ("amin", "amax")
    )
    uniform = (low == high)[index]
    return torch.where(uniform, torch.zeros_like(rewards), scale * (rewards - mean))
