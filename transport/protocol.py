"""The wire protocol: the envelope every message travels in, and the transport's own payloads.

A message is a list of ZeroMQ frames. Frame 0 is the envelope, a MessagePack array (see
docs/protocol.md for the field positions); the frames after it hold tensor bytes. The payload sits
inside the envelope as an ordinary MessagePack value, and tensors inside the payload are MessagePack
extension values (type ``TENSOR_EXT``) holding an index into the envelope's ``tensors`` list.

Payload types of user endpoints belong to the layers that define them; this module only defines
the payloads the transport itself needs (handshake, errors, credit, slot release).
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec

__all__ = [
    "CONTROL_KINDS",
    "MAX_BATCH",
    "MAX_CREDIT",
    "MAX_DIMS",
    "MAX_RELEASE_SLOTS",
    "MAX_SECRET",
    "MAX_TENSORS",
    "PROTOCOL_VERSION",
    "TENSOR_EXT",
    "Credit",
    "Envelope",
    "ErrorCode",
    "ErrorInfo",
    "Hello",
    "Kind",
    "Release",
    "TensorDesc",
    "Where",
]

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change to the envelope or the transport's payloads."""

TENSOR_EXT = 1
"""MessagePack extension type code of a tensor reference inside a payload."""


class Kind(enum.IntEnum):
    """What an envelope is. One small integer on the wire."""

    HANDSHAKE = 1  # client -> server: Hello
    WELCOME = 2  # server -> client: Hello, the answer to HANDSHAKE
    REQUEST = 3  # client -> server: call ``method`` with the payload
    REPLY = 4  # server -> client: the result of request ``id``
    ERROR = 5  # server -> client: ErrorInfo for request ``id`` (or id 0: about the message)
    CREDIT = 6  # server -> client: Credit, free slots the server advertises
    PING = 7  # client -> server: liveness probe
    PONG = 8  # answer to PING
    STOP = 9  # control: the receiver should stop cleanly
    RELEASE = 10  # receiver -> sender: Release, shared-memory slots it no longer reads
    MESSAGE = 11  # one-way stream or broadcast message; ``method`` names its topic
    BATCH = 12  # stream sender -> receiver: several MESSAGE envelopes in one frame


CONTROL_KINDS = frozenset({Kind.STOP})
"""Kinds that control the receiving process. A server accepts them only from a peer that presented
the run's secret under ``control`` in its HANDSHAKE (see docs/protocol.md, Control messages)."""

MAX_TENSORS = 1 << 16
"""The most tensor descriptors one envelope may carry; more is refused as ``decode_error``."""

MAX_DIMS = 64
"""The most dimensions a tensor's shape may have (numpy's limit)."""

MAX_DIM = (1 << 63) - 1
"""The largest size of one dimension."""

MAX_RELEASE_SLOTS = 1 << 16
"""The most slot ids one RELEASE may carry."""

MAX_BATCH = 1024
"""The most MESSAGE envelopes one BATCH may carry; more is refused as ``decode_error``."""

MAX_CREDIT = 1 << 20
"""The most request slots one CREDIT may advertise."""

MAX_SECRET = 256
"""The longest secret (``Hello.secret``, ``Hello.control``) a HANDSHAKE may carry."""


class Where(enum.IntEnum):
    """Where a tensor's bytes travel."""

    INLINE = 0  # in TensorDesc.data
    FRAME = 1  # in frame number TensorDesc.frame of the same message
    SHM = 2  # in a shared-memory segment of the sender, at TensorDesc.offset


class TensorDesc(msgspec.Struct, array_like=True, frozen=True):
    """How to rebuild one tensor or array from bytes.

    ``lib`` is ``"torch"`` or ``"numpy"``; ``dtype`` is a torch dtype name (``"bfloat16"``) or a
    numpy dtype string (``"<f4"``); bytes are C-contiguous in the order of ``shape``.
    """

    lib: str
    dtype: str
    shape: list[int]
    nbytes: int
    where: int
    data: bytes = b""
    frame: int = 0
    segment: str = ""
    offset: int = 0
    slot: int = 0


