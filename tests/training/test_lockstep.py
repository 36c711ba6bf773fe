"""The order of a group's calls (``asyncrl.roles.training.lockstep``), the learner's and the
critic's, in one process: two ranks of a fake group whose broadcast is a queue, the call types it
accepts, and where ``LearnerClient`` and ``CriticClient`` send their calls."""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import msgpack
import msgspec
import pytest

from asyncrl.errors import ClosedError
from asyncrl.roles.payloads import (
    CriticStepResult,
    LearnerStatus,
    ProgramState,
    Sample,
    Scored,
    StepResult,
    TrainBatch,
)
from asyncrl.roles.program.clients import CriticClient, LearnerClient
from asyncrl.roles.training import learner
from asyncrl.roles.training.critic import TrainStep, Values
from asyncrl.roles.training.data_parallel import DataParallelError
from asyncrl.roles.training.lead_refusal import refused_as_follower
from asyncrl.roles.training.lockstep import Close, Idle, Lockstep, NotLeaderError

CriticCall = Values | TrainStep
CALLS = (Values, TrainStep)


def codec() -> Lockstep:
    """A rank of a critic's group, for its ``encode`` and ``decode`` only."""
    return Lockstep(
        cast(Any, FakeRank(Wire(), 0)), CALLS, lambda c: None, on_broken=print, client="C"
    )


def encode(call: Any) -> bytes:
    return codec().encode(call)


def decode(data: bytes) -> Any:
    return codec().decode(data)


def sample(pid: str, n: int) -> Sample:
    return Sample(
        prompt_id=pid,
        sample_index=0,
        prompt_ids=[2, 3],
        token_ids=[4] * n,
        logprobs=[0.0] * n,
        versions=[0] * n,
        finished=True,
        stop_reason="stop",
    )


@dataclass
class Wire:
    """The fake group's links: a queue into each follower; ``received`` counts the messages
    a follower took, and ``heard`` is set once it took ``enough`` of them."""

    world: int = 2
    queues: list[queue.Queue[bytes]] = field(default_factory=list)
    received: int = 0
    enough: int = 0
    heard: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.queues = [queue.Queue() for _ in range(self.world)]


@dataclass
class FakeRank:
    """One rank of a group of two as ``Lockstep`` uses it (``DataParallel``'s broadcast and
    its ``broken`` state): the source's bytes go into the other rank's queue, which waits for
    them at most ``timeout_s``."""

    wire: Wire
    rank: int
    timeout_s: float = 30.0
    name: str = "critic"
    world: int = 2
    broken: str = ""

    def broadcast_bytes(self, what: str, data: bytes = b"", src: int = 0) -> bytes:
        if self.broken:
            raise DataParallelError(f"critic: rank {self.rank}: broke earlier ({self.broken})")
        if self.rank == src:
            for rank, link in enumerate(self.wire.queues):
                if rank != src:
                    link.put(data)
            return data
        try:
            data = self.wire.queues[self.rank].get(timeout=self.timeout_s)
        except queue.Empty:
            self.broken = f"rank {self.rank}: {what} failed (nothing in {self.timeout_s:g} s)"
            raise DataParallelError(f"critic: {self.broken}") from None
        self.wire.received += 1
        if self.wire.enough and self.wire.received >= self.wire.enough:
            self.wire.heard.set()
        return data


class Recorder:
    """A rank's ``run``: records each call and checks that no two overlap."""

    def __init__(self, fail_on: str = "") -> None:
        self.calls: list[bytes] = []
        self.fail_on = fail_on
        self.active = 0
        self.overlapped = False

    def __call__(self, call: CriticCall) -> Any:
        self.active += 1
        self.overlapped |= self.active > 1
        # A millisecond's work: calls that were not kept apart would meet in it.
        threading.Event().wait(0.001)
        try:
            self.calls.append(encode(call))
            if (
                isinstance(call, TrainStep)
                and call.batch
                and call.batch[0].sample.prompt_id == (self.fail_on)
            ):
                raise RuntimeError(f"no step on {self.fail_on}")
            if isinstance(call, Values):
                return [[float(len(s.token_ids))] for s in call.samples]
            return len(self.calls)
        finally:
            self.active -= 1


class Broken:
    """An ``on_broken`` that keeps what it was told."""

    def __init__(self) -> None:
        self.told: list[DataParallelError] = []
        self.event = threading.Event()

    def __call__(self, exc: DataParallelError) -> None:
        self.told.append(exc)
        self.event.set()


