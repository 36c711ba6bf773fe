"""``sweep_dead_runs``: what runs whose agent and janitor are gone left behind goes; what a live
run holds stays (fake segment and lease folders, real processes for alive and dead pids)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.janitor import sweep_dead_runs
from asyncrl.leases import Lease, lease_path, read_leases, start_time, write_lease


@pytest.fixture
def live() -> Iterator[int]:
    """The pid of a process that runs for the whole test."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture
def dead() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def bound_socket(path: Path) -> Path:
    """A socket file left at ``path`` by a process that is gone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
    return path


def lease(folder: Path, run: str, agent: int, janitor: int, run_dir: Path) -> Lease:
    """A lease as an agent of pid ``agent`` writes it."""
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"{run}.{agent}.json"
    found = Lease(
        run=run,
        agent_pid=agent,
        agent_start=start_time(agent),
        janitor_pid=janitor,
        janitor_start=start_time(janitor),
        socket_dir=str(run_dir / "sockets"),
        run_dir=str(run_dir),
        path=str(path),
    )
    fields = {k: v for k, v in found.__dict__.items() if k != "path"}
    path.write_text(json.dumps(fields))
    return found


def test_a_dead_runs_leftovers_go_and_a_live_runs_stay(
    tmp_path: Path, live: int, dead: int
) -> None:
    shm, leases = tmp_path / "shm", tmp_path / "leases"
    gone_dir, live_dir = tmp_path / "gone", tmp_path / "live"
    gone = lease(leases, "gone", dead, dead, gone_dir)
    lease(leases, "busy", live, dead, live_dir)  # the agent still runs
    gone_socket = bound_socket(gone_dir / "sockets" / "learner.0")
    live_socket = bound_socket(live_dir / "sockets" / "learner.0")
    not_a_socket = touch(gone_dir / "sockets" / "notes.txt")
    swept = [
        touch(shm / f"asyncrl.gone.{dead}.0.0"),  # a dead run's, owner dead
        touch(shm / f"asyncrl.old.{dead}.1.3"),  # a run without a lease (an earlier version)
    ]
    kept = [
        touch(shm / f"asyncrl.gone.{live}.0.1"),  # its owner still runs
        touch(shm / f"asyncrl.busy.{dead}.0.0"),  # a live run's, though its owner died
        touch(shm / f"asyncrl.busy.{live}.0.0"),
        touch(shm / "other.file"),
    ]
    removed = sweep_dead_runs(directory=str(shm), leases=str(leases))
    assert sorted(removed) == sorted([str(gone_socket), *map(str, swept)])
    assert [p for p in swept if p.exists()] == []
    assert [p.name for p in kept if not p.exists()] == []
    assert live_socket.exists() and not_a_socket.exists()
    assert [found.run for found in read_leases(str(leases))] == ["busy"]
    assert not os.path.exists(gone.path)


def test_a_lease_of_a_reused_pid_is_a_dead_run(tmp_path: Path, live: int, dead: int) -> None:
    """A pid given to another process since is not the agent that held the lease."""
    leases = tmp_path / "leases"
    found = lease(leases, "gone", live, dead, tmp_path / "run")
    assert found.alive()
    reused = Lease(**{**found.__dict__, "agent_start": found.agent_start + 1})
    assert not reused.alive()


def test_the_agent_writes_its_lease_and_trusts_only_a_private_folder(tmp_path: Path) -> None:
    folder = tmp_path / "leases"
    path = lease_path("my run", str(folder))
    assert path == str(folder / f"my_run.{os.getpid()}.json")
    assert os.stat(folder).st_mode & 0o777 == 0o700
    write_lease(path, "my run", os.getpid(), "/s", "/r")
    (found,) = read_leases(str(folder))
    assert (found.run, found.agent_pid, found.socket_dir, found.run_dir) == (
        "my run",
        os.getpid(),
        "/s",
        "/r",
    )
    assert found.alive() and os.listdir(folder) == [os.path.basename(path)]
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    assert lease_path("my run", str(shared)) == ""  # another user could have planted leases
    os.symlink(folder, tmp_path / "link")
    assert lease_path("my run", str(tmp_path / "link")) == ""
