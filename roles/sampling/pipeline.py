"""The sample pipeline: prompts in; scored GRPO groups with their advantages out, without barriers.

One ``SamplePipeline`` runs in the control-flow program, between the rollout group and the
learner, in either mode of the manifest's ``pipeline`` section
(``asyncrl.manifest.pipeline_section``); both modes run this same code. It orchestrates; its
parts each own one step:

1. **Admission** (``Admission``, ``asyncrl.roles.sampling.admission``). A prompt is admitted as
   a group of ``group_size`` samples when the ``Pacer`` has room: at most one batch in sync
   mode, up to η learner versions ahead in async mode. Admission pages the prompt feed, skips
   what a resume state settled, asks the prompt schedule which prompts to generate, and starts
   a probed prompt with its probe's samples only.
2. **Dispatch.** The unit of work is one sample, (prompt id, sample index): each is its own
   ``generate`` call (with an episode runner's ``source``, its own multi-turn episode), so one
   group's samples run on whichever replicas have free slots, in any order, and an idle
   replica steals queued ones. An unfinished sample (out of its chunk budget,
   or interrupted by a weight update) comes back partial and is resumed on any replica, keeping
   its tokens and their versions. A sample lost with a crashed replica is re-run by the
   dispatcher under the same stable id: it replaces the lost one, and is never counted twice.
   A sample that failed through no fault of the policy (``Sample.infra_failed``) is replaced
   once by a fresh one, or drops its group (``pipeline.infra_failed``).
3. **Release** (``Release``, ``asyncrl.roles.sampling.release``). Finished samples are scored
   together; each reward goes into its group's round of a ``Reducer`` (split-mode reduction).
   A group is released the moment its last sample arrives, or at its deadline under the
   straggler policy, with the advantages the learner would compute over it
   (``group_advantages``); with ``drop_uniform`` (dynamic sampling) a group whose rewards are
   all equal is dropped instead, up to ``max_uniform_drops`` a batch (the batches in flight
   share theirs).
4. **Consumption.** ``next_batch()`` hands out whole released groups, oldest release first,
   with each sample's staleness against the learner version that will consume them; a group
   with a sample over η is dropped (waste, refilled) or kept for the learner's correction.

The pipeline owns its background work (admission, one task per sample, scoring) in one
``asyncio.TaskGroup`` (``asyncrl.dispatch.background``): the first error of any of it, or of a
group's release, cancels the rest and is raised by ``next_batch`` (or by ``close``, if no
``next_batch`` raised it).

Every admitted sample ends up consumed or counted as waste (``counters``, a ``Counters``;
``metrics`` gives them by name); nothing is silently lost. ``cursor`` is the first prompt index
not yet settled (consumed or wasted). Each batch carries ``resume`` (a ``ResumeState`` as a
plain mapping): the cursor, the indices past it already settled, the counters as of that batch
without the groups still in flight, and the prompt schedule's state. Kept with the learner's
step (``TrainBatch.keep``), it is where a resumed pipeline starts
(``SamplePipeline(..., resume=...)``): it admits again from the cursor, skips what was settled,
and counts on from there, so a resumed run generates every unsettled group once more and
consumes nothing twice.

No silent stall: when no sample is in flight, no group is ready and the pacer has no room (the
learner's version does not move), ``next_batch`` raises ``StallError`` at once, saying so; and
``describe()`` tells the driver's watchdog what the pipeline waits for.

``WeightSync`` (``asyncrl.roles.sampling.weight_sync``) and ``group_advantages``
(``asyncrl.roles.learning.groups``) live in modules of their own and are re-exported here, as
is ``BatchSettings`` (``asyncrl.roles.sampling.contract``).
"""

from __future__ import annotations

import asyncio
import logging
import operator
from collections import Counter
from collections.abc import Mapping
from typing import Any

from asyncrl.clock import MONOTONIC, Clock
from asyncrl.dispatch.background import Background
from asyncrl.errors import StallError
from asyncrl.roles.learning.groups import group_advantages
from asyncrl.roles.learning.statistics import Moments, percentiles
from asyncrl.roles.payloads import Sample, SamplingParams, Scored
from asyncrl.roles.sampling.admission import Admission
from asyncrl.roles.sampling.coalesce import GroupCalls
from asyncrl.roles.sampling.contract import (
    Batch,
    BatchSettings,
    Caller,
    Generate,
    PromptFeed,
    PromptsExhausted,
    ResumeState,
    SampleSource,
    Scorer,
)
from asyncrl.roles.sampling.counters import Counters
from asyncrl.roles.sampling.group import Group
from asyncrl.roles.sampling.pacing import Pacer, PipelineSpec
from asyncrl.roles.sampling.release import Release, RewardTally
from asyncrl.roles.sampling.weight_sync import WeightSync

