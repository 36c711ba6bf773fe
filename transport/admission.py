"""Whom a server admits: the checks on a HANDSHAKE (protocol version, the run's secret), on every
other message (from an admitted peer only), and on a control message (STOP), and the watch on the
server's connections that ends an admission when its connection closes. See docs/protocol.md,
Authentication; the secret itself is ``control.py``'s.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import zmq
from zmq.utils.monitor import parse_monitor_message

from .control import CONTROL_SECRET_ENV, SECRET_FILE, SECRET_FILE_ENV, secret_matches
from .errors import ProtocolVersionError
from .events import EventKind
from .peers import PeerInfo, Peers
from .protocol import PROTOCOL_VERSION, ErrorCode, Hello
from .pump import Pump
from .sockets import ipc_path

__all__ = ["ConnectionWatch", "Gate", "Refusal", "connection_of", "control_refusal"]

_SRCFD = int(zmq.SRCFD)

_HOW = (
    f"run it inside the run (every process the node agent starts has {SECRET_FILE_ENV}), or "
    f"point it at the run's secret file: {SECRET_FILE_ENV}=RUN_DIR/{SECRET_FILE}"
)


class Refusal(NamedTuple):
    """Why a handshake is refused: the server's counter, the ERROR code, and its message."""

    counter: str
    code: str
    message: str


class Gate:
    """Who a server serves. With the run's secret, only the peers (routing ids) whose HANDSHAKE
    presented it; without one (outside a run), everyone.

    An admission belongs to the connection the HANDSHAKE came on (its file descriptor in the
    server's ZeroMQ socket): it lasts until the peer handshakes again, its connection closes
    (``disconnected``, from the socket's monitor) or the server closes, also while the liveness
    sweep forgets the peer for a while (a blocked client is not a stranger). So a process that
    learns an admitted client's routing id cannot use it once that client is gone: a new
    connection under the same id must present the secret again.

    Args:
        secret: the run's secret, None outside a run.
        server: the server's name, for messages.
    """

    def __init__(self, secret: str | None, server: str) -> None:
        self.secret = secret
        self._server = server
        self._admitted: dict[bytes, bool] = {}  # routing id -> may send control messages
        self._connection: dict[bytes, int] = {}  # routing id -> the connection it handshook on
        self._on_connection: dict[int, set[bytes]] = {}  # connection -> the ids admitted on it

    @property
    def admitted(self) -> int:
        """How many peers are admitted now."""
        return len(self._admitted)

    def admits(self, identity: bytes) -> bool:
        """Whether the peer ``identity`` may send anything other than a HANDSHAKE."""
        return self.secret is None or identity in self._admitted

    def may_control(self, identity: bytes) -> bool:
        """Whether the peer presented the secret under ``control`` in its handshake."""
        return self._admitted.get(identity, False)

    def handshake(self, identity: bytes, hello: Hello, connection: int = -1) -> Refusal | None:
        """Admit the peer ``identity`` that handshook with ``hello`` on ``connection`` (the file
        descriptor the message came through; -1: unknown, kept until the peer handshakes again),
        or say why not (and forget an earlier admission of it)."""
        refusal = self._refusal(hello)
        self._forget(identity)
        if refusal is not None:
            return refusal
        self._admitted[identity] = bool(hello.control) and self.secret is not None
        self._connection[identity] = connection
        self._on_connection.setdefault(connection, set()).add(identity)
        return None

    def disconnected(self, connection: int) -> list[bytes]:
        """Forget every peer admitted on ``connection``, which closed; returns their ids."""
        gone = sorted(self._on_connection.pop(connection, ()))
        for identity in gone:
            self._admitted.pop(identity, None)
            self._connection.pop(identity, None)
        return gone

    def _forget(self, identity: bytes) -> None:
        self._admitted.pop(identity, None)
        connection = self._connection.pop(identity, None)
        if connection is not None:
            ids = self._on_connection.get(connection)
            if ids is not None:
                ids.discard(identity)
                if not ids:
                    del self._on_connection[connection]

    def unadmitted(self, kind: str) -> str:
        """The ERROR message for a ``kind`` message from a peer that was not admitted."""
        return (
            f"{kind} refused: {self._server} serves only the processes of its run, and this "
            f"client has not presented the run's secret in a HANDSHAKE (Hello.secret) on this "
            f"connection; {_HOW}"
        )

    def _refusal(self, hello: Hello) -> Refusal | None:
        who = hello.name or "this client"
        if hello.version != PROTOCOL_VERSION:
            err = ProtocolVersionError(PROTOCOL_VERSION, hello.version, hello.name)
            return Refusal("version_mismatch", ErrorCode.PROTOCOL_VERSION, str(err))
        secret = self.secret
        if hello.control and secret is not None and not secret_matches(secret, hello.control):
            return Refusal(
                "control_refused",
                ErrorCode.UNAUTHORIZED,
                f"the control secret presented by {who} is not {self._server}'s; both "
                f"processes must read the same run's secret ({SECRET_FILE_ENV}, set by the "
                f"node agent for the whole run)",
            )
        if secret is None or secret_matches(secret, hello.secret or hello.control):
            return None
        if not hello.secret:
            return Refusal(
                "unauthenticated",
                ErrorCode.UNAUTHORIZED,
                f"{self._server} serves only the processes of its run, and the HANDSHAKE of "
                f"{who} presented no secret (Hello.secret); {_HOW}",
            )
        return Refusal(
            "secret_refused",
            ErrorCode.UNAUTHORIZED,
            f"the secret presented by {who} is not the one of {self._server}'s run (a client "
            f"of another run, or of an earlier run of the same directory?); point "
            f"{SECRET_FILE_ENV} at RUN_DIR/{SECRET_FILE} of the run that serves this endpoint",
        )


