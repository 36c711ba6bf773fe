"""The run directory as the command line sees it: is a run already there, save its manifest,
load it back to resume, clear it to start afresh.

``asyncrl run`` saves the resolved manifest (after ``--set``) as ``RUN_DIR/manifest.json`` before
the first process starts, so that ``asyncrl run --resume RUN_DIR`` runs exactly the same manifest
again in the same directory. JSON is YAML, so the saved file is itself a manifest that
``load_manifest`` reads and validates like any other.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import msgspec

from asyncrl.manifest import Manifest, load_manifest

__all__ = [
    "MANIFEST_FILE",
    "RunDirError",
    "clear_run",
    "load_saved_manifest",
    "manifest_differences",
    "run_markers",
    "save_manifest",
]

MANIFEST_FILE = "manifest.json"
"""The resolved manifest of the run, saved in its run directory."""

_MARKERS = (
    MANIFEST_FILE,
    "report.json",
    "driver.json",
    "checkpoints",
    "roles",
    os.path.join("logs", "agent.jsonl"),
)
"""Paths whose presence says a run has already used the directory: its saved manifest, its
report, the driver's record, checkpoints and role state (``roles/<name>.<replica>/``, where the
learner keeps its checkpoints), the agent's log (left even by a run that was killed)."""


class RunDirError(Exception):
    """The run directory cannot be used as asked; the message says why and what to do."""


def run_markers(run_dir: str) -> list[str]:
    """The paths in ``run_dir`` that show an earlier run used it (empty: the directory is free)."""
    return [m for m in _MARKERS if os.path.lexists(os.path.join(run_dir, m))]


def save_manifest(manifest: Manifest, run_dir: str) -> str:
    """Write ``manifest`` to ``RUN_DIR/manifest.json`` atomically; return the path.

    The file is written beside its final name, flushed to disk, then renamed over it, so a
    reader never sees half of it.
    """
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, MANIFEST_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(manifest)))
        f.write(b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_saved_manifest(run_dir: str) -> Manifest:
    """The manifest saved in ``run_dir`` by the run that started there.

    Raises ``RunDirError`` when ``run_dir`` is not a directory or holds no saved manifest, and
    ``ManifestError`` when the saved file no longer validates.
    """
    if not os.path.isdir(run_dir):
        raise RunDirError(f"cannot resume {run_dir}: no such directory; check the path")
    path = os.path.join(run_dir, MANIFEST_FILE)
    if not os.path.exists(path):
        raise RunDirError(
            f"cannot resume {run_dir}: it holds no saved manifest ({MANIFEST_FILE}), so it was "
            "not started by 'asyncrl run' (or by a version that did not save it); start it "
            "again with 'asyncrl run MANIFEST --run-dir DIR --overwrite'"
        )
    return load_manifest(path)


def manifest_differences(a: Manifest, b: Manifest) -> list[str]:
    """Dotted paths (down to ``roles.<name>.<field>``) where ``a`` and ``b`` differ."""
    return _diff(msgspec.to_builtins(a), msgspec.to_builtins(b), "", depth=3)


def _diff(a: Any, b: Any, path: str, depth: int) -> list[str]:
    if a == b:
        return []
    if depth == 0 or not isinstance(a, dict) or not isinstance(b, dict):
        return [path or "the manifest"]
    out: list[str] = []
    for key in [*a, *(k for k in b if k not in a)]:
        sub = f"{path}.{key}" if path else str(key)
        out += _diff(a.get(key), b.get(key), sub, depth - 1)
    return out


def clear_run(run_dir: str) -> None:
    """Remove everything in ``run_dir`` so that a new run starts afresh there.

    Refuses (``RunDirError``) a directory that holds the current directory, or a git checkout:
    ``--overwrite`` on ``.`` must not delete a project.
    """
    real = os.path.realpath(run_dir)
    cwd = os.path.realpath(os.getcwd())
    if real == os.path.sep or cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep):
        raise RunDirError(
            f"refusing to overwrite {run_dir}: it holds the current directory; "
            "give a run directory of its own with --run-dir"
        )
    if os.path.exists(os.path.join(real, ".git")):
        raise RunDirError(
            f"refusing to overwrite {run_dir}: it is a git checkout, not a run directory; "
            "give a run directory of its own with --run-dir"
        )
    if not os.path.isdir(real):
        return
    for name in os.listdir(real):
        path = os.path.join(real, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
