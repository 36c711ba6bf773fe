"""A GRPO group in the sample pipeline: its state, its advantages, whether it carries signal.

``group_advantages`` is the one place GRPO advantages are computed: the sample pipeline
(``asyncrl.roles.sampling.pipeline``) calls it on each group it releases, and the learner, for a
batch whose samples came without advantages, calls it through ``grouped_advantages`` on the batch's
groups (samples of one prompt id), as does ``algorithms.grpo_advantages`` on tensors. So both
paths give the same advantages, to the bit, whatever order the samples arrived or sit in
(docs/algorithms.md). The pipeline keeps one ``Group`` per admitted prompt, and ``uniform`` says
whether a group's rewards carry no GRPO signal at all. Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

from asyncrl.roles.learning.statistics import Moments
from asyncrl.roles.payloads import Prompt, Sample

__all__ = ["STD_KINDS", "Group", "StdKind", "group_advantages", "grouped_advantages", "uniform"]

StdKind = Literal["population", "unbiased"]
"""The standard deviation GRPO divides by: over n (population) or n - 1 (unbiased)."""

STD_KINDS: tuple[str, ...] = get_args(StdKind)

_DDOF = {"population": 0, "unbiased": 1}
"""What each ``StdKind`` takes from a group's size before dividing its M2 by it."""


@dataclass(eq=False)
class Group:
    """One admitted prompt's group, as the pipeline tracks it.

    Attributes:
        key: the prompt's id (the reducer's round); index: its place in the prompt feed.
        samples: sample index -> (sample, reward), as they are scored.
        tasks: one generating task per sample.
        advantages: sample index -> advantage, set on release.
        outcome: how the reducer released it ("" while it is not).
        generated: samples finished generating.
        counts: what the sample source counted for its finished samples (``resumed``; an
            episode's turns, restarts, ...): taken back out of a resume state while the group
            is unsettled, as ``generated`` is, since a resumed run produces them again.
        replaced: the sample indices whose infra-failed sample was replaced by a fresh one
            (once each: ``pipeline.infra_failed: replace``).
        keep_uniform: its probe agreed once the batch could drop no more uniform groups, so
            the rest of it was generated to be kept: it is not dropped if it ends uniform.
    """

    key: str
    index: int
    prompt: Prompt
    samples: dict[int, tuple[Sample, float]] = field(default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    advantages: dict[int, float] = field(default_factory=dict)
    outcome: str = ""
    generated: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    keep_uniform: bool = False
    replaced: set[int] = field(default_factory=set)


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
