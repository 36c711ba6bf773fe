"""The run directory as the command line sees it: is a run already there, claim it for a run,
save its manifest, load it back to resume, clear it to start afresh.

``asyncrl run`` claims the directory first (``claim_run_dir``): it makes it private (0700), sets
the umask so that everything the run creates in it is private too, checks the run's own folders
in it once (each a folder of this user's, never a link: a planted ``logs`` or ``sockets`` link
is an error naming it), and writes the run marker ``.asyncrl-run``. The marker is the record of
what the runs there made: the names at the top of the directory that were not there when a run
first claimed it. ``--overwrite`` (``clear_run``) removes exactly those, and nothing by name
alone: a manifest, a ``logs/`` or a thesis that was there before stays, with all it holds. A
first run into a folder that is not empty and holds no run needs ``--allow-nonempty``.

It then saves the resolved manifest (after ``--set``) as ``RUN_DIR/manifest.json`` before the
first process starts, so that ``asyncrl run --resume RUN_DIR`` runs exactly the same manifest
again in the same directory. JSON is YAML, so the saved file is itself a manifest that
``load_manifest`` reads and validates like any other.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from typing import Any

import msgspec

from asyncrl.manifest.load import Manifest, load_manifest
from asyncrl.safe_files import atomic_file_at, open_dir, remove_at, write_atomic

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
    "node_dir",
    "prepare_run_dir",
    "run_markers",
    "save_manifest",
]

MANIFEST_FILE = "manifest.json"
"""The resolved manifest of the run, saved in its run directory."""
RUN_MARKER = ".asyncrl-run"
"""The file ``asyncrl run`` writes at the top of every run directory it starts a run in: the
record of what the runs there made, and all that ``--overwrite`` removes."""
PRIVATE_UMASK = 0o077
"""The umask of a run: what it creates is its user's alone (folders 0700, files 0600)."""

_RECORD_HEADER = (
    "asyncrl run directory 2: 'asyncrl run --overwrite' removes the entries listed below "
    "(made by the runs here), and nothing else"
)
"""The first line of a marker that records what the runs made; an earlier version's marker
has another first line and no record."""
_MAX_MARKER_BYTES = 65536

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
        "tensorboard",
        "trace",
        "dist",
        "undisturbed",
        "chaos",
    }
)
"""The names a run (of this or an earlier version) writes at the top of its run directory.
A claim records in ``RUN_MARKER`` those that are not there yet: what the run then makes at
those names is its own, and what was there before is not. Never the user's usual companions of
a run (``manifest.yaml``, ``plots``, ``final``): no run makes them."""

_USERS_ENTRIES = frozenset({"manifest.yaml", "plots", "final"})
"""Names often found beside a run's files that no run makes: a directory of an earlier version
may hold them and still be a run directory, but ``--overwrite`` never removes them."""

_WRITTEN_NAME = re.compile(
    r"^(node-\d+|\.(?P<entry>[^/]+)\.[^./]+\.tmp|(?P<staged>[^/]+)\.\d+\.tmp)\Z"
)
_NODE = re.compile(r"^node-\d+\Z")


def node_dir(run_dir: str, node: int) -> str:
    """Where node ``node`` of a launch over several nodes keeps its files: RUN_DIR on node 0,
    RUN_DIR/node-R on the others."""
    return run_dir if node == 0 else os.path.join(run_dir, f"node-{node}")


class RunDirError(Exception):
    """The run directory cannot be used as asked; the message says why and what to do."""


def run_markers(run_dir: str) -> list[str]:
    """The paths in ``run_dir`` that show an earlier run used it (empty: the directory is free)."""
    return [m for m in _MARKERS if os.path.lexists(os.path.join(run_dir, m))]


