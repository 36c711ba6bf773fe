"""Clocks: what a component reads the time from, sets its timers on and sleeps with.

A component that measures durations or acts at deadlines (the reducer's straggler deadlines,
the weight sync's retries) takes a ``Clock``, by default ``MONOTONIC``: ``time.monotonic()``,
and the running event loop's timers and ``asyncio.sleep`` (the loop's clock is
``time.monotonic()`` too). A test passes a ``FakeClock`` instead, which moves only when the test
calls ``advance``: deadlines then fire at exact, chosen times, and no test sleeps or depends on
how loaded the machine is.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["MONOTONIC", "Clock", "FakeClock", "MonotonicClock", "Timer"]


class Timer(Protocol):
    """A callback set to run later; ``cancel`` it to keep it from running."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic time in seconds, timers, and sleeping."""

    def now(self) -> float:
        """Seconds since some fixed point; never goes back."""
        ...

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Timer:
        """Run ``callback(*args)`` once, ``delay`` seconds from now."""
        ...

    async def sleep(self, delay: float) -> None:
        """Return ``delay`` seconds from now."""
        ...


class MonotonicClock:
    """The real clock: ``time.monotonic()``, the running loop's timers and ``asyncio.sleep``.

    ``call_later`` and ``sleep`` need a running event loop.
    """

    def now(self) -> float:
        return time.monotonic()

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Timer:
        return asyncio.get_running_loop().call_later(delay, callback, *args)

    async def sleep(self, delay: float) -> None:
        await asyncio.sleep(delay)


MONOTONIC = MonotonicClock()
"""The default clock of every component that takes one."""


class _FakeTimer:
    __slots__ = ("args", "callback", "cancelled", "due")

    def __init__(self, due: float, callback: Callable[..., object], args: tuple[Any, ...]) -> None:
        self.due = due
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeClock:
    """A clock that moves only when ``advance`` is called (for tests).

    Timers run synchronously inside ``advance``, in the order they are due (ties in the order
    they were set), each with ``now()`` at its due time; ``call_later`` needs no event loop.
    ``sleep`` returns once the clock was advanced past its end, on the sleeper's next turn of
    the loop.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._heap: list[tuple[float, int, _FakeTimer]] = []
        self._order = itertools.count()
        self._armed: asyncio.Event | None = None

    def now(self) -> float:
        return self._now

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Timer:
        timer = _FakeTimer(self._now + max(0.0, delay), callback, args)
        heapq.heappush(self._heap, (timer.due, next(self._order), timer))
        if self._armed is not None:
            self._armed.set()
        return timer

    async def sleep(self, delay: float) -> None:
        woken = asyncio.get_running_loop().create_future()
        timer = self.call_later(delay, _wake, woken)
        try:
            await woken
        finally:
            timer.cancel()

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` on, running every timer due by then.

        Raises:
            ValueError: ``seconds`` is negative (a monotonic clock never goes back).
        """
        if seconds < 0:
            raise ValueError(f"a monotonic clock never goes back: advance({seconds})")
        end = self._now + seconds
        while self._heap and self._heap[0][0] <= end:
            due, _, timer = heapq.heappop(self._heap)
            if timer.cancelled:
                continue
            self._now = due
            timer.callback(*timer.args)
        self._now = end

    @property
    def timers(self) -> int:
        """Timers set and neither run nor cancelled."""
        return sum(1 for _, _, t in self._heap if not t.cancelled)

    async def wait_for_timers(self, n: int = 1) -> None:
        """Wait until at least ``n`` timers are set (a sleeper has gone to sleep)."""
        while self.timers < n:
            if self._armed is None:
                self._armed = asyncio.Event()
            self._armed.clear()
            await self._armed.wait()


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)
