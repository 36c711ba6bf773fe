"""The requests a client has sent and not yet had answered, and their deadlines.

One timer serves every deadline, armed for the earliest: a timer per request would cost more than
the rest of a call's bookkeeping together. When it fires, every request whose deadline passed is
taken out of the table and handed to the owner, which fails it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

from .errors import DeadlineExceededError, TransportError
from .protocol import Hello

__all__ = ["TIMER_SLACK_S", "InFlight", "Pending"]

TIMER_SLACK_S = 0.001
"""Loop timers may fire up to this much early: a deadline this close counts as passed."""


class Pending:
    """One request in flight: the future its caller awaits, and what its errors name."""

    __slots__ = ("deadline", "fut", "method", "peer", "reply_type", "timeout")

    def __init__(
        self,
        fut: asyncio.Future[Any],
        deadline: float,
        reply_type: Any,
        method: str,
        timeout: float,
        peer: Hello | None = None,
    ) -> None:
        self.fut = fut
        self.deadline = deadline  # on the loop's clock
        self.reply_type = reply_type
        self.method = method
        self.timeout = timeout
        self.peer = peer  # the server's handshake when the request was sent; None if none yet

    def deadline_error(self, endpoint: str) -> DeadlineExceededError:
        """The error for a deadline that passed: it names the server's pid and incarnation when
        a handshake had told them before the request was sent."""
        if self.peer is None:
            return DeadlineExceededError(endpoint, self.method, self.timeout)
        return DeadlineExceededError(
            endpoint,
            self.method,
            self.timeout,
            pid=self.peer.pid,
            incarnation=self.peer.incarnation,
        )


class InFlight:
    """The table of requests in flight, by request id, with one timer for their deadlines.

    Args:
        expired: called with each request whose deadline passed and whose future is not done
            yet; the request is already out of the table.
    """

    def __init__(self, expired: Callable[[Pending], None]) -> None:
        self._expired = expired
        self._pending: dict[int, Pending] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._closed = False

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._pending

    def add(self, request_id: int, pending: Pending) -> None:
        """Track ``pending`` under ``request_id`` until it is popped, failed or expires."""
        self._pending[request_id] = pending
        if self._timer is None or pending.deadline < self._timer_at:
            self._arm(pending.deadline)

    def pop(self, request_id: int) -> Pending | None:
        """Take the request out of the table (its answer came, or sending it failed)."""
        return self._pending.pop(request_id, None)

    def fail_all(self, make: Callable[[Pending], TransportError]) -> None:
        """Empty the table, failing each request not yet done with ``make(request)``."""
        pending, self._pending = self._pending, {}
        for p in pending.values():
            if not p.fut.done():
                p.fut.set_exception(make(p))

    def close(self) -> None:
        """Stop the deadline timer; requests left in the table stay for ``fail_all``."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = asyncio.get_running_loop().call_at(when, self._expire_due)

    def _expire_due(self) -> None:
        self._timer = None
        now = asyncio.get_running_loop().time() + TIMER_SLACK_S
        earliest = math.inf
        for request_id, pending in list(self._pending.items()):
            if pending.deadline <= now:
                del self._pending[request_id]
                if not pending.fut.done():
                    self._expired(pending)
            elif pending.deadline < earliest:
                earliest = pending.deadline
        if earliest < math.inf and not self._closed:
            self._arm(earliest)
