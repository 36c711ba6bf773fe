"""``sweep_dead_runs``: what runs whose agent and janitor are gone left behind goes; what a live
run holds stays (fake segment and lease folders, real processes for alive and dead pids)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl import cli
from asyncrl.supervision.janitor import socket_dirs, sweep_dead_runs
from asyncrl.supervision.leases import (
    LEASE_DIR_ENV,
    Lease,
    LeaseDirError,
    lease_dir,
    lease_path,
    read_leases,
    start_time,
    write_lease,
)
from asyncrl.supervision.rundir import RUN_MARKER
from transport.registry import LocalRegistry


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
    """A lease as an agent of pid ``agent`` writes it, of a run directory marked as a run's."""
    folder.mkdir(mode=0o700, exist_ok=True)
    touch(run_dir / RUN_MARKER)
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
    ]
    kept = [
        # a run without a visible lease: it may be alive (a lease it could not write)
        touch(shm / f"asyncrl.old.{dead}.1.3"),
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
    assert lease_path("my run", str(shared)) == str(shared / f"my_run.{os.getpid()}.json")
    assert os.stat(shared).st_mode & 0o777 == 0o700  # this user's: made private
    os.symlink(folder, tmp_path / "link")
    with pytest.raises(LeaseDirError) as refused:
        lease_path("my run", str(tmp_path / "link"))
    assert str(refused.value) == (
        f"the lease folder {tmp_path / 'link'} is a link, not a folder of this user's (uid "
        f"{os.getuid()}): no lease in it can be trusted, so what a killed run of this user "
        f"leaves (shared memory, sockets) is never swept while it is there. To fix it, remove "
        f"it (rm {tmp_path / 'link'}), or set {LEASE_DIR_ENV} to a private folder of yours "
        "(such as ~/.cache/asyncrl/leases) for every run and 'asyncrl clean'"
    )


OTHER_UID = 54321


@pytest.mark.skipif(os.getuid() != 0, reason="making a file another user's takes root")
def test_a_lease_folder_or_file_of_another_user_is_never_trusted(
    tmp_path: Path, dead: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another user who makes the lease folder first hides no run from the sweep: nothing is
    swept, and ``asyncrl clean`` says why; a lease file of another user's is skipped."""
    shm, leases = tmp_path / "shm", tmp_path / "leases"
    lease(leases, "gone", dead, dead, tmp_path / "gone")
    planted = lease(leases, "planted", dead, dead, tmp_path / "planted")
    os.chown(planted.path, OTHER_UID, OTHER_UID)
    segment = touch(shm / f"asyncrl.planted.{dead}.0.0")
    assert [found.run for found in read_leases(str(leases))] == ["gone"]
    assert sweep_dead_runs(directory=str(shm), leases=str(leases)) == []
    assert segment.exists() and os.path.exists(planted.path)

    os.chown(leases, OTHER_UID, OTHER_UID)
    live_segment = touch(shm / f"asyncrl.live.{dead}.0.0")
    with pytest.raises(LeaseDirError, match=f"owned by uid {OTHER_UID}, not a folder"):
        sweep_dead_runs(directory=str(shm), leases=str(leases))
    assert live_segment.exists()
    monkeypatch.setenv(LEASE_DIR_ENV, str(leases))
    assert cli.main(["clean"]) == 1
    assert capsys.readouterr().err == (
        f"asyncrl: warning: not sweeping what killed runs left behind: the lease folder "
        f"{leases} is owned by uid {OTHER_UID}, not a folder of this user's (uid 0): no lease "
        f"in it can be trusted, so what a killed run of this user leaves (shared memory, "
        f"sockets) is never swept while it is there. To fix it, have its owner (uid "
        f"{OTHER_UID}) or root remove it (rm -r {leases}), or set {LEASE_DIR_ENV} to a private "
        "folder of yours (such as ~/.cache/asyncrl/leases) for every run and 'asyncrl clean'\n"
    )


def test_clean_trusts_no_lease_that_names_a_folder_other_than_a_runs_sockets(
    tmp_path: Path, dead: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forged lease naming a foreign socket folder (an ssh agent's) made ``asyncrl clean``
    delete its socket and the folder: a lease may only name the ``sockets`` of a marked run
    directory of this user's, or that run's socket folder in the temp dir."""
    leases = tmp_path / "leases"
    foreign = bound_socket(tmp_path / "ssh-agent" / "agent.1")
    unmarked = bound_socket(tmp_path / "unmarked" / "sockets" / "x.0")
    forged = {
        "foreign": (tmp_path / "ssh-agent", tmp_path / "run"),  # not a run's socket folder
        "unmarked": (tmp_path / "unmarked" / "sockets", tmp_path / "unmarked"),  # no marker
    }
    for run, (sockets, run_dir) in forged.items():
        found = lease(leases, run, dead, dead, run_dir)
        fields = {k: v for k, v in found.__dict__.items() if k != "path"}
        Path(found.path).write_text(json.dumps({**fields, "socket_dir": str(sockets)}))
    os.unlink(tmp_path / "unmarked" / RUN_MARKER)
    monkeypatch.setenv(LEASE_DIR_ENV, str(leases))
    assert cli.main(["clean"]) == 0
    assert foreign.exists() and unmarked.exists()
    assert os.listdir(leases) == []  # the dead leases themselves go
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the registry makes its folder
    run_dir = tmp_path / "a" / ("long" * 30)
    assert socket_dirs(str(run_dir))[1] == LocalRegistry(str(run_dir)).socket_dir


def test_leases_live_beside_the_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run that shares ``/dev/shm`` sees every other's lease, whatever its temp dir."""
    monkeypatch.delenv(LEASE_DIR_ENV, raising=False)
    monkeypatch.setenv("TMPDIR", "/nonexistent-a")
    first = lease_dir()
    monkeypatch.setenv("TMPDIR", "/nonexistent-b")
    assert lease_dir() == first == f"/dev/shm/asyncrl-runs-{os.getuid()}"


def test_a_lease_of_another_pid_namespace_is_taken_as_alive(tmp_path: Path, dead: int) -> None:
    """A container that shares ``/dev/shm`` has pids that mean nothing here."""
    found = lease(tmp_path / "leases", "gone", dead, dead, tmp_path / "run")
    assert not found.alive()
    assert Lease(**{**found.__dict__, "pid_ns": "pid:[1]"}).alive()


def test_an_agent_that_cannot_write_its_lease_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncrl.supervision.janitor import Janitor

    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "leases")  # planted before the run
    monkeypatch.setenv(LEASE_DIR_ENV, str(tmp_path / "leases"))
    janitor = Janitor.start("my run", str(tmp_path / "sockets"), str(tmp_path / "run"))
    janitor.finish()
    assert janitor.lease == "" and os.listdir(tmp_path / "elsewhere") == []
    assert capsys.readouterr().err == (
        f"asyncrl: warning: run 'my run' holds no lease (the lease folder {tmp_path}/leases is "
        f"a link, not a folder of this user's (uid {os.getuid()}): no lease in it can be "
        f"trusted, so what a killed run of this user leaves (shared memory, sockets) is never "
        f"swept while it is there. To fix it, remove it (rm {tmp_path}/leases), or set "
        f"{LEASE_DIR_ENV} to a private folder of yours (such as ~/.cache/asyncrl/leases) for "
        "every run and 'asyncrl clean'); if its agent and janitor are killed together, "
        f"'asyncrl clean' will not find its shared memory and sockets (lease folder: "
        f"{tmp_path}/leases)\n"
    )
