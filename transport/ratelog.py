"""Rate-limited logging of bad input: what a hostile or broken peer sends must not fill the log.

The first few problems of each kind are logged in full. After that they are only counted, and at
most one summary line per interval says how many were suppressed, and from whom. Counts in the
owner's ``stats`` stay exact; only the log is thinned.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["RateLimitedLog"]

FIRST_LOGGED = 5
"""Problems of one kind logged in full before suppression starts."""

SUMMARY_INTERVAL_S = 10.0
"""Seconds between two summary lines of one kind."""


@dataclass
class _Kind:
    logged: int = 0
    suppressed: int = 0
    sources: Counter[str] = field(default_factory=Counter)
    last_summary: float = 0.0


class RateLimitedLog:
    """Logs the first ``first`` problems of each kind, then one summary per ``interval_s``.

    Args:
        logger: where lines go (at WARNING).
        what: the owner, named in summary lines (``server rollout.0``).
        first: problems of one kind logged in full.
        interval_s: the least time between two summary lines of one kind.
        clock: a monotonic clock in seconds (a fake one in tests).
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        first: int = FIRST_LOGGED,
        interval_s: float = SUMMARY_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._what = what
        self._first = first
        self._interval_s = interval_s
        self._clock = clock
        self._kinds: dict[str, _Kind] = {}

    def warning(self, kind: str, source: str, msg: str, *args: object) -> None:
        """Log ``msg % args`` about a problem of ``kind`` from ``source``, or count it."""
        state = self._kinds.get(kind)
        if state is None:
            state = self._kinds[kind] = _Kind(last_summary=self._clock())
        if state.logged < self._first:
            state.logged += 1
            self._logger.warning(msg, *args)
            if state.logged == self._first:
                self._logger.warning(
                    "%s: further %s problems are summarised at most once every %.0f s",
                    self._what,
                    kind,
                    self._interval_s,
                )
            return
        state.suppressed += 1
        if len(state.sources) < 16 or source in state.sources:
            state.sources[source] += 1
        self.flush(kind)

    def flush(self, only: str | None = None, *, force: bool = False) -> None:
        """Write the summary line of each kind whose interval has passed (all, with ``force``)."""
        now = self._clock()
        for kind, state in self._kinds.items():
            if only is not None and kind != only:
                continue
            if not state.suppressed or (not force and now - state.last_summary < self._interval_s):
                continue
            top = ", ".join(f"{src} ({n})" for src, n in state.sources.most_common(3))
            self._logger.warning(
                "%s: suppressed %d more %s problems in the last %.1f s, from %s",
                self._what,
                state.suppressed,
                kind,
                now - state.last_summary,
                top or "unknown peers",
            )
            state.suppressed = 0
            state.sources.clear()
            state.last_summary = now
