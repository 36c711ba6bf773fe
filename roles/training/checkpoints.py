"""The trainers' durable state: checkpoints and the step log.

A checkpoint is a directory ``step-NNNNNNNN`` written with ``torch.distributed.checkpoint``
(DCP, one process's own state: ``no_dist``): the state's tensors in DCP's files, its plain
values (step, version, the optimizer's hyper-parameters, the scheduler) in ``values.msgpack``.
It becomes a checkpoint only when its marker, ``COMPLETE``, is written: after every file is
fsynced, listing each file with its size. A directory without the marker is a save that never
finished; one whose files do not match the marker is damaged. Neither is ever loaded: the
reader skips them with a warning and removes them. The newest ``keep`` are kept.

Saving is in two halves, so that training pauses only for the first: ``stage`` copies the
state's tensors into host buffers; ``write`` writes the staged copy (in a background thread, for
an asynchronous save). Page-locked buffers (where the hardware plugin pins memory: an
accelerator's state staged to the host) are kept from one save to the next; plain host memory
(a model trained on the host) is given back once the save is written. ``save`` writes from the
state itself, in the calling thread, with no staged copy.

The step log (``RUN_DIR/ledger/<role>.<replica>.steps.jsonl``) is the ledger of consumed sample
ids: one JSON line per step. Read back, it is cut at the restored step: lines past it are steps
that never became durable (or, with a write-ahead log, steps the replay writes again).

``rng_state`` and ``set_rng_state`` capture and restore every RNG (torch, Python, NumPy) as
tensors and plain values; ``rng_bytes`` and ``rng_from_bytes`` the same as plain values only.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import warnings
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import torch

from asyncrl.safe_files import open_append, write_atomic
from asyncrl.supervision.faults import FaultPlan

__all__ = [
    "CheckpointDir",
    "CheckpointError",
    "StepLog",
    "fsync_dir",
    "problem",
    "read_values",
    "rng_bytes",
    "rng_from_bytes",
    "rng_state",
    "set_rng_state",
]

_PREFIX = "step-"
_MARKER = "COMPLETE"
_VALUES = "values.msgpack"
_LEGACY = "state.pt"
"""An earlier release's checkpoint: one file, written whole into ``step-N.tmp`` and renamed."""
_TENSOR = "__tensor__"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded (damaged, or none matches)."""


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


def rng_bytes() -> dict[str, Any]:
    """``rng_state`` as plain values and bytes (for a MessagePack record)."""
    state = rng_state()
    state["torch"] = state["torch"].numpy().tobytes()
    state["numpy"][1] = state["numpy"][1].numpy().tobytes()
    return state


def rng_from_bytes(state: dict[str, Any]) -> dict[str, Any]:
    """What ``rng_bytes`` made, as ``set_rng_state`` takes it."""
    out = dict(state)
    out["torch"] = torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8)
    numpy_state = list(state["numpy"])
    numpy_state[1] = torch.frombuffer(bytearray(numpy_state[1]), dtype=torch.int64)
    out["numpy"] = numpy_state
    return out


def _split(tree: Any, tensors: dict[str, torch.Tensor], key: str) -> Any:
    """``tree`` with each tensor replaced by a reference to its key in ``tensors``."""
    if isinstance(tree, torch.Tensor):
        tensors[key] = tree
        return {_TENSOR: key}
    if isinstance(tree, dict):
        return {k: _split(v, tensors, f"{key}/{k}") for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [_split(v, tensors, f"{key}/{i}") for i, v in enumerate(tree)]
    return tree


def _join(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """What ``_split`` took apart."""
    if isinstance(tree, dict):
        if set(tree) == {_TENSOR}:
            return tensors[tree[_TENSOR]]
        return {k: _join(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_join(v, tensors) for v in tree]
    return tree


class Staged(msgspec.Struct):
    """A state copied out of training for a save: ``step``, its tensors (in the stager's
    buffers) and its plain values."""

    step: int
    tensors: dict[str, torch.Tensor]
    values: Any


class CheckpointDir:
    """The checkpoints of one trainer replica, in ``path``.

    ``faults`` names the point ``checkpoint_write`` (the state's files written, not yet fsynced
    nor marked complete) for the fault-injection tests. ``pin`` makes a staging buffer
    page-locked (the hardware plugin's ``device.pin``); ``warn`` reports what reading skipped.
    """

    def __init__(
        self,
        path: str,
        keep: int,
        faults: FaultPlan,
        pin: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        warn: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.path = path
        self.keep = max(1, keep)
        self.faults = faults
        self.pin = pin
        self.warn = warn
        self._buffers: dict[str, torch.Tensor] = {}
        os.makedirs(path, exist_ok=True)

    def _dir(self, step: int) -> str:
        return os.path.join(self.path, f"{_PREFIX}{step:08d}")

    def _all_steps(self) -> list[int]:
        names = [n for n in os.listdir(self.path) if n.startswith(_PREFIX)]
        return sorted(int(n[len(_PREFIX) :]) for n in names if n[len(_PREFIX) :].isdigit())

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints (marked, their files as the marker lists
        them), oldest first."""
        return [s for s in self._all_steps() if self._problem(s) is None]

    def _problem(self, step: int) -> str | None:
        """Why the checkpoint of ``step`` cannot be loaded, or None: it is complete."""
        return problem(self._dir(step))

    def dir_of(self, step: int) -> str:
        """The directory the checkpoint of ``step`` has (or would have) here."""
        return self._dir(step)

    def sweep(self) -> None:
        """Remove (with a warning) every checkpoint directory that is not complete."""
        for step in self._all_steps():
            problem = self._problem(step)
            if problem is not None:
                self.warn(f"checkpoint {self._dir(step)} skipped and removed: {problem}")
                shutil.rmtree(self._dir(step), ignore_errors=True)
        for name in os.listdir(self.path):  # older saves' temporary directories
            if name.endswith(".tmp"):
                shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)

    def latest(self) -> str | None:
        """The newest complete checkpoint's directory, or None."""
        steps = self.steps()
        return self._dir(steps[-1]) if steps else None

    def at(self, step: int) -> str | None:
        """The complete checkpoint of ``step``'s directory, or None."""
        return self._dir(step) if step in self.steps() else None

    def drop_after(self, step: int) -> list[int]:
        """Remove the checkpoints past ``step`` (a timeline the trainer went back from);
        returns their steps."""
        dropped = [s for s in self._all_steps() if s > step]
        for s in dropped:
            shutil.rmtree(self._dir(s), ignore_errors=True)
        if dropped:
            fsync_dir(self.path)
        return dropped

    def stage(self, step: int, state: dict[str, Any]) -> Staged:
        """Copy ``state``'s tensors into this directory's host buffers (allocated on the
        first save, reused after): the state may change once this returns."""
        tensors: dict[str, torch.Tensor] = {}
        values = _split(state, tensors, "")
        staged = {}
        for key, t in tensors.items():
            t = t.detach()
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
                buffer = self.pin(torch.empty(t.shape, dtype=t.dtype, device="cpu"))
                self._buffers[key] = buffer
            buffer.copy_(t)
            staged[key] = buffer
        return Staged(step, staged, values)

    def write(self, staged: Staged) -> str:
        """Write a staged state as the checkpoint of its step, then mark it complete; drop
        the oldest beyond ``keep``. Returns the checkpoint's directory."""
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        where = self._dir(staged.step)
        shutil.rmtree(where, ignore_errors=True)
        os.makedirs(where)
        with warnings.catch_warnings():  # "no process group: saving in a single process"
            warnings.simplefilter("ignore", UserWarning)
            writer = FileSystemWriter(where, sync_files=True)
            dcp_save(staged.tensors, storage_writer=writer, no_dist=True)
        with open(os.path.join(where, _VALUES), "wb") as f:
            f.write(msgspec.msgpack.encode(staged.values))
            f.flush()
            os.fsync(f.fileno())
        self.faults.at("checkpoint_write")
        files = {n: os.path.getsize(os.path.join(where, n)) for n in os.listdir(where)}
        for name in files:  # DCP's metadata file is written after its data files
            _fsync_file(os.path.join(where, name))
        fsync_dir(where)
        marker = json.dumps({"step": staged.step, "files": files}).encode()
        write_atomic(os.path.join(where, _MARKER), marker, fsync=True)
        fsync_dir(where)
        fsync_dir(self.path)
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(self._dir(old), ignore_errors=True)
        if not any(b.is_pinned() for b in self._buffers.values()):
            # Plain host memory is the training's own: give it back until the next save.
            # Page-locked buffers are dear to make, and kept.
            self._buffers.clear()
        return where

    def save(self, step: int, state: dict[str, Any]) -> str:
        """Write ``state`` as the checkpoint of ``step`` in the calling thread, from the
        tensors themselves (on the host; no staged copy: nothing changes them meanwhile)."""
        tensors: dict[str, torch.Tensor] = {}
        values = _split(state, tensors, "")
        host = {k: t.detach().to("cpu") for k, t in tensors.items()}
        return self.write(Staged(step, host, values))

    @staticmethod
    def load(path: str) -> dict[str, Any]:
        """The state saved in the checkpoint directory ``path``, its tensors on the host
        (a checkpoint written on one device loads on any other; the trainer's
        ``load_state_dict`` moves and casts each tensor to its own parameters).

        Raises:
            CheckpointError: a file is missing or does not read.
        """
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        if os.path.exists(os.path.join(path, _LEGACY)):
            legacy: dict[str, Any] = torch.load(
                os.path.join(path, _LEGACY), map_location="cpu", weights_only=True
            )
            return legacy
        try:
            with open(os.path.join(path, _VALUES), "rb") as f:
                values = msgspec.msgpack.decode(f.read())
            reader = FileSystemReader(path)
            tensors: dict[str, torch.Tensor] = {}
            for key, meta in reader.read_metadata().state_dict_metadata.items():
                size, dtype = meta.size, meta.properties.dtype  # type: ignore[union-attr]
                tensors[key] = torch.empty(size, dtype=dtype)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp_load(tensors, storage_reader=reader, no_dist=True)
        except (OSError, ValueError, RuntimeError, msgspec.DecodeError) as e:
            raise CheckpointError(f"checkpoint {path} does not load: {e}") from e
        state: dict[str, Any] = _join(values, tensors)
        # MessagePack gives lists: the optimizer's per-parameter state is keyed by int.
        return state


