"""The janitor: removes what a run leaves on the machine, however the node agent ends.

A run leaves three kinds of things outside its run directory's records: shared-memory segments
in ``/dev/shm`` (named ``asyncrl.<run>.<pid>.<incarnation>.<seq>``, see
``asyncrl.transport.shm``), ipc socket files in its socket directory, and processes. The agent
stops its processes and sweeps the rest itself when the run ends normally or by error
(``sweep_run``). A SIGKILLed agent cannot: its children die by their parent-death signal, but
nothing would unlink their segments and sockets, and their own children (an inference engine's
workers) would outlive them.

So the agent starts this janitor first (``Janitor.start``): a small process of its own session
that imports nothing but the standard library, and reads a pipe from the agent. The agent writes
the pid of each process it starts (``watch``), and ``end`` once it has swept after a normal end.
When the pipe closes without ``end`` (the agent died, however), the janitor kills the process
group of every pid it was told of, waits for the owners of the run's segments to die, sweeps,
and exits. It logs to ``<run_dir>/logs/janitor.log``. Being of its own session, it outlives a
signal to the agent's process group (a Ctrl-C, ``kill -- -PGID``).

A kill of the whole cgroup (a container stopped, ``systemctl kill``) takes the janitor with the
agent. For that, the agent holds a lease while it runs (``asyncrl.supervision.leases``), and the
next ``asyncrl run`` or ``asyncrl clean`` calls ``sweep_dead_runs``: it removes the segments and
sockets of every run whose lease says its agent and janitor are both gone, and keeps those of
live runs. Without a lease folder it can trust, it sweeps nothing.

Run as ``python -m asyncrl.supervision.janitor --fd N --run NAME --sockets DIR [--run-dir DIR]
[--lease PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence

from asyncrl.safe_files import open_append
from asyncrl.supervision.leases import (
    SHM_DIR,
    Lease,
    alive,
    lease_dir,
    lease_path,
    read_leases,
    write_lease,
)

__all__ = [
    "SHM_DIR",
    "Janitor",
    "alive",
    "main",
    "run_segments",
    "socket_dirs",
    "sweep_dead_runs",
    "sweep_run",
]

SWEEP_WAIT_S = 10.0
"""How long the janitor waits for the owners of the run's segments to die before it sweeps."""
_POLL_S = 0.02
_END = b"end"

# The same names as asyncrl.transport.shm (a test checks), without importing it: that module
# pulls in numpy, and the janitor lives as long as the run.
_SEGMENT = re.compile(r"^asyncrl\.([A-Za-z0-9_-]+)\.(\d+)\.(\d+)\.(\d+)\Z")


# The same names as asyncrl.supervision.rundir.RUN_MARKER and transport.registry.LocalRegistry's
# socket folders (a test checks), without importing them: they pull in msgspec and the manifest.
_RUN_MARKER = ".asyncrl-run"