def group(
    *, timeout_s: float = 30.0, idle_s: float | None = None, fail_on: str = ""
) -> tuple[Wire, list[Lockstep], list[Recorder], list[Broken]]:
    wire = Wire()
    runs = [Recorder(fail_on), Recorder(fail_on)]
    broken = [Broken(), Broken()]
    steps = [
        Lockstep(
            cast(Any, FakeRank(wire, rank, timeout_s)),
            CALLS,
            runs[rank],
            on_broken=broken[rank],
            client="CriticClient",
            idle_s=idle_s,
        )
        for rank in range(2)
    ]
    for step in steps:
        step.start()
    return wire, steps, runs, broken


def test_a_follower_of_a_shrunk_group_names_its_lead_the_lowest_replica_left() -> None:
    """A group that went on at a smaller size with replicas 1 and 2 (node 0's loss took replica
    0 out): replica 2, its rank 1, refuses a call and names replica 1, the lead."""
    wire = Wire()
    follower = Lockstep(
        cast(Any, FakeRank(wire, 1)),
        CALLS,
        Recorder(""),
        on_broken=Broken(),
        client="CriticClient",
        members=[1, 2],
    )
    with pytest.raises(ValueError) as caught:
        follower.check_leader("values")
    assert str(caught.value) == (
        "critic.2: a critic with 2 replicas runs every call on all of them in the order "
        "replica 1 (its lead) sets; send values to replica 1 (CriticClient does: "
        "Handle.call(..., replica=1))"
    )


def test_followers_run_the_leaders_concurrent_calls_in_its_order() -> None:
    _, (leader, follower), runs, broken = group()
    calls: list[CriticCall] = []
    for i in range(12):
        if i % 3 == 2:
            calls.append(TrainStep([Scored(sample=sample(f"t{i}", 1 + i % 4), reward=1.0)]))
        else:
            calls.append(Values([sample(f"v{i}", 1 + i % 5), sample(f"w{i}", 2)]))
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(leader.lead, calls))
    leader.close()
    assert follower.close(timeout_s=30) is True
    # One call at a time on the leader; the follower ran the same calls in the same order.
    assert not runs[0].overlapped and not runs[1].overlapped
    assert len(runs[0].calls) == 12 and runs[1].calls == runs[0].calls
    assert sorted(runs[0].calls) == sorted(encode(c) for c in calls)
    assert leader.calls == follower.calls == 12
    # Each caller got its own call's result.
    for call, result in zip(calls, results, strict=True):
        if isinstance(call, Values):
            assert result == [[float(len(s.token_ids))] for s in call.samples]
    assert sorted(r for r in results if isinstance(r, int)) == sorted(
        runs[0].calls.index(encode(c)) + 1 for c in calls if isinstance(c, TrainStep)
    )
    assert not broken[0].told and not broken[1].told
    with pytest.raises(ClosedError, match=r"^critic\.0: the critic group is closed; no call"):
        leader.lead(Values([]))
    with pytest.raises(ValueError, match=r"^critic\.1: only rank 0 leads its group's calls$"):
        follower.lead(Values([]))


def test_an_idle_leader_keeps_its_followers_waiting_past_their_timeout() -> None:
    # The follower waits 0.2 s for each message; the leader says Idle after 0.05 s of silence.
    wire, (leader, follower), runs, broken = group(timeout_s=0.2, idle_s=0.05)
    wire.enough = 20  # messages: at least 1 s of silence, five times the follower's timeout
    assert wire.heard.wait(timeout=60)
    assert leader.lead(Values([sample("a", 3)])) == [[3.0]]
    leader.close()
    assert follower.close(timeout_s=30) is True
    assert follower.idles >= 19 and leader.idles >= follower.idles
    assert runs[1].calls == [encode(Values([sample("a", 3)]))]
    assert not broken[0].told and not broken[1].told


def test_the_keep_alive_reaches_the_followers_while_the_leader_computes_on_its_own() -> None:
    # An export on replica 0 (exclusive) that outlasts the followers' timeout breaks nothing.
    wire, (leader, follower), runs, broken = group(timeout_s=0.2, idle_s=0.05)
    with leader.exclusive():
        wire.enough = 20  # messages: at least 1 s inside the block, five times the timeout
        assert wire.heard.wait(timeout=60)
    assert leader.lead(Values([sample("a", 3)])) == [[3.0]]
    leader.close()
    assert follower.close(timeout_s=30) is True
    assert follower.idles >= 19
    assert runs[1].calls == [encode(Values([sample("a", 3)]))]
    assert not broken[0].told and not broken[1].told


