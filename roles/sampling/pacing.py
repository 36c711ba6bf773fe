"""Staleness, and the pacing of prompt admission under the asynchrony settings of the
manifest's ``pipeline`` section (``asyncrl.manifest.pipeline_section``).

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

from asyncrl.manifest.pipeline_section import (
    Mode,
    OverEta,
    PipelineSpec,
    StragglerSpec,
    straggler_problem,
)

__all__ = [
    "Mode",
    "OverEta",
    "Pacer",
    "PipelineSpec",
    "StragglerSpec",
    "straggler_problem",
]


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