def _read_record(dir_fd: int) -> list[str] | None:
    try:
        fd = os.open(RUN_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        lines = f.read(_MAX_MARKER_BYTES).decode(errors="replace").splitlines()
    if not lines or lines[0] != _RECORD_HEADER:
        return None
    return sorted({name for name in lines[1:] if name in RUN_ENTRIES})


def _marked(dir_fd: int) -> bool:
    """Whether the open folder carries ``RUN_MARKER`` (a file, not a link), of any version."""
    try:
        return stat.S_ISREG(os.lstat(RUN_MARKER, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def claim_run_dir(run_dir: str) -> str:
    """Make ``run_dir`` (and missing parents) a private run directory; return its path.

    The directory is created, or made, 0700, the run's folders in it too. ``RUN_MARKER``
    records the names of ``RUN_ENTRIES`` that are not there yet (added to what it recorded
    before): what the run makes there is its own, and ``clear_run`` removes only that. A name
    that was there at the first claim (the user's ``logs/``) is the user's, and stays. A run
    directory of an earlier version (an earlier marker, or a run's files without one) records
    the ``RUN_ENTRIES`` it holds. Entry points also set the process umask to
    ``PRIVATE_UMASK`` first, so that what the run creates afterwards is private whatever the
    user's umask.

    Every entry of ``RUN_ENTRIES`` there is checked once, and every folder of the run's inside
    them: a link (other than a launch's shared ``weights``, ``asyncrl.supervision.hosts``), a
    folder of another user's, or a file where the run keeps a folder is an error naming it.

    Raises:
        RunDirError: ``run_dir`` is not a directory of this user's, or holds a link or another
            user's folder where the run writes.
    """
    try:
        os.makedirs(run_dir, mode=0o700, exist_ok=True)
        fd = open_dir(run_dir)
    except (FileExistsError, NotADirectoryError) as exc:
        raise RunDirError(
            f"cannot use {run_dir} as a run directory: it is not a directory; give another "
            "--run-dir"
        ) from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise RunDirError(
                f"cannot use {run_dir} as a run directory: it is not a directory of this user "
                f"(uid {os.getuid()}); give another --run-dir"
            )
        os.fchmod(fd, 0o700)
        names = set(os.listdir(fd))
        record = _read_record(fd)
        if record is None:
            earlier = _marked(fd) or bool(run_markers(run_dir))
            record = sorted(RUN_ENTRIES & names) if earlier else []
        for name in sorted(RUN_ENTRIES & names):
            _check_entry(run_dir, fd, name, ours=name in record)
        made = sorted(set(record) | (RUN_ENTRIES - names))
        with atomic_file_at(fd, RUN_MARKER) as f:
            f.write("\n".join([_RECORD_HEADER, *made, ""]).encode())
    finally:
        os.close(fd)
    return run_dir


def _check_entry(run_dir: str, dir_fd: int, name: str, *, ours: bool) -> None:
    """Raise ``RunDirError`` unless the entry ``name`` of the open run directory is fit for the
    run to write into: not a link, this user's, and no link anywhere inside it. Make it private
    (0700), and when it is the run's (``ours``), every folder inside it too."""
    path = os.path.join(run_dir, name)
    st = os.lstat(name, dir_fd=dir_fd)
    if stat.S_ISLNK(st.st_mode):
        if name == "weights" and _shared_weights(run_dir, os.readlink(name, dir_fd=dir_fd)):
            return
        raise RunDirError(
            f"{path} is a link (to {os.readlink(name, dir_fd=dir_fd)}); a run writes only into "
            f"folders it made itself, never through a link: remove the link (the run makes "
            f"{name} again), or give another --run-dir"
        )
    if st.st_uid != os.getuid():
        raise RunDirError(
            f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}); the run "
            f"writes there: remove it, or give another --run-dir"
        )
    if not stat.S_ISDIR(st.st_mode):
        return
    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        os.fchmod(sub, 0o700)
        for folder, dirs, files, folder_fd in os.fwalk(dir_fd=sub):
            for entry in [*dirs, *files]:
                inner = os.lstat(entry, dir_fd=folder_fd)
                where = os.path.normpath(os.path.join(path, folder, entry))
                if stat.S_ISLNK(inner.st_mode):
                    raise RunDirError(
                        f"{where} is a link (to {os.readlink(entry, dir_fd=folder_fd)}); a run "
                        "writes only into folders it made itself, never through a link: "
                        "remove the link, or give another --run-dir"
                    )
                if stat.S_ISDIR(inner.st_mode) and ours:
                    if inner.st_uid != os.getuid():
                        raise RunDirError(
                            f"{where} belongs to uid {inner.st_uid}, not to this user "
                            f"({os.getuid()}); remove it, or give another --run-dir"
                        )
                    os.chmod(entry, 0o700, dir_fd=folder_fd)
    finally:
        os.close(sub)


def _shared_weights(run_dir: str, target: str) -> bool:
    """Whether ``target`` (a ``weights`` link's) is the ``weights`` folder of another node of
    the same launch: ``RUN_DIR/weights`` or ``RUN_DIR/node-<R>/weights``, from a node folder
    ``RUN_DIR/node-<N>`` (``asyncrl.supervision.hosts.share``)."""
    base = os.path.dirname(os.path.realpath(run_dir))
    real = os.path.realpath(os.path.join(run_dir, target))
    folder = os.path.dirname(real)
    return os.path.basename(real) == "weights" and (
        folder == base
        or (os.path.dirname(folder) == base and bool(_NODE.match(os.path.basename(folder))))
    )


def in_use(run_dir: str) -> str:
    """Why ``run_dir`` cannot be taken now: a live run on this machine runs in it or in a folder
    inside it, or it lies inside a live run's own folders (its socket folder, its ``logs``...),
    as the runs' leases say (``asyncrl.supervision.leases``); "" when none does."""
    from asyncrl.supervision.leases import LeaseDirError, read_leases

    real = os.path.realpath(run_dir)
    try:
        leases = read_leases()
    except LeaseDirError:
        return ""  # no lease can be trusted; the sweep after it warns of that
    for lease in leases:
        held = os.path.realpath(lease.run_dir)
        owned = [os.path.realpath(lease.socket_dir)]
        owned += [os.path.join(held, name) for name in sorted(RUN_ENTRIES)]
        inside_of = next((folder for folder in owned if _inside(real, folder)), "")
        if not (_inside(held, real) or inside_of) or not lease.alive():
            continue
        if inside_of:
            return (
                f"{run_dir} is inside {inside_of}, a folder of a running run ({lease.run!r} in "
                f"{lease.run_dir}, agent pid {lease.agent_pid}) that only that run writes; "
                "give a --run-dir outside it"
            )
        where = "" if held == real else f" in {lease.run_dir}"
        return (
            f"{run_dir} is in use by a running run ({lease.run!r}{where}, agent pid "
            f"{lease.agent_pid}); stop it first (asyncrl status {lease.run_dir} shows it)"
        )
    return ""


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it (both resolved)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def prepare_run_dir(
    run_dir: str,
    *,
    overwrite: bool = False,
    resume: bool = False,
    continue_hint: str = "",
    allow_nonempty: bool = False,
) -> str:
    """Make ``run_dir`` ready for a run, the same for ``asyncrl run`` and
    ``asyncrl.launch``; return its path.

    Refused when a live run holds it (``in_use``), and to ``resume`` when it holds no run
    (``run_markers``). For a new run (not ``resume``), a directory
    that already holds one is refused, or with ``overwrite`` cleared (``clear_run``); a
    directory that is not empty and holds no run (no marker, no run's files) is refused unless
    ``allow_nonempty``. Then it is claimed (``claim_run_dir``): private and marked, a resumed
    directory of an earlier version too. ``continue_hint`` goes into the refusal of a used
    directory, before "add --overwrite".

    Raises:
        RunDirError: it cannot be used; the message says why and what to do.
        OSError: it cannot be created, cleared or marked.
    """
    busy = in_use(run_dir)
    if busy:
        raise RunDirError(busy)
    if resume and not run_markers(run_dir):
        raise RunDirError(f"--resume: {run_dir} holds no run to resume")
    found = [] if resume else run_markers(run_dir)
    if found and not overwrite:
        raise RunDirError(
            f"{run_dir} already holds a run ({', '.join(found)}); "
            f"{continue_hint}add --overwrite to delete it and start afresh"
        )
    if found:
        clear_run(run_dir)
    elif not resume and not allow_nonempty and os.path.isdir(run_dir):
        names = sorted(os.listdir(run_dir))
        if names and RUN_MARKER not in names:
            raise RunDirError(
                f"{run_dir} is not empty (it holds {_shown(names)}) and holds no run; give an "
                "empty or new --run-dir, or add --allow-nonempty to write the run beside what "
                "is there ('--overwrite' later removes only what the runs made, never those)"
            )
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
    """Remove what the runs made in ``run_dir`` so that a new run starts afresh there; return
    the names at its top that were kept (the user's own files and folders).

    Under a marker of this version exactly what it records is removed (with the temporary
    names a write in progress leaves for it, and a launch's ``node-<R>`` folders, each cleared
    by its own marker); the marker stays. A run directory of an earlier version (its marker
    records nothing, or it has none but holds nothing but ``RUN_ENTRIES``, the user's usual
    companions such as ``manifest.yaml``, and at least a manifest, report, driver record or
    logs of a run) loses the ``RUN_ENTRIES`` it holds. Nothing is removed by following a link.

    Raises:
        RunDirError: ``run_dir`` holds the current directory, is a git checkout, or is not a
            run directory as above; the message names what is in the way. Nothing is removed.
    """
    real = os.path.realpath(run_dir)
    cwd = os.path.realpath(os.getcwd())
    if real == os.path.sep or _inside(cwd, real):
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
    fd = open_dir(real)
    try:
        names = sorted(os.listdir(fd))
        record = _read_record(fd)
        if record is None and not _marked(fd):
            _check_is_a_run(run_dir, names)
        made = RUN_ENTRIES if record is None else frozenset(record)
        kept = []
        for name in names:
            if name == RUN_MARKER:
                continue
            if _NODE.match(name) and _node_of_the_run(fd, name):
                _clear_node(real, fd, name)
                if os.path.lexists(os.path.join(real, name)):
                    kept.append(name)
            elif _made(name, made):
                remove_at(fd, name)
            else:
                kept.append(name)
        if record is None and _marked(fd):
            os.unlink(RUN_MARKER, dir_fd=fd)  # an earlier version's: the claim records anew
        return kept
    finally:
        os.close(fd)


def _clear_node(real: str, dir_fd: int, name: str) -> None:
    """Clear a launch's node folder ``name`` by its own marker; remove the folder, marker and
    all, when nothing else is left in it."""
    clear_run(os.path.join(real, name))
    sub = _node_fd(dir_fd, name)
    try:
        if os.listdir(sub) == [RUN_MARKER]:
            os.unlink(RUN_MARKER, dir_fd=sub)
    finally:
        os.close(sub)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=dir_fd)  # only when empty


