"""The sample pipeline: prompts in; scored GRPO groups with their advantages out, without barriers.

One ``SamplePipeline`` runs in the control-flow program, between the rollout group and the
learner, in either mode of the manifest's ``pipeline`` section
(``asyncrl.manifest.pipeline_section``); both modes run this same code:

1. **Admission.** A prompt is admitted as a group of ``group_size`` samples when the ``Pacer``
   has room: at most one batch in sync mode, up to η learner versions ahead in async mode.
2. **Dispatch.** The unit of work is one sample, (prompt id, sample index): each is its own
   ``generate`` call (with an episode runner's ``source``, its own multi-turn episode), so one
   group's samples run on whichever replicas have free slots, in any order, and an idle
   replica steals queued ones. An unfinished sample (out of its chunk budget,
   or interrupted by a weight update) comes back partial and is resumed on any replica, keeping
   its tokens and their versions. A sample lost with a crashed replica is re-run by the
   dispatcher under the same stable id: it replaces the lost one, and is never counted twice.
3. **Split-mode reduction.** Each scored sample posts its reward to its group's round of a
   ``Reducer`` (count, mean and M2, merged with Chan's formula in arrival order). A group is
   released the moment its last sample arrives, or at its deadline under the straggler policy;
   its advantages, ``(r - mean) / (std + eps)`` from the rewards it holds, come from the
   function the learner calls when a batch has none (``group_advantages``), so they are
   exactly what the learner computes over the same group. With ``drop_uniform`` (dynamic
   sampling, DAPO), a released group whose rewards are all equal is dropped instead (no GRPO
   signal): counted as waste, and its room goes to a fresh prompt, so batches keep their size.
   At most ``max_uniform_drops`` are dropped per batch; past that, such groups are kept, with
   zero advantages (a probing group whose probe agrees past the cap is generated whole and kept,
   whenever it is released).
4. **Consumption.** ``next_batch()`` hands out whole released groups, oldest release first,
   with each sample's staleness against the learner version that will consume them; a group
   with a sample over η is dropped (waste, refilled) or kept for the learner's correction.

The pipeline owns its background work (admission, one task per sample, scoring) in one
``asyncio.TaskGroup`` (``asyncrl.dispatch.background``): the first error of any of it, or of a
group's release, cancels the rest and is raised by ``next_batch`` (or by ``close``, if no
``next_batch`` raised it).

Every admitted sample ends up consumed or counted as waste (``metrics``); nothing is silently
lost. ``cursor`` is the first prompt index not yet settled (consumed or wasted). Each batch
carries ``resume``: the cursor, the indices past it already settled, and the counters as of that
batch without the groups still in flight. Kept with the learner's step (``TrainBatch.keep``), it
is where a resumed pipeline starts (``SamplePipeline(..., resume=...)``): it admits again from
the cursor, skips what was settled, and counts on from there, so a resumed run generates every
unsettled group once more and consumes nothing twice.

No silent stall: when no sample is in flight, no group is ready and the pacer has no room (the
learner's version does not move), ``next_batch`` raises ``StallError`` at once, saying so; and
``describe()`` tells the driver's watchdog what the pipeline waits for.

``WeightSync`` (``asyncrl.roles.sampling.weight_sync``) and ``group_advantages``
(``asyncrl.roles.learning.groups``) live in modules of their own and are re-exported here.
"""

from __future__ import annotations

import asyncio
import logging
import operator
from collections import Counter, deque
from typing import Any

from asyncrl.clock import MONOTONIC, Clock
from asyncrl.dispatch.background import Background
from asyncrl.errors import StallError
from asyncrl.roles.learning.groups import Group, group_advantages, uniform
from asyncrl.roles.learning.statistics import Moments, percentiles, staleness
from asyncrl.roles.payloads import Prompt, Sample, SamplingParams, Scored
from asyncrl.roles.sampling.coalesce import GroupCalls
from asyncrl.roles.sampling.contract import (
    Batch,
    Caller,
    Generate,
    PromptFeed,
    PromptsExhausted,
    RewardTally,
    SampleSource,
    Scorer,
    check_args,
    max_drops,
    skipped_too_many,
    warn_capped,
)
from asyncrl.roles.sampling.pacing import Mode, OverEta, Pacer, PipelineSpec
from asyncrl.roles.sampling.reduce import Outcome, Reducer, Released, Straggler
from asyncrl.roles.sampling.schedule import PromptSchedule
from asyncrl.roles.sampling.weight_sync import WeightSync

