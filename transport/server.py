"""The request/reply server: one ROUTER inbox per process, with ROUTER_MANDATORY.

Requests are dispatched by method name to handlers registered with ``add``. A handler receives the
decoded payload and a ``Call`` describing the request; it may be a plain function (run inline on
the loop: it must be quick) or a coroutine function (run as a task the server owns). What the
server knows of its clients is kept in ``peers.py``; who it admits, in ``admission.py``.

Bad input never stops the server. A frame that fails to decode, an unknown kind, a message over
the size limit, or tensor descriptors that disagree with the bytes are dropped, counted in
``stats`` and logged (the first few of each kind, then a summary line per interval); the sender
gets an error reply, since a ROUTER always knows who sent what.

A server with the run's secret (``control.py``) serves only peers whose handshake presented it,
on that connection while it lasts (``admission.py``); anything else is refused with ERROR
``unauthorized`` (PING and RELEASE are dropped, counted). STOP only from a peer that presented
it as a controller; shared-memory tensors only from one that handshook from this host. On tcp
with Curve on (``curve.py``), only peers with an authorized client key complete ZeroMQ's handshake.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from .admission import ConnectionWatch, Gate, connection_of, control_refusal
from .codec import Codec
from .control import run_secret
from .curve import CurveSetting, ServerGuard, secure_server
from .errors import (
    ClosedError,
    DecodeError,
    MessageTooLargeError,
    PeerUnreachableError,
    ProtocolError,
    ProtocolVersionError,
    TensorDescriptorError,
    TransportError,
    UnknownKindError,
)
from .events import EventKind, PeerEvent
from .handlers import Call, Handler, Method, Methods
from .options import ChannelOptions
from .peers import PeerInfo, Peers
from .protocol import (
    CONTROL_KINDS,
    PROTOCOL_VERSION,
    Credit,
    Envelope,
    ErrorCode,
    ErrorInfo,
    Hello,
    Kind,
    RawEnvelope,
    Release,
)
from .pump import Pump
from .ratelog import RateLimitedLog
from .releases import Releases
from .shm import ShmPool, ShmReader, host_id
from .sockets import bind, socket_id, unlink_if_same
from .tracing import HANDLED, SERVE, SERVED, clock, current, nbytes

__all__ = ["Call", "Handler", "PeerInfo", "Server"]

log = logging.getLogger("asyncrl.transport.server")


class Server:
    """Serves requests on ``endpoint`` (``ipc://path`` or ``tcp://127.0.0.1:port``).

    Args:
        endpoint: where to bind. ``tcp://127.0.0.1:0`` picks a free port; ``start()`` returns the
            bound address.
        name: this server's name, sent in the handshake and used in logs.
        incarnation: the process's restart count, stamped on every envelope it sends.
        options: thresholds, limits and heartbeat timing.
        context: the zmq context; the process-wide instance by default.
        on_stop: called when an authorised STOP control message arrives.
        on_event: called with a PeerEvent when a client handshakes (``connected``), when one
            goes silent for liveness x interval (``dead``; its shared-memory slots are freed),
            and when an admitted one's connection closes (``disconnected``; with a secret).
        secret: the run's secret; by default the one ``control.run_secret`` reads (the file
            named by ``ASYNCRL_SECRET_FILE``). With a secret, only clients whose handshake
            presented it are served, and STOP only from those that presented it as controllers;
            without one (outside a run), everyone is served, and STOP only on an ipc or inproc
            endpoint (private to this user).
        curve: Curve on a tcp endpoint: keys, False (never), or None (``use_curve``'s default).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        name: str = "server",
        incarnation: int = 0,
        options: ChannelOptions | None = None,
        context: zmq.Context[Any] | None = None,
        on_stop: Callable[[], None] | None = None,
        on_event: Callable[[PeerEvent], None] | None = None,
        secret: str | None = None,
        curve: CurveSetting = None,
    ) -> None:
        self.endpoint = endpoint
        self._curve = curve
        self._guard: ServerGuard | None = None
        self.name = name
        self.incarnation = incarnation
        self.options = options or ChannelOptions()
        self._context = context or zmq.Context.instance()
        self._on_stop = on_stop
        self._on_event = on_event
        self._secret = secret or run_secret()
        self._gate = Gate(self._secret, name)
        self._socket_id: tuple[int, int] | None = None
        self._log = RateLimitedLog(log, f"server {name}")
        self._credit: int | None = None
        self._methods = Methods(name)
        self._tasks: set[asyncio.Task[None]] = set()
        self._releases = Releases(self._send_release, lambda: self._closed)
        self._pump: Pump | None = None
        self._closed = False
        self._host = host_id()
        self._pool = (
            ShmPool(self.options.run, incarnation, max_bytes=self.options.shm_max_bytes)
            if self.options.shm
            else None
        )
        self.codec = Codec(
            inline_threshold=self.options.inline_threshold,
            shm_threshold=self.options.shm_threshold,
            max_message_bytes=self.options.max_message_bytes,
            shm_pool=self._pool,
            shm_reader=ShmReader() if self.options.shm else None,
        )
        self.stats: Counter[str] = Counter()
        self._peers = Peers(
            self.options,
            self._pool,
            self.stats,
            on_sweep=self._log.flush,
            on_dead=self._on_dead,
        )
        self._watch = ConnectionWatch(self._gate, self._peers, self.stats, self._emit)
        self._tracer = current(name, incarnation)  # None unless tracing is on
        self._record = None if self._tracer is None else self._tracer.record

    # -- set-up ---------------------------------------------------------------------------

    def add(self, method: str, handler: Handler, request_type: Any = Any) -> None:
        """Serve ``method`` with ``handler``; its payload is decoded as ``request_type``.

        Raises:
            ValueError: ``method`` is served already.
        """
        self._methods.add(method, handler, request_type)

    async def start(self) -> str:
        """Bind the inbox and start serving; returns the bound endpoint.

        Raises:
            TransportError: the endpoint cannot be bound (in use, bad path, ...).
        """
        if self._pump is not None:
            raise RuntimeError(f"server {self.name} already started")
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, self.options.send_hwm)
        sock.setsockopt(zmq.RCVHWM, self.options.recv_hwm)
        sock.setsockopt(zmq.LINGER, 0)
        # zmq drops the connection of a peer whose frame exceeds this, before it is buffered.
        sock.setsockopt(zmq.MAXMSGSIZE, self.options.max_message_bytes)
        try:  # the ZAP handler is up before the socket binds: without one, any key gets in
            self._guard = secure_server(sock, self.endpoint, self._curve, self.name, self.stats)
            self.endpoint = bind(sock, self.endpoint, allow_remote=self._guard is not None)
        except TransportError:
            sock.close(linger=0)
            if self._guard is not None:
                self._guard.close()
            raise
        self._socket_id = socket_id(self.endpoint)
        self._watch.start(sock)
        self._pump = Pump(sock, self._on_message, routed=True, on_send_error=self._on_send_error)
        self._peers.start()
        log.debug("server %s serving on %s", self.name, self.endpoint)
        return self.endpoint

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel running handlers, close the socket with linger 0, unlink shared memory and the
        ipc socket file (only if it is still the one this server bound: a restarted incarnation
        may have rebound the same path)."""
        if self._closed:
            return
        self._closed = True
        self._peers.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._pump is not None:
            self._watch.close()
            self._pump.close()
            unlink_if_same(self.endpoint, self._socket_id)
        if self._guard is not None:
            self._guard.close()  # after the socket: the ZAP handler outlives it
        if self._pool is not None:
            self._pool.close()
        if self.codec.shm_reader is not None:
            self.codec.shm_reader.close()
        self._log.flush(force=True)

    # -- what the owner can ask -----------------------------------------------------------

    @property
    def peers(self) -> dict[bytes, PeerInfo]:
        """Clients heard from within liveness x interval, by routing id."""
        return self._peers.table

    @property
    def shm_pool(self) -> ShmPool | None:
        return self._pool

    @property
    def credit(self) -> int | None:
        """The slots advertised to every client; None until ``set_credit`` is first called."""
        return self._credit

    def set_credit(self, slots: int) -> None:
        """Advertise ``slots`` to every client now, and to each client right after its handshake.

        A role calls this once its state is restored, so that no work reaches it earlier.
        """
        self._credit = slots
        for identity, peer in list(self._peers.table.items()):
            if peer.admitted:
                self._send_quietly(identity, self._envelope(Kind.CREDIT, payload=Credit(slots)))

    def send_credit(self, peer: bytes, slots: int) -> None:
        """Advertise ``slots`` free request slots to ``peer``.

        Raises:
            PeerUnreachableError: the peer is not connected.
        """
        self._send(peer, self._envelope(Kind.CREDIT, payload=Credit(slots)))

    # -- receiving ------------------------------------------------------------------------

    def _on_message(self, frames: list[Any]) -> None:
        identity = frames[0]
        msg = frames[1:]
        try:
            env = self.codec.decode_envelope(msg)
        except ProtocolError as exc:
            self._bad_input(identity, msg, exc)
            return
        peer = self._peers.heard(identity)
        kind = env.kind
        self._watch.catch_up()  # a connection closed ends its admissions
        if not peer.admitted and kind != Kind.HANDSHAKE:
            if not self._gate.admits(identity):
                self._unadmitted(peer, env)
                return
            peer.admitted = True
        if kind == Kind.REQUEST:
            self._request(peer, env, msg)
        elif kind == Kind.PING:
            self._send_quietly(
                identity,
                Envelope(PROTOCOL_VERSION, Kind.PONG, env.id, incarnation=self.incarnation),
            )
        elif kind == Kind.HANDSHAKE:
            self._handshake(peer, env, msg)
        elif kind == Kind.RELEASE:
            self._release(peer, env, msg)
        elif kind in CONTROL_KINDS:
            self._control(peer, env)
        else:
            self.stats["unexpected_kind"] += 1
            self._error(
                identity,
                env.id,
                ErrorCode.UNEXPECTED_KIND,
                f"a server does not accept {Kind(kind).name} messages",
            )

    def _request(self, peer: PeerInfo, env: RawEnvelope, msg: list[Any]) -> None:
        self.stats["requests"] += 1
        identity = peer.identity
        method = self._methods.get(env.method)
        if method is None:
            self.stats["unknown_method"] += 1
            self._error(
                identity,
                env.id,
                ErrorCode.UNKNOWN_METHOD,
                self._methods.unknown(env.method),
            )
            return
        if env.deadline and env.deadline < time.time():
            self.stats["expired"] += 1
            self._error(
                identity,
                env.id,
                ErrorCode.DEADLINE,
                f"request {env.id} to {env.method!r} arrived after its deadline",
                retryable=True,
            )
            return
        try:
            payload = self.codec.decode_payload(
                env,
                msg,
                method.request_type,
                self._releases.callback(identity),
                allow_shm=peer.shm_in,
            )
        except ProtocolError as exc:
            self._bad_input(identity, msg, exc, env.id)
            return
        call = Call(identity, env.id, env.method, env.attempt, env.deadline, env.trace)
        record = self._record
        if record is not None:
            size = len(msg[0]) if len(msg) == 1 and not env.tensors else nbytes(msg, env.tensors)
            start = peer.heard_ns  # when the request was taken from the socket
        if method.is_async:
            if record is not None:
                record((SERVE, env.method, identity, env.id, start, size))
            assert self._pump is not None  # a request came through it
            task = self._pump.loop.create_task(self._run_async(method, payload, call))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        # Served within this step of the loop: traced, one event holds both ends.
        try:
            result = method.handler(payload, call)
        except Exception as exc:
            if record is not None:
                record((HANDLED, env.method, identity, env.id, start, clock(), size))
            self._handler_failed(call, exc)
            return
        if record is not None:
            record((HANDLED, env.method, identity, env.id, start, clock(), size))
        self._reply(call, result)

    async def _run_async(self, method: Method, payload: Any, call: Call) -> None:
        failed: Exception | None = None
        try:
            result = await method.handler(payload, call)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failed = exc
        record = self._record
        if record is not None:
            record((SERVED, call.peer, call.id, clock()))
        if failed is not None:
            self._handler_failed(call, failed)
            return
        self._reply(call, result)

    def _handler_failed(self, call: Call, exc: Exception) -> None:
        self.stats["handler_errors"] += 1
        self._log.warning(
            f"handler {call.method!r} failure",
            _peer_name(call.peer),
            "server %s: handler %r failed: %r",
            self.name,
            call.method,
            exc,
        )
        self._error(
            call.peer,
            call.id,
            ErrorCode.HANDLER,
            str(exc) or repr(exc),
            type_=type(exc).__qualname__,
            retryable=getattr(exc, "retryable", False),
        )

    def _reply(self, call: Call, result: Any) -> None:
        if self._closed:
            return
        peer = self._peers.get(call.peer)
        env = Envelope(
            PROTOCOL_VERSION, Kind.REPLY, call.id, incarnation=self.incarnation, payload=result
        )
        try:
            frames = self.codec.encode(env, peer=call.peer, use_shm=peer is not None and peer.shm)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
            self.stats["bad_replies"] += 1
            self._error(
                call.peer,
                call.id,
                ErrorCode.BAD_REPLY,
                f"the reply of {call.method!r} cannot be encoded: {exc}",
            )
            return
        slots = self.codec.last_slots
        try:
            self._pump_send([call.peer, *frames])
        except TransportError:
            if self._pool is not None:
                for slot in slots:
                    self._pool.release(slot)
        else:
            self.stats["replies"] += 1

    def _control(self, peer: PeerInfo, env: RawEnvelope) -> None:
        name = Kind(env.kind).name
        presented = self._gate.may_control(peer.identity)
        refusal = control_refusal(presented, self._secret, self.endpoint, self.name)
        if refusal:
            message = f"{name} refused: {refusal}"
            self._refuse(peer, env.id, name, "control_refused", ErrorCode.UNAUTHORIZED, message)
            return
        if env.kind == Kind.STOP:
            self.stats["stops"] += 1
            if self._on_stop is not None:
                self._on_stop()

    def _handshake(self, peer: PeerInfo, env: RawEnvelope, msg: list[Any]) -> None:
        try:
            hello = self.codec.decode_payload(env, msg, Hello)
        except ProtocolError as exc:
            self._bad_input(peer.identity, msg, exc, env.id)
            return
        refusal = self._gate.handshake(peer.identity, hello, connection_of(msg[0]))
        if refusal is not None:
            peer.admitted = False
            self._refuse(peer, env.id, "HANDSHAKE", refusal.counter, refusal.code, refusal.message)
            return
        if hello.control and self._secret is not None:
            self.stats["control_handshakes"] += 1
        peer.hello = hello
        peer.admitted = True
        same_host = bool(hello.host) and hello.host == self._host
        peer.shm = bool(self._pool is not None and hello.shm and same_host)
        peer.shm_in = same_host and self.codec.shm_reader is not None
        self.stats["handshakes"] += 1
        self._emit(peer, "connected", f"{hello.name}, pid {hello.pid}")
        welcome = Hello(
            PROTOCOL_VERSION,
            name=self.name,
            pid=os.getpid(),
            incarnation=self.incarnation,
            host=self._host,
            shm=self.codec.shm_reader is not None,
            run=self.options.run,
        )
        self._send_quietly(peer.identity, self._envelope(Kind.WELCOME, env.id, welcome))
        if self._credit is not None:
            credit = self._envelope(Kind.CREDIT, payload=Credit(self._credit))
            self._send_quietly(peer.identity, credit)

    def _unadmitted(self, peer: PeerInfo, env: RawEnvelope) -> None:
        """Refuse a message from a peer that did not present the run's secret."""
        kind = Kind(env.kind)
        if kind in (Kind.PING, Kind.RELEASE):  # not calls: a reconnecting client sends them
            self.stats["unauthenticated"] += 1  # before its new handshake
            return
        message = self._gate.unadmitted(kind.name)
        self._refuse(peer, env.id, kind.name, "unauthenticated", ErrorCode.UNAUTHORIZED, message)

    def _refuse(
        self, peer: PeerInfo, request_id: int, what: str, counter: str, code: str, message: str
    ) -> None:
        """Count, log (rate-limited) and answer a refused handshake or message; the log line says
        what was wrong and how to fix it, as the ERROR answer does."""
        self.stats[counter] += 1
        if code == ErrorCode.UNAUTHORIZED:
            name = _peer_name(peer.identity)
            line = f"server {self.name} refused {what} from {name!r} ({counter}): {message}"
            self._log.warning(counter, name, "%s", line)
        self._error(peer.identity, request_id, code, message)

    def _release(self, peer: PeerInfo, env: RawEnvelope, msg: list[Any]) -> None:
        try:
            release = self.codec.decode_payload(env, msg, Release)
        except ProtocolError as exc:
            self._bad_input(peer.identity, msg, exc, env.id)
            return
        if self._pool is not None:
            for slot in release.slots:
                self._pool.release(slot, peer.identity)

    def _send_release(self, identity: bytes, slots: list[int]) -> None:
        self._send(identity, self._envelope(Kind.RELEASE, payload=Release(slots)))

    # -- sending and failures -------------------------------------------------------------

    def _envelope(self, kind: Kind, request_id: int = 0, payload: Any = None) -> Envelope:
        """An envelope of ``kind`` from this server (stamped with its incarnation)."""
        return Envelope(
            PROTOCOL_VERSION, kind, request_id, incarnation=self.incarnation, payload=payload
        )

    def _send(self, identity: bytes, env: Envelope) -> None:
        self._pump_send([identity, *self.codec.encode(env)])

    def _send_quietly(self, identity: bytes, env: Envelope) -> None:
        """Send, or drop the message if its peer is gone (that is counted in ``stats``)."""
        try:
            self._send(identity, env)
        except TransportError:
            pass

    def _pump_send(self, frames: list[Any]) -> None:
        if self._pump is None or self._closed:
            raise ClosedError(f"server {self.name} is closed")
        try:
            self._pump.send(frames)
        except PeerUnreachableError:
            self.stats["unreachable"] += 1
            self._peers.forget(frames[0])
            raise

    def _on_send_error(self, frames: list[Any], exc: TransportError) -> None:
        self.stats["unreachable"] += 1
        self._peers.forget(frames[0])

    def _error(
        self,
        identity: bytes,
        request_id: int,
        code: str,
        message: str,
        *,
        type_: str = "",
        retryable: bool = False,
    ) -> None:
        env = self._envelope(Kind.ERROR, request_id, ErrorInfo(code, message, type_, retryable))
        try:
            self._send(identity, env)
        except TransportError:
            pass  # nobody to tell; the error is counted already

    def _bad_input(
        self,
        identity: bytes,
        msg: list[Any],
        exc: ProtocolError,
        request_id: int | None = None,
    ) -> None:
        code = _CODES.get(type(exc), ErrorCode.DECODE)
        self.stats[code] += 1
        reason = getattr(exc, "reason", "")
        if reason:
            self.stats[reason] += 1
        self._log.warning(
            code,
            _peer_name(identity),
            "server %s dropped a message from %r: %s",
            self.name,
            identity,
            exc,
        )
        if not identity:
            return
        if request_id is None:
            request_id = self.codec.salvage_id(msg)
        self._error(identity, request_id, code, str(exc))

    # -- peers ---------------------------------------------------------------------------

    def _on_dead(self, peer: PeerInfo, silent_s: float) -> None:
        self._emit(peer, "dead", f"silent for {silent_s:.3f} s")

    def _emit(self, peer: PeerInfo, kind: EventKind, detail: str) -> None:
        if self._on_event is not None:
            incarnation = peer.hello.incarnation if peer.hello is not None else -1
            name = peer.identity.decode(errors="replace")
            self._on_event(PeerEvent(name, kind, incarnation, detail))


def _peer_name(identity: bytes) -> str:
    return identity[:64].decode(errors="replace")


_CODES: dict[type[ProtocolError], str] = {
    DecodeError: ErrorCode.DECODE,
    UnknownKindError: ErrorCode.UNKNOWN_KIND,
    MessageTooLargeError: ErrorCode.TOO_LARGE,
    TensorDescriptorError: ErrorCode.BAD_TENSOR,
    ProtocolVersionError: ErrorCode.PROTOCOL_VERSION,
}
