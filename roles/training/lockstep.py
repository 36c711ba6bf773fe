"""One order of calls on every rank of a group of replicas: the learner's and the critic's.

A learner or a critic with ``replicas: K`` is one ``torch.distributed`` group
(``asyncrl.roles.training.data_parallel``). A training step all-reduces or reduce-scatters its
gradients, and with ``parallel: fsdp`` every forward pass is a collective of all the ranks, so
every rank must run the same calls (the learner's ``train_step`` and ``checkpoint``, the
critic's ``values`` and ``train_step``) in the same order, while callers (the program, a sample
pipeline) call the role concurrently. ``Lockstep`` gives them that order, the same way for
both roles:

- **The group's lead leads.** The lead is the group's rank 0: replica 0, or the lowest replica
  left once a node's loss took replica 0 out (docs/multinode.md). Callers reach the role
  through the lead only (``LearnerClient`` and ``CriticClient`` send those calls there:
  ``to_lead``; another replica refuses one with ``NotLeaderError``, which they send again to
  the lead: ``check_leader``, ``asyncrl.roles.training.lead_refusal``). The lead runs its
  calls one at a time (``lead`` holds one lock from announcing a call to its end, so
  concurrent calls in several worker threads still run one after the other) and, before
  running one, broadcasts it to the other ranks: a typed message of the role's own (a tagged
  ``msgspec.Struct``: ``TrainStep``, ``Values``...), encoded with msgspec's msgpack and sent
  as a uint8 tensor over the group (``DataParallel.broadcast_bytes``), never pickled. Results
  come from the lead.
- **The others follow.** Each other rank runs a loop in a thread of its own that receives the
  calls and runs exactly the same sequence; a result it computes is dropped (the collectives
  inside the call gather what the lead returns).
- **What a rank does on its own** (the learner's log-probs, weight copy or export) holds
  ``exclusive()``, the lock a group call holds while it runs on that rank, so it never sees a
  step half-taken.
- **Seen in traces.** Each call a rank runs is the span ``lockstep <tag>`` (``lockstep
  train_step``) with the group (``group``: the role's name), its place in the sequence
  (``index``) and a checksum of its bytes (``crc``): the same on every rank of a group that
  kept in step.
- **Liveness.** A follower waits for the next call in a collective bounded by the group's
  timeout (``dist_timeout_s``). So that a leader with no work is not taken for a dead one, it
  broadcasts ``Idle`` when it announced nothing for ``idle_s`` (a quarter of the timeout by
  default), from a thread of its own that takes the lock ``lead`` holds, not ``exclusive``'s:
  it goes on while the lead computes on its own, however long that takes.
- **Failure.** A collective that fails (a rank died or did not come in time) breaks the group
  for good (``DataParallel.broken``); so does a call that raises on any rank once it was
  announced, since the ranks may then wait at different collectives. Either way ``on_broken``
  is told, on whichever thread saw it; a role passes ``exit_when_broken``, so that
  ``one_for_all`` restarts the whole group. A call the leader refuses before announcing it is
  the caller's error and breaks nothing: a role checks what it can first (the critic's
  ``mini_batches``, the learner's algorithm).
- **Closing.** The leader's ``close`` announces ``Close``, which ends the followers' loops; a
  follower's ``close`` waits for that (``leave`` does it for a role's teardown).
"""

from __future__ import annotations

import functools
import operator
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec

from asyncrl.errors import ClosedError
from asyncrl.observe.trace import span
from asyncrl.role import RoleContext
from asyncrl.roles.training.data_parallel import DataParallel, DataParallelError
from asyncrl.roles.training.lead_refusal import NotLeaderError

__all__ = ["Close", "Idle", "Lockstep", "NotLeaderError", "exit_when_broken", "leave", "tag"]


class Idle(msgspec.Struct, tag="idle", forbid_unknown_fields=True):
    """Nothing to run: the leader is alive and had no call for a while."""