def _safe_run(run: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", run) or "run"


def run_segments(run: str, directory: str = SHM_DIR) -> list[tuple[str, int]]:
    """The run's shared-memory segments, as (file name, owner pid)."""
    want = _safe_run(run)
    return [(name, pid) for name, seg_run, pid in _segments(directory) if seg_run == want]


def _segments(directory: str) -> list[tuple[str, str, int]]:
    """Every run's segments in ``directory``, as (file name, run, owner pid)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in sorted(names):
        match = _SEGMENT.match(name)
        if match is not None:
            found.append((name, match.group(1), int(match.group(2))))
    return found


def sweep_run(
    run: str,
    socket_dir: str,
    *,
    run_dir: str = "",
    directory: str = SHM_DIR,
    wait_s: float = 0.0,
) -> list[str]:
    """Unlink the run's shared-memory segments and its socket files; return what went.

    A segment whose owner still runs is kept: it may belong to another run of the same name on
    this machine. ``wait_s`` is how long to wait for such owners to die first (after the agent
    died, its children are dying too). The socket directory is removed as well when it is not
    inside ``run_dir`` (a long run directory puts it under the system temp dir).
    """
    deadline = time.monotonic() + wait_s
    while any(alive(pid) for _, pid in run_segments(run, directory)):
        if time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    removed: list[str] = []
    for name, pid in run_segments(run, directory):
        if pid == os.getpid() or alive(pid):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
            removed.append(name)
    return removed + _sweep_socket_dir(socket_dir, run_dir)


def _sweep_socket_dir(socket_dir: str, run_dir: str) -> list[str]:
    """Unlink the socket files in ``socket_dir``; remove it too when it is not inside
    ``run_dir`` (a long run directory puts it under the system temp dir) and is empty."""
    removed = _sweep_sockets(socket_dir)
    inside = run_dir and os.path.abspath(socket_dir).startswith(os.path.abspath(run_dir) + os.sep)
    if not inside:
        with contextlib.suppress(OSError):
            os.rmdir(socket_dir)  # only when empty
    return removed


def sweep_dead_runs(*, directory: str = SHM_DIR, leases: str = "") -> list[str]:
    """Remove what runs whose agent and janitor are both gone left behind; return what went.

    Such a run is known by its lease (in ``leases``, default
    ``asyncrl.supervision.leases.lease_dir()``): its socket files go (unless a live run uses the
    same socket directory), then the lease. A segment in ``directory`` goes when a dead run's lease
    names its run, no live run has that name, it is this user's, and its owner process is dead. A
    run without a lease (its agent could not write one) is left alone: it may be alive.

    Raises:
        asyncrl.supervision.leases.LeaseDirError: the lease folder is not this user's alone, or
            cannot be made; nothing was removed.
    """
    live: list[Lease] = []
    dead: list[Lease] = []
    for lease in read_leases(leases):
        (live if lease.alive() else dead).append(lease)
    live_runs = {_safe_run(lease.run) for lease in live}
    dead_runs = {_safe_run(lease.run) for lease in dead} - live_runs
    live_sockets = {os.path.abspath(lease.socket_dir) for lease in live}
    removed: list[str] = []
    for lease in dead:
        if os.path.abspath(lease.socket_dir) not in live_sockets and _sockets_of_a_run(lease):
            removed += _sweep_socket_dir(lease.socket_dir, lease.run_dir)
    for name, run, pid in _segments(directory):
        if run not in dead_runs or pid == os.getpid() or alive(pid):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                os.unlink(path)
                removed.append(path)
    for lease in dead:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lease.path)
    return removed


def socket_dirs(run_dir: str) -> list[str]:
    """Where a run in ``run_dir`` keeps its sockets: ``RUN_DIR/sockets``, or (a run directory
    too long for an ipc path) ``asyncrl-<hash of RUN_DIR>`` in the system temp dir, as
    ``transport.registry.LocalRegistry`` chooses."""
    run_dir = os.path.abspath(run_dir)
    digest = hashlib.sha1(run_dir.encode()).hexdigest()[:12]
    return [
        os.path.join(run_dir, "sockets"),
        os.path.join(tempfile.gettempdir(), f"asyncrl-{digest}"),
    ]


def _sockets_of_a_run(lease: Lease) -> bool:
    """Whether the lease's socket folder is one a run keeps (``socket_dirs`` of its run
    directory, a folder of this user's, not a link) under a run directory of this user's that
    carries the run marker: a lease, even a forged one, may only name the user's own run and
    socket folders."""
    socket_dir = os.path.abspath(lease.socket_dir)
    if socket_dir not in socket_dirs(lease.run_dir):
        return False
    for path, marker in ((lease.run_dir, True), (socket_dir, False)):
        try:
            st = os.lstat(path)
            if marker and not stat.S_ISREG(os.lstat(os.path.join(path, _RUN_MARKER)).st_mode):
                return False
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return False
    return True


def _sweep_sockets(socket_dir: str) -> list[str]:
    removed: list[str] = []
    try:
        names = sorted(os.listdir(socket_dir))
    except OSError:
        return removed
    for name in names:
        path = os.path.join(socket_dir, name)
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
                removed.append(path)
    return removed


class Janitor:
    """The agent's end of the janitor: tell it the processes, and tell it the run ended."""

    def __init__(self, proc: subprocess.Popen[bytes], fd: int, lease: str = "") -> None:
        self.proc = proc
        self._fd: int | None = fd
        self._told: set[int] = set()
        self.lease = lease
        """The agent's lease (``asyncrl.supervision.leases``), removed by ``finish``; "" when
        none."""

    @classmethod
    def start(cls, run: str, socket_dir: str, run_dir: str) -> Janitor:
        """Start the janitor of ``run``, and take this agent's lease; it logs to
        ``<run_dir>/logs/janitor.log``. A lease that cannot be written costs only the sweep
        after a kill of both (``sweep_dead_runs``); a warning on stderr says so.

        Raises ``OSError`` when the janitor cannot be started.
        """
        lease = ""
        try:
            lease = lease_path(run)
        except OSError as exc:
            _no_lease(run, exc)
        read_fd, write_fd = os.pipe()  # neither end is inherited by anything else the agent starts
        try:
            os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
            with open_append(os.path.join(run_dir, "logs", "janitor.log")) as log:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "asyncrl.supervision.janitor",
                        "--fd",
                        str(read_fd),
                        "--run",
                        run,
                        "--sockets",
                        socket_dir,
                        "--run-dir",
                        run_dir,
                        "--lease",
                        lease,
                    ],
                    pass_fds=(read_fd,),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    # Its own session: a Ctrl-C or a signal to the agent's group does not reach it.
                    start_new_session=True,
                )
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        if lease:
            try:
                write_lease(lease, run, proc.pid, socket_dir, run_dir)
            except OSError as exc:
                _no_lease(run, exc)
                lease = ""
        return cls(proc, write_fd, lease)

    def watch(self, pids: Iterable[int]) -> None:
        """Tell the janitor about processes to kill (with their groups) if the agent dies."""
        new = [pid for pid in pids if pid not in self._told]
        if not new or self._fd is None:
            return
        self._told.update(new)
        with contextlib.suppress(OSError):  # a janitor that died cannot be told
            os.write(self._fd, b"".join(b"pid %d\n" % pid for pid in new))

    def finish(self, timeout: float = SWEEP_WAIT_S) -> None:
        """The run ended and the agent swept: let the janitor go, and reap it."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.write(self._fd, _END + b"\n")
            os.close(self._fd)
            self._fd = None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.lease:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.lease)


def _no_lease(run: str, exc: OSError) -> None:
    print(
        f"asyncrl: warning: run {run!r} holds no lease ({exc}); if its agent and janitor are "
        f"killed together, 'asyncrl clean' will not find its shared memory and sockets "
        f"(lease folder: {lease_dir()})",
        file=sys.stderr,
        flush=True,
    )


def _read_until_eof(fd: int) -> tuple[list[int], bool]:
    """Read the agent's lines until the pipe closes; return the pids, and whether it ended."""
    data = bytearray()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except InterruptedError:
            continue
        if not chunk:
            break
        data += chunk
    pids, ended = [], False
    for line in bytes(data).splitlines():
        word, _, value = line.partition(b" ")
        if word == b"pid" and value.isdigit():
            pids.append(int(value))
        elif line == _END:
            ended = True
    return pids, ended


