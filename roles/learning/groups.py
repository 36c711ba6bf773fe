"""GRPO groups: their advantages, and whether they carry signal.

``group_advantages`` is the one place GRPO advantages are computed: the sample pipeline
(``asyncrl.roles.sampling.pipeline``) calls it on each group it releases, and the learner, for a
batch whose samples came without advantages, calls it through ``grouped_advantages`` on the batch's
groups (samples of one prompt id), as does ``algorithms.grpo_advantages`` on tensors. So both
paths give the same advantages, to the bit, whatever order the samples arrived or sit in
(docs/algorithms.md). ``uniform`` says whether a group's rewards carry no GRPO signal at all.
Nothing here imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Literal, get_args

from asyncrl.roles.learning.statistics import Moments

__all__ = ["STD_KINDS", "StdKind", "group_advantages", "grouped_advantages", "uniform"]

StdKind = Literal["population", "unbiased"]
"""The standard deviation GRPO divides by: over n (population) or n - 1 (unbiased)."""

STD_KINDS: tuple[str, ...] = get_args(StdKind)

_DDOF = {"population": 0, "unbiased": 1}
"""What each ``StdKind`` takes from a group's size before dividing its M2 by it."""


def uniform(rewards: Sequence[float]) -> bool:
    """All the rewards are exactly equal: every advantage is 0, the group sends no gradient."""
    return max(rewards) == min(rewards)


def _check(normalize_std: bool, eps: float, std: str) -> None:
    if std not in _DDOF:
        raise ValueError(f"unknown std {std!r}; expected one of {STD_KINDS}")
    if normalize_std and not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")


def group_advantages(
    rewards: Sequence[float],
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    std: str = "population",
) -> list[float]:
    """GRPO's advantage of each sample of one group (Shao et al. 2024), from its rewards.

    ``normalize_std=True``: ``(r - mean) / (sd + eps)``; ``normalize_std=False``: ``r - mean``
    (Dr. GRPO, Liu et al. 2025). ``sd`` is the ``population`` std (M2 / n, the default) or the
    ``unbiased`` one (M2 / (n - 1), as TRL and verl). The mean and M2 are those of
    ``Moments.of`` (exactly rounded sums), so the advantages do not depend on the order of the
    rewards. A group of one sample, or of equal rewards, gets exactly 0: it has no baseline, or
    no signal (verl gives a lone sample its reward r instead). No rewards: no advantages.

    Raises:
        ValueError: an unknown ``std``, or ``eps`` <= 0 with ``normalize_std``.
    """
    _check(normalize_std, eps, std)
    if not rewards or uniform(rewards):
        return [0.0] * len(rewards)
    moments = Moments.of(rewards)
    centred = [float(r) - moments.mean for r in rewards]
    if not normalize_std:
        return centred
    sd = math.sqrt(moments.m2 / (moments.count - _DDOF[std]))
    return [c / (sd + eps) for c in centred]


def grouped_advantages(
    keys: Sequence[Hashable],
    rewards: Sequence[float],
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    std: str = "population",
) -> list[float]:
    """``group_advantages`` of samples in any order, grouped by their ``keys`` (a prompt id):
    one advantage per reward, in the rewards' order.

    Raises:
        ValueError: as ``group_advantages``, or keys and rewards of different lengths.
    """
    _check(normalize_std, eps, std)
    if len(keys) != len(rewards):
        raise ValueError(f"{len(keys)} keys for {len(rewards)} rewards; expected one each")
    members: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        members.setdefault(key, []).append(i)
    out = [0.0] * len(rewards)
    for index in members.values():
        group = [rewards[i] for i in index]
        advantages = group_advantages(group, normalize_std=normalize_std, eps=eps, std=std)
        for i, advantage in zip(index, advantages, strict=True):
            out[i] = advantage
    return out
