"""The deadlines of queued calls: one event-loop timer for all of them.

A call that waits in a ``Scheduler``'s queues fails at its deadline if no replica took it by
then. A loop timer per queued call cost the driver a tenth of its loop with thousands of calls
queued (docs/scaling.md): each is a handle in the loop's heap, made when the call is queued and
left there until the call ends. ``Deadlines`` keeps the calls in a heap of its own, by deadline,
and one loop timer for the earliest; a call that is sent or ends is *disarmed* (a flag) and its
entry dropped when it reaches the top, or when disarmed entries outnumber armed ones.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

__all__ = ["Deadlines", "Expiring"]

EARLY_S = 1e-3
"""A deadline this close counts as reached when the timer fires (loops round their timers)."""


class Expiring(Protocol):
    """What ``Deadlines`` needs of a call (``asyncrl.dispatch.scheduler.Work`` is one)."""

    deadline: float  # on the loop's clock
    armed: bool  # set and cleared by Deadlines only
    future: asyncio.Future[object]


W = TypeVar("W", bound=Expiring)


class Deadlines(Generic[W]):
    """Calls ``expire(work)`` for each armed work whose deadline passed.

    Args:
        expire: called once per work still armed at its deadline (disarmed first).
    """

    def __init__(self, expire: Callable[[W], None]) -> None:
        self._expire = expire
        self._heap: list[tuple[float, int, W]] = []
        self._order = itertools.count()  # ties by arrival; works are never compared
        self._armed = 0
        self._timer: asyncio.TimerHandle | None = None
        self._at = math.inf  # when the timer fires

    def __len__(self) -> int:
        """The works armed now."""
        return self._armed

    def arm(self, work: W) -> None:
        """Expire ``work`` at its deadline unless it is disarmed first; nothing if it is armed
        already or its future is done."""
        if work.armed or work.future.done():
            return
        work.armed = True
        self._armed += 1
        heap = self._heap
        heapq.heappush(heap, (work.deadline, next(self._order), work))
        if len(heap) > 2 * self._armed + 1024:  # mostly disarmed entries: build it anew
            self._heap = [entry for entry in heap if entry[2].armed]
            heapq.heapify(self._heap)
        if work.deadline < self._at:
            self._schedule(work.future.get_loop(), work.deadline)

    def disarm(self, work: W) -> None:
        """``work`` was sent or ended: it no longer expires here."""
        if work.armed:
            work.armed = False
            self._armed -= 1

    def close(self) -> None:
        """Stop the timer (every armed work is failed or dropped by the caller)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._at = math.inf

    def _schedule(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._at = at
        self._timer = loop.call_at(at, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer, self._at = None, math.inf
        heap = self._heap
        now = loop.time() + EARLY_S
        while heap and (heap[0][0] <= now or not heap[0][2].armed):
            work = heapq.heappop(heap)[2]
            if work.armed:
                self.disarm(work)
                self._expire(work)  # may arm others: they enter the heap and the timer
        if heap and heap[0][0] < self._at:
            self._schedule(loop, heap[0][0])
