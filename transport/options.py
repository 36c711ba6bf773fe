"""Channel options: thresholds, limits and heartbeat timing, with their defaults."""

from __future__ import annotations

import msgspec

__all__ = ["HEARTBEAT_INTERVAL_S", "HEARTBEAT_LIVENESS", "ChannelOptions"]

HEARTBEAT_INTERVAL_S = 1.0
"""Seconds between two pings from a client to its server."""

HEARTBEAT_LIVENESS = 3
"""Missed intervals after which a silent peer is reported dead."""


class ChannelOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Options shared by every channel.

    Attributes:
        run: the run id; names shared-memory segments.
        inline_threshold: tensors up to this many bytes travel inside the envelope.
        shm_threshold: tensors from this many bytes go through shared memory, when both ends
            are on one host and accept it.
        shm: offer and accept shared memory at the handshake.
        shm_max_bytes: the most a sender's shared-memory pool maps at once.
        max_message_bytes: received messages above this size are refused.
        heartbeat_interval_s: seconds between pings.
        liveness: missed intervals after which a peer is reported dead.
        send_hwm: messages queued per peer before a send waits (ZMQ_SNDHWM).
        recv_hwm: messages queued per peer before the peer must wait (ZMQ_RCVHWM).
    """

    run: str = "default"
    inline_threshold: int = 1024
    shm_threshold: int = 1 << 20
    shm: bool = True
    shm_max_bytes: int = 2 << 30
    max_message_bytes: int = 1 << 31
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    liveness: int = HEARTBEAT_LIVENESS
    send_hwm: int = 10_000
    recv_hwm: int = 10_000

    @property
    def dead_after_s(self) -> float:
        """Silence after which a peer is reported dead: liveness x interval."""
        return self.liveness * self.heartbeat_interval_s
