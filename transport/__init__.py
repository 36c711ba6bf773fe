"""asyncrl.transport: bytes and sockets.

Typed messages over ZeroMQ: the envelope and codec (tensors as zero-copy frames, shared memory on
one host), request/reply, one-way streams, broadcast, heartbeats and discovery. It knows nothing
of RL or roles; the wire protocol is documented in docs/protocol.md. Across hosts, tcp endpoints
use CurveZMQ when ``use_curve`` is given the run's keys (``curve.py``).
"""

from .broadcast import Publisher, Subscriber
from .client import Client
from .codec import Codec
from .curve import CurveKeys, load_keys, use_curve
from .errors import (
    AsyncrlError,
    BrokenError,
    ClosedError,
    DeadlineExceededError,
    DecodeError,
    DisconnectedError,
    MessageTooLargeError,
    PeerDeadError,
    PeerUnreachableError,
    ProtocolError,
    ProtocolVersionError,
    RemoteError,
    TensorDescriptorError,
    TransportError,
    UnknownKindError,
)
from .event_loop import run
from .events import PeerEvent
from .options import HEARTBEAT_INTERVAL_S, HEARTBEAT_LIVENESS, ChannelOptions
from .protocol import PROTOCOL_VERSION, Envelope, ErrorCode, ErrorInfo, Hello, Kind, TensorDesc
from .registry import Entry, LocalRegistry, Registry
from .server import Call, Handler, Server
from .shm import ShmPool, ShmReader, sweep
from .stream import StreamReceiver, StreamSender

__all__ = [
    "HEARTBEAT_INTERVAL_S",
    "HEARTBEAT_LIVENESS",
    "PROTOCOL_VERSION",
    "AsyncrlError",
    "BrokenError",
    "Call",
    "ChannelOptions",
    "Client",
    "ClosedError",
    "Codec",
    "CurveKeys",
    "DeadlineExceededError",
    "DecodeError",
    "DisconnectedError",
    "Entry",
    "Envelope",
    "ErrorCode",
    "ErrorInfo",
    "Handler",
    "Hello",
    "Kind",
    "LocalRegistry",
    "MessageTooLargeError",
    "PeerDeadError",
    "PeerEvent",
    "PeerUnreachableError",
    "ProtocolError",
    "ProtocolVersionError",
    "Publisher",
    "Registry",
    "RemoteError",
    "Server",
    "ShmPool",
    "ShmReader",
    "StreamReceiver",
    "StreamSender",
    "Subscriber",
    "TensorDesc",
    "TensorDescriptorError",
    "TransportError",
    "UnknownKindError",
    "load_keys",
    "run",
    "sweep",
    "use_curve",
]
