"""The dispatcher: one credit-based queue per role group, shared by every handle of the driver.

Each replica advertises free slots (CREDIT, sent by its process once ``setup()`` is done). Work
waits in the group's queue and goes to the replica with the most free slots, so a fast replica
simply takes more, and nothing is bound to a replica until it is sent: an idle replica takes
whatever is queued. Work aimed at one replica (``broadcast``) waits in that replica's own queue.

Work may carry an *affinity* key (a GRPO group's id, for an engine with prefix caching): the
first such work goes wherever the dispatcher picks, and later work with the same key prefers
that replica, waiting in its soft queue while it is full. An idle replica steals from the
longest soft queue of the others (the newest work first, so the owner keeps what it reaches
next), so a preference never leaves a slot empty; each theft is counted as ``stolen``.

Failures follow each endpoint's delivery class. A replica states them when it answers the
built-in ``_describe`` (every Python role does); a role that does not (an external command) has
the classes its manifest declares (``roles.<name>.endpoints``, carried in ``GroupInfo.delivery``).
When both exist, ``_describe`` wins for each method it names. A method neither names is ``once``:


- idempotent: a request whose replica died, hung or restarted runs again, preferably on another
  replica; if none is up it waits for a restarted one. Only its deadline limits this, so waiting
  for a restart spends no retries. Its future resolves once, with the first result.
- once: never retried; the caller gets the typed error.
- latest: like idempotent, and a queued call is replaced by a newer one to the same method and
  target; both callers get the newer call's result.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter, deque
from typing import Any

from asyncrl.errors import (
    BrokenError,
    DeadlineExceededError,
    ProtocolVersionError,
    RemoteError,
    TransportError,
)
from asyncrl.role import Delivery
from asyncrl.spec import GroupInfo
from asyncrl.transport import ChannelOptions, Client, ErrorCode, PeerEvent

__all__ = ["Dispatcher", "Group", "Work"]

log = logging.getLogger("asyncrl.dispatch")

_CONNECT_TIMEOUT_S = 7 * 24 * 3600.0
_DESCRIBE_RETRY_S = 1.0
_MAX_HOMES = 65536


class Work:
    """One request on its way to some replica of a group."""

    __slots__ = (
        "affinity",
        "attempt",
        "avoid",
        "deadline",
        "future",
        "key",
        "method",
        "payload",
        "reply_type",
        "sent",
        "target",
        "timeout",
        "timer",
    )

    def __init__(
        self,
        method: str,
        payload: Any,
        reply_type: Any,
        timeout: float,
        deadline: float,
        future: asyncio.Future[Any],
        *,
        key: Any = None,
        target: int | None = None,
        affinity: Any = None,
    ) -> None:
        self.method = method
        self.payload = payload
        self.reply_type = reply_type
        self.timeout = timeout
        self.deadline = deadline
        self.future = future
        self.key = key
        self.target = target
        self.affinity = affinity
        self.attempt = 0
        self.avoid = -1
        self.sent = False
        self.timer: asyncio.TimerHandle | None = None


class _Replica:
    __slots__ = (
        "alive",
        "client",
        "credit",
        "endpoint",
        "incarnation",
        "index",
        "inflight",
        "queue",
        "served",
        "soft",
    )

    def __init__(self, index: int, endpoint: str) -> None:
        self.index = index
        self.endpoint = endpoint
        self.client: Client | None = None
        self.credit = 0
        self.inflight = 0
        self.alive = False
        self.incarnation = -1
        self.queue: deque[Work] = deque()
        self.soft: deque[Work] = deque()  # work that prefers this replica; others may steal it
        self.served = 0

    @property
    def free(self) -> int:
        return self.credit - self.inflight if self.alive else 0


class Group:
    """The replicas of one role, the work queued for them, and what became of it."""

    def __init__(self, name: str, info: GroupInfo, *, run: str, startup_timeout_s: float) -> None:
        self.name = name
        self.info = info
        self.run = run
        self.startup_timeout_s = startup_timeout_s
        self.replicas = [_Replica(i, ep) for i, ep in enumerate(info.endpoints)]
        self.queue: deque[Work] = deque()
        self.delivery: dict[str, Delivery] = {m: Delivery(d) for m, d in info.delivery.items()}
        self.stats: Counter[str] = Counter()
        self._homes: dict[Any, int] = {}  # affinity key -> the replica it prefers
        self._tasks: set[asyncio.Task[None]] = set()
        self._ready = asyncio.Event()
        self._closed = False

    # -- connections ----------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for replica in self.replicas:
            task = loop.create_task(self._connect(replica))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _connect(self, replica: _Replica) -> None:
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
                replica.endpoint,
                name=f"driver->{self.name}.{replica.index}",
                options=options,
                on_credit=functools.partial(self._on_credit, replica),
                on_event=functools.partial(self._on_event, replica),
            )
            replica.client = client
            try:
                await client.connect(timeout=_CONNECT_TIMEOUT_S)
                break
            except ProtocolVersionError as exc:
                log.error("%s.%d: cannot connect: %s", self.name, replica.index, exc)
                return
            except TransportError as exc:
                await client.close()
                if self._closed:
                    return
                log.warning(
                    "%s.%d: the first handshake broke (%s); connecting again",
                    self.name,
                    replica.index,
                    exc,
                )
                await asyncio.sleep(_DESCRIBE_RETRY_S)
        while not self._closed:
            try:
                await self._describe(replica)
                return
            except TransportError as exc:
                log.warning("%s.%d: no description yet: %s", self.name, replica.index, exc)
                await asyncio.sleep(_DESCRIBE_RETRY_S)

    async def _describe(self, replica: _Replica) -> None:
        assert replica.client is not None
        try:
            info = await replica.client.call("_describe", None, timeout=self.startup_timeout_s)
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
                    replica.index,
                    method,
                    described.value,
                    declared,
                    described.value,
                )
            self.delivery[method] = described
        self._ready.set()

    def _on_credit(self, replica: _Replica, slots: int) -> None:
        replica.credit = slots
        replica.alive = True
        if replica.client is not None:
            # Credit belongs to the incarnation that sent it.
            replica.incarnation = replica.client.peer_incarnation
        self.pump()

    def _on_event(self, replica: _Replica, event: PeerEvent) -> None:
        if event.kind in ("dead", "disconnected"):
            replica.alive = False
            self.stats[f"replica_{event.kind}"] += 1
        elif event.kind == "restarted":
            # The new incarnation advertises its own credit once its state is restored (its
            # CREDIT may even have arrived before this event).
            self.stats["replica_restarts"] += 1
        elif (
            event.kind == "alive"
            and replica.credit > 0
            and replica.client is not None
            and replica.client.peer_incarnation == replica.incarnation
        ):
            # Heard again after a silence from the same incarnation (it was stopped, not
            # restarted): the credit it gave still stands.
            replica.alive = True
            self.pump()

    async def wait_ready(self) -> None:
        """Wait until some replica has described its endpoints."""
        await self._ready.wait()

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for replica in self.replicas:
            if replica.client is not None:
                await replica.client.close()
        for work in [*self.queue, *(w for r in self.replicas for w in (*r.queue, *r.soft))]:
            if work.timer is not None:
                work.timer.cancel()
            work.future.cancel()

    # -- work -----------------------------------------------------------------------------

    def submit(self, work: Work) -> None:
        """Queue ``work``; it is sent as soon as a replica has a free slot."""
        self.stats["calls"] += 1
        loop = asyncio.get_running_loop()
        work.timer = loop.call_at(work.deadline, self._expire, work)
        queue = self.queue if work.target is None else self.replicas[work.target].queue
        if self.delivery.get(work.method) == Delivery.LATEST:
            for older in [w for w in queue if w.method == work.method]:
                queue.remove(older)
                self.stats["superseded"] += 1
                _chain(work.future, older)
        queue.append(work)
        self.pump()

    def pump(self) -> None:
        """Send queued work to replicas with free slots: work aimed at a replica first, then
        work that prefers it, then the shared queue (the freest replica first); then idle
        replicas steal what others prefer."""
        for replica in self.replicas:
            while replica.free > 0 and (replica.queue or replica.soft):
                self._send(replica, (replica.queue or replica.soft).popleft())
        queue = self.queue
        while queue:
            work = queue[0]
            home = self._home(work)
            if home is not None and home.free <= 0:
                home.soft.append(queue.popleft())  # waits for its replica, or a thief
                continue
            chosen = home or self._pick(work)
            if chosen is None:
                break
            queue.popleft()
            if work.affinity is not None:
                self._bind(work.affinity, chosen.index)
            self._send(chosen, work)
        self._steal()

    def _home(self, work: Work) -> _Replica | None:
        if work.affinity is None:
            return None
        index = self._homes.get(work.affinity)
        if index is None or index == work.avoid:
            return None  # unbound yet, or the replica that failed it: pick afresh
        return self.replicas[index]

    def _bind(self, key: Any, index: int) -> None:
        self._homes.pop(key, None)
        self._homes[key] = index
        if len(self._homes) > _MAX_HOMES:  # forget the oldest preference
            del self._homes[next(iter(self._homes))]

    def _steal(self) -> None:
        if not any(r.soft for r in self.replicas):
            return  # nothing is waiting for a particular replica: the usual case
        for thief in sorted(self.replicas, key=lambda r: -r.free):
            while thief.free > 0:
                victim = max(self.replicas, key=lambda r: len(r.soft) if r is not thief else -1)
                if victim is thief or not victim.soft:
                    return
                work = victim.soft.pop()
                self.stats["stolen"] += 1
                if work.affinity is not None:
                    self._bind(work.affinity, thief.index)
                self._send(thief, work)

    def _pick(self, work: Work) -> _Replica | None:
        best: _Replica | None = None
        for replica in self.replicas:
            free = replica.free
            if free <= 0:
                continue
            if best is None:
                best = replica
                continue
            # A retried request prefers any other replica to the one that failed it.
            if (best.index == work.avoid) != (replica.index == work.avoid):
                if best.index == work.avoid:
                    best = replica
                continue
            if free > best.free:
                best = replica
        return best

    def _send(self, replica: _Replica, work: Work) -> None:
        assert replica.client is not None
        if work.future.done():  # cancelled by its caller while it waited
            if work.timer is not None:
                work.timer.cancel()
            return
        loop = asyncio.get_running_loop()
        remaining = work.deadline - loop.time()
        if remaining <= 0:
            self._expire(work)
            return
        try:
            fut = replica.client.call_future(
                work.method,
                work.payload,
                work.reply_type,
                timeout=remaining,
                attempt=work.attempt,
                trace=str(work.key) if work.key is not None else "",
            )
        except TransportError as exc:
            replica.alive = False
            self._retry_or_fail(replica, work, exc)
            return
        replica.inflight += 1
        work.sent = True
        fut.add_done_callback(functools.partial(self._done, replica, work))

    def _done(self, replica: _Replica, work: Work, fut: asyncio.Future[Any]) -> None:
        replica.inflight -= 1
        if fut.cancelled():
            work.future.cancel()
        else:
            exc = fut.exception()
            if exc is None:
                replica.served += 1
                self._resolve(work, fut.result())
            else:
                self._retry_or_fail(replica, work, exc)
        if not self._closed:
            self.pump()

    def _retry_or_fail(self, replica: _Replica, work: Work, exc: BaseException) -> None:
        delivery = self.delivery.get(work.method, Delivery.ONCE)
        retryable = isinstance(exc, BrokenError) or (isinstance(exc, RemoteError) and exc.retryable)
        loop = asyncio.get_running_loop()
        if isinstance(exc, DeadlineExceededError):
            self._fail(
                work,
                DeadlineExceededError(
                    f"{self.name}[{replica.index}] ({replica.endpoint})", work.method, work.timeout
                ),
            )
        elif retryable and delivery != Delivery.ONCE and loop.time() < work.deadline:
            self.stats["retries"] += 1
            work.attempt += 1
            work.avoid = replica.index
            work.sent = False
            if work.target is None:
                self.queue.appendleft(work)
            else:
                self.replicas[work.target].queue.appendleft(work)
            log.info(
                "%s: re-running %r (attempt %d) after %s on replica %d",
                self.name,
                work.method,
                work.attempt,
                type(exc).__name__,
                replica.index,
            )
        else:
            self._fail(work, exc)

    def _expire(self, work: Work) -> None:
        if work.future.done() or work.sent:
            return  # in flight, the client's own deadline answers
        for queue in (self.queue, *(q for r in self.replicas for q in (r.queue, r.soft))):
            if work in queue:
                queue.remove(work)
        where = self.name if work.target is None else f"{self.name}[{work.target}]"
        self._fail(
            work,
            DeadlineExceededError(
                f"{where} (no replica took it: none was up with a free slot)",
                work.method,
                work.timeout,
            ),
        )

    def _resolve(self, work: Work, value: Any) -> None:
        if work.timer is not None:
            work.timer.cancel()
        if not work.future.done():
            work.future.set_result(value)

    def _fail(self, work: Work, exc: BaseException) -> None:
        if work.timer is not None:
            work.timer.cancel()
        if not work.future.done():
            self.stats["failures"] += 1
            work.future.set_exception(exc)

    def summary(self) -> dict[str, Any]:
        return {
            **self.stats,
            "served": {r.index: r.served for r in self.replicas},
        }


def _chain(newer: asyncio.Future[Any], older: Work) -> None:
    """The caller of a superseded latest-wins call gets the newer call's outcome."""
    if older.timer is not None:
        older.timer.cancel()

    def copy(f: asyncio.Future[Any]) -> None:
        if older.future.done():
            return
        if f.cancelled():
            older.future.cancel()
        elif f.exception() is not None:
            older.future.set_exception(f.exception())  # type: ignore[arg-type]
        else:
            older.future.set_result(f.result())

    newer.add_done_callback(copy)


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

    def start(self) -> None:
        for group in self.groups.values():
            group.start()

    async def close(self) -> None:
        await asyncio.gather(*(g.close() for g in self.groups.values()))

    def summary(self) -> dict[str, Any]:
        return {name: g.summary() for name, g in self.groups.items()}
