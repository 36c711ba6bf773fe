"""The stream's fast path: small messages batched into one frame, and decoded in one call.

A stream sender gathers the small messages of one loop turn into a BATCH: one frame holding
their MESSAGE envelopes, each the bytes it would have travelled as alone (``encode_batch``). One
frame is one read from the socket at the receiver, however many messages it carries.

``FastDecoder`` decodes a plain MESSAGE frame, or a BATCH of them, in one msgspec call into
Structs whose version, kind and tensors are constrained by their types, so that msgspec checks
them while it decodes, rather than ``Codec``'s two steps (the envelope with its payload left raw,
then the payload) with checks in Python between them.

It only ever accepts what ``Codec`` would accept, and gives the same payloads. Everything else
(short envelopes, tensors, another version or kind, a payload of another type, malformed bytes)
raises ``Unfit``, and the caller decodes the message with ``Codec``, which reports it exactly.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .codec import Codec, dec_hook
from .protocol import MAX_BATCH, PROTOCOL_VERSION, Kind

__all__ = ["BATCH_BYTES", "BATCH_ITEMS", "FastDecoder", "Unfit", "encode_batch"]

BATCH_ITEMS = 256
"""The most messages a sender puts in one BATCH (at most ``MAX_BATCH``)."""

BATCH_BYTES = 64 << 10
"""The most envelope bytes a sender puts in one BATCH; a larger message travels alone."""

_BATCH = int(Kind.BATCH)
_encoder = msgspec.msgpack.Encoder()


class Unfit(Exception):
    """The message is not one the fast path takes; decode it with ``Codec``."""


def _no_tensors(code: int, data: memoryview) -> Any:
    raise Unfit("a tensor reference")


def encode_batch(topic: str, incarnation: int, items: list[bytes]) -> bytes:
    """The BATCH frame of ``items``, encoded MESSAGE envelopes without tensors, in order."""
    n = len(items)
    head = bytes((0x90 | n,)) if n < 16 else b"\xdc" + n.to_bytes(2, "big")  # array header
    payload = msgspec.Raw(head + b"".join(items))
    return _encoder.encode(
        (PROTOCOL_VERSION, _BATCH, 0, topic, 0.0, 0, incarnation, "", payload, ())
    )


def _envelope_type(kind: Kind, payload_type: Any) -> type[msgspec.Struct]:
    """An envelope Struct of ``kind`` whose payload is ``payload_type``: every position up to
    the payload required, version and kind fixed, and no tensors."""
    return msgspec.defstruct(
        f"Fast{kind.name.title()}",
        [
            ("version", Literal[PROTOCOL_VERSION]),
            ("kind", Literal[int(kind)]),
            ("id", int),
            ("method", str),
            ("deadline", float),
            ("attempt", int),
            ("incarnation", int),
            ("trace", str),
            ("payload", payload_type),
            ("tensors", Annotated[list[Any], msgspec.Meta(max_length=0)], []),
        ],
        array_like=True,
    )


class FastDecoder:
    """Decodes a MESSAGE frame without tensors, or a BATCH of them, into payloads.

    Args:
        payload_type: the receiver's payload type, as given to ``Codec.decode_payload``.
        codec: the receiver's codec, for its size limit.
    """

    def __init__(self, payload_type: Any, codec: Codec) -> None:
        self._max_bytes = codec.max_message_bytes
        message = _envelope_type(Kind.MESSAGE, payload_type)
        batch = _envelope_type(
            Kind.BATCH,
            Annotated[list[message], msgspec.Meta(max_length=MAX_BATCH)],  # type: ignore[valid-type]
        )
        self._one = msgspec.msgpack.Decoder(message, ext_hook=_no_tensors, dec_hook=dec_hook)
        self._many = msgspec.msgpack.Decoder(batch, ext_hook=_no_tensors, dec_hook=dec_hook)

    def payloads(self, frame: Any) -> list[Any]:
        """The payloads in ``frame``, in order: one for a MESSAGE, each of a BATCH's.

        Raises:
            Unfit: the fast path does not take this frame; ``Codec`` must decode it.
        """
        if len(frame) > self._max_bytes:
            raise Unfit("over the size limit")
        envelope: Any
        try:
            envelope = self._one.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            pass  # a BATCH fails here at its kind, before its payload is read
        else:
            return [envelope.payload]
        try:
            envelope = self._many.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            raise Unfit(str(exc)) from exc
        return [item.payload for item in envelope.payload]
