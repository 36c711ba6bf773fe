"""The credit-based dispatcher and the handles, over real sockets in one process.

Each replica is a transport ``Server`` served the way ``asyncrl.supervision.process`` serves a role:
its endpoints, the built-in ``_describe``, and credit advertised once it is ready. Handlers that
must stay busy wait on an ``asyncio.Event``; no test sleeps to let time pass.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from asyncrl.dispatch.dispatcher import Dispatcher, Group
from asyncrl.dispatch.handles import Context, Handle
from asyncrl.errors import (
    BrokenError,
    DeadlineExceededError,
    DisconnectedError,
    RemoteError,
    RoleDeadError,
)
from asyncrl.manifest.spec import GroupInfo
from asyncrl.transport import PROTOCOL_VERSION, Call, ChannelOptions, PeerEvent, Server, run

HEARTBEAT_S = 0.1
LIVENESS = 30  # 3 s of silence before a peer is dead: no test here waits that long
WAIT_S = 10.0  # the bound on every wait for something that should happen at once

ENDPOINTS = {
    "index": "idempotent",
    "work": "idempotent",
    "once_work": "once",
    "set": "latest",
    "fail": "idempotent",
}


class FakeReplica:
    """One replica of role ``g``, served in this process as ``asyncrl.supervision.process`` serves
    it.

    Every endpoint but ``index`` and ``fail`` answers ``[replica index, payload]``. A call
    for which ``hold(method, payload)`` is true waits on ``gate``; with ``tokens`` set, every
    call takes one token before it answers. ``entered`` gets ``(index, payload)`` as each call
    starts; ``calls`` records ``(method, payload, attempt)``.

    Credit is advertised as soon as the server is bound, or, with ``credit_on_connect``, to each
    client as its handshake arrives. With ``describe=False`` it does not answer ``_describe``, as
    an external role need not.
    """

    def __init__(
        self,
        endpoint: str,
        index: int,
        *,
        capacity: int,
        incarnation: int = 0,
        entered: asyncio.Queue[tuple[int, Any]] | None = None,
        hold: Callable[[str, Any], bool] = lambda method, payload: False,
        tokens: asyncio.Queue[None] | None = None,
        credit_on_connect: bool = False,
        describe: bool = True,
    ) -> None:
        self.index = index
        self.capacity = capacity
        self.entered: asyncio.Queue[tuple[int, Any]] = entered or asyncio.Queue()
        self.hold = hold
        self.tokens = tokens
        self.gate = asyncio.Event()
        self.calls: list[tuple[str, Any, int]] = []
        self.active = 0
        self.peak = 0
        options = ChannelOptions(
            run="t", shm=False, heartbeat_interval_s=HEARTBEAT_S, liveness=LIVENESS
        )
        self.credit_on_connect = credit_on_connect
        self.server = Server(
            endpoint,
            name=f"g.{index}",
            incarnation=incarnation,
            options=options,
            on_event=self._on_event,
        )
        for method in ("work", "once_work", "set"):
            self.server.add(method, self._handler(method))
        self.server.add("index", self._index)
        self.server.add("fail", self._fail)
        description = {
            "role": "g",
            "replica": index,
            "incarnation": incarnation,
            "pid": os.getpid(),
            "endpoints": ENDPOINTS,
        }
        if describe:
            self.server.add("_describe", lambda payload, call: description)

    async def start(self) -> FakeReplica:
        await self.server.start()
        if not self.credit_on_connect:
            self.server.set_credit(self.capacity)
        return self

    def _on_event(self, event: PeerEvent) -> None:
        # The server reports a handshake before it sends the WELCOME, so credit sent here
        # reaches the client ahead of the WELCOME.
        if self.credit_on_connect and event.kind == "connected":
            self.server.send_credit(event.peer.encode(), self.capacity)

    def _handler(self, method: str) -> Callable[[Any, Call], Any]:
        async def handle(payload: Any, call: Call) -> Any:
            self.calls.append((method, payload, call.attempt))
            self.active += 1
            self.peak = max(self.peak, self.active)
            try:
                self.entered.put_nowait((self.index, payload))
                if self.hold(method, payload):
                    await self.gate.wait()
                if self.tokens is not None:
                    await self.tokens.get()
                return [self.index, payload]
            finally:
                self.active -= 1

        return handle

    async def _index(self, payload: Any, call: Call) -> int:
        return self.index

    async def _fail(self, payload: Any, call: Call) -> Any:
        self.calls.append(("fail", payload, call.attempt))
        raise ValueError(f"bad payload {payload}")


@asynccontextmanager
async def dispatching(
    endpoints: list[str],
    replicas: list[FakeReplica],
    delivery: dict[str, Any] | None = None,
) -> AsyncIterator[tuple[Handle, Group]]:
    """Start a dispatcher for group ``g``; yield its handle and group; close everything after.

    ``delivery`` is what the manifest declares (``roles.g.endpoints``).
    """
    info = GroupInfo(
        endpoints, heartbeat_interval_s=HEARTBEAT_S, liveness=LIVENESS, delivery=delivery or {}
    )
    dispatcher = Dispatcher({"g": info}, run="t", startup_timeout_s=WAIT_S)
    dispatcher.start()
    ctx = Context(dispatcher, run="t", run_dir=".", log=logging.getLogger("test"))
    try:
        yield ctx.roles["g"], dispatcher.groups["g"]
    finally:
        await dispatcher.close()
        for replica in replicas:
            await replica.server.close()


async def ready(handle: Handle, group: Group) -> None:
    """Wait until the endpoints are described and every replica has advertised credit."""
    await asyncio.wait_for(group.wait_ready(), WAIT_S)
    assert await asyncio.wait_for(handle.broadcast("index"), WAIT_S) == list(range(handle.replicas))


def endpoints_in(run_dir: str, n: int) -> list[str]:
    return [f"ipc://{run_dir}/r{i}" for i in range(n)]


def test_call_returns_the_reply_and_broadcast_answers_in_replica_order(run_dir: str) -> None:
    async def main() -> None:
        endpoints = endpoints_in(run_dir, 3)
        replicas = [await FakeReplica(ep, i, capacity=2).start() for i, ep in enumerate(endpoints)]
        async with dispatching(endpoints, replicas) as (g, group):
            await ready(g, group)
            index, payload = await asyncio.wait_for(g.call("work", {"x": 7}), WAIT_S)
            assert payload == {"x": 7}
            assert index in (0, 1, 2)
            assert await asyncio.wait_for(g.broadcast("index"), WAIT_S) == [0, 1, 2]
            replies = await asyncio.wait_for(g.broadcast("work", "all"), WAIT_S)
            assert replies == [[0, "all"], [1, "all"], [2, "all"]]
            assert group.stats["retries"] == 0
            assert group.stats["failures"] == 0

    run(main())


def test_a_call_for_one_replica_goes_to_that_replica_only(run_dir: str) -> None:
    async def main() -> None:
        endpoints = endpoints_in(run_dir, 3)
        replicas = [await FakeReplica(ep, i, capacity=2).start() for i, ep in enumerate(endpoints)]
        async with dispatching(endpoints, replicas) as (g, group):
            await ready(g, group)
            calls = [g.call("work", n, replica=target) for n in range(4) for target in (0, 2)]
            replies = await asyncio.wait_for(asyncio.gather(*calls), WAIT_S)
            assert [index for index, _ in replies] == [0, 2] * 4
            assert [payload for _, payload in replies] == [n for n in range(4) for _ in (0, 2)]

    run(main())


def test_a_fast_replica_takes_more(run_dir: str) -> None:
    """The slow replica keeps its four calls until the fast one has done all the rest."""

    async def main() -> None:
        endpoints = endpoints_in(run_dir, 2)
        slow = await FakeReplica(endpoints[0], 0, capacity=4, hold=lambda m, p: True).start()
        fast = await FakeReplica(endpoints[1], 1, capacity=4).start()
        async with dispatching(endpoints, [slow, fast]) as (g, group):
            await ready(g, group)
            keys = []
            async for key, (_, item) in g.map("work", range(200), timeout=WAIT_S):
                assert item == key
                keys.append(key)
                if len(keys) == 196:
                    slow.gate.set()
            assert sorted(keys) == list(range(200))
            slow_items = sorted(p for m, p, _ in slow.calls if m == "work")
            assert len(slow_items) == 4
            assert sorted(keys[-4:]) == slow_items
            # One call each from the readiness broadcast, then the split of the 200.
            assert group.summary()["served"] == {0: 1 + 4, 1: 1 + 196}

    run(main())


def test_no_work_waits_for_a_busy_replica_while_another_has_room(run_dir: str) -> None:
    async def main() -> None:
        endpoints = endpoints_in(run_dir, 2)
        entered: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        replicas = [
            await FakeReplica(
                ep, i, capacity=1, entered=entered, hold=lambda m, p: p == "hold"
            ).start()
            for i, ep in enumerate(endpoints)
        ]
        async with dispatching(endpoints, replicas) as (g, group):
            await ready(g, group)
            held = asyncio.ensure_future(g.call("work", "hold"))
            busy, _ = await asyncio.wait_for(entered.get(), WAIT_S)
            idle = 1 - busy
            replies = await asyncio.wait_for(
                asyncio.gather(*(g.call("work", i) for i in range(20))), WAIT_S
            )
            assert replies == [[idle, i] for i in range(20)]
            assert not held.done()
            assert replicas[busy].calls == [("work", "hold", 0)]
            replicas[busy].gate.set()
            assert await asyncio.wait_for(held, WAIT_S) == [busy, "hold"]
            assert group.summary()["served"] == {busy: 1 + 1, idle: 1 + 20}

    run(main())


def test_work_with_an_affinity_key_stays_on_one_replica(run_dir: str) -> None:
    async def main() -> None:
        endpoints = endpoints_in(run_dir, 2)
        entered: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        replicas = [
            await FakeReplica(ep, i, capacity=4, entered=entered, hold=lambda m, p: True).start()
            for i, ep in enumerate(endpoints)
        ]
        async with dispatching(endpoints, replicas) as (g, group):
            await ready(g, group)
            first = asyncio.ensure_future(g.call("work", 0, affinity="group-a"))
            home, _ = await asyncio.wait_for(entered.get(), WAIT_S)
            # The other replica has more free slots, yet the group's next samples go home.
            rest = [asyncio.ensure_future(g.call("work", i, affinity="group-a")) for i in (1, 2)]
            for _ in rest:
                assert (await asyncio.wait_for(entered.get(), WAIT_S))[0] == home
            other = asyncio.ensure_future(g.call("work", "free"))
            assert (await asyncio.wait_for(entered.get(), WAIT_S))[0] == 1 - home
            for replica in replicas:
                replica.gate.set()
            replies = await asyncio.wait_for(asyncio.gather(first, *rest, other), WAIT_S)
            assert replies == [[home, 0], [home, 1], [home, 2], [1 - home, "free"]]
            assert group.stats["stolen"] == 0

    run(main())


def test_an_idle_replica_steals_work_queued_for_a_busy_one(run_dir: str) -> None:
    async def main() -> None:
        endpoints = endpoints_in(run_dir, 2)
        entered: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        replicas = [
            await FakeReplica(
                ep, i, capacity=1, entered=entered, hold=lambda m, p: p == "hold"
            ).start()
            for i, ep in enumerate(endpoints)
        ]
        async with dispatching(endpoints, replicas) as (g, group):
            await ready(g, group)
            pinned = asyncio.ensure_future(g.call("work", "hold", affinity="group-a"))
            home, _ = await asyncio.wait_for(entered.get(), WAIT_S)
            blocker = asyncio.ensure_future(g.call("work", "hold"))
            assert (await asyncio.wait_for(entered.get(), WAIT_S))[0] == 1 - home
            # Both replicas are busy: the group's samples wait in its home's queue ...
            queued = [
                asyncio.ensure_future(g.call("work", i, affinity="group-a")) for i in range(4)
            ]
            await asyncio.sleep(0)
            assert len(group.replicas[home].soft) == 4
            # ... until the other replica frees up and steals every one of them.
            replicas[1 - home].gate.set()
            replies = await asyncio.wait_for(asyncio.gather(*queued), WAIT_S)
            assert replies == [[1 - home, i] for i in range(4)]
            assert group.stats["stolen"] == 4
            assert not pinned.done()
            assert [p for _, p, _ in replicas[home].calls] == ["hold"]
            replicas[home].gate.set()
            assert await asyncio.wait_for(pinned, WAIT_S) == [home, "hold"]
            assert await asyncio.wait_for(blocker, WAIT_S) == [1 - home, "hold"]

    run(main())


def test_map_yields_as_results_complete_each_key_once(run_dir: str) -> None:
    async def main() -> None:
        endpoints = endpoints_in(run_dir, 1)
        replica = await FakeReplica(endpoints[0], 0, capacity=4, hold=lambda m, p: p == 0).start()
        async with dispatching(endpoints, [replica]) as (g, group):
            await ready(g, group)
            keys = [f"item{i}" for i in range(10)]
            got = []
            async for key, reply in g.map("work", range(10), keys=keys, timeout=WAIT_S):
                got.append((key, reply))
                if len(got) == 9:
                    replica.gate.set()
            assert got[-1] == ("item0", [0, 0])
            assert sorted(got) == sorted((f"item{i}", [0, i]) for i in range(10))
            assert len({key for key, _ in got}) == 10

            calls = group.stats["calls"]
            with pytest.raises(ValueError) as err:
                async for _ in g.map("work", [1, 2, 3], keys=["a", "b", "a"]):
                    pass
            assert str(err.value) == "map keys must be unique: each is the stable id of one result"
            with pytest.raises(ValueError) as err:
                async for _ in g.map("work", [1, 2], keys=[[1, 2], (1, 2)]):
                    pass
            assert str(err.value) == "map keys must be unique: each is the stable id of one result"
            with pytest.raises(ValueError) as err:
                async for _ in g.map("work", [1, 2], keys=["a"]):
                    pass
            assert str(err.value) == "map got 2 items but 1 keys"
            assert group.stats["calls"] == calls  # nothing was sent

    run(main())


def test_idempotent_calls_in_flight_on_a_closed_replica_run_again_elsewhere(
    run_dir: str,
) -> None:
    async def main() -> None:
        endpoints = endpoints_in(run_dir, 2)
        doomed = await FakeReplica(endpoints[0], 0, capacity=2, hold=lambda m, p: True).start()
        healthy = await FakeReplica(endpoints[1], 1, capacity=2).start()
        async with dispatching(endpoints, [doomed, healthy]) as (g, group):
            await ready(g, group)

            async def collect() -> list[tuple[Any, Any]]:
                return [kv async for kv in g.map("work", range(8), timeout=WAIT_S)]

            results = asyncio.ensure_future(collect())
            stranded = {(await asyncio.wait_for(doomed.entered.get(), WAIT_S))[1] for _ in "ab"}
            await doomed.server.close()  # the client sees its connection break
            got = await asyncio.wait_for(results, WAIT_S)

            assert sorted(got) == [(i, [1, i]) for i in range(8)]
            assert group.stats["retries"] == 2
            assert group.stats["replica_disconnected"] == 1
            assert group.stats["failures"] == 0
            reruns = {p for m, p, attempt in healthy.calls if m == "work" and attempt == 1}
            assert reruns == stranded
            assert len([c for c in healthy.calls if c[0] == "work"]) == 8
            assert group.summary()["served"] == {0: 1, 1: 1 + 8}

    run(main())


@pytest.mark.parametrize(
    "credit_on_connect", [False, True], ids=["credit-at-bind", "credit-before-welcome"]
)
def test_the_only_replica_restarts_and_idempotent_calls_complete_there(
    run_dir: str, credit_on_connect: bool
) -> None:
    """Waiting for the restart spends no retries: each call in flight is re-sent once.

    The new incarnation advertises credit either as soon as it is bound (as
    ``asyncrl.supervision.process`` does once ``setup()`` returns) or as the driver's handshake
    arrives, so that its CREDIT reaches the dispatcher before the WELCOME is acted on (a process
    whose ``setup()`` ends while the driver reconnects does the same: ``set_credit`` reaches a
    client already known from its pings). Either way the credit belongs to the new incarnation and
    is used.
    """

    async def main() -> None:
        endpoint = endpoints_in(run_dir, 1)
        first = await FakeReplica(endpoint[0], 0, capacity=2, hold=lambda m, p: True).start()
        replicas = [first]
        async with dispatching(endpoint, replicas) as (g, group):
            await ready(g, group)
            calls = asyncio.gather(*(g.call("work", i, timeout=WAIT_S) for i in range(3)))
            stranded = {(await asyncio.wait_for(first.entered.get(), WAIT_S))[1] for _ in "ab"}
            assert stranded == {0, 1}  # the third call waits in the queue
            await first.server.close()
            second = FakeReplica(
                endpoint[0], 0, capacity=2, incarnation=1, credit_on_connect=credit_on_connect
            )
            replicas.append(await second.start())
            assert await asyncio.wait_for(calls, 2 * WAIT_S) == [[0, 0], [0, 1], [0, 2]]
            assert sorted(second.calls) == [("work", 0, 1), ("work", 1, 1), ("work", 2, 0)]
            assert group.stats["retries"] == 2
            assert group.stats["replica_disconnected"] == 1
            assert group.stats["replica_restarts"] == 1
            assert group.stats["failures"] == 0
            assert group.replicas[0].incarnation == 1

    run(main())


def test_a_once_call_in_flight_on_a_closed_replica_fails_typed_and_is_not_retried(
    run_dir: str,
) -> None:
    async def main() -> None:
        endpoints = endpoints_in(run_dir, 2)
        entered: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        replicas = [
            await FakeReplica(
                ep, i, capacity=1, entered=entered, hold=lambda m, p: m == "once_work"
            ).start()
            for i, ep in enumerate(endpoints)
        ]
        async with dispatching(endpoints, replicas) as (g, group):
            await ready(g, group)
            pending = asyncio.ensure_future(g.call("once_work", "charge"))
            busy, _ = await asyncio.wait_for(entered.get(), WAIT_S)
            idle = 1 - busy
            await replicas[busy].server.close()
            with pytest.raises(BrokenError) as err:
                await asyncio.wait_for(pending, WAIT_S)
            assert isinstance(err.value, DisconnectedError)
            assert str(err.value) == (
                f"the connection to {endpoints[busy]} broke with request 'once_work' in flight; "
                f"the server exited or restarted, so the request may or may not have run"
            )
            assert group.stats["retries"] == 0
            assert group.stats["failures"] == 1
            assert replicas[idle].calls == []
            # The other replica still serves.
            assert await asyncio.wait_for(g.call("work", 1), WAIT_S) == [idle, 1]

    run(main())


@pytest.mark.parametrize("method", ["set", "work", "once_work"])
def test_a_broadcast_leaves_out_a_replica_that_departs_with_the_call_in_flight(
    run_dir: str, method: str
) -> None:
    """Replica 2's node is lost while it holds a broadcast's call, its connection still open
    (its host went silent): the broadcast answers the replicas left, as if it had departed
    before, rather than fail with the departed replica's ``BrokenError``."""

    async def main() -> None:
        endpoints = endpoints_in(run_dir, 3)
        entered: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        replicas = [
            await FakeReplica(
                ep, i, capacity=1, entered=entered, hold=lambda m, p, i=i: i == 2
            ).start()
            for i, ep in enumerate(endpoints)
        ]
        async with dispatching(endpoints, replicas) as (g, group):
            await asyncio.wait_for(group.wait_ready(), WAIT_S)
            pending = asyncio.ensure_future(g.broadcast(method, "v2"))
            seen = {(await asyncio.wait_for(entered.get(), WAIT_S))[0] for _ in range(3)}
            assert seen == {0, 1, 2}
            await group.depart(2, "its node 2 was lost")
            replies = await asyncio.wait_for(pending, WAIT_S)
            assert replies == [[0, "v2"], [1, "v2"]]
            assert g.members == [0, 1]
            assert group.stats["replicas_departed"] == 1

    run(main())


