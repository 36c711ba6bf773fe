"""Liveness events: what one end of a channel learns about the other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["EventKind", "PeerEvent"]

EventKind = Literal["connected", "disconnected", "restarted", "dead", "alive"]


@dataclass(frozen=True, slots=True)
class PeerEvent:
    """A change in what one end knows of its peer.

    ``kind`` is one of: ``connected`` (handshake done), ``disconnected`` (the connection broke),
    ``restarted`` (a new incarnation answered), ``dead`` (nothing heard for liveness x
    interval), ``alive`` (heard again after ``dead``). A client reports all of them about its
    server; a server reports ``connected`` and ``dead`` about its clients, and ``disconnected``
    about one it admitted (with the run's secret) whose connection closed.

    ``peer`` is the server's endpoint for a client, and the client's routing id for a server.
    """

    peer: str
    kind: EventKind
    incarnation: int
    detail: str = ""
