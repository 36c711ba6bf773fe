"""Profiling ranges as Chrome trace events (``ph: X``), the format of asyncrl's traces."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["TraceProfiler"]


class TraceProfiler:
    """Records ranges as complete events (name, ``ts`` and ``dur`` in microseconds, pid, tid).

    Args:
        synchronize: called before each range ends, so the time covers the device's work too
            (the cuda plugin passes ``torch.cuda.synchronize``); None: host time only.
        limit: the most events kept (the oldest go first).
    """

    def __init__(self, synchronize: Callable[[], None] | None = None, limit: int = 100_000) -> None:
        self._sync = synchronize
        self._limit = limit
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    @contextmanager
    def range(self, name: str) -> Iterator[None]:
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            end = time.perf_counter_ns()
            event = {
                "name": name,
                "ph": "X",
                "cat": "plugin",
                "ts": start / 1000,
                "dur": (end - start) / 1000,
                "pid": os.getpid(),
                "tid": threading.get_ident(),
            }
            with self._lock:
                self._events.append(event)
                del self._events[: max(0, len(self._events) - self._limit)]

    def events(self) -> Iterator[dict[str, Any]]:
        with self._lock:
            return iter(list(self._events))
