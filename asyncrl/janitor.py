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
and exits. It logs to ``<run_dir>/logs/janitor.log``.

Run as ``python -m asyncrl.janitor --fd N --run NAME --sockets DIR [--run-dir DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence

__all__ = ["SHM_DIR", "Janitor", "main", "run_segments", "sweep_run"]

SHM_DIR = "/dev/shm"
SWEEP_WAIT_S = 10.0
"""How long the janitor waits for the owners of the run's segments to die before it sweeps."""
_POLL_S = 0.02
_END = b"end"

# The same names as asyncrl.transport.shm (a test checks), without importing it: that module
# pulls in numpy, and the janitor lives as long as the run.
_SEGMENT = re.compile(r"^asyncrl\.([A-Za-z0-9_-]+)\.(\d+)\.(\d+)\.(\d+)\Z")


def _safe_run(run: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", run) or "run"


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


def run_segments(run: str, directory: str = SHM_DIR) -> list[tuple[str, int]]:
    """The run's shared-memory segments, as (file name, owner pid)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    want = _safe_run(run)
    found = []
    for name in sorted(names):
        match = _SEGMENT.match(name)
        if match is not None and match.group(1) == want:
            found.append((name, int(match.group(2))))
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
    removed += _sweep_sockets(socket_dir)
    inside = run_dir and os.path.abspath(socket_dir).startswith(os.path.abspath(run_dir) + os.sep)
    if not inside:
        with contextlib.suppress(OSError):
            os.rmdir(socket_dir)  # only when empty
    return removed


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

    def __init__(self, proc: subprocess.Popen[bytes], fd: int) -> None:
        self.proc = proc
        self._fd: int | None = fd
        self._told: set[int] = set()

    @classmethod
    def start(cls, run: str, socket_dir: str, run_dir: str) -> Janitor:
        """Start the janitor of ``run``; it logs to ``<run_dir>/logs/janitor.log``.

        Raises ``OSError`` when it cannot be started.
        """
        read_fd, write_fd = os.pipe()  # neither end is inherited by anything else the agent starts
        try:
            os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
            with open(os.path.join(run_dir, "logs", "janitor.log"), "ab") as log:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "asyncrl.janitor",
                        "--fd",
                        str(read_fd),
                        "--run",
                        run,
                        "--sockets",
                        socket_dir,
                        "--run-dir",
                        run_dir,
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
        return cls(proc, write_fd)

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
    parser = argparse.ArgumentParser(prog="python -m asyncrl.janitor")
    parser.add_argument("--fd", type=int, required=True, help="the read end of the agent's pipe")
    parser.add_argument("--run", required=True, help="the run's name")
    parser.add_argument("--sockets", required=True, help="the run's socket directory")
    parser.add_argument("--run-dir", default="", help="the run directory")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pids, ended = _read_until_eof(args.fd)
    if ended:
        return 0
    print(f"the agent of run {args.run!r} ended without a sweep; cleaning up", flush=True)
    _kill_groups(pids)
    removed = sweep_run(args.run, args.sockets, run_dir=args.run_dir, wait_s=SWEEP_WAIT_S)
    print(f"removed {len(removed)}: {' '.join(removed)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
