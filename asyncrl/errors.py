"""asyncrl's one error hierarchy. Catch ``AsyncrlError`` for everything asyncrl raises::

    AsyncrlError
    └── TransportError                  (asyncrl.transport.errors)
        ├── ClosedError                 you closed it: the channel was closed on this side
        ├── BrokenError                 something outside broke it; the cause is in __cause__
        │   ├── PeerDeadError           the peer missed liveness x interval of heartbeats
        │   ├── DisconnectedError       the connection broke with requests in flight
        │   └── PeerUnreachableError    the peer is not connected (ROUTER_MANDATORY refused)
        ├── DeadlineExceededError       no answer before the request's deadline
        ├── RemoteError                 the peer answered with an error reply
        └── ProtocolError               bytes that do not follow docs/protocol.md
            ├── ProtocolVersionError    the peer speaks another protocol version
            ├── DecodeError             a frame that fails to decode
            ├── UnknownKindError        an envelope kind this side does not know
            ├── MessageTooLargeError    a message over the configured size limit
            └── TensorDescriptorError   tensor descriptors that disagree with the bytes

The transport defines its branch itself, since it may not import the runtime; this module is where
the runtime's own errors join the same root. ``retryable`` is True on errors after which the same
request may succeed later or elsewhere.
"""

from asyncrl.transport.errors import (
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

__all__ = [
    "AsyncrlError",
    "BrokenError",
    "ClosedError",
    "DeadlineExceededError",
    "DecodeError",
    "DisconnectedError",
    "MessageTooLargeError",
    "PeerDeadError",
    "PeerUnreachableError",
    "ProtocolError",
    "ProtocolVersionError",
    "RemoteError",
    "TensorDescriptorError",
    "TransportError",
    "UnknownKindError",
]
