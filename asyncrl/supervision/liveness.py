"""Liveness that tells a frozen process from a busy one.

Every Python process of a run (a role's replica, the driver) runs a heartbeat thread of its own
(``Heartbeat``). Every ``heartbeat_interval_s`` the thread writes the time into the process's
liveness file, ``RUN_DIR/liveness/<name>.<replica>``, beside the time of its event loop's last
turn, which a timer on the loop writes every ``TURN_S``. The thread waits on neither the loop nor
a socket, so the supervisor, which reads the file (``read_beat``, ``judge``), tells apart:

- a process that is **frozen**: stopped (SIGSTOP), deadlocked, or inside a C call that holds the
  GIL. It writes no heartbeat, and is killed once it has written none for ``liveness`` x
  ``heartbeat_interval_s``;
- a process that is **busy**: its event loop blocked (an import, garbage collection, a long call
  made on the loop). It goes on beating. Once its loop has been blocked for ``warn_after_s``,
  the thread logs one warning (``event loop blocked``) with the loop thread's stack, once per
  blocking site (``BlockReporter``); the supervisor kills it only once its loop has been blocked
  for ``hang_after_s``.

Start-up has its own deadline: until the process is ready (a role's ``setup()`` returned, the
driver's program started) only ``startup_timeout_s``, counted from the spawn, applies, since a
start imports (C extensions hold the GIL while they load) and restores state. A process whose
loop has ended (it exits: ``atexit`` handlers, the interpreter's teardown, a thread it joins)
has ``hang_after_s`` from then to be gone.

An external role (``command:``) has no such thread; its supervisor kills it when it misses
``liveness`` x ``heartbeat_interval_s`` of PONGs (docs/protocol.md, Heartbeats), as it does a
Python process whose liveness file could not be written.

The file is 64 bytes: eight signed 64-bit integers in the machine's byte order, each written by
one aligned store through a shared mapping (a reader never sees half of one): ``MAGIC``, pid,
incarnation, state (``STARTING``, ``READY``, ``EXITING``), the last heartbeat and the loop's last
turn (both ``CLOCK_MONOTONIC`` nanoseconds, one clock for every process of the host), and two
zeros. A new incarnation replaces the file whole (a rename) before it maps it.
"""

from __future__ import annotations

import asyncio
import contextvars
import mmap
import os
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from asyncrl.supervision.supervisor import ChildSpec

__all__ = [
    "EXITING",
    "LIVENESS_DIR",
    "READY",
    "STARTING",
    "TURN_S",
    "Beat",
    "BlockReporter",
    "BlockedLoop",
    "Heartbeat",
    "Verdict",
    "Watch",
    "judge",
    "liveness_path",
    "read_beat",
]

LIVENESS_DIR = "liveness"
"""The folder of the run directory that holds one liveness file per supervised process."""

TURN_S = 0.25
"""Seconds between two writes of the loop's turn by the timer on the loop: a loop that is idle
reads as blocked for at most this long."""

STARTING, READY, EXITING = 0, 1, 2
"""The states a process's record says it is in: importing and restoring its state, serving,
and past the end of its event loop."""

MAGIC = 0x61_73_79_6E_63_72_6C_31  # "asyncrl1"
_LAYOUT = struct.Struct("=8q")
_SIZE = _LAYOUT.size
_PID, _INCARNATION, _STATE, _BEAT, _TURN = 1, 2, 3, 4, 5


def liveness_path(run_dir: str, name: str, replica: int) -> str:
    """The liveness file of replica ``replica`` of ``name`` (the driver: ``driver``, 0)."""
    return os.path.join(run_dir, LIVENESS_DIR, f"{name}.{replica}")


@dataclass(frozen=True)
class Beat:
    """What a process's liveness file says: who wrote it, in which state, and when it last
    beat and its loop last turned (``CLOCK_MONOTONIC`` nanoseconds)."""

    pid: int
    incarnation: int
    state: int
    beat_ns: int
    turn_ns: int


def read_beat(path: str) -> Beat | None:
    """The record at ``path``; None when there is none (not written yet, or not a liveness
    file)."""
    try:
        with open(path, "rb") as f:
            data = f.read(_SIZE)
    except OSError:
        return None
    if len(data) != _SIZE:
        return None
    magic, pid, incarnation, state, beat, turn, _, _ = _LAYOUT.unpack(data)
    if magic != MAGIC:
        return None
    return Beat(pid, incarnation, state, beat, turn)


