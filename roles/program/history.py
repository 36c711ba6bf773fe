"""``RUN_DIR/history.jsonl``: a run's named metrics per phase, durable and resumed exactly.

One JSON object a line, ``{"phase": "rl", "step": 12, "reward": 0.41, "wall_s": 88.2, ...}``:
``phase`` and ``step`` (the step within the phase, from 1; 0 for a value measured before the
phase's first step) name the entry, the other keys are the metrics the program or the loop
recorded. Each line is appended and flushed as it is recorded.

Resumed exactly: a resumed run reads the file back and goes on appending. A last line cut short
by a crash (no newline, or not JSON) is cut off with a warning; entries past the learner's
position (``History.open``'s ``keep``) are dropped, since their steps will be taken again; and
a (phase, step) is written once: recording it again merges the new metrics into its entry
(the file is then rewritten atomically), so nothing is counted twice.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
from collections.abc import Callable
from typing import Any

from asyncrl.safe_files import open_append, write_atomic

__all__ = ["HISTORY_FILE", "History"]

HISTORY_FILE = "history.jsonl"

log = logging.getLogger("asyncrl.programs")


class History:
    """The entries of ``history.jsonl``, in the order recorded.

    Use ``History.open``; then ``record`` as the run goes.

    Attributes:
        path: the file.
        entries: every entry so far, those of earlier incarnations included.
    """

    def __init__(self, path: str, entries: list[dict[str, Any]]) -> None:
        self.path = path
        self.entries = entries

    @classmethod
    def open(
        cls, run_dir: str, *, fresh: bool, keeps: Callable[[dict[str, Any]], bool] | None = None
    ) -> History:
        """The history of the run in ``run_dir``.

        Args:
            run_dir: the run directory.
            fresh: a new run (the learner has taken no step): the file starts empty.
            keeps: which entries of a resumed run stand (those the learner's position covers);
                None keeps all.
        """
        path = os.path.join(run_dir, HISTORY_FILE)
        if fresh or not os.path.exists(path):
            write_atomic(path, b"")
            return cls(path, [])
        entries, torn = _read(path)
        kept = [e for e in entries if keeps is None or keeps(e)]
        if torn:
            log.warning("%s: its last line was cut short by a crash; cut it off", path)
        if torn or len(kept) != len(entries):
            write_atomic(path, _lines(kept))
        return cls(path, kept)

    @property
    def wall_s(self) -> float:
        """The run's wall time at its last entry (0 when there is none)."""
        return float(self.entries[-1].get("wall_s", 0.0)) if self.entries else 0.0

    def phase(self, phase: str) -> list[dict[str, Any]]:
        """The entries of ``phase``, in order."""
        return [e for e in self.entries if e.get("phase") == phase]

    def last(self, phase: str) -> dict[str, Any]:
        """The last entry of ``phase`` ({} when none)."""
        entries = self.phase(phase)
        return entries[-1] if entries else {}

    def get(self, phase: str, step: int) -> dict[str, Any] | None:
        """The entry of ``phase`` at ``step``, or None."""
        for entry in self.entries:
            if entry.get("phase") == phase and entry.get("step") == step:
                return entry
        return None

    def values(self, phase: str, metric: str) -> list[float]:
        """The values of ``metric`` in ``phase``, in step order, where recorded."""
        return [e[metric] for e in self.phase(phase) if e.get(metric) is not None]

    def record(self, phase: str, step: int, **metrics: Any) -> dict[str, Any]:
        """Record ``metrics`` of ``phase`` at ``step``: a new line, or merged into the entry
        already there (the file rewritten atomically). Numbers that are not finite are
        written as null. Returns the entry."""
        metrics = {k: _finite(v) for k, v in metrics.items()}
        entry = self.get(phase, step)
        if entry is not None:
            entry.update(metrics)
            write_atomic(self.path, _lines(self.entries))
            return entry
        entry = {"phase": phase, "step": step, **metrics}
        self.entries.append(entry)
        with io.TextIOWrapper(open_append(self.path), encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
        return entry


def _read(path: str) -> tuple[list[dict[str, Any]], bool]:
    """The entries of ``path`` and whether its last line was torn. A torn line that is not
    the last is corruption, not a crash: it raises."""
    with open(path) as f:
        lines = f.readlines()
    entries: list[dict[str, Any]] = []
    for n, line in enumerate(lines):
        last = n == len(lines) - 1
        try:
            entry = json.loads(line) if line.endswith("\n") or not last else None
        except ValueError:
            entry = None
        if entry is None:
            if last:
                return entries, True
            raise ValueError(f"{path}:{n + 1}: not a JSON line; the history is damaged")
        entries.append(entry)
    return entries, False


def _lines(entries: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(e) + "\n" for e in entries).encode()


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
