"""What keeps a traced call cheap: event structs the collector never sees that encode exactly as
the file format's arrays, one list the hooks append to and the writer never swaps, and one file
kept open."""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import msgspec
import pytest

from asyncrl.transport import tracing
from asyncrl.transport.protocol import TensorDesc, Where
from asyncrl.transport.tracing import CallEvent, Recorder, ReplyEvent, ServedEvent, ServeEvent

IDENTITY = b"driver:4242:0badcafe"
EVENTS = [
    (CallEvent("echo", "ipc:///run/echo.0", IDENTITY, 7, 123_456_789_012, 61), 7),
    (ReplyEvent(IDENTITY, 7, 123_456_799_999), 4),
    (ServeEvent("echo", IDENTITY, 7, 123_456_790_000, 61), 6),
    (ServedEvent(IDENTITY, 7, 123_456_798_000), 4),
]


@pytest.fixture
def recorder(tmp_path: Any) -> Any:
    rec = Recorder(str(tmp_path / "trace"), "echo.0", 1)
    yield rec
    rec.close()


def _chunks(path: str) -> list[list[list[Any]]]:
    with open(path, "rb") as f:
        data = f.read()
    chunks, at = [], 0
    while at < len(data):
        size = int.from_bytes(data[at : at + 4], "little")
        chunks.append(msgspec.msgpack.decode(data[at + 4 : at + 4 + size]))
        at += 4 + size
    assert at == len(data)
    return chunks


def _open_files() -> set[str]:
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the fd of the listing itself, closed by now
    return names


@pytest.mark.parametrize(("event", "fields"), EVENTS)
def test_an_event_encodes_as_the_array_of_its_kind(event: Any, fields: int) -> None:
    as_array = [event.__struct_config__.tag, *msgspec.structs.astuple(event)]
    assert len(as_array) == fields
    assert msgspec.msgpack.encode(event) == msgspec.msgpack.encode(as_array)


def test_events_of_calls_are_never_tracked_by_the_collector() -> None:
    gc.collect()
    gc.disable()  # no collection resets the count meanwhile
    try:
        before = gc.get_count()[0]
        held = [CallEvent("echo", "ipc://e", IDENTITY, i, i, 1) for i in range(1000)]
        counted = gc.get_count()[0] - before
    finally:
        gc.enable()
    assert not any(gc.is_tracked(e) for e in held)
    # a tuple per event would count 1000 allocations towards the next collection
    assert counted < 10


def test_flush_writes_what_was_recorded_as_one_chunk_and_keeps_later_events(
    recorder: Recorder,
) -> None:
    record = recorder.record
    for event, _ in EVENTS:
        record(event)
    recorder.flush()
    record(ReplyEvent(IDENTITY, 8, 5))
    recorder.flush()
    recorder.flush()  # nothing new: no empty chunk
    first, second = _chunks(recorder.path)
    head = ["process", "echo.0", 1, os.getpid(), recorder.host, recorder.offset_ns]
    assert first == [
        head,
        ["call", "echo", "ipc:///run/echo.0", IDENTITY, 7, 123_456_789_012, 61],
        ["reply", IDENTITY, 7, 123_456_799_999],
        ["serve", "echo", IDENTITY, 7, 123_456_790_000, 61],
        ["served", IDENTITY, 7, 123_456_798_000],
    ]
    assert second == [["reply", IDENTITY, 8, 5]]


def test_events_recorded_from_threads_while_flushing_are_all_written(
    recorder: Recorder,
) -> None:
    per_thread, threads = 20_000, 4

    def hooks(n: int) -> None:
        for i in range(per_thread):
            recorder.record(ServedEvent(IDENTITY, n * per_thread + i, i))

    workers = [threading.Thread(target=hooks, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    while any(w.is_alive() for w in workers):
        recorder.flush()
    for worker in workers:
        worker.join()
    recorder.flush()
    ids = [e[2] for chunk in _chunks(recorder.path) for e in chunk if e[0] == "served"]
    assert sorted(ids) == list(range(per_thread * threads))


def test_the_file_stays_open_between_chunks_and_closes_with_the_recorder(
    tmp_path: Any,
) -> None:
    rec = Recorder(str(tmp_path / "trace"), "echo.0")
    rec.record(ReplyEvent(IDENTITY, 1, 1))
    rec.flush()
    fd = rec._fd
    rec.record(ReplyEvent(IDENTITY, 2, 2))
    rec.flush()
    assert rec._fd == fd >= 0
    assert os.readlink(f"/proc/self/fd/{fd}") == rec.path
    rec.close()
    assert rec._fd == -1
    assert rec.path not in _open_files()
    assert [e[2] for c in _chunks(rec.path) for e in c[-1:]] == [1, 2]


def test_the_bytes_of_a_message_count_its_frames_and_its_shared_memory_tensors() -> None:
    shm = TensorDesc("torch", "float32", [4], 16, Where.SHM, segment="s", slot=0)
    frame = TensorDesc("torch", "float32", [2], 8, Where.FRAME, frame=1)
    assert tracing.nbytes([b"abc", memoryview(b"12345678")], None) == 11
    assert tracing.nbytes([b"abc"], [shm, frame]) == 3 + 16
