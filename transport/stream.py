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
from typing import Annotated, Any

import msgspec
import zmq

from .codec import Codec
from .curve import CurveSetting, ServerGuard, open_endpoint
from .errors import ClosedError, ProtocolError
from .options import ChannelOptions
from .protocol import MAX_BATCH, Kind
from .pump import Pump
from .ratelog import RateLimitedLog
from .stream_codec import BATCH_BYTES, BATCH_ITEMS, FastDecoder, Unfit, encode_batch

__all__ = ["StreamReceiver", "StreamSender"]

log = logging.getLogger("asyncrl.transport.stream")

CLOSE_LINGER_MS = 1000
"""How long ZeroMQ goes on sending what a closed stream sender handed it (a receiver that is
gone costs the process at most this at exit)."""


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
        self._batch: list[bytes] = []  # encoded envelopes not yet handed to the pump
        self._batch_bytes = 0
        self._flush_handle: asyncio.Handle | None = None
        # A batch must stay far below what a receiver refuses (its MAXMSGSIZE drops a frame
        # over it without a word): half the limit leaves room for the batch's own framing.
        self._batch_limit = min(BATCH_BYTES, self.options.max_message_bytes // 2)
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

        Small messages without tensor frames sent in one loop turn travel together as one
        BATCH frame, handed to the socket at the end of the turn (or when the batch is full).

        Raises:
            ClosedError: the sender is closed.
            TypeError: ``payload`` holds a value that cannot travel.
        """
        pump = self._pump
        if pump is None:
            raise ClosedError("stream sender is not started or was closed")
        self._seq += 1
        frames = self.codec.encode_message(self._seq, self.topic, self.incarnation, payload)
        size = len(frames[0])
        if len(frames) > 1 or size > self._batch_limit:
            self._flush()  # what came before goes first
            return pump.send(frames)
        if self._batch_bytes + size > self._batch_limit:
            self._flush()
        self._batch.append(frames[0])
        self._batch_bytes += size
        if len(self._batch) >= BATCH_ITEMS:
            return self._flush()
        if self._flush_handle is None:
            self._flush_handle = pump.loop.call_soon(self._flush)
        return not pump.queued

    def _flush(self) -> bool:
        """Hand the gathered messages to the pump: alone as a MESSAGE, several as a BATCH.
        True when the socket took them."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        batch = self._batch
        if not batch or self._pump is None:
            return self._pump is None or not self._pump.queued
        self._batch = []
        self._batch_bytes = 0
        if len(batch) == 1:
            return self._pump.send(batch)
        return self._pump.send([encode_batch(self.topic, self.incarnation, batch)])

    async def send(self, payload: Any) -> None:
        """Send ``payload``, waiting while the receiver's queues are full.

        Raises:
            ClosedError: the sender was closed while waiting.
        """
        if not self.send_nowait(payload):
            await self.drained()

    async def drained(self) -> None:
        """Wait until every message sent so far has been handed to the socket.

        Raises:
            ClosedError: the sender was closed while waiting.
        """
        if self._pump is not None:
            self._flush()
            await self._pump.drained()

    async def close(self) -> None:
        """Hand what was sent to the socket, then close it; ZeroMQ delivers what it holds for up
        to ``CLOSE_LINGER_MS`` more."""
        if self._pump is not None:
            self._flush()
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self._batch = []
        if self._pump is not None:
            self._pump.close(linger_ms=CLOSE_LINGER_MS)
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
        self._held: deque[Any] = deque()  # the rest of a batch that overfilled the queue
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self.codec = Codec(
            inline_threshold=self.options.inline_threshold,
            max_message_bytes=self.options.max_message_bytes,
        )
        self._fast = FastDecoder(type_, self.codec)
        self._batch_items = msgspec.msgpack.Decoder(
            Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_BATCH)]
        )
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
        held = self._held
        while held and len(queue) < self.capacity:
            queue.append(held.popleft())
        if self._pump is not None and not held and len(queue) < self.capacity:
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
                payloads = self._fast.payloads(frames[0])
            except Unfit:
                pass
            else:
                self._deliver(payloads)
                return
        try:
            env = self.codec.decode_envelope(frames)
            if env.kind == Kind.BATCH and len(frames) == 1:
                items = self._batch_items.decode(env.payload)
            else:
                items = None
        except (ProtocolError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._bad(exc)
            return
        if items is None:
            self._on_one(frames)
        else:  # a bad envelope inside a batch costs only itself
            for item in items:
                self._on_one([item])

    def _on_one(self, frames: list[Any]) -> None:
        """Decode one MESSAGE with the full codec, which says exactly what is wrong with it."""
        try:
            env = self.codec.decode_envelope(frames)
            if env.kind != Kind.MESSAGE:
                raise ProtocolError(
                    f"a stream carries MESSAGE envelopes (or one frame of them as a BATCH), "
                    f"got {Kind(env.kind).name}"
                )
            payload = self.codec.decode_payload(env, frames, self.type)
        except ProtocolError as exc:
            self._bad(exc)
            return
        self._deliver([payload])

    def _bad(self, exc: Exception) -> None:
        self.stats["bad_input"] += 1
        self._log.warning("bad input", "", "stream %s dropped a message: %s", self.endpoint, exc)

    def _deliver(self, payloads: list[Any]) -> None:
        """Queue ``payloads``; what does not fit under ``capacity`` is held, and reading stops."""
        self.stats["received"] += len(payloads)
        queue = self._queue
        room = 0 if self._held else self.capacity - len(queue)
        if len(payloads) <= room:
            queue.extend(payloads)
        else:
            queue.extend(payloads[:room])
            self._held.extend(payloads[room:])
        if len(queue) >= self.capacity and self._pump is not None:
            self._pump.pause_reading()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