def test_a_follower_whose_leader_is_silent_breaks_the_group() -> None:
    wire = Wire()
    broken = Broken()
    follower = Lockstep(
        cast(Any, FakeRank(wire, 1, timeout_s=0.05)),
        CALLS,
        Recorder(),
        on_broken=broken,
        client="CriticClient",
    )
    follower.start()  # no leader: nothing ever comes
    assert broken.event.wait(timeout=30)
    assert follower.close(timeout_s=30) is True
    assert [str(e) for e in broken.told] == [
        "critic: rank 1: the group's next call failed (nothing in 0.05 s)"
    ]


def test_a_call_that_fails_once_announced_breaks_the_group_on_every_rank() -> None:
    _, (leader, follower), runs, broken = group(fail_on="bad")
    assert leader.lead(Values([sample("a", 2)])) == [[2.0]]
    with pytest.raises(DataParallelError) as caught:
        leader.lead(TrainStep([Scored(sample=sample("bad", 1))]))
    message = (
        "critic: rank {rank}: train_step (announced to every rank) failed (RuntimeError: no "
        "step on bad); the other ranks may be waiting at another collective, so the group "
        "must restart"
    )
    assert str(caught.value) == message.format(rank=0)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert broken[1].event.wait(timeout=30)
    assert [str(e) for e in broken[0].told] == [message.format(rank=0)]
    assert [str(e) for e in broken[1].told] == [message.format(rank=1)]
    assert leader.dp.broken == (
        "rank 0: train_step (announced to every rank) failed (RuntimeError: no step on bad)"
    )
    # Broken for good: nothing more is announced, and closing announces nothing either.
    with pytest.raises(DataParallelError, match=r"broke earlier"):
        leader.lead(Values([sample("b", 1)]))
    leader.close()
    assert follower.close(timeout_s=30) is True
    assert len(runs[0].calls) == len(runs[1].calls) == 2
    assert len(broken[0].told) == 1  # told once


def test_the_calls_are_typed_msgpack_maps_never_pickles() -> None:
    values = Values([sample("a", 2)])
    step = TrainStep([Scored(sample=sample("b", 1), reward=0.5, values=[0.25])])
    for message in (values, step, Idle(), Close()):
        assert decode(encode(message)) == message
    # Any MessagePack reader sees a map tagged with the call's kind.
    plain = msgpack.unpackb(encode(step))
    assert plain["type"] == "train_step" and plain["batch"][0]["values"] == [0.25]
    assert msgpack.unpackb(encode(Idle())) == {"type": "idle"}
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'logprobs'"):
        decode(msgpack.packb({"type": "logprobs", "samples": []}))
    with pytest.raises(msgspec.DecodeError):
        decode(b"\x80\x04\x95")  # a pickle's first bytes


def test_each_role_declares_its_calls_and_a_group_reads_only_its_own() -> None:
    learners = Lockstep(
        cast(Any, FakeRank(Wire(), 0, name="learner")),
        (learner.TrainStep, learner.Checkpoint),
        lambda c: None,
        on_broken=print,
        client="LearnerClient",
    )
    step = learner.TrainStep(TrainBatch(samples=[Scored(sample=sample("a", 2))], id="b1"))
    keep = learner.Checkpoint(ProgramState(cursor=4))
    assert learners.decode(learners.encode(step)) == step
    assert learners.decode(learners.encode(keep)) == keep
    assert msgpack.unpackb(learners.encode(keep)) == {"type": "checkpoint", "keep": {"cursor": 4}}
    # A critic's call is no learner's, and the other way round.
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'values'"):
        learners.decode(encode(Values([sample("a", 2)])))
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'checkpoint'"):
        decode(learners.encode(keep))


class Untagged(msgspec.Struct):
    n: int


class Busy(msgspec.Struct, tag="idle"):
    n: int


def test_call_types_that_a_group_cannot_tell_apart_are_refused() -> None:
    rank = cast(Any, FakeRank(Wire(), 0))

    def build(calls: Any) -> None:
        Lockstep(rank, calls, lambda c: None, on_broken=print, client="CriticClient")

    with pytest.raises(ValueError) as caught:
        build((Values, Untagged))
    assert str(caught.value) == (
        "critic: Lockstep call type Untagged has no tag; declare it with msgspec.Struct, "
        "tag='<its endpoint>'"
    )
    with pytest.raises(ValueError) as caught:
        build((Values, Busy))
    assert str(caught.value) == (
        "critic: Lockstep call type Busy has the tag 'idle', which another message of the "
        "group has; give each call type its own tag"
    )
    with pytest.raises(ValueError) as caught:
        build((Values, Values))
    assert "call type Values has the tag 'values', which another" in str(caught.value)
    with pytest.raises(ValueError) as caught:
        build((Values, dict))
    assert str(caught.value) == (
        "critic: Lockstep call types are msgspec Structs; got <class 'dict'>"
    )
    with pytest.raises(ValueError, match=r"^critic: Lockstep needs at least one call type$"):
        build(())


