"""The ledger: a persisted set of stable ids, so that each result is counted once.

A consumer records the id of every result it has taken. The ledger lives in a file, not only in
memory: a consumer killed with SIGKILL restarts, reloads it, and still refuses a result it already
took. Each id is one JSON line appended and flushed before ``add`` returns; a torn last line left
by a crash is ignored on reload.
"""

from __future__ import annotations

import json
import os
from collections.abc import Hashable, Iterator
from typing import Any

__all__ = ["Ledger"]


def _canonical(key: Any) -> Hashable:
    if isinstance(key, list | tuple):
        return tuple(_canonical(k) for k in key)
    return key  # type: ignore[no-any-return]


class Ledger:
    """A set of ids, persisted in ``path`` (created if missing).

    Args:
        path: the ledger file.
        fsync: also fsync each append, so that the ledger survives a machine crash, not only a
            process crash.
    """

    def __init__(self, path: str, *, fsync: bool = False) -> None:
        self.path = path
        self.fsync = fsync
        self._ids: set[Hashable] = set()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if os.path.exists(path):
            with open(path, "rb") as f:
                for line in f:
                    try:
                        self._ids.add(_canonical(json.loads(line)))
                    except ValueError:
                        continue  # a line torn by a crash mid-write
        self._file = open(path, "ab")  # noqa: SIM115  (kept open for appends; closed by close())

    def __contains__(self, key: Any) -> bool:
        return _canonical(key) in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._ids)

    def add(self, key: Any) -> bool:
        """Record ``key``; True if it is new, False if it was already there (a duplicate).

        Raises:
            TypeError: the key is not JSON-serializable (use str, int or lists of them).
        """
        canonical = _canonical(key)
        if canonical in self._ids:
            return False
        line = json.dumps(key, separators=(",", ":")).encode() + b"\n"
        # A reload after a torn write would otherwise glue this id to the torn line.
        self._file.write(line)
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        self._ids.add(canonical)
        return True

    def close(self) -> None:
        self._file.close()