def test_latest_wins_a_queued_call_is_replaced_by_a_newer_one(run_dir: str) -> None:
    async def main() -> None:
        endpoints = endpoints_in(run_dir, 1)
        replica = await FakeReplica(
            endpoints[0], 0, capacity=1, hold=lambda m, p: p == "hold"
        ).start()
        async with dispatching(endpoints, [replica]) as (g, group):
            await ready(g, group)
            held = asyncio.ensure_future(g.call("work", "hold"))
            await asyncio.wait_for(replica.entered.get(), WAIT_S)
            sets = [asyncio.ensure_future(g.call("set", version)) for version in (1, 2, 3)]
            await asyncio.sleep(0)  # one loop turn: each task submits its call, in order
            assert group.stats["superseded"] == 2
            replica.gate.set()
            assert await asyncio.wait_for(asyncio.gather(*sets), WAIT_S) == [[0, 3]] * 3
            assert await asyncio.wait_for(held, WAIT_S) == [0, "hold"]
            assert [c for c in replica.calls if c[0] == "set"] == [("set", 3, 0)]
            assert group.stats["superseded"] == 2
            assert group.stats["failures"] == 0

    run(main())


def test_a_deadline_with_no_replica_up_names_the_group(run_dir: str) -> None:
    async def main() -> None:
        endpoints = endpoints_in(run_dir, 1)  # nothing is bound there
        async with dispatching(endpoints, []) as (g, group):
            with pytest.raises(DeadlineExceededError) as err:
                await asyncio.wait_for(g.call("work", 1, timeout=0.1), WAIT_S)
            assert err.value.method == "work"
            assert str(err.value) == (
                "request 'work' to g (no replica took it: none was up with a free slot) got no "
                "answer within its deadline of 0.100 s; the peer is slow, hung or gone. Raise "
                "the timeout if the work is legitimately long."
            )
            assert group.stats["failures"] == 1

    run(main())


