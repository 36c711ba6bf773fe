"""The clients a server knows: what each said in its handshake, when it was last heard, and the
periodic sweep that forgets those silent for longer than liveness x interval.

Forgetting is not refusing: the next message from the same routing id is served normally (see
docs/protocol.md, Heartbeats), and a peer the server admitted (``admission.Gate``) stays admitted
while its connection lasts.
What is lost is the rest of its handshake, so it gets no shared memory until it handshakes again,
and the shared-memory slots the server lent it are taken back.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from .options import ChannelOptions
from .protocol import Hello
from .shm import ShmPool
from .tracing import clock

__all__ = ["PeerInfo", "Peers"]


@dataclass(slots=True)
class PeerInfo:
    """What the server knows about one connected client."""

    identity: bytes
    heard_ns: int  # when it was last heard, on the monotonic clock in ns (``tracing.clock``)
    hello: Hello | None = None
    shm: bool = False
    shm_in: bool = False  # may send this server shared-memory tensors (handshook from this host)
    admitted: bool = False  # the server's Gate admits it (checked once, then remembered here)


class Peers:
    """The clients heard from within liveness x interval, by routing id.

    Args:
        options: the heartbeat interval and liveness.
        pool: the server's shared-memory pool; a forgotten peer's slots go back to it.
        stats: the server's counters (``peers_expired``, ``sweeps_deferred``).
        on_sweep: called at the start of every sweep (the server flushes its rate-limited log).
        on_dead: called with each peer the sweep forgot and how long it had been silent.
    """

    def __init__(
        self,
        options: ChannelOptions,
        pool: ShmPool | None,
        stats: Counter[str],
        *,
        on_sweep: Callable[[], None],
        on_dead: Callable[[PeerInfo, float], None],
    ) -> None:
        self.table: dict[bytes, PeerInfo] = {}
        self._options = options
        self._pool = pool
        self._stats = stats
        self._on_sweep = on_sweep
        self._on_dead = on_dead
        self._sweeper: asyncio.TimerHandle | None = None
        self._sweep_due = 0.0
        self._closed = False

    def heard(self, identity: bytes) -> PeerInfo:
        """The peer ``identity``, heard from now; a new entry if it was not known."""
        now = clock()  # also the start of a traced request's serve
        peer = self.table.get(identity)
        if peer is None:
            peer = self.table[identity] = PeerInfo(identity, now)
        else:
            peer.heard_ns = now
        return peer

    def get(self, identity: bytes) -> PeerInfo | None:
        return self.table.get(identity)

    def forget(self, identity: bytes) -> None:
        """Drop the peer (gone silent, or unreachable) and take back the slots lent to it."""
        self.table.pop(identity, None)
        if self._pool is not None:
            self._pool.release_peer(identity)

    def start(self) -> None:
        """Sweep once per heartbeat interval from now on, on the running loop."""
        self._schedule()

    def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()

    def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        self._sweep_due = time.monotonic() + self._options.heartbeat_interval_s
        self._sweeper = loop.call_later(self._options.heartbeat_interval_s, self._sweep)

    def _sweep(self) -> None:
        limit = self._options.dead_after_s
        now = time.monotonic()
        self._on_sweep()
        if now - self._sweep_due > self._options.heartbeat_interval_s:
            # The loop was blocked: what the clients sent meanwhile still waits in the socket,
            # so their silence is this server's own. Look again once the inbox has been read,
            # rather than forget peers (and their handshakes) that are alive.
            self._stats["sweeps_deferred"] += 1
            self._schedule()
            return
        now_ns, limit_ns = clock(), limit * 1e9
        for identity in [i for i, p in self.table.items() if now_ns - p.heard_ns > limit_ns]:
            self._stats["peers_expired"] += 1
            peer = self.table[identity]
            self.forget(identity)
            self._on_dead(peer, (now_ns - peer.heard_ns) / 1e9)
        if not self._closed:
            self._schedule()
