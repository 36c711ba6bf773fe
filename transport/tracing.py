"""The transport's trace recorder: when on, every call this process makes or serves is recorded.

Tracing is on in a process whose environment names a directory in ``ASYNCRL_TRACE_DIR`` (or after
``install``). Each ``Client`` and ``Server`` asks ``current()`` once, when it is built, and keeps
the recorder's ``record`` (or ``None``): with tracing off each hook pays one ``is not None``
test, and with it on one tuple of the event's scalars and one call of ``list.extend``,
written inline in the client's and the server's hot paths (no Python frame of the recorder's).

The recorder appends to ``DIR/<host>-<pid>-<n>.trace`` chunks of events: each a 4-byte
little-endian length, then one flat MessagePack array of scalars in which the events lie back to
back, each opened by its kind (a small int) and as long as its kind says:

- ``0, label, incarnation, pid, host, offset_ns`` (process): who wrote the file; ``offset_ns`` is
  wall clock minus the monotonic clock, sampled at start, which aligns the processes' clocks
  (``CLOCK_MONOTONIC`` is shared by every process of one host; hosts align on their wall clocks);
- ``1, channel, endpoint, identity`` (channel): a client of this process, numbered ``channel``,
  calls the server at ``endpoint`` as ``identity`` (its routing id, bytes, which the server sees
  too); written once, before the client's calls, so that no call repeats the two;
- ``2, method, channel, request_id, start_ns, bytes`` (call): a request this process sent; the
  two ends of a call meet on ``(identity, request_id)``;
- ``3, channel, request_id, end_ns`` (reply): its answer (a reply or an error) arrived; a call
  with none ended otherwise (deadline, disconnect, close);
- ``4, method, identity, request_id, start_ns, bytes`` (serve): a request this process took;
- ``5, identity, request_id, end_ns`` (served): its reply or error was sent;
- ``6, name, thread, start_ns, end_ns, args`` (span): work inside the process (``span``);
- ``7, method, identity, request_id, start_ns, end_ns, bytes`` (handled): a request this
  process took and answered within one step of its loop (a synchronous handler): a serve and
  its served in one event.

(Files of earlier versions hold a chunk as an array of events, each an array opened by the kind's
name, ``["call", method, endpoint, identity, request_id, start_ns, bytes]`` and so on;
``asyncrl.trace`` reads both.)

Times are monotonic nanoseconds (``clock``); ``bytes`` counts the message's frames and its
shared-memory tensors (``nbytes``). An event is written after every event recorded before it, so a
call's end follows its start in the file. Ends are matched to starts when the files are merged
(``asyncrl.trace``). A thread of the recorder writes the events out every ``FLUSH_S`` seconds,
and at exit, so a process that is killed loses at most its last half second.

Why flat: a hook builds one short-lived tuple of its event and hands it to ``list.extend`` (one
C call that copies the scalars in; the tuple is freed at once, so the garbage collector never
counts it, and nothing the list holds is tracked by it); the writer encodes an array of scalars,
frees no event objects, and writes a third of the bytes of arrays that repeat the endpoint and
the identity. A hook calls the ``record`` its client or server holds from a local variable
(``record = self._record``): called as ``self._record(...)``, an instance attribute that is not
a method, Python 3.11 looks it up through the class and the instance's dict at every call, which
cost as much as the rest of the hook. A request a plain function answers is one event
(``HANDLED``) rather than two: one tuple, one ``extend`` and four scalars fewer; a coroutine's
(every role endpoint is one) stays two, so that one still running shows.
"""

from __future__ import annotations

import atexit
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

__all__ = [
    "CALL",
    "CHANNEL",
    "FIELDS",
    "HANDLED",
    "KIND_NAMES",
    "PROCESS",
    "REPLY",
    "SERVE",
    "SERVED",
    "SPAN",
    "TRACE_DIR_ENV",
    "Recorder",
    "clock",
    "current",
    "install",
    "named_events",
    "nbytes",
    "uninstall",
]

TRACE_DIR_ENV = "ASYNCRL_TRACE_DIR"
"""The environment variable that turns tracing on: the directory the per-process files go to."""

FLUSH_S = 0.5
"""How often the recorder's thread writes the events recorded since it last did."""

clock = time.monotonic_ns
"""The clock of every event's times."""

_serial = itertools.count()  # a process may hold several recorders (a benchmark does)