def test_a_deadline_in_flight_names_the_group_and_replica(run_dir: str) -> None:
    async def main() -> None:
        endpoints = endpoints_in(run_dir, 1)
        replica = await FakeReplica(endpoints[0], 0, capacity=1, hold=lambda m, p: True).start()
        async with dispatching(endpoints, [replica]) as (g, group):
            await ready(g, group)
            with pytest.raises(DeadlineExceededError) as err:
                await asyncio.wait_for(g.call("work", 1, timeout=0.2), WAIT_S)
            assert err.value.peer == f"g[0] ({endpoints[0]})"
            assert (err.value.pid, err.value.incarnation) == (os.getpid(), 0)
            assert str(err.value) == (
                f"request 'work' to g[0] ({endpoints[0]}) got no answer within its deadline of "
                f"0.200 s; the peer (pid {os.getpid()}, incarnation 0) is slow, hung or gone. "
                f"Raise the timeout if the work is legitimately long."
            )
            assert replica.calls == [("work", 1, 0)]
            assert group.stats["retries"] == 0

    run(main())


def test_a_remote_error_reaches_the_caller_and_is_not_retried(run_dir: str) -> None:
    async def main() -> None:
        endpoints = endpoints_in(run_dir, 2)
        replicas = [await FakeReplica(ep, i, capacity=2).start() for i, ep in enumerate(endpoints)]
        async with dispatching(endpoints, replicas) as (g, group):
            await ready(g, group)
            with pytest.raises(RemoteError) as err:
                await asyncio.wait_for(g.call("fail", 7), WAIT_S)
            assert err.value.remote_type == "ValueError"
            assert err.value.code == "handler_error"
            assert not err.value.retryable
            assert err.value.peer in endpoints
            assert str(err.value) == (
                f"error reply from {err.value.peer} [handler_error] (ValueError): bad payload 7"
            )
            assert [c for r in replicas for c in r.calls] == [("fail", 7, 0)]
            assert group.stats["retries"] == 0
            assert group.stats["failures"] == 1

    run(main())