@dataclass(frozen=True)
class Verdict:
    """Why a process is taken as hung: ``kind`` and a sentence saying what was seen."""

    kind: Literal["frozen", "blocked", "exiting"]
    seconds: float
    detail: str

    @property
    def reason(self) -> str:
        """The reason a run's report gives for the kill."""
        return {
            "frozen": "frozen: no heartbeat",
            "blocked": "event loop blocked past hang_after_s",
            "exiting": "still exiting past hang_after_s",
        }[self.kind]


def judge(beat: Beat, now_ns: int, *, frozen_after_s: float, hang_after_s: float) -> Verdict | None:
    """Whether the process whose record is ``beat`` is hung at ``now_ns``; None if not.

    A process still starting is never hung here (its start-up deadline applies). One past its
    loop's end is hung once that end is ``hang_after_s`` old. One that serves is hung when its
    heartbeat is older than ``frozen_after_s`` (frozen) or its loop's last turn older than
    ``hang_after_s`` (blocked).
    """
    if beat.state == STARTING:
        return None
    if beat.state == EXITING:
        since = (now_ns - beat.turn_ns) / 1e9
        if since > hang_after_s:
            return Verdict(
                "exiting",
                since,
                f"still exiting {since:.1f} s after its event loop ended, past hang_after_s "
                f"({hang_after_s:g} s)",
            )
        return None
    silent = (now_ns - beat.beat_ns) / 1e9
    if silent > frozen_after_s:
        return Verdict(
            "frozen",
            silent,
            f"no heartbeat for {silent:.3f} s, over liveness x heartbeat_interval_s "
            f"({frozen_after_s:g} s): it is stopped or deadlocked",
        )
    blocked = (now_ns - beat.turn_ns) / 1e9
    if blocked > hang_after_s:
        return Verdict(
            "blocked",
            blocked,
            f"its event loop has been blocked for {blocked:.1f} s, past hang_after_s "
            f"({hang_after_s:g} s); the stack that blocks it is in its log (event loop blocked)",
        )
    return None


class Watch:
    """The supervisor's view of one incarnation's liveness file.

    Args:
        path: the file.
        pid, incarnation: the process it must have been written by; a record of another
            (the previous incarnation's, not replaced yet) is ignored.
        frozen_after_s: ``liveness`` x ``heartbeat_interval_s``.
        hang_after_s: the role's ``hang_after_s``.

    Attributes:
        beating: a record of this incarnation was read: its heartbeat thread runs, and the
            file, not the transport's silence, says whether it is hung.
        ready: the last record read says the process is ready.
    """

    def __init__(
        self, path: str, pid: int, incarnation: int, *, frozen_after_s: float, hang_after_s: float
    ) -> None:
        self.path = path
        self.pid = pid
        self.incarnation = incarnation
        self.frozen_after_s = frozen_after_s
        self.hang_after_s = hang_after_s
        self.beating = False
        self.ready = False

    @classmethod
    def of(cls, child: ChildSpec, pid: int, incarnation: int) -> Watch:
        """The watch of incarnation ``incarnation`` (process ``pid``) of a supervisor's
        ``ChildSpec``, under its policy."""
        policy = child.policy
        return cls(
            child.liveness_path,
            pid,
            incarnation,
            frozen_after_s=policy.liveness * policy.heartbeat_interval_s,
            hang_after_s=policy.hang_after_s,
        )

    def check(self, now_ns: int) -> Verdict | None:
        """Read the file; the verdict on the process at ``now_ns`` (``judge``), or None."""
        beat = read_beat(self.path)
        if beat is None or beat.pid != self.pid or beat.incarnation != self.incarnation:
            return None
        self.beating = True
        self.ready = beat.state != STARTING
        return judge(
            beat, now_ns, frozen_after_s=self.frozen_after_s, hang_after_s=self.hang_after_s
        )


@dataclass(frozen=True)
class BlockedLoop:
    """A blocked loop worth a warning: for how long, and the loop thread's stack."""

    blocked_s: float
    stack: traceback.StackSummary

    @property
    def site(self) -> str:
        """The innermost frame of the stack, ``file:line in function``."""
        if not self.stack:
            return "unknown (the loop thread has no Python frame)"
        f = self.stack[-1]
        return f"{f.filename}:{f.lineno} in {f.name}"


