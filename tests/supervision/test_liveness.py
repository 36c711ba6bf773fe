"""The liveness rules (``asyncrl.supervision.liveness``) on fake clocks: no sleeps, no processes.

Times are in nanoseconds, as the liveness file holds them; ``S`` is one second.
"""

from __future__ import annotations

import asyncio
import os
import struct
import traceback
from collections.abc import Iterator
from typing import Any

import pytest

from asyncrl.manifest.load import HANG_AFTER_S, LIVENESS, WARN_AFTER_S, Supervision
from asyncrl.supervision.liveness import (
    EXITING,
    READY,
    STARTING,
    Beat,
    BlockReporter,
    Heartbeat,
    Watch,
    judge,
    liveness_path,
    read_beat,
)
from asyncrl.supervision.runreport import exit_reason

S = 1_000_000_000
T0 = 1_000 * S  # any point of the monotonic clock


def _beat(state: int, *, beat: float = 0.0, turn: float = 0.0) -> Beat:
    """A record of pid 42, incarnation 1, that beat ``beat`` s and turned ``turn`` s after T0."""
    return Beat(42, 1, state, T0 + int(beat * S), T0 + int(turn * S))


def _judge(beat: Beat, now: float) -> Any:
    return judge(beat, T0 + int(now * S), frozen_after_s=3.0, hang_after_s=300.0)


# -- judge: frozen, blocked, exiting, starting -------------------------------------------------


def test_a_process_that_beats_and_turns_is_alive() -> None:
    assert _judge(_beat(READY, beat=10, turn=10), 12.9) is None


def test_no_heartbeat_past_liveness_x_interval_is_frozen() -> None:
    verdict = _judge(_beat(READY, beat=10, turn=10), 13.5)
    assert verdict.kind == "frozen"
    assert verdict.seconds == 3.5
    assert verdict.detail == (
        "no heartbeat for 3.500 s, over liveness x heartbeat_interval_s (3 s): it is stopped "
        "or deadlocked"
    )
    assert verdict.reason == "frozen: no heartbeat"


def test_a_blocked_loop_that_still_beats_is_busy_until_hang_after() -> None:
    # The thread beat a moment ago; the loop last turned 299 s ago, then 301 s ago.
    assert _judge(_beat(READY, beat=309.5, turn=10), 309) is None
    verdict = _judge(_beat(READY, beat=310.5, turn=10), 311)
    assert verdict.kind == "blocked"
    assert verdict.detail == (
        "its event loop has been blocked for 301.0 s, past hang_after_s (300 s); the stack "
        "that blocks it is in its log (event loop blocked)"
    )
    assert verdict.reason == "event loop blocked past hang_after_s"


def test_a_starting_process_is_left_to_its_start_up_deadline() -> None:
    # Imports hold the GIL and restores block the loop: neither counts before it is ready.
    assert _judge(_beat(STARTING, beat=0, turn=0), 10_000) is None


def test_an_exiting_process_has_hang_after_to_be_gone() -> None:
    # Its thread may have stopped with the interpreter's teardown: silence is not frozen here.
    assert _judge(_beat(EXITING, beat=0, turn=5), 304) is None
    verdict = _judge(_beat(EXITING, beat=0, turn=5), 306)
    assert verdict.kind == "exiting"
    assert verdict.detail == (
        "still exiting 301.0 s after its event loop ended, past hang_after_s (300 s)"
    )
    assert exit_reason(-9, hung=verdict.reason) == (
        "hung (still exiting past hang_after_s) and was killed"
    )


# -- the warning: once a stretch, once a site -------------------------------------------------


def _stack(*functions: str) -> traceback.StackSummary:
    return traceback.StackSummary.from_list(
        [("app.py", 10 + i, name, f"{name}()") for i, name in enumerate(functions)]
    )


def test_a_blocked_stretch_is_reported_once_when_it_reaches_warn_after() -> None:
    reporter = BlockReporter(5.0)
    taken: list[int] = []

    def stack() -> traceback.StackSummary:
        taken.append(1)
        return _stack("main", "handler", "parse")

    assert reporter.observe(T0 + 4 * S, T0, stack) is None
    assert taken == []  # the stack is taken only when a warning may be due
    blocked = reporter.observe(T0 + 5 * S, T0, stack)
    assert blocked is not None
    assert blocked.blocked_s == 5.0
    assert blocked.site == "app.py:12 in parse"
    assert reporter.observe(T0 + 9 * S, T0, stack) is None  # the same stretch, later
    assert taken == [1]


