"""Binding and connecting sockets: endpoint checks, ipc directories, and zmq errors mapped.

By default an endpoint is ``ipc://`` or TCP on the loopback interface. Binding a TCP endpoint on
another interface exposes an unauthenticated socket to the network, so it needs
``allow_remote=True``.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

import zmq

from .errors import TransportError

__all__ = ["IPC_PATH_MAX", "bind", "check_endpoint", "connect"]

IPC_PATH_MAX = 107
"""The longest ipc socket path the operating system accepts (sun_path, less the final NUL)."""

_LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}


def check_endpoint(endpoint: str, *, allow_remote: bool = False) -> None:
    """Raise TransportError when ``endpoint`` is malformed or not local without ``allow_remote``."""
    scheme, sep, address = endpoint.partition("://")
    if not sep or not address:
        raise TransportError(
            f"endpoint {endpoint!r} is malformed; expected ipc:///path or tcp://127.0.0.1:port"
        )
    if scheme == "ipc":
        if len(address) > IPC_PATH_MAX:
            raise TransportError(
                f"ipc path {address!r} is {len(address)} characters, over the limit of "
                f"{IPC_PATH_MAX}; use a shorter run directory"
            )
        return
    if scheme in ("inproc",):
        return
    if scheme != "tcp":
        raise TransportError(f"endpoint {endpoint!r}: scheme {scheme!r} is not ipc or tcp")
    host = address.rsplit(":", 1)[0]
    if allow_remote or host in _LOOPBACK_NAMES:
        return
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise TransportError(
            f"endpoint {endpoint!r} is not on the loopback interface; asyncrl binds ipc or "
            f"127.0.0.1 by default. Pass allow_remote=True to expose it to the network"
        )


def bind(sock: zmq.Socket[Any], endpoint: str, *, allow_remote: bool = False) -> str:
    """Bind ``sock`` to ``endpoint`` and return the address actually bound.

    For ipc the parent directory is created. A leftover socket file of a dead process at the same
    path is replaced, which is what lets a restarted process rebind its stable endpoint.

    Raises:
        TransportError: the endpoint is malformed, not local, or cannot be bound.
    """
    check_endpoint(endpoint, allow_remote=allow_remote)
    if endpoint.startswith("ipc://"):
        os.makedirs(os.path.dirname(endpoint[len("ipc://") :]) or ".", exist_ok=True)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise TransportError(f"cannot bind {endpoint}: {exc.strerror}") from exc
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else str(bound)


def connect(sock: zmq.Socket[Any], endpoint: str, *, allow_remote: bool = False) -> None:
    """Connect ``sock`` to ``endpoint``; zmq reconnects by itself whenever the peer rebinds.

    Raises:
        TransportError: the endpoint is malformed or not local.
    """
    check_endpoint(endpoint, allow_remote=allow_remote)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        raise TransportError(f"cannot connect to {endpoint}: {exc.strerror}") from exc