def test_a_replica_never_has_more_calls_than_its_credit(run_dir: str) -> None:
    async def main() -> None:
        endpoints = endpoints_in(run_dir, 2)
        entered: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        tokens: asyncio.Queue[None] = asyncio.Queue()
        replicas = [
            await FakeReplica(ep, i, capacity=2 + i, entered=entered, tokens=tokens).start()
            for i, ep in enumerate(endpoints)
        ]
        async with dispatching(endpoints, replicas) as (g, group):
            await ready(g, group)
            calls = asyncio.gather(*(g.call("work", i) for i in range(30)))
            for _ in range(2 + 3):  # both replicas full
                await asyncio.wait_for(entered.get(), WAIT_S)
            assert [r.active for r in replicas] == [2, 3]
            for _ in range(30):
                tokens.put_nowait(None)
            replies = await asyncio.wait_for(calls, WAIT_S)
            assert sorted(item for _, item in replies) == list(range(30))
            assert [r.peak for r in replicas] == [2, 3]
            served = group.summary()["served"]
            assert served[0] + served[1] == 2 + 30

    run(main())


@pytest.mark.parametrize(
    ("describe", "declared", "retried"),
    [
        (False, {"work": "idempotent"}, True),  # the manifest's declaration applies
        (False, {}, False),  # nothing declared or described: once
        (True, {"work": "once"}, True),  # _describe wins over the manifest
    ],
    ids=["declared", "undeclared", "described-wins"],
)
def test_the_manifest_declares_delivery_for_a_replica_that_does_not_describe_itself(
    run_dir: str, describe: bool, declared: dict[str, Any], retried: bool
) -> None:
    async def main() -> None:
        endpoints = endpoints_in(run_dir, 2)
        entered: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        replicas = [
            await FakeReplica(
                ep, i, capacity=1, entered=entered, hold=lambda m, p: p == "held", describe=describe
            ).start()
            for i, ep in enumerate(endpoints)
        ]
        async with dispatching(endpoints, replicas, declared) as (g, group):
            await ready(g, group)
            pending = asyncio.ensure_future(g.call("work", "held", timeout=WAIT_S))
            doomed, _ = await asyncio.wait_for(entered.get(), WAIT_S)
            other = replicas[1 - doomed]
            other.gate.set()  # the re-run answers at once
            await replicas[doomed].server.close()
            if retried:
                assert await asyncio.wait_for(pending, WAIT_S) == [1 - doomed, "held"]
                assert other.calls == [("work", "held", 1)]
                assert group.stats["retries"] == 1
            else:
                with pytest.raises(DisconnectedError):
                    await asyncio.wait_for(pending, WAIT_S)
                assert other.calls == []
                assert group.stats["retries"] == 0

    run(main())


