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
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["Deadlines", "Expiring"]

EARLY_S = 1e-3
"""A deadline this close counts as reached when the timer fires (loops round their timers)."""


class Expiring(Protocol):
    """What ``Deadlines`` needs of a call (``asyncrl.dispatch.scheduler.Work`` is one)."""

    deadline: float  # on the loop's clock
    armed: list[Any] | None  # its entry while armed; set and cleared by Deadlines only
    future: asyncio.Future[object]


W = TypeVar("W", bound=Expiring)


class Deadlines(Generic[W]):
    """Calls ``expire(work)`` for each armed work whose deadline passed.

    Args:
        expire: called once per work still armed at its deadline (disarmed first).
    """

    def __init__(self, expire: Callable[[W], None]) -> None:
        self._expire = expire
        # [deadline, arrival, work]; the work is None once disarmed (ties go by arrival, so
        # works are never compared)
        self._heap: list[list[Any]] = []
        self._order = itertools.count()
        self._armed = 0
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the timer's
        self._at = math.inf  # when the timer fires

    def __len__(self) -> int:
        """The works armed now."""
        return self._armed

    def arm(self, work: W) -> None:
        """Expire ``work`` at its deadline unless it is disarmed first; nothing if it is armed
        already or its future is done."""
        if work.armed is not None or work.future.done():
            return
        entry = [work.deadline, next(self._order), work]
        work.armed = entry
        self._armed += 1
        heapq.heappush(self._heap, entry)
        loop = work.future.get_loop()
        if work.deadline < self._at or loop is not self._loop:  # or the last loop closed
            self._schedule(loop, self._heap[0][0])

    def disarm(self, work: W) -> None:
        """``work`` was sent or ended: it no longer expires here, and is no longer held."""
        if not self._release(work):
            return
        if len(self._heap) > 2 * self._armed + 1024:  # mostly empty entries: build it anew
            self._heap = [e for e in self._heap if e[2] is not None]
            heapq.heapify(self._heap)

    def _release(self, work: W) -> bool:
        """Empty ``work``'s entry; False when it was not armed."""
        entry = work.armed
        if entry is None:
            return False
        entry[2] = None
        work.armed = None
        self._armed -= 1
        return True

    def close(self) -> None:
        """Stop the timer and let go of every work (the caller fails or drops them)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._loop, self._at = None, None, math.inf
        for entry in self._heap:
            if entry[2] is not None:
                entry[2].armed = None
        self._heap.clear()
        self._armed = 0

    def _schedule(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._loop, self._at = loop, at
        self._timer = loop.call_at(at, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer, self._at = None, math.inf
        heap = self._heap
        now = loop.time() + EARLY_S
        due = []
        while heap and (heap[0][0] <= now or heap[0][2] is None):
            work = heapq.heappop(heap)[2]
            if work is not None:
                self._release(work)  # no rebuild while this loop holds the heap
                due.append(work)
        if heap:
            self._schedule(loop, heap[0][0])
        for work in due:  # each on its own, as its own timer did: one that raises stops none
            loop.call_soon(self._expire, work)
