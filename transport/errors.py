"""The transport's errors: the lower branch of asyncrl's one error hierarchy.

The runtime re-exports every class here from ``asyncrl.errors`` and hangs its own errors under
the same root, so a caller catches ``AsyncrlError`` for everything asyncrl raises::

    AsyncrlError
    └── TransportError
        ├── ClosedError                 you closed it: the channel was closed on this side
        ├── BrokenError                 something outside broke it; the cause is in __cause__
        │   ├── PeerDeadError           the peer missed liveness x interval of heartbeats
        │   ├── DisconnectedError       the connection broke with requests in flight
        │   └── PeerUnreachableError    the peer is not connected (ROUTER_MANDATORY refused)
        ├── DeadlineExceededError       no answer before the request's deadline; names the
        │                               peer's pid and incarnation when its handshake told them
        ├── RemoteError                 the peer answered with an error reply
        └── ProtocolError               bytes that do not follow docs/protocol.md
            ├── ProtocolVersionError    the peer speaks another protocol version
            ├── DecodeError             a frame that fails to decode
            ├── UnknownKindError        an envelope kind this side does not know
            ├── MessageTooLargeError    a message over the configured size limit
            └── TensorDescriptorError   tensor descriptors that disagree with the bytes

``retryable`` tells recoverable errors (the same request may succeed later or elsewhere) from
fatal ones. Errors raised from a zmq error keep it as ``__cause__`` (``raise ... from exc``).
"""

from __future__ import annotations

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


class AsyncrlError(Exception):
    """The root of every error asyncrl raises on purpose."""

    retryable: bool = False


class TransportError(AsyncrlError):
    """Something went wrong moving bytes between two processes.

    Attributes:
        replica: the index, in its group, of the replica a dispatcher had sent the failed
            request to (the one that answered it with an error, broke with it or let its
            deadline pass); None when no replica took it, or no dispatcher sent it.
    """

    replica: int | None = None


class ClosedError(TransportError):
    """The channel was closed on this side, by its owner, before or during the operation."""


class BrokenError(TransportError):
    """The channel was broken by something outside this process; the cause is in __cause__."""

    retryable = True


class PeerDeadError(BrokenError):
    """The peer stopped answering heartbeats.

    Attributes:
        peer: the peer's endpoint or identity.
        silent_s: seconds since anything was last heard from it.
    """

    def __init__(self, peer: str, silent_s: float, limit_s: float) -> None:
        self.peer = peer
        self.silent_s = silent_s
        self.limit_s = limit_s
        super().__init__(
            f"peer {peer} is dead: nothing heard for {silent_s:.3f} s, over the liveness limit of "
            f"{limit_s:.3f} s (liveness x interval); it crashed, hung or was stopped. Requests "
            f"pending to it have failed; retry them elsewhere or after it restarts."
        )


class DisconnectedError(BrokenError):
    """The connection to the peer broke (it exited or restarted) while requests were in flight.

    Their outcome is unknown: the peer may or may not have run them.
    """


class PeerUnreachableError(BrokenError):
    """A message could not be routed: the peer is not connected to this socket."""


class DeadlineExceededError(TransportError):
    """A request got no answer before its deadline.

    Attributes:
        peer: the endpoint the request went to.
        method: the endpoint method that was called.
        timeout_s: the time the request was given.
        pid: the process id of the peer the request went to, from its handshake; None when it
            was not known (no handshake had been answered yet).
        incarnation: that peer's restart count, from the same handshake; None when not known.
    """

    retryable = True

    def __init__(
        self,
        peer: str,
        method: str,
        timeout_s: float,
        *,
        pid: int | None = None,
        incarnation: int | None = None,
    ) -> None:
        self.peer = peer
        self.method = method
        self.timeout_s = timeout_s
        self.pid = pid
        self.incarnation = incarnation
        known = [f"pid {pid}"] if pid is not None else []
        if incarnation is not None:
            known.append(f"incarnation {incarnation}")
        who = f"the peer ({', '.join(known)})" if known else "the peer"
        super().__init__(
            f"request {method!r} to {peer} got no answer within its deadline of {timeout_s:.3f} s; "
            f"{who} is slow, hung or gone. Raise the timeout if the work is legitimately long."
        )


class RemoteError(TransportError):
    """The peer answered with an error reply.

    Attributes:
        code: a short machine-readable code (``handler_error``, ``unknown_method``, ...).
        remote_type: the exception type raised on the peer, when it says.
        peer: the endpoint that answered.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        remote_type: str = "",
        peer: str = "",
        retryable: bool = False,
    ) -> None:
        self.code = code
        self.remote_type = remote_type
        self.peer = peer
        self.retryable = retryable
        where = f" from {peer}" if peer else ""
        kind = f" ({remote_type})" if remote_type else ""
        super().__init__(f"error reply{where} [{code}]{kind}: {message}")


class ProtocolError(TransportError):
    """Bytes arrived that do not follow the wire protocol of docs/protocol.md."""


class ProtocolVersionError(ProtocolError):
    """The peer speaks another version of the wire protocol."""

    def __init__(self, ours: int, theirs: int, peer: str = "") -> None:
        self.ours = ours
        self.theirs = theirs
        where = f" {peer}" if peer else ""
        super().__init__(
            f"protocol version mismatch: this side speaks version {ours}, the peer{where} speaks "
            f"version {theirs}; run the same asyncrl protocol version on both ends"
        )


class DecodeError(ProtocolError):
    """A frame could not be decoded."""


class UnknownKindError(ProtocolError):
    """An envelope carried a kind this side does not know."""


class MessageTooLargeError(ProtocolError):
    """A message exceeded the configured size limit."""


class TensorDescriptorError(ProtocolError):
    """A tensor descriptor disagrees with the bytes that came with it, or cannot be accepted.

    Attributes:
        reason: a short code for the receiver's counters when the descriptor is well formed but
            refused (``shm_refused``: shared memory this receiver does not take from this peer;
            ``library_not_imported``: a library the process has not imported); "" otherwise.
    """

    def __init__(self, message: str, *, reason: str = "") -> None:
        self.reason = reason
        super().__init__(message)
