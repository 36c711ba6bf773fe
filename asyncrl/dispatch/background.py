"""Background tasks with an owner: one ``asyncio.TaskGroup``, run in a task of its own.

An object that works in the background (the sample pipeline's samples and scoring, the weight
sync's pushes) owns that work through a ``Background``. Every task runs in one TaskGroup, so the
first one that fails cancels the others, and its error is kept for the owner, who raises it from
its next call (``failure``) and from ``close``: an error in the background is never only a log
line or a counter, and nothing is left running once the owner is closed. A callback that runs
outside the tasks (a timer, a reducer's release) reports its error with ``fail``, to the same
effect.

The TaskGroup runs in a task of its own rather than in the owner's caller, so that a failure
cancels the background work but not what the caller awaits meanwhile (a learner step); the
caller hears of it at its next call into the owner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["Background"]

T = TypeVar("T")


class Background:
    """The background tasks of one owner.

    Args:
        name: the owner, for task names (``"sample pipeline"``).
        on_stop: called when the tasks stop, failed or closed (to wake the owner's waiters).
    """

    def __init__(self, name: str, *, on_stop: Callable[[], None] | None = None) -> None:
        self.name = name
        self._on_stop = on_stop
        self._group: asyncio.TaskGroup | None = None
        self._runner: asyncio.Task[None] | None = None
        self._entered = asyncio.Event()
        self._stop = asyncio.Event()
        self._stopping = False
        self._closed = False
        self._failure: BaseException | None = None

    @property
    def started(self) -> bool:
        """``start`` was called."""
        return self._runner is not None

    @property
    def failure(self) -> BaseException | None:
        """The first error of a task (or reported with ``fail``); None while none failed."""
        return self._failure

    async def start(self) -> None:
        """Start the TaskGroup (or wait until the one already started runs); ``spawn`` may be
        called from then on."""
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(
                self._run(), name=f"{self.name}: background"
            )
            self._runner.add_done_callback(self._finished)
        await self._entered.wait()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T] | None:
        """Run ``coro`` as one of the tasks; None (and ``coro`` is closed, never run) once the
        tasks failed or are being closed: nothing new starts then (a task still running its
        last step before it is cancelled may ask), and a failure is the owner's to raise.

        Raises:
            RuntimeError: not started, or closed and done.
        """
        closed = self._closed and self._runner is not None and self._runner.done()
        if self._runner is None or closed:
            coro.close()
            state = "closed" if closed else "not started"
            raise RuntimeError(f"the background tasks of the {self.name} are {state}")
        if self._group is None or self._stopping:
            coro.close()
            return None
        try:
            task = self._group.create_task(self._watch(coro))
        except RuntimeError:  # the group is shutting down: a task failed a moment ago
            coro.close()
            return None
        # A task cancelled before its first step never awaits ``coro``: close it then, so it
        # is not reported as never awaited (closing a finished coroutine does nothing).
        task.add_done_callback(lambda _: coro.close())
        return task

    def fail(self, exc: BaseException) -> None:
        """Report an error from outside the tasks: it becomes the failure (unless one came
        first), and every task is cancelled."""
        if self._failure is None:
            self._failure = exc
        self._stopping = True
        if self._runner is not None and not self._runner.done():
            self._runner.cancel()

    async def close(self, *, cancel: bool = True) -> BaseException | None:
        """Cancel the tasks (or, with ``cancel=False``, wait for them to finish), wait until
        they are done, and return the failure, if any. Closing twice is harmless."""
        self._stopping = self._closed = True
        runner = self._runner
        if runner is not None and not runner.done():
            if cancel:
                runner.cancel()
            else:
                self._stop.set()
            await asyncio.wait([runner])
        return self._failure

    async def _watch(self, coro: Coroutine[Any, Any, T]) -> T:
        # The failure is known from the moment the task fails, not only once the group has
        # cancelled the others and ended: the owner's next call raises it even in between.
        try:
            return await coro
        except Exception as exc:
            if self._failure is None:
                self._failure = exc
            self._stopping = True
            raise

    async def _run(self) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            self._entered.set()
            await self._stop.wait()

    def _finished(self, runner: asyncio.Task[None]) -> None:
        self._group = None
        self._stopping = True
        error = None if runner.cancelled() else runner.exception()  # retrieved, always
        if self._failure is None:
            self._failure = _first_error(error)
        self._entered.set()  # a start() still waiting must not wait forever
        if self._on_stop is not None:
            self._on_stop()


def _first_error(exc: BaseException | None) -> BaseException | None:
    """The first error in ``exc``, looking into exception groups; cancellations do not count."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _first_error(inner)
            if found is not None:
                return found
        return None
    if isinstance(exc, asyncio.CancelledError):
        return None
    return exc