__all__ = ["Batch", "BatchSettings", "SamplePipeline", "WeightSync", "group_advantages"]

log = logging.getLogger("asyncrl.pipeline")

_FIRST = operator.itemgetter(0)

INFRA_DROP = "drop"
"""``pipeline.infra_failed``: drop a group with an infra-failed sample (else: replace it once)."""

INFRA_DROPPED = "infra_dropped"
"""The outcome of a group dropped for an infra-failed sample."""


class SamplePipeline:
    """Admits prompts, generates and scores their groups, and releases them with advantages.

    Use it as an async context manager around the training loop::

        settings = BatchSettings(batch_size=64, group_size=8)
        rollout = ctx.roles["rollout"]
        async with SamplePipeline(rollout, spec=ctx.pipeline, settings=settings, ...) as pipe:
            for _ in range(steps):
                batch = await pipe.next_batch()
                step = TrainBatch(samples=batch.samples, ...)
                result = await ctx.roles["learner"].call("train_step", step)
                pipe.advance(result.version)        # the window moves on

    Args:
        rollout: the rollout group's handle; ``generate`` takes one sample per call.
        spec: the manifest's ``pipeline`` section.
        settings: the batch and group sizes, the learner's GRPO conventions and dynamic
            sampling (``BatchSettings``).
        feed: the prompts, by index; score: one reward per sample.
        params: sampling parameters; timeout: seconds per generate call.
        start_version, resume: where a resumed run starts: the learner's version, and the
            ``Batch.resume`` kept with its last step (``{"cursor": n}`` alone starts at prompt
            n).
        watchdog: told what the pipeline waits for.
        clock: what straggler deadlines run on (a test passes a ``FakeClock``).
        source: how each sample is produced (``SampleSource``); None: ``Generate``, one
            completion from ``rollout`` with ``params`` (``GroupCalls`` with the spec's
            ``group_calls``). An episode runner's source makes each sample a multi-turn
            episode.

    Attributes:
        counters: what the pipeline counted (``Counters``); ``metrics`` gives them by name.
        admission: which prompt comes next (``Admission``); release: what becomes of a group
            once its rewards are in (``Release``); pacer: the staleness window (``Pacer``).

    Raises:
        ValueError: ``drop_uniform`` with groups of one, or a ``resume`` that is not a
            pipeline's resume state.
    """

    def __init__(
        self,
        rollout: Caller,
        *,
        spec: PipelineSpec,
        settings: BatchSettings,
        feed: PromptFeed,
        score: Scorer,
        params: SamplingParams,
        start_version: int = 0,
        resume: Mapping[str, Any] | None = None,
        timeout: float = 600.0,
        watchdog: Any = None,
        clock: Clock = MONOTONIC,
        source: SampleSource | None = None,
    ) -> None:
        state = ResumeState.of(resume)
        self.spec = spec
        self.settings = settings
        self.score = score
        self.group_size = settings.group_size
        self.source = source or (
            GroupCalls(rollout, params, timeout=timeout)
            if spec.group_calls
            else Generate(rollout, params, timeout=timeout, affinity=spec.group_affinity)
        )
        self.pacer = Pacer(
            settings.batch_size,
            spec.window_eta,
            start_version=start_version,
            overprovision=spec.window_overprovision,
        )
        self.counters = Counters.from_dict(state.pipeline)
        self.admission = Admission(
            feed,
            spec.schedule,
            group_size=settings.group_size,
            chunk=settings.groups,
            counters=self.counters,
            cursor=state.cursor,
            settled=state.settled,
            schedule_state=state.schedule,
        )
        self._ready_event = asyncio.Event()
        # Samples, scoring and admission run here; its first error is next_batch's to raise.
        self._background = Background("sample pipeline", on_stop=self._ready_event.set)
        self._raised: BaseException | None = None  # the failure next_batch raised
        self.release = Release(
            settings,
            spec,
            self.counters,
            self.pacer,
            on_ready=self._ready_event.set,
            on_settled=self.admission.settle,
            on_error=self._background.fail,
            clock=clock,
        )
        self.running: dict[int, Moments] = {}  # consuming version -> reward moments
        self._running_total = Moments(0, 0.0, 0.0)  # all of them merged
        self._to_score: list[tuple[Group, int, Sample]] = []
        self._scoring: asyncio.Task[None] | None = None
        if watchdog is not None:
            watchdog.watch("sample pipeline", self.describe)

    # -- life cycle ---------------------------------------------------------------------

    async def __aenter__(self) -> SamplePipeline:
        await self._background.start()
        self._background.spawn(self._admit_loop())
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        await self.close(raise_failure=exc is None)

    async def close(self, *, raise_failure: bool = True) -> None:
        """Stop admitting, cancel every sample in flight and wait until they are done.

        Raises:
            The first error of a background task (a generate or score call, the release of a
            group) that ``next_batch`` has not raised yet, unless ``raise_failure`` is false
            (then it is logged: the caller is raising another error already).
        """
        failure = await self._background.close()
        self.release.close()
        if failure is None or failure is self._raised:
            return
        if raise_failure:
            self._raised = failure
            raise failure
        log.error("sample pipeline: a background task had failed", exc_info=failure)

    def _check_failure(self) -> None:
        failure = self._background.failure
        if failure is not None:
            self._raised = failure
            raise failure

    # -- admission ----------------------------------------------------------------------

    async def _admit_loop(self) -> None:
        while True:
            await self.pacer.admit(self.group_size)
            prompt = await self.admission.next_prompt()
            if prompt is None:
                self.pacer.waste(self.group_size)  # nothing to admit: give the room back
                self._ready_event.set()
                return
            self._start(self.admission.start(prompt))

    def _start(self, group: Group) -> None:
        """Generate an admitted group: one task a sample (its probe's first, when probed)."""
        self.release.open(group)
        self._spawn(group, range(group.probe or self.group_size))

    def _spawn(self, group: Group, ks: range) -> None:
        for k in ks:
            task = self._background.spawn(self._sample(group, k))
            if task is not None:
                group.tasks.append(task)

    def _after_probe(self, group: Group) -> None:
        """The probe's samples are all scored: drop the group if they agree (while this batch
        may still drop uniform groups), else generate the rest of it."""
        first = group.probe
        if not self._probe_drops(group):
            self._spawn(group, range(first, self.group_size))

    def _probe_drops(self, group: Group) -> bool:
        """End ``group``'s probe, whose samples are all scored: True when it is dropped (they
        agree, and this batch may still drop a uniform group); False when the rest of it is to
        be generated."""
        agree, first = self.admission.end_probe(group)
        if agree and self.release.drop_probe(group, first):
            return True
        # Agreeing past this batch's cap, it is generated whole to be kept: dropping it at its
        # release (a later batch's cap may allow it) would waste all of it, not its probe.
        group.keep_uniform = agree
        return False

    # -- one sample ---------------------------------------------------------------------

    async def _sample(self, group: Group, k: int) -> None:
        source_counts: Counter[str] = Counter()  # what the source counts, by its own names
        sample = await self.source(group.prompt, k, source_counts)
        while sample.infra_failed:
            cause = sample.infra_failed
            failed = Counters(
                infra_failed=1,
                infra_causes=Counter({cause: 1}),
                wasted_tokens=len(sample.token_ids),
            )
            if self.spec.infra_failed == INFRA_DROP or k in group.replaced:
                self._generated(group, source_counts, failed)
                self._drop_infra_failed(group, k, cause)
                return
            # Replaced once: the failed sample is waste; a fresh one of the prompt takes its slot.
            group.replaced.add(k)
            failed.infra_replaced = failed.admitted_samples = failed.wasted_samples = 1
            self._generated(group, source_counts, failed)
            sample = await self.source(group.prompt, k, source_counts)
        self._generated(group, source_counts)
        self._to_score.append((group, k, sample))
        if self._scoring is None or self._scoring.done():
            self._scoring = self._background.spawn(self._score_pending())

    def _generated(
        self, group: Group, source_counts: Counter[str], counts: Counters | None = None
    ) -> None:
        """Count one sample the source returned, what the source counted on the way, and
        ``counts`` (a failed sample's); the group keeps them too, for a resume state."""
        if source_counts:
            self.counters.source.update(source_counts)
            group.counts.source.update(source_counts)
            source_counts.clear()
        if counts is not None:
            self.counters.add(counts)
            group.counts.add(counts)
        self.counters.generated_samples += 1
        group.counts.generated_samples += 1

    def _drop_infra_failed(self, group: Group, k: int, cause: str) -> None:
        """Drop a group whose sample ``k`` failed through no fault of the policy and is not
        replaced (``infra_failed: drop``, or its replacement failed too): the whole group is
        waste, its other samples are cancelled, and a fresh prompt takes its room."""
        if group.outcome:  # released without it (a straggler deadline): counted as waste then
            return
        log.warning(
            "sample pipeline: group %r dropped: sample %d failed (%s) through no fault of the "
            "policy%s",
            group.key,
            k,
            cause,
            " twice" if k in group.replaced else "",
        )
        group.outcome = INFRA_DROPPED
        self.counters.groups_infra_dropped += 1
        current = asyncio.current_task()
        for task in group.tasks:
            if task is not current and not task.done():
                task.cancel()
        self.release.waste(group, self.group_size)

    async def _score_pending(self) -> None:
        """Score every sample that finished meanwhile in one call, then post each reward."""
        while self._to_score:
            todo, self._to_score = self._to_score, []
            rewards = await self.score([s for _, _, s in todo])
            for (group, k, sample), reward in zip(todo, rewards, strict=True):
                self.counters.scored_samples += 1
                group.counts.scored_samples += 1
                if group.outcome == INFRA_DROPPED:  # waste already
                    continue
                if group.outcome:
                    self.release.late(group.key, str(k))  # its group was released without it
                    continue
                self.release.add(group, k, sample, float(reward))
                if self.admission.probe_scored(group):
                    self._after_probe(group)

    # -- state --------------------------------------------------------------------------

    @property
    def metrics(self) -> Counter[str]:
        """The counters by name (``Counters.as_dict``), as every batch's metrics show them."""
        return Counter(self.counters.as_dict())

    @property
    def cursor(self) -> int:
        """The first prompt index not yet consumed or wasted."""
        return self.admission.cursor

    @property
    def in_flight(self) -> int:
        """Samples admitted and not yet consumed or wasted: those of the unsettled groups, less
        what they wasted already (a partial group's missing samples, a replaced failure), so
        that ``admitted_samples`` is ``consumed_samples + wasted_samples + in_flight``."""
        return sum(
            group.counts.admitted_samples - group.counts.wasted_samples
            for group in self.admission.unsettled.values()
        )

    def resume_state(self) -> dict[str, Any]:
        """What a pipeline resumed from here needs (``ResumeState``): the cursor, the indices
        past it already settled, and the counters without what the groups still unsettled
        added to them (generating, or released and not consumed: they are admitted, generated
        and released again on resume)."""
        counters = self.counters.copy()
        for group in self.admission.unsettled.values():
            counters.subtract(group.counts)
        schedule = self.admission.schedule
        return ResumeState(
            cursor=self.cursor,
            settled=self.admission.settled(),
            pipeline=counters.as_dict(),
            schedule=schedule.state() if schedule.enabled else None,
        ).as_dict()

    def describe(self) -> str:
        """What the pipeline waits for now, for the watchdog's report."""
        groups = self.admission.unsettled.values()
        generating = sum(1 for g in groups for t in g.tasks if not t.done())
        return (
            f"{len(groups)} group(s) admitted and unsettled, {generating} sample(s) "
            f"generating, {len(self._to_score)} waiting to be scored, {len(self.release.ready)} "
            f"group(s) ready; pacer at learner version {self.pacer.version}, room "
            f"{self.pacer.room()} sample(s) (a group needs {self.group_size}); prompts "
            f"{'exhausted' if self.admission.exhausted else 'available'}"
        )

    def _stuck(self) -> bool:
        """Nothing can make the next group ready: nothing generates, scores or fetches, and the
        pacer admits nothing until the learner's version moves, which waits on this batch."""
        admission = self.admission
        if self.release.ready or admission.exhausted or admission.fetching or self._to_score:
            return False
        if self._scoring is not None and not self._scoring.done():
            return False
        if any(not t.done() for g in admission.unsettled.values() for t in g.tasks):
            return False
        if self.release.deadline_pending():
            return False
        return self.pacer.room() < self.group_size

    # -- consumption --------------------------------------------------------------------

    def advance(self, version: int) -> None:
        """The learner reached ``version``: generation may move ahead accordingly."""
        self.pacer.advance(version)

    async def next_batch(self) -> Batch:
        """Whole released groups for the learner at the current version: ``batch_size //
        group_size`` of them (fewer only at the end of the prompts), so ``batch_size`` samples
        unless a group was emitted partial under the straggler policy.

        Raises:
            The first error of a background task: a generate call (after the dispatcher's
                retries), the feed, the score function, the release of a group. The other
                tasks are cancelled then, and every later call raises it again.
            PromptsExhausted: the prompts ran out and nothing is left to hand out (an
                ``EOFError``).
        """
        version = self.pacer.version
        taken: list[tuple[int, list[Scored], list[int]]] = []  # (prompt index, samples, ages)
        admitted = 0  # the samples admitted for the groups taken: a partial group counts whole
        while admitted < self.settings.batch_size:
            group = await self._next_ready()
            if group is None:
                break
            took = self.release.take(group, version)
            if took is None:  # over η, dropped
                continue
            taken.append((group.index, *took))
            admitted += self.group_size
        # In prompt order, not release order (and in sample order within a group): the learner
        # sums the same samples in the same order whichever finished first, so a sync run is
        # repeatable to the bit.
        taken.sort(key=_FIRST)
        samples = [s for _, group_samples, _ in taken for s in group_samples]
        ages = [a for _, _, group_ages in taken for a in group_ages]
        if not samples:
            raise PromptsExhausted("the prompts ran out: no more groups to hand out")
        self.counters.consumed_samples += len(samples)
        self.counters.batches += 1
        tally = self.release.end_batch()
        self.admission.schedule.end_batch()
        if self.spec.running_stats:
            rewards = Moments.of([s.reward for s in samples])
            self.running[version] = self.running.get(version, Moments(0, 0.0, 0.0)).merge(rewards)
            self._running_total = self._running_total.merge(rewards)
        metrics = self._batch_metrics(samples, ages, tally)
        return Batch(samples, version, ages, self.cursor, metrics, self.resume_state())

    def _batch_metrics(
        self, samples: list[Scored], ages: list[int], tally: RewardTally
    ) -> dict[str, float]:
        """A batch's metrics: the counters, its staleness, the reducer's counters, the scored
        reward, the schedule's exploration, the pacer's window and the running statistics."""
        metrics: dict[str, float] = {k: float(v) for k, v in self.counters.as_dict().items()}
        metrics.update({f"staleness_{k}": v for k, v in percentiles(ages).items()})
        reducer = self.release.reducer
        metrics.update({f"reducer_{k}": float(v) for k, v in reducer.metrics.items()})
        # The policy's reward: over every group scored since the last batch, uniform ones that
        # dynamic sampling dropped included (the batch's own mean leaves them out).
        metrics["reward_scored_mean"] = (
            tally.total / tally.count
            if tally.count
            else sum(s.reward for s in samples) / len(samples)
        )
        if self.admission.schedule.enabled:
            metrics["schedule_explore"] = self.admission.schedule.explore
        metrics["pacer_room"] = float(self.pacer.room())
        metrics["pacer_max_ahead"] = float(self.pacer.max_ahead)
        if self.spec.running_stats:
            metrics["reward_running_mean"] = self._running_total.mean
            metrics["reward_running_std"] = self._running_total.std
        return metrics

    async def _next_ready(self) -> Group | None:
        self._check_failure()
        ready = self.release.ready
        while not ready:
            self._check_failure()
            if self.admission.exhausted and not self.admission.unsettled:
                return None
            self._ready_event.clear()
            if self._stuck():
                # Give the admission loop one turn: it may just have been woken.
                await asyncio.sleep(0)
                if self._stuck():
                    raise StallError(
                        f"the sample pipeline cannot make progress: {self.describe()}. The "
                        f"learner's version must move for the pacer to admit more; call "
                        f"advance(version) after each learner step"
                    )
                continue
            await self._ready_event.wait()
        return ready.popleft()
