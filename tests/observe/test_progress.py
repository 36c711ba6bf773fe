"""The progress display (asyncrl.observe.progress): plain lines off a terminal, a live bar on
one."""

from __future__ import annotations

import io
import logging
import re

import pytest

from asyncrl.observe import progress
from asyncrl.observe.progress import Progress, format_eta, say

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_keep_their_pace_and_show_the_notable_steps_and_the_last() -> None:
    clock, out = FakeClock(), io.StringIO()
    with Progress("GRPO", 10, done=2, stream=out, plain_every_s=5, clock=clock) as shown:
        assert not shown.live  # a StringIO is no terminal
        for step in range(3, 11):
            clock.now += 2
            shown.update(step, {"reward": f"{step / 10:.3f}", "restarts": "0"}, notable=step == 4)
        say("BC plateau: held-out accuracy 0.500")
    assert out.getvalue().splitlines() == [
        # 7 steps left at 2 s a step (the 2 taken before the display started do not count)
        "GRPO 3/10  reward 0.300  restarts 0  ETA 0:00:14",
        "GRPO 4/10  reward 0.400  restarts 0  ETA 0:00:12",  # notable
        "GRPO 7/10  reward 0.700  restarts 0  ETA 0:00:06",  # 6 s after the last line
        "GRPO 10/10  reward 1.000  restarts 0  ETA 0:00:00",  # the last
        "BC plateau: held-out accuracy 0.500",
    ]


def test_the_eta_is_unknown_until_a_step_is_taken() -> None:
    clock = FakeClock()
    shown = Progress("PPO", 100, done=40, stream=io.StringIO(), clock=clock)
    assert shown.eta_s(40) is None
    clock.now += 30
    assert shown.eta_s(43) == pytest.approx(570.0)
    assert [format_eta(s) for s in (None, 0.4, 59.6, 3725.0)] == [
        "-:--:--",
        "0:00:00",
        "0:01:00",
        "1:02:05",
    ]


def test_on_a_terminal_the_bar_is_redrawn_and_log_lines_go_above_it() -> None:
    clock, out = FakeClock(), io.StringIO()
    handler = logging.StreamHandler(out)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with Progress("GRPO", 4, stream=out, terminal=True, clock=clock) as shown:
            assert shown.live and progress._shown is shown
            for step in (1, 2):
                clock.now += 1
                shown.update(step, {"reward": "0.250", "held-out": "-"})
                logging.getLogger("asyncrl.programs").warning("grpo step %d", step)
            say("a line of the program's")
        assert handler.stream is out  # given back
        assert progress._shown is None
    finally:
        root.removeHandler(handler)
    # Each redraw goes back to the start of the line (\r); a line printed meanwhile ends the bar's
    # line, and the bar is drawn again below it.
    seen = []
    for part in re.split(r"[\r\n]", ANSI.sub("", out.getvalue())):
        bar = re.match(r"GRPO \S+ (\d/4)", part)
        if bar or part:
            seen.append(f"bar {bar.group(1)}" if bar else part)
    assert seen == [
        "bar 0/4",
        "bar 1/4",
        "grpo step 1",
        "bar 1/4",
        "bar 2/4",
        "grpo step 2",
        "bar 2/4",
        "a line of the program's",
        "bar 2/4",
        "bar 2/4",  # left on the screen when the display closes
    ]
    assert "2/4 reward 0.250  held-out -" in ANSI.sub("", out.getvalue())
