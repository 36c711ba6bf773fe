"""The run directory as the command line sees it: is a run already there, claim it for a run,
save its manifest, load it back to resume, clear it to start afresh.

``asyncrl run`` claims the directory first (``claim_run_dir``): it makes it private (0700), sets
the umask so that everything the run creates in it is private too, and writes the run marker
``.asyncrl-run``. ``--overwrite`` (``clear_run``) removes only what a run writes, and only in a
directory carrying that marker (or a run directory of an earlier version), so that a mistyped
``--run-dir`` never deletes someone's folder and a manifest kept beside a run's files stays.

It then saves the resolved manifest (after ``--set``) as ``RUN_DIR/manifest.json`` before the
first process starts, so that ``asyncrl run --resume RUN_DIR`` runs exactly the same manifest
again in the same directory. JSON is YAML, so the saved file is itself a manifest that
``load_manifest`` reads and validates like any other.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from typing import Any

import msgspec

from asyncrl.manifest.load import Manifest, load_manifest
from asyncrl.safe_files import write_atomic

__all__ = [
    "MANIFEST_FILE",
    "PRIVATE_UMASK",
    "RUN_ENTRIES",
    "RUN_MARKER",
    "RunDirError",
    "claim_run_dir",
    "clear_run",
    "in_use",
    "load_saved_manifest",
    "manifest_differences",
    "prepare_run_dir",
    "run_markers",
    "save_manifest",
]

MANIFEST_FILE = "manifest.json"
"""The resolved manifest of the run, saved in its run directory."""
RUN_MARKER = ".asyncrl-run"
"""The file ``asyncrl run`` writes at the top of every run directory it starts a run in: the
proof ``--overwrite`` asks for before it deletes anything."""
PRIVATE_UMASK = 0o077
"""The umask of a run: what it creates is its user's alone (folders 0700, files 0600)."""

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

_WRITTEN_BY_A_RUN = (MANIFEST_FILE, "report.json", "driver.json", "logs")
"""What every run of an earlier version (without ``RUN_MARKER``) left at the top of its run
directory, at least one of them: its manifest, report, driver record, logs."""

RUN_ENTRIES = frozenset(
    {
        RUN_MARKER,
        MANIFEST_FILE,
        "report.json",
        "driver.json",
        "launch.json",
        "accounting.json",
        "summary.json",
        "history.jsonl",
        "heldout.jsonl",
        "metrics.jsonl",
        "trace.json",
        "trace.html",
        "progress.png",
        "manifest.yaml",
        "checkpoints",
        "roles",
        "ledger",
        "logs",
        "liveness",
        "sockets",
        "registry",
        "specs",
        "weights",
        "exports",
        "secret",
        "final",
        "plots",
        "tensorboard",
        "trace",
        "dist",
        "undisturbed",
        "chaos",
    }
)
"""The names a run (of this or an earlier version) writes at the top of its run directory, its
program's usual outputs included, besides a launch's ``node-<R>`` folders and the temporary
names a write in progress leaves (``.<entry>.*.tmp``; ``<entry>.<pid>.tmp`` in earlier
versions). ``--overwrite`` removes only these; a directory without ``RUN_MARKER`` that holds
anything else is not cleared at all."""

_WRITTEN_NAME = re.compile(
    r"^(node-\d+|\.(?P<entry>[^/]+)\.[^./]+\.tmp|(?P<staged>[^/]+)\.\d+\.tmp)\Z"
)


class RunDirError(Exception):
    """The run directory cannot be used as asked; the message says why and what to do."""


def run_markers(run_dir: str) -> list[str]:
    """The paths in ``run_dir`` that show an earlier run used it (empty: the directory is free)."""
    return [m for m in _MARKERS if os.path.lexists(os.path.join(run_dir, m))]


def claim_run_dir(run_dir: str) -> str:
    """Make ``run_dir`` (and missing parents) a private run directory; return its path.

    A folder that holds the user's own files (a manifest, a program) may be a run directory:
    ``clear_run`` removes only what a run writes there (``RUN_ENTRIES``), never those files.
    The directory is created, or made, 0700 (the folders an earlier run left in it too), and
    carries ``RUN_MARKER``. Entry points also set the process umask to ``PRIVATE_UMASK`` first,
    so that what the run creates afterwards is private whatever the user's umask.

    Raises:
        RunDirError: ``run_dir`` is not a directory, or belongs to another user.
    """
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    st = os.stat(run_dir)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise RunDirError(
            f"cannot use {run_dir} as a run directory: it is not a directory of this user "
            f"(uid {os.getuid()}); give another --run-dir"
        )
    names = os.listdir(run_dir)
    marker = os.path.join(run_dir, RUN_MARKER)
    os.chmod(run_dir, 0o700)
    for name in sorted(RUN_ENTRIES & set(names)):
        path = os.path.join(run_dir, name)
        sub = os.lstat(path)
        if stat.S_ISDIR(sub.st_mode) and sub.st_uid == os.getuid():
            os.chmod(path, 0o700)
    if not os.path.isfile(marker) or os.path.islink(marker):
        write_atomic(marker, b"a run directory of asyncrl: asyncrl run --overwrite clears it\n")
    return run_dir


