"""Release: what becomes of a group once its rewards are in, and when a batch takes it.

- **Group reduction.** Each scored sample posts its reward to its group's round of a
  ``Reducer`` (count, mean and M2, merged with Chan's formula in arrival order). A group is
  released the moment its last sample arrives, or at its deadline under the manifest's
  straggler policy (``groups_complete``, ``groups_partial``, ``groups_dropped``); its
  advantages, ``(r - mean) / (std + eps)`` from the rewards it holds, come from the function
  the learner calls when a batch has none (``group_advantages``), so they are exactly what the
  learner computes over the same group. Released groups wait in ``ready``, oldest first.
- **The uniform-drop cap.** With ``drop_uniform`` (dynamic sampling, DAPO), a released group
  whose rewards are all equal carries no GRPO signal and is dropped instead, as is a probed
  group whose probe agreed: counted as waste, its room refilled with a fresh prompt, so
  batches keep their size. At most ``max_uniform_drops`` are dropped per batch: each batch in
  flight (the pacer's η + 1 in async mode, one in sync mode) brings that many drops, what a
  batch handed out left unspent goes to the next, and the drops left never exceed the batches
  in flight's. Past that, such groups are kept with zero advantages (``groups_uniform_kept``),
  and a batch whose every scored reward was the same value says so in a warning. The drops
  are charged to the batches in flight, not to the time between two batches: in async mode
  the groups that end while one batch is assembled are mostly admitted for the next ones, and
  a per-batch count let a burst of them spend a batch's drops and keep the rest uniform.
- **Staleness.** When a batch takes a group, each sample's staleness is measured against the
  learner version that consumes it; a group with a sample over η is dropped (async mode with
  ``over_eta: drop``; waste, refilled) or kept for the learner's correction.

A group dropped here, or taken into a batch, is settled: its room goes back to the ``Pacer``
and admission is told (``on_settled``). What is counted for a group that stays unsettled (its
release, the missing samples of a partial one, its late samples, a uniform group kept) goes
into its own counts too (``Group.counts``), which the pipeline's resume state leaves out.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence

from asyncrl.clock import Clock
from asyncrl.roles.learning.groups import group_advantages, uniform
from asyncrl.roles.learning.statistics import Moments, staleness
from asyncrl.roles.payloads import Sample, Scored
from asyncrl.roles.sampling.contract import BatchSettings
from asyncrl.roles.sampling.counters import Counters
from asyncrl.roles.sampling.group import Group
from asyncrl.roles.sampling.pacing import Mode, OverEta, Pacer, PipelineSpec
from asyncrl.roles.sampling.reduce import Outcome, Reducer, Released, Straggler

__all__ = ["CAPPED_WARN_EVERY", "Release", "RewardTally"]

log = logging.getLogger("asyncrl.pipeline")

CAPPED_WARN_EVERY = 50
"""The warning that a batch reached ``max_uniform_drops`` with a constant reward is given for
the first such batch and then once every this many."""


class RewardTally:
    """The rewards scored since the last batch: their sum, count, least and most."""

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0
        self.low, self.high = math.inf, -math.inf

    def add(self, rewards: Sequence[float]) -> None:
        if rewards:
            self.total += sum(rewards)
            self.count += len(rewards)
            self.low, self.high = min(self.low, *rewards), max(self.high, *rewards)

    def constant(self) -> float | None:
        """The one value every reward had; None when they differ or there is none."""
        return self.low if self.count and self.low == self.high else None


class Release:
    """Reduces each group's rewards, releases it with its advantages or drops it, and hands
    released groups to a batch (see the module).

    Args:
        settings: the batch's settings (group size, the GRPO conventions, dynamic sampling).
        spec: the manifest's ``pipeline`` section (straggler policy, η, ``over_eta``, the
            default of dynamic sampling and its cap).
        counters: the pipeline's counters, which release adds to.
        pacer: what a dropped group's room goes back to.
        on_ready: called when a group is released ready for a batch.
        on_settled: called with each group dropped or taken into a batch.
        on_error: called with an error of the reducer's callbacks (the pipeline raises it
            from ``next_batch``).
        clock: what straggler deadlines run on.

    Raises:
        ValueError: ``drop_uniform`` with groups of one sample.
    """

    def __init__(
        self,
        settings: BatchSettings,
        spec: PipelineSpec,
        counters: Counters,
        pacer: Pacer,
        *,
        on_ready: Callable[[], None],
        on_settled: Callable[[Group], None],
        on_error: Callable[[Exception], None],
        clock: Clock,
    ) -> None:
        self.drop_uniform = (
            spec.drop_uniform if settings.drop_uniform is None else settings.drop_uniform
        )
        self.max_uniform_drops = (
            spec.uniform_drops_per_group * settings.groups
            if settings.max_uniform_drops is None
            else settings.max_uniform_drops
        )
        if self.drop_uniform and settings.group_size < 2:
            raise ValueError(
                "drop_uniform needs group_size >= 2: a group of one sample is always uniform, "
                "so every group would be dropped; raise group_size or set drop_uniform false"
            )
        self.settings = settings
        self.group_size = settings.group_size
        self.counters = counters
        self.pacer = pacer
        self.eta = spec.window_eta
        self.drop_over_eta = spec.mode == Mode.ASYNC and spec.over_eta == OverEta.DROP
        self.waits_for_deadlines = bool(spec.straggler.deadline_s)
        self.ready: deque[Group] = deque()  # released, waiting for a batch; oldest first
        self.tally = RewardTally()  # the rewards released since the last batch
        # The drops the batches in flight may make: max_uniform_drops for each (module).
        self.drops_room = (spec.window_eta + 1) * self.max_uniform_drops
        self.drops_left = self.drops_room
        self.uniform_drops = 0  # uniform groups dropped since the last batch was handed out
        self.capped = False  # ... and the drops ran out
        self.constant_batches = 0  # ... with every reward scored for them the same, in this run
        self._on_ready = on_ready
        self._on_settled = on_settled
        self._rounds: dict[str, Group] = {}  # the groups of the reducer's rounds, by key
        straggler = spec.straggler
        self.reducer = Reducer(
            self.group_released,
            policy=Straggler(straggler.policy),
            deadline_s=straggler.deadline_s or None,
            k_min=min(straggler.k_min, settings.group_size),
            on_late=self.late,
            on_error=on_error,
            clock=clock,
        )

    # -- reduction ----------------------------------------------------------------------

    def open(self, group: Group) -> None:
        """Open ``group``'s round: its deadline runs from now."""
        self._rounds[group.key] = group
        self.reducer.open(group.key, self.group_size)

    def adopt(self, group: Group) -> None:
        """Track ``group``, whose round a reducer elsewhere (a dispatch shard's) reduces:
        ``group_released`` takes its release as if this reducer had made it."""
        self._rounds[group.key] = group

    def add(self, group: Group, k: int, sample: Sample, reward: float) -> None:
        """Sample ``k`` of ``group`` is scored: post its reward (which may release the group)."""
        group.samples[k] = (sample, reward)
        self.reducer.add(group.key, str(k), Moments.one(reward))

    def late(self, key: str, part: str) -> None:
        """A sample arrived after its group was released: counted, never used (and kept in
        the group's own counts while it is unsettled)."""
        self.counters.late_samples += 1
        group = self._rounds.get(key)
        if group is not None:
            group.counts.late_samples += 1

    def group_released(self, released: Released) -> None:
        """The reducer released a group (the reducer's callback): drop it, or compute its
        advantages and make it ready for a batch."""
        group = self._rounds.get(released.key)
        if group is None:
            return
        group.probe = 0  # a deadline may release a probing group: it is not probed again
        group.outcome = released.outcome
        self.counters.released(released.outcome)
        group.counts.released(released.outcome)
        for k, task in enumerate(group.tasks):
            if k not in group.samples and not task.done():
                task.cancel()  # a straggler of a released group: its result would be waste
        if released.outcome == Outcome.DROPPED:
            self.waste(group, self.group_size)
            return
        missing = self.group_size - len(group.samples)
        if missing:
            self._count(group, Counters(wasted_samples=missing))
            self.pacer.waste(missing)
        ks = sorted(group.samples)
        rewards = [group.samples[k][1] for k in ks]
        self.tally.add(rewards)
        if self.drop_uniform and uniform(rewards):
            if group.keep_uniform:
                self._count(group, Counters(groups_uniform_kept=1))
            elif self._drop_uniform(group):
                return
        settings = self.settings
        advantages = group_advantages(
            rewards, normalize_std=settings.normalize_std, std=settings.std
        )
        group.advantages = dict(zip(ks, advantages, strict=True))
        self.ready.append(group)
        self._on_ready()

    def _count(self, group: Group, counts: Counters) -> None:
        """Add ``counts``, counted for ``group`` while it stays unsettled (released, not yet
        taken into a batch), to the pipeline's counters and to the group's own: a resume state
        takes them back out, since the resumed run generates and releases the group again."""
        self.counters.add(counts)
        group.counts.add(counts)

    def deadline_pending(self) -> bool:
        """A straggler deadline may still release a group that waits for samples."""
        return self.waits_for_deadlines and bool(self.reducer.pending())

    # -- the uniform-drop cap -----------------------------------------------------------

    def _drop_uniform(self, group: Group) -> bool:
        """Dynamic sampling: drop a group whose rewards are all equal, so that a fresh prompt
        takes its room; False (keep it) once the batches in flight have no drops left."""
        if self.drops_left <= 0:
            if not self.capped:
                self.capped = True
                self.counters.batches_uniform_capped += 1
                constant = self.tally.constant()
                self.constant_batches += constant is not None
                self._warn_capped(constant)
            self._count(group, Counters(groups_uniform_kept=1))
            return False
        self.uniform_drops += 1
        self.drops_left -= 1
        self.counters.groups_uniform_dropped += 1
        self.counters.samples_uniform_dropped += len(group.samples)
        self.waste(group, len(group.samples))
        return True

    def drop_probe(self, group: Group, first: int) -> bool:
        """Drop ``group`` after its probe of ``first`` samples agreed, unless the batches in
        flight have no drops left (False: the caller generates the rest)."""
        if self.drops_left <= 0:
            return False
        self.tally.add([r for _, r in group.samples.values()])
        self.uniform_drops += 1
        self.drops_left -= 1
        self.counters.groups_uniform_dropped += 1
        self.counters.groups_probe_dropped += 1
        self.counters.samples_uniform_dropped += first
        # The whole group's room goes to a fresh prompt; its rest was never started.
        self.waste(group, first, never_started=self.group_size - first)
        return True

    def _warn_capped(self, constant: float | None) -> None:
        """The drops of the batches in flight ran out while this batch was assembled, the
        ``constant_batches``-th of the run to do so with every reward the same (``constant``).

        With dynamic sampling that is routine (late in a run most groups of a good policy are
        uniform), so it is counted (``batches_uniform_capped``) and logged at debug. Only when
        every reward scored since the previous batch was the same value does it point at the
        reward or the data, and then a warning says so, for the first such batch and every
        ``CAPPED_WARN_EVERY``-th after it."""
        drops, batches = self.uniform_drops, self.constant_batches
        if constant is None:
            log.debug(
                "sample pipeline: %d groups with uniform rewards dropped since the last batch, "
                "and the batches in flight have no drops left (max_uniform_drops a batch); "
                "keeping such groups, with zero advantages, until the next batch",
                drops,
            )
            return
        if (batches - 1) % CAPPED_WARN_EVERY == 0:
            log.warning(
                "sample pipeline: %d groups with uniform rewards dropped since the last batch, "
                "the batches in flight have no drops left (max_uniform_drops a batch), and "
                "every reward scored since then was %g; keeping such groups, with zero "
                "advantages, until the next batch (%d batches so far; said again every %d). Is "
                "the reward constant, or the data far too hard or too easy? (A policy at a "
                "perfect score gets here too.)",
                drops,
                constant,
                batches,
                CAPPED_WARN_EVERY,
            )

    # -- settling -----------------------------------------------------------------------

    def take(self, group: Group, version: int) -> tuple[list[Scored], list[int]] | None:
        """``group``'s scored samples for a batch at learner ``version``, in sample order, with
        their staleness; the group is settled. None: a sample is over η and the group is
        dropped (async mode, ``over_eta: drop``)."""
        ks = sorted(group.samples)
        ages = [staleness(version, group.samples[k][0].policy_versions) for k in ks]
        if max(ages, default=0) > self.eta:
            if self.drop_over_eta:
                self.counters.groups_over_eta_dropped += 1
                self.waste(group, len(group.samples))
                return None
            self.counters.groups_over_eta_corrected += 1
        scored = []
        for k in ks:
            sample, reward = group.samples[k]
            scored.append(Scored(sample=sample, reward=reward, advantage=group.advantages[k]))
        self._settle(group)
        return scored, ages

    def end_batch(self) -> RewardTally:
        """A batch was handed out: the next batch in flight brings its drops; the rewards
        released for this one."""
        self.drops_left = min(self.drops_left + self.max_uniform_drops, self.drops_room)
        self.uniform_drops, self.capped = 0, False
        tally, self.tally = self.tally, RewardTally()
        return tally

    def waste(self, group: Group, n: int, *, never_started: int = 0) -> None:
        """Drop a whole group: ``n`` of its samples are waste (``never_started`` more were
        admitted but never started: no longer counted as admitted), and its room goes to a
        fresh prompt."""
        self.counters.wasted_samples += n
        self.counters.admitted_samples -= never_started
        self.counters.wasted_tokens += sum(len(s.token_ids) for s, _ in group.samples.values())
        self.pacer.waste(n + never_started)
        self._settle(group)

    def close(self) -> None:
        """Cancel every straggler deadline."""
        self.reducer.close()

    def _settle(self, group: Group) -> None:
        self._rounds.pop(group.key, None)
        self.reducer.forget(group.key)
        self._on_settled(group)