def problem(where: str) -> str | None:
    """Why the checkpoint directory ``where`` cannot be loaded, or None: it is complete (its
    marker written, its files as the marker lists them)."""
    if os.path.exists(os.path.join(where, _LEGACY)):
        return None  # an earlier release's: renamed into place whole
    try:
        with open(os.path.join(where, _MARKER)) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return "no completion marker: its save never finished"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"an unreadable completion marker ({e})"
    for name, size in files.items():
        full = os.path.join(where, name)
        if not os.path.exists(full):
            return f"its file {name} is missing"
        if os.path.getsize(full) != size:
            return f"its file {name} has {os.path.getsize(full)} bytes, not {size}"
    return None


def read_values(where: str) -> dict[str, Any]:
    """The plain values of the checkpoint directory ``where`` (its ``values.msgpack``: the
    state without its tensors, each a reference); ``{}`` for an earlier release's.

    Raises:
        CheckpointError: the file does not read.
    """
    if os.path.exists(os.path.join(where, _LEGACY)):
        return {}
    try:
        with open(os.path.join(where, _VALUES), "rb") as f:
            out = msgspec.msgpack.decode(f.read())
    except (OSError, msgspec.DecodeError) as e:
        raise CheckpointError(f"checkpoint {where} does not load: {e}") from e
    return out if isinstance(out, dict) else {}


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StepLog:
    """The ledger of consumed sample ids: one JSON line per step, in ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(os.path.dirname(path), exist_ok=True)

    def append(self, record: dict[str, Any], sync: bool = True) -> None:
        """Add one step's record (``step``, ``version``, ``ids``, ...), durably unless not
        ``sync`` (a write-ahead log holds the step: ``sync`` before a checkpoint covers it)."""
        with io.TextIOWrapper(open_append(self.path), encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            if sync:
                os.fsync(f.fileno())

    def sync(self) -> None:
        """Make every line appended so far durable."""
        if os.path.exists(self.path):
            _fsync_file(self.path)

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
            write_atomic(self.path, "".join(kept).encode(), fsync=True)
        return consumed, cut
