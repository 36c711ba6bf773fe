"""The per-host weight relay: each new version crosses the network once per host, not once per
rollout replica.

The learner publishes its weights into a shared-memory store (``asyncrl.weights.publishing``), which
only processes on its own host can map. A host without a learner runs one ``Relay``: its ``sync``
endpoint asks the source (the publisher, ``source: learner``) for its version, and when that is
newer than the one it holds, pulls the weights from the source's ``weights`` endpoint over the
transport (tensor frames over tcp), republishes them into a ``WeightStore`` of its own host, and
writes the store's handle under the *source's* name in the folder of the node it runs on
(``handle_path(ctx.node_folder, source)``: its run directory, unless it moved there off a lost
node, when ``run_dir`` stays its home node's folder). Rollout replicas of that host
(``weights_from: learner``) therefore read the relay's store exactly as they read the
learner's on the learner's host.

- The source is its group's lead (``asyncrl.manifest.membership.lead``): replica 0
  (``ctx.groups[source].endpoints[0]``), or, once a node's loss took replica 0 out of a
  data-parallel group, the lowest replica left, which publishes from then on. The relay reads
  the ``membership.json`` of the node it runs on now (``ctx.node_folder``) before each try of
  a call to the source, and follows the lead where it moved (a lead on the relay's own host
  makes it stop copying, below). Whether it copies is decided again at each try, after
  following the lead: a lead that moved onto this host between the question of its version
  and the pull is not copied, and the relay drops its store and writes no handle (the new
  lead wrote its own).
- A version the relay already holds is never pulled again: ``sync`` asks ``status`` first.
- The source's lead lost with its node: a call the relay sent it may be answered by nobody
  until its deadline (``timeout_s``), so while a version query or a pull waits, the relay looks
  at its node's ``membership.json`` every second and gives the call up as soon as it names
  another lead, then asks that one.
- The source restarting: the relay's client reconnects by itself, and a pull that failed with a
  recoverable error, or that a new lead's old process refused as the follower it still is
  (``NotLeaderError``, until its agent restarts it as the lead), is tried again until
  ``source_wait_s`` passes. A source whose version went back (a learner that lost steps) gets
  a new store, which the rollouts reopen.
- The relay restarting: ``setup`` pulls the newest version into a new store and rewrites the
  handle, so the host's rollouts move to it at their next ``sync``.
- Every ``poll_s`` seconds (1 by default) the relay also syncs by itself, which costs one
  ``status`` call when nothing is new: a program that pushes to the rollouts only still gets
  the new versions to this host, a poll later.
- On the source's own host (the same ``asyncrl.transport.shm.host_id``), the relay copies
  nothing and writes nothing: the rollouts there read the learner's store itself, and ``sync``
  only answers the source's version. That holds for another node rank on the source's host too
  (two ranks on one machine): the launch links that node's ``weights`` folder to the host's
  first node's (``asyncrl.supervision.hosts``), so its rollouts find the learner's handle. A
  one-machine rehearsal gives each simulated node its own ``ASYNCRL_HOST_ID`` to make its relay
  really relay. One host without the source needs one relay: two would republish into one name.

With ``transport: broadcast`` the weights cross through the hardware plugin's broadcast (gloo
on CPU, NCCL on GPUs) instead of tensor frames. For each transfer the relay hosts a rendezvous
store (a ``torch.distributed.TCPStore`` on a free port, which the source reaches at this host's
address that routes to it, or ``broadcast_address``) and calls the source's ``broadcast_weights``
(``asyncrl.weights.broadcast``) with it; the two form a standalone group of two ranks
(``Communication.pair_group``, never the default group: a data-parallel learner is in one).
The source, rank 0, broadcasts the version its store holds: a header (version, tensor table,
bucket sizes), then one flat uint8 buffer per bucket of at most ``bucket_mib`` (a larger
tensor alone). The relay, rank 1, writes each bucket into its store as it comes
(``WeightStore.publish_buckets``), so neither side holds more than one bucket beyond its
store, and the version becomes visible only once complete. The whole transfer has the deadline
``timeout_s``. A source that dies mid-transfer fails the relay's side with ``BrokenError`` (a
relay that dies, the source's side: the source keeps serving), a peer that goes silent with
``CollectiveTimeoutError``, a version the source overwrote while sending with
``TornReadError``: all recoverable, the store stays on its last complete version, and ``sync``
tries again as a pull does. Nothing authenticates the rendezvous store (torch's listens on
every interface, for the transfer only, under a fresh random prefix) or the group's connections,
as with ``torch.distributed`` itself: use it on a network the run trusts.

Endpoints: ``sync(None) -> int`` (latest-wins: the version held after pulling the newest) and
``status(None) -> RelayStatus`` (idempotent). The control-flow programs push to the relays
before the rollout replicas (``asyncrl.roles.sampling.weight_sync.WeightSync``).
"""

