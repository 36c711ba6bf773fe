"""Where each call to a role group goes, and what becomes of it when it fails: no sockets here.

A ``Scheduler`` holds the replicas of one role group, the credit each advertised, and the work
queued for them. It reaches a replica only through a ``ReplicaClient`` (in a run, the
transport's ``Client``; in a test, a fake) and learns of credit and of a replica's comings and
goings from its owner, ``asyncrl.dispatch.dispatcher.Group``, through ``credit`` and ``peer_event``.
So the whole policy runs in-process, as vLLM's ``EngineCore`` runs apart from ``EngineCoreProc``.

Each replica advertises free slots (CREDIT, sent by its process once ``setup()`` is done). Work
waits in the group's queue and goes to the replica with the most free slots, so a fast replica
simply takes more, and nothing is bound to a replica until it is sent: an idle replica takes
whatever is queued. Work aimed at one replica (``broadcast``) waits in that replica's own queue.

No call walks every replica: a heap holds the replicas with free slots (freest, then lowest
index, on top), beside the replicas with room and work of their own queued and those with soft
work; ``_sync`` updates them as a replica changes, so a call costs O(log n) in replicas.

Work may carry an *affinity* key (a GRPO group's id, for an engine with prefix caching): the
first such work goes wherever the scheduler picks, and later work with the same key prefers
that replica, waiting in its soft queue while it is full. An idle replica steals from the
longest soft queue of the others (the newest work first, so the owner keeps what it reaches
next), so a preference never leaves a slot empty; each theft is counted as ``stolen``.

Failures follow each endpoint's delivery class (``delivery``, by method; a method it does not
name is ``once``):

- idempotent: a request whose replica died, hung or restarted runs again, preferably on another
  replica; if none is up it waits for a restarted one. Only its deadline limits this, so waiting
  for a restart spends no retries. Its future resolves once, with the first result.
- once: never retried; the caller gets the typed error.
- latest: like idempotent, and a queued call is replaced by a newer one to the same method and
  target; both callers get the newer call's result.

A replica that can never be spoken to (it speaks another protocol version) is *lost*
(``lose``): work aimed at it fails with ``RoleDeadError`` naming it, and other work goes to the
rest of the group. A replica whose node was lost for good *departs* (``depart``): it is lost in
the same way, and each call it held in flight runs again elsewhere under its delivery class
(exactly once more: its future resolves once). A replica started again at another address (a
role moved to a surviving node) is *rebound* (``rebind``): its calls in flight run again, and it
takes work again once its new incarnation advertises credit.

Once ``close`` is called (the run is shutting down), every call still queued, every later one,
and every call in flight that its client's closing ends or that would run again fails with
``RoleDeadError`` (``SHUTTING_DOWN``): nothing will answer it now.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import logging
import operator
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from asyncrl.dispatch.deadlines import Deadlines
from asyncrl.errors import (
    BrokenError,
    ClosedError,
    DeadlineExceededError,
    RemoteError,
    RoleDeadError,
    TransportError,
)
from asyncrl.role import Delivery

__all__ = ["SHUTTING_DOWN", "Replica", "ReplicaClient", "Scheduler", "Work"]

log = logging.getLogger("asyncrl.dispatch.dispatcher")

_MAX_HOMES = 65536
_INDEX = operator.attrgetter("index")

SHUTTING_DOWN = (
    "the run is shutting down (the driver closed its connections with this call still queued "
    "or in flight)"
)
"""Why a call fails with ``RoleDeadError`` once its scheduler is closed: queued then, made
afterwards, or in flight on a client that closed (its ``ClosedError`` is then the cause)."""


class ReplicaClient(Protocol):
    """How the scheduler sends a request to one replica (``asyncrl.transport.Client`` is one)."""

    def call_future(
        self,
        method: str,
        payload: Any = None,
        reply_type: Any = Any,
        *,
        timeout: float = 30.0,
        attempt: int = 0,
        trace: str = "",
    ) -> asyncio.Future[Any]:
        """Send the request now; return the future of its reply.

        Raises:
            TransportError: it cannot be sent (the client is closed): the replica counts as down.
            TypeError: the payload cannot be encoded.
        """


class Work:
    """One request on its way to some replica of a group. ``avoid`` names a replica it should
    go elsewhere than, when another has room: the one that failed it (a retry sets it; so may
    its caller, for a request that repeats one a replica failed)."""

    __slots__ = (
        "affinity",
        "armed",
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
        avoid: int = -1,
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
        self.avoid = avoid
        self.sent = False
        self.armed: list[Any] | None = None  # queued, due to fail at its deadline (``Deadlines``)


class Replica:
    """What the scheduler knows of one replica: its credit, its calls in flight, its queues, and
    ``free``: its credit less its calls in flight while it is up, kept by its ``Scheduler``."""

    __slots__ = (
        "alive",
        "client",
        "credit",
        "departed",
        "endpoint",
        "free",
        "incarnation",
        "index",
        "inflight",
        "lost",
        "queue",
        "rebound",
        "served",
        "soft",
    )

    def __init__(self, index: int, endpoint: str) -> None:
        self.index = index
        self.endpoint = endpoint
        self.client: ReplicaClient | None = None
        self.credit = 0
        self.inflight = 0
        self.alive = False
        self.incarnation = -1
        self.queue: deque[Work] = deque()  # work aimed at this replica
        self.soft: deque[Work] = deque()  # work that prefers this replica; others may steal it
        self.served = 0
        self.lost: str | None = None  # why it can never be spoken to, once it cannot
        self.rebound = False  # started again at another address (``Scheduler.rebind``)
        self.departed = False  # left the run with its node (``Scheduler.depart``)
        self.free = 0


class Scheduler:
    """The credit-based queues of one role group.

    Args:
        name: the role's name (errors and logs name it).
        endpoints: one per replica, in replica order (errors name the replica's).
        delivery: the delivery class of each method known so far; ``delivery`` may be updated
            later (a replica describes its endpoints).
    """

    def __init__(
        self, name: str, endpoints: Sequence[str], delivery: Mapping[str, Delivery] | None = None
    ) -> None:
        self.name = name
        self.replicas = [Replica(i, ep) for i, ep in enumerate(endpoints)]
        self.queue: deque[Work] = deque()
        self.delivery: dict[str, Delivery] = dict(delivery or {})
        self.stats: Counter[str] = Counter()
        self._homes: dict[Any, int] = {}  # affinity key -> the replica it prefers
        # (-free, index) of replicas with free slots, the freest on top; an entry whose free
        # count is no longer its replica's is stale, and dropped when it reaches the top.
        self._heap: list[tuple[int, int]] = []
        self._ready: dict[int, Replica] = {}  # free slots and work of its own queued
        self._soft_owners: dict[int, Replica] = {}  # work waiting in its soft queue
        self._closed = False
        self._lost = 0  # replicas that can never be spoken to
        self._failure: BaseException | None = None
        self._deadlines: Deadlines[Work] = Deadlines(self._expire)

    @property
    def failure(self) -> BaseException | None:
        """What every call fails with since ``fail_all``; None while the owner is sound."""
        return self._failure

    # -- what the owner tells it ----------------------------------------------------------

    def attach(self, index: int, client: ReplicaClient) -> None:
        """Send replica ``index``'s work through ``client`` from now on."""
        self.replicas[index].client = client

    def credit(self, index: int, slots: int, incarnation: int) -> None:
        """Replica ``index``, in ``incarnation``, takes ``slots`` calls at once from now on."""
        replica = self.replicas[index]
        replica.credit = slots
        replica.alive = True
        replica.incarnation = incarnation  # credit belongs to the incarnation that sent it
        self._sync(replica)
        self.pump()

    def peer_event(self, index: int, kind: str, incarnation: int) -> None:
        """The connection to replica ``index`` changed (a ``PeerEvent`` kind); ``incarnation``
        is the one its last message came from."""
        replica = self.replicas[index]
        if kind in ("dead", "disconnected"):
            replica.alive = False
            self._sync(replica)
            self.stats[f"replica_{kind}"] += 1
        elif kind == "restarted":
            # The new incarnation advertises its own credit once its state is restored (its
            # CREDIT may even have arrived before this event).
            self.stats["replica_restarts"] += 1
        elif kind == "alive" and replica.credit > 0 and incarnation == replica.incarnation:
            # Heard again after a silence from the same incarnation (it was stopped, not
            # restarted): the credit it gave still stands.
            replica.alive = True
            self._sync(replica)
            self.pump()

    def lose(self, index: int, reason: str) -> None:
        """Replica ``index`` can never be spoken to (it speaks another protocol version; it
        was never connected, so it took no work): work aimed at it fails with ``RoleDeadError``
        naming it and ``reason``, now and later, and other work goes to the rest of the group.
        Once every replica is lost, every call fails so."""
        replica = self.replicas[index]
        self._lost += replica.lost is None
        replica.lost = reason
        self.stats["replicas_lost"] += 1
        for work in replica.queue:
            self._fail(work, RoleDeadError(self.name, reason, index))
        replica.queue.clear()
        self._sync(replica)
        dead = self.all_lost()
        if dead is not None:
            for work in self.queue:
                self._fail(work, dead)
            self.queue.clear()
        self.pump()

    def depart(self, index: int, reason: str) -> None:
        """Replica ``index`` left the run (its node was lost for good): it is lost as ``lose``
        says, work that preferred it goes back to the shared queue, and each call it holds in
        flight runs again on another replica when its client fails it (``BrokenError`` or
        ``ClosedError``), unless its delivery class is ``once``: that one fails with
        ``BrokenError``, so its caller may send it again. A replica already lost stays as it
        was."""
        replica = self.replicas[index]
        if replica.lost is not None:
            return
        replica.alive = False
        replica.departed = True
        self.stats["replicas_departed"] += 1
        for work in replica.soft:
            self.queue.append(work)
        replica.soft.clear()
        self.lose(index, reason)

    def rebind(self, index: int) -> None:
        """Replica ``index`` moved to another address: until its new incarnation advertises
        credit it takes no work, and each call its old client fails runs again as ``depart``
        says."""
        replica = self.replicas[index]
        replica.alive = False
        replica.credit = 0
        replica.incarnation = -1
        replica.rebound = True
        self.stats["replicas_rebound"] += 1
        self._sync(replica)

    def restore(self, index: int) -> None:
        """Replica ``index``, departed with its node, is back (the node joined the run again):
        it takes work again once it advertises credit, as after ``rebind``."""
        replica = self.replicas[index]
        if replica.departed:
            replica.departed = False
            replica.lost = None
            self._lost -= 1
            self.stats["replicas_back"] += 1
        self.rebind(index)

    def members(self) -> list[int]:
        """The replicas that have not departed with a lost node, in replica order."""
        return [r.index for r in self.replicas if not r.departed]

    def all_lost(self) -> RoleDeadError | None:
        """The error of a group none of whose replicas can be spoken to; None while one can."""
        if self._lost < len(self.replicas):
            return None
        reasons = "; ".join(f"replica {r.index}: {r.lost}" for r in self.replicas)
        return RoleDeadError(self.name, f"none of its replicas can be spoken to ({reasons})")

    def fail_all(self, exc: BaseException) -> None:
        """The owner broke (a bug): fail every queued call with ``exc``, and every later one."""
        self._failure = exc
        for work in self._queued():
            self._fail(work, exc)
        self._clear_queues()

    def close(self) -> None:
        """The run is shutting down: fail every queued call, and every later one, with
        ``RoleDeadError`` (``SHUTTING_DOWN``). A call in flight fails so when it ends (its
        client closes under it), and is never re-queued."""
        self._closed = True
        for work in self._queued():
            self._fail(work, self._shutting_down())
        self._clear_queues()
        self._deadlines.close()

    def _clear_queues(self) -> None:
        self.queue.clear()
        for replica in self.replicas:
            replica.queue.clear()
            replica.soft.clear()
        self._ready.clear()
        self._soft_owners.clear()

    def _shutting_down(self, cause: BaseException | None = None) -> RoleDeadError:
        error = RoleDeadError(self.name, SHUTTING_DOWN)
        error.__cause__ = cause
        return error

    def _queued(self) -> list[Work]:
        return [*self.queue, *(w for r in self.replicas for w in (*r.queue, *r.soft))]

    # -- work -----------------------------------------------------------------------------

    def submit(self, work: Work) -> None:
        """Queue ``work``; it is sent as soon as a replica has a free slot. Once the owner
        failed, or the scheduler is closed, it fails at once instead."""
        self.stats["calls"] += 1
        if self._failure is not None:
            self._fail(work, self._failure)
            return
        if self._closed:
            self._fail(work, self._shutting_down())
            return
        lost = self._lost_for(work)
        if lost is not None:
            self._fail(work, lost)
            return
        target = None if work.target is None else self.replicas[work.target]
        queue = self.queue if target is None else target.queue
        if self.delivery.get(work.method) == Delivery.LATEST:
            for older in [w for w in queue if w.method == work.method]:
                queue.remove(older)
                self.stats["superseded"] += 1
                self._deadlines.disarm(older)
                _chain(work.future, older)
        queue.append(work)
        if target is not None:
            self._sync(target)
        self.pump()
        if not work.sent:
            self._arm(work)

    def _arm(self, work: Work) -> None:
        """Expire ``work`` at its deadline if still queued then (sent at once, it needs none)."""
        self._deadlines.arm(work)

    def _lost_for(self, work: Work) -> RoleDeadError | None:
        """The error ``work`` fails with at once because its replica, or every replica, is
        lost; None when some replica it may go to is not."""
        if work.target is not None:
            reason = self.replicas[work.target].lost
            return None if reason is None else RoleDeadError(self.name, reason, work.target)
        return self.all_lost()

    def pump(self) -> None:
        """Send queued work to replicas with free slots: work aimed at a replica first, then
        work that prefers it, then the shared queue (the freest replica first); then idle
        replicas steal what others prefer."""
        if self._ready:
            for replica in sorted(self._ready.values(), key=_INDEX):
                while replica.free > 0 and (replica.queue or replica.soft):
                    self._send(replica, (replica.queue or replica.soft).popleft())
                self._sync(replica)
        queue = self.queue
        while queue:
            work = queue[0]
            home = self._home(work)
            if home is not None and home.free <= 0:
                home.soft.append(queue.popleft())  # waits for its replica, or a thief
                self._soft_owners[home.index] = home
                continue
            chosen = home or self._pick(work)
            if chosen is None:
                break
            queue.popleft()
            if work.affinity is not None:
                self._bind(work.affinity, chosen.index)
            self._send(chosen, work)
        if self._soft_owners:
            self._steal()

    def _sync(self, replica: Replica) -> None:
        """Bring ``replica.free`` and its place in the indexes up to date after a change."""
        free = replica.credit - replica.inflight if replica.alive and replica.lost is None else 0
        index = replica.index
        if free != replica.free:
            replica.free = free
            if free > 0:
                heap = self._heap
                heapq.heappush(heap, (-free, index))
                if len(heap) > 2 * len(self.replicas) + 64:  # mostly stale: build it anew
                    self._heap = [(-r.free, r.index) for r in self.replicas if r.free > 0]
                    heapq.heapify(self._heap)
        if free > 0 and (replica.queue or replica.soft):
            self._ready[index] = replica
        else:
            self._ready.pop(index, None)
        if replica.soft:
            self._soft_owners[index] = replica
        else:
            self._soft_owners.pop(index, None)

    def _freest(self) -> Replica | None:
        """The freest replica (the lowest index among equals); None when none has room."""
        heap, replicas = self._heap, self.replicas
        while heap:
            negative_free, index = heap[0]
            replica = replicas[index]
            if replica.free == -negative_free:
                return replica
            heapq.heappop(heap)  # stale
        return None

    def _home(self, work: Work) -> Replica | None:
        if work.affinity is None:
            return None
        index = self._homes.get(work.affinity)
        if index is None or index == work.avoid or self.replicas[index].lost is not None:
            return None  # unbound yet, the replica that failed it, or one gone: pick afresh
        return self.replicas[index]

    def _bind(self, key: Any, index: int) -> None:
        self._homes.pop(key, None)
        self._homes[key] = index
        if len(self._homes) > _MAX_HOMES:  # forget the oldest preference
            del self._homes[next(iter(self._homes))]

    def _steal(self) -> None:
        if self._freest() is None:
            return  # no replica has room to take what others prefer
        thieves = sorted((r for r in self.replicas if r.free > 0), key=lambda r: (-r.free, r.index))
        for thief in thieves:
            while thief.free > 0:
                victims = (r for r in self._soft_owners.values() if r is not thief)
                victim = max(victims, key=lambda r: (len(r.soft), -r.index), default=None)
                if victim is None:
                    return
                work = victim.soft.pop()
                self._sync(victim)
                self.stats["stolen"] += 1
                if work.affinity is not None:
                    self._bind(work.affinity, thief.index)
                self._send(thief, work)

    def _pick(self, work: Work) -> Replica | None:
        """The freest replica, but a retried request prefers any other to the one that failed it."""
        best = self._freest()
        if best is None or best.index != work.avoid:
            return best
        heap = self._heap
        top = heapq.heappop(heap)
        other = self._freest()
        while other is best:  # another entry of the replica to avoid
            heapq.heappop(heap)
            other = self._freest()
        heapq.heappush(heap, top)
        return other or best

    def _send(self, replica: Replica, work: Work) -> None:
        assert replica.client is not None
        if work.future.done():  # cancelled by its caller while it waited
            self._deadlines.disarm(work)
            return
        loop = work.future.get_loop()  # no system call (get_running_loop makes one)
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
            self._sync(replica)
            self._retry_or_fail(replica, work, exc)
            return
        except TypeError as exc:  # a payload that cannot be encoded: its caller's error alone
            self._fail(work, exc)
            return
        replica.inflight += 1
        self._sync(replica)
        work.sent = True
        self._deadlines.disarm(work)  # in flight, the client's own deadline answers
        fut.add_done_callback(functools.partial(self._done, replica, work))

    def _done(self, replica: Replica, work: Work, fut: asyncio.Future[Any]) -> None:
        replica.inflight -= 1
        self._sync(replica)
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

    def _retry_or_fail(self, replica: Replica, work: Work, exc: BaseException) -> None:
        delivery = self.delivery.get(work.method, Delivery.ONCE)
        retryable = isinstance(exc, BrokenError) or (isinstance(exc, RemoteError) and exc.retryable)
        # A client closed under its calls because its replica departed or moved (``depart``,
        # ``rebind``): they run again elsewhere. Any other ClosedError is this side closing.
        moved = replica.lost is not None or replica.rebound
        retryable = retryable or (isinstance(exc, ClosedError) and moved and not self._closed)
        again = retryable and delivery != Delivery.ONCE
        if isinstance(exc, TransportError):
            exc.replica = replica.index  # which replica failed it, for its caller to judge
        if isinstance(exc, DeadlineExceededError):
            # Named by group and replica; the pid and incarnation that had the call stay.
            late = DeadlineExceededError(
                f"{self.name}[{replica.index}] ({replica.endpoint})",
                work.method,
                work.timeout,
                pid=exc.pid,
                incarnation=exc.incarnation,
            )
            late.replica = replica.index
            self._fail(work, late)
        elif self._closed and (again or isinstance(exc, ClosedError)):
            # It would run again, or its client closed under it: nothing will answer it now.
            self._fail(work, self._shutting_down(exc))
        elif again and asyncio.get_running_loop().time() < work.deadline:
            self.stats["retries"] += 1
            work.attempt += 1
            work.avoid = replica.index
            work.sent = False
            if work.target is None:
                self.queue.appendleft(work)
            elif self.replicas[work.target].lost is not None:
                self._fail(work, self._gone(self.replicas[work.target], exc))
                return
            else:
                target = self.replicas[work.target]
                target.queue.appendleft(work)
                self._sync(target)
            self._arm(work)
            log.info(
                "%s: re-running %r (attempt %d) after %s on replica %d",
                self.name,
                work.method,
                work.attempt,
                type(exc).__name__,
                replica.index,
            )
        elif isinstance(exc, ClosedError) and moved:
            # A ``once`` call its replica held when it departed or moved: broken, not closed by
            # this side, so the caller may send it again (the role answers a repeat).
            self._fail(work, self._gone(replica, exc))
        else:
            self._fail(work, exc)

    def _gone(self, replica: Replica, exc: BaseException) -> BaseException:
        """The error of a call ``replica`` held or was aimed at, now that it is gone: broken when
        it departed with its node or moved (the caller may send it again, as after a replica's
        death; the role answers a repeat), else the replica is dead for good."""
        if replica.departed or replica.rebound:
            how = "left the run with its node" if replica.departed else "moved to another node"
            err = BrokenError(f"{self.name}[{replica.index}] {how} with the call in flight")
            err.__cause__ = exc
            return err
        return RoleDeadError(self.name, replica.lost or "", replica.index)

    def _expire(self, work: Work) -> None:
        if work.future.done() or work.sent:
            return  # in flight, the client's own deadline answers
        # Aimed at a replica, it waits in that one's queue; else in the shared or a soft queue.
        holders = (
            self._soft_owners.values() if work.target is None else [self.replicas[work.target]]
        )
        for queue in (self.queue, *(q for r in holders for q in (r.queue, r.soft))):
            if work in queue:
                queue.remove(work)
        for replica in [*holders]:
            self._sync(replica)
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
        self._deadlines.disarm(work)
        if not work.future.done():
            work.future.set_result(value)

    def _fail(self, work: Work, exc: BaseException) -> None:
        self._deadlines.disarm(work)
        if not work.future.done():
            self.stats["failures"] += 1
            work.future.set_exception(exc)

    def summary(self) -> dict[str, Any]:
        """The counters (calls, retries, failures, stolen, ...) and the calls each replica
        answered, by replica index."""
        return {**self.stats, "served": {r.index: r.served for r in self.replicas}}


def _chain(newer: asyncio.Future[Any], older: Work) -> None:
    """The caller of a superseded latest-wins call gets the newer call's outcome."""

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
