"""The plugins' errors, under asyncrl's one root (``asyncrl.errors.AsyncrlError``; the tree of
``asyncrl.errors`` shows them in place)::

AsyncrlError
├── ConfigError
│   └── PluginError               F no such plugin, or one that does not support this
│                                   asyncrl version, or one that fails to load
└── CollectiveTimeoutError        R a collective did not complete in time; names the
                                    collective and the ranks that did not arrive
"""

from __future__ import annotations

from asyncrl.errors import AsyncrlError, ConfigError

__all__ = ["CollectiveTimeoutError", "PluginError"]


class PluginError(ConfigError):
    """A hardware plugin cannot be used: unknown name, unsupported asyncrl version, or a plugin
    whose entry point fails to load. Fatal: restarting with the same settings cannot help."""


class CollectiveTimeoutError(AsyncrlError):
    """A collective (all-reduce, all-gather, broadcast, barrier) did not complete within its
    timeout (``roles.<learner>.config.dist_timeout_s`` in the manifest). Recoverable: the
    data-parallel group restarts (it comes as the cause of a ``DataParallelError``).

    Attributes:
        collective: the collective's name (``all_reduce`` ...).
        missing: the ranks that did not arrive (empty when the process group cannot tell).
        timeout_s: the timeout that passed.
    """

    retryable = True

    def __init__(self, collective: str, missing: list[int], timeout_s: float, rank: int) -> None:
        self.collective = collective
        self.missing = missing
        self.timeout_s = timeout_s
        self.rank = rank
        who = f"rank(s) {missing} did not arrive" if missing else "the ranks did not all arrive"
        super().__init__(
            f"{collective}: {who} within {timeout_s:g} s (this is rank {rank}); check that "
            f"process's log for a crash or a hang, or raise dist_timeout_s in the manifest"
        )

    def __reduce__(
        self,
    ) -> tuple[type[CollectiveTimeoutError], tuple[list[int] | str | float | int, ...]]:
        return (type(self), (self.collective, self.missing, self.timeout_s, self.rank))
