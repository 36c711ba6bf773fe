"""The dispatcher's scheduling in-process: credit, affinity, work stealing and retries.

Each replica's client is a ``FakeClient`` that records what is sent to it and hands back a
future the test settles, so every step is explicit: nothing is sent over a socket and nothing
waits on time, except the one test of a deadline.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from asyncrl.dispatch.scheduler import Scheduler, Work
from asyncrl.errors import (
    BrokenError,
    ClosedError,
    DeadlineExceededError,
    DisconnectedError,
    RemoteError,
    RoleDeadError,
)
from asyncrl.role import Delivery

T = TypeVar("T")

TIMEOUT_S = 60.0
DELIVERY = {
    "work": Delivery.IDEMPOTENT,
    "charge": Delivery.ONCE,
    "set": Delivery.LATEST,
}


@dataclass
class Sent:
    """One request as it reached a fake client."""

    method: str
    payload: Any
    attempt: int
    timeout: float
    trace: str
    reply: asyncio.Future[Any]


class FakeClient:
    """Records each request and returns a future the test settles. A payload for which
    ``refuse`` returns an error is not sent: the error is raised, as a closed client or an
    unencodable payload does."""

    def __init__(self) -> None:
        self.sent: list[Sent] = []
        self.refuse: Callable[[Any], BaseException | None] = lambda payload: None

    def call_future(
        self,
        method: str,
        payload: Any = None,
        reply_type: Any = Any,
        *,
        timeout: float = 30.0,
        attempt: int = 0,
        trace: str = "",
    ) -> asyncio.Future[Any]:
        refusal = self.refuse(payload)
        if refusal is not None:
            raise refusal
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.sent.append(Sent(method, payload, attempt, timeout, trace, reply))
        return reply

    def payloads(self) -> list[Any]:
        return [s.payload for s in self.sent]

    def answer(self, position: int) -> None:
        """Reply to the ``position``-th request sent here with ``[payload]``."""
        sent = self.sent[position]
        sent.reply.set_result([sent.payload])


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await scenario()

    return asyncio.run(main())


def scheduler_with(*credits: int) -> tuple[Scheduler, list[FakeClient]]:
    """A scheduler for role ``g`` whose replica ``i`` has ``credits[i]`` slots (incarnation 0)."""
    scheduler = Scheduler("g", [f"ipc://g{i}" for i in range(len(credits))], DELIVERY)
    clients = [FakeClient() for _ in credits]
    for index, (client, slots) in enumerate(zip(clients, credits, strict=True)):
        scheduler.attach(index, client)
        if slots:
            scheduler.credit(index, slots, incarnation=0)
    return scheduler, clients


def submit(
    scheduler: Scheduler,
    method: str,
    payload: Any,
    *,
    timeout: float = TIMEOUT_S,
    target: int | None = None,
    affinity: Any = None,
    avoid: int = -1,
) -> Work:
    loop = asyncio.get_running_loop()
    work = Work(
        method,
        payload,
        Any,
        timeout,
        loop.time() + timeout,
        loop.create_future(),
        target=target,
        affinity=affinity,
        avoid=avoid,
    )
    scheduler.submit(work)
    return work


def test_a_replica_never_gets_more_calls_than_its_credit_and_the_freest_goes_first() -> None:
    async def scenario() -> None:
        scheduler, (a, b) = scheduler_with(2, 3)
        works = [submit(scheduler, "work", i) for i in range(10)]
        # The freest replica first; a tie goes to the lower index.
        assert (a.payloads(), b.payloads()) == ([1, 3], [0, 2, 4])
        assert len(scheduler.queue) == 5
        a.answer(0)
        await works[1].future  # its reply is in: one slot of a is free again, b has none
        assert (a.payloads(), b.payloads()) == ([1, 3, 5], [0, 2, 4])
        b.answer(2)
        await works[4].future
        assert (a.payloads(), b.payloads()) == ([1, 3, 5], [0, 2, 4, 6])
        # More credit from the same incarnation: the queue drains up to it at once.
        scheduler.credit(0, 4, incarnation=0)
        assert (a.payloads(), b.payloads()) == ([1, 3, 5, 7, 8], [0, 2, 4, 6])
        assert [r.inflight for r in scheduler.replicas] == [4, 3]
        assert [w.payload for w in scheduler.queue] == [9]
        assert scheduler.summary() == {"calls": 10, "served": {0: 1, 1: 1}}

    run(scenario)


class Walks(list[Any]):
    """The scheduler's replicas, counting how many of them it visits: one a lookup, all of them
    a walk."""

    visits = 0

    def __iter__(self) -> Iterator[Any]:
        self.visits += len(self)
        return super().__iter__()

    def __getitem__(self, index: Any) -> Any:
        self.visits += 1
        return super().__getitem__(index)


def freest(scheduler: Scheduler, avoid: int) -> int:
    """The replica a walk over every replica picks: the most free slots, the lowest index
    among equals, any other before ``avoid``; free slots counted afresh from credit, calls in
    flight and liveness."""
    free = [
        (r.credit - r.inflight if r.alive and r.lost is None else 0, -r.index, r.index != avoid)
        for r in list.__iter__(scheduler.replicas)
    ]
    candidates = [(other, f, i) for f, i, other in free if f > 0]
    return -max(candidates)[2]


def test_at_any_scale_each_call_goes_where_a_walk_over_every_replica_would_send_it() -> None:
    # 48 replicas of 1 to 4 slots; calls answered, failed (and retried elsewhere) and replicas
    # dropping and coming back, in a seeded random order. Before each send the fake client
    # checks the choice against a fresh walk over every replica.
    async def scenario() -> None:
        rng = random.Random(7)
        scheduler, clients = scheduler_with(*(rng.randint(1, 4) for _ in range(48)))
        works: dict[Any, Work] = {}
        choices: list[tuple[int, int]] = []
        for index, client in enumerate(clients):

            def check(payload: Any, index: int = index) -> None:
                choices.append((index, freest(scheduler, works[payload].avoid)))

            client.refuse = lambda payload, check=check: check(payload)  # type: ignore[misc]
        for step in range(3000):
            if rng.random() < 0.55:
                work = Work(
                    "work", step, Any, TIMEOUT_S, 1e9, asyncio.get_running_loop().create_future()
                )
                works[step] = work
                scheduler.submit(work)
            pending = [(c, s) for c in clients for s in c.sent if not s.reply.done()]
            if pending and rng.random() < 0.5:
                _, sent = rng.choice(pending)
                if rng.random() < 0.1:
                    sent.reply.set_exception(DisconnectedError("gone"))
                else:
                    sent.reply.set_result([sent.payload])
            if rng.random() < 0.01:
                index = rng.randrange(len(clients))
                scheduler.peer_event(index, "dead", 0)
                scheduler.credit(index, rng.randint(1, 4), 0)
            settled = asyncio.Event()
            asyncio.get_running_loop().call_soon(settled.set)  # after the replies' callbacks
            await settled.wait()
        assert len(choices) > 1500
        assert [chosen for chosen, _ in choices] == [expected for _, expected in choices]
        assert scheduler.stats["retries"] > 50

    run(scenario)


def test_a_call_visits_a_few_replicas_not_every_one() -> None:
    # 1,024 replicas of 2 slots, kept full: 8,000 calls sent and answered. A walk over every
    # replica per call or per reply (the scheduler before its index) visits over 2,000
    # replicas a call; the index looks up a handful.
    async def scenario() -> None:
        scheduler, clients = scheduler_with(*([2] * 1024))
        walks = Walks(scheduler.replicas)
        scheduler.replicas = walks
        works = [submit(scheduler, "work", i) for i in range(3000)]
        answered = 0
        rng = random.Random(3)
        while answered < 8000:
            pending = [s for c in rng.sample(clients, 4) for s in c.sent if not s.reply.done()]
            for sent in pending:
                sent.reply.set_result([sent.payload])
                answered += 1
                works.append(submit(scheduler, "work", answered + 3000))
            settled = asyncio.Event()
            asyncio.get_running_loop().call_soon(settled.set)
            await settled.wait()
        assert sum(r.inflight for r in scheduler.replicas) == 2048
        assert walks.visits / answered < 16

    run(scenario)


def test_work_with_an_affinity_key_prefers_the_replica_of_the_first() -> None:
    async def scenario() -> None:
        scheduler, (a, b) = scheduler_with(1, 4)
        submit(scheduler, "work", "g0", affinity="grp")
        assert b.payloads() == ["g0"]  # the freest: the key's home from now on
        scheduler.credit(0, 8, incarnation=0)  # now a has more room than b
        for item in ("g1", "g2", "g3"):
            submit(scheduler, "work", item, affinity="grp")
        assert (a.payloads(), b.payloads()) == ([], ["g0", "g1", "g2", "g3"])
        submit(scheduler, "work", "free")
        assert a.payloads() == ["free"]
        # The home is full: g4 waits in its soft queue, and a, idle, steals it at once.
        submit(scheduler, "work", "g4", affinity="grp")
        assert (a.payloads(), b.payloads()) == (["free", "g4"], ["g0", "g1", "g2", "g3"])
        assert scheduler.stats["stolen"] == 1
        # The key moved with the theft: its next work goes to a, stolen from no one.
        submit(scheduler, "work", "g5", affinity="grp")
        assert a.payloads() == ["free", "g4", "g5"]
        assert scheduler.stats["stolen"] == 1

    run(scenario)


def test_an_idle_replica_steals_the_newest_work_queued_for_a_slow_one() -> None:
    async def scenario() -> None:
        scheduler, (slow, fast) = scheduler_with(1, 1)
        submit(scheduler, "work", "held", affinity="grp")
        blocker = submit(scheduler, "work", "quick")
        assert (slow.payloads(), fast.payloads()) == (["held"], ["quick"])
        queued = [submit(scheduler, "work", i, affinity="grp") for i in range(4)]
        assert [w.payload for w in scheduler.replicas[0].soft] == [0, 1, 2, 3]
        fast.answer(0)
        await blocker.future
        # The slow replica keeps what it would reach next; the thief takes the newest.
        assert fast.payloads() == ["quick", 3]
        for position in (1, 2, 3):
            fast.answer(position)
            await queued[4 - position].future
        assert fast.payloads() == ["quick", 3, 2, 1, 0]
        fast.answer(4)
        assert await asyncio.gather(*(w.future for w in queued)) == [[0], [1], [2], [3]]
        assert slow.payloads() == ["held"]
        assert scheduler.stats["stolen"] == 4
        assert scheduler.summary()["served"] == {0: 0, 1: 5}

    run(scenario)


def test_an_idempotent_call_whose_replica_died_runs_again_on_another() -> None:
    async def scenario() -> None:
        scheduler, (a, b) = scheduler_with(1, 1)
        doomed = submit(scheduler, "work", "x")
        assert (a.payloads(), b.payloads()) == (["x"], [])
        # The connection breaks: the event first, then the call in flight fails.
        scheduler.peer_event(0, "disconnected", incarnation=0)
        a.sent[0].reply.set_exception(DisconnectedError("the connection to ipc://g0 broke"))
        await asyncio.sleep(0)  # one loop turn: the failure's callback runs
        assert [(s.payload, s.attempt) for s in b.sent] == [("x", 1)]
        b.answer(0)
        assert await doomed.future == ["x"]
        assert scheduler.stats["retries"] == 1
        assert scheduler.stats["replica_disconnected"] == 1
        assert scheduler.stats["failures"] == 0

    run(scenario)


def test_a_call_that_avoids_a_replica_goes_to_another_with_room_before_it() -> None:
    async def scenario() -> None:
        scheduler, (a, b, c) = scheduler_with(2, 0, 1)
        submit(scheduler, "work", "x", avoid=0)  # a is the freest
        submit(scheduler, "work", "y", avoid=0)  # a alone has room now
        submit(scheduler, "work", "z", avoid=2)
        assert (a.payloads(), b.payloads(), c.payloads()) == (["y", "z"], [], ["x"])

    run(scenario)


def test_with_no_replica_up_the_retry_waits_for_the_restarted_one() -> None:
    async def scenario() -> None:
        scheduler, (only,) = scheduler_with(1)
        first = submit(scheduler, "work", "x")
        queued = submit(scheduler, "work", "y")
        scheduler.peer_event(0, "disconnected", incarnation=0)
        only.sent[0].reply.set_exception(DisconnectedError("the connection to ipc://g0 broke"))
        await asyncio.sleep(0)
        # Re-queued ahead of the work that never left; nothing is sent while none is up.
        assert [w.payload for w in scheduler.queue] == ["x", "y"]
        assert len(only.sent) == 1
        scheduler.peer_event(0, "restarted", incarnation=1)
        scheduler.credit(0, 2, incarnation=1)
        assert [(s.payload, s.attempt) for s in only.sent[1:]] == [("x", 1), ("y", 0)]
        only.answer(1)
        only.answer(2)
        assert await asyncio.gather(first.future, queued.future) == [["x"], ["y"]]
        assert scheduler.replicas[0].incarnation == 1
        assert scheduler.stats["retries"] == 1
        assert scheduler.stats["replica_restarts"] == 1

    run(scenario)


def test_a_once_call_whose_replica_died_fails_with_that_error() -> None:
    async def scenario() -> None:
        scheduler, (a, b) = scheduler_with(1, 1)
        charge = submit(scheduler, "charge", "x")
        error = DisconnectedError("the connection to ipc://g0 broke")
        a.sent[0].reply.set_exception(error)
        with pytest.raises(DisconnectedError) as info:
            await charge.future
        assert info.value is error
        assert (b.sent, scheduler.stats["retries"], scheduler.stats["failures"]) == ([], 0, 1)

    run(scenario)


def test_a_remote_error_is_not_retried_unless_it_says_it_may_be() -> None:
    async def scenario() -> None:
        scheduler, (a, b) = scheduler_with(1, 1)
        bad = submit(scheduler, "work", "bad")
        busy = submit(scheduler, "work", "busy")
        a.sent[0].reply.set_exception(RemoteError("handler_error", "bad payload"))
        b.sent[0].reply.set_exception(RemoteError("overloaded", "later", retryable=True))
        with pytest.raises(RemoteError) as info:
            await bad.future
        assert (info.value.code, info.value.replica) == ("handler_error", 0)  # a failed it
        # The retryable one runs again on the other replica (a is free now).
        assert [(s.payload, s.attempt) for s in a.sent] == [("bad", 0), ("busy", 1)]
        a.answer(1)
        assert await busy.future == ["busy"]
        assert (scheduler.stats["retries"], scheduler.stats["failures"]) == (1, 1)

    run(scenario)


def test_a_refused_send_marks_the_replica_down_and_only_a_broken_one_is_retried() -> None:
    async def scenario() -> None:
        scheduler, (a, b) = scheduler_with(2, 1)
        closed = ClosedError("client driver->g.0 is closed or not connected")
        a.refuse = lambda payload: closed
        work = submit(scheduler, "work", "x")
        # Closed on this side (the dispatcher is closing): not retried.
        with pytest.raises(ClosedError) as info:
            await work.future
        assert info.value is closed
        assert not scheduler.replicas[0].alive
        assert (b.sent, scheduler.stats["retries"]) == ([], 0)
        scheduler.credit(0, 2, incarnation=0)
        a.refuse = lambda payload: DisconnectedError("the connection to ipc://g0 broke")
        again = submit(scheduler, "work", "y")
        # Broken from outside: re-run on the other replica.
        assert [(s.payload, s.attempt) for s in b.sent] == [("y", 1)]
        b.answer(0)
        assert await again.future == ["y"]
        assert scheduler.stats["retries"] == 1

    run(scenario)


def test_a_replica_heard_again_keeps_its_credit_only_in_the_same_incarnation() -> None:
    async def scenario() -> None:
        scheduler, (a,) = scheduler_with(1)
        scheduler.peer_event(0, "dead", incarnation=0)
        submit(scheduler, "work", "x")
        assert a.sent == []
        scheduler.peer_event(0, "alive", incarnation=1)  # another incarnation: no credit yet
        assert a.sent == []
        scheduler.peer_event(0, "alive", incarnation=0)  # it was stopped, not restarted
        assert a.payloads() == ["x"]
        assert scheduler.stats["replica_dead"] == 1

    run(scenario)


def test_a_payload_that_cannot_be_encoded_fails_its_call_alone() -> None:
    async def scenario() -> None:
        scheduler, (a,) = scheduler_with(1)
        held = submit(scheduler, "work", "held")
        bad, good = (submit(scheduler, "work", p) for p in ("bad", "good"))
        unencodable = TypeError("cannot encode")
        a.refuse = lambda payload: unencodable if payload == "bad" else None
        a.answer(0)
        await held.future
        # The slot went to "bad", which failed at once; "good" took it in the same turn.
        assert a.payloads() == ["held", "good"]
        with pytest.raises(TypeError) as info:
            await bad.future
        assert info.value is unencodable
        assert not good.future.done()
        assert scheduler.stats["failures"] == 1

    run(scenario)


def test_latest_wins_a_queued_call_is_replaced_and_both_callers_get_the_newer_reply() -> None:
    async def scenario() -> None:
        scheduler, (a,) = scheduler_with(1)
        submit(scheduler, "work", "held")
        sets = [submit(scheduler, "set", version) for version in (1, 2, 3)]
        assert scheduler.stats["superseded"] == 2
        a.answer(0)
        await asyncio.sleep(0)
        assert a.payloads() == ["held", 3]
        a.answer(1)
        assert await asyncio.gather(*(w.future for w in sets)) == [[3], [3], [3]]

    run(scenario)


def test_a_deadline_with_no_replica_up_names_the_group() -> None:
    async def scenario() -> None:
        scheduler, _ = scheduler_with(0)
        work = submit(scheduler, "work", 1, timeout=0.05)
        with pytest.raises(DeadlineExceededError) as info:
            await work.future
        assert info.value.replica is None  # no replica took it
        assert str(info.value) == (
            "request 'work' to g (no replica took it: none was up with a free slot) got no "
            "answer within its deadline of 0.050 s; the peer is slow, hung or gone. Raise the "
            "timeout if the work is legitimately long."
        )
        assert not scheduler.queue

    run(scenario)


def test_a_deadline_in_flight_names_the_replica_and_keeps_the_pid_and_incarnation() -> None:
    async def scenario() -> None:
        scheduler, (a, b) = scheduler_with(1, 1)
        work = submit(scheduler, "work", "x", timeout=5.0)
        a.sent[0].reply.set_exception(
            DeadlineExceededError("ipc://g0", "work", 5.0, pid=4242, incarnation=3)
        )
        with pytest.raises(DeadlineExceededError) as info:
            await work.future
        assert (info.value.peer, info.value.pid, info.value.incarnation, info.value.replica) == (
            "g[0] (ipc://g0)",
            4242,
            3,
            0,
        )
        assert str(info.value) == (
            "request 'work' to g[0] (ipc://g0) got no answer within its deadline of 5.000 s; "
            "the peer (pid 4242, incarnation 3) is slow, hung or gone. Raise the timeout if the "
            "work is legitimately long."
        )
        # Its deadline is spent: it is not run again elsewhere.
        assert (b.sent, scheduler.stats["retries"], scheduler.stats["failures"]) == ([], 0, 1)

    run(scenario)


def test_once_its_owner_failed_every_queued_and_later_call_fails_with_the_error() -> None:
    async def scenario() -> None:
        scheduler, _ = scheduler_with(0, 0)
        queued = [submit(scheduler, "work", 1), submit(scheduler, "work", 2, target=1)]
        failure = ExceptionGroup("unhandled errors in a TaskGroup", [RuntimeError("bug")])
        scheduler.fail_all(failure)
        later = submit(scheduler, "work", 3)
        for work in (*queued, later):
            with pytest.raises(ExceptionGroup) as info:
                await work.future
            assert info.value is failure
        assert scheduler.stats["failures"] == 3
        assert not scheduler.queue and not scheduler.replicas[1].queue

    run(scenario)


SHUTTING_DOWN = (
    "role g is dead: the run is shutting down (the driver closed its connections with this call "
    "still queued or in flight); nothing will answer it again in this run, so retrying cannot "
    "help. The run's report says why it ended."
)


def test_closing_fails_queued_and_later_calls_with_role_dead() -> None:
    async def scenario() -> None:
        scheduler, (a, _) = scheduler_with(1, 0)
        submit(scheduler, "work", "held", affinity="k")  # takes replica 0's only slot
        queued = [
            submit(scheduler, "work", "preferring", affinity="k"),
            submit(scheduler, "work", "shared"),
            submit(scheduler, "work", "aimed", target=1),
        ]
        assert [w.payload for w in scheduler.replicas[0].soft] == ["preferring"]
        assert [w.payload for w in scheduler.queue] == ["shared"]
        assert [w.payload for w in scheduler.replicas[1].queue] == ["aimed"]
        scheduler.close()
        later = submit(scheduler, "work", "late")
        for work in (*queued, later):
            with pytest.raises(RoleDeadError) as info:
                await work.future
            assert str(info.value) == SHUTTING_DOWN
            assert (info.value.role, info.value.replica) == ("g", None)
            assert info.value.__cause__ is None
            assert not work.armed
        assert scheduler.stats["failures"] == 4
        assert not scheduler.queue and not any(r.queue or r.soft for r in scheduler.replicas)
        assert a.payloads() == ["held"]

    run(scenario)


def test_after_closing_a_call_in_flight_is_never_sent_again() -> None:
    """Its client closing under it, or a broken connection that would re-run it, fails it
    with RoleDeadError (the error as its cause); an answer still reaches its caller."""

    async def scenario() -> None:
        scheduler, (a, b) = scheduler_with(4, 4)
        works = [submit(scheduler, "work", n) for n in range(4)]
        assert (a.payloads(), b.payloads()) == ([0, 2], [1, 3])
        scheduler.close()
        closed = ClosedError("client driver->g.0 was closed")
        broken = DisconnectedError("the connection to ipc://g1 broke")
        refused = RemoteError("handler_error", "bad payload 2", remote_type="ValueError")
        a.sent[0].reply.set_exception(closed)
        b.sent[0].reply.set_exception(broken)
        a.sent[1].reply.set_exception(refused)
        b.answer(1)
        for work, cause in ((works[0], closed), (works[1], broken)):
            with pytest.raises(RoleDeadError) as info:
                await work.future
            assert str(info.value) == SHUTTING_DOWN
            assert info.value.__cause__ is cause
        with pytest.raises(RemoteError) as remote:
            await works[2].future
        assert remote.value is refused
        assert await works[3].future == [3]
        assert (len(a.sent), len(b.sent), scheduler.stats["retries"]) == (2, 2, 0)

    run(scenario)


MISMATCH = (
    "protocol version mismatch: this side speaks version 1, the peer ipc://g1 speaks version 2; "
    "run the same asyncrl protocol version on both ends"
)


def test_calls_aimed_at_a_replica_that_cannot_be_spoken_to_fail_at_once() -> None:
    """A replica of another protocol version is lost: what is aimed at it fails with
    RoleDeadError naming it, now and later, rather than wait for its deadline."""

    async def scenario() -> None:
        scheduler, (a, b) = scheduler_with(0, 0)
        aimed = submit(scheduler, "work", "aimed", target=1)
        shared = submit(scheduler, "work", "shared")
        scheduler.lose(1, MISMATCH)
        later = submit(scheduler, "work", "later", target=1)
        for work in (aimed, later):
            with pytest.raises(RoleDeadError) as info:
                await work.future
            assert (info.value.role, info.value.replica) == ("g", 1)
            assert str(info.value) == (
                f"role g[1] is dead: {MISMATCH}; nothing will answer it again in this run, so "
                "retrying cannot help. The run's report says why it ended."
            )
        # The rest of the group still takes the other work.
        assert [w.payload for w in scheduler.queue] == ["shared"]
        scheduler.credit(0, 1, incarnation=0)
        a.answer(0)
        assert await shared.future == ["shared"]
        assert b.sent == []
        assert (scheduler.stats["replicas_lost"], scheduler.stats["failures"]) == (1, 2)

    run(scenario)


def test_once_no_replica_can_be_spoken_to_every_call_fails() -> None:
    async def scenario() -> None:
        scheduler, _ = scheduler_with(0, 0)
        queued = submit(scheduler, "work", "queued")
        scheduler.lose(0, "protocol version mismatch (replica 0)")
        assert scheduler.all_lost() is None and list(scheduler.queue) == [queued]
        scheduler.lose(1, "protocol version mismatch (replica 1)")
        later = submit(scheduler, "work", "later")
        for work in (queued, later):
            with pytest.raises(RoleDeadError) as info:
                await work.future
            assert (info.value.role, info.value.replica) == ("g", None)
            assert info.value.reason == (
                "none of its replicas can be spoken to (replica 0: protocol version mismatch "
                "(replica 0); replica 1: protocol version mismatch (replica 1))"
            )
        assert not scheduler.queue

    run(scenario)


def test_a_departed_replica_s_calls_run_again_once_elsewhere_and_it_takes_no_more() -> None:
    """Its node lost for good: the idempotent call it held runs again on the other replica
    (attempt 1, once), the once call fails as broken (its caller may send it again), what was
    aimed at it fails with RoleDeadError naming the node, and later work never goes to it."""

    async def scenario() -> None:
        scheduler, (a, b) = scheduler_with(2, 1)
        first = submit(scheduler, "work", "x")  # the freest: replica 0
        once = submit(scheduler, "charge", "c")
        assert [s.payload for s in a.sent] == ["x", "c"]
        aimed = submit(scheduler, "work", "t", target=0)  # replica 0 is full: it waits there
        scheduler.depart(0, "its node 1 was lost")
        assert scheduler.members() == [1]
        with pytest.raises(RoleDeadError) as err:
            await aimed.future
        assert (err.value.replica, "its node 1 was lost" in str(err.value)) == (0, True)
        closed = ClosedError("client driver->g.0 is closed or not connected")
        for sent in a.sent:
            sent.reply.set_exception(closed)
        await asyncio.sleep(0)
        assert [(s.payload, s.attempt) for s in b.sent] == [("x", 1)]
        with pytest.raises(BrokenError) as broke:
            await once.future
        assert str(broke.value) == "g[0] left the run with its node with the call in flight"
        assert broke.value.__cause__ is closed
        b.answer(0)
        assert await first.future == ["x"]
        later = submit(scheduler, "work", "y")
        scheduler.credit(1, 1, incarnation=0)
        assert [s.payload for s in b.sent] == ["x", "y"] and len(a.sent) == 2
        b.answer(1)
        assert await later.future == ["y"]
        stats = scheduler.stats
        assert (stats["retries"], stats["replicas_departed"]) == (1, 1)

    run(scenario)


def test_a_rebound_replica_s_calls_run_again_when_it_serves_at_its_new_address() -> None:
    async def scenario() -> None:
        scheduler, (a,) = scheduler_with(1)
        work = submit(scheduler, "work", "x")
        scheduler.rebind(0)
        a.sent[0].reply.set_exception(ClosedError("client driver->g.0 is closed"))
        await asyncio.sleep(0)
        moved = FakeClient()
        scheduler.attach(0, moved)
        assert moved.sent == []  # no credit from the new incarnation yet
        scheduler.credit(0, 1, incarnation=0)
        assert [(s.payload, s.attempt) for s in moved.sent] == [("x", 1)]
        moved.answer(0)
        assert await work.future == ["x"]
        assert scheduler.members() == [0]

    run(scenario)
