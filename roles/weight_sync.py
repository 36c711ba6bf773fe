"""Weight sync: after each learner step, every rollout replica loads the newest weights.

``WeightSync`` asks the rollout group (its handle's ``broadcast``) to load the newest version
from the weight store; in sync mode it waits until every replica holds it, in async mode the
broadcast runs in the background. Used by the control-flow programs next to the
``SamplePipeline`` (``asyncrl.roles.pipeline``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from asyncrl.errors import StallError

__all__ = ["Broadcaster", "WeightSync"]

_RESYNC_S = 0.1  # between asks of a replica that still holds older weights


class Broadcaster(Protocol):
    """What ``WeightSync`` needs of the rollout group's handle."""

    async def broadcast(
        self, method: str, payload: Any = None, reply_type: Any = Any, *, timeout: float = ...
    ) -> list[Any]: ...


class WeightSync:
    """After each learner step, has every rollout replica load the newest weights.

    In sync mode ``push`` waits until every replica holds at least the version the learner
    reached (part of the barrier): a replica that answers with older weights (its publisher was
    restarting and had no store to read) is asked again until it has them, or until
    ``timeout``. In async mode it returns at once and the broadcast runs in the background; the
    endpoint is latest-wins, so a push queued behind a busy replica is replaced by the next one,
    and a replica that missed a version takes the next. A failed background push is raised by
    the next ``push`` or by ``close``.
    """

    def __init__(
        self, rollout: Broadcaster, *, wait: bool, method: str = "sync", timeout: float = 600.0
    ) -> None:
        self.rollout = rollout
        self.wait = wait
        self.method = method
        self.timeout = timeout
        self._tasks: set[asyncio.Task[list[Any]]] = set()
        self._failure: BaseException | None = None

    async def push(self, payload: Any = None, *, version: int | None = None) -> None:
        """Have every replica load the newest weights; in sync mode, wait until each holds at
        least ``version`` (when given).

        Raises:
            StallError: sync mode, and some replica still holds older weights after
                ``timeout`` seconds.
            The first failure of an earlier background push.
        """
        if self._failure is not None:
            raise self._failure
        if self.wait:
            await self.ensure(version, payload)
            return
        call = self.rollout.broadcast(self.method, payload, timeout=self.timeout)
        task = asyncio.get_running_loop().create_task(call)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    async def ensure(self, version: int | None, payload: Any = None) -> list[Any]:
        """Broadcast until every replica answers with a version of at least ``version``;
        return the versions. ``None`` asks once, whatever they answer.

        Raises:
            StallError: a replica still holds older weights after ``timeout`` seconds.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while True:
            versions = await self.rollout.broadcast(self.method, payload, timeout=self.timeout)
            if version is None or min(int(v) for v in versions) >= version:
                return versions
            if loop.time() >= deadline:
                raise StallError(
                    f"rollout replicas hold weights versions {versions} after "
                    f"{self.timeout:g} s, not version {version}: the publisher's store never "
                    f"came back (is the learner restarting over and over?)"
                )
            await asyncio.sleep(_RESYNC_S)

    def _done(self, task: asyncio.Task[list[Any]]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()

    async def close(self) -> None:
        """Wait for the pushes in flight; raise the first that failed."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._failure is not None:
            raise self._failure
