"""Posting contributions to a ``Reducer`` in another process, acknowledged asynchronously.

A ``Poster`` sends ``Contribution`` messages to a server method (``contribute``) that
``serve_reducer`` implements. ``post`` returns at once; the contribution stays pending until the
server's reply, the acknowledgement, arrives: ``True`` if it was merged, ``False`` if it was a
duplicate or late (nothing more to do either way). If the request fails because the connection
broke, the server restarted or its deadline passed, the contribution is sent again once the
client is connected, until it is acknowledged or the poster is closed. A contribution can thus
arrive more than once; de-duplication by ``(key, part)`` on the reducer makes that harmless.
Only an error reply that is not retryable (a malformed contribution) ends the attempts; it is
counted as ``rejected`` and kept in ``Poster.rejected``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

from asyncrl.errors import (
    ClosedError,
    FlushDeadlineError,
    RemoteError,
    TransportError,
)
from asyncrl.reduce import Moments, Reducer
from asyncrl.transport import Call, ChannelOptions, Client, PeerEvent

__all__ = ["Contribution", "FlushDeadlineError", "Poster", "serve_reducer"]

log = logging.getLogger("asyncrl.post")


class Contribution(msgspec.Struct, frozen=True, array_like=True):
    """One part of one round, on its way to the reducer.

    Attributes:
        key: the round.
        part: this part's id, unique within the round (a re-sent part carries the same id).
        moments: the part's moments.
        expected: the number of parts the round expects (opens it if it is new).
        sender: who posted it, for logs.
    """

    key: str
    part: str
    moments: Moments
    expected: int
    sender: str


def serve_reducer(reducer: Reducer) -> Callable[[Any, Call], bool]:
    """The server handler that merges ``Contribution`` requests into ``reducer``.

    Register it with ``server.add("contribute", serve_reducer(reducer), Contribution)``. It
    replies True if the contribution was merged, False if it was a duplicate or late; both are
    acknowledgements. A payload that is not a contribution, or an ``expected`` that disagrees
    with the round's, is an error reply (not retryable).
    """

    def contribute(payload: Any, call: Call) -> bool:
        c = payload if isinstance(payload, Contribution) else msgspec.convert(payload, Contribution)
        merged = reducer.add(c.key, c.part, c.moments, expected=c.expected)
        if not merged:
            log.debug("reducer: part %r of %r from %s not merged", c.part, c.key, c.sender)
        return merged

    return contribute


_ACK_EVENTS = ("connected", "restarted", "alive")
_LOST_EVENTS = ("disconnected", "dead")


class Poster:
    """Posts contributions to a reducer's server and re-sends them until acknowledged.

    The poster owns its ``Client`` (``client``), made with the poster's peer-event handler so
    that it learns of reconnections.

    Args:
        endpoint: the reducer server's endpoint.
        name: this poster's name, sent in the handshake and used in logs.
        method: the server method that takes contributions.
        timeout_s: the deadline of each send; an unanswered send is sent again.
        retry_s: the wait before failed contributions are sent again while the connection is
            up (after a reconnection they are sent at once).
        options: the client's channel options.
        incarnation: this process's restart count.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        name: str = "poster",
        method: str = "contribute",
        timeout_s: float = 5.0,
        retry_s: float = 0.5,
        options: ChannelOptions | None = None,
        incarnation: int = 0,
    ) -> None:
        self.method = method
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.client = Client(
            endpoint, name=name, incarnation=incarnation, options=options, on_event=self._on_event
        )
        self.stats: Counter[str] = Counter()
        self.rejected: list[tuple[Contribution, RemoteError]] = []
        self._pending: dict[tuple[str, str], Contribution] = {}
        self._inflight: set[tuple[str, str]] = set()
        self._attempts: dict[tuple[str, str], int] = {}
        self._connected = False
        self._closed = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._retry: asyncio.TimerHandle | None = None

    async def connect(self, timeout: float = 10.0) -> None:
        """Connect to the server; contributions posted before are sent now.

        Raises:
            DeadlineExceededError: no handshake answer within ``timeout`` seconds.
        """
        await self.client.connect(timeout)
        self._connected = True
        self._send_waiting()

    async def __aenter__(self) -> Poster:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def pending(self) -> int:
        """Contributions posted and not yet acknowledged."""
        return len(self._pending)

    def post(self, contribution: Contribution) -> None:
        """Send ``contribution`` now and keep it until acknowledged; returns at once.

        Posting a part that is still pending does nothing.

        Raises:
            ClosedError: the poster is closed.
        """
        if self._closed:
            raise ClosedError(f"poster {self.client.name} is closed; it posts nothing more")
        ident = (contribution.key, contribution.part)
        if ident in self._pending:
            return
        self._pending[ident] = contribution
        self._idle.clear()
        self.stats["posted"] += 1
        if self._connected:
            self._send(ident)

    async def flush(self, timeout: float = 30.0) -> None:
        """Wait until every posted contribution is acknowledged.

        Raises:
            FlushDeadlineError: some are still unacknowledged after ``timeout`` seconds.
            ClosedError: the poster was closed with some unacknowledged.
        """
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            raise FlushDeadlineError(
                self.client.endpoint, self.method, timeout, len(self._pending)
            ) from None
        if self._pending:
            raise ClosedError(
                f"poster {self.client.name} was closed with {len(self._pending)} contributions "
                f"unacknowledged"
            )

    async def close(self) -> None:
        """Stop re-sending and close the client; what is unacknowledged stays in ``pending``."""
        if self._closed:
            return
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._idle.set()  # wakes flush(), which reports what was left
        await self.client.close()

    # -- internals ------------------------------------------------------------------------

    def _send(self, ident: tuple[str, str]) -> None:
        attempt = self._attempts.get(ident, 0)
        try:
            fut = self.client.call_future(
                self.method, self._pending[ident], bool, timeout=self.timeout_s, attempt=attempt
            )
        except TransportError:
            self._arm_retry()
            return
        self._attempts[ident] = attempt + 1
        self._inflight.add(ident)
        self.stats["sends" if attempt == 0 else "resends"] += 1
        fut.add_done_callback(functools.partial(self._answered, ident))

    def _answered(self, ident: tuple[str, str], fut: asyncio.Future[Any]) -> None:
        self._inflight.discard(ident)
        if self._closed or fut.cancelled() or ident not in self._pending:
            return
        exc = fut.exception()
        if exc is None:
            self.stats["merged" if fut.result() else "refused"] += 1
            self._done(ident)
        elif isinstance(exc, RemoteError) and not exc.retryable:
            self.stats["rejected"] += 1
            self.rejected.append((self._pending[ident], exc))
            log.warning("poster %s: contribution %r rejected: %s", self.client.name, ident, exc)
            self._done(ident)
        else:
            self.stats["failed_sends"] += 1
            self._arm_retry()

    def _done(self, ident: tuple[str, str]) -> None:
        del self._pending[ident]
        self._attempts.pop(ident, None)
        self.stats["acked"] += 1
        if not self._pending:
            self._idle.set()

    def _on_event(self, event: PeerEvent) -> None:
        if event.kind in _ACK_EVENTS:
            self._connected = True
            self._send_waiting()
        elif event.kind in _LOST_EVENTS:
            self._connected = False

    def _arm_retry(self) -> None:
        if self._retry is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._retry = loop.call_later(self.retry_s, self._on_retry)

    def _on_retry(self) -> None:
        self._retry = None
        # While disconnected, the reconnection's peer event sends them instead.
        if self._connected:
            self._send_waiting()

    def _send_waiting(self) -> None:
        if self._closed:
            return
        for ident in [i for i in self._pending if i not in self._inflight]:
            self._send(ident)