def clock_offset_ns(samples: int = 7) -> int:
    """Wall clock minus monotonic clock in ns, from the tightest of ``samples`` brackets."""
    best: tuple[int, int] | None = None
    for _ in range(samples):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        if best is None or after - before < best[0]:
            best = (after - before, wall - (before + after) // 2)
    assert best is not None
    return best[1]


PROCESS, CHANNEL, CALL, REPLY, SERVE, SERVED, SPAN, HANDLED = range(8)
"""The kinds of events, as written (see the module docstring)."""

FIELDS = {PROCESS: 6, CHANNEL: 4, CALL: 6, REPLY: 4, SERVE: 6, SERVED: 4, SPAN: 6, HANDLED: 7}
"""How many scalars each kind of event takes, its kind included."""

KIND_NAMES = {
    PROCESS: "process",
    CHANNEL: "channel",
    CALL: "call",
    REPLY: "reply",
    SERVE: "serve",
    SERVED: "served",
    SPAN: "span",
}
"""The name of each kind, as files of earlier versions wrote it."""


def nbytes(frames: list[Any], tensors: list[Any] | None) -> int:
    """The bytes of a message: its frames (bytes, memoryviews or ``zmq.Frame``) and the tensors
    (``TensorDesc``) of ``tensors`` that travel through shared memory.

    The hot paths call it only for a message of several frames or with tensors; for one frame
    and none, ``len(frames[0])`` is the answer.
    """
    total = 0
    for frame in frames:
        total += frame.nbytes if isinstance(frame, memoryview) else len(frame)
    if tensors:
        total += sum(d.nbytes for d in tensors if d.where == 2)
    return total


def named_events(chunk: list[Any], channels: dict[int, tuple[str, bytes]]) -> Iterator[list[Any]]:
    """The events of one chunk as ``Recorder`` writes it, each as an array opened by its kind's
    name (``["call", method, endpoint, identity, request_id, start_ns, bytes]``, and so on: the
    form of earlier versions' files); ``channels`` (one per file, shared by its chunks) learns
    the chunk's channels and names their endpoints and identities in calls and replies.

    Raises:
        KeyError: an unknown kind, or a channel not defined before its use.
        ValueError: the chunk ends inside an event.
    """
    at, end = 0, len(chunk)
    while at < end:
        kind = chunk[at]
        stop = at + FIELDS[kind]
        if stop > end:
            raise ValueError(f"a chunk ends inside an event of kind {kind}")
        fields = chunk[at + 1 : stop]
        at = stop
        if kind == CHANNEL:
            channels[fields[0]] = (fields[1], fields[2])
        elif kind == CALL:
            method, channel, rid, start, size = fields
            yield ["call", method, *channels[channel], rid, start, size]
        elif kind == REPLY:
            yield ["reply", channels[fields[0]][1], fields[1], fields[2]]
        elif kind == HANDLED:
            method, identity, rid, start, stop_ns, size = fields
            yield ["serve", method, identity, rid, start, size]
            yield ["served", identity, rid, stop_ns]
        else:
            yield [KIND_NAMES[kind], *fields]


class Recorder:
    """Records this process's calls and spans into ``directory/<host>-<pid>-<n>.trace``.

    ``record`` (the ``extend`` of one flat list that lives as long as the recorder) takes one
    event as a tuple of its scalars (``(REPLY, channel, request_id, end_ns)``), from any thread;
    ``channel`` numbers a client's endpoint and identity. A daemon thread of the recorder writes
    what was recorded every ``FLUSH_S`` seconds, and ``flush`` does at once (at exit too).

    Args:
        directory: where the file goes; created if missing.
        label: what the process is (``rollout.0``); the first server built names it if empty.
        incarnation: the process's restart count.
    """

    def __init__(self, directory: str, label: str = "", incarnation: int = 0) -> None:
        os.makedirs(directory, exist_ok=True)
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.path = os.path.join(directory, f"{self.host}-{self.pid}-{next(_serial)}.trace")
        self.label = label
        self.incarnation = incarnation
        self.offset_ns = clock_offset_ns()
        self._events: list[Any] = []
        self.record: Callable[[tuple[Any, ...]], None] = self._events.extend
        self._channels = itertools.count()
        self._written_label: tuple[str, int] | None = None
        self._lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_as_text)
        self._buffer = bytearray()
        self._fd = -1  # the file, opened at the first write and kept open
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_often, name="trace-writer", daemon=True)
        self._writer.start()

    def name(self, label: str, incarnation: int) -> None:
        """Name the process, unless it is named already (the first server's name wins)."""
        if not self.label:
            self.label = label
            self.incarnation = incarnation

    def channel(self, endpoint: str, identity: bytes) -> int:
        """Number a client's ``endpoint`` and ``identity`` for its events (``CALL`` and ``REPLY``
        name the number); records the pair, so call this before the client's first call."""
        number = next(self._channels)
        self.record((CHANNEL, number, endpoint, identity))
        return number

    @contextmanager
    def span(self, name: str, **args: Any) -> Iterator[dict[str, Any]]:
        """Record the time the ``with`` block takes as ``name``; the yielded dict is its args,
        which the block may add to (sizes known only at the end)."""
        start = clock()
        try:
            yield args
        finally:
            self.record((SPAN, name, threading.current_thread().name, start, clock(), args))

    # -- writing ---------------------------------------------------------------------------

    def _write_often(self) -> None:
        while not self._stop.wait(FLUSH_S):
            try:
                self.flush()
            except OSError:
                return  # the folder is gone (a benchmark's): nothing more can be written

    def close(self) -> None:
        """Stop the writer thread, write what is left and close the file."""
        self._stop.set()
        self.flush()
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def flush(self) -> None:
        """Write the events recorded so far (from any thread), as one chunk (preceded, the
        first time and when the process is named anew, by a chunk of its ``PROCESS`` event).

        The list is never swapped (the hooks hold its ``extend``) nor copied: it is encoded
        where it lies, in one C call under the GIL, so no hook adds to it meanwhile, and the
        scalars the array's header counts are deleted from its front; what a hook adds between
        the two stays for the next chunk (an ``extend`` is one C call too: the count never
        splits an event).
        """
        with self._lock:
            events = self._events
            buffer = self._buffer
            if not events:
                return
            if self._written_label != (self.label, self.incarnation):
                self._written_label = (self.label, self.incarnation)
                head = (PROCESS, self.label, self.incarnation, self.pid, self.host)
                self._encoder.encode_into((*head, self.offset_ns), buffer, 4)
                buffer[:4] = (len(buffer) - 4).to_bytes(4, "little")
                self._write(buffer)
            # One C call under the GIL: no hook adds to the list while it is encoded, and the
            # array's header says how many scalars it took (a hook may add more right after).
            self._encoder.encode_into(events, buffer, 4)
            del events[: _array_length(buffer, 4)]
            buffer[:4] = (len(buffer) - 4).to_bytes(4, "little")
            self._write(buffer)

    def _write(self, buffer: bytearray) -> None:
        if self._fd < 0:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        written = os.write(self._fd, buffer)  # one write: the GIL changes hands once
        while written < len(buffer):  # a short write (a full disk raises instead)
            written += os.write(self._fd, buffer[written:])


