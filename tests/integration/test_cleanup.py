"""Nothing is left behind after a run, whatever way it ends.

Each test runs ``asyncrl run`` on a tiny manifest: a ``publisher`` role that holds a shared-memory
segment (a ``WeightStore``, as the learner does) and a program that waits until it is up, writes
its pids to a file, prints ``READY`` and then returns, raises, or waits to be killed. After the run
no segment of the run is in /dev/shm, no socket file is in its socket directory, and no process of
the run lives.

This module is also the manifest's code: the role and the program below.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from asyncrl.role import Delivery, Role, endpoint
from asyncrl.supervision import janitor
from asyncrl.supervision.leases import read_leases
from tests.conftest import ROOT

TIMEOUT_S = 60.0  # the bound on each wait; every one ends on an event well before it
READY_FILE = "ready.pids"  # where the program writes the publisher's and the driver's pids

MANIFEST = """\
run:
  name: {run}
  program: tests.integration.test_cleanup:program
  config: {{end: {end}}}
roles:
  publisher:
    class: tests.integration.test_cleanup:Publisher
    supervision: {{max_restarts: 0, heartbeat_interval_s: 0.2}}
driver:
  supervision: {{max_restarts: 0}}
"""


class Publisher(Role):
    """Holds a shared-memory segment from setup until it stops."""

    async def setup(self) -> None:
        import torch

        from asyncrl.weights import WeightStore

        self.store = WeightStore(
            {"w": torch.zeros(256)}, run=self.ctx.run, incarnation=self.ctx.incarnation
        )

    @endpoint(Delivery.IDEMPOTENT)
    async def pid(self, payload: int) -> int:
        return os.getpid()

    async def teardown(self) -> None:
        self.store.close()


async def program(ctx: Any) -> str:
    """Wait for the publisher, say READY, then end as ``run.config.end`` says."""
    pid = await ctx.roles["publisher"].call("pid", 0)
    # the pids go in a file: the run's stdout is shared with other processes' log lines
    path = os.path.join(ctx.run_dir, READY_FILE)
    with open(path + ".tmp", "w") as f:
        f.write(f"{pid} {os.getpid()}")
    os.replace(path + ".tmp", path)
    print("READY", flush=True)
    end = ctx.config["end"]
    if end == "error":
        raise RuntimeError("the program fails on purpose")
    if end == "wait":
        await asyncio.Event().wait()
    return "done"


class Run:
    """One ``asyncrl run`` of the manifest above, in its own run directory."""

    def __init__(self, run_dir: str, end: str) -> None:
        self.run_dir = run_dir
        self.name = os.path.basename(run_dir)
        path = os.path.join(run_dir, "manifest.yaml")
        with open(path, "w") as f:
            f.write(MANIFEST.format(run=self.name, end=end))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "asyncrl.cli",
                "run",
                path,
                "--run-dir",
                run_dir,
                "--allow-nonempty",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.output = b""

    def ready(self) -> tuple[int, int]:
        """Wait for the program's READY line; return the publisher's and the driver's pids."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + TIMEOUT_S
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"READY" not in self.output:
                left = deadline - time.monotonic()
                assert left > 0 and sel.select(left), f"no READY in time: {self.output!r}"
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                assert chunk, f"the run ended before READY: {self.output.decode()}"
                self.output += chunk
        with open(os.path.join(self.run_dir, READY_FILE)) as f:
            publisher, driver = map(int, f.read().split())
        return publisher, driver

    def wait(self) -> int:
        """Wait for ``asyncrl run`` to exit; return its exit status."""
        rest, _ = self.proc.communicate(timeout=TIMEOUT_S)
        self.output += rest
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()

    # -- what may be left behind ----------------------------------------------------------

    def segments(self) -> list[str]:
        return [name for name, _ in janitor.run_segments(self.name)]

    def sockets(self) -> list[str]:
        folder = os.path.join(self.run_dir, "sockets")
        return sorted(os.listdir(folder)) if os.path.isdir(folder) else []

    def processes(self) -> list[int]:
        """Live processes started for this run: their command line or environment names it."""
        mark = self.run_dir.encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    text = f.read()
                with open(f"/proc/{entry}/environ", "rb") as f:
                    text += f.read()
            except OSError:
                continue  # gone, or not ours
            if mark in text and janitor.alive(int(entry)):
                found.append(int(entry))
        return found

    def leftovers(self) -> dict[str, list[Any]]:
        found = {
            "segments": self.segments(),
            "sockets": self.sockets(),
            "processes": self.processes(),
        }
        return {kind: items for kind, items in found.items() if items}


@pytest.fixture
def make_run(run_dir: str) -> Iterator[Callable[[str], Run]]:
    runs: list[Run] = []

    def make(end: str) -> Run:
        runs.append(Run(run_dir, end))
        return runs[-1]

    yield make
    for run in runs:
        run.close()
        for name in run.segments():  # never leave a failed test's segments to the next one
            os.unlink(os.path.join(janitor.SHM_DIR, name))


