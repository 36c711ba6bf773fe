"""Which runs are alive on this machine: one small lease file per running node agent.

A run leaves things outside its run directory's records (shared-memory segments, ipc socket
files). Its janitor removes them when the agent dies, but a cgroup kill takes the janitor too.
So every agent holds a lease while it runs, written when it starts its janitor and removed once
the run is swept: a JSON file in ``lease_dir()`` naming the run, the agent's and the janitor's
pids with their start times and pid namespace, and the run's socket and run directories. A
lease whose agent and janitor are both gone is a run that left its leftovers behind;
``asyncrl.supervision.janitor.sweep_dead_runs`` removes them.

The leases live beside the segments, in ``/dev/shm/asyncrl-runs-<uid>``: every run whose
segments share a ``/dev/shm`` sees every other's lease, whatever its temp dir. A lease is
trusted only in a folder that is this user's alone (0700, owned by the user, not a link); a
folder that another user made first, or a link planted there, is refused (``LeaseDirError``),
and a lease file that is not this user's is skipped.

Standard library only: the janitor imports this module, and lives as long as the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
from dataclasses import asdict, dataclass

from asyncrl.safe_files import write_atomic

__all__ = [
    "LEASE_DIR_ENV",
    "Lease",
    "LeaseDirError",
    "alive",
    "lease_dir",
    "lease_path",
    "pid_namespace",
    "private_lease_dir",
    "read_leases",
    "start_time",
    "write_lease",
]

LEASE_DIR_ENV = "ASYNCRL_LEASE_DIR"
"""Overrides where leases live (tests)."""
SHM_DIR = "/dev/shm"
"""Where the runs' shared-memory segments live, and their leases beside them."""


class LeaseDirError(OSError):
    """The lease folder is not this user's alone (another user made it, or it is a link), or
    cannot be made: no lease there can be trusted, nor written. The message says which."""


def lease_dir() -> str:
    """The folder of this user's leases: ``$ASYNCRL_LEASE_DIR``, else
    ``/dev/shm/asyncrl-runs-<uid>`` (beside the segments), else (no ``/dev/shm``)
    ``$XDG_RUNTIME_DIR/asyncrl-runs``, else ``asyncrl-runs-<uid>`` in the system temp dir."""
    if os.environ.get(LEASE_DIR_ENV):
        return os.environ[LEASE_DIR_ENV]
    if os.path.isdir(SHM_DIR):
        return os.path.join(SHM_DIR, f"asyncrl-runs-{os.getuid()}")
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "asyncrl-runs")
    return os.path.join(tempfile.gettempdir(), f"asyncrl-runs-{os.getuid()}")


def private_lease_dir(folder: str = "") -> str:
    """``folder`` (default ``lease_dir()``), created 0700 when missing; return it.

    Raises:
        LeaseDirError: it is not a folder of this user's (another user made it first, or it is
            a link), or it cannot be created.
    """
    folder = folder or lease_dir()
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        st = os.lstat(folder)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.chmod(folder, 0o700)  # ours: nobody else's lease is trusted in it anyway
    except OSError as exc:
        raise LeaseDirError(f"cannot use the lease folder {folder}: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        what = (
            "a link"
            if stat.S_ISLNK(st.st_mode)
            else f"owned by uid {st.st_uid}"
            if st.st_uid != os.getuid()
            else "not a folder"
        )
        fix = (
            f"remove it (rm {folder})"
            if st.st_uid == os.getuid()
            else f"have its owner (uid {st.st_uid}) or root remove it (rm -r {folder})"
        )
        raise LeaseDirError(
            f"the lease folder {folder} is {what}, not a folder of this user's (uid "
            f"{os.getuid()}): no lease in it can be trusted, so what a killed run of this user "
            f"leaves (shared memory, sockets) is never swept while it is there. To fix it, "
            f"{fix}, or set {LEASE_DIR_ENV} to a private folder of yours (such as "
            f"~/.cache/asyncrl/leases) for every run and 'asyncrl clean'"
        )
    return folder


def pid_namespace() -> str:
    """This process's pid namespace ("" when unknown): a pid means a process only in it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs: a zombie (dead, not yet reaped) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: trust kill()
    return state not in (b"Z", b"X")


def start_time(pid: int) -> int:
    """When process ``pid`` started, in clock ticks since boot (0: unknown), so that a pid
    reused by another process is not taken for the one that held it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


@dataclass(frozen=True)
class Lease:
    """One running agent's lease.

    Attributes:
        run: the run's name.
        agent_pid: the node agent's pid; ``agent_start`` its ``start_time``.
        janitor_pid: its janitor's pid; ``janitor_start`` its ``start_time``.
        socket_dir: the run's socket directory.
        run_dir: the run directory.
        pid_ns: the agent's pid namespace ("": unknown, an earlier version's lease).
        path: the lease file (not stored in it).
    """

    run: str
    agent_pid: int
    agent_start: int
    janitor_pid: int
    janitor_start: int
    socket_dir: str
    run_dir: str
    pid_ns: str = ""
    path: str = ""

    def alive(self) -> bool:
        """Whether the agent or its janitor still runs (a janitor at work cleans up itself).

        A lease of another pid namespace (a container that shares ``/dev/shm``) is taken as
        alive: its pids mean nothing here.
        """
        if self.pid_ns and self.pid_ns != pid_namespace():
            return True
        return any(
            alive(pid) and (not since or start_time(pid) == since)
            for pid, since in (
                (self.agent_pid, self.agent_start),
                (self.janitor_pid, self.janitor_start),
            )
        )


def lease_path(run: str, folder: str = "") -> str:
    """Where this process (the agent) keeps the lease of ``run``: in ``folder`` (default
    ``lease_dir()``, created 0700).

    Raises:
        LeaseDirError: that folder is not this user's alone, or cannot be created.
    """
    folder = private_lease_dir(folder)
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", run) or "run"
    return os.path.join(folder, f"{safe}.{os.getpid()}.json")


def write_lease(path: str, run: str, janitor_pid: int, socket_dir: str, run_dir: str) -> None:
    """Write this process's (the agent's) lease of ``run`` at ``path`` (``lease_path``).

    Raises:
        OSError: it cannot be written.
    """
    pid = os.getpid()
    lease = Lease(
        run=run,
        agent_pid=pid,
        agent_start=start_time(pid),
        janitor_pid=janitor_pid,
        janitor_start=start_time(janitor_pid),
        socket_dir=socket_dir,
        run_dir=run_dir,
        pid_ns=pid_namespace(),
    )
    data = json.dumps({k: v for k, v in asdict(lease).items() if k != "path"}).encode()
    write_atomic(path, data)  # its temporary name starts with ".", which read_leases skips


def read_leases(folder: str = "") -> list[Lease]:
    """The leases in ``folder`` (default ``lease_dir()``, created 0700 when missing); a file
    that is unreadable, or not this user's, is skipped.

    Raises:
        LeaseDirError: the folder is not this user's alone, or cannot be created: no lease in
            it can be trusted.
    """
    folder = private_lease_dir(folder)
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        raise LeaseDirError(f"cannot read the lease folder {folder}: {exc}") from exc
    leases = []
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                    continue
                fields = json.loads(f.read())
            leases.append(Lease(**fields, path=path))
        except (OSError, ValueError, TypeError):
            continue
    return leases
