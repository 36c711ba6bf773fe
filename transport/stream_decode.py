"""The stream receiver's fast path: a plain MESSAGE envelope decoded in one msgspec call.

``Codec`` decodes a message in two steps (the envelope with its payload left raw, then the
payload as the receiver's type), and checks version, kind and tensors in Python between them.
For the common stream message (one frame, no tensors, every position written, as asyncrl's
senders write it) that costs more than reading it from the socket. ``FastDecoder`` instead
decodes the whole envelope at once into a Struct whose version, kind and tensors are constrained
by their types, so msgspec checks them while it decodes.

It only ever accepts what ``Codec`` would accept, and gives the same payload. Everything else
(short envelopes, tensors, another version or kind, a payload of another type, malformed bytes)
raises ``Unfit``, and the caller decodes the message with ``Codec``, which reports it exactly.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .codec import Codec, dec_hook
from .protocol import PROTOCOL_VERSION, Kind

__all__ = ["FastDecoder", "Unfit"]


class Unfit(Exception):
    """The message is not one the fast path takes; decode it with ``Codec``."""


def _no_tensors(code: int, data: memoryview) -> Any:
    raise Unfit("a tensor reference")


def _envelope_type(payload_type: Any) -> type[msgspec.Struct]:
    """An envelope Struct whose payload is ``payload_type``: every position up to the payload
    required, version and kind fixed to this protocol's MESSAGE, and no tensors."""
    return msgspec.defstruct(
        "FastEnvelope",
        [
            ("version", Literal[PROTOCOL_VERSION]),
            ("kind", Literal[int(Kind.MESSAGE)]),
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
    """Decodes single-frame MESSAGE envelopes without tensors into their payload.

    Args:
        payload_type: the receiver's payload type, as given to ``Codec.decode_payload``.
        codec: the receiver's codec, for its size limit.
    """

    def __init__(self, payload_type: Any, codec: Codec) -> None:
        self._max_bytes = codec.max_message_bytes
        self._decoder = msgspec.msgpack.Decoder(
            _envelope_type(payload_type), ext_hook=_no_tensors, dec_hook=dec_hook
        )

    def payload(self, frame: Any) -> Any:
        """The payload of the envelope in ``frame``.

        Raises:
            Unfit: the fast path does not take this message; ``Codec`` must decode it.
        """
        if len(frame) > self._max_bytes:
            raise Unfit("over the size limit")
        try:
            envelope: Any = self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            raise Unfit(str(exc)) from exc
        return envelope.payload
