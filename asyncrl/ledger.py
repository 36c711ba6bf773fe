"""The ledger: a persisted set of stable ids, so that a consumer counts each result once.

Idempotent calls are delivered at least once: a replica that died with a call in flight may have
done the work, and the dispatcher runs it again elsewhere. A role that *consumes* results (a sink,
a counter, anything with an effect) records the stable id of each one it takes in a ``Ledger``,
and takes no id twice, across its own restarts too::

    async def setup(self) -> None:
        self.seen = Ledger(self.ctx.path("seen.jsonl"))
        for key, words in self.seen.items():   # a restarted replica rebuilds its state
            self.count(words)

    @endpoint(Delivery.IDEMPOTENT)
    async def add(self, item: Item) -> bool:
        if not self.seen.add(item.id, item.words):   # the id and its effect, in one line
            return False                             # a re-run call: already counted
        self.count(item.words)
        return True

An id may carry a value: what the consumer took from that result, written in the same line, so
that state rebuilt from ``items()`` holds exactly the results the ledger refuses again. A consumer
whose state lives only in memory must do so: a ledger alone would refuse, after a restart, results
whose effect the restart lost.

Each entry is one JSON line (the id, or ``{"id": ..., "value": ...}`` with a value), appended and
flushed before ``add`` returns, so a process killed with SIGKILL keeps every entry ``add``
acknowledged; with ``fsync``, a machine crash does too. A last line torn by a crash mid-write was
never acknowledged: it is cut when the ledger is opened again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Hashable, Iterator
from typing import Any

from asyncrl.safe_files import open_append

__all__ = ["Ledger"]


def _canonical(key: Any) -> Hashable:
    if isinstance(key, list | tuple):
        return tuple(_canonical(k) for k in key)
    return key  # type: ignore[no-any-return]


def _entry(line: bytes) -> tuple[Any, Any]:
    """The id and value of one line. Raises ValueError for a line that is not one."""
    entry = json.loads(line)
    if isinstance(entry, dict):
        return entry["id"], entry.get("value")
    return entry, None


class Ledger:
    """A set of ids, each with an optional value, persisted in ``path`` (created if missing).

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
        whole = 0  # bytes up to the end of the last complete line
        if os.path.exists(path):
            with open(path, "rb") as f:
                for line in f:
                    if not line.endswith(b"\n"):
                        break  # torn by a crash mid-write: never acknowledged
                    whole += len(line)
                    try:
                        self._ids.add(_canonical(_entry(line)[0]))
                    except (ValueError, KeyError, TypeError):
                        continue  # not an entry (written by something else)
        self._file = open_append(path)  # kept open for appends; closed by close()
        if self._file.tell() > whole:
            # Cut the torn line, or the next entry would be glued to it and lost on reload.
            self._file.truncate(whole)
            self._sync()

    def __contains__(self, key: Any) -> bool:
        return _canonical(key) in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._ids)

    def add(self, key: Any, value: Any = None) -> bool:
        """Record ``key``, with ``value`` when given; True if it is new, False if it was already
        there (a duplicate: nothing is written).

        Raises:
            TypeError: the key or the value is not JSON-serializable (use str, int, float, bool,
                None, and lists and string-keyed dicts of them; a key may not be a dict).
        """
        if isinstance(key, dict):
            raise TypeError(f"a ledger id may not be a dict, got {key!r}; use str, int or lists")
        canonical = _canonical(key)
        if canonical in self._ids:
            return False
        entry = key if value is None else {"id": key, "value": value}
        self._file.write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")
        self._sync()
        self._ids.add(canonical)
        return True

    def items(self) -> Iterator[tuple[Any, Any]]:
        """Each id with its value (None when it has none), in the order they were added, read
        back from the file: ids as JSON gives them back (lists, not tuples)."""
        self._file.flush()
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    yield _entry(line)
                except (ValueError, KeyError, TypeError):
                    continue

    def _sync(self) -> None:
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()
