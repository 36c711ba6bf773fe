"""The dispatcher: one credit-based queue per role group, shared by every handle of the driver.

The policy (credit, affinity, work stealing, delivery classes and retries) is
``asyncrl.dispatch.scheduler.Scheduler``, which holds no socket and is tested in-process. This
module is the thin part that owns the sockets: one transport ``Client`` per replica, connected in
the background, whose credit and peer events it hands to the group's scheduler.

Each endpoint's delivery class comes from the replica: it states them when it answers the built-in
``_describe`` (every Python role does); a role that does not (an external command) has the classes
its manifest declares (``roles.<name>.endpoints``, carried in ``GroupInfo.delivery``). When both
exist, ``_describe`` wins for each method it names. A method neither names is ``once``.

The connections belong to one ``asyncio.TaskGroup``, owned by the dispatcher from ``start()`` to
``close()``. If connecting raises what it does not expect (a bug), the error is logged with its
traceback and every call queued or made afterwards, in every group, fails with it (an
``ExceptionGroup``), so the control-flow program fails with it rather than wait on a replica that
will never be connected.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from typing import Any

from asyncrl.dispatch.scheduler import Replica, Scheduler, Work
from asyncrl.errors import ProtocolVersionError, RemoteError, TransportError
from asyncrl.manifest.membership import Membership
from asyncrl.manifest.spec import GroupInfo
from asyncrl.role import Delivery
from asyncrl.transport import ChannelOptions, Client, ErrorCode, PeerEvent
from asyncrl.transport.sockets import CLIENT_SOCKETS, reserve_sockets

__all__ = ["Busy", "Dispatcher", "Group", "Work", "reserve_connections"]

log = logging.getLogger("asyncrl.dispatch.dispatcher")

_CONNECT_TIMEOUT_S = 7 * 24 * 3600.0
_DESCRIBE_RETRY_S = 1.0


class Busy:
    """The time one replica had at least one call of the driver in flight.

    It wraps the replica's client (a ``ReplicaClient``): every call is counted from when it is
    sent to when its future settles, whatever the outcome. ``busy_s()`` is what the idle
    fraction of a role in the per-step metrics (``asyncrl.observe.metrics.IdleFractions``) comes
    from.

    Args:
        client: the replica's client.
        clock: seconds (a test may pass a fake one).
    """

    def __init__(self, client: Any, clock: Any = time.monotonic) -> None:
        self.client = client
        self.clock = clock
        self.inflight = 0
        self._busy = 0.0
        self._since = 0.0
        self._on_settled = self._settled  # bound once, not per call

    def call_future(
        self,
        method: str,
        payload: Any = None,
        reply_type: Any = Any,
        *,
        timeout: float = 30.0,
        attempt: int = 0,
        trace: str = "",
    ) -> Any:
        """The client's ``call_future``, counted while it is in flight. The arguments are
        named, not forwarded as ``**kw``: no dict is built and unpacked per call."""
        fut = self.client.call_future(
            method, payload, reply_type, timeout=timeout, attempt=attempt, trace=trace
        )
        if self.inflight == 0:
            self._since = self.clock()
        self.inflight += 1
        fut.add_done_callback(self._on_settled)
        return fut

    def _settled(self, _: Any) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._busy += self.clock() - self._since

    def busy_s(self) -> float:
        """Seconds with a call in flight so far, the current stretch included."""
        return self._busy + (self.clock() - self._since if self.inflight else 0.0)


class Group:
    """The replicas of one role: their clients, and the scheduler that queues work for them."""

    def __init__(self, name: str, info: GroupInfo, *, run: str, startup_timeout_s: float) -> None:
        self.name = name
        self.info = info
        self.run = run
        self.startup_timeout_s = startup_timeout_s
        self.scheduler = Scheduler(
            name, info.endpoints, {m: Delivery(d) for m, d in info.delivery.items()}
        )
        self._clients: list[Client | None] = [None] * len(info.endpoints)
        self.busy = [Busy(None) for _ in info.endpoints]
        self._ready = asyncio.Event()
        self._closed = False

    @property
    def replicas(self) -> list[Replica]:
        return self.scheduler.replicas

    @property
    def stats(self) -> Counter[str]:
        return self.scheduler.stats

    @property
    def delivery(self) -> dict[str, Delivery]:
        return self.scheduler.delivery

    def submit(self, work: Work) -> None:
        """Queue ``work``; it is sent as soon as a replica has a free slot."""
        self.scheduler.submit(work)

    def summary(self) -> dict[str, Any]:
        return self.scheduler.summary()

    def status(self) -> dict[str, Any]:
        """The group now, for ``asyncrl status``: ``queued`` (calls waiting for any replica),
        the scheduler's counters, and per replica its connection, the incarnation it last
        heard, its credit (slots it offers), calls in flight and queued for it, calls served,
        and seconds busy."""
        return {
            "queued": len(self.scheduler.queue),
            "counters": dict(self.stats),
            "replicas": [
                {
                    "replica": r.index,
                    "endpoint": r.endpoint,
                    "connected": r.alive,
                    "incarnation": r.incarnation,
                    "credit": r.credit,
                    "inflight": r.inflight,
                    "queued": len(r.queue) + len(r.soft),
                    "served": r.served,
                    "busy_s": round(self.busy[r.index].busy_s(), 3),
                }
                for r in self.replicas
            ],
        }

    # -- connections ----------------------------------------------------------------------

    async def connect(self, index: int) -> None:
        """Connect to replica ``index`` and learn its delivery classes; return once it has
        described itself, or once it cannot be spoken to (another protocol version): calls
        aimed at it then fail with ``RoleDeadError`` (``Scheduler.lose``)."""
        options = ChannelOptions(
            run=self.run,
            heartbeat_interval_s=self.info.heartbeat_interval_s,
            liveness=self.info.liveness,
        )
        # One client for the whole run once connected: it reconnects by itself across
        # restarts, and a replica that is slow to come up is waited for, not hammered.
        # Supervision decides when a start has taken too long. A first handshake that breaks
        # (the replica died during it) is tried again with a new client.
        while True:
            client = Client(
                self.info.endpoints[index],
                name=f"driver->{self.name}.{index}",
                options=options,
                on_credit=functools.partial(self._on_credit, index),
                on_event=functools.partial(self._on_event, index),
            )
            self._clients[index] = client
            self.busy[index].client = client
            self.scheduler.attach(index, self.busy[index])
            try:
                await client.connect(timeout=_CONNECT_TIMEOUT_S)
                break
            except ProtocolVersionError as exc:
                # It can never be spoken to: calls aimed at it fail now rather than at their
                # deadline, and the others go to the rest of the group.
                log.error("%s.%d: cannot connect: %s", self.name, index, exc)
                self.scheduler.lose(index, str(exc))
                if self.scheduler.all_lost() is not None:
                    self._ready.set()  # none will describe itself: wait_ready says why
                return
            except TransportError as exc:
                await client.close()
                if self._closed:
                    return
                log.warning(
                    "%s.%d: the first handshake broke (%s); connecting again",
                    self.name,
                    index,
                    exc,
                )
                await asyncio.sleep(_DESCRIBE_RETRY_S)
        while not self._closed:
            try:
                await self._describe(index, client)
                return
            except TransportError as exc:
                log.warning("%s.%d: no description yet: %s", self.name, index, exc)
                await asyncio.sleep(_DESCRIBE_RETRY_S)

    async def _describe(self, index: int, client: Client) -> None:
        try:
            info = await client.call("_describe", None, timeout=self.startup_timeout_s)
        except RemoteError as exc:
            if exc.code != ErrorCode.UNKNOWN_METHOD:
                raise
            # An external role need not describe itself; its endpoints then have the classes
            # the manifest declares, and the others are 'once'.
            info = {}
        for method, delivery in info.get("endpoints", {}).items():
            described = Delivery(delivery)
            declared = self.info.delivery.get(method)
            if declared is not None and declared != described:
                log.warning(
                    "%s.%d: %r is %s by its _describe, %s by the manifest; %s applies",
                    self.name,
                    index,
                    method,
                    described.value,
                    declared,
                    described.value,
                )
            self.scheduler.delivery[method] = described
        self._ready.set()

    def _on_credit(self, index: int, slots: int) -> None:
        client = self._clients[index]
        assert client is not None
        self.scheduler.credit(index, slots, client.peer_incarnation)

    def _on_event(self, index: int, event: PeerEvent) -> None:
        client = self._clients[index]
        assert client is not None
        self.scheduler.peer_event(index, event.kind, client.peer_incarnation)

    async def depart(self, index: int, reason: str) -> None:
        """Replica ``index`` left the run with its node (``Scheduler.depart``): its calls in
        flight run again elsewhere as its client closes."""
        if self.scheduler.replicas[index].lost is not None:
            return
        self.scheduler.depart(index, reason)
        client = self._clients[index]
        if client is not None:
            await client.close()

    async def rebind(self, index: int, endpoint: str) -> None:
        """Replica ``index`` now serves at ``endpoint`` (moved to another node): its old client
        closes (its calls in flight run again), and ``connect`` reaches the new address. A
        replica that departed with its node is back in the group (``Scheduler.restore``)."""
        self.scheduler.restore(index)
        self.scheduler.replicas[index].endpoint = endpoint
        self.info = GroupInfo(
            [endpoint if i == index else e for i, e in enumerate(self.info.endpoints)],
            self.info.heartbeat_interval_s,
            self.info.liveness,
            delivery=self.info.delivery,
        )
        client = self._clients[index]
        if client is not None:
            await client.close()

    async def wait_ready(self) -> None:
        """Wait until some replica has described its endpoints.

        Raises:
            ExceptionGroup: connecting failed (see ``Dispatcher``).
            RoleDeadError: no replica can be spoken to (each speaks another protocol version).
        """
        await self._ready.wait()
        if self.scheduler.failure is not None:
            raise self.scheduler.failure
        dead = self.scheduler.all_lost()
        if dead is not None:
            raise dead

    def fail(self, exc: BaseException) -> None:
        """Connecting failed: every queued call and every later one fails with ``exc``."""
        self.scheduler.fail_all(exc)
        self._ready.set()

    async def close(self) -> None:
        """Fail the calls still queued with ``RoleDeadError``, then close every client: the
        calls in flight on it fail so too (``Scheduler.close``)."""
        self._closed = True
        self.scheduler.close()  # first: nothing queued is sent to a client as it closes
        for client in self._clients:
            if client is not None:
                await client.close()


class Dispatcher:
    """Every group of the run, by role name."""

    def __init__(
        self,
        groups: dict[str, GroupInfo],
        *,
        run: str,
        startup_timeout_s: float = 120.0,
    ) -> None:
        self.groups = {
            name: Group(name, info, run=run, startup_timeout_s=startup_timeout_s)
            for name, info in groups.items()
        }
        self._owner: asyncio.Task[None] | None = None
        self._later: set[asyncio.Task[None]] = set()  # connections to moved replicas

    def start(self) -> None:
        """Connect to every replica in the background; calls may be made at once."""
        self._owner = asyncio.get_running_loop().create_task(self._connect_all())
        self._owner.add_done_callback(self._owner_done)

    async def _connect_all(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            for group in self.groups.values():
                for index in range(len(group.replicas)):
                    tasks.create_task(group.connect(index))

    def _owner_done(self, owner: asyncio.Task[None]) -> None:
        if owner.cancelled() or owner.exception() is None:
            return
        exc = owner.exception()
        assert exc is not None
        log.error(
            "the dispatcher failed while connecting; every call fails with this", exc_info=exc
        )
        for group in self.groups.values():
            group.fail(exc)

    async def apply(self, membership: Membership) -> list[str]:
        """Follow the run's membership (``asyncrl.manifest.membership``): each replica that
        departed with a lost node leaves its group (``Group.depart``), and each replica that
        moved to another node is reached at its new address (``Group.rebind``, then connected
        in the background). Return what changed, one line each; a change already applied is
        not applied again.
        """
        changed: list[str] = []
        for name, departed in membership.departed.items():
            group = self.groups.get(name)
            for index, node in departed.items():
                if group is None or group.replicas[index].lost is not None:
                    continue
                reason = f"its node {node} was lost"
                await group.depart(index, reason)
                changed.append(f"{name}[{index}] left the run: {reason}")
        for name, moved in membership.moved.items():
            group = self.groups.get(name)
            for index, where in moved.items():
                if group is None:
                    continue
                replica = group.replicas[index]
                if group.info.endpoints[index] == where.endpoint and not replica.departed:
                    continue
                back = replica.departed
                await group.rebind(index, where.endpoint)
                self._connect_later(group, index)
                how = "is back on" if back else "moved to"
                changed.append(f"{name}[{index}] {how} node {where.node} ({where.endpoint})")
        return changed

    def _connect_later(self, group: Group, index: int) -> None:
        task = asyncio.get_running_loop().create_task(group.connect(index))
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    async def close(self) -> None:
        """Stop connecting and close every group: every call queued, in flight or made
        afterwards fails with ``RoleDeadError``."""
        if self._owner is not None:
            self._owner.cancel()
            await asyncio.wait({self._owner})  # its failure, if any, went to the calls
        for task in list(self._later):
            task.cancel()
        if self._later:
            await asyncio.wait(set(self._later))
        await asyncio.gather(*(g.close() for g in self.groups.values()))

    def summary(self) -> dict[str, Any]:
        return {name: g.summary() for name, g in self.groups.items()}

    def status(self) -> dict[str, Any]:
        """Every group's ``Group.status``, by role name."""
        return {name: g.status() for name, g in self.groups.items()}

    def busy(self) -> dict[str, tuple[float, int]]:
        """Per role: the seconds its replicas were busy so far (summed), and its replica count."""
        return {
            name: (sum(b.busy_s() for b in g.busy), len(g.busy)) for name, g in self.groups.items()
        }


