"""The learner's durable state: atomic checkpoints and the step log.

A checkpoint is a directory ``step-NNNNNNNN`` holding one ``state.pt``. It is written into a
temporary ``.tmp`` directory, fsynced, and renamed into place, so a crash mid-write leaves the
previous one intact; a leftover ``.tmp`` is never loaded. The newest ``keep`` are kept.

The step log (``RUN_DIR/ledger/<role>.<replica>.steps.jsonl``) is the ledger of consumed sample
ids: one fsynced JSON line per step, written before the step's checkpoint. Read back, it is cut
at the restored step: lines past it are steps that never became durable.

``rng_state`` and ``set_rng_state`` capture and restore every RNG (torch, Python, NumPy) as
tensors and plain values, so a checkpoint loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any

import numpy as np
import torch

from asyncrl.faults import FaultPlan

__all__ = ["CheckpointDir", "StepLog", "fsync_dir", "rng_state", "set_rng_state"]

_PREFIX = "step-"


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    """Every RNG's state, as tensors and plain values (no pickled objects)."""
    version, internal, gauss = random.getstate()
    numpy_state: tuple[Any, ...] = tuple(np.random.get_state(legacy=True))
    kind, keys, pos, has_gauss, cached = numpy_state
    return {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, cached],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` captured."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


class CheckpointDir:
    """The checkpoints of one learner replica, in ``path``.

    ``faults`` names the point ``checkpoint_write`` (the state written, not yet fsynced nor
    renamed into place) for the fault-injection tests.
    """

    def __init__(self, path: str, keep: int, faults: FaultPlan) -> None:
        self.path = path
        self.keep = max(1, keep)
        self.faults = faults
        os.makedirs(path, exist_ok=True)

    def names(self) -> list[str]:
        """Complete checkpoints, oldest first (a ``.tmp`` directory is a write that died)."""
        names = [
            n
            for n in os.listdir(self.path)
            if n.startswith(_PREFIX) and n[len(_PREFIX) :].isdigit()
        ]
        return sorted(names, key=lambda n: int(n[len(_PREFIX) :]))

    def latest(self) -> str | None:
        """The newest complete checkpoint's directory, or None."""
        names = self.names()
        return os.path.join(self.path, names[-1]) if names else None

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first."""
        return [int(n[len(_PREFIX) :]) for n in self.names()]

    def at(self, step: int) -> str | None:
        """The complete checkpoint of ``step``'s directory, or None."""
        path = os.path.join(self.path, f"{_PREFIX}{step:08d}")
        return path if step in self.steps() else None

    def drop_after(self, step: int) -> list[int]:
        """Remove the checkpoints past ``step`` (a timeline the learner went back from);
        returns their steps."""
        dropped = [s for s in self.steps() if s > step]
        for s in dropped:
            shutil.rmtree(os.path.join(self.path, f"{_PREFIX}{s:08d}"), ignore_errors=True)
        if dropped:
            fsync_dir(self.path)
        return dropped

    def save(self, step: int, state: dict[str, Any]) -> str:
        """Write ``state`` as the checkpoint of ``step``, atomically; drop the oldest beyond
        ``keep``. Returns the checkpoint's directory."""
        final = os.path.join(self.path, f"{_PREFIX}{step:08d}")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        with open(os.path.join(tmp, "state.pt"), "wb") as f:
            torch.save(state, f)
            f.flush()
            self.faults.at("checkpoint_write")
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(self.path)
        for old in self.names()[: -self.keep]:
            shutil.rmtree(os.path.join(self.path, old), ignore_errors=True)
        return final

    @staticmethod
    def load(path: str) -> dict[str, Any]:
        """The state saved in the checkpoint directory ``path``."""
        # weights_only: a checkpoint holds tensors and plain values, never pickled objects.
        # On the host: a checkpoint written on one device (cuda) loads on any other; the
        # learner's load_state_dict then moves and casts each tensor to its own parameters.
        state: dict[str, Any] = torch.load(
            os.path.join(path, "state.pt"), map_location="cpu", weights_only=True
        )
        return state


class StepLog:
    """The ledger of consumed sample ids: one fsynced JSON line per step, in ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(os.path.dirname(path), exist_ok=True)

    def append(self, record: dict[str, Any]) -> None:
        """Add one step's record (``step``, ``version``, ``ids``, ...), durably."""
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self, up_to_step: int) -> tuple[set[tuple[str, int]], int]:
        """The ids consumed by the steps up to ``up_to_step``, and how many lines were cut.

        Lines past that step (the learner died between the log and the checkpoint, or, with
        ``durable: false``, after the last checkpoint) and lines torn by a crash mid-write are
        cut from the file, durably: those steps will be trained again.
        """
        consumed: set[tuple[str, int]] = set()
        if not os.path.exists(self.path):
            return consumed, 0
        kept: list[str] = []
        cut = 0
        with open(self.path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    cut += 1  # a line torn by a crash mid-write
                    continue
                if record["step"] > up_to_step:
                    cut += 1
                    continue
                kept.append(line if line.endswith("\n") else line + "\n")
                consumed.update((p, int(i)) for p, i in record["ids"])
        if cut:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(kept)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        return consumed, cut
