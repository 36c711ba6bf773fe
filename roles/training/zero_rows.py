"""Rows whose advantage is exactly 0: which rows of a mini-batch the learner's passes leave
out (``skip_zero_advantage``), the metrics of a step that left rows out, and how many rows of a
batch had advantage 0 (docs/algorithms.md, "Rows whose advantage is 0")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from asyncrl.roles.training.objective import Objective

__all__ = ["over_trained_rows", "trained_rows", "zero_advantage_metric"]


def trained_rows(objective: Objective, advantages: Sequence[Any], skip: bool = True) -> list[int]:
    """The rows of a mini-batch whose loss can have a gradient, in order.

    Every row, unless ``skip`` and the objective is a policy loss alone (no KL or entropy
    term): then a row whose advantage is exactly 0 on every token adds exactly 0 to the loss
    and to its gradient under every correction (each multiplies the advantage by a finite
    weight), so it is left out of the forward and backward passes. The mini-batch's aggregate
    keeps its whole denominator, so the gradient is the same. One row always stays, so a
    mini-batch of nothing but zeros still takes its optimizer step (AdamW moves on zero
    gradients: momentum, decay)."""
    rows = list(range(len(advantages)))
    if not rows or not _skips(objective, skip):
        return rows
    return [i for i in rows if _nonzero(advantages[i])] or [0]


def zero_advantage_metric(
    objective: Objective, advantages: Sequence[Any], skip: bool = True
) -> dict[str, float]:
    """``zero_advantage_rows``: how many of a batch's rows have an advantage of exactly 0, and
    so are left out of its passes (``trained_rows``); nothing where no row is ever left out."""
    if not _skips(objective, skip):
        return {}
    return {"zero_advantage_rows": float(sum(not _nonzero(a) for a in advantages))}


def _skips(objective: Objective, skip: bool) -> bool:
    return skip and objective.algorithm.rl and not objective.terms


def over_trained_rows(parts: dict[str, float], total: float, trained: float) -> dict[str, float]:
    """A mini-batch's parts, summed with weights over ``total`` (every row's) after
    ``trained_rows`` left rows out (``trained``, theirs): ``policy_loss`` as it is (the rows left
    out add exactly 0 to it); the correction's stats as means over the rows trained."""
    scale = total / trained if trained else 0.0
    return {k: v if k == "policy_loss" else v * scale for k, v in parts.items()}


def _nonzero(advantage: Any) -> bool:
    if isinstance(advantage, torch.Tensor):
        return bool(advantage.ne(0).any())
    if isinstance(advantage, (list, tuple)):
        return any(a != 0 for a in advantage)
    return bool(advantage != 0)
