"""What keeps a traced call cheap: a hook hands one short-lived tuple of scalars to one flat
list's ``extend`` (nothing the collector counts or tracks), a client's endpoint and identity
written once per file, the list never swapped, and one file kept open; and what the reader makes
of the flat chunks, and of files of the earlier format (an array of arrays per chunk)."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from typing import Any

import msgspec
import pytest

from asyncrl.observe import trace
from asyncrl.transport import ChannelOptions, Client, RemoteError, Server, run, tracing
from asyncrl.transport.protocol import TensorDesc, Where
from asyncrl.transport.tracing import CALL, HANDLED, REPLY, SERVE, SERVED, Recorder

IDENTITY = b"driver:4242:0badcafe"
ENDPOINT = "ipc:///run/echo.0"


@pytest.fixture
def recorder(tmp_path: Any) -> Any:
    rec = Recorder(str(tmp_path / "trace"), "echo.0", 1)
    yield rec
    rec.close()


def _chunks(path: str) -> list[list[Any]]:
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


def _record_one_of_each(rec: Recorder) -> int:
    channel = rec.channel(ENDPOINT, IDENTITY)
    rec.record((CALL, "echo", channel, 7, 123_456_789_012, 61))
    rec.record((REPLY, channel, 7, 123_456_799_999))
    rec.record((SERVE, "echo", IDENTITY, 7, 123_456_790_000, 61))
    rec.record((SERVED, IDENTITY, 7, 123_456_798_000))
    return channel


def test_a_chunk_is_one_flat_array_with_the_channel_written_once(recorder: Recorder) -> None:
    channel = _record_one_of_each(recorder)
    recorder.record((REPLY, channel, 8, 5))
    recorder.flush()
    head, chunk = _chunks(recorder.path)  # who wrote the file, in a chunk of its own
    assert head == [0, "echo.0", 1, os.getpid(), recorder.host, recorder.offset_ns]
    assert chunk == [
        *(1, 0, ENDPOINT, IDENTITY),
        *(2, "echo", 0, 7, 123_456_789_012, 61),
        *(3, 0, 7, 123_456_799_999),
        *(4, "echo", IDENTITY, 7, 123_456_790_000, 61),
        *(5, IDENTITY, 7, 123_456_798_000),
        *(3, 0, 8, 5),
    ]


def test_the_reader_names_the_events_of_flat_chunks_across_chunks(recorder: Recorder) -> None:
    channel = _record_one_of_each(recorder)
    recorder.flush()
    recorder.record((REPLY, channel, 8, 5))  # its channel was defined in the chunk before
    with recorder.span("generate", tokens=3):
        pass
    recorder.flush()
    events = list(trace._events(recorder.path))
    span = events.pop()
    assert events == [
        ["process", "echo.0", 1, os.getpid(), recorder.host, recorder.offset_ns],
        ["call", "echo", ENDPOINT, IDENTITY, 7, 123_456_789_012, 61],
        ["reply", IDENTITY, 7, 123_456_799_999],
        ["serve", "echo", IDENTITY, 7, 123_456_790_000, 61],
        ["served", IDENTITY, 7, 123_456_798_000],
        ["reply", IDENTITY, 8, 5],
    ]
    assert span[:3] == ["span", "generate", "MainThread"] and span[5] == {"tokens": 3}
    assert span[3] <= span[4]


def test_a_request_served_in_one_step_is_one_event_read_as_a_serve_and_its_served(
    recorder: Recorder,
) -> None:
    recorder.record((HANDLED, "echo", IDENTITY, 7, 100, 250, 61))
    recorder.flush()
    assert _chunks(recorder.path)[1] == [7, "echo", IDENTITY, 7, 100, 250, 61]
    assert list(trace._events(recorder.path))[1:] == [
        ["serve", "echo", IDENTITY, 7, 100, 61],
        ["served", IDENTITY, 7, 250],
    ]


def _kinds(path: str) -> list[int]:
    """The kinds of a file's events, in order (its flat chunks walked event by event)."""
    kinds = []
    for chunk in _chunks(path):
        at = 0
        while at < len(chunk):
            kinds.append(chunk[at])
            at += tracing.FIELDS[chunk[at]]
    return kinds