class Close(msgspec.Struct, tag="close", forbid_unknown_fields=True):
    """The leader closes: no call follows; the followers' loops end."""


def tag(message: msgspec.Struct) -> str:
    """The message's tag: ``train_step``, ``values``, ``idle``, ``close``..."""
    return str(message.__struct_config__.tag)


def _check_calls(name: str, calls: tuple[type[msgspec.Struct], ...]) -> None:
    """Raise unless ``calls`` are tagged msgspec Structs with tags of their own.

    Raises:
        ValueError: no call type, one that is not a tagged Struct, or a tag used twice (or
            ``idle``/``close``, the group's own).
    """
    if not calls:
        raise ValueError(f"{name}: Lockstep needs at least one call type")
    seen = {"idle", "close"}
    for call in calls:
        config = getattr(call, "__struct_config__", None)
        if not (isinstance(call, type) and issubclass(call, msgspec.Struct)) or config is None:
            raise ValueError(f"{name}: Lockstep call types are msgspec Structs; got {call!r}")
        if config.tag is None:
            raise ValueError(
                f"{name}: Lockstep call type {call.__name__} has no tag; declare it with "
                f"msgspec.Struct, tag='<its endpoint>'"
            )
        if config.tag in seen:
            raise ValueError(
                f"{name}: Lockstep call type {call.__name__} has the tag {config.tag!r}, "
                f"which another message of the group has; give each call type its own tag"
            )
        seen.add(str(config.tag))