def _kill_groups(pids: Sequence[int]) -> None:
    # Each process the supervisor starts leads its own process group, and the kernel does not
    # hand out a pid that still names a group: the group of a leader already reaped is still
    # ours while any member lives. Only a pid freed and reused in the moments since the agent
    # died could name someone else's group.
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> int:
    """Wait for the agent's pipe to close; after an abnormal end, kill and sweep."""
    parser = argparse.ArgumentParser(prog="python -m asyncrl.supervision.janitor")
    parser.add_argument("--fd", type=int, required=True, help="the read end of the agent's pipe")
    parser.add_argument("--run", required=True, help="the run's name")
    parser.add_argument("--sockets", required=True, help="the run's socket directory")
    parser.add_argument("--run-dir", default="", help="the run directory")
    parser.add_argument("--lease", default="", help="the agent's lease, removed after the sweep")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pids, ended = _read_until_eof(args.fd)
    if ended:
        return 0
    print(f"the agent of run {args.run!r} ended without a sweep; cleaning up", flush=True)
    _kill_groups(pids)
    removed = sweep_run(args.run, args.sockets, run_dir=args.run_dir, wait_s=SWEEP_WAIT_S)
    print(f"removed {len(removed)}: {' '.join(removed)}", flush=True)
    if args.lease:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(args.lease)
    return 0


if __name__ == "__main__":
    sys.exit(main())