def in_use(run_dir: str) -> str:
    """Why ``run_dir`` cannot be taken now: a live run on this machine runs in it or in a folder
    inside it (its lease says so, ``asyncrl.supervision.leases``); "" when none does."""
    from asyncrl.supervision.leases import LeaseDirError, read_leases

    real = os.path.realpath(run_dir)
    try:
        leases = read_leases()
    except LeaseDirError:
        return ""  # no lease can be trusted; the sweep after it warns of that
    for lease in leases:
        held = os.path.realpath(lease.run_dir)
        if (held == real or held.startswith(real.rstrip(os.sep) + os.sep)) and lease.alive():
            where = "" if held == real else f" in {lease.run_dir}"
            return (
                f"{run_dir} is in use by a running run ({lease.run!r}{where}, agent pid "
                f"{lease.agent_pid}); stop it first (asyncrl status {lease.run_dir} shows it)"
            )
    return ""


def prepare_run_dir(
    run_dir: str, *, overwrite: bool = False, resume: bool = False, continue_hint: str = ""
) -> str:
    """Make ``run_dir`` ready for a run, the same for ``asyncrl run`` and
    ``asyncrl.launch``; return its path.

    Refused when a live run holds it (``in_use``). For a new run (not ``resume``), a directory
    that already holds one is refused, or with ``overwrite`` cleared (``clear_run``). Then it is
    claimed (``claim_run_dir``): private and marked, a resumed directory of an earlier version
    too. ``continue_hint`` goes into the refusal of a used directory, before "add --overwrite".

    Raises:
        RunDirError: it cannot be used; the message says why and what to do.
        OSError: it cannot be created, cleared or marked.
    """
    busy = in_use(run_dir)
    if busy:
        raise RunDirError(busy)
    found = [] if resume else run_markers(run_dir)
    if found and not overwrite:
        raise RunDirError(
            f"{run_dir} already holds a run ({', '.join(found)}); "
            f"{continue_hint}add --overwrite to delete it and start afresh"
        )
    if found:
        clear_run(run_dir)
    return claim_run_dir(run_dir)


def save_manifest(manifest: Manifest, run_dir: str) -> str:
    """Claim ``run_dir`` (``claim_run_dir``), then write ``manifest`` to
    ``RUN_DIR/manifest.json`` atomically; return the path.

    The file is written into a fresh temporary file beside its final name (``O_EXCL``, never a
    name that was there before), flushed to disk, then renamed over it, so a reader never sees
    half of it.
    """
    claim_run_dir(run_dir)
    data = msgspec.json.format(msgspec.json.encode(manifest)) + b"\n"
    return write_atomic(os.path.join(run_dir, MANIFEST_FILE), data, fsync=True)


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


def clear_run(run_dir: str) -> list[str]:
    """Remove what a run wrote in ``run_dir`` so that a new run starts afresh there; return the
    names at its top that were kept because no run writes them (the user's own files).

    Only a run directory is cleared: one that carries ``RUN_MARKER``, or, from a version that
    wrote no marker, holds nothing but ``RUN_ENTRIES`` and at least a manifest, report, driver
    record or logs of a run. Under the marker only ``RUN_ENTRIES`` (and a write's temporary
    names) are removed: a manifest, a program or a thesis beside them stays.

    Raises:
        RunDirError: ``run_dir`` holds the current directory, is a git checkout, or is not a
            run directory as above; the message names what is in the way. Nothing is removed.
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
        return []
    names = sorted(os.listdir(real))
    _check_is_a_run(run_dir, names)
    kept = _not_written_by_a_run(names)
    ours = [n for n in names if n not in kept and n != RUN_MARKER]
    for name in ours + ([RUN_MARKER] if RUN_MARKER in names else []):  # the marker last
        path = os.path.join(real, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
    return kept


def _check_is_a_run(run_dir: str, names: list[str]) -> None:
    """Raise ``RunDirError`` unless ``names`` (the entries of ``run_dir``) are a run's."""
    what = "delete it yourself if it is yours to delete, or give another --run-dir"
    marker = os.path.join(run_dir, RUN_MARKER)
    marked = RUN_MARKER in names and os.path.isfile(marker) and not os.path.islink(marker)
    if marked:
        return
    unknown = _not_written_by_a_run(names)
    if unknown:
        raise RunDirError(
            f"refusing to overwrite {run_dir}: it has no run marker ({RUN_MARKER}) and holds "
            f"{_shown(unknown)}, which no run writes, so it may not be a run directory; {what}"
        )
    if not marked and not any(n in names for n in _WRITTEN_BY_A_RUN):
        raise RunDirError(
            f"refusing to overwrite {run_dir}: it has no run marker ({RUN_MARKER}) and none of "
            f"the {', '.join(_WRITTEN_BY_A_RUN)} a run leaves, so it may not be a run "
            f"directory; {what}"
        )


def _not_written_by_a_run(names: list[str]) -> list[str]:
    """The entries among ``names`` that no run writes at the top of its run directory."""
    unknown = []
    for name in sorted(names):
        match = _WRITTEN_NAME.match(name)
        entry = match and (match.group("entry") or match.group("staged"))
        if name in RUN_ENTRIES or (match and (not entry or entry in RUN_ENTRIES)):
            continue
        unknown.append(name)
    return unknown


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if names[5:] else "")
