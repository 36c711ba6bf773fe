"""One order of calls on every rank of a data-parallel critic (``asyncrl.roles.training.critic``).

A critic with ``replicas: K`` is one ``torch.distributed`` group
(``asyncrl.roles.training.data_parallel``). With ``parallel: fsdp`` every forward pass is a
collective of all its ranks, and with either ``parallel`` a training step all-reduces or
reduce-scatters its gradients, so every rank must run the same ``values`` and ``train_step`` calls
in the same order, while callers (the program, a sample pipeline) call the critic concurrently and a
handle sends each call to one replica. ``Lockstep`` gives them that order:

- **Replica 0 leads.** Callers reach the critic through replica 0 only (``CriticClient`` sends
  every call there; another replica refuses a call with a message naming replica 0). Replica 0
  runs its calls one at a time (``lead`` holds one lock from announcing a call to its end, so
  concurrent calls in several worker threads still run one after the other) and, before running
  one, broadcasts it to the other ranks: a typed message (``Values``, ``TrainStep``), encoded
  with msgspec's msgpack and sent as a uint8 tensor over the group
  (``DataParallel.broadcast_bytes``), never pickled. Results come from replica 0.
- **The others follow.** Each other rank runs a loop in a thread of its own that receives the
  calls and runs exactly the same sequence; a result it computes is dropped (the collectives
  inside the call gather what replica 0 returns).
- **Liveness.** A follower waits for the next call in a collective bounded by the group's
  timeout (``dist_timeout_s``). So that a leader with no work is not taken for a dead one, it
  broadcasts ``Idle`` when it announced nothing for ``idle_s`` (a quarter of the timeout by
  default), from a thread of its own that takes the same lock.
- **Failure.** A collective that fails (a rank died or did not come in time) breaks the group
  for good (``DataParallel.broken``); so does a call that raises on any rank once it was
  announced, since the ranks may then wait at different collectives. Either way ``on_broken``
  is told, on whichever thread saw it (the critic exits, so that ``one_for_all`` restarts the
  group, as a broken learner group does). A call the leader refuses before announcing it is the
  caller's error and breaks nothing: the critic checks what it can (``mini_batches``) first.
- **Closing.** The leader's ``close`` announces ``Close``, which ends the followers' loops; a
  follower's ``close`` waits for that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from asyncrl.errors import ClosedError
from asyncrl.roles.payloads import Sample, Scored
from asyncrl.roles.training.data_parallel import DataParallel, DataParallelError

__all__ = [
    "Announcement",
    "Close",
    "CriticCall",
    "Idle",
    "Lockstep",
    "TrainStep",
    "Values",
    "decode",
    "encode",
]


class Values(msgspec.Struct, tag="values", forbid_unknown_fields=True):
    """``Critic.values`` on these samples."""

    samples: list[Sample]


class TrainStep(msgspec.Struct, tag="train_step", forbid_unknown_fields=True):
    """``Critic.train_step`` on this batch (``id``: its ``CriticBatch.id``)."""

    batch: list[Scored]
    id: str = ""


class Idle(msgspec.Struct, tag="idle", forbid_unknown_fields=True):
    """Nothing to run: the leader is alive and had no call for a while."""


class Close(msgspec.Struct, tag="close", forbid_unknown_fields=True):
    """The leader closes: no call follows; the followers' loops end."""


CriticCall = Values | TrainStep
"""A call every rank runs."""
Announcement = Values | TrainStep | Idle | Close
"""What the leader broadcasts: a call, or one of the group's own messages."""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Announcement)


def encode(message: Announcement) -> bytes:
    """``message`` as MessagePack (a map with its tag under ``type``)."""
    return _encoder.encode(message)


def decode(data: bytes) -> Announcement:
    """The message ``encode`` wrote.

    Raises:
        msgspec.ValidationError, msgspec.DecodeError: the bytes are not one.
    """
    message: Announcement = _decoder.decode(data)
    return message


def _kind(message: Announcement) -> str:
    """The message's tag: ``values``, ``train_step``, ``idle``, ``close``."""
    return str(message.__struct_config__.tag)


class Lockstep:
    """The order of a data-parallel critic's calls, on one rank of its group.

    Args:
        dp: this rank's handle on the group; rank 0 leads.
        run: runs one call on this rank and returns its result (every rank's collectives
            inside it meet those of the other ranks running the same call).
        on_broken: told, once, when the group broke; on whichever thread saw it.
        idle_s: the leader announces ``Idle`` after this long without announcing anything;
            None: a quarter of ``dp.timeout_s``.
        thread_setup: called first in each thread ``start`` begins (to select this rank's
            device in it: the current device is per thread).
    """

    def __init__(
        self,
        dp: DataParallel,
        run: Callable[[CriticCall], Any],
        *,
        on_broken: Callable[[DataParallelError], None],
        idle_s: float | None = None,
        thread_setup: Callable[[], object] | None = None,
    ) -> None:
        self.dp = dp
        self.run = run
        self.on_broken = on_broken
        self.idle_s = dp.timeout_s / 4 if idle_s is None else idle_s
        self.thread_setup = thread_setup
        self.leader = dp.rank == 0
        self.calls = 0  # calls run on this rank
        self.idles = 0  # Idle messages sent (leader) or received (follower)
        self._lock = threading.Lock()
        self._last = time.monotonic()  # the end of the last announcement or call
        self._closed = False
        self._told = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def where(self) -> str:
        """This rank, for messages: ``critic.1``."""
        return f"{self.dp.name}.{self.dp.rank}"

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

    def lead(self, call: CriticCall) -> Any:
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
        with self._lock:
            if self._closed:
                raise ClosedError(f"{self.where}: the critic's group is closed; no call runs")
            try:
                self._announce(call)
            except DataParallelError as exc:
                self._broke(exc)
                raise
            return self._run(call)

    def _announce(self, message: Announcement) -> None:
        """Broadcast ``message`` (the lock held).

        Raises:
            DataParallelError: the broadcast failed, or the group broke earlier.
        """
        self.dp.broadcast_bytes(f"the critic's next call ({_kind(message)})", encode(message))
        self._last = time.monotonic()

    def _keep_alive(self) -> None:
        """The leader's thread: ``Idle`` whenever nothing was announced for ``idle_s``."""
        while not self._stop.wait(self.idle_s / 2):
            with self._lock:
                if self._closed or self.dp.broken:
                    return
                if time.monotonic() - self._last < self.idle_s:
                    continue
                self._announce(Idle())
                self.idles += 1

    # -- follower -----------------------------------------------------------------------------

    def _follow(self) -> None:
        """A follower's thread: run each call the leader announces until ``Close``."""
        while True:
            data = self.dp.broadcast_bytes("the critic's next call")
            try:
                message = decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise self._failed("reading the leader's call", exc) from exc
            if isinstance(message, Close):
                return
            if isinstance(message, Idle):
                self.idles += 1
                continue
            self._run(message)

    # -- both ---------------------------------------------------------------------------------

    def _run(self, call: CriticCall) -> Any:
        """``run(call)``; anything it raises breaks the group (``on_broken`` is told)."""
        try:
            result = self.run(call)
        except DataParallelError as exc:
            if not self.dp.broken:  # the ranks disagreed, rather than a collective failing
                self.dp.broken = f"rank {self.dp.rank}: {_kind(call)} failed ({exc})"
            self._broke(exc)
            raise
        except Exception as exc:
            error = self._failed(f"{_kind(call)} (announced to every rank)", exc)
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
            with self._lock:
                if not self._closed:
                    self._closed = True
                    if not self.dp.broken:
                        self._announce(Close())
        if self._thread is None:
            return True
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()
