"""The run watchdog, on a fake clock: progress keeps it quiet, silence fails the run with what
every source waits for."""

from __future__ import annotations

import pytest

from asyncrl.dispatch.watchdog import Watchdog
from asyncrl.errors import StallError
from asyncrl.roles.sampling.pacing import Pacer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_silence_past_the_timeout_raises_with_every_source() -> None:
    clock = Clock()
    dog = Watchdog(60, clock=clock)
    dog.watch("role learner", lambda: "1 x train_step (sent to any replica, oldest 61 s)")
    dog.watch("role reward", lambda: "")  # waits for nothing: left out
    clock.now += 59
    dog.check()
    dog.progress()
    clock.now += 59
    dog.check()  # progress reset the clock
    clock.now += 2
    with pytest.raises(StallError) as err:
        dog.check()
    text = str(err.value)
    assert text.startswith("no progress for 61 s (stall_timeout_s is 60); waiting for:\n")
    assert "role learner: 1 x train_step (sent to any replica, oldest 61 s)" in text
    assert "role reward" not in text


def test_zero_disables_it_and_a_broken_source_does_not_hide_the_stall() -> None:
    clock = Clock()
    off = Watchdog(0, clock=clock)
    clock.now += 1e9
    off.check()
    dog = Watchdog(1, clock=clock)

    def broken() -> str:
        raise KeyError("gone")

    dog.watch("pipeline", broken)
    clock.now += 2
    with pytest.raises(StallError, match=r"pipeline: \(cannot describe: KeyError\('gone'\)\)"):
        dog.check()
    with pytest.raises(ValueError, match="timeout_s: expected a number >= 0, got -1"):
        Watchdog(-1)


def test_a_version_that_goes_back_fails_pacing_loudly() -> None:
    pacer = Pacer(8, 1, start_version=5)
    pacer.advance(7)
    with pytest.raises(ValueError, match="went back from 7 to 6: it lost steps it had"):
        pacer.advance(6)
    pacer.advance(7)  # the same version again is fine