def test_a_synchronous_handler_is_one_event_and_an_asynchronous_one_two(tmp_path: Any) -> None:
    """Served within one step of the loop (a plain function, failing or not), a request is one
    ``HANDLED`` event; awaited (a coroutine), a ``SERVE`` when taken and a ``SERVED`` when
    answered, so that one still running shows in the trace."""

    def now(payload: int, call: Any) -> int:
        if payload < 0:
            raise ValueError("negative")
        return payload

    async def later(payload: int, call: Any) -> int:
        await asyncio.sleep(0)
        return now(payload, call)

    async def calls(directory: str) -> None:
        options = ChannelOptions(run="t")
        server = Server(f"ipc://{directory}/s", name="echo.0", options=options)
        server.add("now", now, int)
        server.add("later", later, int)
        async with server, Client(server.endpoint, options=options) as client:
            for method in ("now", "later"):
                assert await client.call(method, 3, int) == 3
                with pytest.raises(RemoteError, match="negative"):
                    await client.call(method, -1, int)

    rec = tracing.install(Recorder(str(tmp_path / "trace"), "echo.0"))
    try:
        run(calls(str(tmp_path)))
    finally:
        tracing.uninstall()
        rec.close()
    served = [k for k in _kinds(rec.path) if k in (SERVE, SERVED, HANDLED)]
    assert served == [HANDLED, HANDLED, SERVE, SERVED, SERVE, SERVED]
    (proc,) = trace.load(str(tmp_path / "trace"))
    assert [s[1] for s in proc.serves] == ["now", "now", "later", "later"]
    for call, serve in zip(proc.calls, proc.serves, strict=True):
        assert call[5] <= serve[4] <= serve[5] <= call[6]  # served inside the call


