"""Waiting on a condition in tests, always with a deadline.

A test waits on an event where it has one; where it can only observe state (a file a run
writes, a counter of a component), it polls with these, which fail with what was awaited,
and with the run's output when it is given, instead of hanging.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable

__all__ = ["wait_until", "wait_until_async"]


def wait_until(
    condition: Callable[[], object],
    *,
    timeout: float,
    what: str,
    proc: subprocess.Popen[str] | None = None,
    output: Callable[[], str] | None = None,
    interval: float = 0.05,
) -> None:
    """Return as soon as ``condition()`` is true.

    Raises:
        AssertionError: after ``timeout`` seconds, or as soon as ``proc`` (a run being watched)
            ends first, naming ``what`` and adding ``output()`` (or what ``proc`` printed).
            A process that outlives the deadline is killed.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        ended = proc is not None and proc.poll() is not None
        if ended or time.monotonic() > deadline:
            if proc is not None and not ended:
                proc.kill()
            why = "the run ended before" if ended else f"waited {timeout:g} s for"
            told = output() if output is not None else _printed(proc)
            raise AssertionError(f"{why} {what}" + (f"\n{told}" if told else ""))
        time.sleep(interval)


async def wait_until_async(
    condition: Callable[[], object], *, timeout: float, what: str, interval: float = 0.01
) -> None:
    """Return as soon as ``condition()`` is true, polling on the event loop.

    Raises:
        AssertionError: after ``timeout`` seconds, naming ``what``.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}")
        await asyncio.sleep(interval)


def _printed(proc: subprocess.Popen[str] | None) -> str:
    if proc is None or proc.stdout is None or proc.poll() is None:
        return ""
    return proc.stdout.read()
