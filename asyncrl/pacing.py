"""Asynchrony settings, staleness, and the pacing of prompt admission.

A sample's *staleness* is the learner version that consumes it minus the oldest version among
its tokens. The manifest's ``pipeline`` section bounds it by ``eta`` (η). Generation may run
ahead of the learner, but only so far: the ``Pacer`` admits new work while

    admitted - wasted  <=  (version - start_version + eta + 1) * batch + overprovision

counted in samples from the moment the pacer was built at ``start_version``. A sample admitted
under that bound starts at a version no more than ``eta`` below the learner step that consumes
it, as long as batches are consumed in admission order; one that still arrives over η (a slow
tail, out-of-order completion) is dropped and counted as waste, or corrected by the learner,
as ``over_eta`` says.

Sync mode is the same pacer with ``eta = 0`` and no over-provisioning: exactly one batch is in
flight, and the next is admitted only after the learner step (a barrier).

The bound counts from the learner's version, which checkpoints keep, so pacing still holds
when a role restarts (a retried request is the same admitted sample) or when the run resumes
from a checkpoint (the pacer starts at the resumed version, not at 0).
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Iterable, Sequence
from typing import Annotated

import msgspec

from asyncrl.manifest_limits import MAX_COUNT, MAX_RATIO, MAX_SECONDS

__all__ = [
    "Mode",
    "OverEta",
    "Pacer",
    "PipelineSpec",
    "StragglerSpec",
    "percentiles",
    "staleness",
    "straggler_problem",
]


class Mode(enum.StrEnum):
    """``sync``: one batch in flight and a barrier before each learner step. ``async``: up to
    ``eta`` versions of generation ahead of the learner, no barrier."""

    SYNC = "sync"
    ASYNC = "async"


class OverEta(enum.StrEnum):
    """What becomes of a sample whose staleness still exceeds η when it is consumed."""

    DROP = "drop"  # discarded, counted as waste; its admission slot is refilled
    CORRECT = "correct"  # trained on, with the learner's off-policy correction


class StragglerSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """When a GRPO group is released if some of its samples are late.

    Attributes:
        policy: ``wait`` for every sample; ``emit`` the group at its deadline with at least
            ``k_min`` samples, its statistics taken over those that arrived; or ``drop`` it at
            its deadline and admit a fresh prompt instead.
        deadline_s: seconds from a group's admission to its deadline; 0 means none (only
            ``wait`` allows that).
        k_min: for ``emit``, the fewest samples a released group may have (at least 2: one
            sample has no group baseline).
    """

    policy: Annotated[
        str,
        msgspec.Meta(pattern="^(wait|emit|drop)$", extra={"expected": "'wait', 'emit' or 'drop'"}),
    ] = "wait"
    deadline_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)] = 0.0
    k_min: Annotated[int, msgspec.Meta(ge=2, le=MAX_COUNT)] = 2


class PipelineSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The manifest's ``pipeline`` section: how samples flow from rollout to the learner.

    Attributes:
        mode: ``sync`` (the baseline) or ``async``; both run the same code.
        eta: the staleness bound η, in learner versions (async mode; sync mode is 0).
        over_eta: ``drop`` or ``correct`` a sample still over η when consumed.
        correction: the learner's off-policy correction of stale tokens: ``clip`` (PPO's
            clipped importance ratio against the behaviour policy: a token the policy has
            moved away from by more than the clip range stops pushing further), ``decoupled``
            PPO (trust region around the learner's current, proximal policy; the behaviour
            policy corrected by an importance weight capped at ``importance_cap``) or ``tis``
            (policy gradient with truncated importance weights).
        importance_cap: the cap on importance weights of ``decoupled`` and ``tis``.
        overprovision: samples admitted beyond what η allows (async mode), so that drops and
            stragglers do not leave the learner waiting.
        group_affinity: keep a GRPO group's samples on one rollout replica (for engines with
            prefix caching); an idle replica still steals them.
        straggler: when a group with late samples is released.
        running_stats: keep streaming, version-tagged reward statistics for the metrics.
        drop_uniform: dynamic sampling (DAPO): drop a group whose rewards are all equal (it
            carries no GRPO signal) and admit another prompt in its place, so that batches keep
            their size; past a cap of drops per batch, such groups are kept
            (docs/algorithms.md).
        stall_timeout_s: seconds without any call completing after which the driver fails the
            run, saying what it waited for and on whom (0: never). Raise it when one learner
            step or one generation legitimately takes longer.
    """

    mode: Annotated[
        str, msgspec.Meta(pattern="^(sync|async)$", extra={"expected": "'sync' or 'async'"})
    ] = "sync"
    eta: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] = 2
    over_eta: Annotated[
        str, msgspec.Meta(pattern="^(drop|correct)$", extra={"expected": "'drop' or 'correct'"})
    ] = "correct"
    correction: Annotated[
        str,
        msgspec.Meta(
            pattern="^(clip|decoupled|tis)$", extra={"expected": "'clip', 'decoupled' or 'tis'"}
        ),
    ] = "clip"
    importance_cap: Annotated[float, msgspec.Meta(gt=0, le=MAX_RATIO)] = 2.0
    overprovision: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] = 0
    group_affinity: bool = False
    straggler: StragglerSpec = msgspec.field(default_factory=StragglerSpec)
    running_stats: bool = False
    drop_uniform: bool = False
    stall_timeout_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)] = 600.0

    def __post_init__(self) -> None:
        problem = straggler_problem(self.straggler.policy, self.straggler.deadline_s)
        if problem:
            raise ValueError(f"straggler.deadline_s: {problem}")

    @property
    def window_eta(self) -> int:
        """η as the pacer applies it: 0 in sync mode."""
        return self.eta if self.mode == Mode.ASYNC else 0

    @property
    def window_overprovision(self) -> int:
        """Over-provisioning as the pacer applies it: none in sync mode."""
        return self.overprovision if self.mode == Mode.ASYNC else 0


