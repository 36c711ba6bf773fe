"""One-way streams with back-pressure: PUSH senders, a PULL receiver, bounded queues.

Nothing is lost silently. When the receiver's queue is full it stops reading, zmq's queues fill up
to their high-water marks, and then ``StreamSender.send`` waits until there is room. A message
that cannot be decoded is dropped, counted in ``stats`` and logged (there is no reply channel to
tell the sender).

Streams carry tensors as frames; shared memory needs a reply channel for slot releases, which
request/reply has.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from typing import Any

import zmq

from .codec import Codec
from .curve import CurveSetting, ServerGuard, open_endpoint
from .errors import ClosedError, ProtocolError
from .options import ChannelOptions
from .protocol import Kind
from .pump import Pump
from .ratelog import RateLimitedLog
from .stream_decode import FastDecoder, Unfit

__all__ = ["StreamReceiver", "StreamSender"]

log = logging.getLogger("asyncrl.transport.stream")


def _socket(context: zmq.Context[Any] | None, kind: int, options: ChannelOptions) -> Any:
    sock = (context or zmq.Context.instance()).socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, options.send_hwm)
    sock.setsockopt(zmq.RCVHWM, options.recv_hwm)
    if kind == zmq.PULL:
        sock.setsockopt(zmq.MAXMSGSIZE, options.max_message_bytes)
    return sock


class StreamSender:
    """Sends typed messages one way to a StreamReceiver.

    Args:
        endpoint: the receiver's endpoint (or this sender's, with ``bind=True``).
        topic: stamped on each message (``Envelope.method``).
        bind: bind instead of connect (one sender, many receivers).
        curve: Curve on a tcp endpoint (the binding end serves with the server key pair, the
            connecting end presents the client key pair): keys, False, or None (``use_curve``).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        bind: bool = False,
        incarnation: int = 0,
        options: ChannelOptions | None = None,
        context: zmq.Context[Any] | None = None,
        curve: CurveSetting = None,
    ) -> None:
        self.endpoint = endpoint
        self.topic = topic
        self._curve = curve
        self._guard: ServerGuard | None = None
        self.incarnation = incarnation
        self.options = options or ChannelOptions()
        self._bind = bind
        self._context = context
        self._pump: Pump | None = None
        self._seq = 0
        self.codec = Codec(
            inline_threshold=self.options.inline_threshold,
            max_message_bytes=self.options.max_message_bytes,
        )

    async def start(self) -> str:
        sock = _socket(self._context, zmq.PUSH, self.options)
        self.endpoint, self._guard = open_endpoint(
            sock, self.endpoint, self._curve, binds=self._bind, name=f"stream {self.endpoint}"
        )
        self._pump = Pump(sock, None)
        return self.endpoint

    async def __aenter__(self) -> StreamSender:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def send_nowait(self, payload: Any) -> bool:
        """Queue ``payload``; False when the caller should ``await drained()`` before more.

        Raises:
            ClosedError: the sender is closed.
        """
        if self._pump is None:
            raise ClosedError("stream sender is not started or was closed")
        self._seq += 1
        frames = self.codec.encode_message(self._seq, self.topic, self.incarnation, payload)
        return self._pump.send(frames)

    async def send(self, payload: Any) -> None:
        """Send ``payload``, waiting while the receiver's queues are full.

        Raises:
            ClosedError: the sender was closed while waiting.
        """
        if not self.send_nowait(payload):
            await self.drained()

    async def drained(self) -> None:
        if self._pump is not None:
            await self._pump.drained()

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.close()
            self._pump = None
        if self._guard is not None:
            self._guard.close()


class StreamReceiver:
    """Receives typed messages from any number of StreamSenders, in a bounded queue.

    Args:
        endpoint: where to bind (or, with ``bind=False``, the sender to connect to).
        type_: the payload type; messages that do not decode as it are dropped and counted.
        capacity: the most decoded messages held; past it, reading stops until some are taken.
        curve: Curve on a tcp endpoint, as for ``StreamSender``.
    """

    def __init__(
        self,
        endpoint: str,
        type_: Any = Any,
        *,
        capacity: int = 4096,
        bind: bool = True,
        options: ChannelOptions | None = None,
        context: zmq.Context[Any] | None = None,
        curve: CurveSetting = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.endpoint = endpoint
        self.type = type_
        self.capacity = capacity
        self.options = options or ChannelOptions()
        self._bind = bind
        self._context = context
        self._curve = curve
        self._guard: ServerGuard | None = None
        self._pump: Pump | None = None
        self._queue: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self.codec = Codec(
            inline_threshold=self.options.inline_threshold,
            max_message_bytes=self.options.max_message_bytes,
        )
        self._fast = FastDecoder(type_, self.codec)
        self.stats: Counter[str] = Counter()
        self._log = RateLimitedLog(log, f"stream {endpoint}")

    async def start(self) -> str:
        sock = _socket(self._context, zmq.PULL, self.options)
        self.endpoint, self._guard = open_endpoint(
            sock,
            self.endpoint,
            self._curve,
            binds=self._bind,
            name=f"stream {self.endpoint}",
            stats=self.stats,
        )
        self._pump = Pump(sock, self._on_message)
        return self.endpoint

    async def __aenter__(self) -> StreamReceiver:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __len__(self) -> int:
        return len(self._queue)

    async def recv(self) -> Any:
        """The next message, waiting for one.

        Raises:
            ClosedError: the receiver was closed.
        """
        while not self._queue:
            await self._wait()
        return self._take(1)[0]

    async def recv_batch(self, max_items: int = 1 << 30) -> list[Any]:
        """Every waiting message (at least one, at most ``max_items``), waiting for the first.

        Raises:
            ClosedError: the receiver was closed.
        """
        while not self._queue:
            await self._wait()
        return self._take(max_items)

    async def close(self) -> None:
        self._closed = True
        if self._pump is not None:
            self._pump.close()
        if self._guard is not None:
            self._guard.close()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ClosedError("stream receiver closed"))

    def _take(self, n: int) -> list[Any]:
        queue = self._queue
        out = [queue.popleft() for _ in range(min(n, len(queue)))]
        if self._pump is not None and len(queue) < self.capacity:
            self._pump.resume_reading()
        return out

    async def _wait(self) -> None:
        if self._closed or self._pump is None:
            raise ClosedError("stream receiver is closed or not started")
        self._waiter = self._pump.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _on_message(self, frames: list[Any]) -> None:
        if len(frames) == 1:
            try:
                payload = self._fast.payload(frames[0])
            except Unfit:
                pass
            else:
                self._deliver(payload)
                return
        try:
            env = self.codec.decode_envelope(frames)
            if env.kind != Kind.MESSAGE:
                raise ProtocolError(
                    f"a stream carries MESSAGE envelopes, got {Kind(env.kind).name}"
                )
            payload = self.codec.decode_payload(env, frames, self.type)
        except ProtocolError as exc:
            self.stats["bad_input"] += 1
            self._log.warning(
                "bad input", "", "stream %s dropped a message: %s", self.endpoint, exc
            )
            return
        self._deliver(payload)

    def _deliver(self, payload: Any) -> None:
        self.stats["received"] += 1
        self._queue.append(payload)
        if len(self._queue) >= self.capacity and self._pump is not None:
            self._pump.pause_reading()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