def test_a_follower_refuses_callers_and_its_own_work_waits_for_the_groups_call() -> None:
    _, (leader, follower), runs, broken = group()
    with pytest.raises(NotLeaderError) as caught:  # a ValueError its callers tell apart
        follower.check_leader("train_step")
    assert isinstance(caught.value, ValueError) and refused_as_follower(caught.value)
    assert str(caught.value) == (
        "critic.1: a critic with 2 replicas runs every call on all of them in the order "
        "replica 0 (its lead) sets; send train_step to replica 0 (CriticClient does: "
        "Handle.call(..., replica=0))"
    )
    leader.check_leader("train_step")  # the leader takes it
    # While the follower computes on its own (exclusive), the group's call waits on it.
    with ThreadPoolExecutor(max_workers=1) as pool:
        with follower.exclusive():
            done = pool.submit(leader.lead, Values([sample("a", 3)]))
            assert done.result(timeout=30) == [[3.0]]  # the leader ran it
            assert runs[1].calls == []  # the follower did not, yet
        leader.close()
        assert follower.close(timeout_s=30) is True
    assert runs[1].calls == runs[0].calls == [encode(Values([sample("a", 3)]))]
    assert not broken[0].told and not broken[1].told


@dataclass
class TargetHandle:
    """A learner or critic handle that records where each call was sent and answers as the
    role; the first ``breaks`` calls break in flight, as a replica dying would."""

    name: str = "critic"
    replicas: int = 2
    breaks: int = 0
    sent: list[tuple[str, int | None]] = field(default_factory=list)
    members: list[int] = field(default_factory=lambda: [0, 1])

    async def call(self, method: str, payload: Any, reply_type: Any = Any, **kw: Any) -> Any:
        from asyncrl.errors import DisconnectedError

        self.sent.append((method, kw.get("replica")))
        if self.breaks:
            self.breaks -= 1
            raise DisconnectedError(f"{self.name}.0 died with the call in flight")
        if method in ("values", "logprobs"):
            return [[0.0] * len(s.token_ids) for s in payload]
        if method == "status":
            return LearnerStatus(version=3, step=3)
        if method == "checkpoint":
            return "run/roles/learner.0/checkpoints/step-00000003"
        if self.name == "learner":
            return StepResult(version=3, step=3, consumed=1, skipped=0, metrics={})
        return CriticStepResult(
            step=1, optimizer_steps=1, value_loss=0.5, value_clip_fraction=0.0, grad_norm=1.0
        )


def test_the_learner_and_critic_clients_send_their_calls_to_replica_0() -> None:
    critic = TargetHandle(breaks=1)
    learners = TargetHandle(name="learner", breaks=1)

    async def go() -> None:
        scored = [Scored(sample=sample("a", 2))]
        # A step with an id is sent again, to replica 0, after it broke in flight.
        assert (await CriticClient(cast(Any, critic)).train_step(scored, id="b1")).step == 1
        assert await CriticClient(cast(Any, critic)).values([sample("a", 2)]) == [[0.0, 0.0]]
        client = LearnerClient(cast(Any, learners))
        assert (await client.train_step(TrainBatch(samples=scored, id="b1"))).step == 3
        path = await client.checkpoint(ProgramState(cursor=4))
        assert path == "run/roles/learner.0/checkpoints/step-00000003"
        # The step is whole on replica 0 when it answers; another rank may still be in it.
        assert (await client.status()).step == 3
        assert await client.logprobs([sample("a", 2)]) == [[0.0, 0.0]]

    asyncio.run(go())
    assert critic.sent == [("train_step", 0), ("train_step", 0), ("values", 0)]
    assert learners.sent == [
        ("train_step", 0),
        ("train_step", 0),
        ("checkpoint", 0),
        ("status", 0),
        ("logprobs", 0),
    ]


# -- both roles, a real group of two ranks --------------------------------------------------------

