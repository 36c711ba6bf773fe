"""The request/reply client: a DEALER connected to one server's stable endpoint.

Every request carries an id, a deadline and an attempt number, and ends in exactly one of: its
reply, a ``RemoteError`` (the server's error reply), a ``DeadlineExceededError``, a
``PeerDeadError`` (heartbeats stopped), a ``DisconnectedError`` (the connection broke), or a
``ClosedError`` (this client was closed).

The client reconnects by itself when the server restarts on the same endpoint. It learns of the
restart from a socket monitor, handshakes again (``reconnect.py``: retrying until the new
incarnation answers or the client is closed, however long its start-up blocks), and reports the
new incarnation in a ``PeerEvent``; requests made before that handshake wait for it.

Every client presents the run's secret in its handshake (``control.py``), without which a server
of the run serves nothing; ``control=True`` also presents it as a controller (``send_stop``).

On tcp with Curve on (``curve.py``) the client presents the run's client key and checks the
server's. A server that refuses the ZeroMQ handshake (its client key or the mechanism differs)
fails the requests in flight, the handshake included, with a ``TransportError`` that says why.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from .codec import Codec
from .control import run_secret
from .curve import CurveSetting, handshake_refusal, secure_client
from .errors import (
    ClosedError,
    DisconnectedError,
    PeerDeadError,
    ProtocolError,
    ProtocolVersionError,
    RemoteError,
    TransportError,
)
from .events import EventKind, PeerEvent
from .inflight import InFlight, Pending
from .options import ChannelOptions
from .protocol import (
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
from .reconnect import Held, rehandshake
from .releases import Releases
from .shm import ShmPool, ShmReader, host_id
from .sockets import connect, dealer
from .tracing import CALL, REPLY, clock, current, nbytes

__all__ = ["Client", "PeerEvent"]

log = logging.getLogger("asyncrl.transport.client")

# The kinds every answer is told apart by, as module globals: an attribute of the enum class
# costs about 40 ns a look-up, a global a few.
_REPLY, _ERROR, _WELCOME, _CREDIT = Kind.REPLY, Kind.ERROR, Kind.WELCOME, Kind.CREDIT
_ENDS = frozenset((Kind.REPLY, Kind.ERROR))
"""The kinds that end a call (a traced reply is recorded on them)."""


class Client:
    """Calls methods of the server at ``endpoint``.

    Args:
        endpoint: the server's stable endpoint.
        name: this client's name, sent in the handshake.
        identity: the routing id; unique per client by default.
        incarnation: this process's restart count, stamped on its envelopes.
        options: thresholds, limits and heartbeat timing.
        context: the zmq context; the process-wide instance by default.
        on_event: called with each PeerEvent.
        on_credit: called with the slot count of each CREDIT the server sends.
        control: also present the secret as a controller, so that the server accepts this
            client's control messages (``send_stop``). Only the supervisor's clients set it.
        secret: the run's secret to present; by default the one ``control.run_secret`` reads
            (the file named by ``ASYNCRL_SECRET_FILE``), none outside a run.
        curve: Curve on a tcp endpoint: keys, False (never), or None (``use_curve``'s default).

    Raises:
        TransportError: ``ASYNCRL_SECRET_FILE`` names a file that holds no readable secret.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        name: str = "client",
        identity: bytes | None = None,
        incarnation: int = 0,
        options: ChannelOptions | None = None,
        context: zmq.Context[Any] | None = None,
        on_event: Callable[[PeerEvent], None] | None = None,
        on_credit: Callable[[int], None] | None = None,
        control: bool = False,
        secret: str | None = None,
        curve: CurveSetting = None,
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self.identity = identity or f"{name}:{os.getpid()}:{uuid.uuid4().hex[:8]}".encode()
        self.incarnation = incarnation
        self.options = options or ChannelOptions()
        self._context = context or zmq.Context.instance()
        self._on_event = on_event
        self._on_credit = on_credit
        self.control = control
        self._curve = curve
        self._keyed = False  # Curve is on (set by connect)
        self._secret = secret or run_secret()
        self._held = Held()  # requests made while the connection is broken
        self._rehandshaking: asyncio.Task[None] | None = None
        self._log = RateLimitedLog(log, f"client {name}")
        self._ids = itertools.count(1)
        self._in_flight = InFlight(self._expired)
        self._pump: Pump | None = None
        self._monitor: Pump | None = None
        self._ticker: asyncio.TimerHandle | None = None
        self._closed = False
        self._alive = True
        self._connected_once = False
        self._last_heard_ns = clock()  # any message from the server sets it
        self._host = host_id()
        self._pool: ShmPool | None = None
        self._use_shm = False
        self._releases = Releases(self._send_release, lambda: self._closed)
        self._tasks: set[asyncio.Task[None]] = set()
        self.server: Hello | None = None
        self.peer_incarnation = -1  # stamped on the last message the server sent
        self.codec = Codec(
            inline_threshold=self.options.inline_threshold,
            shm_threshold=self.options.shm_threshold,
            max_message_bytes=self.options.max_message_bytes,
            shm_reader=ShmReader() if self.options.shm else None,
        )
        self.stats: Counter[str] = Counter()
        self._tracer = current()  # None unless tracing is on
        self._record = None if self._tracer is None else self._tracer.record
        self._channel = (
            -1 if self._tracer is None else self._tracer.channel(endpoint, self.identity)
        )

    # -- life cycle -----------------------------------------------------------------------

    async def connect(self, timeout: float = 10.0) -> Hello:
        """Connect and handshake; returns the server's Hello.

        Raises:
            ProtocolVersionError: the server speaks another protocol version.
            DeadlineExceededError: no handshake answer within ``timeout`` seconds.
            TransportError: the endpoint is malformed.
        """
        if self._pump is not None:
            raise RuntimeError(f"client {self.name} already connected")
        sock = dealer(self._context, self.identity, self.options)
        self._keyed = secure_client(sock, self.endpoint, self._curve)
        events = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        events |= zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        self._monitor = Pump(sock.get_monitor_socket(events), self._on_monitor)
        try:
            connect(sock, self.endpoint, allow_remote=self._keyed)
        except TransportError:
            self._monitor.close()
            sock.close(linger=0)
            raise
        self._pump = Pump(sock, self._on_message)
        self._schedule_tick()
        return await self._handshake(timeout)

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Fail pending requests with ClosedError and close the socket with linger 0."""
        if self._closed:
            return
        self._closed = True
        if self._ticker is not None:
            self._ticker.cancel()
        self._in_flight.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._in_flight.fail_all(
            lambda p: ClosedError(
                f"client {self.name} was closed with request {p.method!r} to {self.endpoint} "
                f"in flight"
            )
        )
        if self._pump is not None:
            try:
                self._pump.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._pump.close()
        if self._monitor is not None:
            self._monitor.close()
        if self._pool is not None:
            self._pool.close()
        if self.codec.shm_reader is not None:
            self.codec.shm_reader.close()
        self._log.flush(force=True)

    @property
    def alive(self) -> bool:
        """False from the moment heartbeats are missed until the server is heard again."""
        return self._alive

    @property
    def last_heard(self) -> float:
        """When (``time.monotonic()``) the server was last heard: any message resets it."""
        return self._last_heard_ns / 1e9

    @property
    def pending(self) -> int:
        """Requests sent and not yet answered."""
        return len(self._in_flight)

    # -- calls ----------------------------------------------------------------------------

    def call_future(
        self,
        method: str,
        payload: Any = None,
        reply_type: Any = Any,
        *,
        timeout: float = 30.0,
        attempt: int = 0,
        trace: str = "",
    ) -> asyncio.Future[Any]:
        """Send a request now and return the future of its reply (no coroutine per call).

        Raises:
            ClosedError: the client is closed.
            TypeError: the payload cannot be encoded.
        """
        if self._closed or self._pump is None:
            raise ClosedError(f"client {self.name} is closed or not connected")
        request_id = next(self._ids)
        env = Envelope(
            PROTOCOL_VERSION,
            Kind.REQUEST,
            request_id,
            method,
            time.time() + timeout,
            attempt,
            self.incarnation,
            trace,
            payload,
        )
        frames = self.codec.encode(env, peer=b"", use_shm=self._use_shm)
        loop = self._pump.loop
        fut: asyncio.Future[Any] = loop.create_future()
        self._in_flight.add(
            request_id,
            Pending(fut, loop.time() + timeout, reply_type, method, timeout, self.server),
        )
        record = self._record
        if record is not None:  # before the send: a reply may come before we run again
            size = (
                len(frames[0])
                if len(frames) == 1 and not env.tensors
                else nbytes(frames, env.tensors)
            )
            record((CALL, method, self._channel, request_id, clock(), size))
        if self._held.holding:  # the connection broke: sent after the next handshake
            self._held.add(request_id, frames, list(self.codec.last_slots))
            return fut
        try:
            self._pump.send(frames)
        except TransportError:
            self._in_flight.pop(request_id)
            self._release_own(self.codec.last_slots)
            raise
        return fut

    async def call(
        self,
        method: str,
        payload: Any = None,
        reply_type: Any = Any,
        *,
        timeout: float = 30.0,
        attempt: int = 0,
        trace: str = "",
    ) -> Any:
        """Call ``method`` with ``payload`` and return the reply decoded as ``reply_type``.

        Raises:
            RemoteError: the server answered with an error.
            DeadlineExceededError: no answer within ``timeout`` seconds.
            PeerDeadError: the server stopped answering heartbeats.
            DisconnectedError: the connection broke with the request in flight.
            ClosedError: this client was closed.
        """
        return await self.call_future(
            method, payload, reply_type, timeout=timeout, attempt=attempt, trace=trace
        )

    def send_stop(self) -> None:
        """Ask the server to stop cleanly (a STOP control message; no answer when it is obeyed).

        A server with the run's secret obeys only a client created with ``control=True`` that
        holds it; otherwise it answers ERROR ``unauthorized`` (logged here).

        Raises:
            ClosedError: the client is closed or not connected.
        """
        self._send(Envelope(PROTOCOL_VERSION, Kind.STOP, incarnation=self.incarnation))

    # -- receiving ------------------------------------------------------------------------

    def _on_message(self, frames: list[Any]) -> None:
        try:
            env = self.codec.decode_envelope(frames)
        except ProtocolVersionError as exc:
            # The server speaks another version: whatever it answered, the request fails.
            self.stats["bad_input"] += 1
            pending = self._in_flight.pop(self.codec.salvage_id(frames))
            if pending is not None and not pending.fut.done():
                pending.fut.set_exception(ProtocolVersionError(exc.ours, exc.theirs, self.endpoint))
            return
        except ProtocolError as exc:
            self.stats["bad_input"] += 1
            self._log.warning(
                "bad input",
                self.endpoint,
                "client %s dropped a message from %s: %s",
                self.name,
                self.endpoint,
                exc,
            )
            return
        self.peer_incarnation = env.incarnation
        now = self._last_heard_ns = clock()
        if not self._alive:
            self._revived()
        kind = env.kind
        record = self._record
        if record is not None and kind in _ENDS:
            record((REPLY, self._channel, env.id, now))
        if kind in (_REPLY, _WELCOME):
            self._reply(env, frames)
        elif kind == _ERROR:
            self._error(env, frames)
        elif kind == _CREDIT:
            if self._on_credit is not None:
                try:
                    credit = self.codec.decode_payload(env, frames, Credit)
                except ProtocolError as exc:
                    self.stats["bad_input"] += 1
                    self._log.warning(
                        "bad credit", self.endpoint, "client %s: bad credit: %s", self.name, exc
                    )
                    return
                self._on_credit(credit.slots)
        elif kind == Kind.RELEASE:
            try:
                release = self.codec.decode_payload(env, frames, Release)
            except ProtocolError:
                self.stats["bad_input"] += 1
                return
            self._release_own(release.slots)
        elif kind != Kind.PONG:
            self.stats["unexpected_kind"] += 1

    def _reply(self, env: RawEnvelope, frames: list[Any]) -> None:
        pending = self._in_flight.pop(env.id)
        if pending is None:
            # Answered after its deadline, or a duplicate: its shared memory still goes back.
            self.stats["late_replies"] += 1
            slots = [d.slot for d in env.tensors if d.where == 2]
            if slots:
                self._releases.queue(b"", slots)
            return
        if pending.fut.done():
            return
        server = self.server
        try:
            value = self.codec.decode_payload(
                env,
                frames,
                pending.reply_type,
                self._releases.callback(b""),
                allow_shm=server is not None and bool(server.host) and server.host == self._host,
            )
        except ProtocolError as exc:
            self.stats["bad_input"] += 1
            pending.fut.set_exception(exc)
            return
        pending.fut.set_result(value)

    def _error(self, env: RawEnvelope, frames: list[Any]) -> None:
        try:
            info = self.codec.decode_payload(env, frames, ErrorInfo)
        except ProtocolError as exc:
            self.stats["bad_input"] += 1
            info = ErrorInfo(ErrorCode.DECODE, f"undecodable error reply: {exc}")
        pending = self._in_flight.pop(env.id)
        if pending is None:
            self.stats["orphan_errors"] += 1
            self._log.warning(
                f"error reply {info.code}",
                self.endpoint,
                "client %s: error reply from %s: [%s] %s",
                self.name,
                self.endpoint,
                info.code,
                info.message,
            )
            return
        if pending.fut.done():
            return
        pending.fut.set_exception(
            RemoteError(
                info.code,
                info.message,
                remote_type=info.type,
                peer=self.endpoint,
                retryable=info.retryable,
            )
        )

    def _on_monitor(self, frames: list[Any]) -> None:
        refusal = handshake_refusal(frames, self.endpoint, keyed=self._keyed)
        if refusal is not None:
            self.stats["refused"] += 1
            self._in_flight.fail_all(lambda p: refusal())
            return
        event = parse_monitor_message([f.bytes for f in frames])["event"]
        if event == zmq.EVENT_DISCONNECTED:
            self.stats["disconnects"] += 1
            self._held.start()
            count = len(self._in_flight)
            self._in_flight.fail_all(
                lambda p: DisconnectedError(
                    f"the connection to {self.endpoint} broke with request {p.method!r} in flight; "
                    f"the server exited or restarted, so the request may or may not have run"
                )
            )
            self._emit("disconnected", f"{count} requests failed")
        elif event == zmq.EVENT_CONNECTED and self._connected_once and not self._closed:
            if self._rehandshaking is not None and not self._rehandshaking.done():
                return  # the running one keeps trying until the server answers
            task = asyncio.get_running_loop().create_task(self._rehandshake())
            self._rehandshaking = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _rehandshake(self) -> None:
        """Handshake again after a reconnect, until it succeeds or the client is closed."""
        await rehandshake(self._handshake, lambda: self._closed, self.options, self._retry)

    def _retry(self, tries: int, exc: TransportError) -> None:
        self.stats["rehandshake_failures"] += 1
        self._log.warning(
            "handshake retry",
            self.endpoint,
            "client %s: handshake %d after reconnect to %s failed, trying again: %s",
            self.name,
            tries,
            self.endpoint,
            exc,
        )

    async def _handshake(self, timeout: float) -> Hello:
        hello = Hello(
            PROTOCOL_VERSION,
            name=self.name,
            pid=os.getpid(),
            incarnation=self.incarnation,
            host=self._host,
            shm=self.codec.shm_reader is not None,
            run=self.options.run,
            control=(self._secret or "") if self.control else "",
            secret=self._secret or "",
        )
        assert self._pump is not None
        request_id = next(self._ids)
        loop = self._pump.loop
        fut: asyncio.Future[Any] = loop.create_future()
        self._in_flight.add(
            request_id, Pending(fut, loop.time() + timeout, Hello, "handshake", timeout)
        )
        self._send(
            Envelope(
                PROTOCOL_VERSION,
                Kind.HANDSHAKE,
                request_id,
                incarnation=self.incarnation,
                payload=hello,
            )
        )
        welcome: Hello = await fut
        if welcome.version != PROTOCOL_VERSION:
            raise ProtocolVersionError(PROTOCOL_VERSION, welcome.version, self.endpoint)
        previous = self.server
        self.server = welcome
        self._use_shm = bool(self.options.shm and welcome.shm and welcome.host == self._host)
        if self._use_shm and self._pool is None:
            self._pool = ShmPool(
                self.options.run, self.incarnation, max_bytes=self.options.shm_max_bytes
            )
            self.codec.shm_pool = self._pool
        self._connected_once = True
        restarted = previous is not None and previous.incarnation != welcome.incarnation
        if restarted and self._pool is not None:
            # The dead incarnation's slots come back first: the held requests' slots stay lent,
            # as the new server reads them once they are sent.
            self._pool.release_peer(b"", keep=self._held.slots())
        self._held.release(self._in_flight, self._pump.send, self._release_own)
        if previous is not None and restarted:
            self._emit(
                "restarted",
                f"incarnation {previous.incarnation} -> {welcome.incarnation}, pid {welcome.pid}",
            )
        else:
            self._emit("connected", f"pid {welcome.pid}")
        return welcome

    # -- liveness -------------------------------------------------------------------------

    def _schedule_tick(self) -> None:
        assert self._pump is not None
        self._ticker = self._pump.loop.call_later(self.options.heartbeat_interval_s, self._tick)

    def _tick(self) -> None:
        if self._closed:
            return
        silent = (clock() - self._last_heard_ns) / 1e9
        limit = self.options.dead_after_s
        # A server that never answered is not dead but not up yet: until the first handshake
        # only the connect timeout applies, so a slow start is not mistaken for a hang.
        if self._alive and self._connected_once and silent > limit:
            self._alive = False
            self._in_flight.fail_all(lambda p: PeerDeadError(self.endpoint, silent, limit))
            if self._pool is not None:
                self._pool.release_peer(b"")
            self._emit("dead", f"silent for {silent:.3f} s")
        try:
            self._send(Envelope(PROTOCOL_VERSION, Kind.PING, incarnation=self.incarnation))
        except TransportError:
            pass
        self._schedule_tick()

    def _revived(self) -> None:
        self._alive = True
        self._emit("alive")

    def _expired(self, pending: Pending) -> None:
        self.stats["deadlines"] += 1
        pending.fut.set_exception(pending.deadline_error(self.endpoint))

    def _emit(self, kind: EventKind, detail: str = "") -> None:
        incarnation = self.server.incarnation if self.server is not None else -1
        if self._on_event is not None:
            self._on_event(PeerEvent(self.endpoint, kind, incarnation, detail))

    # -- shared memory --------------------------------------------------------------------

    def _release_own(self, slots: list[int]) -> None:
        if self._pool is not None:
            for slot in slots:
                self._pool.release(slot)

    def _send_release(self, peer: bytes, slots: list[int]) -> None:
        env = Envelope(PROTOCOL_VERSION, Kind.RELEASE, incarnation=self.incarnation)
        env.payload = Release(slots)
        self._send(env)

    def _send(self, env: Envelope) -> None:
        if self._pump is None or self._closed:
            raise ClosedError(f"client {self.name} is closed or not connected")
        self._pump.send(self.codec.encode(env))
