"""The transport's trace recorder: when on, every call this process makes or serves is recorded.

Tracing is on in a process whose environment names a directory in ``ASYNCRL_TRACE_DIR`` (or after
``install``). Each ``Client`` and ``Server`` asks ``current()`` once, when it is built, and keeps
the answer: with tracing off that is ``None``, and the hot path pays one ``is not None`` test.

The recorder appends to ``DIR/<host>-<pid>-<n>.trace`` chunks of events: each a 4-byte
little-endian length, then a MessagePack array of events, each event an array:

- ``["process", label, incarnation, pid, host, offset_ns]``: who wrote the file; ``offset_ns`` is
  wall clock minus the monotonic clock, sampled at start, which aligns the processes' clocks
  (``CLOCK_MONOTONIC`` is shared by every process of one host; hosts align on their wall clocks);
- ``["call", method, endpoint, identity, request_id, start_ns, bytes]``: a request this process
  sent to the server at ``endpoint``; ``identity`` is the client's routing id (bytes), which
  the server sees too, so the two ends of a call meet on ``(identity, request_id)``;
- ``["reply", identity, request_id, end_ns]``: its answer (a reply or an error) arrived; a call
  with none ended otherwise (deadline, disconnect, close);
- ``["serve", method, identity, request_id, start_ns, bytes]``: a request this process took;
- ``["served", identity, request_id, end_ns]``: its reply or error was sent;
- ``["span", name, thread, start_ns, end_ns, args]``: work inside the process (``span``).

Times are monotonic nanoseconds; ``bytes`` counts the message's frames and its shared-memory
tensors. The hooks only append a tuple: ends are matched to starts when the files are merged
(``asyncrl.trace``). A thread of the recorder writes the events out every ``FLUSH_S`` seconds,
and at exit, so a process that is killed loses at most its last half second.
"""

from __future__ import annotations

import atexit
import itertools
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

__all__ = ["TRACE_DIR_ENV", "Recorder", "current", "install", "uninstall"]

TRACE_DIR_ENV = "ASYNCRL_TRACE_DIR"
"""The environment variable that turns tracing on: the directory the per-process files go to."""

FLUSH_S = 0.5
"""How often the recorder's thread writes the events recorded since it last did."""

_clock = time.monotonic_ns
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


def frames_bytes(frames: list[Any]) -> int:
    """The bytes of a message's frames (bytes, memoryviews or ``zmq.Frame``)."""
    total = 0
    for frame in frames:
        total += frame.nbytes if isinstance(frame, memoryview) else len(frame)
    return total


def shm_bytes(tensors: list[Any]) -> int:
    """The bytes of the tensors (``TensorDesc``) that travel through shared memory."""
    return sum(d.nbytes for d in tensors if d.where == 2) if tensors else 0


class Recorder:
    """Records this process's calls and spans into ``directory/<host>-<pid>-<n>.trace``.

    The hooks only append a tuple to a list (from any thread); a daemon thread of the recorder
    writes them out every ``FLUSH_S`` seconds, and ``flush`` does at once (at exit too).

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
        self._events: list[tuple[Any, ...]] = []
        self._previous: list[tuple[Any, ...]] = []  # the list last written, and how much of it
        self._previous_written = 0
        self._written_label: tuple[str, int] | None = None
        self._lock = threading.Lock()
        self._encode = msgspec.msgpack.Encoder().encode
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_often, name="trace-writer", daemon=True)
        self._writer.start()

    def name(self, label: str, incarnation: int) -> None:
        """Name the process, unless it is named already (the first server's name wins)."""
        if not self.label:
            self.label = label
            self.incarnation = incarnation

    # -- the transport's hooks -----------------------------------------------------------

    def call(self, client: Any, env: Any, frames: list[Any]) -> None:
        """``client`` is sending the request ``env`` (an ``Envelope``) as ``frames``."""
        size = len(frames[0]) if len(frames) == 1 else frames_bytes(frames)
        if env.tensors:
            size += shm_bytes(env.tensors)
        self._events.append(
            ("call", env.method, client.endpoint, client.identity, env.id, _clock(), size)
        )

    def answered(self, client: Any, env: Any) -> None:
        """``client`` got the answer ``env`` (a reply or an error) to its request ``env.id``."""
        self._events.append(("reply", client.identity, env.id, _clock()))

    def serving(self, call: Any, frames: list[Any], tensors: list[Any]) -> None:
        """A server took request ``call`` (a ``Call``) of ``frames``, whose tensor descriptors
        are ``tensors``."""
        size = len(frames[0]) if len(frames) == 1 else frames_bytes(frames)
        if tensors:
            size += shm_bytes(tensors)
        self._events.append(("serve", call.method, call.peer, call.id, _clock(), size))

    def served(self, call: Any) -> None:
        """A server answered ``call`` (with its reply or an error)."""
        self._events.append(("served", call.peer, call.id, _clock()))

    # -- spans -----------------------------------------------------------------------------

    @contextmanager
    def span(self, name: str, **args: Any) -> Iterator[dict[str, Any]]:
        """Record the time the ``with`` block takes as ``name``; the yielded dict is its args,
        which the block may add to (sizes known only at the end)."""
        start = _clock()
        try:
            yield args
        finally:
            self._events.append(
                ("span", name, threading.current_thread().name, start, _clock(), args)
            )

    # -- writing ---------------------------------------------------------------------------

    def _write_often(self) -> None:
        while not self._stop.wait(FLUSH_S):
            try:
                self.flush()
            except OSError:
                return  # the folder is gone (a benchmark's): nothing more can be written

    def close(self) -> None:
        """Stop the writer thread and write what is left."""
        self._stop.set()
        self.flush()

    def flush(self) -> None:
        """Write the events recorded so far (from any thread).

        The hooks append without a lock: one that fetched the list just before it was swapped
        appends to the old one, so what the old list gained since it was written goes first.
        """
        with self._lock:
            events, self._events = self._events, []
            batch = self._previous[self._previous_written :]
            count = len(events)
            batch.extend(events[:count])
            self._previous, self._previous_written = events, count
            if self._written_label != (self.label, self.incarnation):
                self._written_label = (self.label, self.incarnation)
                head = ("process", self.label, self.incarnation, self.pid, self.host)
                batch.insert(0, (*head, self.offset_ns))
            if batch:
                chunk = self._encode(batch)
                with open(self.path, "ab") as f:
                    f.write(len(chunk).to_bytes(4, "little") + chunk)


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
