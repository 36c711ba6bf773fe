"""Dispatch shards in one process: the ledger, the shard's work, and the sharded pipeline with a
shard killed while it holds groups.

``FakeShards`` stands for the shards' handle: each shard is a real ``ShardWorker`` over a fake
rollout; ``kill`` ends a shard's incarnation as the dispatcher sees a shard's death (every
``run_group`` it held fails with ``BrokenError``) and starts a fresh, empty one.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections import Counter
from typing import Any

import msgspec
import pytest

from asyncrl.clock import FakeClock
from asyncrl.errors import BrokenError, ConfigProblem, DeadlineExceededError, RemoteError
from asyncrl.manifest.membership import MEMBERSHIP_FILE, Membership, Moved
from asyncrl.manifest.pipeline_section import PipelineSpec, ScheduleSpec, StragglerSpec
from asyncrl.manifest.spec import GroupInfo
from asyncrl.role import RoleContext
from asyncrl.roles.payloads import GenerateBatch, Sample, SamplingParams
from asyncrl.roles.sampling.contract import BatchSettings
from asyncrl.roles.sampling.pipeline import INFRA_DROPPED, SamplePipeline
from asyncrl.roles.sampling.shard import (
    PROBED,
    DispatchShard,
    GroupWithdrawnError,
    ReleasedGroup,
    ShardEmptyError,
    ShardGrant,
    ShardWorker,
    owned_membership,
    owned_replicas,
    shard_of,
)
from asyncrl.roles.sampling.sharded import ShardedPipeline, ShardLedger
from asyncrl.transport import run
from tests.sampling.test_pipeline import Feed, prompts, reward_of, score
from tests.sampling.test_pipeline import until as turns_until

G = 4
B = 8
WAIT_S = 20.0


class Rollout:
    """Answers each ``generate`` after the test's gate opens (open from the start unless
    ``gated``); ``fail`` lists sample ids whose first answer is an infra failure."""

    def __init__(self, *, gated: bool = False, fail: tuple[tuple[str, int], ...] = ()) -> None:
        self.gate = asyncio.Event()
        if not gated:
            self.gate.set()
        self.fail = Counter(fail)
        self.calls: list[tuple[str, int]] = []

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **_: Any) -> Any:
        assert method == "generate" and isinstance(payload, GenerateBatch)
        out = []
        for request in payload.requests:
            sid = (request.prompt.id, request.sample_index)
            self.calls.append(sid)
            await self.gate.wait()
            failed = "error" if self.fail[sid] > 0 else ""
            self.fail[sid] -= 1
            out.append(
                Sample(
                    prompt_id=sid[0],
                    sample_index=sid[1],
                    prompt_ids=request.prompt.token_ids,
                    token_ids=[5],
                    logprobs=[-0.5],
                    versions=[0],
                    finished=True,
                    stop_reason="stop",
                    infra_failed=failed,
                )
            )
        return out


class FakeShards:
    """The shards' handle: ``replica`` picks the shard; ``kill`` ends its incarnation;
    ``pass_time`` moves the calls' clock (a call not answered by its deadline fails with
    ``DeadlineExceededError`` while its shard goes on working, as a real shard does)."""

    def __init__(self, count: int, *, gated: bool = False) -> None:
        self.count = count
        self.gated = gated
        self.rollouts = [Rollout(gated=gated) for _ in range(count)]
        self.workers = [ShardWorker(r, score, shard=i) for i, r in enumerate(self.rollouts)]
        self.running: list[set[asyncio.Task[ReleasedGroup]]] = [set() for _ in range(count)]
        self.killed: set[asyncio.Task[ReleasedGroup]] = set()
        self.grants: list[tuple[int, int, int]] = []  # (index, shard, incarnation)
        self.answered: Counter[int] = Counter()  # run_group answers, by group index
        self.withdrawn: list[tuple[int, int, bool]] = []  # cancel_group: (index, shard, held)
        self.timeouts: list[float] = []  # each run_group call's timeout
        self.empty: set[int] = set()  # shards whose rollout replicas all left the run
        self.by_shard: Counter[int] = Counter()  # run_group answers, by the shard answering
        self.now = 0.0
        self._deadlines: list[tuple[float, asyncio.Future[None]]] = []
        self.changed = asyncio.Event()  # set by every call

    @property
    def replicas(self) -> int:
        return self.count

    def pass_time(self, seconds: float) -> None:
        """Move the clock: every call whose deadline has come fails."""
        self.now += seconds
        for deadline, expired in self._deadlines:
            if deadline <= self.now and not expired.done():
                expired.set_result(None)

    async def call(
        self,
        method: str,
        payload: Any = None,
        reply_type: Any = Any,
        *,
        timeout: float = 0.0,
        key: Any = None,
        affinity: Any = None,
        replica: int | None = None,
    ) -> Any:
        assert replica is not None
        worker = self.workers[replica]
        if method == "cancel_group":
            held = worker.cancel(payload)
            self.withdrawn.append((payload, replica, held))
            self.changed.set()
            return held
        assert method == "run_group" and isinstance(payload, ShardGrant)
        self.grants.append((payload.index, replica, worker.incarnation))
        if replica in self.empty:
            raise RemoteError(
                "handler_error",
                f"dispatch shard {replica}: every rollout replica it owns left the run",
                remote_type="ShardEmptyError",
            )
        self.timeouts.append(timeout)
        task = asyncio.get_running_loop().create_task(worker.run_group(payload))
        task.add_done_callback(lambda _: self.changed.set())
        self.running[replica].add(task)
        task.add_done_callback(self.running[replica].discard)
        expired: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (self.now + timeout, expired)
        self._deadlines.append(entry)
        self.changed.set()
        try:
            await asyncio.wait({task, expired}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                answer = await task
                self.answered[answer.index] += 1
                self.by_shard[answer.shard] += 1
                return answer
            raise DeadlineExceededError(f"shard[{replica}]", method, timeout)
        except asyncio.CancelledError:
            if task in self.killed:
                raise BrokenError(f"shard[{replica}] died with the call in flight") from None
            task.cancel()
            raise
        finally:
            self._deadlines.remove(entry)

    def held(self, shard: int) -> int:
        return len(self.running[shard])

    def kill(self, shard: int) -> int:
        """End shard ``shard``'s incarnation; start the next (its rollout open); returns how
        many groups it held."""
        held = list(self.running[shard])
        self.killed.update(held)
        for task in held:
            task.cancel()
        self.rollouts[shard] = Rollout()
        old = self.workers[shard]
        self.workers[shard] = ShardWorker(
            self.rollouts[shard], score, shard=shard, incarnation=old.incarnation + 1
        )
        return len(held)

    async def close(self) -> None:
        """End every shard's work still running (a withdrawn group's, say)."""
        tasks = [t for running in self.running for t in running]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sharded(shards: FakeShards, spec: PipelineSpec, **kwargs: Any) -> ShardedPipeline:
    return ShardedPipeline(
        shards,
        spec=spec,
        settings=BatchSettings(batch_size=B, group_size=G),
        feed=Feed(1000),
        params=SamplingParams(max_new_tokens=1),
        **kwargs,
    )


async def until(shards: FakeShards, condition: Any) -> None:
    async with asyncio.timeout(WAIT_S):
        while not condition():
            shards.changed.clear()
            await shards.changed.wait()


# -- the ledger -----------------------------------------------------------------------------


def test_the_ledger_holds_a_group_until_its_one_release() -> None:
    ledger = ShardLedger(2)
    ledger.grant(7, 1)
    assert ledger.holding() == [0, 1]
    assert ledger.lost(7, 1) == 2  # the second grant of group 7
    assert ledger.release(7, 1) is True
    assert ledger.release(7, 1) is False  # released already: a duplicate, ignored
    assert ledger.duplicates == 1
    assert ledger.holding() == [0, 0]


def test_the_ledger_refuses_a_second_grant_of_a_held_group() -> None:
    ledger = ShardLedger(2)
    ledger.grant(3, 0)
    with pytest.raises(ValueError, match=r"^group 3 is granted already, to shard 0$"):
        ledger.grant(3, 1)
    with pytest.raises(ValueError, match=r"^shard 1 does not hold group 3$"):
        ledger.lost(3, 1)
    with pytest.raises(ValueError, match=r"^shards: expected an int >= 1, got 0$"):
        ShardLedger(0)


def test_shards_split_the_replicas_and_the_prompts() -> None:
    assert [owned_replicas(10, 3, i) for i in range(3)] == [range(0, 3), range(3, 6), range(6, 10)]
    with pytest.raises(ValueError) as err:
        owned_replicas(2, 3, 0)
    assert str(err.value) == (
        "3 dispatch shards need at least as many rollout replicas, got 2: give the shard role "
        "at most 2 replicas"
    )
    owners = Counter(shard_of(f"p{i}", 2) for i in range(1000))
    assert set(owners) == {0, 1} and min(owners.values()) > 400
    assert shard_of("p17", 2) == shard_of("p17", 2)


# -- one shard's work -----------------------------------------------------------------------


def grant(index: int, **kw: Any) -> ShardGrant:
    return ShardGrant(
        index=index,
        prompt=prompts(index + 1)[index],
        group_size=G,
        params=SamplingParams(max_new_tokens=1),
        **kw,
    )


def test_a_shard_releases_a_whole_group_scored() -> None:
    async def main() -> ReleasedGroup:
        return await ShardWorker(Rollout(), score, shard=1, incarnation=2).run_group(grant(3))

    answer = run(main())
    assert (answer.index, answer.shard) == (3, 1)
    assert answer.outcome == "complete"
    assert [s.k for s in answer.samples] == [0, 1, 2, 3]
    assert [s.reward for s in answer.samples] == [reward_of(s.sample) for s in answer.samples]
    assert answer.counts == {"generated_samples": 4, "scored_samples": 4, "scored_tokens": 4}


def test_a_shard_scores_each_sample_against_its_prompts_answer() -> None:
    """``score_answers`` (the reward role's ``score_samples``, as the built-in programs score)
    gets each sample with the answer of the prompt its grant carried."""
    seen: list[tuple[str, int, str]] = []

    async def against(samples: list[Sample], answers: list[str]) -> list[float]:
        seen.extend((s.prompt_id, s.sample_index, a) for s, a in zip(samples, answers, strict=True))
        return [float(a) + s.sample_index / 10 for s, a in zip(samples, answers, strict=True)]

    async def main() -> ReleasedGroup:
        return await ShardWorker(Rollout(), score_answers=against).run_group(grant(3))

    answer = run(main())
    assert sorted(seen) == [("p3", k, "3") for k in range(G)]
    assert [s.reward for s in answer.samples] == [3.0, 3.1, 3.2, 3.3]
    with pytest.raises(ValueError, match=r"^give exactly one of score and score_answers$"):
        ShardWorker(Rollout(), score, score_answers=against)


def test_a_shard_replaces_an_infra_failed_sample_once_then_drops_the_group() -> None:
    async def main(fail: tuple[tuple[str, int], ...]) -> ReleasedGroup:
        return await ShardWorker(Rollout(fail=fail), score).run_group(grant(0))

    once = run(main((("p0", 2),)))
    assert once.outcome == "complete" and len(once.samples) == G
    assert once.counts == {
        "admitted_samples": 1,
        "generated_samples": 5,
        "wasted_samples": 1,
        "wasted_tokens": 1,
        "infra_failed": 1,
        "infra_replaced": 1,
        "infra_failed_error": 1,
        "scored_samples": 4,
        "scored_tokens": 4,
    }
    twice = run(main((("p0", 2), ("p0", 2))))
    assert (twice.outcome, twice.cause) == (INFRA_DROPPED, "error")
    assert twice.counts["infra_failed"] == 2


def test_a_shard_emits_a_group_at_its_deadline_with_the_samples_it_has() -> None:
    """Straggler policy emit: sample 3 never finishes; at the deadline (a fake clock) the
    group is released partial with samples 0 to 2, and the straggler is cancelled."""

    class Stuck(Rollout):
        async def call(self, method: str, payload: Any = None, *a: Any, **kw: Any) -> Any:
            if payload.requests[0].sample_index == 3:
                await asyncio.Event().wait()  # never answers: cancelled at the release
            return await super().call(method, payload, *a, **kw)

    async def main() -> tuple[ReleasedGroup, int]:
        clock = FakeClock()
        scored = 0
        three = asyncio.Event()

        async def counting(samples: list[Sample]) -> list[float]:
            nonlocal scored
            scored += len(samples)
            if scored == 3:
                three.set()
            return await score(samples)

        worker = ShardWorker(Stuck(), counting, clock=clock)
        task = asyncio.get_running_loop().create_task(
            worker.run_group(grant(0, straggler="emit", deadline_s=1.0, k_min=2))
        )
        async with asyncio.timeout(WAIT_S):
            await three.wait()
        await asyncio.sleep(0)  # the third reward reaches the reducer
        clock.advance(1.0)
        async with asyncio.timeout(WAIT_S):
            answer = await task
        return answer, clock.timers

    answer, timers = run(main())
    assert answer.outcome == "partial"
    assert [s.k for s in answer.samples] == [0, 1, 2]
    assert answer.counts == {"generated_samples": 3, "scored_samples": 3, "scored_tokens": 3}
    assert timers == 0  # the deadline's timer is gone with the round


# -- the sharded pipeline -------------------------------------------------------------------


def test_a_sharded_pipeline_hands_out_whole_groups_in_prompt_order() -> None:
    async def main() -> tuple[list[list[tuple[str, int]]], ShardedPipeline, FakeShards]:
        shards = FakeShards(2)
        async with sharded(shards, PipelineSpec(mode="sync")) as pipe:
            batches = []
            for version in range(1, 4):
                batch = await pipe.next_batch()
                batches.append([(s.sample.prompt_id, s.sample.sample_index) for s in batch.samples])
                pipe.advance(version)
        return batches, pipe, shards

    batches, pipe, shards = run(main())
    assert batches == [
        [(f"p{p}", k) for p in (2 * b, 2 * b + 1) for k in range(G)] for b in range(3)
    ]
    # Each group went to the shard its prompt id names, once.
    granted = [(i, s) for i, s, _ in shards.grants]
    assert granted[:6] == [(i, shard_of(f"p{i}", 2)) for i in range(6)]
    assert pipe.metrics["consumed_samples"] == 3 * B
    assert pipe.metrics["generated_samples"] >= 3 * B
    assert pipe.pacer.max_ahead <= 0  # sync mode: one batch at a time


def test_a_shard_killed_holding_groups_loses_and_repeats_nothing() -> None:
    """Shard 0 dies with every group it holds half generated: each is granted again to its
    next incarnation, consumed once, and the counters add up."""

    async def main() -> tuple[list[str], dict[str, int], int, ShardedPipeline, FakeShards]:
        shards = FakeShards(2, gated=True)
        keys: list[str] = []
        async with sharded(shards, PipelineSpec(mode="async", eta=2)) as pipe:
            # The pacer's room (3 batches: p0 to p5) is granted; the rollouts hold every
            # sample. p4 and p5 live in shard 0, the others in shard 1.
            await until(shards, lambda: shards.held(0) + shards.held(1) == 6)
            held = shards.kill(0)
            shards.rollouts[1].gate.set()
            for version in range(1, 6):
                batch = await pipe.next_batch()
                keys += [f"{s.sample.prompt_id} {s.sample.sample_index}" for s in batch.samples]
                pipe.advance(version)
            metrics = dict(pipe.metrics)
            metrics["in_flight"] = pipe.in_flight
        return keys, metrics, held, pipe, shards

    keys, metrics, held, pipe, shards = run(main())
    assert len(keys) == 5 * B and len(set(keys)) == len(keys)  # nothing consumed twice
    # Consumed in prompt order with no gap: no group lost.
    assert sorted({k.split()[0] for k in keys}, key=lambda p: int(p[1:])) == [
        f"p{i}" for i in range(10)
    ]
    assert metrics["groups_regranted"] == held
    # Every release that reached the driver, stale ones included: one a group; the killed
    # incarnation released none.
    consumed = sorted({int(k.split()[0][1:]) for k in keys})
    assert all(shards.answered[i] == 1 for i in consumed)
    assert set(shards.answered) - set(consumed) == {i for i in shards.answered if i >= 10}
    assert pipe.ledger.duplicates == 0
    # The groups shard 0 held were granted again to its next incarnation.
    first = [i for i, s, inc in shards.grants if s == 0 and inc == 0]
    again = [i for i, s, inc in shards.grants if s == 0 and inc == 1]
    assert first == [4, 5] and held == 2
    assert again[:2] == [4, 5]
    # Every admitted sample is consumed, wasted or still in flight; η held throughout.
    assert metrics["admitted_samples"] == metrics["consumed_samples"] + metrics["in_flight"]
    assert pipe.pacer.max_ahead <= 0


def test_a_group_slower_than_one_generate_timeout_is_not_given_up() -> None:
    """Each group waits three generate timeouts for its rollouts (queued behind others, say):
    within its budget, so the driver waits for its live shard, withdraws nothing and grants
    nothing again."""

    async def main() -> tuple[list[str], ShardedPipeline, FakeShards]:
        shards = FakeShards(2, gated=True)
        async with asyncio.timeout(WAIT_S):
            async with sharded(shards, PipelineSpec(mode="sync"), timeout=10.0) as pipe:
                await until(shards, lambda: shards.held(0) + shards.held(1) == 2)
                shards.pass_time(30.0)
                for rollout in shards.rollouts:
                    rollout.gate.set()
                batch = await pipe.next_batch()
                pipe.advance(1)
            await shards.close()
        keys = [f"{s.sample.prompt_id} {s.sample.sample_index}" for s in batch.samples]
        return keys, pipe, shards

    keys, pipe, shards = run(main())
    assert keys == [f"p{p} {k}" for p in (0, 1) for k in range(G)]
    assert pipe.group_budget_s == 90.0  # (2 x 4 generate calls + 1) x 10 s
    assert shards.timeouts[:2] == [90.0, 90.0]
    assert shards.withdrawn == []
    assert pipe.metrics["groups_regranted"] == 0
    assert shards.answered == Counter({0: 1, 1: 1})


def test_a_group_past_its_budget_is_withdrawn_at_its_shard_and_granted_again() -> None:
    """Both groups of a batch outlive their budget in live shards: each is withdrawn at its
    shard (its samples cancelled there), granted again, released once and consumed once."""

    async def main() -> tuple[list[str], ShardedPipeline, FakeShards]:
        shards = FakeShards(2, gated=True)
        async with asyncio.timeout(WAIT_S):
            async with sharded(shards, PipelineSpec(mode="sync"), timeout=10.0) as pipe:
                await until(shards, lambda: shards.held(0) + shards.held(1) == 2)
                shards.pass_time(90.0)
                await until(shards, lambda: len(shards.grants) == 4)
                for rollout in shards.rollouts:
                    rollout.gate.set()
                batch = await pipe.next_batch()
                pipe.advance(1)
            await shards.close()
        keys = [f"{s.sample.prompt_id} {s.sample.sample_index}" for s in batch.samples]
        return keys, pipe, shards

    keys, pipe, shards = run(main())
    assert keys == [f"p{p} {k}" for p in (0, 1) for k in range(G)]
    owners = {i: shard_of(f"p{i}", 2) for i in (0, 1)}
    assert sorted(shards.withdrawn) == [(0, owners[0], True), (1, owners[1], True)]
    assert sum(w.served["withdrawn"] for w in shards.workers) == 2
    assert sorted(i for i, _, _ in shards.grants[:4]) == [0, 0, 1, 1]
    assert shards.answered == Counter({0: 1, 1: 1})  # each released once, by its second grant
    assert pipe.metrics["groups_regranted"] == 2
    assert pipe.ledger.holding() == [0, 0]


def test_a_scorer_returning_the_wrong_number_of_rewards_fails_the_group() -> None:
    """The scorer's error fails the group's call at once, named; no task is left behind."""

    async def short(samples: list[Sample]) -> list[float]:
        return (await score(samples))[:-1]

    async def main() -> tuple[str, ShardWorker]:
        worker = ShardWorker(Rollout(), short)
        async with asyncio.timeout(WAIT_S):
            with pytest.raises(ValueError) as err:
                await worker.run_group(grant(0))
            await worker.close()
        return str(err.value), worker

    message, worker = run(main())
    assert message == (
        "the scorer tests.sampling.test_shards:test_a_scorer_returning_the_wrong_number_of_"
        "rewards_fails_the_group.<locals>.short returned 3 rewards for 4 samples: it must "
        "return one reward per sample, in order"
    )
    task = worker._scoring._task
    assert task is not None and task.done() and task.exception() is None
    assert worker._runs == {}


def test_the_ledger_routes_around_a_shard_that_is_gone() -> None:
    ledger = ShardLedger(3)
    ids = [f"p{i}" for i in range(60)]
    natural = {p: shard_of(p, 3) for p in ids}
    ledger.retire(1)
    for p in ids:
        owner = ledger.owner(p)
        assert owner == natural[p] if natural[p] != 1 else owner in (0, 2)
    assert {ledger.owner(p) for p in ids if natural[p] == 1} == {0, 2}
    ledger.grant(4, 1)
    assert ledger.lost(4, 1, to=2) == 2 and ledger.holding() == [0, 0, 1]
    ledger.retire(0)
    ledger.retire(2)
    with pytest.raises(ValueError, match=r"^every dispatch shard is gone \(3 of 3\)$"):
        ledger.owner("p0")


def test_a_shard_whose_rollout_replicas_all_left_hands_its_groups_to_the_others() -> None:
    """Shard 0's rollout replicas all departed with their node: each group its prompt id
    names is granted to shard 1 instead, and the run goes on, every group consumed once."""

    async def main() -> tuple[list[str], ShardedPipeline, FakeShards]:
        shards = FakeShards(2)
        shards.empty.add(0)
        keys: list[str] = []
        async with asyncio.timeout(WAIT_S):
            async with sharded(shards, PipelineSpec(mode="sync")) as pipe:
                for version in range(1, 4):
                    batch = await pipe.next_batch()
                    keys += [f"{s.sample.prompt_id} {s.sample.sample_index}" for s in batch.samples]
                    pipe.advance(version)
            await shards.close()
        return keys, pipe, shards

    keys, pipe, shards = run(main())
    assert keys == [f"p{p} {k}" for p in range(6) for k in range(G)]
    assert pipe.ledger.gone == {0}
    assert set(shards.by_shard) == {1}  # every release came from shard 1
    assert all(shards.answered[i] == 1 for i in range(6))
    # Only the first group shard 0 was named for went there; it was granted again to shard 1.
    to_zero = [i for i, s, _ in shards.grants if s == 0]
    assert len(to_zero) == 1 and shard_of(f"p{to_zero[0]}", 2) == 0
    assert pipe.metrics["groups_regranted"] == 1


def test_a_release_of_another_group_is_refused_and_the_group_granted_again() -> None:
    """A shard answers a grant with another group's release (a stale or misrouted answer):
    the driver refuses it, counts it, and grants its group again."""

    async def main() -> tuple[list[str], ShardedPipeline]:
        shards = FakeShards(1)
        wrong = {"left": 1}
        real = shards.workers[0].run_group

        async def misanswering(grant: ShardGrant) -> ReleasedGroup:
            answer = await real(grant)
            if wrong["left"]:
                wrong["left"] -= 1
                return msgspec.structs.replace(answer, index=answer.index + 100)
            return answer

        shards.workers[0].run_group = misanswering  # type: ignore[method-assign]
        async with asyncio.timeout(WAIT_S):
            async with sharded(shards, PipelineSpec(mode="sync")) as pipe:
                batch = await pipe.next_batch()
                pipe.advance(1)
            await shards.close()
        return [f"{s.sample.prompt_id} {s.sample.sample_index}" for s in batch.samples], pipe

    keys, pipe = run(main())
    assert keys == [f"p{p} {k}" for p in (0, 1) for k in range(G)]
    assert pipe.ledger.duplicates == 1
    assert pipe.metrics["groups_regranted"] == 1


def test_owned_membership_is_the_shards_own_replicas_numbered_from_zero() -> None:
    membership = Membership(
        departed={"rollout": {1: 0, 5: 2}, "learner": {0: 2}},
        moved={"rollout": {4: Moved(node=1, endpoint="tcp://b:1")}},
    )
    mine = owned_membership(membership, "rollout", range(4, 8))
    assert mine.departed == {"rollout": {1: 2}}
    assert mine.moved == {"rollout": {0: Moved(node=1, endpoint="tcp://b:1")}}
    # The reward role a shard calls is followed as it is, under its own numbers.
    kept = owned_membership(
        msgspec.structs.replace(membership, moved={"reward": {0: Moved(node=1, endpoint="x")}}),
        "rollout",
        range(4, 8),
        keep=("reward",),
    )
    assert kept.departed == {"rollout": {1: 2}}
    assert kept.moved == {"reward": {0: Moved(node=1, endpoint="x")}, "rollout": {}}


def test_a_shard_follows_its_nodes_membership() -> None:
    """Shard 1 of 2 owns rollout replicas 2 and 3; membership.json says 3 departed, then 2:
    its dispatcher drops each, and with none left a grant fails naming why."""

    async def main(run_dir: str) -> tuple[list[list[int]], str]:
        four = {"rollout": GroupInfo([f"ipc:///nowhere/{i}" for i in range(4)])}
        ctx = RoleContext.local(
            {"score": "tests.sampling.test_pipeline:score"},
            name="shard",
            replica=1,
            replicas=2,
            capacity=2,
            groups=four,
            run_dir=run_dir,
        )
        role = DispatchShard(ctx)
        await role.setup()
        applied = asyncio.Event()
        apply = role.dispatcher.apply

        async def applying(membership: Membership) -> list[str]:
            changed = await apply(membership)
            applied.set()
            return changed

        role.dispatcher.apply = applying  # type: ignore[method-assign]
        seen = [list(role.rollout.members)]
        try:
            for departed in ({3: 1}, {3: 1, 2: 1}):
                applied.clear()
                with open(os.path.join(run_dir, MEMBERSHIP_FILE), "wb") as f:
                    f.write(msgspec.json.encode(Membership(departed={"rollout": departed})))
                async with asyncio.timeout(WAIT_S):
                    await applied.wait()
                seen.append(list(role.rollout.members))
            with pytest.raises(ShardEmptyError) as err:
                await role.run_group(grant(0))
        finally:
            await role.teardown()
        return seen, str(err.value)

    with tempfile.TemporaryDirectory() as run_dir:
        seen, message = run(main(run_dir))
    assert seen == [[0, 1], [0], []]
    assert message == "dispatch shard 1: every rollout replica it owns (2 to 3) left the run"


# -- the prompt schedule's probes ------------------------------------------------------------


async def mostly_uniform(samples: list[Sample]) -> list[float]:
    """Uniform groups (every sample right) but for prompts 1, 5, 9, ...: mixed ones."""
    return [reward_of(s) if int(s.prompt_id[1:]) % 4 == 1 else 1.0 for s in samples]


PROBE = 2


class RestGated(Rollout):
    """Answers the first ``PROBE`` samples of a group at once, the others once ``rests`` is
    set."""

    def __init__(self) -> None:
        super().__init__()
        self.rests = asyncio.Event()

    async def call(self, method: str, payload: Any = None, *a: Any, **kw: Any) -> Any:
        if payload.requests[0].sample_index >= PROBE:
            await self.rests.wait()
        return await super().call(method, payload, *a, **kw)


def test_a_shard_answers_a_probe_then_generates_only_the_rest() -> None:
    """A grant with a probe of 2 is answered with samples 0 and 1 (``probed``); the grant of
    the rest carries them, and only samples 2 and 3 are generated and counted."""

    async def main() -> tuple[ReleasedGroup, ReleasedGroup, Rollout]:
        rollout = Rollout()
        worker = ShardWorker(rollout, score)
        probe = await worker.run_group(grant(3, probe=PROBE))
        rest = await worker.run_group(grant(3, scored=probe.samples))
        return probe, rest, rollout

    probe, rest, rollout = run(main())
    assert probe.outcome == PROBED
    assert [s.k for s in probe.samples] == [0, 1]
    assert probe.counts == {"generated_samples": 2, "scored_samples": 2, "scored_tokens": 2}
    assert rest.outcome == "complete"
    assert [s.k for s in rest.samples] == [0, 1, 2, 3]
    assert rest.samples[:2] == probe.samples
    assert [s.reward for s in rest.samples] == [reward_of(s.sample) for s in rest.samples]
    assert rest.counts == {"generated_samples": 2, "scored_samples": 2, "scored_tokens": 2}
    assert rollout.calls == [("p3", k) for k in range(G)]


def one_driver(spec: PipelineSpec, batches: int) -> tuple[list[str], Counter[str]]:
    """The batches and counters of one driver's ``SamplePipeline`` at ``sharded``'s settings,
    scored by ``mostly_uniform``."""

    async def main() -> tuple[list[str], Counter[str]]:
        pipe = SamplePipeline(
            Rollout(),
            spec=spec,
            settings=BatchSettings(batch_size=B, group_size=G),
            feed=Feed(1000),
            score=mostly_uniform,
            params=SamplingParams(max_new_tokens=1),
        )
        async with asyncio.timeout(WAIT_S), pipe:
            keys = await consume(pipe, batches)
        return keys, pipe.metrics

    return run(main())


async def consume(pipe: SamplePipeline, batches: int) -> list[str]:
    """The sample ids of ``batches`` batches, in order, the learner's version moving on
    between them (not after the last: in sync mode nothing more is admitted)."""
    keys: list[str] = []
    for version in range(batches):
        if version:
            pipe.advance(version)
        batch = await pipe.next_batch()
        keys += [f"{s.sample.prompt_id} {s.sample.sample_index}" for s in batch.samples]
    return keys


PROBED_SPEC = PipelineSpec(
    mode="sync", drop_uniform=True, uniform_drops_per_group=1, schedule=ScheduleSpec(probe=PROBE)
)


def scoring_mostly_uniform(shards: FakeShards) -> FakeShards:
    """``shards`` with each worker scoring by ``mostly_uniform``."""
    for i, worker in enumerate(shards.workers):
        shards.workers[i] = ShardWorker(worker.rollout, mostly_uniform, shard=i)
    return shards


def recording_rests(shards: FakeShards) -> list[ShardGrant]:
    """The grants of probed groups' rests (``ShardGrant.scored``) made to ``shards`` from now
    on, in order."""
    real = shards.call
    rests: list[ShardGrant] = []

    async def call(method: str, payload: Any = None, *a: Any, **kw: Any) -> Any:
        if method == "run_group" and payload.scored:
            rests.append(payload)
        return await real(method, payload, *a, **kw)

    shards.call = call  # type: ignore[method-assign]
    return rests


def test_a_sharded_pipeline_drops_a_group_after_its_probe_as_one_driver_does() -> None:
    """Probes of 2 of 4, three prompts in four uniform, two uniform drops a batch: the driver
    drops a group whose probe agrees while the batch may, and grants the rest of the others;
    the batches and every count are one driver's."""

    async def main() -> tuple[list[str], Counter[str], FakeShards]:
        shards = scoring_mostly_uniform(FakeShards(2))
        async with asyncio.timeout(WAIT_S), sharded(shards, PROBED_SPEC) as pipe:
            keys = await consume(pipe, 4)
        return keys, pipe.metrics, shards

    keys, metrics, shards = run(main())
    alone_keys, alone = one_driver(PROBED_SPEC, 4)
    assert keys == alone_keys
    assert {k: v for k, v in metrics.items() if k != "scored_tokens"} == alone
    assert metrics["groups_probe_dropped"] > 0 and metrics["groups_uniform_kept"] > 0
    # Every group's probe (samples 0 and 1) was generated once, and the rest (2 and 3) only
    # for a group kept after its probe.
    calls = Counter(sid for rollout in shards.rollouts for sid in rollout.calls)
    assert set(calls.values()) == {1}
    probed = {p for p, k in calls if k < PROBE}
    rested = {p for p, k in calls if k >= PROBE}
    assert len(probed) == metrics["probed_groups"] == metrics["admitted_groups"]
    assert len(probed - rested) == metrics["groups_probe_dropped"]


def test_a_shard_killed_holding_probes_or_rests_loses_and_counts_nothing_twice() -> None:
    """The shard of p0 to p3 dies first with the probes of p0 and p1 in hand, then (its next
    incarnation) with the rests of p1 and p3, kept after their probe: each is granted again,
    a rest with its probe's samples, which are not generated again; the batches and every count
    are one driver's."""
    victim = shard_of("p0", 2)

    async def main() -> tuple[list[str], Counter[str], FakeShards, list[ShardGrant]]:
        shards = scoring_mostly_uniform(FakeShards(2, gated=True))
        rests = recording_rests(shards)
        async with asyncio.timeout(WAIT_S), sharded(shards, PROBED_SPEC) as pipe:
            await until(shards, lambda: shards.held(victim) == 2)
            assert shards.kill(victim) == 2  # the probes of p0 and p1, ungenerated
            shards.rollouts[victim] = RestGated()
            shards.workers[victim] = ShardWorker(
                shards.rollouts[victim], mostly_uniform, shard=victim, incarnation=1
            )
            await until(shards, lambda: len(rests) == 2 and shards.held(victim) == 2)
            assert shards.kill(victim) == 2  # the rests of p1 and p3
            shards.workers[victim] = ShardWorker(
                shards.rollouts[victim], mostly_uniform, shard=victim, incarnation=2
            )
            shards.rollouts[1 - victim].gate.set()
            keys = await consume(pipe, 3)
        return keys, pipe.metrics, shards, rests

    keys, metrics, shards, rests = run(main())
    alone_keys, alone = one_driver(PROBED_SPEC, 3)
    assert keys == alone_keys
    assert metrics["groups_regranted"] == 4  # two probes, two rests
    assert {k: v for k, v in metrics.items() if k not in ("scored_tokens", "groups_regranted")} == (
        alone
    )
    assert sorted(g.index for g in rests[:4]) == [1, 1, 3, 3]  # granted, then again
    # A rest granted again carries its probe's samples; only the rest is generated.
    assert all([s.k for s in g.scored] == list(range(PROBE)) for g in rests)
    assert sorted(shards.rollouts[victim].calls)[:4] == [("p1", 2), ("p1", 3), ("p3", 2), ("p3", 3)]
    assert all(k >= PROBE for p, k in shards.rollouts[victim].calls if p in ("p1", "p3"))


def test_a_rest_past_its_budget_is_withdrawn_and_granted_again_with_its_probe() -> None:
    """The rests of p1 and p3 outlive their budget in their live shard: each is withdrawn
    there and granted again with its probe's samples; the batch and every count are one
    driver's."""
    victim = shard_of("p0", 2)

    async def main() -> tuple[list[str], Counter[str], FakeShards, list[ShardGrant]]:
        shards = FakeShards(2)
        gated = [RestGated(), RestGated()]
        shards.rollouts = list(gated)
        shards.workers = [ShardWorker(r, score, shard=i) for i, r in enumerate(gated)]
        scoring_mostly_uniform(shards)
        rests = recording_rests(shards)
        async with (
            asyncio.timeout(WAIT_S),
            sharded(shards, PROBED_SPEC, timeout=10.0) as pipe,
        ):
            await until(shards, lambda: len(rests) == 2 and shards.held(victim) == 2)
            shards.pass_time(90.0)
            await until(shards, lambda: len(rests) == 4)
            gated[victim].rests.set()
            keys = await consume(pipe, 1)
        await shards.close()
        return keys, pipe.metrics, shards, rests

    keys, metrics, shards, rests = run(main())
    alone_keys, alone = one_driver(PROBED_SPEC, 1)
    assert keys == alone_keys
    assert sorted(shards.withdrawn) == [(1, victim, True), (3, victim, True)]
    assert metrics["groups_regranted"] == 2
    assert {k: v for k, v in metrics.items() if k not in ("scored_tokens", "groups_regranted")} == (
        alone
    )
    assert sorted(g.index for g in rests) == [1, 1, 3, 3]
    assert all([s.k for s in g.scored] == list(range(PROBE)) for g in rests)


def test_a_probes_release_answering_a_grant_of_no_probe_is_refused() -> None:
    """A shard answers the rest's grant with a probe's release (a stale answer): the driver
    refuses it and grants the rest again."""

    async def main() -> tuple[list[str], ShardedPipeline]:
        shards = scoring_mostly_uniform(FakeShards(1))
        real = shards.workers[0].run_group
        wrong = {"left": 1}

        async def misanswering(grant: ShardGrant) -> ReleasedGroup:
            answer = await real(grant)
            if grant.scored and wrong["left"]:
                wrong["left"] -= 1
                return msgspec.structs.replace(answer, outcome=PROBED)
            return answer

        shards.workers[0].run_group = misanswering  # type: ignore[method-assign]
        async with asyncio.timeout(WAIT_S), sharded(shards, PROBED_SPEC) as pipe:
            keys = await consume(pipe, 1)
        return keys, pipe

    keys, pipe = run(main())
    assert keys == one_driver(PROBED_SPEC, 1)[0]
    assert pipe.ledger.duplicates == 1
    assert pipe.metrics["groups_regranted"] == 1


def test_the_rest_of_a_probed_group_keeps_the_deadline_it_was_admitted_with() -> None:
    """Straggler deadline 10 s: a probe answered 4 s after its group's grant (the driver's
    clock) leaves its rest 6 s, as one driver's deadline runs from the group's admission; a
    group granted after those 4 s has its 10 s."""

    async def main() -> list[ShardGrant]:
        clock = FakeClock()
        shards = scoring_mostly_uniform(FakeShards(2, gated=True))
        rests = recording_rests(shards)
        spec = msgspec.structs.replace(
            PROBED_SPEC, straggler=StragglerSpec(policy="emit", deadline_s=10.0, k_min=1)
        )
        async with asyncio.timeout(WAIT_S), sharded(shards, spec, clock=clock) as pipe:
            await until(shards, lambda: shards.held(0) + shards.held(1) == 2)
            clock.advance(4.0)
            for rollout in shards.rollouts:
                rollout.gate.set()
            await consume(pipe, 1)
        return rests

    rests = {g.index: g.deadline_s for g in run(main())}
    assert rests[1] == 6.0  # p1, granted before the 4 s passed
    assert rests[3] == 10.0  # p3, granted after (in the room p0 and p2 left)


# -- late samples ----------------------------------------------------------------------------


def test_a_sample_scored_after_its_groups_release_is_counted_in_the_shards_next_answer() -> None:
    """Emit policy: group 0 is released at its deadline with samples 0 to 2 while sample 3 is
    out to the scorer. The sample is scored all the same, as one driver scores it, and its
    counts (late, scored) ride on the shard's next answer, of group 1, once."""

    class ThreeLast(Rollout):
        async def call(self, method: str, payload: Any = None, *a: Any, **kw: Any) -> Any:
            if payload.requests[0].sample_index == 3:
                await three_out.wait()
            return await super().call(method, payload, *a, **kw)

    three_out = asyncio.Event()  # sample 3 may be generated
    at_scorer = asyncio.Event()  # ... and is out to the scorer
    scored_late = asyncio.Event()  # the scorer may answer for it

    async def holding(samples: list[Sample]) -> list[float]:
        if any(s.sample_index == 3 and s.prompt_id == "p0" for s in samples):
            at_scorer.set()
            await scored_late.wait()
        elif samples[0].prompt_id == "p0":
            three_out.set()  # once samples 0 to 2 are scored
        return await score(samples)

    async def main() -> tuple[ReleasedGroup, ReleasedGroup, ReleasedGroup]:
        clock = FakeClock()
        worker = ShardWorker(ThreeLast(), holding, clock=clock)
        task = asyncio.get_running_loop().create_task(
            worker.run_group(grant(0, straggler="emit", deadline_s=1.0, k_min=2))
        )
        async with asyncio.timeout(WAIT_S):
            await at_scorer.wait()
            await turns_until(lambda: len(worker._runs[0].samples) == 3)  # 0 to 2 in the round
            clock.advance(1.0)
            released = await task
            scored_late.set()
            await asyncio.gather(*worker._stragglers)
            after = await worker.run_group(grant(1))
            again = await worker.run_group(grant(2))
        return released, after, again

    released, after, again = run(main())
    assert released.outcome == "partial" and [s.k for s in released.samples] == [0, 1, 2]
    assert released.counts == {"generated_samples": 4, "scored_samples": 3, "scored_tokens": 3}
    assert released.late == {}
    assert after.late == {0: {"scored_samples": 1, "late_samples": 1, "scored_tokens": 1}}
    assert again.late == {}


def test_a_sharded_pipeline_counts_the_late_samples_an_answer_carries() -> None:
    """Group 5's answer carries a late sample of group 0 (consumed in the first batch) and one
    of group 4 (released, not consumed): both are counted, group 4's in its own counts too, so
    a resume state leaves it out with the group, which a resumed run generates again."""

    async def main() -> tuple[Counter[str], dict[str, int], int]:
        shards = FakeShards(1)
        real = shards.workers[0].run_group
        late = {"late_samples": 1, "scored_samples": 1}

        async def carrying(grant: ShardGrant) -> ReleasedGroup:
            answer = await real(grant)
            if grant.index == 5:
                answer = msgspec.structs.replace(answer, late={0: late, 4: late})
            return answer

        shards.workers[0].run_group = carrying  # type: ignore[method-assign]
        spec = PipelineSpec(mode="async", eta=2)
        async with asyncio.timeout(WAIT_S), sharded(shards, spec) as pipe:
            await consume(pipe, 1)
            await turns_until(lambda: pipe.metrics["late_samples"] == 2)  # group 5's answer
            unsettled = pipe.admission.unsettled[4].counts.late_samples
            resume = pipe.resume_state()["pipeline"]
        return pipe.metrics, resume, unsettled

    metrics, resume, unsettled = run(main())
    assert metrics["late_samples"] == 2
    assert unsettled == 1
    assert resume["late_samples"] == 1  # group 0's; group 4's goes with the group


# -- the shard role's configuration -----------------------------------------------------------


def shard_role(
    replicas: int, groups: dict[str, GroupInfo], capacity: int = 1, **config: Any
) -> DispatchShard:
    config = {"score": "tests.sampling.test_pipeline:score", **config}
    ctx = RoleContext.local(
        config, name="shard", replicas=replicas, groups=groups, capacity=capacity
    )
    return DispatchShard(ctx)


def setup_error(role: DispatchShard) -> str:
    with pytest.raises(ConfigProblem) as err:
        run(role.setup())
    return str(err.value)


def test_a_shard_names_what_is_wrong_with_its_configuration() -> None:
    two = {"rollout": GroupInfo(["ipc:///nowhere/a", "ipc:///nowhere/b"])}
    assert setup_error(shard_role(2, two, rollout="actor")) == (
        "roles.shard.config.rollout: the run has no role 'actor' (roles: rollout); name the "
        "rollout role whose replicas the shards own"
    )
    assert setup_error(shard_role(3, two)) == (
        "roles.shard.replicas: 3 dispatch shards need at least as many replicas of "
        "roles.rollout, which has 2: set pipeline.shards (or roles.shard.replicas) to at most "
        "2, or roles.rollout.replicas to at least 3"
    )
    # No score function: the reward role scores, and the run must have it.
    assert setup_error(shard_role(2, two, score="")) == (
        "roles.shard.config.reward: the run has no role 'reward' (roles: rollout); name the "
        "reward role that scores the samples, or give roles.shard.config.score"
    )
    four = {"rollout": GroupInfo([f"ipc:///nowhere/{i}" for i in range(4)])}
    assert setup_error(shard_role(2, four)) == (
        "roles.shard.capacity: 1 is fewer than the 2 rollout replicas shard 0 owns (a shard's "
        "capacity is the groups it works on at once: fewer would idle them); set it to the "
        "groups in flight, about (eta + 1) * "
        "batch_size / group_size / 2 (docs/scaling.md)"
    )
    assert setup_error(shard_role(2, two, score="no_colon")) == (
        "roles.shard.config.score: expected 'module:function', got 'no_colon'"
    )
    message = setup_error(shard_role(2, two, score="tests.sampling.test_pipeline:nothing"))
    assert message.startswith(
        "roles.shard.config.score: 'tests.sampling.test_pipeline:nothing' cannot be imported: "
    )
    with pytest.raises(ConfigProblem, match=r"roles\.shard\.config"):
        shard_role(2, two, scores="x")  # a misspelt key is refused by the role's Config


def test_a_newer_drivers_grant_withdraws_the_groups_older_drivers_granted() -> None:
    """A restarted driver grants its groups again; what the dead one granted stops at once
    (its samples cancelled) rather than running on for nobody, and a late grant of the dead
    driver is refused."""
    generating = asyncio.Event()  # both groups' samples are generating

    class Counted(Rollout):
        async def call(self, method: str, payload: Any = None, *a: Any, **kw: Any) -> Any:
            if len(self.calls) + 1 == 2 * G:
                generating.set()
            return await super().call(method, payload, *a, **kw)

    rollout = Counted(gated=True)
    worker = ShardWorker(rollout, score)

    async def main() -> tuple[list[BaseException | ReleasedGroup], ReleasedGroup, str]:
        old = [asyncio.ensure_future(worker.run_group(grant(i))) for i in (0, 1)]
        async with asyncio.timeout(WAIT_S):
            await generating.wait()
        new = asyncio.ensure_future(worker.run_group(grant(1, driver=1)))
        withdrawn = await asyncio.gather(*old, return_exceptions=True)
        rollout.gate.set()
        with pytest.raises(GroupWithdrawnError) as refused:
            await worker.run_group(grant(2))
        return withdrawn, await new, str(refused.value)

    withdrawn, answer, refused = run(main())
    assert [str(e) for e in withdrawn] == [
        "group 0 was granted by driver incarnation 0, which incarnation 1 replaced",
        "group 1 was granted by driver incarnation 0, which incarnation 1 replaced",
    ]
    assert all(isinstance(e, GroupWithdrawnError) for e in withdrawn)
    assert refused == "group 2 was granted by driver incarnation 0, which incarnation 1 replaced"
    assert (answer.index, answer.outcome, len(answer.samples)) == (1, "complete", G)
    assert worker.served == {"withdrawn": 2, "complete": 1}
    assert worker.driver == 1