def eventually_clean(run: Run) -> None:
    """Wait until nothing of the run is left (the janitor works after the agent is gone)."""
    deadline = time.monotonic() + TIMEOUT_S
    while run.leftovers():
        assert time.monotonic() < deadline, f"left behind: {run.leftovers()}"
        time.sleep(0.05)


pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("end", "status"), [("normal", 0), ("error", 1)])
def test_a_run_that_ends_leaves_nothing_behind(
    make_run: Callable[[str], Run], end: str, status: int
) -> None:
    run = make_run(end)
    run.ready()
    assert run.segments(), "the publisher holds a segment while the run lives"
    assert run.wait() == status, run.output.decode()
    # The agent swept before it exited: nothing to wait for.
    assert run.leftovers() == {}
    with open(os.path.join(run.run_dir, "logs", "janitor.log")) as f:
        assert f.read() == ""  # the agent told its janitor the run ended cleanly


@pytest.mark.parametrize("victim", ["agent", "publisher", "driver"])
def test_a_run_killed_with_sigkill_leaves_nothing_behind(
    make_run: Callable[[str], Run], victim: str
) -> None:
    run = make_run("wait")
    publisher, driver = run.ready()
    assert run.segments(), "the publisher holds a segment while the run lives"
    assert run.sockets(), "the roles' sockets are bound while the run lives"
    assert {publisher, driver, run.proc.pid} <= set(run.processes())
    pid = {"agent": run.proc.pid, "publisher": publisher, "driver": driver}[victim]
    os.kill(pid, signal.SIGKILL)
    status = run.wait()
    assert status == (-signal.SIGKILL if victim == "agent" else 1), run.output.decode()
    eventually_clean(run)
    if victim == "agent":
        with open(os.path.join(run.run_dir, "logs", "janitor.log")) as f:
            log = f.read()
        assert log.startswith(
            f"the agent of run {run.name!r} ended without a sweep; cleaning up\nremoved "
        )


def test_the_janitor_knows_the_segment_names_of_the_transport(run_dir: str) -> None:
    from asyncrl.transport.shm import _NAME_RE, segment_name

    name = segment_name("a.b c", 12, 3, 4)
    assert janitor._SEGMENT.pattern == _NAME_RE.pattern
    path = os.path.join(run_dir, name)
    with open(path, "wb"):
        pass
    assert janitor.run_segments("a.b c", run_dir) == [(name, 12)]
    assert janitor.run_segments("other", run_dir) == []


# -- the agent and its janitor killed together (a cgroup kill) ------------------------------


def kill_agent_and_janitor(run: Run) -> None:
    """SIGKILL the agent and its janitor at once, as a kill of their cgroup does, and wait
    until every process of the run is gone: its segment and sockets stay behind."""
    run.ready()
    (lease,) = [lease for lease in read_leases() if lease.run_dir == run.run_dir]
    agent, janitor_pid = lease.agent_pid, lease.janitor_pid
    assert agent == run.proc.pid
    # The janitor is of its own session and process group: a signal to the agent's group
    # (a Ctrl-C, kill -- -PGID) does not reach it.
    assert os.getsid(janitor_pid) != os.getsid(agent)
    assert os.getpgid(janitor_pid) != os.getpgid(agent)
    os.kill(agent, signal.SIGKILL)
    os.kill(janitor_pid, signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL
    deadline = time.monotonic() + TIMEOUT_S
    while run.processes() or janitor.alive(janitor_pid):
        assert time.monotonic() < deadline, f"still running: {run.processes()}"
        time.sleep(0.05)
    assert run.segments() and run.sockets(), "nothing was left to sweep"
    assert os.path.exists(lease.path)


def test_asyncrl_clean_sweeps_a_run_whose_agent_and_janitor_were_killed(
    make_run: Callable[[str], Run],
) -> None:
    run = make_run("wait")
    kill_agent_and_janitor(run)
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "clean"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert out.returncode == 0, out.stderr
    assert "leftovers of runs that are no longer alive" in out.stderr
    assert run.leftovers() == {}
    assert not [lease for lease in read_leases() if lease.run_dir == run.run_dir]


def test_the_next_run_anywhere_sweeps_a_run_whose_agent_and_janitor_were_killed(
    make_run: Callable[[str], Run], tmp_path: Any
) -> None:
    run = make_run("wait")
    kill_agent_and_janitor(run)
    hello = os.path.join(ROOT, "examples", "hello", "manifest.yaml")
    other = str(tmp_path / "other")
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", hello, "--run-dir", other],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert run.leftovers() == {}


def test_a_live_runs_segments_and_sockets_are_never_swept(make_run: Callable[[str], Run]) -> None:
    from asyncrl.supervision.janitor import sweep_dead_runs

    run = make_run("wait")
    run.ready()
    before = (run.segments(), run.sockets())
    assert all(before)
    sweep_dead_runs()
    assert (run.segments(), run.sockets()) == before
