"""A GRPO group's advantages from its reduced reward moments.

The sample pipeline (``asyncrl.roles.pipeline``) releases a group with the moments its reducer
merged (count, mean, M2); ``group_advantages`` turns them into the group's advantages exactly as
the learner's one-shot ``grpo_advantages`` would (docs/algorithms.md).
"""

from __future__ import annotations

import math

from asyncrl.reduce import Moments

__all__ = ["group_advantages"]


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
