"""Shared memory: the sender's pool, the receiver's reader, sweeping, and processes that die.

The in-process tests keep their segments in a private directory standing in for /dev/shm. The
multi-process ones use /dev/shm itself with the run named after the test's run directory, and
check that nothing of that run is left behind.
"""

from __future__ import annotations

import asyncio
import gc
import glob
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.transport import ChannelOptions, Client, run
from asyncrl.transport.shm import (
    HOST_ID_ENV,
    SHM_DIR,
    ShmPool,
    ShmReader,
    host_id,
    segment_name,
    sweep,
)
from tests.conftest import ServerProcess, start_server_process

MIB = 1 << 20


@pytest.fixture
def shm_dir(tmp_path: Path) -> str:
    return str(tmp_path)


@pytest.fixture
def pool(shm_dir: str) -> Iterator[ShmPool]:
    pool = ShmPool("unit", directory=shm_dir)
    yield pool
    pool.close()


def _files(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


def _size(directory: str, name: str) -> int:
    return os.path.getsize(os.path.join(directory, name))


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _touch(directory: str, name: str) -> None:
    Path(directory, name).write_bytes(b"x")


# -- the pool -----------------------------------------------------------------------------


def test_a_released_slot_is_reused(pool: ShmPool, shm_dir: str) -> None:
    first = pool.acquire(1000, b"peer-a")
    assert first is not None
    assert (first.id, first.nbytes, first.peer) == (1, 1000, b"peer-a")
    assert pool.lent == 1
    assert pool.release(first.id) is True
    assert pool.lent == 0

    second = pool.acquire(5000, b"peer-b")
    assert second is not None
    assert second.segment == first.segment and second.id == 2
    assert np.shares_memory(first.array, second.array)
    assert _files(shm_dir) == [first.segment] == pool.segment_names()
    assert pool.mapped_bytes == MIB

    # Two slots lent at once are two segments.
    third = pool.acquire(10)
    assert third is not None and third.segment != second.segment
    assert len(_files(shm_dir)) == 2


def test_segments_come_in_power_of_two_size_classes(pool: ShmPool, shm_dir: str) -> None:
    sizes = {}
    for nbytes in (1, MIB, MIB + 1, 3 * MIB):
        slot = pool.acquire(nbytes)
        assert slot is not None
        sizes[nbytes] = (slot.segment, _size(shm_dir, slot.segment), slot.array.nbytes)
    assert [size for _, size, _ in sizes.values()] == [MIB, MIB, 2 * MIB, 4 * MIB]
    assert all(size == mapped for _, size, mapped in sizes.values())
    assert pool.mapped_bytes == 8 * MIB

    for slot_id in (1, 2, 3, 4):
        assert pool.release(slot_id)
    # The smallest free segment that fits is lent.
    fit = pool.acquire(MIB + MIB // 2)
    assert fit is not None and fit.segment == sizes[MIB + 1][0]
    small = pool.acquire(100)
    assert small is not None and small.segment in (sizes[1][0], sizes[MIB][0])
    assert len(_files(shm_dir)) == 4  # nothing new was created


def test_past_max_bytes_acquire_returns_none(shm_dir: str) -> None:
    pool = ShmPool("max", max_bytes=2 * MIB, directory=shm_dir)
    try:
        a, b = pool.acquire(MIB), pool.acquire(10)
        assert a is not None and b is not None
        assert pool.acquire(10) is None  # a third segment would pass 2 MiB
        assert pool.acquire(3 * MIB) is None
        assert pool.fallbacks == 2
        assert _files(shm_dir) == sorted([a.segment, b.segment])
        assert pool.release(a.id)
        again = pool.acquire(10)
        assert again is not None and again.segment == a.segment
        assert pool.fallbacks == 2
    finally:
        pool.close()


def test_idle_small_segments_make_room_for_a_larger_one(shm_dir: str) -> None:
    pool = ShmPool("room", max_bytes=4 * MIB, directory=shm_dir)
    try:
        a, b = pool.acquire(10), pool.acquire(10)
        assert a is not None and b is not None
        assert pool.release(a.id) and pool.release(b.id)
        large = pool.acquire(3 * MIB)  # a 4 MiB segment: both idle 1 MiB ones go first
        assert large is not None
        assert _files(shm_dir) == [large.segment] == pool.segment_names()
        assert pool.mapped_bytes == 4 * MIB
    finally:
        pool.close()


def test_release_ignores_unknown_slots_and_other_peers(pool: ShmPool) -> None:
    slot = pool.acquire(10, b"peer-a")
    assert slot is not None
    assert pool.release(999) is False
    assert pool.release(slot.id, b"peer-b") is False  # one receiver cannot free another's
    assert pool.lent == 1
    assert pool.release(slot.id, b"peer-a") is True
    assert pool.release(slot.id) is False  # twice
    assert pool.unknown_releases == 3
    assert pool.lent == 0


def test_release_peer_takes_back_every_slot_of_that_peer(pool: ShmPool, shm_dir: str) -> None:
    slots = [pool.acquire(10, peer) for peer in (b"a", b"a", b"b")]
    assert all(slot is not None for slot in slots)
    assert pool.release_peer(b"a") == 2
    assert pool.lent == 1
    assert pool.release_peer(b"a") == 0
    assert pool.release_peer(b"nobody") == 0
    reused = [pool.acquire(10, b"c"), pool.acquire(10, b"c")]
    assert {s.segment for s in reused if s is not None} == {slots[0].segment, slots[1].segment}
    assert len(_files(shm_dir)) == 3


def test_close_unlinks_everything(shm_dir: str) -> None:
    pool = ShmPool("close", directory=shm_dir)
    lent, idle = pool.acquire(10, b"a"), pool.acquire(2 * MIB, b"a")
    assert lent is not None and idle is not None
    assert pool.release(idle.id)
    lent.array[:3] = [7, 8, 9]
    held = lent.array  # a local view outlives close(): its mapping stays until it goes
    assert len(_files(shm_dir)) == 2

    pool.close()
    assert _files(shm_dir) == []
    assert pool.segment_names() == [] and pool.mapped_bytes == 0
    assert held[:3].tolist() == [7, 8, 9]
    assert pool.acquire(10) is None
    pool.close()  # idempotent


def test_a_pool_dropped_without_close_unlinks_its_segments(shm_dir: str) -> None:
    pool = ShmPool("dropped", directory=shm_dir)
    slot = pool.acquire(10)
    assert slot is not None and _files(shm_dir) == [slot.segment]
    del pool, slot
    gc.collect()
    assert _files(shm_dir) == []


def test_segment_names_carry_run_pid_and_incarnation(shm_dir: str) -> None:
    assert segment_name("r", 12, 3, 4) == "asyncrl.r.12.3.4"
    assert segment_name("my run/1", 12, 3, 4) == "asyncrl.my_run_1.12.3.4"
    assert segment_name("", 1, 0, 1) == "asyncrl.run.1.0.1"

    pool = ShmPool("my run/1", incarnation=7, directory=shm_dir)
    other = ShmPool("my run/1", incarnation=7, directory=shm_dir)
    try:
        names = []
        for p in (pool, other, pool):
            slot = p.acquire(10)
            assert slot is not None
            names.append(slot.segment)
        pattern = re.compile(rf"^asyncrl\.my_run_1\.{os.getpid()}\.7\.(\d+)$")
        assert all(pattern.match(name) for name in names), names
        # Two pools of one run and incarnation in one process never share a name.
        assert len(set(names)) == 3
        assert other.fallbacks == 0
    finally:
        pool.close()
        other.close()


def test_names_are_not_reused_so_a_reader_never_sees_a_closed_pools_bytes(shm_dir: str) -> None:
    reader = ShmReader(shm_dir)
    old = ShmPool("reuse", directory=shm_dir)
    slot = old.acquire(10)
    assert slot is not None
    slot.array[:4] = 1
    view = reader.view(slot.segment, 0, 4)
    assert view.tolist() == [1, 1, 1, 1]
    del view
    old.close()

    new = ShmPool("reuse", directory=shm_dir)
    try:
        fresh = new.acquire(10)
        assert fresh is not None and fresh.segment != slot.segment
        fresh.array[:4] = 2
        assert reader.view(fresh.segment, 0, 4).tolist() == [2, 2, 2, 2]
    finally:
        new.close()
        reader.close()


# -- sweeping -----------------------------------------------------------------------------


def test_sweep_removes_segments_of_dead_processes_only(shm_dir: str) -> None:
    dead, live, me = _dead_pid(), os.getppid(), os.getpid()
    names = {
        "dead": [segment_name("r", dead, 0, 1), segment_name("r", dead, 2, 5)],
        "live": [segment_name("r", live, 0, 1)],
        "me": [segment_name("r", me, 0, 99)],
        "other-run": [segment_name("q", dead, 0, 1)],
        "not-ours": ["something.else", f"asyncrl.r.{dead}.x.1", f"asyncrl.r.{dead}.0"],
    }
    for group in names.values():
        for name in group:
            _touch(shm_dir, name)

    assert sorted(sweep("r", directory=shm_dir)) == sorted(names["dead"])
    assert _files(shm_dir) == sorted(
        names["live"] + names["me"] + names["other-run"] + names["not-ours"]
    )
    assert sweep("r", directory=shm_dir) == []

    # With pid, that process's segments go whether it is alive or not.
    assert sweep("r", pid=live, directory=shm_dir) == names["live"]
    # Without a run, every run.
    assert sweep(directory=shm_dir) == names["other-run"]
    assert _files(shm_dir) == sorted(names["me"] + names["not-ours"])


def test_a_new_pool_sweeps_its_run(shm_dir: str) -> None:
    dead = _dead_pid()
    left = segment_name("swept", dead, 0, 1)
    other = segment_name("kept", dead, 0, 1)
    _touch(shm_dir, left)
    _touch(shm_dir, other)
    pool = ShmPool("swept", directory=shm_dir)
    try:
        assert _files(shm_dir) == [other]
    finally:
        pool.close()


def test_sweep_of_a_missing_directory_is_empty(tmp_path: Path) -> None:
    assert sweep("r", directory=str(tmp_path / "absent")) == []


# -- the reader ---------------------------------------------------------------------------


def test_the_reader_maps_the_senders_bytes_in_place(pool: ShmPool, shm_dir: str) -> None:
    slot = pool.acquire(100)
    assert slot is not None
    slot.array[:3] = [1, 2, 3]
    reader = ShmReader(shm_dir)
    view = reader.view(slot.segment, 0, 3)
    assert view.tolist() == [1, 2, 3]
    view[0] = 42  # writable, and the same memory as the sender's
    assert int(slot.array[0]) == 42
    assert reader.view(slot.segment, MIB - 1, 1).shape == (1,)
    assert reader.view(slot.segment, MIB, 0).shape == (0,)

    # The mapping outlives the sender's close; a new reader finds nothing.
    pool.close()
    assert view.tolist() == [42, 2, 3]
    with pytest.raises(FileNotFoundError):
        ShmReader(shm_dir).view(slot.segment, 0, 3)
    del view
    reader.close()


@pytest.mark.parametrize(
    "name",
    [
        "../etc/passwd",
        "/dev/shm/asyncrl.r.1.0.1",
        "asyncrl.r.1.0.1/../../../etc/passwd",
        "../asyncrl.r.1.0.1",
        "asyncrl.r.1.0",
        "asyncrl..1.0.1",
        "asyncrl.r.-1.0.1",
        "asyncrl.r.1.0.1.2",
        "other.r.1.0.1",
        "",
    ],
)
def test_the_reader_refuses_names_that_are_not_segments(shm_dir: str, name: str) -> None:
    with pytest.raises(ValueError) as err:
        ShmReader(shm_dir).view(name, 0, 1)
    assert str(err.value) == f"{name!r} is not an asyncrl shared-memory segment name"


def test_a_trailing_newline_is_not_a_segment_name(shm_dir: str) -> None:
    name = "asyncrl.r.1.0.1\n"  # '$' alone would match before the newline
    _touch(shm_dir, name)
    with pytest.raises(ValueError) as err:
        ShmReader(shm_dir).view(name, 0, 1)
    assert str(err.value) == f"{name!r} is not an asyncrl shared-memory segment name"
    # Nor does sweep() take such a file for a segment of a dead process.
    assert sweep(directory=shm_dir) == []
    assert _files(shm_dir) == [name]


def test_the_reader_refuses_ranges_outside_the_segment(pool: ShmPool, shm_dir: str) -> None:
    slot = pool.acquire(10)
    assert slot is not None
    reader = ShmReader(shm_dir)
    for offset, nbytes in ((1, MIB), (MIB, 1), (-1, 10), (0, -1), (1 << 62, 1 << 62)):
        with pytest.raises(ValueError) as err:
            reader.view(slot.segment, offset, nbytes)
        assert str(err.value) == (
            f"range [{offset}, {offset + nbytes}) lies outside segment {slot.segment} of "
            f"{MIB} bytes"
        )
    reader.close()


def test_the_reader_reports_a_missing_segment(shm_dir: str) -> None:
    with pytest.raises(FileNotFoundError):
        ShmReader(shm_dir).view("asyncrl.r.1.0.1", 0, 1)


# -- processes that die -------------------------------------------------------------------


def _segments(run_name: str) -> list[str]:
    """Names of /dev/shm segments of ``run_name``."""
    return sorted(
        os.path.basename(path) for path in glob.glob(os.path.join(SHM_DIR, f"asyncrl.{run_name}.*"))
    )


def _pid_of(name: str) -> int:
    return int(name.split(".")[2])


def _mapped_by(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


@pytest.mark.slow
def test_a_killed_receiver_leaves_nothing_once_the_sender_closes(
    server_process: ServerProcess, run_dir: str
) -> None:
    """The client sends by shared memory; the server only maps. SIGKILL it, then close."""
    run_name = os.path.basename(run_dir)
    big = torch.arange(512 * 1024, dtype=torch.float32)  # 2 MiB: over the shm threshold

    async def main() -> None:
        client = Client(server_process.endpoint, options=ChannelOptions(run=run_name))
        await client.connect()
        try:
            # ``sum`` answers with a float: the server sends nothing through shared memory.
            assert await client.call("sum", big) == float(big.double().sum())
            sent = _segments(run_name)
            assert len(sent) == 1 and _pid_of(sent[0]) == os.getpid()
            assert os.path.join(SHM_DIR, sent[0]) in _mapped_by(server_process.pid)

            await asyncio.to_thread(server_process.stop, signal.SIGKILL)
            assert server_process.proc.returncode == -signal.SIGKILL
            assert _segments(run_name) == sent  # a receiver owns nothing to clean up
        finally:
            await client.close()
        assert _segments(run_name) == []

    try:
        run(main())
    finally:
        sweep(run_name, pid=os.getpid())


@pytest.mark.slow
def test_a_killed_sender_is_swept(run_dir: str) -> None:
    """The server answers through shared memory; SIGKILL it: sweep(run) removes what it left."""
    run_name = os.path.basename(run_dir)
    server = start_server_process(
        f"ipc://{run_dir}/echo.sock", "--run", run_name, "--incarnation", "3"
    )
    big = torch.arange(512 * 1024, dtype=torch.float32)
    # This side sends by frames, so only the server's segments are in play.
    options = ChannelOptions(run=run_name, shm_threshold=1 << 40)

    async def main() -> None:
        async with Client(server.endpoint, options=options) as client:
            back = await client.call("echo", big, torch.Tensor)
            assert torch.equal(back, big)
            left = _segments(run_name)
            assert len(left) == 1
            assert re.match(rf"^asyncrl\.{re.escape(run_name)}\.{server.pid}\.3\.\d+$", left[0])
            assert os.path.join(SHM_DIR, left[0]) in _mapped_by(os.getpid())

            await asyncio.to_thread(server.stop, signal.SIGKILL)
            assert server.proc.returncode == -signal.SIGKILL
            assert _segments(run_name) == left  # nobody unlinked it

            assert sweep(run_name) == left
            assert _segments(run_name) == []
            assert torch.equal(back, big)  # a live mapping outlasts the unlink

    try:
        run(main())
    finally:
        if server.proc.poll() is None:
            server.stop(signal.SIGKILL)
        sweep(run_name, pid=server.pid)
    assert _segments(run_name) == []


def test_the_host_id_override_splits_one_machine_into_hosts(
    monkeypatch: pytest.MonkeyPatch, shm_dir: str
) -> None:
    monkeypatch.delenv(HOST_ID_ENV, raising=False)
    real = host_id(shm_dir)
    monkeypatch.setenv(HOST_ID_ENV, "node-1")
    assert host_id(shm_dir) == f"{real}#node-1"
    monkeypatch.setenv(HOST_ID_ENV, "")  # empty: not set
    assert host_id(shm_dir) == real


def test_processes_with_other_host_ids_send_tensors_inline_not_by_shared_memory(
    monkeypatch: pytest.MonkeyPatch, run_dir: str
) -> None:
    """The same pair on one machine shares memory (the control); with different host ids each
    side sends its tensor as frames over the socket, and no segment of the run is made."""
    run_name = os.path.basename(run_dir)
    big = torch.arange(512 * 1024, dtype=torch.float32)  # 2 MiB: over the shm threshold

    async def echo_twice(endpoint: str) -> tuple[bool, list[str]]:
        async with Client(endpoint, options=ChannelOptions(run=run_name)) as client:
            back = await client.call("echo", big, torch.Tensor)
            assert torch.equal(back, big)
            shared = client._use_shm
            return shared, _segments(run_name)

    for server_host, client_host, shared in (
        ("node-0", "node-0", True),
        ("node-1", "node-0", False),
    ):
        monkeypatch.setenv(HOST_ID_ENV, server_host)  # inherited by the server process
        server = start_server_process(f"ipc://{run_dir}/{server_host}.sock", "--run", run_name)
        monkeypatch.setenv(HOST_ID_ENV, client_host)
        try:
            used, segments = run(echo_twice(server.endpoint))
            assert used is shared
            owners = sorted({_pid_of(name) for name in segments})
            assert owners == (sorted([os.getpid(), server.pid]) if shared else [])
        finally:
            server.stop(signal.SIGTERM)
            sweep(run_name, pid=server.pid)
            sweep(run_name, pid=os.getpid())