class Envelope(msgspec.Struct, array_like=True):
    """The envelope of every message: a MessagePack array in this field order.

    ``deadline`` is a Unix time in seconds (0: none). ``incarnation`` is the sender's restart
    count. ``tensors`` follows ``payload`` so that an encoder can fill it while it writes the
    payload in one pass.
    """

    version: int
    kind: int
    id: int = 0
    method: str = ""
    deadline: float = 0.0
    attempt: int = 0
    incarnation: int = 0
    trace: str = ""
    payload: Any = None
    tensors: list[TensorDesc] = []


class RawEnvelope(msgspec.Struct, array_like=True):
    """The receiving side's view of an Envelope: the payload is left undecoded until the
    receiver knows its type. Senders write every position; readers accept shorter arrays
    (at least version and kind), filling in the defaults."""

    version: int
    kind: int
    id: int = 0
    method: str = ""
    deadline: float = 0.0
    attempt: int = 0
    incarnation: int = 0
    trace: str = ""
    payload: msgspec.Raw = msgspec.Raw(b"\xc0")
    tensors: Annotated[list[TensorDesc], msgspec.Meta(max_length=MAX_TENSORS)] = []


class EnvelopeHead(msgspec.Struct, array_like=True):
    """The first three positions of an envelope, left undecoded: what a receiver reads from a
    frame that failed validation (to name the version, or salvage the id) without building the
    rest of it in memory."""

    version: msgspec.Raw = msgspec.Raw(b"\xc0")
    kind: msgspec.Raw = msgspec.Raw(b"\xc0")
    id: msgspec.Raw = msgspec.Raw(b"\xc0")


class Hello(msgspec.Struct, omit_defaults=True):
    """Payload of HANDSHAKE and WELCOME: who is speaking and what it can do.

    ``host`` identifies the machine (hostname and boot id); shared memory is used only between
    peers that report the same host and both set ``shm``. ``secret`` is the run's secret, which
    every client of a run presents: a server of the run serves nothing else to a peer whose
    handshake did not carry it. ``control`` is the same secret again, sent only by a client
    created with ``control=True`` (the supervisor's); it also authorises control messages (STOP)
    from that client. A server sends neither.
    """

    version: int
    name: str = ""
    pid: int = 0
    incarnation: int = 0
    host: str = ""
    shm: bool = False
    run: str = ""
    control: Annotated[str, msgspec.Meta(max_length=MAX_SECRET)] = ""
    secret: Annotated[str, msgspec.Meta(max_length=MAX_SECRET)] = ""


class ErrorInfo(msgspec.Struct, omit_defaults=True):
    """Payload of ERROR: what went wrong, and whether the same request may succeed if retried."""

    code: str
    message: str
    type: str = ""
    retryable: bool = False


class ErrorCode:
    """The ``code`` values of ErrorInfo that the transport itself sends."""

    PROTOCOL_VERSION = "protocol_version"
    DECODE = "decode_error"
    UNKNOWN_KIND = "unknown_kind"
    TOO_LARGE = "message_too_large"
    BAD_TENSOR = "bad_tensor"
    UNEXPECTED_KIND = "unexpected_kind"
    UNKNOWN_METHOD = "unknown_method"
    DEADLINE = "deadline_exceeded"
    HANDLER = "handler_error"
    BAD_REPLY = "bad_reply"
    UNAUTHORIZED = "unauthorized"


class Credit(msgspec.Struct):
    """Payload of CREDIT: the number of requests the server can take now."""

    slots: Annotated[int, msgspec.Meta(ge=0, le=MAX_CREDIT)]


class Release(msgspec.Struct):
    """Payload of RELEASE: shared-memory slots of the sender that the receiver no longer reads."""

    slots: Annotated[list[int], msgspec.Meta(max_length=MAX_RELEASE_SLOTS)]
