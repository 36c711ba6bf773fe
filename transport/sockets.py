"""Making, binding and connecting sockets: endpoint checks, ipc directories, and zmq errors mapped.

By default an endpoint is ``ipc://`` or TCP on the loopback interface. Binding a TCP endpoint on
another interface exposes an unauthenticated socket to the network, so it needs
``allow_remote=True``.

An ipc socket is private to the user that binds it, whatever the umask: directories ``bind``
creates are mode 0700, and the socket file itself is made 0600 (connecting to a Unix socket needs
write permission on its file).
"""

from __future__ import annotations

import ipaddress
import os
import resource
import stat
from typing import Any, NamedTuple

import zmq

from .errors import TransportError
from .options import ChannelOptions

__all__ = [
    "IPC_PATH_MAX",
    "Reserved",
    "bind",
    "check_endpoint",
    "connect",
    "dealer",
    "ipc_path",
    "make_private_dir",
    "reserve_sockets",
    "socket_id",
    "unlink_if_same",
]

IPC_PATH_MAX = 107
"""The longest ipc socket path the operating system accepts (sun_path, less the final NUL)."""

CLIENT_SOCKETS = 3
"""ZeroMQ sockets one ``Client`` holds: its DEALER, its monitor's PAIR and libzmq's end of it."""

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


def ipc_path(endpoint: str) -> str | None:
    """The socket file of an ``ipc://`` endpoint, or None for any other scheme."""
    if endpoint.startswith("ipc://"):
        return endpoint[len("ipc://") :]
    return None


def make_private_dir(path: str) -> None:
    """Create ``path`` (and missing parents) and make it 0700, whatever the umask.

    Raises:
        TransportError: ``path`` is a symlink, not a directory, or belongs to another user, so
            sockets in it would not be private.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise TransportError(
            f"socket directory {path!r} is a symlink or not a directory; remove it, or use "
            f"another run directory"
        )
    if st.st_uid != os.getuid():
        raise TransportError(
            f"socket directory {path!r} belongs to uid {st.st_uid}, not to this user "
            f"({os.getuid()}), so its sockets would not be private; remove it, or use another "
            f"run directory"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def _missing_dirs(path: str) -> list[str]:
    """The directories ``os.makedirs(path)`` would create, outermost first."""
    missing = []
    while path and not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing[::-1]


def bind(sock: zmq.Socket[Any], endpoint: str, *, allow_remote: bool = False) -> str:
    """Bind ``sock`` to ``endpoint`` and return the address actually bound.

    For ipc, missing parent directories are created with mode 0700 (a directory that already
    exists is left as it is), and the socket file is made 0600, so that no other user can
    connect. A leftover socket file of a dead process at the same path is replaced, which is
    what lets a restarted process rebind its stable endpoint.

    Raises:
        TransportError: the endpoint is malformed, not local, or cannot be bound.
    """
    check_endpoint(endpoint, allow_remote=allow_remote)
    path = ipc_path(endpoint)
    if path is not None:
        try:
            for directory in _missing_dirs(os.path.dirname(os.path.abspath(path))):
                make_private_dir(directory)
        except OSError as exc:
            raise TransportError(f"cannot create the directory of {endpoint}: {exc}") from exc
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise TransportError(f"cannot bind {endpoint}: {exc.strerror}") from exc
    if path is not None:
        try:
            os.chmod(path, 0o600)
        except OSError as exc:
            sock.unbind(endpoint)
            raise TransportError(f"cannot make {endpoint} private: {exc}") from exc
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else str(bound)


def socket_id(endpoint: str) -> tuple[int, int] | None:
    """(device, inode) of an ipc endpoint's socket file, or None (not ipc, or no file)."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def unlink_if_same(endpoint: str, bound: tuple[int, int] | None) -> bool:
    """Unlink the socket file of ``endpoint`` if it is still the file ``bound`` identifies.

    A restarted incarnation may have rebound the same path meanwhile; its file has another
    inode and is left alone. Returns True when the file was removed.
    """
    path = ipc_path(endpoint)
    if path is None or bound is None or socket_id(endpoint) != bound:
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


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


def dealer(context: zmq.Context[Any], identity: bytes, options: ChannelOptions) -> zmq.Socket[Any]:
    """A new DEALER socket with routing id ``identity`` and the limits of ``options``; it closes
    at once (linger 0) and reconnects quickly (from 10 ms, at most 200 ms apart) when its peer
    rebinds."""
    sock: zmq.Socket[Any] = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.SNDHWM, options.send_hwm)
    sock.setsockopt(zmq.RCVHWM, options.recv_hwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, options.max_message_bytes)
    sock.setsockopt(zmq.RECONNECT_IVL, 10)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 200)
    return sock


class Reserved(NamedTuple):
    """What ``reserve_sockets`` made room for.

    Attributes:
        sockets: the shared context's socket limit now.
        wanted: the open files the sockets asked for need (two a socket, and 256 more).
        hard: the process's hard limit on open files (None: unlimited), above which the soft
            limit cannot be raised.
    """

    sockets: int
    wanted: int
    hard: int | None

    @property
    def capped(self) -> bool:
        """The hard limit kept the open-files limit below ``wanted``: past about
        ``hard // 2`` sockets, libzmq refuses new ones ("Too many open files")."""
        return self.hard is not None and self.hard < self.wanted


def reserve_sockets(clients: int, spare: int = 64) -> Reserved:
    """Let this process's shared context (``zmq.Context.instance()``, which every ``Client``,
    ``Server`` and stream uses unless given one) hold ``clients`` clients and ``spare`` other
    sockets, and the process open the descriptors they need (two a socket, within its hard
    limit: ``Reserved.capped`` says when the hard limit stopped it short). libzmq sizes a
    context when its first socket is made (1,023 sockets by default, a limit it never raises
    later), so call this before the first.
    """
    sockets = CLIENT_SOCKETS * clients + spare
    context: zmq.Context[Any] = zmq.Context.instance()
    limit = min(sockets, context.get(zmq.SOCKET_LIMIT))
    if limit > context.get(zmq.MAX_SOCKETS):
        context.set(zmq.MAX_SOCKETS, limit)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * sockets + 256
    want = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return Reserved(
        sockets=int(context.get(zmq.MAX_SOCKETS)),
        wanted=wanted,
        hard=None if hard == resource.RLIM_INFINITY else hard,
    )