@pytest.mark.parametrize("count", [3, 15, 16, 65_535, 65_536, 70_001])
def test_a_flush_deletes_what_it_wrote_whatever_the_array_header(
    recorder: Recorder, count: int
) -> None:
    """The writer encodes the live list and reads how many scalars it took from the array's
    header: a fixarray (up to 15), an array 16 (up to 65,535) or an array 32."""
    recorder.flush()  # the head
    events = [(SERVED, IDENTITY, i, i) for i in range(count // 4)]
    for event in events:
        recorder.record(event)
    recorder._events.extend(range(count % 4))  # the header's count, not a whole event's
    recorder.flush()
    assert recorder._events == []
    assert len(_chunks(recorder.path)[1]) == count
    with pytest.raises(ValueError, match="no MessagePack array at byte 4"):
        tracing._array_length(bytearray(b"\0\0\0\0\xc0"), 4)


def test_a_span_argument_msgpack_cannot_hold_is_written_as_its_repr(recorder: Recorder) -> None:
    """The list is encoded where it lies: an event that failed to encode would stay at its
    front for good, and every later chunk fail behind it."""

    class Shape:
        def __repr__(self) -> str:
            return "Shape(2, 3)"

    with recorder.span("generate", shape=Shape(), tokens=3):
        pass
    recorder.flush()
    with recorder.span("score"):
        pass
    recorder.flush()
    spans = [e for e in trace._events(recorder.path) if e[0] == "span"]
    assert [(s[1], s[5]) for s in spans] == [
        ("generate", {"shape": "Shape(2, 3)", "tokens": 3}),
        ("score", {}),
    ]
    assert recorder._events == []


def test_files_of_the_earlier_format_still_read(tmp_path: Any) -> None:
    events = [
        ["process", "echo.0", 1, 42, "h", 1000],
        ["call", "echo", ENDPOINT, IDENTITY, 7, 10, 61],
        ["reply", IDENTITY, 7, 20],
    ]
    chunk = msgspec.msgpack.encode(events)
    path = str(tmp_path / "h-42-0.trace")
    with open(path, "wb") as f:
        f.write(len(chunk).to_bytes(4, "little") + chunk)
    assert list(trace._events(path)) == events


def test_a_chunk_with_an_unknown_kind_or_channel_ends_what_is_read(tmp_path: Any) -> None:
    assert list(tracing.named_events([3, 0, 7, 20], {0: (ENDPOINT, IDENTITY)})) == [
        ["reply", IDENTITY, 7, 20]
    ]
    with pytest.raises(KeyError):
        list(tracing.named_events([3, 9, 7, 20], {}))
    with pytest.raises(KeyError):
        list(tracing.named_events([17, 1, 2, 3], {}))
    with pytest.raises(ValueError, match="a chunk ends inside an event of kind 2"):
        list(tracing.named_events([2, "echo", 0, 7], {}))
    rec = Recorder(str(tmp_path / "trace"), "echo.0")
    rec.record((SERVED, IDENTITY, 1, 1))
    rec.flush()
    rec.record((17, 1, 2, 3))  # a kind of a later version: the reader stops there
    rec.flush()
    rec.close()
    assert list(trace._events(rec.path))[-1] == ["served", IDENTITY, 1, 1]


def test_hooks_leave_nothing_the_collector_counts_or_tracks(recorder: Recorder) -> None:
    record = recorder.record
    gc.collect()
    gc.disable()  # no collection resets the count meanwhile
    try:
        before = gc.get_count()[0]
        for i in range(1000):
            record((CALL, "echo", 0, 100_000 + i, tracing.clock(), 61))
            record((REPLY, 0, 100_000 + i, tracing.clock()))
        counted = gc.get_count()[0] - before
    finally:
        gc.enable()
    assert len(recorder._events) == 1000 * 6 + 1000 * 4
    assert not any(gc.is_tracked(e) for e in recorder._events)
    # an event object held per event would count 2000 allocations towards the next collection
    assert counted < 10


def test_events_recorded_from_threads_while_flushing_are_all_written(
    recorder: Recorder,
) -> None:
    per_thread, threads = 20_000, 4

    def hooks(n: int) -> None:
        for i in range(per_thread):
            recorder.record((SERVED, IDENTITY, n * per_thread + i, i))

    workers = [threading.Thread(target=hooks, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    while any(w.is_alive() for w in workers):
        recorder.flush()
    for worker in workers:
        worker.join()
    recorder.flush()
    events = list(trace._events(recorder.path))
    assert events[0][0] == "process"
    ids = [e[2] for e in events[1:] if e[0] == "served"]
    assert len(ids) == len(events) - 1  # every chunk ended on an event's end
    assert sorted(ids) == list(range(per_thread * threads))


def test_the_file_stays_open_between_chunks_and_closes_with_the_recorder(
    tmp_path: Any,
) -> None:
    rec = Recorder(str(tmp_path / "trace"), "echo.0")
    rec.record((SERVED, IDENTITY, 1, 1))
    rec.flush()
    fd = rec._fd
    rec.record((SERVED, IDENTITY, 2, 2))
    rec.flush()
    assert rec._fd == fd >= 0
    assert os.readlink(f"/proc/self/fd/{fd}") == rec.path
    rec.close()
    assert rec._fd == -1
    assert rec.path not in _open_files()
    assert [e[2] for e in trace._events(rec.path)][1:] == [1, 2]


def test_the_bytes_of_a_message_count_its_frames_and_its_shared_memory_tensors() -> None:
    shm = TensorDesc("torch", "float32", [4], 16, Where.SHM, segment="s", slot=0)
    frame = TensorDesc("torch", "float32", [2], 8, Where.FRAME, frame=1)
    assert tracing.nbytes([b"abc", memoryview(b"12345678")], None) == 11
    assert tracing.nbytes([b"abc"], [shm, frame]) == 3 + 16
