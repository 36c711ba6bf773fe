"""The driver's side of dispatch shards: a sample pipeline whose groups run in shard processes.

``ShardedPipeline`` is a ``SamplePipeline`` (same ``next_batch``, ``advance``, ``resume_state``,
counters and metrics; the RL loop cannot tell them apart) that does not dispatch samples. The
driver keeps what must be one: the ``Pacer`` (η holds exactly as in one driver: its bound is a
sum over samples, and every group is admitted here before it is granted), the ``Admission``
(data cursor, settled indices, resume), the release side (dynamic sampling's cap, staleness,
advantages) and the learner. Each admitted group is *granted* to one dispatch shard
(``asyncrl.roles.sampling.shard``), chosen by its prompt id: the pacer's room is handed out a
group at a time, each grant one prompt index. The shard answers with the group released
(``ReleasedGroup``): one message a group, where one driver handles several a sample.

**The prompt schedule.** Admission is the driver's, so deferral and retirement
(``pipeline.schedule.skip_uniform``, ``retire_after``) run here as in one driver: the schedule
learns from each group's rewards when it is settled (consumed or dropped), from the samples its
release carried, and its state is in the resume state. A probed group is granted in two
stages, so that the drop is decided where one driver decides it, against the driver's state
(the schedule's ``confidence``, the batch's cap on uniform drops): its first grant carries the
probe's size (``ShardGrant.probe``), and the shard generates and scores those samples alone and
answers them (outcome ``probed``); the driver ends the probe (``Admission.end_probe``,
``Release.drop_probe``) and either drops the group, with what one driver counts, or grants the
rest of it: the sample indices after the probe, under the same sample ids, the probe's samples
and rewards carried in the grant (``ShardGrant.scored``) so that the shard's reducer sees the
whole group and answers it whole. Each stage is a grant of its own in the ledger, granted again
on its own when its shard dies or withdraws it; the rest's grant carries the probe's samples,
so a shard that dies between or during the stages leaves nothing the driver lacks, and nothing
is generated or counted twice (counts travel with an accepted answer only). The rest's
straggler deadline is what is left of the group's, which runs from its first grant, as one
driver's runs from its admission.

A shard counts a sample it scores after its group's release (``late_samples``, as one driver
does) in its next answer, whichever group that is (``ReleasedGroup.late``, by group index);
the driver counts it, in the group's own counts too while that is unsettled.

``ShardLedger`` keeps which shard holds which granted group until it is released. A shard that
dies with groups in hand fails every ``run_group`` it held (``BrokenError``; the endpoint is
*once*, so the dispatcher retries nothing itself); each such group is granted again to the same
shard, which the supervisor restarts, and waits in its queue until the new incarnation takes
work. A live shard that has not released a group within the group's budget
(``group_budget_s``) withdraws it (``cancel_group``) and it is granted again. A release is
accepted once per granted group: nothing is lost, nothing counted twice
(``groups_regranted`` counts the grants made again).

The built-in programs build it over the role ``shards`` when the manifest sets
``pipeline.shards`` (``asyncrl.roles.program.rl_loop``). What one driver does that a shard
does not (yet): a custom sample source (an episode runner): shards generate with ``Generate``
or ``GroupCalls``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

import msgspec

from asyncrl.clock import MONOTONIC, Clock
from asyncrl.errors import (
    BrokenError,
    DeadlineExceededError,
    RemoteError,
    RoleDeadError,
    TransportError,
)
from asyncrl.roles.learning.statistics import Moments
from asyncrl.roles.payloads import Sample, SamplingParams
from asyncrl.roles.sampling.contract import BatchSettings, PromptFeed
from asyncrl.roles.sampling.counters import Counters
from asyncrl.roles.sampling.group import Group
from asyncrl.roles.sampling.pacing import PipelineSpec
from asyncrl.roles.sampling.pipeline import INFRA_DROPPED, SamplePipeline
from asyncrl.roles.sampling.reduce import Outcome, Released
from asyncrl.roles.sampling.shard import PROBED, ReleasedGroup, ShardGrant, shard_of

__all__ = ["ShardCaller", "ShardLedger", "ShardedPipeline"]

log = logging.getLogger("asyncrl.pipeline")

_SOON_S = 1e-3
"""The straggler deadline of a probed group's rest whose deadline has passed already (a probe
answered just before it): released at once, with what it has, as one driver would."""


class ShardCaller(Protocol):
    """What the front needs of the shards' handle (``asyncrl.dispatch.handles.Handle``)."""

    @property
    def replicas(self) -> int: ...

    async def call(
        self,
        method: str,
        payload: Any = None,
        reply_type: Any = Any,
        *,
        timeout: float = ...,
        key: Any = None,
        affinity: Any = None,
        replica: int | None = None,
    ) -> Any: ...