def straggler_problem(policy: object, deadline_s: object) -> str | None:
    """Why a straggler policy and deadline do not go together, or None."""
    if policy in ("emit", "drop") and not deadline_s:
        return (
            f"policy {policy!r} needs a deadline > 0 (seconds from a group's admission to "
            "its release); set it, or use policy 'wait'"
        )
    return None


def staleness(consumer_version: int, versions: Sequence[int]) -> int:
    """The consuming learner version minus the oldest version among a sample's tokens (0 for a
    sample without tokens)."""
    return consumer_version - min(versions) if versions else 0


def percentiles(values: Iterable[float]) -> dict[str, float]:
    """``p50``, ``p99`` and ``max`` by nearest rank (0 for no values)."""
    ordered = sorted(values)
    if not ordered:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}

    def rank(q: float) -> float:
        return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])

    return {"p50": rank(0.50), "p99": rank(0.99), "max": float(ordered[-1])}


class Pacer:
    """Admits work while generation stays within η versions of the learner (see the module)."""

    def __init__(
        self, batch: int, eta: int, *, start_version: int = 0, overprovision: int = 0
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch: expected an int >= 1, got {batch}")
        if eta < 0 or overprovision < 0:
            raise ValueError(f"eta and overprovision must be >= 0, got {eta}, {overprovision}")
        self.batch = batch
        self.eta = eta
        self.overprovision = overprovision
        self.start_version = start_version
        self.version = start_version
        self.admitted = 0
        self.wasted = 0
        self.max_ahead = -batch  # the largest (admitted - wasted) - bound seen; <= overprovision
        self._changed = asyncio.Event()

    @property
    def limit(self) -> int:
        """The most samples that may be admitted and not wasted, now."""
        return (self.version - self.start_version + self.eta + 1) * self.batch + self.overprovision

    def room(self) -> int:
        """Samples that may be admitted now."""
        return self.limit - (self.admitted - self.wasted)

    async def admit(self, n: int) -> None:
        """Wait until ``n`` more samples fit under the bound, then count them as admitted."""
        if n > self.batch + self.overprovision:
            raise ValueError(f"cannot admit {n} samples at once; the window holds {self.batch}")
        while self.room() < n:
            self._changed.clear()
            await self._changed.wait()
        self.admitted += n
        self.max_ahead = max(self.max_ahead, self.overprovision - self.room())

    def advance(self, version: int) -> None:
        """The learner reached ``version``: the window moves on.

        Raises:
            ValueError: ``version`` is below the one already reached: the learner lost steps it
                had acknowledged (it restarted from an older checkpoint). Pacing cannot hold
                from there, and waiting would stall the run, so the caller must fail or resume.
        """
        if version < self.version:
            raise ValueError(
                f"the learner's version went back from {self.version} to {version}: it lost "
                f"steps it had acknowledged (restarted from an older checkpoint). Keep the "
                f"learner's 'durable: wal' (the default), or resume the run from its checkpoint"
            )
        if version > self.version:
            self.version = version
            self._changed.set()

    def waste(self, n: int) -> None:
        """``n`` admitted samples were dropped: their room is refilled."""
        if n:
            self.wasted += n
            self._changed.set()
