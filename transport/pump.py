"""The socket pump: drives one non-blocking ZeroMQ socket from the asyncio event loop.

A zmq.asyncio design that awaits one future per message costs about twice the round trip of this
one. The pump instead watches the socket's file descriptor with ``loop.add_reader``, and on each
wake-up drains every waiting message, then sends what was queued, both non-blocking until EAGAIN.

The zmq file descriptor is edge-triggered: it signals only when the socket's state changes, and
any send or receive may consume the signal. So after work done outside the reader callback (a
send from a coroutine), the pump schedules one check of ``ZMQ_EVENTS`` for the same loop turn.

A pump belongs to one loop thread; its socket is never touched from another thread.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import zmq

from .errors import ClosedError, PeerUnreachableError, TransportError

__all__ = ["Pump"]

log = logging.getLogger("asyncrl.transport.pump")

_LOGGED_ERRORS = 5  # handling errors logged with their traceback, then one in _LOG_EVERY
_LOG_EVERY = 1000
_MAX_BATCH = 512  # messages read per wake-up before yielding to other callbacks
# Plain ints: pyzmq's constants are enum members, and enum arithmetic costs microseconds a call.
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
# One frame goes through the backend's send: pyzmq's Socket.send wrapper only adds routing ids
# and groups (unused here) and more than doubles the cost of a small message.
_send_frame = zmq.backend.Socket.send


class Pump:
    """Reads and writes one zmq socket on the running loop.

    Args:
        sock: a socket this pump now owns; it is closed with linger 0 by ``close()``.
        on_message: called with the frames of each received message, as ``zmq.Frame`` objects
            (zero-copy; they support ``len`` and the buffer protocol), except the routing id.
        routed: the socket is a ROUTER: frame 0 is the sender's routing id, received as
            ``bytes``.
        on_send_error: called with (frames, error) for a queued message that could not be sent.
    """

    def __init__(
        self,
        sock: zmq.Socket[Any],
        on_message: Callable[[list[Any]], None] | None,
        *,
        routed: bool = False,
        on_send_error: Callable[[list[Any], TransportError], None] | None = None,
    ) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self._on_message = on_message
        self._routed = routed
        self._on_send_error = on_send_error
        self._out: deque[list[Any]] = deque()
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._check_scheduled = False
        self._in_ready = False
        self._paused = False
        self._closed = False
        self.errors = 0
        self._fd = cast(int, sock.getsockopt(zmq.FD))
        self.loop.add_reader(self._fd, self._on_ready)
        self.schedule_check()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def paused(self) -> bool:
        """True while reading is paused for back-pressure."""
        return self._paused

    @property
    def queued(self) -> int:
        """Messages waiting for the socket to accept them."""
        return len(self._out)

    def send(self, frames: list[Any]) -> bool:
        """Send one message now if the socket takes it, else queue it; True if sent now.

        Raises:
            ClosedError: the pump was closed.
            PeerUnreachableError: a ROUTER with ROUTER_MANDATORY has no such peer.
        """
        if self._closed:
            raise ClosedError("send on a closed channel")
        if self._out:
            self._out.append(frames)
            return False
        sock = self.sock
        try:
            if len(frames) == 1:
                _send_frame(sock, frames[0], _NOBLOCK)
            else:
                sock.send_multipart(frames, _NOBLOCK, copy=False)
        except zmq.Again:
            self._out.append(frames)
            self.schedule_check()
            return False
        except zmq.ZMQError as exc:
            raise _send_error(exc) from exc
        # Inside _on_ready the drain loop sees everything anyway; elsewhere the send may have
        # consumed the edge of a message that is already waiting. A socket that is only written
        # (PUSH) has none to miss, and the check costs more than the send.
        if (
            self._on_message is not None
            and not self._in_ready
            and not self._check_scheduled
            and cast(int, sock.getsockopt(_EVENTS)) & _POLLIN
        ):
            self.schedule_check()
        return True

    async def drained(self) -> None:
        """Wait until every queued message has been handed to the socket.

        Raises:
            ClosedError: the pump was closed first.
        """
        if not self._out:
            return
        if self._closed:
            raise ClosedError("channel closed with messages still queued")
        fut: asyncio.Future[None] = self.loop.create_future()
        self._drain_waiters.append(fut)
        await fut

    def read_waiting(self) -> None:
        """Read every message waiting now, from outside the pump's own callback: a caller that
        must see what the socket holds before it goes on (a server reads its monitor's events
        before it trusts an admission). Costs one ``ZMQ_EVENTS`` check when nothing waits."""
        while not (self._closed or self._in_ready or self._paused):
            if not cast(int, self.sock.getsockopt(_EVENTS)) & _POLLIN:
                return
            self._on_ready()  # at most _MAX_BATCH messages a time

    def pause_reading(self) -> None:
        """Stop reading: messages stay in zmq's queues, so the senders feel back-pressure."""
        self._paused = True

    def resume_reading(self) -> None:
        if self._paused:
            self._paused = False
            self.schedule_check()

    def schedule_check(self) -> None:
        """Look at the socket once more this loop turn: an edge may have been consumed."""
        if not self._check_scheduled and not self._closed:
            self._check_scheduled = True
            self.loop.call_soon(self._on_ready)

    def _on_ready(self) -> None:
        self._check_scheduled = False
        if self._closed:
            return
        self._in_ready = True
        try:
            self._drain()
        finally:
            self._in_ready = False

    def _drain(self) -> None:
        sock = self.sock
        if self._out:
            self._flush()
        # The loop ends on EAGAIN, which also leaves the edge-triggered descriptor armed. Frames
        # come as zmq.Frame so that ``more`` is read without a getsockopt call per frame.
        if self._on_message is not None and not self._paused:
            routed = self._routed
            for _ in range(_MAX_BATCH):
                try:
                    if routed:
                        frames: list[Any] = [sock.recv(_NOBLOCK)]
                        frame = sock.recv(copy=False)
                    else:
                        frames = []
                        frame = sock.recv(_NOBLOCK, copy=False)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    if self.closed:
                        return
                    raise
                frames.append(frame)
                while frame.more:
                    frame = sock.recv(copy=False)
                    frames.append(frame)
                try:
                    self._on_message(frames)
                except Exception:
                    # A bug in one message's handling must not stop the reading of the others.
                    # Only the first few are logged in full: a peer may trigger it at will.
                    self.errors += 1
                    if self.errors <= _LOGGED_ERRORS or self.errors % _LOG_EVERY == 0:
                        log.exception(
                            "dropped a message whose handling raised (%d so far)", self.errors
                        )
                if self._closed or self._paused:
                    return
            else:
                self.schedule_check()
                return
        if self._out:
            self._flush()
            if self.closed:
                return
            events = cast(int, sock.getsockopt(_EVENTS))
            if events & _POLLOUT or (events & _POLLIN and not self.paused):
                self.schedule_check()
        elif self._on_message is None:
            # Nothing was read or written, so nothing has taken the signal that woke us: the
            # descriptor would stay readable and wake the loop on every turn until it is.
            sock.getsockopt(_EVENTS)

    def _flush(self) -> None:
        sock = self.sock
        out = self._out
        while out:
            frames = out[0]
            try:
                if len(frames) == 1:
                    _send_frame(sock, frames[0], _NOBLOCK)
                else:
                    sock.send_multipart(frames, _NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                out.popleft()
                if self._on_send_error is not None:
                    self._on_send_error(frames, _send_error(exc))
                continue
            out.popleft()
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def close(self, linger_ms: int = 0) -> None:
        """Stop watching the socket and close it; ZeroMQ goes on sending what it holds for up
        to ``linger_ms`` (0: it drops it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.loop.remove_reader(self._fd)
        self.sock.close(linger=linger_ms)
        self._out.clear()
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_exception(ClosedError("channel closed with messages still queued"))


def _send_error(exc: zmq.ZMQError) -> TransportError:
    if exc.errno == errno.EHOSTUNREACH:
        return PeerUnreachableError(
            "no peer with that routing id is connected (it disconnected, or never connected)"
        )
    if exc.errno == zmq.ENOTSOCK:
        return ClosedError("the socket was closed")
    return TransportError(f"send failed: {exc}")
