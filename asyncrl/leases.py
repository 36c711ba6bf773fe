"""Which runs are alive on this machine: one small lease file per running node agent.

A run leaves things outside its run directory's records (shared-memory segments, ipc socket
files). Its janitor removes them when the agent dies, but a cgroup kill takes the janitor too.
So every agent holds a lease while it runs, written when it starts its janitor and removed once
the run is swept: a JSON file in ``lease_dir()`` (private to this user) naming the run, the
agent's and the janitor's pids with their start times, and the run's socket and run
directories. A lease whose agent and janitor are both gone is a run that left its leftovers
behind; ``asyncrl.janitor.sweep_dead_runs`` removes them.

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

__all__ = [
    "Lease",
    "alive",
    "lease_dir",
    "lease_path",
    "read_leases",
    "start_time",
    "write_lease",
]

LEASE_DIR_ENV = "ASYNCRL_LEASE_DIR"
"""Overrides where leases live (tests; machines whose temp dir is not shared by all runs)."""


def lease_dir() -> str:
    """The folder of this user's leases: ``$ASYNCRL_LEASE_DIR``, or ``asyncrl-runs-<uid>`` in
    the system temp dir."""
    default = os.path.join(tempfile.gettempdir(), f"asyncrl-runs-{os.getuid()}")
    return os.environ.get(LEASE_DIR_ENV) or default


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
        path: the lease file (not stored in it).
    """

    run: str
    agent_pid: int
    agent_start: int
    janitor_pid: int
    janitor_start: int
    socket_dir: str
    run_dir: str
    path: str = ""

    def alive(self) -> bool:
        """Whether the agent or its janitor still runs (a janitor at work cleans up itself)."""
        return any(
            alive(pid) and (not since or start_time(pid) == since)
            for pid, since in (
                (self.agent_pid, self.agent_start),
                (self.janitor_pid, self.janitor_start),
            )
        )


def _private_dir(folder: str) -> bool:
    """Create ``folder`` 0700; whether it is a folder of this user's (not a planted link)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    st = os.lstat(folder)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def lease_path(run: str, folder: str = "") -> str:
    """Where this process (the agent) keeps the lease of ``run``: in ``folder`` (default
    ``lease_dir()``, created 0700); "" when that is not a private folder of this user, where a
    lease would not be safe to trust.

    Raises:
        OSError: the folder cannot be created.
    """
    folder = folder or lease_dir()
    if not _private_dir(folder):
        return ""
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
    )
    folder = os.path.dirname(path)
    data = json.dumps({k: v for k, v in asdict(lease).items() if k != "path"}).encode()
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".lease.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_leases(folder: str = "") -> list[Lease]:
    """The leases in ``folder`` (default ``lease_dir()``); unreadable ones are skipped."""
    folder = folder or lease_dir()
    try:
        st = os.lstat(folder)
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return []
    leases = []
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                fields = json.loads(f.read())
            leases.append(Lease(**fields, path=path))
        except (OSError, ValueError, TypeError):
            continue
    return leases