class ShardLedger:
    """Which shard holds which granted group, from its grant to its release.

    Args:
        shards: how many dispatch shards there are.

    Attributes:
        held: per shard, the indices of the groups it holds, each with its grants so far.
        gone: the shards that can work no group (every rollout replica they own left the run,
            or the supervisor gave up on them); ``owner`` skips them.
        duplicates: releases refused because the group was not held by the shard that
            released it (released already, withdrawn, or granted elsewhere since).
    """

    def __init__(self, shards: int) -> None:
        if shards < 1:
            raise ValueError(f"shards: expected an int >= 1, got {shards}")
        self.shards = shards
        self.held: list[dict[int, int]] = [{} for _ in range(shards)]
        self.gone: set[int] = set()
        self.duplicates = 0

    def owner(self, prompt_id: str) -> int:
        """The shard a group of ``prompt_id`` is granted to: ``shard_of`` over every shard, or,
        when that one is gone, over the shards left.

        Raises:
            ValueError: every shard is gone.
        """
        shard = shard_of(prompt_id, self.shards)
        if shard not in self.gone:
            return shard
        left = [s for s in range(self.shards) if s not in self.gone]
        if not left:
            raise ValueError(f"every dispatch shard is gone ({self.shards} of {self.shards})")
        return left[shard_of(prompt_id, len(left))]

    def grant(self, index: int, shard: int) -> None:
        """Group ``index`` is granted to ``shard``.

        Raises:
            ValueError: a shard already holds it (a group is granted once until released).
        """
        for s, held in enumerate(self.held):
            if index in held:
                raise ValueError(f"group {index} is granted already, to shard {s}")
        self.held[shard][index] = 1

    def lost(self, index: int, shard: int, to: int | None = None) -> int:
        """``shard`` lost group ``index`` (it died, or withdrew it): it is granted again, to
        ``to`` (the same shard when None); returns how many grants it has had."""
        held = self.held[shard]
        if index not in held:
            raise ValueError(f"shard {shard} does not hold group {index}")
        grants = held.pop(index) + 1
        self.held[shard if to is None else to][index] = grants
        return grants

    def retire(self, shard: int) -> None:
        """``shard`` can work no group: ``owner`` skips it from now on."""
        self.gone.add(shard)

    def release(self, index: int, shard: int) -> bool:
        """``shard`` released group ``index``: True the first time; False (a duplicate,
        counted and ignored) when it is not held there."""
        if self.held[shard].pop(index, None) is None:
            self.duplicates += 1
            return False
        return True

    def holding(self) -> list[int]:
        """How many groups each shard holds."""
        return [len(held) for held in self.held]


def _gone(exc: Exception, shard: int) -> bool:
    """Whether ``exc``, failing a ``run_group`` sent to ``shard``, says the shard can work no
    group: its rollout replicas all left the run (``ShardEmptyError``), or the shard itself is
    dead for good (``RoleDeadError`` naming it; not the run shutting down)."""
    if isinstance(exc, RemoteError):
        return exc.remote_type == "ShardEmptyError"
    return isinstance(exc, RoleDeadError) and exc.replica == shard


async def _scored_in_shards(samples: list[Sample]) -> list[float]:
    raise RuntimeError("a sharded pipeline scores its samples in the dispatch shards")