def test_a_replica_that_dies_during_the_first_handshake_is_connected_again(run_dir: str) -> None:
    """The replica's process dies with the driver's first HANDSHAKE in flight (a restart
    under fire, or a driver restarted while a replica is): the dispatcher connects again, and
    the next incarnation serves its calls, rather than never hearing from that replica."""
    import zmq
    import zmq.asyncio

    async def main() -> None:
        endpoint = endpoints_in(run_dir, 1)
        context = zmq.asyncio.Context()
        doomed = context.socket(zmq.ROUTER)
        doomed.bind(endpoint[0])
        replicas: list[FakeReplica] = []
        async with dispatching(endpoint, replicas) as (g, group):
            frames = await asyncio.wait_for(doomed.recv_multipart(), WAIT_S)
            assert len(frames) >= 2  # identity and the HANDSHAKE: it dies before it answers
            doomed.close(linger=0)
            replicas.append(await FakeReplica(endpoint[0], 0, capacity=1).start())
            await ready(g, group)
            assert await asyncio.wait_for(g.call("work", 7), WAIT_S) == [0, 7]
        context.term()

    run(main())


def test_calls_aimed_at_a_replica_of_another_protocol_version_fail_at_once(run_dir: str) -> None:
    """Replica 1 answers the handshake in version 2: it can never be spoken to, so what is aimed
    at it (broadcast's share) fails with RoleDeadError naming it, not at its deadline; the rest
    of the group serves as usual."""
    import msgspec
    import zmq
    import zmq.asyncio

    async def main() -> None:
        endpoints = endpoints_in(run_dir, 2)
        context = zmq.asyncio.Context()
        other_version = context.socket(zmq.ROUTER)
        other_version.bind(endpoints[1])
        replicas = [await FakeReplica(endpoints[0], 0, capacity=1).start()]
        async with dispatching(endpoints, replicas) as (g, group):
            identity, envelope = await asyncio.wait_for(other_version.recv_multipart(), WAIT_S)
            waiting = asyncio.ensure_future(g.broadcast("index", timeout=3600))
            await asyncio.sleep(0)  # one loop turn: its calls are queued, one for each replica
            assert group.stats["calls"] == 2
            request_id = msgspec.msgpack.decode(envelope)[2]
            await other_version.send_multipart(
                [identity, msgspec.msgpack.encode([2, 2, request_id])]
            )
            mismatch = (
                f"protocol version mismatch: this side speaks version {PROTOCOL_VERSION}, the "
                f"peer {endpoints[1]} speaks version 2; run the same asyncrl protocol version on "
                f"both ends"
            )
            dead = (
                f"role g[1] is dead: {mismatch}; nothing will answer it again in this run, so "
                "retrying cannot help. The run's report says why it ended."
            )
            with pytest.raises(RoleDeadError) as err:
                await asyncio.wait_for(waiting, WAIT_S)
            assert (str(err.value), err.value.replica) == (dead, 1)
            with pytest.raises(RoleDeadError) as err:
                await asyncio.wait_for(g.broadcast("index", timeout=3600), WAIT_S)
            assert str(err.value) == dead
            await asyncio.wait_for(group.wait_ready(), WAIT_S)
            assert await asyncio.wait_for(g.call("work", 7), WAIT_S) == [0, 7]
            assert group.stats["replicas_lost"] == 1
        other_version.close(linger=0)
        context.term()

    run(main())