BOTH_SCRIPT = """
import asyncio, json, sys
import torch
torch.set_num_threads(1)
from asyncrl.role import RoleContext
from asyncrl.roles.payloads import ProgramState, Scored
from asyncrl.roles.training.critic import Critic
from asyncrl.roles.training.learner import Learner
from asyncrl.roles.training.lockstep import Lockstep
from asyncrl.transport import tracing
from tests.training import test_critic_sharding, test_data_parallel

rank, run_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
tracing.install(tracing.Recorder(f"{out}/trace", label=f"ranks.{rank}"))

async def refusals(role, calls):
    refused = []
    for method, payload in calls:
        try:
            await getattr(role, method)(payload)
        except ValueError as exc:
            refused.append(str(exc))
    return refused

async def main():
    report = {}
    # One torch.distributed group per process at a time: the learner's, then the critic's.
    ctx = RoleContext.local(config=dict(test_data_parallel.CONFIG, durable=False),
                            name="learner", replica=rank, replicas=2, run_dir=run_dir)
    learner = Learner(ctx)
    await learner.setup()
    assert type(learner.lockstep) is Lockstep
    batches = test_data_parallel.batches()[:2]
    if rank == 0:
        report["learner"] = [(await learner.train_step(b)).version for b in batches]
        await learner.checkpoint(ProgramState(cursor=7))
    else:
        report["learner"] = await refusals(
            learner, [("train_step", batches[0]), ("checkpoint", ProgramState(cursor=1))])
    await learner.teardown()
    report["learner_state"] = [learner.version, learner.keep.cursor]

    ctx = RoleContext.local(config=dict(test_critic_sharding.CONFIG, durable=False),
                            name="critic", replica=rank, replicas=2, run_dir=run_dir)
    critic = Critic(ctx)
    await critic.setup()
    assert type(critic.lockstep) is Lockstep
    batch = test_data_parallel.batches()[0].samples
    samples = [s.sample for s in batch]
    if rank == 0:
        values = await critic.values(samples)
        scored = [Scored(sample=s.sample, reward=s.reward, ref_logprobs=s.ref_logprobs, values=v)
                  for s, v in zip(batch, values)]
        report["critic"] = (await critic.train_step(scored)).step
    else:
        report["critic"] = await refusals(critic, [("values", samples)])
    await critic.teardown()
    report["critic_state"] = critic.step
    with open(f"{out}/both{rank}.json", "w") as f:
        json.dump(report, f)

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_learner_and_the_critic_keep_their_ranks_in_step_through_one_lockstep(
    tmp_path: Any,
) -> None:
    """Two ranks in two processes (gloo, a FileStore) form a learner's group, then a critic's:
    in both, replica 0 takes the calls and each rank runs them through ``Lockstep`` (its trace
    holds a ``lockstep`` span per call, the same calls in the same order on both ranks, the
    follower's in the lockstep's own thread), and replica 1 refuses calls sent to it."""
    from asyncrl.observe import trace
    from tests.training.test_data_parallel import run_ranks

    out = str(tmp_path)
    ranks = run_ranks(BOTH_SCRIPT, [str(tmp_path / "run"), out], f"{out}/both{{rank}}.json")
    assert ranks[0]["learner"] == [1, 2]
    assert ranks[0]["critic"] == 1
    refused = (
        "{role}.1: a {role} with 2 replicas runs every call on all of them in the order replica "
        "0 (its lead) sets; send {method} to replica 0 ({client} does: "
        "Handle.call(..., replica=0))"
    )
    assert ranks[1]["learner"] == [
        refused.format(role="learner", method=m, client="LearnerClient")
        for m in ("train_step", "checkpoint")
    ]
    assert ranks[1]["critic"] == [
        refused.format(role="critic", method="values", client="CriticClient")
    ]
    # Both ranks ran the steps and the checkpoint: the same version and kept position.
    assert [r["learner_state"] for r in ranks] == [[2, 7], [2, 7]]
    assert [r["critic_state"] for r in ranks] == [1, 1]
    spans: dict[int, list[list[Any]]] = {}
    for proc in trace.load(str(tmp_path / "trace")):
        ran = sorted((e for e in proc.spans if e[1].startswith("lockstep ")), key=lambda e: e[3])
        spans[proc.replica] = [[e[5]["group"], e[1], e[5]["index"], e[5]["crc"]] for e in ran]
        threads = {e[2] for e in ran}
        if proc.replica == 1:
            assert threads == {"learner.1 lockstep follower", "critic.1 lockstep follower"}
    assert [[g, name, i] for g, name, i, _ in spans[0]] == [
        ["learner", "lockstep train_step", 0],
        ["learner", "lockstep train_step", 1],
        ["learner", "lockstep checkpoint", 2],
        ["critic", "lockstep values", 0],
        ["critic", "lockstep train_step", 1],
    ]
    assert spans[1] == spans[0]
