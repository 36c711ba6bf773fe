"""asyncrl's one error hierarchy. Catch ``AsyncrlError`` for everything asyncrl raises::

    AsyncrlError
    ├── TransportError                  (asyncrl.transport.errors)
    │   ├── ClosedError                 you closed it: the channel was closed on this side
    │   ├── BrokenError                 something outside broke it; the cause is in __cause__
    │   │   ├── PeerDeadError           the peer missed liveness x interval of heartbeats
    │   │   ├── DisconnectedError       the connection broke with requests in flight
    │   │   ├── PeerUnreachableError    the peer is not connected (ROUTER_MANDATORY refused)
    │   │   └── WeightsGoneError        the weight store's writer closed it or died (weights.py)
    │   ├── DeadlineExceededError       no answer before the request's deadline
    │   │   └── FlushDeadlineError      contributions still unacknowledged (post.py)
    │   ├── TornReadError               every weights read raced with the writer; retry
    │   ├── NothingPublishedError       weights were read before any version was published
    │   ├── RemoteError                 the peer answered with an error reply
    │   └── ProtocolError               bytes that do not follow docs/protocol.md
    │       ├── ProtocolVersionError    the peer speaks another protocol version
    │       ├── DecodeError             a frame that fails to decode
    │       ├── UnknownKindError        an envelope kind this side does not know
    │       ├── MessageTooLargeError    a message over the configured size limit
    │       └── TensorDescriptorError   tensor descriptors that disagree with the bytes
    ├── ManifestError                   a manifest with problems; lists every one, with its path
    ├── ConfigProblem                   a process cannot start with its configuration (exit 78)
    └── StallError                      a run made no progress for too long; says on whom it waits

The transport defines its branch itself, since it may not import the runtime; this module is where
the runtime's own errors join the same root. ``retryable`` is True on errors after which the same
request may succeed later or elsewhere.
"""

from __future__ import annotations

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
    "ConfigProblem",
    "DeadlineExceededError",
    "DecodeError",
    "DisconnectedError",
    "FlushDeadlineError",
    "ManifestError",
    "MessageTooLargeError",
    "NothingPublishedError",
    "PeerDeadError",
    "PeerUnreachableError",
    "ProtocolError",
    "ProtocolVersionError",
    "RemoteError",
    "StallError",
    "TensorDescriptorError",
    "TornReadError",
    "TransportError",
    "UnknownKindError",
    "WeightsGoneError",
]


class ManifestError(AsyncrlError):
    """A manifest that cannot be read or has problems; the message lists every one of them.

    Attributes:
        source: the manifest's file name, or ``<string>`` for text given directly.
        problems: one line per problem, ``<path>: <what is wrong>; <how to fix>``.
    """

    def __init__(self, source: str, problems: list[str]) -> None:
        count = f"{len(problems)} problem{'' if len(problems) == 1 else 's'}"
        super().__init__("\n  ".join([f"manifest {source} has {count}:", *problems]))
        self.source = source
        self.problems = problems

    def __reduce__(self) -> tuple[type[ManifestError], tuple[str, list[str]]]:
        return (type(self), (self.source, self.problems))


class ConfigProblem(AsyncrlError):
    """A process cannot start because of its configuration (a program or class that does not
    import, a config the role rejects). The process exits with ``EXIT_CONFIG``, and the
    supervisor fails the run at once: restarting cannot help."""


class StallError(AsyncrlError):
    """The run made no progress for its stall timeout (or can provably make none).

    The message says what the program waits for and on whom: the calls in flight, by role,
    replica and age, and the sample pipeline's state. The driver fails the run with it rather
    than hang.
    """


class WeightsGoneError(BrokenError):
    """The writer closed its store, or died and its segment was swept.

    Ask the learner for a fresh ``WeightsHandle`` and open a new ``WeightReader``. When the
    segment file was missing, the ``FileNotFoundError`` is in ``__cause__``.
    """


class TornReadError(TransportError):
    """Every attempt to copy a complete snapshot raced with the writer; the next call may succeed.

    The contents of an ``into`` dict passed to the failed ``read`` are undefined.
    """

    retryable = True


class FlushDeadlineError(DeadlineExceededError):
    """Contributions were still unacknowledged when ``Poster.flush`` gave up.

    Attributes:
        pending: how many were unacknowledged.
    """

    def __init__(self, peer: str, method: str, timeout_s: float, pending: int) -> None:
        super().__init__(peer, method, timeout_s)
        self.pending = pending
        self.args = (
            f"{pending} contribution{'' if pending == 1 else 's'} to {method!r} at {peer} still "
            f"unacknowledged after {timeout_s:.3f} s; the reducer is down, hung or unreachable "
            f"(they are still being re-sent). Raise the timeout or check the reducer's process.",
        )


class NothingPublishedError(TransportError):
    """``read`` was called before the writer published any version."""

    retryable = True