from __future__ import annotations

import asyncio
import datetime
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import msgspec
import torch
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from asyncrl.errors import AsyncrlError, ConfigProblem, StallError
from asyncrl.manifest.membership import lead
from asyncrl.plugins.contract import CollectiveTimeoutError
from asyncrl.plugins.registry import current as current_plugin
from asyncrl.role import Delivery, Role, RoleContext, endpoint
from asyncrl.roles.generation.rollout import WeightsUpdate
from asyncrl.roles.training.lead_refusal import refused_as_follower
from asyncrl.supervision.store_registry import node_address
from asyncrl.transport import ChannelOptions, Client
from asyncrl.transport.codec import torch_dtypes
from asyncrl.transport.shm import host_id
from asyncrl.weights import NO_VERSION, HandlePointer, WeightStore, handle_path
from asyncrl.weights.broadcast import (
    READY,
    BucketTable,
    Rendezvous,
    received_buckets,
    remaining,
)
from asyncrl.weights.layout import check_names, check_tensor

__all__ = ["Relay", "RelayStatus"]

T = TypeVar("T")

_RETRY_S = 0.2  # between tries of a source that is restarting
_LEAD_LOOK_S = 1.0  # between two looks at the source's lead while a call to it waits
_READY_POLL_S = 0.005  # between two looks for the source's arrival at the rendezvous


class _SourceHere(Exception):
    """The source's lead is on this host now (it moved here after a node's loss): its own
    store serves the host, and the relay copies nothing."""


class _LeadMoved(Exception):
    """This node's membership names another lead for the source while a call to the old one
    waits: the call is given up, and the relay follows the new lead at once."""