def _as_text(value: Any) -> str:
    """What a span's argument that MessagePack cannot hold (a tensor, an object) is written as:
    its ``repr``, cut to 200 characters; the chunk is written rather than the writer stopped."""
    return repr(value)[:200]


def _array_length(buffer: bytearray, at: int) -> int:
    """The length of the MessagePack array whose header starts at ``buffer[at]``."""
    head = buffer[at]
    if head & 0xF0 == 0x90:
        return head & 0x0F
    if head == 0xDC:
        return int.from_bytes(buffer[at + 1 : at + 3], "big")
    if head == 0xDD:
        return int.from_bytes(buffer[at + 1 : at + 5], "big")
    raise ValueError(f"no MessagePack array at byte {at} (0x{head:02x})")


_recorder: Recorder | None = None
_checked = False


def current(label: str = "", incarnation: int = 0) -> Recorder | None:
    """This process's recorder, or None when tracing is off.

    The first call reads ``ASYNCRL_TRACE_DIR``; a ``label`` names the process if it is not named
    yet (servers pass theirs).
    """
    global _recorder, _checked
    if not _checked:
        _checked = True
        directory = os.environ.get(TRACE_DIR_ENV, "")
        if directory and _recorder is None:
            install(Recorder(directory))
    if _recorder is not None and label:
        _recorder.name(label, incarnation)
    return _recorder


def install(recorder: Recorder) -> Recorder:
    """Make ``recorder`` this process's: clients and servers built from now on record into it.
    It is flushed at exit."""
    global _recorder, _checked
    _recorder, _checked = recorder, True
    atexit.register(_flush_at_exit, recorder)
    return recorder


def _flush_at_exit(recorder: Recorder) -> None:
    """At exit, write what is left; a folder removed meanwhile (a benchmark's) is no error."""
    try:
        recorder.close()
    except FileNotFoundError:
        pass


def uninstall() -> Recorder | None:
    """Stop recording for clients and servers built from now on; returns the recorder. Those
    built earlier keep recording into it."""
    global _recorder, _checked
    recorder, _recorder, _checked = _recorder, None, True
    return recorder