def test_a_fault_while_connecting_fails_every_call_with_it(
    run_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The connections belong to the dispatcher's task group: a bug in one of them reaches the
    program through its calls, rather than leave it waiting on a replica never described."""
    fault = RuntimeError("injected fault while connecting")

    async def faulty(self: Group, index: int, client: Any) -> None:
        raise fault

    monkeypatch.setattr(Group, "_describe", faulty)

    async def main() -> None:
        endpoints = endpoints_in(run_dir, 1)
        replicas = [await FakeReplica(endpoints[0], 0, capacity=1).start()]
        async with dispatching(endpoints, replicas) as (g, group):
            with pytest.raises(ExceptionGroup) as info:
                await asyncio.wait_for(group.wait_ready(), WAIT_S)
            assert info.value.exceptions == (fault,)
            with pytest.raises(ExceptionGroup) as info:
                await asyncio.wait_for(g.call("work", 1), WAIT_S)
            assert info.value.exceptions == (fault,)
            assert group.stats["failures"] == 1

    with caplog.at_level(logging.ERROR, logger="asyncrl.dispatch.dispatcher"):
        run(main())
    errors = [r for r in caplog.records if r.name == "asyncrl.dispatch.dispatcher"]
    assert [r.getMessage() for r in errors] == [
        "the dispatcher failed while connecting; every call fails with this"
    ]
    assert errors[0].exc_info is not None and errors[0].exc_info[1].exceptions == (fault,)


def test_the_driver_freezes_what_it_made_at_start_up_and_collects_young_objects_less_often() -> (
    None
):
    # In a process of its own: freezing is for the whole process.
    code = (
        "import gc; from asyncrl.dispatch.driver import freeze_start_up; "
        "before = gc.get_freeze_count(); freeze_start_up(); "
        "print(before, gc.get_freeze_count() > 10000, *gc.get_threshold())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "True", "200000", "20", "20"]
