"""``Deadlines``: queued calls expire at their deadlines through one loop timer, on a fake loop
whose clock the test moves."""

from __future__ import annotations

import gc
import weakref
from typing import Any

from asyncrl.dispatch.deadlines import EARLY_S, Deadlines


class FakeTimer:
    def __init__(self, at: float, callback: Any, args: tuple[Any, ...]) -> None:
        self.at, self.callback, self.args = at, callback, args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeLoop:
    """The loop's clock and timers, as ``Deadlines`` uses them."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[FakeTimer] = []
        self.soon: list[tuple[Any, tuple[Any, ...]]] = []

    def time(self) -> float:
        return self.now

    def call_at(self, at: float, callback: Any, *args: Any) -> FakeTimer:
        timer = FakeTimer(at, callback, args)
        self.timers.append(timer)
        return timer

    def call_soon(self, callback: Any, *args: Any) -> None:
        self.soon.append((callback, args))

    def run_soon(self) -> None:
        while self.soon:
            callback, args = self.soon.pop(0)
            callback(*args)

    def pending(self) -> list[FakeTimer]:
        return [t for t in self.timers if not t.cancelled]

    def advance(self, to: float) -> None:
        """Move the clock to ``to``, firing the timers due on the way, in order."""
        while True:
            due = [t for t in self.pending() if t.at <= to]
            if not due:
                break
            timer = min(due, key=lambda t: t.at)
            timer.cancelled = True  # fired
            self.now = max(self.now, timer.at)
            timer.callback(*timer.args)
            self.run_soon()
        self.now = to


class FakeFuture:
    def __init__(self, loop: FakeLoop) -> None:
        self.loop = loop
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def get_loop(self) -> FakeLoop:
        return self.loop


class Call:
    def __init__(self, name: str, deadline: float, loop: FakeLoop) -> None:
        self.name = name
        self.deadline = deadline
        self.armed: list[Any] | None = None
        self.future = FakeFuture(loop)


def setup() -> tuple[FakeLoop, Deadlines[Any], list[str]]:
    loop, expired = FakeLoop(), []
    return loop, Deadlines(lambda call: expired.append(call.name)), expired


def test_calls_expire_at_their_deadlines_in_order_through_one_timer() -> None:
    loop, deadlines, expired = setup()
    calls = [Call(f"c{i}", 1.0 + i, loop) for i in range(1000)]
    for call in calls:
        deadlines.arm(call)
    assert len(deadlines) == 1000 and len(loop.timers) == 1  # one timer, at the earliest
    assert loop.timers[0].at == 1.0
    deadlines.disarm(calls[1])  # sent before its deadline: never expires here
    deadlines.disarm(calls[1])  # twice is once
    loop.advance(3.5)
    assert expired == ["c0", "c2"]
    assert not calls[0].armed and not calls[2].armed and calls[3].armed
    assert [t.at for t in loop.pending()] == [4.0]  # the next one's
    loop.advance(1002.0)
    assert expired == ["c0"] + [f"c{i}" for i in range(2, 1000)]
    assert len(deadlines) == 0 and not loop.pending()
    assert len(loop.timers) == 999  # a timer per deadline reached, one pending at a time


def test_an_earlier_deadline_moves_the_timer_and_a_done_call_is_never_armed() -> None:
    loop, deadlines, expired = setup()
    late, early, done = Call("late", 10.0, loop), Call("early", 2.0, loop), Call("done", 1.0, loop)
    done.future.finished = True
    deadlines.arm(late)
    deadlines.arm(early)
    deadlines.arm(done)
    deadlines.arm(early)  # armed already: no second entry
    assert not done.armed and len(deadlines) == 2
    assert [t.at for t in loop.pending()] == [2.0]
    # A loop may fire a timer a little early (it rounds): the deadline counts as reached.
    (timer,) = loop.pending()
    loop.now = 2.0 - EARLY_S / 2
    timer.cancelled = True
    timer.callback(*timer.args)
    loop.run_soon()
    assert expired == ["early"]
    assert [t.at for t in loop.pending()] == [10.0]
    loop.advance(20.0)
    assert expired == ["early", "late"]


def test_an_expiry_may_arm_another_call() -> None:
    loop, expired = FakeLoop(), []
    retry = Call("retry", 1.5, loop)

    def expire(call: Call) -> None:
        expired.append(call.name)
        if call.name == "first":
            deadlines.arm(retry)  # earlier than the pending one at 5.0

    deadlines: Deadlines[Any] = Deadlines(expire)
    deadlines.arm(Call("first", 1.0, loop))
    deadlines.arm(Call("later", 5.0, loop))
    loop.advance(1.0)
    assert [t.at for t in loop.pending()] == [1.5]
    loop.advance(6.0)
    assert expired == ["first", "retry", "later"]


def test_disarmed_entries_do_not_pile_up() -> None:
    loop, deadlines, expired = setup()
    kept = Call("kept", 1e9, loop)
    deadlines.arm(kept)
    for i in range(50_000):  # each sent at once, as most calls are
        call = Call(f"s{i}", 100.0 + i, loop)
        deadlines.arm(call)
        deadlines.disarm(call)
    assert len(deadlines) == 1
    assert len(deadlines._heap) <= 2 * 1 + 1024 + 1
    loop.advance(2e9)
    assert expired == ["kept"]


def test_close_stops_the_timer_and_lets_go_of_every_call() -> None:
    loop, deadlines, expired = setup()
    call = Call("c", 1.0, loop)
    deadlines.arm(call)
    deadlines.close()
    assert not loop.pending() and not call.armed and len(deadlines) == 0
    assert not deadlines._heap
    loop.advance(5.0)
    assert expired == []


def test_a_disarmed_call_is_no_longer_held() -> None:
    loop, deadlines, _ = setup()
    call = Call("c", 600.0, loop)
    deadlines.arm(Call("other", 700.0, loop))
    deadlines.arm(call)
    alive = weakref.ref(call)
    deadlines.disarm(call)
    del call
    gc.collect()
    assert alive() is None  # its payload and result go with it, long before its deadline


def test_a_call_on_another_loop_gets_a_timer_there() -> None:
    # A scheduler that outlives its loop (a test's asyncio.run, then another) still expires.
    first, second = FakeLoop(), FakeLoop()
    expired: list[str] = []
    deadlines: Deadlines[Any] = Deadlines(lambda call: expired.append(call.name))
    deadlines.arm(Call("old", 1.0, first))
    deadlines.arm(Call("new", 5.0, second))  # later, but on a loop with no timer of ours
    assert [t.at for t in second.pending()] == [1.0]
    second.advance(6.0)
    assert expired == ["old", "new"]
