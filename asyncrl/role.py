"""Roles: a plain class with async endpoint methods, each declaring its delivery class.

A role holds only its logic. The process wrapper (``asyncrl.supervision.process``) owns the event
loop, the inbox, heartbeats, logging and shutdown, so a test can build a role with
``RoleContext.local()`` and call its methods in-process::

    class Doubler(Role):
        class Config(msgspec.Struct):
            factor: int = 2

        @endpoint(Delivery.IDEMPOTENT)
        async def double(self, x: int) -> int:
            return x * self.config.factor

Heavy compute goes through ``self.ctx.offload(fn, ...)``, which runs it in the role's worker
thread, so the event loop keeps answering heartbeats.
"""

from __future__ import annotations

import asyncio
import atexit
import enum
import inspect
import logging
import os
import shutil
import tempfile
import typing
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgspec

from asyncrl.errors import ConfigProblem
from asyncrl.role_config import unknown_config_keys

__all__ = [
    "Delivery",
    "EndpointSpec",
    "Role",
    "RoleContext",
    "endpoint",
    "endpoints_of",
]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


class Delivery(enum.StrEnum):
    """How a caller may deliver requests to an endpoint.

    - ``idempotent``: at least once. A request whose replica dies or misses its deadline runs
      again elsewhere; the consumer counts each result once by its stable id.
    - ``once``: never retried automatically; a failure reaches the caller as a typed error.
    - ``latest``: only the newest value matters; a queued older call is replaced by a newer one.
    """

    IDEMPOTENT = "idempotent"
    ONCE = "once"
    LATEST = "latest"


@dataclass(frozen=True)
class EndpointSpec:
    """An endpoint method: its wire name, delivery class and payload types."""

    name: str
    attr: str
    delivery: Delivery
    request_type: Any
    reply_type: Any


_MARK = "__asyncrl_endpoint__"


def endpoint(
    delivery: Delivery = Delivery.IDEMPOTENT, *, name: str | None = None
) -> Callable[[F], F]:
    """Mark an async method of a Role as an endpoint with the given delivery class.

    The method takes one payload argument; its annotation is the type the payload is decoded
    as, and the return annotation the reply's type.

    Raises:
        TypeError: the method is not ``async def``.
    """

    def mark(fn: F) -> F:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"endpoint {fn.__qualname__} must be an async method")
        setattr(fn, _MARK, (name or fn.__name__, Delivery(delivery)))
        return fn

    return mark


def endpoints_of(cls: type) -> dict[str, EndpointSpec]:
    """Every endpoint of a role class, by wire name.

    Raises:
        TypeError: an endpoint does not take exactly one payload argument.
    """
    out: dict[str, EndpointSpec] = {}
    for attr, fn in inspect.getmembers(cls, inspect.iscoroutinefunction):
        mark = getattr(fn, _MARK, None)
        if mark is None:
            continue
        wire_name, delivery = mark
        params = list(inspect.signature(fn).parameters.values())[1:]
        if len(params) != 1:
            raise TypeError(
                f"endpoint {cls.__name__}.{attr} must take exactly one payload argument "
                f"after self, got {len(params)}"
            )
        hints = typing.get_type_hints(fn)
        out[wire_name] = EndpointSpec(
            wire_name, attr, delivery, hints.get(params[0].name, Any), hints.get("return", Any)
        )
    return out