class Lockstep:
    """The order of a group's calls, on one rank of the group.

    Args:
        dp: this rank's handle on the group; rank 0 leads.
        calls: the role's call types: tagged ``msgspec.Struct``s, one per endpoint every rank
            runs.
        run: runs one call on this rank and returns its result (every rank's collectives
            inside it meet those of the other ranks running the same call).
        on_broken: told, once, when the group broke; on whichever thread saw it.
        client: the client that reaches the group's lead (``CriticClient``), for refusals.
        members: the group's replicas in rank order once it went on at a smaller size
            (``RoleContext.members``; empty: replicas 0 to ``dp.world - 1``): the first leads.
        idle_s: the leader announces ``Idle`` after this long without announcing anything;
            None: a quarter of ``dp.timeout_s``.
        thread_setup: called first in each thread ``start`` begins (to select this rank's
            device in it: the current device is per thread).

    Raises (on construction):
        ValueError: a call type is not a tagged Struct, or two share a tag.
    """

    def __init__(
        self,
        dp: DataParallel,
        calls: tuple[type[msgspec.Struct], ...],
        run: Callable[[Any], Any],
        *,
        on_broken: Callable[[DataParallelError], None],
        client: str,
        idle_s: float | None = None,
        thread_setup: Callable[[], object] | None = None,
        members: Sequence[int] = (),
    ) -> None:
        _check_calls(dp.name, calls)
        self.dp = dp
        self.call_types = calls
        self.run = run
        self.on_broken = on_broken
        self.client = client
        self.members = tuple(members) or tuple(range(dp.world))
        self.idle_s = dp.timeout_s / 4 if idle_s is None else idle_s
        self.thread_setup = thread_setup
        self.leader = dp.rank == 0
        self.calls = 0  # calls run on this rank
        self.idles = 0  # Idle messages sent (leader) or received (follower)
        announcement: Any = functools.reduce(operator.or_, (*calls, Idle, Close))
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(announcement)
        # Two locks, taken in this order: ``_order`` keeps the leader's announcements in one
        # sequence (a call's announce-and-run, the keep-alive's Idle, Close); ``_model`` keeps
        # a group call apart from what this rank computes on its own (``exclusive``), so the
        # keep-alive still reaches the followers while the leader computes on its own.
        self._order = threading.Lock()
        self._model = threading.Lock()
        self._last = time.monotonic()  # the end of the last announcement or call
        self._closed = False
        self._told = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def where(self) -> str:
        """This rank's replica, for messages: ``critic.1``."""
        return f"{self.dp.name}.{self.members[self.dp.rank]}"

    def encode(self, message: msgspec.Struct) -> bytes:
        """``message`` as MessagePack (a map with its tag under ``type``)."""
        return self._encoder.encode(message)

    def decode(self, data: bytes) -> Any:
        """The message ``encode`` wrote: one of the call types, ``Idle`` or ``Close``.

        Raises:
            msgspec.ValidationError, msgspec.DecodeError: the bytes are not one.
        """
        return self._decoder.decode(data)

    def check_leader(self, method: str) -> None:
        """Raise unless this rank leads: the other replicas take no group call from a caller.

        Raises:
            NotLeaderError: another replica (the message names the lead to call); a
                ``ValueError``, which its callers tell apart (``lead_refusal``).
        """
        if not self.leader:
            lead = self.members[0]
            raise NotLeaderError(
                f"{self.where}: a {self.dp.name} with {self.dp.world} replicas runs every call "
                f"on all of them in the order replica {lead} (its lead) sets; send {method} "
                f"to replica {lead} ({self.client} does: Handle.call(..., replica={lead}))"
            )

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold this rank's group calls off for the block (they wait for it, and it waits for
        the call in progress): for what a rank computes on its own from the model. The
        leader's keep-alive goes on meanwhile, so a long block (an export) never leaves the
        followers waiting past their collective's timeout."""
        with self._model:
            yield

    def start(self) -> None:
        """Start this rank's thread: the leader's keep-alive or the follower's loop."""
        target = self._keep_alive if self.leader else self._follow
        role = "keep-alive" if self.leader else "follower"
        self._thread = threading.Thread(
            target=self._thread_main,
            args=(target,),
            name=f"{self.where} lockstep {role}",
            daemon=True,
        )
        self._thread.start()

    def _thread_main(self, target: Callable[[], None]) -> None:
        """``target`` after ``thread_setup``; an error of either breaks the group (a thread
        that ended silently would leave the other ranks waiting)."""
        try:
            if self.thread_setup is not None:
                self.thread_setup()
            target()
        except DataParallelError as exc:
            self._broke(exc)
        except Exception as exc:
            self._broke(self._failed(f"the {threading.current_thread().name} thread", exc))

    # -- leader -------------------------------------------------------------------------------

    def lead(self, call: msgspec.Struct) -> Any:
        """Announce ``call`` to every rank, run it here, return its result. Blocking: call it
        from a worker thread; concurrent calls run one after the other.

        Raises:
            ValueError: this rank is not the leader.
            ClosedError: ``close`` was called.
            DataParallelError: the group broke, announcing or running the call (``on_broken``
                was told).
        """
        if not self.leader:
            raise ValueError(f"{self.where}: only rank 0 leads its group's calls")
        with self._order:
            if self._closed:
                raise ClosedError(f"{self.where}: the {self.dp.name} group is closed; no call runs")
            data = self.encode(call)
            try:
                self._announce(call, data)
            except DataParallelError as exc:
                self._broke(exc)
                raise
            with self._model:
                return self._run(call, data)

    def _announce(self, message: msgspec.Struct, data: bytes) -> None:
        """Broadcast ``message`` encoded as ``data`` (``_order`` held).

        Raises:
            DataParallelError: the broadcast failed, or the group broke earlier.
        """
        self.dp.broadcast_bytes(f"the group's next call ({tag(message)})", data)
        self._last = time.monotonic()

    def _keep_alive(self) -> None:
        """The leader's thread: ``Idle`` whenever nothing was announced for ``idle_s``."""
        while not self._stop.wait(self.idle_s / 2):
            with self._order:
                if self._closed or self.dp.broken:
                    return
                if time.monotonic() - self._last < self.idle_s:
                    continue
                self._announce(Idle(), self.encode(Idle()))
                self.idles += 1

    # -- follower -----------------------------------------------------------------------------

    def _follow(self) -> None:
        """A follower's thread: run each call the leader announces until ``Close``."""
        while True:
            data = self.dp.broadcast_bytes("the group's next call")
            try:
                message = self.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise self._failed("reading the leader's call", exc) from exc
            if isinstance(message, Close):
                return
            if isinstance(message, Idle):
                self.idles += 1
                continue
            with self._model:
                self._run(message, data)

    # -- both ---------------------------------------------------------------------------------

    def _run(self, call: msgspec.Struct, data: bytes) -> Any:
        """``run(call)`` (``_model`` held), as the span ``lockstep <tag>``; anything it raises
        breaks the group (``on_broken`` is told)."""
        kind = tag(call)
        try:
            with span(
                f"lockstep {kind}", group=self.dp.name, index=self.calls, crc=zlib.crc32(data)
            ):
                result = self.run(call)
        except DataParallelError as exc:
            if not self.dp.broken:  # the ranks disagreed, rather than a collective failing
                self.dp.broken = f"rank {self.dp.rank}: {kind} failed ({exc})"
            self._broke(exc)
            raise
        except Exception as exc:
            error = self._failed(f"{kind} (announced to every rank)", exc)
            self._broke(error)
            raise error from exc
        finally:
            self._last = time.monotonic()
        self.calls += 1
        return result

    def _failed(self, what: str, exc: Exception) -> DataParallelError:
        """The group broke because ``what`` raised ``exc`` on this rank."""
        first = f"{type(exc).__name__}: {exc}".splitlines()[0]
        self.dp.broken = self.dp.broken or f"rank {self.dp.rank}: {what} failed ({first})"
        error = DataParallelError(
            f"{self.dp.name}: rank {self.dp.rank}: {what} failed ({first}); the other ranks "
            f"may be waiting at another collective, so the group must restart"
        )
        error.__cause__ = exc
        return error

    def _broke(self, exc: DataParallelError) -> None:
        """Tell ``on_broken``, once."""
        if not self._told:
            self._told = True
            self.on_broken(exc)

    def close(self, timeout_s: float | None = None) -> bool:
        """End this rank's part, once: the leader announces ``Close`` (after the call in
        progress) unless the group broke, and stops its keep-alive; a follower waits up to
        ``timeout_s`` (None: for good) for its loop to end. Returns whether this rank's thread
        has ended (True when none was started).

        Raises:
            DataParallelError: the leader could not announce ``Close`` (a rank is gone).
        """
        if self.leader:
            self._stop.set()
            with self._order:
                if not self._closed:
                    self._closed = True
                    if not self.dp.broken:
                        self._announce(Close(), self.encode(Close()))
        if self._thread is None:
            return True
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()


def exit_when_broken(ctx: RoleContext) -> Callable[[DataParallelError], None]:
    """An ``on_broken`` for a role's replica: log why and exit at once. A broken group never
    mends in place; the supervisor restarts the whole group (``one_for_all``), and a caller
    sends its call again to the new replica 0."""

    def broken(exc: DataParallelError) -> None:
        ctx.log.error(f"{ctx.name}.{ctx.replica}: exiting: {exc}")
        os._exit(1)

    return broken


async def leave(ctx: RoleContext, lockstep: Lockstep, timeout_s: float) -> bool:
    """End a replica's part in its group's calls, at teardown (``Lockstep.close`` in the
    replica's worker thread); returns whether it ended, so that the role may leave the group.
    A thread still in a collective (the leader never closed) is left to the process's exit,
    with a warning."""
    try:
        ended = await ctx.offload(lockstep.close, timeout_s)
    except DataParallelError as exc:
        ctx.log.warning(f"{ctx.name}: could not close the group's calls: {exc}")
        ended = False
    if not ended:
        ctx.log.warning(f"{ctx.name}.{ctx.replica}: leaving with the group's calls open")
    return ended
