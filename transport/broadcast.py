"""Broadcast for control messages that may be lost: PUB/SUB, latest value wins.

A publisher never waits: a subscriber that is slow or not yet connected misses messages (zmq drops
them at its high-water mark). So broadcast carries only values where the newest is all that
matters (a weights version, a stop flag). A subscriber keeps the latest value per topic.

Frames: ``[topic, envelope, tensor frames...]``; the topic frame lets zmq filter by prefix.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import zmq

from .codec import Codec
from .curve import CurveSetting, ServerGuard, open_endpoint
from .errors import ClosedError, ProtocolError
from .options import ChannelOptions
from .protocol import PROTOCOL_VERSION, Envelope, Kind
from .pump import Pump
from .ratelog import RateLimitedLog

__all__ = ["Publisher", "Subscriber"]

log = logging.getLogger("asyncrl.transport.broadcast")


class Publisher:
    """Publishes typed values by topic to every connected Subscriber.

    Args:
        endpoint: where to bind.
        curve: Curve on a tcp endpoint (the server key pair): keys, False (never), or None (the
            process-wide default of ``use_curve``).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        incarnation: int = 0,
        options: ChannelOptions | None = None,
        context: zmq.Context[Any] | None = None,
        curve: CurveSetting = None,
    ) -> None:
        self.endpoint = endpoint
        self.incarnation = incarnation
        self._curve = curve
        self._guard: ServerGuard | None = None
        self.options = options or ChannelOptions()
        self._context = context or zmq.Context.instance()
        self._pump: Pump | None = None
        self._seq = 0
        self.codec = Codec(
            inline_threshold=self.options.inline_threshold,
            max_message_bytes=self.options.max_message_bytes,
        )

    async def start(self) -> str:
        sock = self._context.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.options.send_hwm)
        self.endpoint, self._guard = open_endpoint(
            sock, self.endpoint, self._curve, binds=True, name=f"publisher {self.endpoint}"
        )
        self._pump = Pump(sock, None)
        return self.endpoint

    async def __aenter__(self) -> Publisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def publish(self, topic: str, payload: Any) -> None:
        """Publish ``payload`` under ``topic``; never waits.

        Raises:
            ClosedError: the publisher is closed.
        """
        if self._pump is None:
            raise ClosedError("publisher is not started or was closed")
        self._seq += 1
        env = Envelope(
            PROTOCOL_VERSION,
            Kind.MESSAGE,
            self._seq,
            topic,
            incarnation=self.incarnation,
            payload=payload,
        )
        self._pump.send([topic.encode(), *self.codec.encode(env)])

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.close()
            self._pump = None
        if self._guard is not None:
            self._guard.close()


class Subscriber:
    """Keeps the latest value of each subscribed topic.

    Args:
        endpoint: the publisher's endpoint.
        topics: topic name -> payload type. Only these topics are received.
        curve: Curve on a tcp endpoint (the client key pair): keys, False, or None (default).
    """

    def __init__(
        self,
        endpoint: str,
        topics: dict[str, Any],
        *,
        options: ChannelOptions | None = None,
        context: zmq.Context[Any] | None = None,
        curve: CurveSetting = None,
    ) -> None:
        self.endpoint = endpoint
        self.topics = dict(topics)
        self._curve = curve
        self.options = options or ChannelOptions()
        self._context = context or zmq.Context.instance()
        self._pump: Pump | None = None
        self._latest: dict[str, Any] = {}
        self._seq: dict[str, int] = {}
        self._changed: asyncio.Event | None = None
        self.codec = Codec(
            inline_threshold=self.options.inline_threshold,
            max_message_bytes=self.options.max_message_bytes,
        )
        self.stats: Counter[str] = Counter()
        self._log = RateLimitedLog(log, f"subscriber {endpoint}")

    async def start(self) -> None:
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.options.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, self.options.recv_hwm)
        for topic in self.topics:
            # The topic frame is matched by prefix; subscribing to the exact frame bytes and
            # checking equality on arrival keeps "w" from receiving "weights".
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        open_endpoint(sock, self.endpoint, self._curve, binds=False, name="subscriber")
        self._changed = asyncio.Event()
        self._pump = Pump(sock, self._on_message)

    async def __aenter__(self) -> Subscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def latest(self, topic: str) -> Any:
        """The newest value received on ``topic``, or None."""
        return self._latest.get(topic)

    async def wait_for(self, topic: str, predicate: Any = None) -> Any:
        """Wait until ``topic`` has a value (for which ``predicate(value)`` holds); return it.

        Raises:
            ClosedError: the subscriber was closed.
        """
        while True:
            if self._pump is None or self._changed is None:
                raise ClosedError("subscriber is not started or was closed")
            value = self._latest.get(topic)
            if value is not None and (predicate is None or predicate(value)):
                return value
            self._changed.clear()
            await self._changed.wait()

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.close()
            self._pump = None
        if self._changed is not None:
            self._changed.set()

    def _on_message(self, frames: list[Any]) -> None:
        topic = frames[0].bytes.decode(errors="replace")
        type_ = self.topics.get(topic)
        if type_ is None:
            return  # a longer topic sharing a subscribed prefix
        try:
            env = self.codec.decode_envelope(frames[1:])
            if env.kind != Kind.MESSAGE or env.method != topic:
                raise ProtocolError(f"expected a MESSAGE on topic {topic!r}")
            payload = self.codec.decode_payload(env, frames[1:], type_)
        except ProtocolError as exc:
            self.stats["bad_input"] += 1
            self._log.warning(
                "bad input", topic, "subscriber %s dropped a message: %s", self.endpoint, exc
            )
            return
        key = f"{topic}"
        self.stats["received"] += 1
        self._latest[key] = payload
        if self._changed is not None:
            self._changed.set()
