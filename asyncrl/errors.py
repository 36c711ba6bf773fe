"""asyncrl's one error hierarchy. Catch ``AsyncrlError`` for everything asyncrl raises::

    AsyncrlError
    ├── TransportError                  (asyncrl.transport.errors)
    │   ├── ClosedError                 you closed it: the channel was closed on this side
    │   ├── BrokenError               R something outside broke it; the cause is in __cause__
    │   │   ├── PeerDeadError         R the peer missed liveness x interval of heartbeats
    │   │   ├── DisconnectedError     R the connection broke with requests in flight
    │   │   └── PeerUnreachableError  R the peer is not connected (ROUTER_MANDATORY refused)
    │   ├── DeadlineExceededError     R no answer before the request's deadline; names the
    │   │                               peer's pid and incarnation when its handshake told them
    │   ├── RemoteError               ? the peer answered with an error reply
    │   └── ProtocolError               bytes that do not follow docs/protocol.md
    │       ├── ProtocolVersionError    the peer speaks another protocol version
    │       ├── DecodeError             a frame that fails to decode
    │       ├── UnknownKindError        an envelope kind this side does not know
    │       ├── MessageTooLargeError    a message over the configured size limit
    │       └── TensorDescriptorError   tensor descriptors that disagree with the bytes
    ├── RoleDeadError                 F a role (or a replica) is gone for good: past its restart
    │                                   budget, the run is shutting down, or it speaks another
    │                                   protocol version; nothing will answer it again
    ├── WeightsError                    the shared-memory weight store (weights.py)
    │   ├── WeightsGoneError          R the store's writer closed it or died; open the new one
    │   ├── TornReadError             R every weights read raced with the writer; retry
    │   └── NothingPublishedError     R weights were read before any version was published
    ├── ConfigError                   F the run's configuration is wrong; restarting cannot help
    │   ├── ManifestError             F a manifest with problems; lists every one, with its path
    │   ├── ConfigProblem             F a process cannot start with its configuration (exit 78)
    │   └── PluginError               F no such hardware plugin, one that fails to load, or one
    │                                   that does not support this asyncrl (asyncrl.plugins.errors)
    ├── StallError                    F a run made no progress for too long; says on whom it waits
    ├── NotRunningError                 asyncrl status: no agent answers for the run directory
    │                                   (asyncrl.observe.status)
    ├── StoreError                      the launch's store (torchrun's TCPStore) unreachable, or a
    │                                   key late (asyncrl.supervision.store_registry)
    ├── CollectiveTimeoutError        R a collective of the plugin did not complete in time;
    │                                   names it and the ranks that did not arrive
    │                                   (asyncrl.plugins.errors)
    └── DataParallelError             R a data-parallel learner's ranks could not work as one
                                        group (asyncrl.roles.training.data_parallel); the group
                                        restarts

Recoverable (R) errors have ``retryable`` True: the same request may succeed later or elsewhere,
since a replica that died, went silent or restarted comes back under supervision. Fatal (F)
errors end the run or the caller's use of what failed: retrying cannot help. ``RemoteError`` (?)
carries what the peer said (``retryable`` as the remote exception's own). Unmarked errors are not
retried either: this side closed what it used (``ClosedError``), or the bytes were wrong
(``ProtocolError``).

The two "dead" errors differ as vLLM's ``EngineGenerateError`` and ``EngineDeadError`` do:
``PeerDeadError`` says one process went silent and its calls failed, and the supervisor restarts
it; ``RoleDeadError`` says the role will not come back in this run.

The transport defines its branch itself, since it may not import the runtime; this module is where
the runtime's own errors join the same root. The hardware plugins' two errors live in
``asyncrl.plugins.errors`` (the runtime imports no plugin module) under the same root.
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
    "ConfigError",
    "ConfigProblem",
    "DeadlineExceededError",
    "DecodeError",
    "DisconnectedError",
    "ManifestError",
    "MessageTooLargeError",
    "NothingPublishedError",
    "PeerDeadError",
    "PeerUnreachableError",
    "ProtocolError",
    "ProtocolVersionError",
    "RemoteError",
    "RoleDeadError",
    "StallError",
    "TensorDescriptorError",
    "TornReadError",
    "TransportError",
    "UnknownKindError",
    "WeightsError",
    "WeightsGoneError",
]


class RoleDeadError(AsyncrlError):
    """A role is gone for good: nothing will answer it again in this run.

    The supervisor gave up on it past its restart budget, the run is shutting down (the
    driver closed its connections with the call still queued or in flight), or the replica the
    call was aimed at speaks another protocol version (``replica`` names it). Fatal, unlike
    ``PeerDeadError`` and ``DisconnectedError``, after which the replica is restarted and the
    call may run again: let it end the program.

    Attributes:
        role: the role's name.
        replica: the replica, or None when the whole role is gone.
        reason: why it is gone.
    """

    def __init__(self, role: str, reason: str, replica: int | None = None) -> None:
        self.role = role
        self.replica = replica
        self.reason = reason
        where = role if replica is None else f"{role}[{replica}]"
        super().__init__(
            f"role {where} is dead: {reason}; nothing will answer it again in this run, so "
            f"retrying cannot help. The run's report says why it ended."
        )

    def __reduce__(self) -> tuple[type[RoleDeadError], tuple[str, str, int | None]]:
        return (type(self), (self.role, self.reason, self.replica))


class WeightsError(AsyncrlError):
    """Something went wrong with the shared-memory weight store (``asyncrl.weights.publishing``).

    A runtime error, not a transport one: the store is memory shared on one host, not a channel.
    """


class WeightsGoneError(WeightsError):
    """The writer closed its store, or died and its segment was swept.

    Ask the learner for a fresh ``WeightsHandle`` and open a new ``WeightReader``. When the
    segment file was missing, the ``FileNotFoundError`` is in ``__cause__``.
    """

    retryable = True


class TornReadError(WeightsError):
    """Every attempt to copy a complete snapshot raced with the writer; the next call may succeed.

    The contents of an ``into`` dict passed to the failed ``read`` are undefined.
    """

    retryable = True


class NothingPublishedError(WeightsError):
    """``read`` was called before the writer published any version."""

    retryable = True


class ConfigError(AsyncrlError):
    """The run's configuration is wrong: fix it, since restarting cannot help."""


class ManifestError(ConfigError):
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


class ConfigProblem(ConfigError):
    """A process cannot start because of its configuration (a program or class that does not
    import, a config the role rejects). The process exits with ``EXIT_CONFIG``, and the
    supervisor fails the run at once: restarting cannot help."""


class StallError(AsyncrlError):
    """The run made no progress for its stall timeout (or can provably make none).

    The message says what the program waits for and on whom: the calls in flight, by role,
    replica and age, and the sample pipeline's state. The driver fails the run with it rather
    than hang.
    """
