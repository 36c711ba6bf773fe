"""The fake clock: timers run in due order at their due time, sleepers wake once it passes."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.clock import MONOTONIC, FakeClock
from asyncrl.transport import run


def test_timers_run_in_due_order_each_at_its_time() -> None:
    clock = FakeClock(10.0)
    seen: list[tuple[str, float]] = []
    clock.call_later(2.0, lambda: seen.append(("b", clock.now())))
    clock.call_later(1.0, lambda name: seen.append((name, clock.now())), "a")
    clock.call_later(2.0, lambda: seen.append(("c", clock.now())))  # a tie: set after b
    clock.call_later(5.0, lambda: seen.append(("d", clock.now()))).cancel()
    assert clock.timers == 3
    clock.advance(1.5)
    assert seen == [("a", 11.0)] and clock.now() == 11.5
    clock.advance(10.0)
    assert seen == [("a", 11.0), ("b", 12.0), ("c", 12.0)]
    assert clock.now() == 21.5 and clock.timers == 0
    with pytest.raises(ValueError, match=r"a monotonic clock never goes back: advance\(-1\)"):
        clock.advance(-1)


def test_a_sleeper_wakes_once_the_clock_passes_its_end() -> None:
    async def main() -> None:
        clock = FakeClock()
        sleeper = asyncio.ensure_future(clock.sleep(3.0))
        await clock.wait_for_timers(1)
        clock.advance(2.0)
        await asyncio.sleep(0)
        assert not sleeper.done()
        clock.advance(1.0)
        await asyncio.wait_for(sleeper, 5.0)
        cancelled = asyncio.ensure_future(clock.sleep(1.0))
        await clock.wait_for_timers(1)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert clock.timers == 0  # a cancelled sleep takes its timer with it

    run(main())


def test_the_real_clock_is_monotonic_and_sleeps_on_the_loop() -> None:
    async def main() -> None:
        before = MONOTONIC.now()
        fired = asyncio.Event()
        MONOTONIC.call_later(0.0, fired.set)
        await asyncio.wait_for(fired.wait(), 5.0)
        await MONOTONIC.sleep(0)
        assert MONOTONIC.now() >= before

    run(main())
