"""CurveZMQ on tcp endpoints: key files, the process-wide default, and what each socket does.

Across hosts, every tcp socket asyncrl opens authenticates its peer and encrypts what it sends
with CurveZMQ (RFC 26) when Curve is on. ipc and inproc endpoints never use it: they stay on one
machine, private to the user by their 0700 directory.

One key directory serves a whole run (``asyncrl keys generate DIR`` writes it; copy it to every
node). It holds pyzmq's certificate files:

- ``server.key`` / ``server.key_secret``: the key pair every binding socket (a Server's inbox, a
  Publisher, a binding stream end) serves with;
- ``client.key`` / ``client.key_secret``: the key pair every connecting socket presents;
- ``authorized/*.key`` (optional): public keys of further clients to admit, for a peer written in
  another language with its own key pair.

A binding socket with Curve takes only clients whose public key is the run's client key or one of
``authorized/``: a ZAP handler (RFC 27), one per zmq context, started by the first such socket
and stopped with the last, checks each connecting key. A peer without keys, or with a key pair
that is not authorized, never completes the ZeroMQ handshake: no message of it reaches the
socket's owner. The server logs the refusal and counts it in its ``stats``; a Client sees it as a
``TransportError`` naming the endpoint and the cause. The server keeps serving the peers whose
keys are right.

Which settings a socket uses (``resolve``): ``curve=False`` never, ``curve=<CurveKeys>`` those
keys, ``curve=None`` (the default) the process-wide keys set by ``use_curve``. Whatever is passed,
ipc and inproc endpoints use none. A tcp endpoint off the loopback interface is bound or
connected only with Curve on, since it would otherwise expose an unauthenticated socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import hashlib
import logging
import os
import stat
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from .errors import TransportError
from .pump import Pump
from .ratelog import RateLimitedLog
from .sockets import bind, connect

__all__ = [
    "AUTHORIZED_DIR",
    "CLIENT",
    "SERVER",
    "CurveKeys",
    "CurveSetting",
    "ServerGuard",
    "active_handlers",
    "current",
    "handshake_refusal",
    "load_keys",
    "open_endpoint",
    "resolve",
    "secure_client",
    "secure_server",
    "use_curve",
]

log = logging.getLogger("asyncrl.transport.curve")

SERVER = "server"
"""Base name of the binding sockets' key pair: ``server.key`` and ``server.key_secret``."""
CLIENT = "client"
"""Base name of the connecting sockets' key pair: ``client.key`` and ``client.key_secret``."""
AUTHORIZED_DIR = "authorized"
"""Sub-directory of further authorized client public keys (``*.key``), optional."""

# Handshakes that failed on what a side said (a ZAP refusal, a protocol error): a connection that
# merely dropped mid-handshake (a peer restarting) reports EVENT_HANDSHAKE_FAILED_NO_DETAIL.
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq asks a context's ZAP handler (RFC 27) about each connecting Curve peer."""
_GENERATE = "make them with 'asyncrl keys generate DIR' and copy DIR to every node"


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """The run's Curve keys, as loaded from its key directory (Z85 text, 40 bytes each).

    Attributes:
        server_public: the public key binding sockets serve with; connecting sockets check it.
        server_secret: its secret half.
        client_public: the public key connecting sockets present.
        client_secret: its secret half.
        authorized_clients: the client public keys a binding socket admits (``client_public``
            and those of ``authorized/``).
        directory: where the keys were loaded from ("" when built in code), for messages.
    """

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    authorized_clients: frozenset[bytes] = field(default_factory=frozenset)
    directory: str = ""

    def __repr__(self) -> str:
        # Secrets never reach a log line or a traceback.
        return (
            f"CurveKeys(directory={self.directory!r}, server_public={self.server_public!r}, "
            f"client_public={self.client_public!r}, "
            f"authorized_clients={len(self.authorized_clients)})"
        )


CurveSetting = CurveKeys | Literal[False] | None
"""What a socket is given: keys, ``False`` (never Curve), or None (the process-wide default)."""

_default: CurveKeys | None = None


def use_curve(keys: CurveKeys | None) -> None:
    """Make ``keys`` the process-wide default of every tcp socket opened from now on.

    Sockets given ``curve=None`` (the default) consult it when they start; None switches Curve
    off again. ipc and inproc endpoints are never affected.
    """
    global _default
    _default = keys


def current() -> CurveKeys | None:
    """The process-wide keys set by ``use_curve``, or None."""
    return _default


