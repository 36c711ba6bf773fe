"""Handshaking again after a reconnect: tried until the server answers or the client closes.

A restarted server may block its loop for a while as it starts (imports, loading a checkpoint),
so a try that gets no answer within liveness x interval is simply sent again. Tries that fail at
once (an error reply) are spaced out, from one heartbeat interval, doubling, up to
``REHANDSHAKE_BACKOFF_MAX_S`` apart.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from .errors import ClosedError, TransportError
from .options import ChannelOptions

__all__ = ["REHANDSHAKE_BACKOFF_MAX_S", "rehandshake"]

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