def control_refusal(presented: bool, secret: str | None, endpoint: str, server: str) -> str:
    """Why a control message is refused, or "" when it is authorised.

    Args:
        presented: the peer presented the run's secret under ``control`` in its handshake.
        secret: the server's secret, None when it has none.
        endpoint: where the server listens.
        server: the server's name.
    """
    if secret is not None:
        if presented:
            return ""
        return (
            f"control messages are accepted only from a client that presented the run's "
            f"secret under Hello.control in its HANDSHAKE (the supervisor's); create the client "
            f"with control=True in a process that has the run's secret ({SECRET_FILE_ENV})"
        )
    if ipc_path(endpoint) is not None or endpoint.startswith("inproc://"):
        return ""
    return (
        f"{server} has no secret (neither {SECRET_FILE_ENV} nor {CONTROL_SECRET_ENV} is set) "
        f"and listens on {endpoint}, where any local user can connect; give both processes "
        f"the run's secret and create the client with control=True"
    )


def connection_of(frame: Any) -> int:
    """The connection a received frame (a ``zmq.Frame``) came through: its file descriptor in
    the socket (``ZMQ_SRCFD``), which the socket's monitor names when that connection closes."""
    return int(frame.get(_SRCFD))


class ConnectionWatch:
    """Ends admissions with their connections: a server's ROUTER socket's monitor reports each
    closed connection (``EVENT_DISCONNECTED``, with its descriptor), and every routing id the
    ``Gate`` admitted on it is forgotten; its peer in the server's table is marked unadmitted
    and reported ``disconnected``. Without a secret (everyone is served) it watches nothing.

    libzmq reports a closed connection before a new one can take its descriptor or the routing
    id it carried, so ``catch_up`` before trusting an admission sees every close that happened
    before the message at hand.

    Args:
        gate: the server's Gate.
        peers: the server's table of peers.
        stats: the server's counters (``disconnects``, ``admissions_ended``).
        emit: the server's peer-event callback: (peer, kind, detail).
    """

    def __init__(
        self,
        gate: Gate,
        peers: Peers,
        stats: Counter[str],
        emit: Callable[[PeerInfo, EventKind, str], None],
    ) -> None:
        self._gate, self._peers, self._stats, self._emit = gate, peers, stats, emit
        self._sock: zmq.Socket[Any] | None = None
        self._pump: Pump | None = None

    def start(self, sock: zmq.Socket[Any]) -> None:
        """Watch ``sock``'s connections (a server with a secret only)."""
        if self._gate.secret is not None:
            self._sock = sock
            self._pump = Pump(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED), self._on_event)

    def catch_up(self) -> None:
        """Read every close reported so far (one ``ZMQ_EVENTS`` check when there is none)."""
        if self._pump is not None:
            self._pump.read_waiting()

    def close(self) -> None:
        """Stop watching, before the watched socket closes."""
        if self._sock is not None and self._pump is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._pump.close()

    def _on_event(self, frames: list[Any]) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        if event["event"] != zmq.EVENT_DISCONNECTED:
            return
        self._stats["disconnects"] += 1
        for identity in self._gate.disconnected(int(event["value"])):
            self._stats["admissions_ended"] += 1
            peer = self._peers.get(identity)
            if peer is not None:
                peer.admitted = False
                self._emit(peer, "disconnected", "its connection closed: it must handshake again")