class ShardedPipeline(SamplePipeline):
    """A ``SamplePipeline`` whose groups are generated, scored and reduced by dispatch shards
    (see the module); use it as the pipeline is used::

        async with ShardedPipeline(ctx.roles["shard"], spec=ctx.pipeline, ...) as pipe:
            batch = await pipe.next_batch()
            ...
            pipe.advance(version)

    Args:
        shards: the dispatch shards' handle (``ctx.roles[<the shard role>]``).
        spec, settings, feed, params, start_version, resume, watchdog, clock: as for
            ``SamplePipeline``.
        timeout: seconds for each of a shard's ``generate`` calls. A group's ``run_group``
            call is given the group's whole budget (``group_budget_s``): its generate calls one
            after another, each replaced once, its straggler deadline and one timeout more.
            A live shard that has not released a group by then is asked to withdraw it
            (``cancel_group``) and the group is granted again; a shard that died fails its
            calls at once (its liveness), and its groups are granted again.
        driver: the driver's incarnation (``ctx.incarnation``), carried in each grant: a
            shard withdraws the groups of older drivers once this one grants to it.

    Attributes:
        ledger: which shard holds which group (``ShardLedger``).
        group_budget_s: the seconds one group's ``run_group`` call is given.

    Raises:
        ValueError: what ``SamplePipeline`` raises.
    """

    def __init__(
        self,
        shards: ShardCaller,
        *,
        spec: PipelineSpec,
        settings: BatchSettings,
        feed: PromptFeed,
        params: SamplingParams,
        start_version: int = 0,
        resume: Mapping[str, Any] | None = None,
        timeout: float = 600.0,
        watchdog: Any = None,
        clock: Clock = MONOTONIC,
        driver: int = 0,
    ) -> None:
        super().__init__(
            shards,
            spec=spec,
            settings=settings,
            feed=feed,
            score=_scored_in_shards,
            params=params,
            start_version=start_version,
            resume=resume,
            timeout=timeout,
            watchdog=watchdog,
            clock=clock,
        )
        self.shards = shards
        self.clock = clock
        self.ledger = ShardLedger(shards.replicas)
        self.params = params
        self.timeout = timeout
        straggler = spec.straggler
        # A group's samples run at once in its shard, but may each wait for the shard's room
        # and the rollout replicas': its budget counts its generate calls one after another,
        # each replaced once, then its straggler deadline, and one timeout more to be queued.
        calls = 1 if spec.group_calls else settings.group_size
        self.group_budget_s = (2 * calls + 1) * timeout + (straggler.deadline_s or 0.0)
        self._grant_fields: dict[str, Any] = {
            "group_size": settings.group_size,
            "params": params,
            "timeout_s": timeout,
            "group_calls": spec.group_calls,
            "affinity": spec.group_affinity,
            "infra_failed": spec.infra_failed,
            "straggler": straggler.policy,
            "deadline_s": straggler.deadline_s or 0.0,
            "k_min": straggler.k_min,
            "driver": driver,
        }

    def _start(self, group: Group) -> None:
        """Grant an admitted group to its shard."""
        self.release.adopt(group)
        task = self._background.spawn(self._grant(group))
        if task is not None:
            group.tasks.append(task)

    async def _grant(self, group: Group) -> None:
        """Grant ``group`` to its shard and take its release; a probed group's probe first,
        then, unless the probe drops it, the rest of it."""
        opened = self.clock.now()
        grant = ShardGrant(
            index=group.index, prompt=group.prompt, probe=group.probe, **self._grant_fields
        )
        answer = await self._run(group, grant)
        if answer is None:
            return
        if answer.outcome == PROBED:
            self._take_counts(group, answer)
            group.samples = {s.k: (s.sample, s.reward) for s in answer.samples}
            if self._probe_drops(group):
                group.tasks.clear()  # settled: the granting task ends here
                return
            deadline_s = grant.deadline_s
            if deadline_s:  # the deadline runs from the group's admission, as in one driver
                deadline_s = max(deadline_s - (self.clock.now() - opened), _SOON_S)
            rest = msgspec.structs.replace(
                grant, probe=0, scored=answer.samples, deadline_s=deadline_s
            )
            answer = await self._run(group, rest)
            if answer is None:
                return
        self._released(group, answer)

    async def _run(self, group: Group, grant: ShardGrant) -> ReleasedGroup | None:
        """Grant ``grant`` to the shard ``group``'s prompt id names, again whenever that shard
        dies holding it or withdraws it; its answer, or None when the ledger refuses it (a
        duplicate: the group is not held there)."""
        shard = self.ledger.owner(group.key)
        self.ledger.grant(group.index, shard)
        while True:
            try:
                answer: ReleasedGroup = await self.shards.call(
                    "run_group", grant, ReleasedGroup, timeout=self.group_budget_s, replica=shard
                )
            except DeadlineExceededError as exc:
                await self._withdraw(group, shard, exc)
                continue
            except BrokenError as exc:
                grants = self.ledger.lost(group.index, shard)
                self.counters.groups_regranted += 1
                log.warning(
                    "sample pipeline: dispatch shard %d died holding group %r (index %d); "
                    "granted again (grant %d): %s",
                    shard,
                    group.key,
                    group.index,
                    grants,
                    exc,
                )
                continue
            except (RemoteError, RoleDeadError) as exc:
                if not _gone(exc, shard):
                    raise
                shard = self._elsewhere(group, shard, exc)
                continue
            self._take_late(answer)
            stage = grant.probe > 0 or answer.outcome != PROBED  # a probe answers a probe
            if answer.index != group.index or answer.shard != shard or not stage:
                # Not this grant's answer: refused, and the group is granted again.
                self.ledger.duplicates += 1
                log.warning(
                    "sample pipeline: dispatch shard %d answered group %r (index %d) with a "
                    "release (%s) of group %d by shard %d; refused, granted again",
                    shard,
                    group.key,
                    group.index,
                    answer.outcome,
                    answer.index,
                    answer.shard,
                )
                self.ledger.lost(group.index, shard)
                self.counters.groups_regranted += 1
                continue
            break
        return answer if self.ledger.release(group.index, shard) else None

    def _elsewhere(self, group: Group, shard: int, exc: Exception) -> int:
        """``shard`` can work no group: it is retired, and ``group`` goes to the shard its
        prompt id names among those left (the error is raised again when none is)."""
        self.ledger.retire(shard)
        try:
            to = self.ledger.owner(group.key)
        except ValueError:
            raise exc from None
        grants = self.ledger.lost(group.index, shard, to)
        self.counters.groups_regranted += 1
        log.warning(
            "sample pipeline: dispatch shard %d can work no group (%s); group %r (index %d) "
            "granted to shard %d (grant %d), and every group its prompt id names shard %d "
            "from now on",
            shard,
            exc,
            group.key,
            group.index,
            to,
            grants,
            shard,
        )
        return to

    async def _withdraw(self, group: Group, shard: int, exc: DeadlineExceededError) -> None:
        """``shard``, alive, did not release ``group`` within its budget: it is withdrawn there
        (its samples cancelled; a shard that cannot be reached holds nothing to cancel) and
        granted again."""
        try:
            await self.shards.call(
                "cancel_group", group.index, bool, timeout=self.timeout, replica=shard
            )
        except (TransportError, RoleDeadError) as cancel_exc:
            log.warning(
                "sample pipeline: dispatch shard %d could not withdraw group %r: %s",
                shard,
                group.key,
                cancel_exc,
            )
        grants = self.ledger.lost(group.index, shard)
        self.counters.groups_regranted += 1
        log.warning(
            "sample pipeline: dispatch shard %d did not release group %r (index %d) within its "
            "budget of %.0f s; withdrawn and granted again (grant %d): %s",
            shard,
            group.key,
            group.index,
            self.group_budget_s,
            grants,
            exc,
        )

    def _take_counts(self, group: Group, answer: ReleasedGroup) -> None:
        """Count what ``answer`` counted for ``group`` (kept in the group's own counts too)."""
        counts = Counters.from_dict(answer.counts)
        self.counters.add(counts)
        group.counts.add(counts)

    def _take_late(self, answer: ReleasedGroup) -> None:
        """Count what a shard's answer carries for samples of groups answered earlier (scored
        after their release), in the group's own counts too while it is unsettled."""
        for index, late in answer.late.items():
            counts = Counters.from_dict(late)
            self.counters.add(counts)
            unsettled = self.admission.unsettled.get(index)
            if unsettled is not None:
                unsettled.counts.add(counts)

    def _released(self, group: Group, answer: ReleasedGroup) -> None:
        """Take a shard's release of ``group``: its counts, its samples, its outcome."""
        group.tasks.clear()  # the granting task ends here: nothing of the group runs on
        self._take_counts(group, answer)
        group.samples = {s.k: (s.sample, s.reward) for s in answer.samples}
        if answer.outcome == INFRA_DROPPED:
            log.warning(
                "sample pipeline: group %r dropped: a sample failed (%s) through no fault of "
                "the policy",
                group.key,
                answer.cause,
            )
            group.outcome = INFRA_DROPPED
            self.counters.groups_infra_dropped += 1
            self.release.waste(group, self.group_size)
            return
        rewards = [r for _, r in group.samples.values()]
        self.release.group_released(
            Released(
                key=group.key,
                moments=Moments.of(rewards),
                parts=frozenset(str(k) for k in group.samples),
                expected=self.group_size,
                outcome=Outcome(answer.outcome),
                waited_s=0.0,
            )
        )

    def describe(self) -> str:
        """What the pipeline waits for now, with the groups each shard holds."""
        return f"{super().describe()}; groups held by each dispatch shard {self.ledger.holding()}"