__all__ = ["Batch", "SamplePipeline", "WeightSync", "group_advantages"]

log = logging.getLogger("asyncrl.pipeline")

_FIRST = operator.itemgetter(0)

INFRA_DROP = "drop"
"""``pipeline.infra_failed``: drop a group with an infra-failed sample (else: replace it once)."""

INFRA_DROPPED = "infra_dropped"
"""The outcome of a group dropped for an infra-failed sample."""

FETCH_MAX = 1024
"""The most prompts asked of the feed at once (while the schedule skips most of them)."""


class SamplePipeline:
    """Admits prompts, generates and scores their groups, and releases them with advantages.

    Use it as an async context manager around the training loop::

        async with SamplePipeline(ctx.roles["rollout"], spec=ctx.pipeline, ...) as pipe:
            for _ in range(steps):
                batch = await pipe.next_batch()
                step = TrainBatch(samples=batch.samples, ...)
                result = await ctx.roles["learner"].call("train_step", step)
                pipe.advance(result.version)        # the window moves on

    Args:
        rollout: the rollout group's handle; ``generate`` takes one sample per call.
        spec: the manifest's ``pipeline`` section.
        feed: the prompts, by index; score: one reward per sample.
        params: sampling parameters; batch_size, group_size: samples per batch and per group.
        start_version, start_cursor, resume: where a resumed run starts (``Batch.resume``).
        normalize_std, std: the learner's GRPO conventions (``group_advantages``).
        timeout: seconds per generate call; watchdog: told what the pipeline waits for.
        drop_uniform: drop groups whose rewards are all equal (default: ``spec.drop_uniform``).
        max_uniform_drops: the most such groups dropped per batch (default: the spec's
            ``uniform_drops_per_group`` per group of the batch); past it they are kept, with
            zero advantages, and counted.
        clock: what straggler deadlines run on (a test passes a ``FakeClock``).
        source: how each sample is produced (``SampleSource``); None: ``Generate``, one
            completion from ``rollout`` with ``params``. An episode runner's source makes each
            sample a multi-turn episode.

    Raises:
        ValueError: a batch smaller than one group, an unknown ``std``, or ``drop_uniform``
            with groups of one.
    """

    def __init__(
        self,
        rollout: Caller,
        *,
        spec: PipelineSpec,
        feed: PromptFeed,
        score: Scorer,
        params: SamplingParams,
        batch_size: int,
        group_size: int,
        start_version: int = 0,
        start_cursor: int = 0,
        resume: dict[str, Any] | None = None,
        normalize_std: bool = True,
        std: str = "population",
        timeout: float = 600.0,
        watchdog: Any = None,
        drop_uniform: bool | None = None,
        max_uniform_drops: int | None = None,
        clock: Clock = MONOTONIC,
        source: SampleSource | None = None,
    ) -> None:
        self.drop_uniform = spec.drop_uniform if drop_uniform is None else drop_uniform
        self.max_uniform_drops = max_drops(
            batch_size, group_size, max_uniform_drops, spec.uniform_drops_per_group
        )
        check_args(batch_size, group_size, std, self.drop_uniform, self.max_uniform_drops)
        self.rollout = rollout
        self.spec = spec
        self.feed = feed
        self.score = score
        self.params = params
        self.batch_size = batch_size
        self.group_size = group_size
        self.normalize_std = normalize_std
        self.std = std
        self.timeout = timeout
        self.source = source or (
            GroupCalls(rollout, params, timeout=timeout)
            if spec.group_calls
            else Generate(rollout, params, timeout=timeout, affinity=spec.group_affinity)
        )
        self.pacer = Pacer(
            batch_size,
            spec.window_eta,
            start_version=start_version,
            overprovision=spec.window_overprovision,
        )
        self._ready_event = asyncio.Event()
        # Samples, scoring and admission run here; its first error is next_batch's to raise.
        self._background = Background("sample pipeline", on_stop=self._ready_event.set)
        self._raised: BaseException | None = None  # the failure next_batch raised
        self.reducer = self._reducer(clock)
        resume = resume or {}
        start_cursor = int(resume.get("cursor", start_cursor))
        self.metrics: Counter[str] = Counter(
            {k: int(v) for k, v in resume.get("pipeline", {}).items()}
        )
        self.running: dict[int, Moments] = {}  # consuming version -> reward moments
        self._running_total = Moments(0, 0.0, 0.0)  # all of them merged
        self._groups: dict[str, Group] = {}
        self._ready: deque[Group] = deque()
        self._next_index = start_cursor  # the next prompt to admit
        self._fetched = start_cursor  # the next prompt to ask the feed for
        self._skip = {int(i) for i in resume.get("settled", [])}  # settled before a resume
        self._fetching = False
        self._unsettled: dict[int, None] = {}  # admitted, not consumed or wasted, in order
        self._prompts: deque[Prompt] = deque()
        self._exhausted = False
        self._uniform_drops = 0  # uniform groups dropped since the last batch was handed out
        self._uniform_capped = False  # ... and it reached max_uniform_drops
        self._constant_batches = 0  # ... with every reward scored for them the same, in this run
        self.schedule = PromptSchedule(spec.schedule, group_size, state=resume.get("schedule"))
        self._probing: dict[str, int] = {}  # group key -> samples of its probe, while probing
        self._skipped_run = 0  # prompts the schedule skipped since it last admitted one
        self._scored = RewardTally()  # the rewards released since the last batch
        self._to_score: list[tuple[Group, int, Sample]] = []
        self._scoring: asyncio.Task[None] | None = None
        if watchdog is not None:
            watchdog.watch("sample pipeline", self.describe)

    def _reducer(self, clock: Clock) -> Reducer:
        """The reducer of the groups' rewards, under the manifest's straggler policy; an error
        in its callbacks fails the pipeline's background work (next_batch raises it)."""
        straggler = self.spec.straggler
        return Reducer(
            self._on_release,
            policy=Straggler(straggler.policy),
            deadline_s=straggler.deadline_s or None,
            k_min=min(straggler.k_min, self.group_size),
            on_late=self._on_late,
            on_error=self._background.fail,
            clock=clock,
        )

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
        self.reducer.close()
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
            prompt = await self._next_prompt()
            if prompt is None:
                self.pacer.waste(self.group_size)  # nothing to admit: give the room back
                self._exhausted = True
                self._ready_event.set()
                return
            self._start(prompt)

    async def _next_prompt(self) -> Prompt | None:
        while True:
            if not self._prompts:
                # While the schedule skips most prompts, ask for more at a time.
                n = max(1, self.batch_size // self.group_size)
                n = min(FETCH_MAX, max(n, self._skipped_run))
                self._fetching = True
                try:
                    fetched = await self.feed(self._fetched, n)
                finally:
                    self._fetching = False
                self._fetched += len(fetched)
                self._prompts.extend(fetched)
            if not self._prompts:
                return None
            prompt = self._prompts.popleft()
            if self._next_index in self._skip:  # consumed before the run resumed
                self._skip.discard(self._next_index)
                self._next_index += 1
                continue
            if not self.schedule.admit(prompt.id, self._next_index):  # deferred: settled now
                retired = self.schedule.retired(prompt.id)
                self.metrics["retired_skips" if retired else "skipped_prompts"] += 1
                self._skipped_run += 1
                if skipped_too_many(log, self._skipped_run, self.schedule.skip_bound()):
                    return None
                self._next_index += 1
                continue
            self._skipped_run = 0
            return prompt

    def _start(self, prompt: Prompt) -> None:
        index = self._next_index
        self._next_index += 1
        group = Group(prompt.id, index, prompt)
        self._groups[group.key] = group
        self._unsettled[index] = None
        self.reducer.open(group.key, self.group_size)
        self.metrics["admitted_groups"] += 1
        self.metrics["admitted_samples"] += self.group_size
        first = self.schedule.first(prompt.id)
        if first < self.group_size:
            self._probing[group.key] = first
            self.metrics["probed_groups"] += 1
        self._spawn(group, range(first))

    def _spawn(self, group: Group, ks: range) -> None:
        for k in ks:
            task = self._background.spawn(self._sample(group, k))
            if task is not None:
                group.tasks.append(task)

    def _after_probe(self, group: Group) -> None:
        """The probe's samples are all scored: drop the group if they agree (while this batch
        may still drop uniform groups), else generate the rest of it."""
        first = self._probing.pop(group.key)
        rewards = [r for _, r in group.samples.values()]
        agree = uniform(rewards) and self.schedule.repeats(
            [s.logprobs for s, _ in group.samples.values()]
        )
        if agree and self._uniform_drops < self.max_uniform_drops:
            self._scored.add(rewards)
            self._uniform_drops += 1
            for counter in ("groups_uniform_dropped", "groups_probe_dropped"):
                self.metrics[counter] += 1
            self.metrics["samples_uniform_dropped"] += first
            self.metrics["wasted_samples"] += first
            self.metrics["admitted_samples"] -= self.group_size - first  # never generated
            self.metrics["wasted_tokens"] += sum(
                len(s.token_ids) for s, _ in group.samples.values()
            )
            self.pacer.waste(self.group_size)  # the whole group's room goes to a fresh prompt
            self._settle(group)
            return
        # Agreeing past this batch's cap, it is generated whole to be kept: dropping it at its
        # release (a later batch's cap may allow it) would waste all of it, not its probe.
        group.keep_uniform = agree
        self._spawn(group, range(first, self.group_size))

    # -- one sample ---------------------------------------------------------------------

    async def _sample(self, group: Group, k: int) -> None:
        counts: Counter[str] = Counter()  # the group's own, so a resume state can drop them
        sample = await self.source(group.prompt, k, counts)
        while sample.infra_failed:
            cause = sample.infra_failed
            counts.update({"infra_failed": 1, f"infra_failed_{cause}": 1})
            if self.spec.infra_failed == INFRA_DROP or k in group.replaced:
                counts["wasted_tokens"] += len(sample.token_ids)
                self._generated(group, counts)
                self._drop_infra_failed(group, k, cause)
                return
            # Replaced once: the failed sample is waste; a fresh one of the prompt takes its slot.
            group.replaced.add(k)
            counts.update(
                infra_replaced=1,
                admitted_samples=1,
                wasted_samples=1,
                wasted_tokens=len(sample.token_ids),
            )
            self._generated(group, counts)
            sample = await self.source(group.prompt, k, counts)
        self._generated(group, counts)
        self._to_score.append((group, k, sample))
        if self._scoring is None or self._scoring.done():
            self._scoring = self._background.spawn(self._score_pending())

    def _generated(self, group: Group, counts: Counter[str]) -> None:
        """Count one sample the source returned, and what it counted on the way."""
        if counts:
            self.metrics.update(counts)
            group.counts.update(counts)
            counts.clear()
        self.metrics["generated_samples"] += 1
        group.generated += 1

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
        self.metrics["groups_infra_dropped"] += 1
        current = asyncio.current_task()
        for task in group.tasks:
            if task is not current and not task.done():
                task.cancel()
        self._waste(group, self.group_size)

    async def _score_pending(self) -> None:
        """Score every sample that finished meanwhile in one call, then post each reward."""
        while self._to_score:
            todo, self._to_score = self._to_score, []
            rewards = await self.score([s for _, _, s in todo])
            for (group, k, sample), reward in zip(todo, rewards, strict=True):
                if group.outcome == INFRA_DROPPED:  # waste already
                    continue
                if group.outcome:
                    self._on_late(group.key, str(k))  # its group was released without it
                    continue
                group.samples[k] = (sample, float(reward))
                self.reducer.add(group.key, str(k), Moments.one(float(reward)))
                if not group.outcome and len(group.samples) == self._probing.get(group.key):
                    self._after_probe(group)

    # -- release ------------------------------------------------------------------------

    def _on_release(self, released: Released) -> None:
        group = self._groups.get(released.key)
        if group is None:
            return
        self._probing.pop(group.key, None)  # a deadline may release a probing group
        group.outcome = released.outcome
        self.metrics[f"groups_{released.outcome}"] += 1
        for k, task in enumerate(group.tasks):
            if k not in group.samples and not task.done():
                task.cancel()  # a straggler of a released group: its result would be waste
        if released.outcome == Outcome.DROPPED:
            self._waste(group, self.group_size)
            return
        missing = self.group_size - len(group.samples)
        if missing:
            self.metrics["wasted_samples"] += missing
            self.pacer.waste(missing)
        ks = sorted(group.samples)
        rewards = [group.samples[k][1] for k in ks]
        self._scored.add(rewards)
        if self.drop_uniform and uniform(rewards):
            if group.keep_uniform:
                self.metrics["groups_uniform_kept"] += 1
            elif self._drop_uniform(group):
                return
        advantages = group_advantages(rewards, normalize_std=self.normalize_std, std=self.std)
        group.advantages = dict(zip(ks, advantages, strict=True))
        self._ready.append(group)
        self._ready_event.set()

    def _drop_uniform(self, group: Group) -> bool:
        """Dynamic sampling: drop a group whose rewards are all equal, so that a fresh prompt
        takes its room; False (keep it) once this batch has dropped ``max_uniform_drops``."""
        if self._uniform_drops >= self.max_uniform_drops:
            if not self._uniform_capped:
                self._uniform_capped = True
                self.metrics["batches_uniform_capped"] += 1
                constant = self._scored.constant()
                self._constant_batches += constant is not None
                warn_capped(log, self._uniform_drops, self._constant_batches, constant)
            self.metrics["groups_uniform_kept"] += 1
            return False
        self._uniform_drops += 1
        self.metrics["groups_uniform_dropped"] += 1
        self.metrics["samples_uniform_dropped"] += len(group.samples)
        self._waste(group, len(group.samples))
        return True

    def _on_late(self, key: str, part: str) -> None:
        self.metrics["late_samples"] += 1

    def _waste(self, group: Group, n: int) -> None:
        """Drop a whole group: its samples are waste, and its room goes to a fresh prompt."""
        self.metrics["wasted_samples"] += n
        self.metrics["wasted_tokens"] += sum(len(s.token_ids) for s, _ in group.samples.values())
        self.pacer.waste(n)
        self._settle(group)

    def _settle(self, group: Group) -> None:
        # The schedule learns from a group once it is settled (consumed or wasted), as the
        # resume state counts it: a released group still unconsumed is admitted again on resume.
        if self.schedule.enabled and group.samples:
            self.schedule.record(group.prompt.id, [r for _, r in group.samples.values()])
        self._probing.pop(group.key, None)
        self._groups.pop(group.key, None)
        self._unsettled.pop(group.index, None)
        self.reducer.forget(group.key)

    @property
    def cursor(self) -> int:
        """The first prompt index not yet consumed or wasted."""
        return next(iter(self._unsettled), self._next_index)

    @property
    def in_flight(self) -> int:
        """Samples admitted and not yet consumed or wasted."""
        return len(self._unsettled) * self.group_size

    def resume_state(self) -> dict[str, Any]:
        """What a pipeline resumed from here needs: the cursor, the indices past it already
        settled, and the counters without the groups still in flight (they are admitted and
        generated again on resume)."""
        unsettled = [g for g in self._groups.values() if g.index in self._unsettled]
        counters = Counter(self.metrics)
        counters["admitted_groups"] -= len(unsettled)
        counters["admitted_samples"] -= len(unsettled) * self.group_size
        counters["generated_samples"] -= sum(g.generated for g in unsettled)
        for group in unsettled:
            counters.subtract(group.counts)
        return {
            "cursor": self.cursor,
            # Past the cursor, every index admitted (or skipped as settled before a resume)
            # and not unsettled is settled; so are those a resume said to skip, not reached yet.
            "settled": [
                *(i for i in range(self.cursor, self._next_index) if i not in self._unsettled),
                *sorted(self._skip),
            ],
            "pipeline": {k: int(v) for k, v in counters.items()},
            **({"schedule": self.schedule.state()} if self.schedule.enabled else {}),
        }

    def describe(self) -> str:
        """What the pipeline waits for now, for the watchdog's report."""
        generating = sum(1 for g in self._groups.values() for t in g.tasks if not t.done())
        return (
            f"{len(self._groups)} group(s) admitted and unsettled, {generating} sample(s) "
            f"generating, {len(self._to_score)} waiting to be scored, {len(self._ready)} "
            f"group(s) ready; pacer at learner version {self.pacer.version}, room "
            f"{self.pacer.room()} sample(s) (a group needs {self.group_size}); prompts "
            f"{'exhausted' if self._exhausted else 'available'}"
        )

    def _stuck(self) -> bool:
        """Nothing can make the next group ready: nothing generates, scores or fetches, and the
        pacer admits nothing until the learner's version moves, which waits on this batch."""
        if self._ready or self._exhausted or self._fetching or self._to_score:
            return False
        if self._scoring is not None and not self._scoring.done():
            return False
        if any(not t.done() for g in self._groups.values() for t in g.tasks):
            return False
        if self.reducer.pending() and self.spec.straggler.deadline_s:
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
        while admitted < self.batch_size:
            group = await self._next_ready()
            if group is None:
                break
            ks = sorted(group.samples)
            group_ages = [staleness(version, group.samples[k][0].policy_versions) for k in ks]
            over = max(group_ages, default=0) > self.pacer.eta
            if over and self.spec.mode == Mode.ASYNC and self.spec.over_eta == OverEta.DROP:
                self.metrics["groups_over_eta_dropped"] += 1
                self._waste(group, len(group.samples))
                continue
            if over:
                self.metrics["groups_over_eta_corrected"] += 1
            scored = []
            for k in ks:
                sample, reward = group.samples[k]
                scored.append(Scored(sample=sample, reward=reward, advantage=group.advantages[k]))
            taken.append((group.index, scored, group_ages))
            admitted += self.group_size
            self._settle(group)
        # In prompt order, not release order (and in sample order within a group): the learner
        # sums the same samples in the same order whichever finished first, so a sync run is
        # repeatable to the bit.
        taken.sort(key=_FIRST)
        samples = [s for _, group_samples, _ in taken for s in group_samples]
        ages = [a for _, _, group_ages in taken for a in group_ages]
        if not samples:
            raise PromptsExhausted("the prompts ran out: no more groups to hand out")
        self.metrics["consumed_samples"] += len(samples)
        self.metrics["batches"] += 1
        self._uniform_drops, self._uniform_capped = 0, False
        self.schedule.end_batch()
        tally, self._scored = self._scored, RewardTally()
        if self.spec.running_stats:
            rewards = Moments.of([s.reward for s in samples])
            self.running[version] = self.running.get(version, Moments(0, 0.0, 0.0)).merge(rewards)
            self._running_total = self._running_total.merge(rewards)
        metrics: dict[str, float] = {k: float(v) for k, v in self.metrics.items()}
        metrics.update({f"staleness_{k}": v for k, v in percentiles(ages).items()})
        metrics.update({f"reducer_{k}": float(v) for k, v in self.reducer.metrics.items()})
        # The policy's reward: over every group scored since the last batch, uniform ones that
        # dynamic sampling dropped included (the batch's own mean leaves them out).
        metrics["reward_scored_mean"] = (
            tally.total / tally.count
            if tally.count
            else sum(s.reward for s in samples) / len(samples)
        )
        if self.schedule.enabled:
            metrics["schedule_explore"] = self.schedule.explore
        metrics["pacer_room"] = float(self.pacer.room())
        metrics["pacer_max_ahead"] = float(self.pacer.max_ahead)
        if self.spec.running_stats:
            metrics["reward_running_mean"] = self._running_total.mean
            metrics["reward_running_std"] = self._running_total.std
        return Batch(samples, version, ages, self.cursor, metrics, self.resume_state())

    async def _next_ready(self) -> Group | None:
        self._check_failure()
        while not self._ready:
            self._check_failure()
            if self._exhausted and not self._groups:
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
        return self._ready.popleft()
