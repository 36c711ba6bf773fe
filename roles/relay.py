"""The per-host weight relay: each new version crosses the network once per host, not once per
rollout replica.

The learner publishes its weights into a shared-memory store (``asyncrl.weights``), which only
processes on its own host can map. A host without a learner runs one ``Relay``: its ``sync``
endpoint asks the source (the publisher, ``source: learner``) for its version, and when that is
newer than the one it holds, pulls the weights from the source's ``weights`` endpoint over the
transport (tensor frames over tcp), republishes them into a ``WeightStore`` of its own host, and
writes the store's handle under the *source's* name in its own run directory
(``handle_path(run_dir, source)``). Rollout replicas of that host (``weights_from: learner``)
therefore read the relay's store exactly as they read the learner's on the learner's host.

- The source is replica 0 of its group (``ctx.groups[source].endpoints[0]``): with
  data-parallel learners, rank 0 publishes.
- A version the relay already holds is never pulled again: ``sync`` asks ``status`` first.
- The source restarting: the relay's client reconnects by itself, and a pull that failed with a
  recoverable error is tried again until ``source_wait_s`` passes. A source whose version went
  back (a learner that lost steps) gets a new store, which the rollouts reopen.
- The relay restarting: ``setup`` pulls the newest version into a new store and rewrites the
  handle, so the host's rollouts move to it at their next ``sync``.
- Every ``poll_s`` seconds (1 by default) the relay also syncs by itself, which costs one
  ``status`` call when nothing is new: a program that pushes to the rollouts only still gets
  the new versions to this host, a poll later.
- On the source's own host (the same ``asyncrl.transport.shm.host_id``), the relay copies
  nothing and writes nothing: the rollouts there read the learner's store itself, and ``sync``
  only answers the source's version. That holds for another node rank on the source's host too
  (two ranks on one machine): the launch links that node's ``weights`` folder to the host's
  first node's (``asyncrl.hosts``), so its rollouts find the learner's handle. A one-machine
  rehearsal gives each simulated node its own ``ASYNCRL_HOST_ID`` to make its relay really
  relay. One host without the source needs one relay: two would republish into one name.

Endpoints: ``sync(None) -> int`` (latest-wins: the version held after pulling the newest) and
``status(None) -> RelayStatus`` (idempotent). The control-flow programs push to the relays
before the rollout replicas (``asyncrl.roles.weight_sync.WeightSync``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec

from asyncrl.errors import AsyncrlError, ConfigProblem, StallError
from asyncrl.role import Delivery, Role, RoleContext, endpoint
from asyncrl.roles.rollout import WeightsUpdate
from asyncrl.transport import ChannelOptions, Client
from asyncrl.transport.shm import host_id
from asyncrl.weight_layout import check_names, check_tensor
from asyncrl.weights import NO_VERSION, WeightStore, handle_path, write_handle

__all__ = ["Relay", "RelayStatus"]

T = TypeVar("T")

_RETRY_S = 0.2  # between tries of a source that is restarting


class RelayStatus(msgspec.Struct):
    """What a relay's ``status`` endpoint says.

    Attributes:
        version: the version its store holds (``NO_VERSION``, -1, before the first pull).
        pulls: versions pulled over the network by this incarnation.
        bytes_pulled: the bytes of tensors those pulls carried.
        relaying: False on the source's own host, where it copies nothing.
        store: the name of its shared-memory segment ("" when it holds none).
        source: the role it relays.
    """

    version: int
    pulls: int
    bytes_pulled: int
    relaying: bool
    store: str
    source: str


class Relay(Role):
    """Pulls each new version of the source's weights once, over the transport, and republishes
    it into this host's shared-memory store for the host's rollout replicas."""

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        """The relay role's config (the manifest's ``config`` mapping).

        Attributes:
            source: the role that publishes the weights (its replica 0 is asked); the rollout
                replicas of this host name the same role in ``weights_from``.
            weights_method: the source's endpoint that answers a ``WeightsUpdate``.
            version_method: the source's endpoint that answers its version: an int, or a map
                with a ``version`` field (the learner's ``status``).
            timeout_s: seconds for one call to the source (a pull of large weights included).
            source_wait_s: how long a source that does not answer (restarting) is tried again
                before ``sync`` fails with ``StallError``.
            poll_s: seconds between two syncs the relay makes by itself, so that the host
                catches up with a program that pushes to the rollouts only (0: none; pushes
                to the relay first are what keep a replica from ever finding an older version).
        """

        source: str = "learner"
        weights_method: str = "weights"
        version_method: str = "status"
        timeout_s: float = 300.0
        source_wait_s: float = 300.0
        poll_s: float = 1.0

        def __post_init__(self) -> None:
            if not self.source:
                raise ValueError("source: name the role that publishes the weights (learner)")
            for name in ("timeout_s", "source_wait_s"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"{name}: expected a number > 0, got {getattr(self, name)}")
            if self.poll_s < 0:
                raise ValueError(f"poll_s: expected a number >= 0, got {self.poll_s}")

    def __init__(self, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.store: WeightStore | None = None
        self.pulls = 0
        self.bytes_pulled = 0
        self.relaying = True
        self._client: Client | None = None
        self._endpoint = ""
        self._options = ChannelOptions(run=ctx.run)
        self._lock = asyncio.Lock()  # one sync at a time; a queued one finds the version held
        self._poller: asyncio.Task[None] | None = None  # from setup to teardown, with poll_s

    async def setup(self) -> None:
        """Connect to the source and republish its newest version (a restarted relay too).

        Raises:
            ConfigProblem: the run has no role named ``source``.
            StallError: the source did not answer within ``source_wait_s``.
        """
        cfg = self.config
        group = self.ctx.groups.get(cfg.source)
        if group is None:
            known = ", ".join(sorted(self.ctx.groups)) or "none"
            raise ConfigProblem(
                f"roles.{self.ctx.name}.config.source: the run has no role {cfg.source!r} "
                f"(roles: {known}); name the role that publishes the weights"
            )
        self._options = ChannelOptions(
            run=self.ctx.run,
            heartbeat_interval_s=group.heartbeat_interval_s,
            liveness=group.liveness,
        )
        self._endpoint = group.endpoints[0]
        await self._retrying(self._connect, "connect to")
        await self.sync(None)
        if cfg.poll_s:
            self._poller = asyncio.get_running_loop().create_task(
                self._poll(), name=f"{self.ctx.name}[{self.ctx.replica}] polling"
            )

    async def _poll(self) -> None:
        """Sync every ``poll_s`` seconds; a failure is logged and the next poll tries again
        (the source may be gone for longer than ``source_wait_s``)."""
        while True:
            await asyncio.sleep(self.config.poll_s)
            try:
                await self.sync(None)
            except Exception as exc:  # logged; the next poll tries again
                self.ctx.log.warning(f"relay {self.ctx.name}: polling its source failed: {exc!r}")

    async def _connect(self) -> None:
        """A connected client of the source; a try that failed leaves nothing open."""
        client = Client(
            self._endpoint,
            name=f"{self.ctx.name}.{self.ctx.replica}",
            incarnation=self.ctx.incarnation,
            options=self._options,
        )
        try:
            await client.connect(timeout=min(self.config.timeout_s, 10.0))
        except BaseException:
            await client.close()
            raise
        self._client = client

    async def teardown(self) -> None:
        """Stop polling, close the client and the store (mapped readers see it closed and keep
        their copy)."""
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.wait({self._poller})
        if self._client is not None:
            await self._client.close()
        async with self._lock:
            if self.store is not None:
                self.store.close()
                self.store = None

    @property
    def version(self) -> int:
        """The version this host's store holds; ``NO_VERSION`` before the first pull."""
        return NO_VERSION if self.store is None else self.store.version

    @endpoint(Delivery.LATEST)
    async def sync(self, _: None) -> int:
        """Pull the source's newest version when it is not the one held, and republish it;
        return the version this host's rollouts now find (the source's, on its own host).

        Raises:
            StallError: the source did not answer within ``source_wait_s``.
        """
        async with self._lock:
            source = await self._retrying(self._source_version, "ask the version of")
            client = self._client
            assert client is not None and client.server is not None
            self.relaying = client.server.host != host_id()
            if not self.relaying:
                return source
            if self.store is not None and source == self.store.version:
                return source
            update = await self._retrying(self._pull, "pull weights from")
            await self.ctx.offload(self._publish, update)
            return self.version

    @endpoint(Delivery.IDEMPOTENT, name="status")
    async def relay_status(self, _: None) -> RelayStatus:
        """The version held, the pulls made, and whether this relay copies at all."""
        return RelayStatus(
            version=self.version,
            pulls=self.pulls,
            bytes_pulled=self.bytes_pulled,
            relaying=self.relaying,
            store="" if self.store is None else self.store.name,
            source=self.config.source,
        )

    async def _source_version(self) -> int:
        assert self._client is not None
        reply = await self._client.call(
            self.config.version_method, None, timeout=self.config.timeout_s
        )
        if isinstance(reply, dict):
            reply = reply.get("version")
        if not isinstance(reply, int) or isinstance(reply, bool):
            raise ConfigProblem(
                f"roles.{self.ctx.name}.config.version_method: {self.config.source}'s "
                f"{self.config.version_method!r} answered {reply!r}, not a version (an int, or "
                f"a map with an int 'version'); name the endpoint that answers its version"
            )
        return reply

    async def _pull(self) -> WeightsUpdate:
        assert self._client is not None
        update: WeightsUpdate = await self._client.call(
            self.config.weights_method, None, WeightsUpdate, timeout=self.config.timeout_s
        )
        self.pulls += 1
        self.bytes_pulled += sum(t.numel() * t.element_size() for t in update.state.values())
        return update

    def _publish(self, update: WeightsUpdate) -> None:
        """Republish ``update`` into this host's store and point the handle at it. A first
        version, one that went back (the source lost steps) or other tensors take a new store,
        which the rollouts reopen; the old one is closed once the handle names the new."""
        store = self.store
        if store is not None and update.version == store.version:
            return
        if store is not None and update.version > store.version and _fits(store, update):
            store.publish(update.state, update.version)
            return
        fresh = WeightStore(update.state, run=self.ctx.run, incarnation=self.ctx.incarnation)
        try:
            fresh.publish(update.state, update.version)
            write_handle(handle_path(self.ctx.run_dir, self.config.source), fresh.describe())
        except BaseException:
            fresh.close()
            raise
        self.store = fresh
        if store is not None:
            store.close()

    async def _retrying(self, attempt: Callable[[], Awaitable[T]], what: str) -> T:
        """``await attempt()``, tried again while it fails with a recoverable error (the
        source restarting), for at most ``source_wait_s``.

        Raises:
            StallError: still failing after ``source_wait_s``; its cause is the last error.
        """
        cfg = self.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.source_wait_s
        while True:
            try:
                return await attempt()
            except AsyncrlError as exc:
                if not getattr(exc, "retryable", False):
                    raise
                if loop.time() >= deadline:
                    raise StallError(
                        f"relay {self.ctx.name}[{self.ctx.replica}] could not {what} its "
                        f"source {cfg.source!r} at {self._endpoint} for {cfg.source_wait_s:g} s "
                        f"(last error: {exc}); is the source running, and reachable from "
                        f"this host?"
                    ) from exc
            await asyncio.sleep(_RETRY_S)


def _fits(store: WeightStore, update: WeightsUpdate) -> bool:
    """Whether ``update`` has exactly the names, dtypes and shapes of ``store``."""
    specs = store.describe().tensors
    problems = check_names(update.state, specs, "update")
    for spec in specs:
        if spec.name in update.state:
            problems += check_tensor(spec.name, update.state[spec.name], spec, "update")
    return not problems
