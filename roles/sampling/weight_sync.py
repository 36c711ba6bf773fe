"""Weight sync: after each learner step, every rollout replica loads the newest weights.

``WeightSync`` asks the rollout group (its handle's ``broadcast``) to load the newest version
from the weight store; in sync mode it waits until every replica holds it, in async mode the
broadcast runs in the background. Used by the control-flow programs next to the
``SamplePipeline`` (``asyncrl.roles.sampling.pipeline``).

Across hosts, the rollout replicas of a host without the learner read a per-host relay's store
(``asyncrl.roles.services.relay``). ``WeightSync`` then pushes to the relay groups first and to the
rollout group after, in sync and in async mode alike, so a replica that syncs never finds its
host's store older than the version pushed. ``relay_groups`` says which roles are relays.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from asyncrl.clock import MONOTONIC, Clock
from asyncrl.dispatch.background import Background
from asyncrl.errors import StallError

__all__ = ["Broadcaster", "WeightSync", "relay_groups"]

log = logging.getLogger("asyncrl.weight_sync")

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
    and a replica that missed a version takes the next.

    The background pushes run in one ``asyncio.TaskGroup`` (``asyncrl.dispatch.background``): the
    first that fails cancels the others, and is raised by the next ``push`` or by ``close`` (which
    waits for the pushes in flight). Use it as an async context manager, or call ``close``.

    With ``relays``, every push and ``ensure`` first has each relay group hold the version
    (their ``sync``, asked again like a replica that lags), then the rollout group: a rollout
    replica on a relay's host never reads a version older than the relay's.

    Args:
        rollout: the rollout group's handle.
        wait: sync mode (wait for every replica) or async mode (push in the background).
        method: the rollout endpoint that loads the newest weights and answers its version.
        timeout: seconds for one broadcast, and for ``ensure`` to see the version.
        clock: what ``ensure`` waits on between asks (a test passes a ``FakeClock``).
        relays: the handles of the relay groups (``relay_groups``), pushed to first.
        relay_method: the relays' endpoint that pulls the newest version and answers it.
    """

    def __init__(
        self,
        rollout: Broadcaster,
        *,
        wait: bool,
        method: str = "sync",
        timeout: float = 600.0,
        clock: Clock = MONOTONIC,
        relays: Sequence[Broadcaster] = (),
        relay_method: str = "sync",
    ) -> None:
        self.rollout = rollout
        self.relays = tuple(relays)
        self.relay_method = relay_method
        self.wait = wait
        self.method = method
        self.timeout = timeout
        self.clock = clock
        self._background = Background("weight sync")
        self._raised: BaseException | None = None  # the failure push raised already

    async def __aenter__(self) -> WeightSync:
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        await self.close(raise_failure=exc is None)

    async def push(self, payload: Any = None, *, version: int | None = None) -> None:
        """Have every replica load the newest weights; in sync mode, wait until each holds at
        least ``version`` (when given).

        Raises:
            StallError: sync mode, and some replica still holds older weights after
                ``timeout`` seconds.
            The first failure of an earlier background push.
        """
        failure = self._background.failure
        if failure is not None:
            self._raised = failure
            raise failure
        if self.wait:
            await self.ensure(version, payload)
            return
        await self._background.start()
        self._background.spawn(self._broadcast(payload))

    async def _broadcast(self, payload: Any) -> None:
        for relay in self.relays:
            await relay.broadcast(self.relay_method, None, timeout=self.timeout)
        await self.rollout.broadcast(self.method, payload, timeout=self.timeout)

    async def ensure(self, version: int | None, payload: Any = None) -> list[Any]:
        """Broadcast until every replica answers with a version of at least ``version``;
        return the rollout replicas' versions. ``None`` asks once, whatever they answer. The
        relays, when there are any, are brought to ``version`` first.

        Raises:
            StallError: a relay or a replica still holds older weights after ``timeout``
                seconds.
        """
        deadline = self.clock.now() + self.timeout
        for relay in self.relays:
            await self._reach(relay, self.relay_method, None, version, deadline, "relays")
        return await self._reach(
            self.rollout, self.method, payload, version, deadline, "rollout replicas"
        )

    async def _reach(
        self,
        group: Broadcaster,
        method: str,
        payload: Any,
        version: int | None,
        deadline: float,
        what: str,
    ) -> list[Any]:
        """Broadcast ``method`` to ``group`` until each answers at least ``version``."""
        while True:
            versions = await group.broadcast(method, payload, timeout=self.timeout)
            if version is None or min((int(v) for v in versions), default=version) >= version:
                return versions
            if self.clock.now() >= deadline:
                raise StallError(
                    f"{what} hold weights versions {versions} after {self.timeout:g} s, not "
                    f"version {version}: the publisher's store never came back (is the "
                    f"learner restarting over and over?)"
                )
            await self.clock.sleep(_RESYNC_S)

    async def close(self, *, raise_failure: bool = True) -> None:
        """Wait for the pushes in flight.

        Raises:
            The first push that failed, unless ``push`` raised it already or
            ``raise_failure`` is false (then it is logged: the caller is raising another error).
        """
        failure = await self._background.close(cancel=False)
        if failure is None or failure is self._raised:
            return
        if raise_failure:
            self._raised = failure
            raise failure
        log.error("weight sync: a background push had failed", exc_info=failure)


def relay_groups(config: Mapping[str, Any], roles: Mapping[str, Any]) -> list[str]:
    """The names of the run's relay groups, which ``WeightSync`` pushes to first.

    ``config["relays"]`` (the manifest's ``run.config.relays``) lists them; when it is absent,
    a role named ``relay`` is the relay, if the run has one.

    Args:
        config: the program's config (the manifest's ``run.config``).
        roles: the run's role groups by name (``Context.roles``).

    Raises:
        ValueError: ``relays`` is not a list of names, or names a role the run lacks.
    """
    names = config.get("relays")
    if names is None:
        return ["relay"] if "relay" in roles else []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"run.config.relays: expected a list of role names, got {names!r}")
    missing = [n for n in names if n not in roles]
    if missing:
        known = ", ".join(sorted(roles)) or "none"
        raise ValueError(
            f"run.config.relays: no role named {', '.join(map(repr, missing))} in the run "
            f"(roles: {known}); list the relay roles, or remove relays"
        )
    return list(names)
