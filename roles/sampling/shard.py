"""Dispatch shards: the per-sample half of the sample pipeline, in a role process of its own.

One driver dispatches every sample of a run through its own event loop (docs/scaling.md). A
dispatch shard takes that per-sample work off it: the driver keeps the program, the ``Pacer``,
the data cursor and the learner (``asyncrl.roles.sampling.sharded.ShardedPipeline``), and grants
each admitted group to one shard; the shard generates it, scores it, reduces it and answers with
the group released. The driver then handles one message a group instead of several a sample.

A shard is a supervised role (``DispatchShard``), named in the manifest like any other::

    roles:
      rollout: {class: ..., replicas: 8}
      shard:
        class: asyncrl.roles.sampling.shard:DispatchShard
        replicas: 2                 # shard i owns a contiguous range of the rollout replicas
        capacity: 1024              # groups a shard works on at once
        config: {rollout: rollout, score: my_package.rewards:score}

or, in the built-in programs, by ``pipeline.shards: K``, which adds that role as ``shards``
(``asyncrl.manifest.pipeline_section.shard_role``) with no ``score``: each shard then scores
with the ``reward`` role's ``score_samples``, against the answer of the prompt its grant
carries, as the driver's ``PromptFeed.scorer`` does.

Shard ``i`` of ``K`` owns rollout replicas ``i * n // K`` to ``(i + 1) * n // K - 1``
(``owned_replicas``): its own ``Dispatcher`` and ``Scheduler`` connect to those alone, so the
per-replica work (connections, heartbeats, credit) is spread over the shards. Within a shard a
group's samples go to whichever owned replica has room, as in one driver. The shard follows its
node's ``membership.json`` as the driver does (``follow_membership``, through
``owned_membership``): an owned replica that departed with its node leaves the shard's group,
one that moved is reached where it runs now. Once every owned replica has departed, each grant
fails with ``ShardEmptyError`` and the driver grants the shard's groups to the other shards.

Per granted group (``ShardGrant``, answered by ``ReleasedGroup``; ``ShardWorker.run_group``):

- one ``generate`` call per sample (or per group, ``group_calls``), retried by the shard's
  dispatcher when a rollout replica dies, resumed when it comes back partial;
- a sample that failed through no fault of the policy is replaced once by a fresh one, or drops
  the group (``infra_failed``), as in the driver's pipeline;
- each finished sample is scored (the samples finished in one loop turn in one call of the
  shard's scorer) and its reward posted to the group's round of a ``Reducer``, released whole,
  or at its deadline under the straggler policy;
- the answer carries the samples the group was released with, their rewards, its outcome and
  what it counted (``Counters`` by name: generated, failed, replaced, late samples);
- a grant with a ``probe`` (the prompt schedule's) has only the probe's samples generated and
  scored, answered (outcome ``probed``) once they all are; the driver decides whether the
  group is dropped, and if not grants the rest with the probe's samples in ``scored``, which
  go into the group's round first and are neither generated nor counted again;
- a sample out to the scorer when its group is released (at a straggler deadline) is scored
  all the same, as one driver scores it, and what it counts (``late_samples``,
  ``scored_samples``) rides on the shard's next answer (``ReleasedGroup.late``).

``run_group`` is a *once* endpoint: the driver, not the dispatcher, decides what becomes of a
group whose shard died (it grants it again; ``ShardLedger``). A restarted shard starts empty:
every group it held is generated again from its prompt, under the same sample ids, so nothing
it had half done is counted.

Its cyclic garbage collector is set as the driver's (``asyncrl.dispatch.driver.freeze_start_up``):
it holds a driver's share of samples, futures and tasks in flight.

``sync`` has the shard's replicas load the newest weights (the rollout endpoint the config's
``weights_method`` names) and answers the oldest version among them: a ``WeightSync`` over the
shards' handle reaches every rollout replica through its shard.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import msgspec

from asyncrl.clock import MONOTONIC, Clock
from asyncrl.dispatch.dispatcher import Dispatcher
from asyncrl.dispatch.driver import follow_membership, followed, freeze_start_up
from asyncrl.dispatch.handles import Context
from asyncrl.errors import ConfigProblem, RoleDeadError
from asyncrl.manifest.membership import Membership
from asyncrl.observe import logs
from asyncrl.role import Delivery, Role, endpoint
from asyncrl.roles.learning.statistics import Moments
from asyncrl.roles.payloads import Prompt, Sample, SamplingParams, ScoreSamples
from asyncrl.roles.sampling.coalesce import GroupCalls
from asyncrl.roles.sampling.contract import Caller, Generate, SampleSource, Scorer
from asyncrl.roles.sampling.counters import Counters
from asyncrl.roles.sampling.pipeline import INFRA_DROPPED
from asyncrl.roles.sampling.reduce import Reducer, Released, Straggler

__all__ = [
    "PROBED",
    "AnswerScorer",
    "DispatchShard",
    "GroupWithdrawnError",
    "ReleasedGroup",
    "ShardEmptyError",
    "ShardGrant",
    "ShardSample",
    "ShardWorker",
    "owned_membership",
    "owned_replicas",
    "shard_of",
]

T = TypeVar("T")

PROBED = "probed"
"""The outcome of a probe's release (``ShardGrant.probe``): its samples are all scored, and the
driver decides what becomes of the group."""


class ShardSample(msgspec.Struct, kw_only=True):
    """One scored sample of a released group: its index in the group, the sample, its reward."""

    k: int
    sample: Sample
    reward: float


class ShardGrant(msgspec.Struct, kw_only=True):
    """One group granted to a shard: generate, score and reduce it.

    Attributes:
        index: the prompt's place in the feed (what the driver's ledger keys the group by).
        prompt: the prompt; group_size: its samples; params: how to sample them.
        timeout_s: seconds for one ``generate`` call.
        group_calls, affinity: the pipeline's ``group_calls`` and ``group_affinity``.
        infra_failed: ``replace`` (an infra-failed sample once) or ``drop`` (the group).
        straggler, deadline_s, k_min: the pipeline's straggler policy (``wait``, ``emit``,
            ``drop``), its deadline (0: none) and the fewest samples ``emit`` releases.
        driver: the incarnation of the driver that granted it. A shard granted a group by a
            newer driver withdraws every group of older ones (their driver died, and nobody
            takes their release), and refuses an older driver's grant.
        probe: the prompt schedule probes the group: generate and score samples 0 to
            ``probe - 1`` only, and answer with them (outcome ``probed``) once they are all
            scored; the driver ends the probe. 0: the whole group.
        scored: samples of the group scored already (a probe's, when the driver keeps its
            group after it): posted to the group's round first, neither generated nor counted
            again, and answered with the rest.
    """

    index: int
    prompt: Prompt
    group_size: int
    params: SamplingParams
    timeout_s: float = 600.0
    group_calls: bool = False
    affinity: bool = False
    infra_failed: str = "replace"
    straggler: str = "wait"
    deadline_s: float = 0.0
    k_min: int = 1
    driver: int = 0
    probe: int = 0
    scored: list[ShardSample] = msgspec.field(default_factory=list)


class ReleasedGroup(msgspec.Struct, kw_only=True):
    """A shard's answer to a ``ShardGrant``: the group as its reducer released it.

    Attributes:
        index: the grant's index; shard: the shard that released it (the driver refuses a
            release of another group, or by another shard, than the one it granted).
        outcome: ``complete``, ``partial``, ``dropped`` (the reducer's ``Outcome``),
            ``infra_dropped`` (``asyncrl.roles.sampling.pipeline.INFRA_DROPPED``, waste: a
            sample failed through no fault of the policy) or ``probed`` (``PROBED``: the
            samples of a grant's ``probe``, all scored).
        samples: the scored samples it was released with, in sample order (a grant's
            ``scored`` among them).
        counts: what the group added to the pipeline's counters in the shard for this grant
            (``Counters`` by name: ``generated_samples``, ``infra_failed``, ``late_samples``,
            ...; not what its ``scored`` samples counted in an earlier grant).
        cause: with ``infra_dropped``, the failure's cause.
        late: what this shard counted, since its previous answer, for samples of groups
            answered already (by group index): a sample scored after its group's release
            (``late_samples``, ``scored_samples``, ``scored_tokens``). It rides on the next
            answer, whichever group that is.
    """

    index: int
    shard: int
    outcome: str
    samples: list[ShardSample]
    counts: dict[str, int]
    cause: str = ""
    late: dict[int, dict[str, int]] = msgspec.field(default_factory=dict)


class GroupWithdrawnError(RuntimeError):
    """A granted group's ``run_group`` ended because the driver withdrew it (``cancel_group``)."""


class ShardEmptyError(RuntimeError):
    """Every rollout replica a shard owns left the run (their nodes were lost): it cannot work
    a group; the driver grants the group to another shard."""


def owned_membership(
    membership: Membership, role: str, owned: range, keep: tuple[str, ...] = ()
) -> Membership:
    """``membership`` as a shard's dispatcher knows it: ``role``'s replicas in ``owned`` alone,
    numbered from 0 as the shard numbers them (``follow_membership``'s ``view``), and the
    roles in ``keep`` (the reward role it calls) as they are; no other role."""

    def mine(per_replica: Mapping[int, T]) -> dict[int, T]:
        return {i - owned.start: v for i, v in per_replica.items() if i in owned}

    return msgspec.structs.replace(
        membership,
        departed={
            **{r: v for r, v in membership.departed.items() if r in keep},
            role: mine(membership.departed.get(role, {})),
        },
        moved={
            **{r: v for r, v in membership.moved.items() if r in keep},
            role: mine(membership.moved.get(role, {})),
        },
        shrunk={},
    )


def owned_replicas(replicas: int, shards: int, shard: int) -> range:
    """The rollout replicas shard ``shard`` of ``shards`` owns: a contiguous range, every
    replica owned by exactly one shard.

    Raises:
        ValueError: fewer rollout replicas than shards (a shard would own none).
    """
    if replicas < shards:
        raise ValueError(
            f"{shards} dispatch shards need at least as many rollout replicas, got {replicas}: "
            f"give the shard role at most {replicas} replicas"
        )
    return range(shard * replicas // shards, (shard + 1) * replicas // shards)


def shard_of(prompt_id: str, shards: int) -> int:
    """The shard a group lives in, chosen by its prompt id (the same in every process)."""
    return zlib.crc32(prompt_id.encode()) % shards


def _named(fn: Any) -> str:
    """A scorer's ``module:function`` (its repr when it has no such name)."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}:{name}" if module and name else repr(fn)


AnswerScorer = Callable[[list[Sample], list[str]], Awaitable[list[float]]]
"""``score(samples, answers)``: one reward per sample, checked against its prompt's answer (the
reward role's ``score_samples``, as the built-in programs score)."""


class _Scoring:
    """Scores samples as they finish: those that finish in one loop turn in one call, of
    ``score`` (samples alone) or of ``score_answers`` (each with its prompt's answer)."""

    def __init__(self, score: Scorer | None, score_answers: AnswerScorer | None) -> None:
        if (score is None) == (score_answers is None):
            raise ValueError("give exactly one of score and score_answers")
        self.score = score
        self.score_answers = score_answers
        self._pending: list[tuple[Sample, str, asyncio.Future[float]]] = []
        self._task: asyncio.Task[None] | None = None

    async def __call__(self, sample: Sample, answer: str) -> float:
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._pending.append((sample, answer, future))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return await future

    async def _scored(self, samples: list[Sample], answers: list[str]) -> list[float]:
        if self.score_answers is not None:
            return list(await self.score_answers(samples, answers))
        assert self.score is not None  # one of the two, checked when made
        return list(await self.score(samples))

    async def _run(self) -> None:
        while self._pending:
            todo, self._pending = self._pending, []
            scorer = self.score_answers if self.score is None else self.score
            try:
                rewards = [
                    float(r)
                    for r in await self._scored([s for s, _, _ in todo], [a for _, a, _ in todo])
                ]
                if len(rewards) != len(todo):
                    raise ValueError(
                        f"the scorer {_named(scorer)} returned {len(rewards)} rewards for "
                        f"{len(todo)} samples: it must return one reward per sample, in order"
                    )
            except Exception as exc:  # every caller of this call raises it
                for _, _, future in todo:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, _, future), reward in zip(todo, rewards, strict=True):
                if not future.done():
                    future.set_result(reward)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class _GroupRun:
    """One granted group while its shard works on it."""

    def __init__(self, grant: ShardGrant, done: asyncio.Future[tuple[str, str]]) -> None:
        self.grant = grant
        self.key = str(grant.index)
        self.done = done  # (outcome, cause) once released; its exception: a sample's failure
        self.samples: dict[int, tuple[Sample, float]] = {}
        self.counts = Counters()
        self.replaced: set[int] = set()
        self.scoring: set[int] = set()  # samples generated and out to the scorer
        self.answered = False  # its answer is built: what it counts now rides on a later one

    @property
    def outcome(self) -> str:
        """How it was released; "" while it is not, or when it failed or was cancelled."""
        done = self.done
        if not done.done() or done.cancelled() or done.exception() is not None:
            return ""
        return done.result()[0]

    def finish(self, outcome: str, cause: str = "") -> None:
        if not self.done.done():
            self.done.set_result((outcome, cause))

    def fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)

    def generated(self, source_counts: Counter[str], counts: Counters | None = None) -> None:
        self.counts.source.update(source_counts)
        source_counts.clear()
        if counts is not None:
            self.counts.add(counts)
        self.counts.generated_samples += 1


class ShardWorker:
    """The work of one dispatch shard, without its process: a test drives it in-process.

    Args:
        rollout: the handle of the rollout replicas this shard owns.
        score: one reward per sample (``Scorer``); or
        score_answers: one reward per sample, given each sample's prompt answer
            (``AnswerScorer``): exactly one of the two.
        shard: which shard this is (echoed in every answer); incarnation: its restarts.
        clock: what straggler deadlines run on.

    Attributes:
        served: grants answered, by outcome (``probed``: a group's probe; ``withdrawn``:
            groups the driver withdrew, or granted by a driver that a newer incarnation
            replaced).
        driver: the newest driver incarnation that granted this shard a group.
    """

    def __init__(
        self,
        rollout: Caller,
        score: Scorer | None = None,
        *,
        score_answers: AnswerScorer | None = None,
        shard: int = 0,
        incarnation: int = 0,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.rollout = rollout
        self.shard = shard
        self.incarnation = incarnation
        self.clock = clock
        self.served: Counter[str] = Counter()
        self._scoring = _Scoring(score, score_answers)
        self._runs: dict[int, _GroupRun] = {}
        self._late: dict[int, Counters] = {}  # group index -> counted since its answer
        self._stragglers: set[asyncio.Task[None]] = set()  # samples of released groups
        self.driver = 0

    async def run_group(self, grant: ShardGrant) -> ReleasedGroup:
        """Generate, score and reduce ``grant``'s group; answer it as released (with a
        ``probe``, answer its probe's samples once they are all scored, unless a straggler
        deadline released the group first).

        The samples of ``grant.scored`` are posted to the group's round before any other and
        answered with the rest; only the others are generated. Samples out to the scorer when
        the group is released run on: each is counted when scored (``late_samples``, unless
        the group was dropped for an infra failure) in the shard's next answer (``late``).

        A grant of a newer driver incarnation than any before withdraws the groups the older
        ones granted: that driver died, and its successor grants them again when it admits
        them. Their ``run_group`` raises ``GroupWithdrawnError``.

        Raises:
            GroupWithdrawnError: the group was granted by an older driver incarnation than one
                that has granted to this shard (at once), or withdrawn while it runs.
            The first error of its samples: a generate call that failed after the shard
            dispatcher's retries, or the scorer's.
        """
        self._follow_driver(grant)
        source: SampleSource = (
            GroupCalls(self.rollout, grant.params, timeout=grant.timeout_s)
            if grant.group_calls
            else Generate(
                self.rollout, grant.params, timeout=grant.timeout_s, affinity=grant.affinity
            )
        )
        run = _GroupRun(grant, asyncio.get_running_loop().create_future())
        self._runs[grant.index] = run

        def released(r: Released) -> None:
            run.finish(r.outcome.value)

        reducer = Reducer(
            released,
            policy=Straggler(grant.straggler),
            deadline_s=grant.deadline_s or None,
            k_min=min(grant.k_min, grant.group_size),
            on_error=run.fail,
            clock=self.clock,
        )
        reducer.open(run.key, grant.group_size)
        for scored in grant.scored:
            run.samples[scored.k] = (scored.sample, scored.reward)
            reducer.add(run.key, str(scored.k), Moments.one(scored.reward))
        ks = (
            range(grant.probe)
            if grant.probe
            else [k for k in range(grant.group_size) if k not in run.samples]
        )
        loop = asyncio.get_running_loop()
        tasks = {k: loop.create_task(self._sample(run, k, source, reducer)) for k in ks}
        try:
            outcome, cause = await run.done
        finally:
            if self._runs.get(grant.index) is run:
                del self._runs[grant.index]
            reducer.close()
            # Released: a sample out to the scorer runs on, to be counted (as one driver
            # scores a sample generated before its group's release). Else every sample stops.
            stopped = []
            for k, task in tasks.items():
                if run.outcome and k in run.scoring:
                    self._stragglers.add(task)
                    task.add_done_callback(self._stragglers.discard)
                else:
                    task.cancel()
                    stopped.append(task)
            await asyncio.gather(*stopped, return_exceptions=True)
        self.served[outcome] += 1
        run.answered = True
        late, self._late = self._late, {}
        return ReleasedGroup(
            index=grant.index,
            shard=self.shard,
            outcome=outcome,
            samples=[
                ShardSample(k=k, sample=s, reward=r) for k, (s, r) in sorted(run.samples.items())
            ],
            counts=run.counts.as_dict(),
            cause=cause,
            late={index: counts.as_dict() for index, counts in late.items()},
        )

    def _follow_driver(self, grant: ShardGrant) -> None:
        """Withdraw the groups of drivers older than ``grant``'s; refuse ``grant`` if its own
        driver is older than one seen."""
        if grant.driver < self.driver:
            raise GroupWithdrawnError(
                f"group {grant.index} was granted by driver incarnation {grant.driver}, which "
                f"incarnation {self.driver} replaced"
            )
        if grant.driver == self.driver:
            return
        self.driver = grant.driver
        # What the older drivers' released groups still score, or counted since: nobody takes it.
        for task in self._stragglers:
            task.cancel()
        self._late.clear()
        for index, run in list(self._runs.items()):
            del self._runs[index]
            if not run.done.done():
                self.served["withdrawn"] += 1
                run.fail(
                    GroupWithdrawnError(
                        f"group {index} was granted by driver incarnation {run.grant.driver}, "
                        f"which incarnation {grant.driver} replaced"
                    )
                )

    def cancel(self, index: int) -> bool:
        """Withdraw group ``index`` (the driver gave up on it and grants it again): its samples
        are cancelled and its ``run_group`` raises ``GroupWithdrawnError``. False when no such
        group is being worked on (released already, or never granted here)."""
        run = self._runs.pop(index, None)
        if run is None or run.done.done():
            return False
        self.served["withdrawn"] += 1
        run.fail(GroupWithdrawnError(f"group {index} was withdrawn by the driver"))
        return True

    async def _sample(self, run: _GroupRun, k: int, source: SampleSource, reducer: Reducer) -> None:
        """Sample ``k`` of ``run``'s group: generated (replaced once when it failed through no
        fault of the policy), scored, and posted to the group's round; the group's probe ends
        with the last of its samples."""
        grant = run.grant
        try:
            source_counts: Counter[str] = Counter()
            sample = await source(grant.prompt, k, source_counts)
            while sample.infra_failed:
                cause = sample.infra_failed
                failed = Counters(
                    infra_failed=1,
                    infra_causes=Counter({cause: 1}),
                    wasted_tokens=len(sample.token_ids),
                )
                if grant.infra_failed == "drop" or k in run.replaced:
                    run.generated(source_counts, failed)
                    run.finish(INFRA_DROPPED, cause)
                    return
                run.replaced.add(k)
                failed.infra_replaced = failed.admitted_samples = failed.wasted_samples = 1
                run.generated(source_counts, failed)
                sample = await source(grant.prompt, k, source_counts)
            run.generated(source_counts)
            run.scoring.add(k)
            reward = await self._scoring(sample, grant.prompt.answer)
            scored = Counters(scored_samples=1, scored_tokens=len(sample.token_ids))
            if run.done.done():  # released without it (a straggler deadline), or dropped
                scored.late_samples = int(run.outcome not in ("", INFRA_DROPPED))
                self._count(run, scored)
                return
            run.counts.add(scored)
            run.samples[k] = (sample, reward)
            reducer.add(run.key, str(k), Moments.one(reward))
            if grant.probe and len(run.samples) == grant.probe:
                run.finish(PROBED)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the group's call raises it
            run.fail(exc)

    def _count(self, run: _GroupRun, counts: Counters) -> None:
        """Count ``counts`` for ``run``'s group: in its answer, or, once that is built, in the
        shard's next answer (``ReleasedGroup.late``)."""
        if run.answered:
            self._late.setdefault(run.grant.index, Counters()).add(counts)
        else:
            run.counts.add(counts)

    async def close(self) -> None:
        """Cancel the scoring in flight, and the samples of released groups still scored."""
        stragglers = list(self._stragglers)
        for task in stragglers:
            task.cancel()
        await asyncio.gather(*stragglers, return_exceptions=True)
        await self._scoring.close()


def _scorer(target: str, where: str) -> Scorer:
    """The scorer a config's ``module:function`` names.

    Raises:
        ConfigProblem: it is not ``module:function``, or cannot be imported.
    """
    module, _, name = target.partition(":")
    if not module or not name:
        raise ConfigProblem(f"{where}: expected 'module:function', got {target!r}")
    try:
        fn: Scorer = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigProblem(f"{where}: {target!r} cannot be imported: {exc}") from exc
    return fn


class DispatchShard(Role):
    """A dispatch shard: owns a contiguous range of the rollout replicas (shard i of K: replicas
    ``i * n // K`` to ``(i + 1) * n // K - 1``) and generates, scores and reduces the groups the
    driver's ``ShardedPipeline`` grants it (docs/scaling.md, "Beyond one driver"). Its role's
    ``capacity`` is the groups one shard works on at once: set it to the groups in flight,
    about ``(eta + 1) * batch_size / group_size / replicas``; below the rollout replicas it
    owns (the manifest's default, 1, with two or more) it is refused, as it would idle them.
    ``pipeline.shards: K`` adds this role as ``shards``, with K replicas and a capacity of
    1,024, for the built-in programs."""

    class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
        """A dispatch shard's settings.

        Attributes:
            score: `module:function`, an async scorer: one reward per sample, in order; empty:
                the `reward` role scores.
            reward: the reward role that scores each sample against its prompt's answer
                (its `score_samples`, as the built-in programs score), when `score` is empty.
            rollout: the rollout role whose replicas the shards split among them.
            weights_method: the rollout endpoint `sync` calls on every owned replica.
            timeout_s: seconds `sync` waits for every owned replica (their connections too),
                and one scoring call of the reward role.
        """

        score: str = ""
        reward: str = "reward"
        rollout: str = "rollout"
        weights_method: str = "sync"
        timeout_s: float = 600.0

    async def setup(self) -> None:
        """Connect to the owned rollout replicas.

        Raises:
            ConfigProblem: the run has no such rollout role, fewer rollout replicas than
                shards, a capacity below the rollout replicas owned, or a scorer that cannot
                be imported.
        """
        cfg = self.config
        where = f"roles.{self.ctx.name}.config"
        known = ", ".join(sorted(self.ctx.groups)) or "none"
        score = _scorer(cfg.score, f"{where}.score") if cfg.score else None
        groups: dict[str, Any] = {}
        if score is None:
            reward = self.ctx.groups.get(cfg.reward)
            if reward is None:
                raise ConfigProblem(
                    f"{where}.reward: the run has no role {cfg.reward!r} (roles: {known}); name "
                    f"the reward role that scores the samples, or give {where}.score"
                )
            groups[cfg.reward] = reward
        group = self.ctx.groups.get(cfg.rollout)
        if group is None:
            raise ConfigProblem(
                f"{where}.rollout: the run has no role {cfg.rollout!r} (roles: {known}); name "
                f"the rollout role whose replicas the shards own"
            )
        try:
            owned = owned_replicas(len(group.endpoints), self.ctx.replicas, self.ctx.replica)
        except ValueError as exc:
            n, k, name = len(group.endpoints), self.ctx.replicas, self.ctx.name
            raise ConfigProblem(
                f"roles.{name}.replicas: {k} dispatch shards need at least as many replicas of "
                f"roles.{cfg.rollout}, which has {n}: set pipeline.shards (or "
                f"roles.{name}.replicas) to at most {n}, or roles.{cfg.rollout}.replicas to at "
                f"least {k}"
            ) from exc
        if self.ctx.capacity < len(owned):
            raise ConfigProblem(
                f"roles.{self.ctx.name}.capacity: {self.ctx.capacity} is fewer than the "
                f"{len(owned)} rollout replicas shard {self.ctx.replica} owns (a shard's "
                f"capacity is the groups it works on at once: fewer would idle them); set it "
                f"to the groups in flight, about (eta + 1) * "
                f"batch_size / group_size / {self.ctx.replicas} (docs/scaling.md)"
            )
        mine = msgspec.structs.replace(group, endpoints=[group.endpoints[i] for i in owned])
        self.owned = owned
        self.dispatcher = Dispatcher({cfg.rollout: mine, **groups}, run=self.ctx.run)
        self.dispatcher.start()
        # The run's membership, as the driver follows it, for the owned replicas (and the reward
        # role) alone: one that departed with its node leaves the shard's group, one that moved
        # is reached where it runs now.
        log = logs.get_logger("asyncrl.roles.sampling.shard")
        view = functools.partial(
            owned_membership, role=cfg.rollout, owned=owned, keep=tuple(groups)
        )
        self._follow = asyncio.get_running_loop().create_task(
            follow_membership(self.ctx.run_dir, self.dispatcher, log, view)
        )
        self._follow.add_done_callback(functools.partial(followed, log))
        roles = Context(self.dispatcher, run=self.ctx.run, run_dir=self.ctx.run_dir, log=None)
        self.rollout = roles.roles[cfg.rollout]
        score_answers = None
        if score is None:
            reward, timeout = roles.roles[cfg.reward], cfg.timeout_s

            async def score_answers(samples: list[Sample], answers: list[str]) -> list[float]:
                request = ScoreSamples(samples, answers)
                out: list[float] = await reward.call(
                    "score_samples", request, list[float], timeout=timeout
                )
                return out

        self.worker = ShardWorker(
            self.rollout,
            score,
            score_answers=score_answers,
            shard=self.ctx.replica,
            incarnation=self.ctx.incarnation,
        )
        # A shard holds thousands of samples in flight, as a driver does: its collector is set
        # as the driver's (a young collection walking them all took a third of a driver's loop).
        freeze_start_up()

    @endpoint(Delivery.ONCE)
    async def run_group(self, grant: ShardGrant) -> ReleasedGroup:
        """Generate, score and reduce one granted group (``ShardWorker.run_group``).

        Raises:
            ShardEmptyError: every rollout replica this shard owns left the run.
        """
        if not self.rollout.members:
            raise self._empty()
        try:
            return await self.worker.run_group(grant)
        except RoleDeadError as exc:
            if not self.rollout.members:
                raise self._empty() from exc
            raise

    def _empty(self) -> ShardEmptyError:
        owned = self.owned
        return ShardEmptyError(
            f"dispatch shard {self.ctx.replica}: every rollout replica it owns "
            f"({owned.start} to {owned.stop - 1}) left the run"
        )

    @endpoint(Delivery.ONCE)
    async def cancel_group(self, index: int) -> bool:
        """Withdraw group ``index``, which the driver gave up on (``ShardWorker.cancel``)."""
        return self.worker.cancel(index)

    @endpoint(Delivery.LATEST)
    async def sync(self, payload: Any) -> int | None:
        """Have every owned replica load the newest weights; the oldest version they hold
        (None when a replica answers no version)."""
        cfg = self.config
        versions = await self.rollout.broadcast(cfg.weights_method, payload, timeout=cfg.timeout_s)
        if not versions or not all(isinstance(v, int) for v in versions):
            return None
        return min(int(v) for v in versions)

    def status(self) -> dict[str, Any]:
        owned = getattr(self, "owned", range(0))
        worker = getattr(self, "worker", None)
        return {
            "rollout_replicas": [owned.start, owned.stop - 1] if owned else [],
            "groups": dict(worker.served) if worker is not None else {},
        }

    async def teardown(self) -> None:
        follow = getattr(self, "_follow", None)
        if follow is not None:
            follow.cancel()
            await asyncio.gather(follow, return_exceptions=True)
        if hasattr(self, "worker"):
            await self.worker.close()
        if hasattr(self, "dispatcher"):
            await self.dispatcher.close()