def resolve(endpoint: str, curve: CurveSetting) -> CurveKeys | None:
    """The keys a socket on ``endpoint`` uses: None for ipc and inproc, or with ``curve=False``."""
    if not endpoint.startswith("tcp://") or curve is False:
        return None
    return curve if curve is not None else _default


# -- key files ---------------------------------------------------------------------------------


def _checked_key(key: bytes | None, path: str, what: str) -> bytes:
    try:
        if key is None or len(key) != 40 or len(z85.decode(key)) != 32:
            raise ValueError(what)
    except (ValueError, KeyError, IndexError) as exc:
        raise TransportError(
            f"Curve key file {path} holds no valid {what} (40 Z85 characters); "
            f"{_GENERATE} (add --force to replace bad files)"
        ) from exc
    return key


def _read(path: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    """The (public, secret) keys of one certificate file, checked."""
    if not os.path.isfile(path):
        raise TransportError(f"Curve key file {path} is missing; {_GENERATE}")
    if secret:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            raise TransportError(
                f"Curve secret key file {path} is readable by other users (mode {mode:04o}); "
                f"run 'chmod 600 {path}'"
            )
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise TransportError(
            f"Curve key file {path} cannot be read ({exc}); {_GENERATE} "
            f"(add --force to replace bad files)"
        ) from exc
    public = _checked_key(public, path, "public key")
    if secret:
        secret_key = _checked_key(secret_key, path, "secret key")
    return public, secret_key


def load_keys(directory: str) -> CurveKeys:
    """Load the run's Curve keys from ``directory`` (as ``asyncrl keys generate`` wrote it).

    Raises:
        TransportError: the directory or one of its files is missing, unreadable, not a pyzmq
            certificate, or a secret file is readable by other users; the message names the
            file and how to fix it.
    """
    if not os.path.isdir(directory):
        raise TransportError(f"Curve key directory {directory} does not exist; {_GENERATE}")
    keys: dict[str, tuple[bytes, bytes]] = {}
    for name in (SERVER, CLIENT):
        public, secret = _read(os.path.join(directory, f"{name}.key_secret"), secret=True)
        listed, _ = _read(os.path.join(directory, f"{name}.key"), secret=False)
        if listed != public:
            raise TransportError(
                f"Curve key files {name}.key and {name}.key_secret in {directory} are not one "
                f"pair; {_GENERATE} (with --force)"
            )
        assert secret is not None
        keys[name] = (public, secret)
    authorized = {keys[CLIENT][0]}
    for path in sorted(glob.glob(os.path.join(directory, AUTHORIZED_DIR, "*.key"))):
        authorized.add(_read(path, secret=False)[0])
    return CurveKeys(
        server_public=keys[SERVER][0],
        server_secret=keys[SERVER][1],
        client_public=keys[CLIENT][0],
        client_secret=keys[CLIENT][1],
        authorized_clients=frozenset(authorized),
        directory=directory,
    )


# -- the ZAP handler, one per context ----------------------------------------------------------


@dataclass
class _Domain:
    """The sockets of one ZAP domain: the keys they admit, their names and counters."""

    authorized: frozenset[bytes]
    owners: dict[int, tuple[str, Counter[str]]] = field(default_factory=dict)


class _ZapHandler:
    """The ZAP handler (RFC 27) of one zmq context: admits Curve clients by domain and key.

    libzmq asks it about every peer that connects to a Curve socket of the context, over
    ``ZAP_ENDPOINT``. It is a ROUTER driven by a ``Pump`` on the loop, so it answers in the
    callback and stops at once. (pyzmq's ``AsyncioAuthenticator`` removes its reader only when its
    task is next scheduled, by file descriptor number: a handler started in between, for the next
    Curve socket, may get the same number and go deaf.)

    Raises:
        TransportError: another ZAP handler already serves the context.
    """

    def __init__(self, context: zmq.Context[Any]) -> None:
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise TransportError(
                f"cannot start the Curve ZAP handler on this zmq context: {exc.strerror} "
                f"(another ZAP handler already serves it)"
            ) from exc
        self.domains: dict[str, _Domain] = {}
        self._ratelog = RateLimitedLog(log, "zap")
        self._pump = Pump(sock, self._request, routed=True)

    def _request(self, frames: list[Any]) -> None:
        # [routing id, b"", version, request id, domain, address, identity, mechanism, creds...]
        parts = [f.bytes for f in frames[1:]]
        if len(parts) < 7:
            return  # not a ZAP request: libzmq never sends one this short
        _, version, request_id, domain, address, _, mechanism, *credentials = parts
        status, text, user = self._decide(version, domain, address, mechanism, credentials)
        self._pump.send([frames[0], b"", b"1.0", request_id, status, text, user, b""])

    def _decide(
        self, version: bytes, domain: bytes, address: bytes, mechanism: bytes, creds: list[bytes]
    ) -> tuple[bytes, bytes, bytes]:
        """(status code, status text, user id) of one request: 200 with the key as user id,
        or 400."""
        if version != b"1.0":
            return b"400", b"Invalid version", b""
        if mechanism != b"CURVE" or len(creds) != 1 or len(creds[0]) != 32:
            return b"400", b"Only CURVE clients are admitted", b""
        key = z85.encode(creds[0])
        entry = self.domains.get(domain.decode(errors="replace"))
        if entry is not None and key in entry.authorized:
            return b"200", b"OK", key
        owners = entry.owners.values() if entry is not None else ()
        for _, stats in owners:
            stats["curve_refused_key"] += 1
        peer = address.decode(errors="replace")
        self._ratelog.warning(
            "curve key refused",
            peer,
            "%s refused a Curve client from %s: its public key %s is not an authorized client "
            "key; the peer needs the run's key directory (asyncrl keys generate)",
            ", ".join(sorted(name for name, _ in owners)) or domain.decode(errors="replace"),
            peer,
            key.decode(),
        )
        return b"400", b"Unknown key", b""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop that answers."""
        return self._pump.loop

    def close(self) -> None:
        """Stop answering and free ``ZAP_ENDPOINT`` now (an unbind frees an inproc address at
        once; a close frees it later, on zmq's reaper thread)."""
        with contextlib.suppress(zmq.ZMQError):
            self._pump.sock.unbind(ZAP_ENDPOINT)
        with contextlib.suppress(RuntimeError):  # a closed loop cannot remove its reader
            self._pump.close()
        self._pump.sock.close(linger=0)


_authenticators: dict[int, tuple[zmq.Context[Any], _ZapHandler, Counter[str]]] = {}


def _acquire(context: zmq.Context[Any], domain: str, keys: CurveKeys) -> _ZapHandler:
    held = _authenticators.get(id(context))
    if held is not None and held[1].loop.is_closed():
        # Sockets of a finished loop were never closed: a new handler, on this loop, takes over
        # their domains and references, so that closing them later still counts.
        log.warning("a Curve ZAP handler outlived its event loop; starting a new one")
        held[1].close()
        stale = held[1].domains
        held = (context, _ZapHandler(context), held[2])
        held[1].domains.update(stale)
        _authenticators[id(context)] = held
    if held is None:
        held = (context, _ZapHandler(context), Counter())
        _authenticators[id(context)] = held
    _, auth, refs = held
    refs[domain] += 1
    if domain not in auth.domains:
        auth.domains[domain] = _Domain(keys.authorized_clients)
    return auth


def _release(context: zmq.Context[Any], domain: str) -> None:
    held = _authenticators.get(id(context))
    if held is None:
        return
    _, auth, refs = held
    refs[domain] -= 1
    if refs[domain] <= 0:
        del refs[domain]
        auth.domains.pop(domain, None)
    if not refs:
        del _authenticators[id(context)]
        auth.close()


def active_handlers() -> int:
    """ZAP handlers running in this process (one per zmq context with a Curve server)."""
    return len(_authenticators)


# -- what one socket does ----------------------------------------------------------------------


def _domain(keys: CurveKeys) -> str:
    digest = hashlib.sha256(b"\n".join(sorted(keys.authorized_clients))).hexdigest()
    return f"asyncrl-{digest[:16]}"


class ServerGuard:
    """Curve on one binding socket: its ZAP domain held, and a monitor logging refusals.

    Made by ``secure_server`` before the socket binds; ``close()`` after the socket is closed
    releases the ZAP handler (stopped with the last socket of its context).
    """

    def __init__(
        self, sock: zmq.Socket[Any], keys: CurveKeys, name: str, stats: Counter[str]
    ) -> None:
        self.keys = keys
        self.name = name
        self._stats = stats
        self._context = sock.context
        self._domain = _domain(keys)
        self._auth = _acquire(self._context, self._domain, keys)
        self._auth.domains[self._domain].owners[id(self)] = (name, stats)
        self._ratelog = RateLimitedLog(log, name)
        sock.curve_server = True
        sock.curve_publickey = keys.server_public
        sock.curve_secretkey = keys.server_secret
        sock.zap_domain = self._domain.encode()
        self._monitor: Pump | None = Pump(sock.get_monitor_socket(_HANDSHAKE_FAILED), self._event)
        self._closed = False

    def _event(self, frames: list[Any]) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        self._stats["curve_refused"] += 1
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return  # the ZAP handler logged it, with the key and the address
        endpoint = event["endpoint"].decode(errors="replace")
        self._ratelog.warning(
            "curve handshake failed",
            endpoint,
            "%s on %s refused a peer: %s",
            self.name,
            endpoint,
            _cause(event["event"], event["value"], keyed=True),
        )

    def close(self) -> None:
        """Stop the monitor and release the ZAP handler; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._monitor is not None:
            self._monitor.close()
        entry = self._auth.domains.get(self._domain)
        if entry is not None:
            entry.owners.pop(id(self), None)
        _release(self._context, self._domain)


def secure_server(
    sock: zmq.Socket[Any],
    endpoint: str,
    curve: CurveSetting,
    name: str,
    stats: Counter[str],
) -> ServerGuard | None:
    """Make ``sock`` a Curve server when Curve applies to ``endpoint``; call before binding.

    Returns the guard to close after the socket, or None when Curve does not apply.

    Raises:
        TransportError: the context's ZAP endpoint is taken by another handler.
    """
    keys = resolve(endpoint, curve)
    if keys is None:
        return None
    return ServerGuard(sock, keys, name, stats)


def secure_client(sock: zmq.Socket[Any], endpoint: str, curve: CurveSetting) -> bool:
    """Make ``sock`` a Curve client of the run's server key when Curve applies to ``endpoint``.

    Returns True when Curve is on (the endpoint may then be off the loopback interface).
    """
    keys = resolve(endpoint, curve)
    if keys is None:
        return False
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
    return True


def open_endpoint(
    sock: zmq.Socket[Any],
    endpoint: str,
    curve: CurveSetting,
    *,
    binds: bool,
    name: str,
    stats: Counter[str] | None = None,
) -> tuple[str, ServerGuard | None]:
    """Bind ``sock`` as a Curve server, or connect it as a Curve client, when Curve applies.

    For broadcast and stream sockets: the binding end serves with the server key pair, the
    connecting end presents the client key pair. Returns the endpoint (as bound) and the guard
    to close after the socket (None unless it binds with Curve). ``sock`` is closed on failure.

    Raises:
        TransportError: the endpoint is malformed, off the loopback interface without Curve, or
            cannot be bound.
    """
    guard: ServerGuard | None = None
    try:
        if binds:
            guard = secure_server(sock, endpoint, curve, name, stats or Counter())
            return bind(sock, endpoint, allow_remote=guard is not None), guard
        connect(sock, endpoint, allow_remote=secure_client(sock, endpoint, curve))
        return endpoint, None
    except TransportError:
        sock.close(linger=0)
        if guard is not None:
            guard.close()
        raise


def _cause(event: int, value: int, *, keyed: bool) -> str:
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"Curve authentication failed (ZAP status {value}): the client's public key is not "
            f"one the server authorizes"
        )
    if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "the Curve handshake does not decrypt: the peer holds another server public key"
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return (
            "the security mechanisms differ: one side uses Curve and the other does not"
            if keyed
            else "the security mechanisms differ: the server requires Curve and this side has "
            "no keys"
        )
    return f"the ZeroMQ handshake failed (protocol error {value}); keys or mechanism differ"


def handshake_refusal(
    frames: list[Any], endpoint: str, *, keyed: bool
) -> Callable[[], TransportError] | None:
    """From a connecting socket's monitor message: a maker of the refusal error, or None.

    Only what the server said counts (a ZAP refusal, a protocol error such as a mechanism
    mismatch): a connection that merely dropped during the handshake (a server restarting) is
    not a refusal, so a client holding the wrong server key, which the server just drops, sees
    its calls time out instead.

    Args:
        frames: the monitor message.
        endpoint: the endpoint the socket connects to.
        keyed: whether this side uses Curve.
    """
    event = parse_monitor_message([f.bytes for f in frames])
    if not event["event"] & _HANDSHAKE_FAILED:
        return None
    cause = _cause(event["event"], event["value"], keyed=keyed)

    def refusal() -> TransportError:
        return TransportError(
            f"{endpoint} refused this connection: {cause}. Use the run's key directory on "
            f"every node ({_GENERATE}; the manifest names it in security.curve_keys)"
        )

    return refusal
