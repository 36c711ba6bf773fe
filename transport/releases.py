"""Shared-memory slots a receiver is done with, owed back to the peers that lent them.

A tensor that arrived through the sender's shared-memory pool holds its slot until the receiver
drops it, in whatever thread that happens. Each release is carried to the event loop and batched:
one RELEASE message per peer per turn of the loop, however many tensors were dropped (see
docs/protocol.md, Shared memory).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .errors import TransportError

__all__ = ["Releases"]


class Releases:
    """The RELEASE messages this side owes, by peer routing id (``b""``: a client's one server).

    Args:
        send: sends one RELEASE of ``slots`` to ``peer``; a ``TransportError`` it raises means
            the peer is gone, and that peer reclaims its own slots.
        closed: whether the owner is closed; nothing is sent once it is.
    """

    def __init__(
        self, send: Callable[[bytes, list[int]], None], closed: Callable[[], bool]
    ) -> None:
        self._send = send
        self._closed = closed
        self._pending: dict[bytes, list[int]] = {}
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def callback(self, peer: bytes) -> Callable[[int], None]:
        """A release callback for tensors from ``peer``, callable from any thread; call it from
        the event loop's thread (the first call captures the running loop, which its owner's
        socket is bound to: ``asyncio.get_running_loop`` makes a system call, ``getpid``, each
        time, and this is called for every message received)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()

        def release(slot: int) -> None:
            if not self._closed():
                try:
                    loop.call_soon_threadsafe(self.queue, peer, [slot])
                except RuntimeError:
                    pass  # the loop is closed: the sender reclaims its slots itself

        return release

    def queue(self, peer: bytes, slots: list[int]) -> None:
        """Owe ``slots`` to ``peer``; sent with the others at the end of this turn of the loop."""
        if not slots:
            return
        self._pending.setdefault(peer, []).extend(slots)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        self._scheduled = False
        if self._closed():
            return
        for peer, slots in pending.items():
            try:
                self._send(peer, slots)
            except TransportError:
                pass  # the peer is gone; it reclaims its own slots