class BlockReporter:
    """Decides which blocked loops are reported: a stretch of blocking once it reaches
    ``warn_after_s``, and of those only the first at each blocking site.

    A site is the chain of functions on the loop thread's stack (file and function of each
    frame, without line numbers): a loop that computes in one function for seconds is one
    site, wherever in that function the stack is taken.
    """

    def __init__(self, warn_after_s: float) -> None:
        self.warn_after_s = warn_after_s
        self._sites: set[tuple[tuple[str, str], ...]] = set()
        self._reported_turn: int | None = None

    def observe(
        self, now_ns: int, turn_ns: int, stack: Callable[[], traceback.StackSummary]
    ) -> BlockedLoop | None:
        """The warning due at ``now_ns`` for a loop last turned at ``turn_ns``, or None.
        ``stack`` is called only when a warning may be due."""
        blocked = (now_ns - turn_ns) / 1e9
        if blocked < self.warn_after_s or turn_ns == self._reported_turn:
            return None
        self._reported_turn = turn_ns  # this stretch is decided, whatever its site
        frames = stack()
        site = tuple((f.filename, f.name) for f in frames)
        if site in self._sites:
            return None
        self._sites.add(site)
        return BlockedLoop(blocked, frames)


class Heartbeat:
    """The heartbeat thread of one process, and the timer on its event loop.

    Args:
        path: the liveness file (``liveness_path``).
        incarnation: the process's incarnation, written in the record.
        interval_s: seconds between two heartbeats.
        warn_after_s: seconds of a blocked loop after which a warning is logged.
        log: a structlog logger; the warning goes through it.
        clock: ``CLOCK_MONOTONIC`` nanoseconds (a test may pass a fake one).
    """

    def __init__(
        self,
        path: str,
        *,
        incarnation: int,
        interval_s: float,
        warn_after_s: float,
        log: Any,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.path = path
        self.clock = clock
        self.incarnation = incarnation
        self.interval_s = interval_s
        self.reporter = BlockReporter(warn_after_s)
        self._log = log
        self._map: mmap.mmap | None = None
        self._slots: memoryview | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_thread: int | None = None
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Write this incarnation's record (state ``STARTING``) and start beating.

        Raises:
            OSError: the file cannot be written; the process then runs without one, and its
                supervisor falls back on transport heartbeats.
        """
        folder = os.path.dirname(self.path)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        now = self.clock()
        record = _LAYOUT.pack(MAGIC, os.getpid(), self.incarnation, STARTING, now, now, 0, 0)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        try:
            os.write(fd, record)
            self._map = mmap.mmap(fd, _SIZE)
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        self._slots = memoryview(self._map).cast("q")
        # A new thread starts with an empty context: give it this one's, which holds the log
        # fields naming the process.
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._run,), name="asyncrl-heartbeat", daemon=True
        )
        self._thread.start()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the timer that writes ``loop``'s turns; call it from the loop's thread."""
        self._loop_thread = threading.get_ident()
        self._turn(loop)

    def ready(self) -> None:
        """The process is ready: from now on a blocked loop is reported and judged."""
        self._write(_TURN, self.clock())
        self._write(_STATE, READY)

    def exiting(self) -> None:
        """The event loop has ended: the process has ``hang_after_s`` from now to be gone."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._write(_TURN, self.clock())
        self._write(_STATE, EXITING)

    def stop(self) -> None:
        """Stop the thread and the timer (the file stays, with its last beat)."""
        self._stop.set()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _write(self, slot: int, value: int) -> None:
        if self._slots is not None:
            self._slots[slot] = value

    def _turn(self, loop: asyncio.AbstractEventLoop) -> None:
        self._write(_TURN, self.clock())
        if not self._stop.is_set() and not loop.is_closed():
            self._timer = loop.call_later(TURN_S, self._turn, loop)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def beat(self) -> None:
        """Write one heartbeat; warn if the loop has been blocked long enough (the thread
        calls it every ``interval_s``)."""
        slots = self._slots
        if slots is None:
            return
        now = self.clock()
        slots[_BEAT] = now
        if slots[_STATE] != READY or self._loop_thread is None:
            return
        blocked = self.reporter.observe(now, slots[_TURN], self._loop_stack)
        if blocked is not None:
            self._log.warning(
                "event loop blocked",
                blocked_s=round(blocked.blocked_s, 3),
                warn_after_s=self.reporter.warn_after_s,
                site=blocked.site,
                stack="".join(blocked.stack.format()),
            )

    def _loop_stack(self) -> traceback.StackSummary:
        frame = sys._current_frames().get(self._loop_thread or 0)
        if frame is None:
            return traceback.StackSummary()
        return traceback.extract_stack(frame)