def _made(name: str, made: frozenset[str]) -> bool:
    """Whether ``name`` is one of ``made``, or a temporary name a write of one of them left."""
    if name in made:
        return True
    match = _WRITTEN_NAME.match(name)
    entry = match and (match.group("entry") or match.group("staged"))
    return bool(entry) and entry in made


def _node_of_the_run(dir_fd: int, name: str) -> bool:
    """Whether ``name`` is a launch's node folder: a folder (not a link) with its own marker."""
    try:
        sub = _node_fd(dir_fd, name)
    except OSError:
        return False
    try:
        return _marked(sub)
    finally:
        os.close(sub)


def _node_fd(dir_fd: int, name: str) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)


def _check_is_a_run(run_dir: str, names: list[str]) -> None:
    """Raise ``RunDirError`` unless ``names`` (the entries of ``run_dir``, which carries no
    marker) are an earlier version's run's."""
    what = "delete it yourself if it is yours to delete, or give another --run-dir"
    unknown = _not_written_by_a_run(names)
    if unknown:
        raise RunDirError(
            f"refusing to overwrite {run_dir}: it has no run marker ({RUN_MARKER}) and holds "
            f"{_shown(unknown)}, which no run writes, so it may not be a run directory; {what}"
        )
    if not any(n in names for n in _WRITTEN_BY_A_RUN):
        raise RunDirError(
            f"refusing to overwrite {run_dir}: it has no run marker ({RUN_MARKER}) and none of "
            f"the {', '.join(_WRITTEN_BY_A_RUN)} a run leaves, so it may not be a run "
            f"directory; {what}"
        )


def _not_written_by_a_run(names: list[str]) -> list[str]:
    """The entries among ``names`` that no run writes at the top of its run directory (the
    user's usual companions of a run aside)."""
    return [
        name
        for name in sorted(names)
        if not (_made(name, RUN_ENTRIES) or _NODE.match(name) or name in _USERS_ENTRIES)
    ]


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if names[5:] else "")
