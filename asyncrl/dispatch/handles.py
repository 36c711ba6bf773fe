"""Handles: what a control-flow program holds for each role group.

    async def main(ctx):
        reward, rollout, worker = ctx.roles["reward"], ctx.roles["rollout"], ctx.roles["worker"]
        answer = await reward.call("score", sample)                   # one replica
        versions = await rollout.broadcast("set_weights", w)          # every replica
        async for key, result in worker.map("work", items):           # as they complete
            ...

Independent calls run concurrently (``asyncio.gather``, or ``map``). Every call goes through the
one credit-based dispatcher, so a fast replica takes more work and nothing waits at a barrier;
where it goes and what becomes of it when it fails is ``asyncrl.dispatch.scheduler``.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator, Mapping
from importlib.metadata import entry_points
from typing import Any

import msgspec

from asyncrl.dispatch.dispatcher import Dispatcher, Group, Work
from asyncrl.dispatch.restarts import Restarts
from asyncrl.dispatch.scheduler import SHUTTING_DOWN
from asyncrl.dispatch.watchdog import Watchdog
from asyncrl.errors import BrokenError, ClosedError, ConfigProblem, RoleDeadError
from asyncrl.manifest.model_section import ModelSpec, inherited_config
from asyncrl.manifest.pipeline_section import PipelineSpec
from asyncrl.observe.metrics import IdleFractions
from asyncrl.restart_request import RestartAnswer, RestartRequest
from asyncrl.transport.control import run_api_key

__all__ = ["Context", "Handle", "Roles"]

DEFAULT_TIMEOUT_S = 60.0


class Handle:
    """Calls into one role group; ``restarts``: the line to the supervisor that
    ``restart_replica`` asks (None outside a run)."""

    def __init__(
        self, group: Group, watchdog: Watchdog | None = None, restarts: Restarts | None = None
    ) -> None:
        self._group = group
        self._watchdog = watchdog
        self._restarts = restarts
        self._in_flight: dict[Work, float] = {}  # work -> when it was submitted
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the calls
        if watchdog is not None:
            watchdog.watch(f"role {group.name}", self.describe_in_flight)

    @property
    def name(self) -> str:
        return self._group.name

    @property
    def replicas(self) -> int:
        return len(self._group.replicas)

    @property
    def members(self) -> list[int]:
        """The replicas still in the run (none of them departed with a lost node)."""
        return self._group.scheduler.members()

    def _work(
        self,
        method: str,
        payload: Any,
        reply_type: Any,
        timeout: float,
        *,
        key: Any = None,
        target: int | None = None,
        affinity: Any = None,
        avoid: int = -1,
        settle: bool = True,
    ) -> Work:
        """A call's ``Work``, counted in flight until it settles: by a callback on its future
        (``settle``), or by the caller, which pops it itself (``call``: one callback less a
        call)."""
        loop = self._loop  # asyncio.get_running_loop makes a system call (getpid) each time
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        work = Work(
            method,
            payload,
            reply_type,
            timeout,
            loop.time() + timeout,
            loop.create_future(),
            key=key,
            target=target,
            affinity=affinity,
            avoid=avoid,
        )
        self._in_flight[work] = loop.time()
        if settle:
            work.future.add_done_callback(functools.partial(self._settled, work))
        return work

    def _settled(self, work: Work, future: asyncio.Future[Any]) -> None:
        self._in_flight.pop(work, None)
        if self._watchdog is not None and not future.cancelled() and future.exception() is None:
            self._watchdog.progress()

    def describe_in_flight(self) -> str:
        """The calls in flight to this group, oldest first: method, replica, age."""
        if not self._in_flight:
            return ""
        now = asyncio.get_running_loop().time()
        calls: dict[tuple[str, str], list[float]] = {}
        for work, since in self._in_flight.items():
            where = "any replica" if work.target is None else f"replica {work.target}"
            state = "sent to" if work.sent else "queued for"
            calls.setdefault((work.method, f"{state} {where}"), []).append(now - since)
        parts = [
            f"{len(ages)} x {method} ({where}, oldest {max(ages):.0f} s)"
            for (method, where), ages in sorted(calls.items(), key=lambda kv: -max(kv[1]))
        ]
        return "; ".join(parts)

    async def call(
        self,
        method: str,
        payload: Any = None,
        reply_type: Any = Any,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        key: Any = None,
        affinity: Any = None,
        replica: int | None = None,
        avoid: int | None = None,
    ) -> Any:
        """Call ``method`` on whichever replica has room; return its reply.

        Calls with the same ``affinity`` key prefer the replica the first of them went to
        (an idle replica still steals them; see ``asyncrl.dispatch.scheduler``). ``replica`` sends
        the call to that replica only (one that alone can answer it: a sharded learner's first).
        ``avoid`` sends it to any other replica that has room, before that one (a call that
        repeats one the replica failed, as a retry does).

        Raises:
            DeadlineExceededError: no reply within ``timeout`` seconds (names role and replica).
            RemoteError: the role raised; ``code`` and ``remote_type`` say what.
            BrokenError: a once endpoint's replica died with the call in flight.
            RoleDeadError: the run is shutting down; nothing will answer the call.
        """
        work = self._work(
            method,
            payload,
            reply_type,
            timeout,
            key=key,
            affinity=affinity,
            target=replica,
            avoid=-1 if avoid is None else avoid,
            settle=False,
        )
        self._group.submit(work)
        try:
            result = await work.future
        except ClosedError as exc:  # as _outcome, without a coroutine more per call
            raise RoleDeadError(self.name, SHUTTING_DOWN) from exc
        finally:
            self._in_flight.pop(work, None)
        if self._watchdog is not None:
            self._watchdog.progress()
        return result

    async def restart_replica(
        self, replica: int, reason: str, *, incarnation: int | None = None
    ) -> RestartAnswer:
        """Ask the supervisor to restart replica ``replica``, which is alive but no good (it
        fails its work), because of ``reason`` (logged, and shown by ``asyncrl status``): its
        process is stopped and a fresh one started from its durable state, as after a crash,
        without spending its restart budget (``asyncrl.restart_request``). ``incarnation``:
        only if that incarnation still runs. Calls in flight to it fail as on a crash (a
        retried call runs again elsewhere).

        Returns:
            The supervisor's answer: restarted, or refused and why (``RestartAnswer``).

        Raises:
            ValueError: ``replica`` is not one of the group's, or ``reason`` is empty.
            ClosedError: the handle has no supervisor to ask (it was made outside a run).
            TransportError: the node agent did not answer (the run is ending).
        """
        if not 0 <= replica < self.replicas:
            raise ValueError(
                f"restart_replica: {self.name} has replicas 0 to {self.replicas - 1}, not {replica}"
            )
        request = RestartRequest(
            role=self.name,
            replica=replica,
            reason=reason,
            incarnation=-1 if incarnation is None else incarnation,
        )
        problem = request.problem()
        if problem:
            raise ValueError(f"restart_replica: {problem}")
        if self._restarts is None:
            raise ClosedError(
                f"restart_replica: the handle of {self.name} has no supervisor to ask; only a "
                "program run by asyncrl (its driver) can restart replicas"
            )
        return await self._restarts.restart(request)

    async def broadcast(
        self,
        method: str,
        payload: Any = None,
        reply_type: Any = Any,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> list[Any]:
        """Call ``method`` on every replica still in the run; return the replies in replica
        order. A replica whose node was lost for good has left the run and is not called (its
        group's ``members``); a group none of whose replicas is left answers ``[]``. One that
        leaves while the call is on its way (``RoleDeadError``) or in flight (``BrokenError``:
        its node went silent mid-call) is left out of the replies, as if it had left before.

        Raises:
            The first error of any replica still in the run, as ``call`` does.
        """
        works = [self._work(method, payload, reply_type, timeout, target=i) for i in self.members]
        for work in works:
            self._group.submit(work)
        futures = (w.future for w in works)
        replies = await asyncio.gather(*futures, return_exceptions=True)
        members = set(self.members)
        out: list[Any] = []
        for work, reply in zip(works, replies, strict=True):
            if isinstance(reply, RoleDeadError | BrokenError) and work.target not in members:
                continue  # it departed with its node while the call was on its way or in flight
            if isinstance(reply, ClosedError):
                raise RoleDeadError(self.name, SHUTTING_DOWN) from reply
            if isinstance(reply, BaseException):
                raise reply
            out.append(reply)
        return out

    async def map(
        self,
        method: str,
        items: Iterable[Any],
        reply_type: Any = Any,
        *,
        keys: Iterable[Any] | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> AsyncIterator[tuple[Any, Any]]:
        """Call ``method`` once per item; yield ``(key, reply)`` as each completes.

        Keys are the items' stable ids (their index by default) and must be unique: each key
        is yielded exactly once, even when its request ran more than once.

        Raises:
            ValueError: two items share a key.
            The first error of any item, as ``call`` does; the other items are cancelled.
        """
        items = list(items)
        key_list = list(range(len(items))) if keys is None else list(keys)
        if len(key_list) != len(items):
            raise ValueError(f"map got {len(items)} items but {len(key_list)} keys")
        if len(set(map(_hashable, key_list))) != len(key_list):
            raise ValueError("map keys must be unique: each is the stable id of one result")
        done: asyncio.Queue[Work] = asyncio.Queue()
        works = []
        for key, item in zip(key_list, items, strict=True):
            work = self._work(method, item, reply_type, timeout, key=key)
            work.future.add_done_callback(functools.partial(_put, done, work))
            works.append(work)
        for work in works:
            self._group.submit(work)
        try:
            for _ in range(len(works)):
                work = await done.get()
                yield work.key, await self._outcome(work.future)
        finally:
            for work in works:
                if not work.future.done():
                    work.future.cancel()

    async def _outcome(self, waiting: Awaitable[Any]) -> Any:
        """What ``waiting`` (the futures of calls) gives. The scheduler itself fails calls
        with ``RoleDeadError`` once the dispatcher closes; a ``ClosedError`` that still reaches
        here (a client closed under a call) means the same."""
        try:
            return await waiting
        except ClosedError as exc:
            raise RoleDeadError(self.name, SHUTTING_DOWN) from exc


def _role_class(name: str, target: str) -> Any:
    """The class a manifest's ``class`` names: ``module:Class`` or an entry point of the group
    ``asyncrl.roles``; None for an external ``command`` role.

    Raises:
        ConfigProblem: it cannot be imported.
    """
    if not target:
        return None
    try:
        if ":" in target:
            module, _, attr = target.partition(":")
            return getattr(importlib.import_module(module), attr)
        (point,) = [e for e in entry_points(group="asyncrl.roles") if e.name == target]
        return point.load()
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigProblem(f"roles.{name}.class {target!r} cannot be imported: {exc}") from exc


def _put(queue: asyncio.Queue[Work], work: Work, future: asyncio.Future[Any]) -> None:
    queue.put_nowait(work)


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list | tuple) else key


class Roles(Mapping[str, Handle]):
    """The run's role groups by their manifest names: ``ctx.roles["rollout"]`` is the rollout
    group's handle, ``"critic" in ctx.roles`` asks whether the run has one.

    Raises (``[]``):
        KeyError: the run has no role of that name (the message lists the roles it has).
    """

    def __init__(self, handles: Mapping[str, Handle]) -> None:
        self._handles = dict(handles)

    def __getitem__(self, name: str) -> Handle:
        try:
            return self._handles[name]
        except KeyError:
            known = ", ".join(sorted(self._handles)) or "none"
            raise KeyError(f"no role {name!r} in this run; the roles are: {known}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._handles)

    def __len__(self) -> int:
        return len(self._handles)

    def __repr__(self) -> str:
        return f"Roles({sorted(self._handles)})"


class Context:
    """What the control-flow program receives: a handle per role group, and the run's facts.

    A role is reached one way: ``ctx.roles[name]``, its group's ``Handle`` (``Roles``), by the
    name the manifest gives it; the built-in roles also have typed clients
    (``asyncrl.roles.program.clients.RLContext``, a ``Run``'s ``run.rl``), each over that same
    handle. The roles are a mapping apart from the run's facts, so that every name the manifest
    allows reaches its role (``my-env`` and ``2nd`` too, which are no Python attribute), a name
    chosen at run time reaches it the same way (``ctx.roles[cfg["verifier"]]``), no role name
    can clash with an attribute of the context (a role called ``config``, ``model`` or ``run`` is
    ``ctx.roles["config"]``, and ``ctx.config`` stays the run's config), and a checker types both:
    ``ctx.roles[...]`` is a ``Handle``, and a misspelt attribute of the context is an error.

    ``ctx.config`` is the manifest's ``run.config``; ``ctx.pipeline`` its ``pipeline`` section
    (``asyncrl.manifest.pipeline_section.PipelineSpec``); ``ctx.run_dir`` is where the program
    writes its outputs; ``ctx.watchdog`` fails the run when nothing progresses for
    ``pipeline.stall_timeout_s`` (a program may ``watch`` its own waits, so the failure says on what
    it waited); ``ctx.incarnation`` is the driver's restart count (0 on a fresh start: a program
    resumes from its checkpoint when it is not); ``ctx.api_key`` is the run's API key (what the
    program's OpenAI-compatible endpoint requires); ``ctx.idle()`` is each role's idle fraction
    since the previous ``ctx.idle()`` (a step's, when the program calls it once a step;
    ``asyncrl.observe.metrics.IdleFractions``).

    The manifest's other sections, typed: ``ctx.model`` is its ``model`` section
    (``asyncrl.manifest.model_section.ModelSpec``: ``path``, ``config``, ``tokenizer``), and
    ``ctx.role_config(name)`` the ``config`` of role ``name`` as the role's own process sees
    it, the model section's fields filled in and converted to its ``Config`` class.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        run: str,
        run_dir: str,
        log: Any,
        config: dict[str, Any] | None = None,
        pipeline: PipelineSpec | None = None,
        watchdog: Watchdog | None = None,
        incarnation: int = 0,
        model: Mapping[str, Any] | None = None,
        roles: Mapping[str, Mapping[str, Any]] | None = None,
        restarts: Restarts | None = None,
    ) -> None:
        self.run = run
        self.run_dir = run_dir
        self.log = log
        self.config = config or {}
        self.pipeline = pipeline or PipelineSpec()
        self.watchdog = watchdog or Watchdog(0)
        self.incarnation = incarnation
        self.roles = Roles(
            {
                name: Handle(group, self.watchdog, restarts)
                for name, group in dispatcher.groups.items()
            }
        )
        self._idle = IdleFractions(dispatcher.busy)
        self.model = msgspec.convert(dict(model or {}), ModelSpec)
        self._roles = {name: dict(role) for name, role in (roles or {}).items()}

    @property
    def api_key(self) -> str | None:
        """The run's API key, which the program's HTTP endpoints (the OpenAI-compatible one)
        require; the node agent writes it into ``RUN_DIR/api_key`` (0600) for agents outside
        the run. None outside a run."""
        return run_api_key()

    def role_config(self, name: str, config_type: Any = None) -> Any:
        """The ``config`` of role ``name``, as its process sees it: the manifest's mapping,
        with the fields it leaves unset that the ``model`` section fills (``tokenizer_path``,
        ``model_path``, ``model_config``: ``asyncrl.manifest.model_section``), converted to
        ``config_type``.

        Args:
            name: the role's name in the manifest.
            config_type: a msgspec Struct, dataclass or annotated class; None: the role
                class's ``Config`` (its module is imported here, which may take seconds: call
                it once, before the loop), or a plain dict for a role without one.

        Raises:
            KeyError: the run has no role ``name`` (the message lists them).
            ConfigProblem: the config does not convert to the type (the message names the
                field), or the role's class cannot be imported.
        """
        if name not in self._roles:
            known = ", ".join(sorted(self._roles)) or "none"
            raise KeyError(f"no role {name!r} in this run's manifest; the roles are: {known}")
        role = self._roles[name]
        raw = dict(role.get("config") or {})
        if config_type is None:
            config_type = getattr(_role_class(name, str(role.get("class") or "")), "Config", None)
        if config_type is None:
            return raw
        filled = inherited_config(raw, config_type, msgspec.to_builtins(self.model))
        try:
            return msgspec.convert(filled, config_type)
        except msgspec.ValidationError as exc:
            raise ConfigProblem(f"roles.{name}.config: {exc}") from exc

    def idle(self) -> dict[str, float]:
        """Each role's idle fraction since the previous call: the share of the time in which
        its replicas had no call of this program in flight, averaged over its replicas."""
        return self._idle()