@dataclass
class RoleContext:
    """What a role knows about where it runs.

    Attributes:
        name: the role's name in the manifest.
        replica: this replica's index.
        incarnation: how many times this replica has been restarted.
        run: the run's name.
        run_dir: the run directory (checkpoints, ledgers, logs live under it).
        node_dir: the folder of the node this replica runs on now, where that is not
            ``run_dir`` (a replica moved off a lost node keeps its home node's folder as
            ``run_dir``); empty: ``run_dir``. ``node_folder`` gives the one to use.
        config: the role's validated config (an instance of the role's ``Config``), or a dict.
        threads: CPU threads this process may use for compute.
        device: the placement's device string.
        capacity: requests one replica works on at once.
        replicas: how many replicas the role has.
        members: the replicas of its data-parallel group that run now, in rank order, once the
            group went on at a smaller size after a node's loss (docs/multinode.md); empty: all
            ``replicas``. ``group_rank`` and ``group_size`` follow from it.
        formation: which formation of its data-parallel group over several nodes this
            incarnation joins (``ProcessSpec.formation``): each shrink or growth of the group
            is a new one; it names the group's rendezvous with ``members``.
        groups: every role group of the run by name (``asyncrl.manifest.spec.GroupInfo``: endpoints
            as seen from this node), for a role that calls another.
    """

    name: str = "role"
    replica: int = 0
    incarnation: int = 0
    run: str = "local"
    run_dir: str = "."
    node_dir: str = ""
    config: Any = None
    threads: int = 1
    device: str = "cpu"
    capacity: int = 1
    replicas: int = 1
    members: list[int] = field(default_factory=list)
    formation: int = 0
    groups: dict[str, Any] = field(default_factory=dict)
    log: Any = field(default_factory=lambda: logging.getLogger("asyncrl.role"))
    _executor: ThreadPoolExecutor | None = field(default=None, repr=False)

    @classmethod
    def local(cls, config: Any = None, **kw: Any) -> RoleContext:
        """A context for calling a role in-process (tests, notebooks).

        Without ``run_dir``, the role's files (checkpoints, ledgers) go to a fresh temporary
        directory, removed at exit, never into the working directory.
        """
        if "run_dir" not in kw:
            kw["run_dir"] = tempfile.mkdtemp(prefix="asyncrl-local-")
            atexit.register(shutil.rmtree, kw["run_dir"], ignore_errors=True)
        return cls(config=config, **kw)

    @property
    def node_folder(self) -> str:
        """The folder of the node this replica runs on now: its ``membership.json`` says how
        the run's membership stands as this node sees it (``asyncrl.manifest.membership``)."""
        return self.node_dir or self.run_dir

    @property
    def group_size(self) -> int:
        """The size of this replica's data-parallel group now (its world size)."""
        return len(self.members) if self.members else self.replicas

    @property
    def group_rank(self) -> int:
        """This replica's rank in its data-parallel group now."""
        return self.members.index(self.replica) if self.members else self.replica

    async def offload(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` in this role's worker threads and return its result."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=max(1, self.capacity), thread_name_prefix=f"{self.name}-compute"
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def path(self, *parts: str) -> str:
        """A path under this role's own directory in the run directory (created on demand)."""
        base = os.path.join(self.run_dir, "roles", f"{self.name}.{self.replica}")
        os.makedirs(base, exist_ok=True)
        return os.path.join(base, *parts)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


class Role:
    """Base class of roles: wires endpoints, holds the context and the validated config.

    Subclasses may define ``Config`` (a msgspec Struct; the manifest's ``config`` mapping is
    validated against it) and override ``setup`` (restore state before taking work) and
    ``teardown``. A key the ``Config`` does not declare is refused (``ConfigProblem``), as is
    any key for a role without a ``Config``: a misspelt setting must not be silently ignored.
    """

    Config: ClassVar[type[Any] | None] = None

    def __init__(self, ctx: RoleContext) -> None:
        """Validate ``ctx.config`` against ``Config``.

        Raises:
            ConfigProblem: a key that ``Config`` does not declare (at any depth of nested
                Structs), or any key when the role has no ``Config``; the message names the key
                by its path (``roles.<name>.config.<key>``) and the keys accepted there.
            msgspec.ValidationError: a value ``Config`` refuses.
        """
        self.ctx = ctx
        if isinstance(ctx.config, Mapping):
            problems = unknown_config_keys(
                ctx.config, self.Config, f"roles.{ctx.name}.config", type(self).__name__
            )
            if problems:
                raise ConfigProblem("\n  ".join(problems))
        if self.Config is not None and not isinstance(ctx.config, self.Config):
            ctx.config = msgspec.convert(ctx.config or {}, self.Config)
        self.config: Any = ctx.config

    @classmethod
    def preload(cls, config: Mapping[str, Any]) -> None:
        """Import what ``setup`` will need, ahead of time, without touching any state.

        A standby process (``supervision.standby`` in the manifest) calls it while it waits to
        take over from a failed replica, so that the restart skips these imports. ``config``
        is the manifest's raw ``config`` mapping (not yet validated). The default imports
        nothing.
        """

    def status(self) -> dict[str, Any]:
        """Live facts this role reports to ``asyncrl status``, e.g. its device memory.

        The process wrapper answers them under the key ``"role"`` of its built-in ``_status``
        method, beside what it measures itself (calls served, seconds busy, calls in flight).
        Called on the event loop, so it must be quick: read counters, never compute. The
        values must be plain data (numbers, strings, lists, dicts, or msgspec Structs). A
        ``"memory"`` entry with the fields of ``asyncrl.plugins.contract.MemoryStats``
        (``allocated``, ``reserved``, ``peak``, ``total``, in bytes) shows as the memory column
        of ``asyncrl status``. The default reports nothing: ``{}``.
        """
        return {}

    async def setup(self) -> None:
        """Restore state before any request is taken; no credit is advertised until it returns."""

    async def teardown(self) -> None:
        """Release resources; called once when the process stops cleanly."""
