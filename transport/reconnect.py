"""Handshaking again after a reconnect: tried until the server answers or the client closes, with
the requests made meanwhile held until it succeeds (``Held``).

A restarted server may block its loop for a while as it starts (imports, loading a checkpoint),
so a try that gets no answer within liveness x interval is simply sent again. Tries that fail at
once (an error reply) are spaced out, from one heartbeat interval, doubling, up to
``REHANDSHAKE_BACKOFF_MAX_S`` apart.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .errors import ClosedError, TransportError
from .inflight import InFlight
from .options import ChannelOptions

__all__ = ["REHANDSHAKE_BACKOFF_MAX_S", "Held", "rehandshake"]

REHANDSHAKE_BACKOFF_MAX_S = 5.0
"""The longest wait between two handshake tries after a reconnect that failed at once."""


async def rehandshake(
    handshake: Callable[[float], Awaitable[object]],
    closed: Callable[[], bool],
    options: ChannelOptions,
    failed: Callable[[int, TransportError], None],
) -> None:
    """Await ``handshake(options.dead_after_s)`` until it succeeds, raises ``ClosedError``, or
    ``closed()`` is true; ``failed(tries, error)`` is told of each try that failed.

    Raises nothing of the handshake's: a ``TransportError`` is retried, ``ClosedError`` ends it.
    """
    backoff = options.heartbeat_interval_s
    tries = 0
    while not closed():
        tries += 1
        started = time.monotonic()
        try:
            await handshake(options.dead_after_s)
            return
        except ClosedError:
            return
        except TransportError as exc:
            failed(tries, exc)
            if time.monotonic() - started < options.dead_after_s / 2:
                await asyncio.sleep(backoff)  # an immediate failure: do not spin
                backoff = min(backoff * 2, REHANDSHAKE_BACKOFF_MAX_S)


class Held:
    """Requests made while a client's connection is broken, sent once it has handshaken again.

    A server of a run refuses every request from a peer that has not presented the run's secret
    on the connection (``admission.py``), and a restarted server has seen no handshake yet: a
    request sent before the new handshake would be refused rather than served.
    """

    def __init__(self) -> None:
        self._items: list[tuple[int, list[Any], list[int]]] | None = None

    @property
    def holding(self) -> bool:
        """True from a broken connection until the next handshake succeeds."""
        return self._items is not None

    def start(self) -> None:
        """The connection broke: hold requests from now on."""
        if self._items is None:
            self._items = []

    def slots(self) -> set[int]:
        """The shared-memory slots of the held requests."""
        return {slot for _, _, slots in self._items or () for slot in slots}

    def add(self, request_id: int, frames: list[Any], slots: list[int]) -> None:
        """Hold request ``request_id`` (its frames, and the shared-memory slots they use)."""
        assert self._items is not None
        self._items.append((request_id, frames, slots))

    def release(
        self,
        in_flight: InFlight,
        send: Callable[[list[Any]], object],
        give_back: Callable[[list[int]], None],
    ) -> None:
        """The handshake succeeded: ``send`` each held request still in flight (one that cannot
        be sent fails with the error), ``give_back`` the slots of the others; stop holding."""
        items, self._items = self._items or [], None
        for request_id, frames, slots in items:
            if request_id in in_flight:
                try:
                    send(frames)
                    continue
                except TransportError as exc:
                    pending = in_flight.pop(request_id)
                    if pending is not None and not pending.fut.done():
                        pending.fut.set_exception(exc)
            give_back(slots)
