"""The order of a data-parallel critic's calls (``asyncrl.roles.training.critic_lockstep``), in one
process: two ranks of a fake group whose broadcast is a queue, and ``CriticClient``'s target."""

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
from asyncrl.roles.payloads import CriticStepResult, Sample, Scored
from asyncrl.roles.program.clients import CriticClient
from asyncrl.roles.training.critic_lockstep import (
    Close,
    CriticCall,
    Idle,
    Lockstep,
    TrainStep,
    Values,
    decode,
    encode,
)
from asyncrl.roles.training.data_parallel import DataParallelError


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
            runs[rank],
            on_broken=broken[rank],
            idle_s=idle_s,
        )
        for rank in range(2)
    ]
    for step in steps:
        step.start()
    return wire, steps, runs, broken


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
    with pytest.raises(ClosedError, match=r"^critic\.0: the critic's group is closed; no call"):
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


def test_a_follower_whose_leader_is_silent_breaks_the_group() -> None:
    wire = Wire()
    broken = Broken()
    follower = Lockstep(cast(Any, FakeRank(wire, 1, timeout_s=0.05)), Recorder(), on_broken=broken)
    follower.start()  # no leader: nothing ever comes
    assert broken.event.wait(timeout=30)
    assert follower.close(timeout_s=30) is True
    assert [str(e) for e in broken.told] == [
        "critic: rank 1: the critic's next call failed (nothing in 0.05 s)"
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


@dataclass
class TargetHandle:
    """A critic handle that records where each call was sent and answers as the critic."""

    name: str = "critic"
    replicas: int = 2
    sent: list[tuple[str, int | None]] = field(default_factory=list)

    async def call(self, method: str, payload: Any, reply_type: Any = Any, **kw: Any) -> Any:
        self.sent.append((method, kw.get("replica")))
        if method == "values":
            return [[0.0] * len(s.token_ids) for s in payload]
        return CriticStepResult(
            step=1, optimizer_steps=1, value_loss=0.5, value_clip_fraction=0.0, grad_norm=1.0
        )


def test_the_critic_client_sends_every_call_to_replica_0() -> None:
    handle = TargetHandle()
    client = CriticClient(cast(Any, handle))

    async def go() -> None:
        assert await client.values([sample("a", 2)]) == [[0.0, 0.0]]
        assert (await client.train_step([Scored(sample=sample("a", 2))])).step == 1

    asyncio.run(go())
    assert handle.sent == [("values", 0), ("train_step", 0)]
