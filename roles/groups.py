"""A GRPO group in the sample pipeline: its state, its advantages, whether it carries signal.

The sample pipeline (``asyncrl.roles.pipeline``) keeps one ``Group`` per admitted prompt and
releases it with the moments its reducer merged (count, mean, M2); ``group_advantages`` turns
them into the group's advantages exactly as the learner's one-shot ``grpo_advantages`` would
(docs/algorithms.md), and ``uniform`` says whether its rewards carry no GRPO signal at all.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncrl.reduce import Moments
from asyncrl.roles.payloads import Prompt, Sample

__all__ = ["Group", "group_advantages", "uniform"]


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
    """

    key: str
    index: int
    prompt: Prompt
    samples: dict[int, tuple[Sample, float]] = field(default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    advantages: dict[int, float] = field(default_factory=dict)
    outcome: str = ""
    generated: int = 0


def uniform(rewards: Sequence[float]) -> bool:
    """All the rewards are exactly equal: every advantage is 0, the group sends no gradient."""
    return max(rewards) == min(rewards)


def group_advantages(
    rewards: list[float],
    moments: Moments,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    std: str = "population",
) -> list[float]:
    """GRPO advantages of a group's rewards from its reduced moments: ``(r - mean) / (std +
    eps)``, or ``r - mean``; ``std`` is the ``population`` or ``unbiased`` one, as in
    ``algorithms.grpo_advantages`` (docs/algorithms.md), and a group of one sample gets 0."""
    if moments.count < 2:
        return [0.0] * len(rewards)
    if not normalize_std:
        return [r - moments.mean for r in rewards]
    if std == "unbiased":
        sd = math.sqrt(moments.m2 / (moments.count - 1))
    elif std == "population":
        sd = moments.std
    else:
        raise ValueError(f"std: expected 'population' or 'unbiased', got {std!r}")
    return [(r - moments.mean) / (sd + eps) for r in rewards]