def test_one_warning_per_blocking_site() -> None:
    reporter = BlockReporter(5.0)
    parse = _stack("main", "handler", "parse")
    assert reporter.observe(T0 + 6 * S, T0, lambda: parse) is not None
    # A later stretch in the same functions (another line of them) is not reported again ...
    again = traceback.StackSummary.from_list([("app.py", 99, f.name, "") for f in parse])
    assert reporter.observe(T0 + 20 * S, T0 + 10 * S, lambda: again) is None
    # ... one elsewhere is.
    gc = _stack("main", "handler", "collect")
    later = reporter.observe(T0 + 40 * S, T0 + 30 * S, lambda: gc)
    assert later is not None and later.site == "app.py:12 in collect"


# -- the file, written by the process and read by its supervisor ------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


class Log:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append((event, fields))


@pytest.fixture
def heartbeat(run_dir: str) -> Iterator[tuple[Heartbeat, Clock, Log]]:
    clock, log = Clock(), Log()
    # A thread that never beats by itself here: the test calls beat().
    hb = Heartbeat(
        liveness_path(run_dir, "sleeper", 0),
        incarnation=3,
        interval_s=3600.0,
        warn_after_s=5.0,
        log=log,
        clock=clock,
    )
    hb.start()
    yield hb, clock, log
    hb.stop()


def test_the_record_says_who_wrote_it_and_in_which_state(
    heartbeat: tuple[Heartbeat, Clock, Log], run_dir: str
) -> None:
    hb, clock, _ = heartbeat
    path = os.path.join(run_dir, "liveness", "sleeper.0")
    assert hb.path == path
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert read_beat(path) == Beat(os.getpid(), 3, STARTING, T0, T0)
    clock.now += 2 * S
    hb.ready()
    assert read_beat(path) == Beat(os.getpid(), 3, READY, T0, T0 + 2 * S)
    clock.now += S
    hb.beat()
    assert read_beat(path) == Beat(os.getpid(), 3, READY, T0 + 3 * S, T0 + 2 * S)
    clock.now += S
    hb.exiting()
    assert read_beat(path) == Beat(os.getpid(), 3, EXITING, T0 + 3 * S, T0 + 4 * S)


def test_a_blocked_loop_is_logged_with_the_loop_threads_stack(
    heartbeat: tuple[Heartbeat, Clock, Log],
) -> None:
    hb, clock, log = heartbeat
    loop = asyncio.new_event_loop()
    try:
        hb.attach(loop)  # this thread is the loop's: its stack is the one reported
        hb.ready()
        clock.now += 4 * S
        hb.beat()
        assert log.warnings == []
        clock.now += 2 * S
        hb.beat()
    finally:
        hb.stop()
        loop.close()
    ((event, fields),) = log.warnings
    assert event == "event loop blocked"
    assert fields["blocked_s"] == 6.0
    assert fields["warn_after_s"] == 5.0
    assert fields["site"].endswith("in _loop_stack")  # where the stack was read, on this thread
    assert "in test_a_blocked_loop_is_logged_with_the_loop_threads_stack" in fields["stack"]


def test_a_stale_or_foreign_file_is_not_read_as_this_incarnations(run_dir: str) -> None:
    path = liveness_path(run_dir, "r", 0)
    watch = Watch(path, 42, 1, frozen_after_s=3.0, hang_after_s=300.0)
    assert watch.check(T0) is None and not watch.beating  # no file yet
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:  # the previous incarnation's record
        f.write(struct.pack("=8q", 0x61_73_79_6E_63_72_6C_31, 41, 0, READY, 0, 0, 0, 0))
    assert watch.check(T0) is None and not watch.beating
    with open(path, "wb") as f:  # not a liveness file
        f.write(b"x" * 64)
    assert read_beat(path) is None
    with open(path, "wb") as f:
        f.write(struct.pack("=8q", 0x61_73_79_6E_63_72_6C_31, 42, 1, STARTING, T0, T0, 0, 0))
    assert watch.check(T0 + 60 * S) is None
    assert watch.beating and not watch.ready
    with open(path, "wb") as f:
        f.write(struct.pack("=8q", 0x61_73_79_6E_63_72_6C_31, 42, 1, READY, T0, T0, 0, 0))
    verdict = watch.check(T0 + 4 * S)
    assert watch.ready and verdict is not None and verdict.kind == "frozen"


# -- the defaults -------------------------------------------------------------------------------


def test_the_defaults_keep_a_busy_process_far_from_a_kill() -> None:
    policy = Supervision()
    assert (policy.liveness, policy.heartbeat_interval_s) == (LIVENESS, 1.0) == (10, 1.0)
    assert (policy.warn_after_s, policy.hang_after_s) == (WARN_AFTER_S, HANG_AFTER_S)
    assert (policy.warn_after_s, policy.hang_after_s) == (5.0, 300.0)
