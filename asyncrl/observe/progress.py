"""A progress display for long loops: a live bar on a terminal (``rich``), plain lines elsewhere.

On a terminal, ``Progress`` draws one line and redraws it at every step: the title, a bar,
``step/total``, the caller's fields and the time left::

    GRPO ━━━━━━━━━━╺━━━━━━━━━━━ 40/100 reward 0.412  held-out 0.734  samples/s 96.0  ETA 0:01:02

While it is shown, what this process prints to its stdout, its log lines included, goes above
it. When stdout is not a terminal (a file, a pipe, CI) it writes a plain line instead, at most
every ``plain_every_s`` seconds, and at the first step, every step the caller marks as notable
(an evaluation) and the last::

    GRPO 40/100  reward 0.412  held-out 0.734  samples/s 96.0  restarts 0  ETA 0:01:02

The ETA is the steps left at the pace of the steps taken since the display started (a resumed
loop's earlier steps do not count). ``say`` prints a line of the program's own: above the bar
when one is shown.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["Progress", "format_eta", "say"]

_shown: Progress | None = None  # the display shown now in this process, if any


def say(text: str) -> None:
    """Print ``text`` as a line of its own on stdout: above the progress bar when one is shown."""
    if _shown is not None:
        _shown.say(text)
    else:
        print(text, flush=True)


def format_eta(seconds: float | None) -> str:
    """``H:MM:SS``, or ``-:--:--`` when not known yet."""
    if seconds is None:
        return "-:--:--"
    whole = max(0, round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class Progress:
    """The progress of a loop of ``total`` steps, ``done`` of them taken before it started.

    Use it as a context manager; ``update`` after each step.

    Args:
        title: what runs (``GRPO``).
        total: the step the loop ends at.
        done: steps taken before (a resumed loop's).
        stream: where it writes (stdout by default).
        terminal: draw the live bar (True), write plain lines (False), or ask ``rich`` whether
            ``stream`` is a terminal (None).
        plain_every_s: the least time between two plain lines, notable steps and the last
            aside.
        clock: seconds, for the ETA and the plain lines' pace (a test passes a fake one).
    """

    def __init__(
        self,
        title: str,
        total: int,
        *,
        done: int = 0,
        stream: TextIO | None = None,
        terminal: bool | None = None,
        plain_every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from rich.console import Console

        self.title = title
        self.total = total
        self.done = done
        self.stream = stream if stream is not None else sys.stdout
        self.plain_every_s = plain_every_s
        self.clock = clock
        self.console = Console(file=self.stream, force_terminal=terminal, highlight=False)
        self.live = self.console.is_terminal and not self.console.is_dumb_terminal
        self._started = clock()
        self._printed_at: float | None = None
        self._bar: Any = None
        self._task: Any = None
        self._routed: list[tuple[logging.StreamHandler[Any], Any]] = []

    def __enter__(self) -> Progress:
        global _shown
        if self.live:
            self._bar = self._live_bar()
            self._task = self._bar.add_task(
                self.title, total=self.total, completed=self.done, info=""
            )
            self._bar.start()
            # rich hides the cursor while the bar is shown: a process killed meanwhile would
            # leave the terminal without one.
            self.console.show_cursor(True)
            self._route_logs()
        _shown = self
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Leave the last bar on the screen (live) and give the log lines their stream back."""
        global _shown
        if _shown is self:
            _shown = None
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        for handler, stream in self._routed:
            handler.setStream(stream)
        self._routed = []

    def eta_s(self, step: int) -> float | None:
        """Seconds left at the pace since the display started; None before a step was taken."""
        taken, elapsed = step - self.done, self.clock() - self._started
        if taken <= 0 or elapsed <= 0:
            return None
        return (self.total - step) * elapsed / taken

    def line(self, step: int, fields: dict[str, str]) -> str:
        """The plain line of ``step``."""
        parts = [f"{self.title} {step}/{self.total}", *(f"{k} {v}" for k, v in fields.items())]
        return "  ".join([*parts, f"ETA {format_eta(self.eta_s(step))}"])

    def update(self, step: int, fields: dict[str, str], *, notable: bool = False) -> None:
        """Show ``step`` with ``fields`` (label: value, in order); ``notable`` steps get a plain
        line whatever the pace."""
        info = "  ".join(f"{k} {v}" for k, v in fields.items())
        if self._bar is not None:
            self._bar.update(self._task, completed=step, info=info, refresh=True)
            return
        now = self.clock()
        due = self._printed_at is None or now - self._printed_at >= self.plain_every_s
        if due or notable or step >= self.total:
            self._printed_at = now
            print(self.line(step, fields), file=self.stream, flush=True)

    def say(self, text: str) -> None:
        """Print ``text`` as a line of its own (above the bar when it is shown)."""
        if self._bar is not None:
            self.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def _live_bar(self) -> Any:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as Bar

        return Bar(
            TextColumn("{task.description}", style="bold", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}", markup=False),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,
            auto_refresh=False,  # redrawn at each step: no thread, no redraw between steps
            redirect_stdout=self.stream is sys.stdout,
            redirect_stderr=False,
            get_time=self.clock,
        )

    def _route_logs(self) -> None:
        """Log handlers that write to this display's stream write above the bar instead."""
        from rich.file_proxy import FileProxy

        proxy = FileProxy(self.console, self.stream)
        for handler in logging.getLogger().handlers:
            if type(handler) is logging.StreamHandler and handler.stream is self.stream:
                self._routed.append((handler, handler.setStream(proxy)))