def reserve_connections(groups: dict[str, GroupInfo], who: str) -> None:
    """Size this process, before its first socket, for a connection to every replica of
    ``groups`` (``reserve_sockets``): libzmq fixes its context's size then (1,023 sockets, 341
    connections, by default), and each connection holds open files. Where the process's hard
    limit on open files is below what connections to all of them need, it warns, naming
    ``who``, the replicas, the limit and the fix, and goes on: most processes connect to a few
    of the replicas (a rollout replica to none), and one that connects to more than the limit
    allows fails with libzmq's ``Too many open files`` only then.
    """
    replicas = sum(len(group.endpoints) for group in groups.values())
    reserved = reserve_sockets(replicas)
    if reserved.capped and reserved.hard is not None:
        allowed = max(0, (reserved.hard - 256) // (2 * CLIENT_SOCKETS))
        log.warning(
            "%s may connect to %d replicas, which needs about %d open files, but the "
            "process's hard limit on open files is %d: past about %d connections it fails "
            "with `Too many open files`. Raise it (`ulimit -Hn %d` as root before the run "
            "starts, or LimitNOFILE in its systemd unit), or run fewer replicas per process "
            "(more dispatch shards, pipeline.shards, each owning fewer rollout replicas)",
            who,
            replicas,
            reserved.wanted,
            reserved.hard,
            allowed,
            reserved.wanted,
        )