class _Abandoned(Exception):
    """The source's call failed before it reached the rendezvous: stop waiting for it (its
    error is what the transfer raises)."""


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
    """Pulls each new version of the source's weights once, over the transport or through the
    plugin's broadcast, and republishes it into this host's shared-memory store for the host's
    rollout replicas."""

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        """The relay role's config (the manifest's ``config`` mapping).

        Attributes:
            source: the role that publishes the weights (its group's lead is asked); the rollout
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
            transport: how a version crosses: ``pull`` (the source's ``weights_method``, as
                tensor frames over the transport) or ``broadcast`` (the hardware plugin's
                broadcast on a group of two with the source's ``broadcast_method``: gloo on
                CPU, NCCL on GPUs; its deadline is ``timeout_s``).
            broadcast_method: with ``broadcast``, the source's endpoint that sends its store to
                a ``Rendezvous`` (the learner's ``broadcast_weights``).
            broadcast_address: with ``broadcast``, this host's address the source reaches the
                rendezvous store and the group at; empty: the one that routes to the source.
            bucket_mib: with ``broadcast``, the most MiB of one bucket (a larger tensor goes
                alone): what each side holds beyond its store.
        """

        source: str = "learner"
        weights_method: str = "weights"
        version_method: str = "status"
        timeout_s: float = 300.0
        source_wait_s: float = 300.0
        poll_s: float = 1.0
        transport: Literal["pull", "broadcast"] = "pull"
        broadcast_method: str = "broadcast_weights"
        broadcast_address: str = ""
        bucket_mib: int = 256

        def __post_init__(self) -> None:
            if not self.source:
                raise ValueError("source: name the role that publishes the weights (learner)")
            if self.bucket_mib < 1:
                raise ValueError(f"bucket_mib: expected an int >= 1, got {self.bucket_mib}")
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
        self._handle = HandlePointer()  # the host's handle, naming this relay's store

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
        await self._retrying(self._follow_lead, "connect to")
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

    def _lead_now(self) -> tuple[int, str]:
        """The source's lead and its address as this node's ``membership.json`` names them:
        the file of the node the relay runs on now (a relay moved off a lost node keeps that
        node's folder as its run_dir, whose membership.json no agent writes any more:
        ``node_folder``)."""
        name = self.config.source
        return lead(self.ctx.node_folder, name, self.ctx.groups[name].endpoints)

    async def _follow_lead(self) -> None:
        """Be connected to the source's lead as this node's ``membership.json`` names it now:
        a lead that left the run with its node is replaced by the new one. ``relaying`` then
        says whether that lead is on another host."""
        name = self.config.source
        replica, endpoint = self._lead_now()
        if endpoint == self._endpoint and self._client is not None:
            self._note_host()
            return
        if self._endpoint and endpoint != self._endpoint:
            self.ctx.log.info(
                f"relay {self.ctx.name}: {name}'s group is led by replica {replica} now "
                f"({endpoint}): its weights come from there"
            )
        old, self._client = self._client, None
        if old is not None:
            await old.close()
        self._endpoint = endpoint
        await self._connect()
        self._note_host()

    def _note_host(self) -> None:
        """Set ``relaying`` from the host of the source's lead the client reaches now; on the
        lead's host, drop this relay's store: the lead's own store serves the host (its handle
        names it), and a later lead on another host gets a new store and handle from here."""
        client = self._client
        if client is None or client.server is None:
            return
        self.relaying = client.server.host != host_id()
        if not self.relaying and self.store is not None:
            store, self.store = self.store, None
            store.close()

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
            while True:
                source = await self._retrying(
                    self._source_version, "ask the version of", watch_lead=True
                )
                if not self.relaying:
                    return source
                if self.store is not None and source == self.store.version:
                    return source
                try:
                    # Each try follows the lead first: one that moved onto this host stops
                    # the copy before a byte is written (``_SourceHere``).
                    if self.config.transport == "broadcast":
                        await self._retrying(self._broadcast, "receive the broadcast of")
                        return self.version
                    update = await self._retrying(self._pull, "pull weights from", watch_lead=True)
                    await self.ctx.offload(self._publish, update)
                    return self.version
                except _SourceHere:
                    continue  # ask the lead on this host its version, and copy nothing

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
        if not self.relaying:
            raise _SourceHere
        update: WeightsUpdate = await self._client.call(
            self.config.weights_method, None, WeightsUpdate, timeout=self.config.timeout_s
        )
        self.pulls += 1
        self.bytes_pulled += sum(t.numel() * t.element_size() for t in update.state.values())
        return update

    def _address(self) -> str:
        """This host's address the source reaches: ``broadcast_address``, or the one that
        routes to the source's host (the loopback for a source over ipc)."""
        address: str = self.config.broadcast_address
        if address:
            return address
        host = urlsplit(self._endpoint).hostname if self._endpoint.startswith("tcp://") else ""
        return node_address("", host or "127.0.0.1")[1]

    async def _broadcast(self) -> int:
        """One transfer through the plugin's broadcast: host a rendezvous store, call the
        source's ``broadcast_method`` with it, and receive its buckets into this host's store
        in a thread meanwhile; return the version received.

        Raises:
            BrokenError: the source died or closed its end during the transfer.
            CollectiveTimeoutError: it did not come or answer within ``timeout_s``.
            TornReadError: the source overwrote the version while sending it.
            RemoteError, DisconnectedError, ...: the source's call failed before it sent.
        """
        cfg = self.config
        assert self._client is not None
        if not self.relaying:
            raise _SourceHere
        address = self._address()
        server = TCPStore(
            address,
            0,
            None,
            True,
            timeout=datetime.timedelta(seconds=cfg.timeout_s),
            wait_for_workers=False,
        )
        rendezvous = Rendezvous(
            host=address,
            port=server.port,
            prefix=f"asyncrl/relay/{self.ctx.name}.{self.ctx.replica}/{secrets.token_hex(8)}",
            timeout_s=cfg.timeout_s,
            bucket_bytes=cfg.bucket_mib * 2**20,
        )
        store = PrefixStore(rendezvous.prefix, server)
        abandon = threading.Event()
        receiving = asyncio.ensure_future(
            self.ctx.offload(self._receive, store, rendezvous, abandon)
        )
        calling = asyncio.ensure_future(
            self._client.call(
                cfg.broadcast_method, rendezvous, int, timeout=cfg.timeout_s + _RETRY_S
            )
        )
        try:
            await asyncio.wait({receiving, calling}, return_when=asyncio.FIRST_EXCEPTION)
            failed = calling.exception() if calling.done() else None
            if failed is not None:
                abandon.set()  # a source that failed before the rendezvous never comes
                await asyncio.wait({receiving})
                if isinstance(receiving.exception(), _Abandoned):
                    raise failed
            # Every bucket arrived whole (or this raises why not): the version is complete
            # whatever became of the call's reply.
            return await receiving
        finally:
            abandon.set()
            calling.cancel()
            await asyncio.wait({receiving, calling})
            # The rendezvous store (``server``) closes when this frame lets it go.

    def _receive(self, store: Any, rendezvous: Rendezvous, abandon: threading.Event) -> int:
        """Rank 1 of the transfer: wait for the source at the rendezvous, form the group,
        receive the header and then each bucket into this host's store. Blocking."""
        deadline = time.monotonic() + rendezvous.timeout_s
        while not store.check([READY]):
            if abandon.is_set():
                raise _Abandoned
            if time.monotonic() >= deadline:
                raise CollectiveTimeoutError("rendezvous", [0], rendezvous.timeout_s, 1)
            time.sleep(_READY_POLL_S)
        comm = current_plugin().comm
        left = remaining(deadline)
        with comm.pair_group(store, 1, 2, timeout_s=left, address=rendezvous.host) as group:

            def receive(t: torch.Tensor) -> None:
                left = remaining(deadline)
                comm.broadcast(t, 0, timeout_s=left, group=group)

            length = torch.zeros(1, dtype=torch.int64)
            receive(length)
            header = torch.empty(int(length.item()), dtype=torch.uint8)
            receive(header)
            table = msgspec.msgpack.decode(header.numpy().tobytes(), type=BucketTable)
            self._publish_buckets(table, received_buckets(table, receive, self.config.source))
        self.pulls += 1
        self.bytes_pulled += sum(spec.nbytes for spec in table.tensors)
        return table.version

    def _publish_buckets(
        self, table: BucketTable, buckets: Iterator[dict[str, torch.Tensor]]
    ) -> None:
        """Write ``buckets`` into this host's store as ``table.version``, as ``_publish`` does
        a whole update: in place when the store fits and the version is newer, else into a new
        store that the handle then names. A bucket that fails leaves the version unpublished."""
        store = self.store
        if store is not None and table.version == store.version:
            for _ in buckets:  # the source sends all of it; the version is already here
                pass
            return
        layout = [(s.name, s.dtype, s.shape) for s in table.tensors]
        if (
            store is not None
            and table.version > store.version
            and layout == [(s.name, s.dtype, s.shape) for s in store.describe().tensors]
        ):
            store.publish_buckets(buckets, table.version)
            self._point_handle(store)
            return
        dtypes = torch_dtypes()
        template = {
            s.name: torch.empty(s.shape, dtype=dtypes[s.dtype], device="meta")
            for s in table.tensors
        }
        self._replace_store(template, buckets, table.version)

    def _publish(self, update: WeightsUpdate) -> None:
        """Republish ``update`` into this host's store and point the handle at it. A first
        version, one that went back (the source lost steps) or other tensors take a new store,
        which the rollouts reopen; the old one is closed once the handle names the new."""
        store = self.store
        if store is not None and update.version == store.version:
            return
        if store is not None and update.version > store.version and _fits(store, update):
            store.publish(update.state, update.version)
            self._point_handle(store)
            return
        self._replace_store(update.state, [update.state], update.version)

    def _point_handle(self, store: WeightStore) -> None:
        """Make the host's handle name ``store`` (``HandlePointer``): the group's lead may
        have written its own while it ran on this host, a move this relay did not see (the
        lead came and went between two of its syncs), and the host's rollouts would read that
        closed store and keep their old weights."""
        self._handle.point(handle_path(self.ctx.node_folder, self.config.source), store.describe())

    def _replace_store(
        self,
        template: Mapping[str, torch.Tensor],
        buckets: Iterable[Mapping[str, torch.Tensor]],
        version: int,
    ) -> None:
        """Publish ``version`` from ``buckets`` into a new store laid out as ``template``,
        point the handle at it, then close the old one; a failure closes the new one and
        keeps the old. Never on the source's lead's host, where the handle names the lead's
        own store (``_SourceHere``)."""
        if not self.relaying:
            raise _SourceHere
        fresh = WeightStore(template, run=self.ctx.run, incarnation=self.ctx.incarnation)
        try:
            fresh.publish_buckets(buckets, version)
            self._point_handle(fresh)
        except BaseException:
            fresh.close()
            raise
        old, self.store = self.store, fresh
        if old is not None:
            old.close()

    async def _retrying(
        self, attempt: Callable[[], Awaitable[T]], what: str, *, watch_lead: bool = False
    ) -> T:
        """``await attempt()``, tried again while it fails with a recoverable error (the
        source restarting), for at most ``source_wait_s``. ``watch_lead``: give the attempt
        up as soon as this node's membership names another lead (``_unless_lead_moves``), and
        try again at the new one.

        Raises:
            StallError: still failing after ``source_wait_s``; its cause is the last error.
        """
        cfg = self.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.source_wait_s
        while True:
            try:
                await self._follow_lead()
                if watch_lead:
                    return await self._unless_lead_moves(attempt())
                return await attempt()
            except _LeadMoved:
                continue  # follow the new lead at once
            except AsyncrlError as exc:
                # A lead's old process, a follower until its agent restarts it as the lead,
                # refuses what only the lead serves: asked again, the new lead answers.
                if not getattr(exc, "retryable", False) and not refused_as_follower(exc):
                    raise
                if loop.time() >= deadline:
                    raise StallError(
                        f"relay {self.ctx.name}[{self.ctx.replica}] could not {what} its "
                        f"source {cfg.source!r} at {self._endpoint} for {cfg.source_wait_s:g} s "
                        f"(last error: {exc}); is the source running, and reachable from "
                        f"this host?"
                    ) from exc
            await asyncio.sleep(_RETRY_S)

    async def _unless_lead_moves(self, call: Awaitable[T]) -> T:
        """``call``'s result, unless this node's membership names another lead for the source
        first: then the call is cancelled and ``_LeadMoved`` raised. A call sent to a lead
        whose node died before the call reached it is answered by nobody, and its client
        learns nothing of it until the call's deadline (``timeout_s``, minutes): the
        membership's change (the node marked lost, the group led by another replica) ends the
        wait within ``_LEAD_LOOK_S``."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_LEAD_LOOK_S)
                if done:
                    return task.result()
                if self._lead_now()[1] != self._endpoint:
                    raise _LeadMoved
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})


def _fits(store: WeightStore, update: WeightsUpdate) -> bool:
    """Whether ``update`` has exactly the names, dtypes and shapes of ``store``."""
    specs = store.describe().tensors
    problems = check_names(update.state, specs, "update")
    for spec in specs:
        if spec.name in update.state:
            problems += check_tensor(spec.name, update.state[spec.name], spec, "update")
    return not problems
