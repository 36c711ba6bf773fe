"""No silent stall: the driver's watchdog fails a run that stops making progress.

Every call a handle makes has a deadline, but a program can still wait on something that is not
a call: the sample pipeline's admission waits for the learner's version to move, a queue waits
for a producer that will never produce. The watchdog sees the run from above. Progress is any
call that completes (``progress()``, called by the handles); *sources* describe what the program
waits for right now (the handles list their calls in flight, the pipeline its state). When no
progress happens for ``timeout_s``, ``run()`` raises ``StallError`` with every source's
description, so the run fails saying on whom it waited, instead of hanging.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import NoReturn

from asyncrl.errors import StallError

__all__ = ["Watchdog"]


class Watchdog:
    """Fails the run when nothing progresses for ``timeout_s`` seconds.

    Args:
        timeout_s: seconds without progress after which ``run`` raises; 0 disables it.
        clock: seconds, monotonic (a test passes a fake one).
    """

    def __init__(self, timeout_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s < 0:
            raise ValueError(f"timeout_s: expected a number >= 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._clock = clock
        self._last = clock()
        self._sources: dict[str, Callable[[], str]] = {}

    def progress(self) -> None:
        """Something completed: the run is moving."""
        self._last = self._clock()

    def watch(self, name: str, describe: Callable[[], str]) -> None:
        """Add a source: ``describe()`` says what ``name`` waits for now ("" when nothing)."""
        self._sources[name] = describe

    def unwatch(self, name: str) -> None:
        self._sources.pop(name, None)

    @property
    def idle_s(self) -> float:
        """Seconds since the last progress."""
        return self._clock() - self._last

    def describe(self) -> str:
        """What every source waits for, one line each (sources waiting for nothing left out)."""
        lines = []
        for name, describe in self._sources.items():
            try:
                what = describe()
            except Exception as exc:  # a broken description must not hide the stall
                what = f"(cannot describe: {exc!r})"
            if what:
                lines.append(f"{name}: {what}")
        return "\n  ".join(lines) or "nothing in flight"

    def check(self) -> None:
        """Raise ``StallError`` if the run made no progress for ``timeout_s``.

        Raises:
            StallError: naming the idle time and what every source waits for.
        """
        idle = self.idle_s
        if self.timeout_s and idle > self.timeout_s:
            raise StallError(
                f"no progress for {idle:.0f} s (stall_timeout_s is {self.timeout_s:g}); "
                f"waiting for:\n  {self.describe()}\nThe run fails rather than hang: find the "
                f"process named above in the run's logs, or raise pipeline.stall_timeout_s if "
                f"a single step legitimately takes this long."
            )

    async def run(self) -> NoReturn:
        """Check periodically; return only by raising ``StallError`` (or being cancelled)."""
        if not self.timeout_s:
            await asyncio.Event().wait()
        interval = max(0.05, min(5.0, self.timeout_s / 10))
        while True:
            await asyncio.sleep(interval)
            self.check()
