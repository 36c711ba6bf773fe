"""``torch.distributed`` collectives with a timeout that names the ranks that did not arrive.

Each collective is numbered in this process, from 1 in each process group (a group formed again
after a restart counts afresh, as its restarted ranks do); before it starts, the rank marks its
arrival in the group's store (``asyncrl/<collective>/<n>/<rank>``). When the collective does not
complete in time, the ranks whose mark is missing are the ones that never came, and the error
names them. A collective that fails otherwise (a peer's connection closed: it died) raises the
backend's own error, which is not a timeout.

``pair_group`` forms a standalone group apart from the default one (a relay and a learner that
may already be in a data-parallel group): its ranks meet through a store of their own, and its
collectives mark their arrivals there (kept until that store goes: it may be hosted by the
peer, and a store whose host went silent never answers; after a timeout it is asked which ranks
arrived for at most 2 s, from a thread of its own, so a transfer ends at its deadline whatever
became of the peer). On such a group a peer that dies raises ``BrokenError`` (its cause the
backend's error), so its other rank can tell the two failures apart and retry.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from asyncrl.errors import BrokenError
from asyncrl.plugins.errors import CollectiveTimeoutError

__all__ = ["PairGroup", "TorchCommunication"]

T = TypeVar("T")


def _default_store() -> Any:
    """The default group's store, or None where torch does not expose it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a private function: absent or failing on another torch
        return None


def _forget(store: Any, key: str) -> None:
    """Delete this rank's mark of an ended collective: the store keeps no key per collective
    of a long run. A store without ``delete_key`` keeps it."""
    try:
        store.delete_key(key)
    except (AttributeError, RuntimeError, NotImplementedError):
        pass


def _release(group: Any, how: str) -> None:
    """``group.abort()`` or ``group.shutdown()`` where the backend has it; a backend that
    cannot is left to be collected."""
    try:
        getattr(group, how)()
    except (AttributeError, RuntimeError, NotImplementedError):
        pass


_LOOKUP_S = 2.0
"""How long a timed-out collective of a pair group asks its store which ranks arrived. The
store may be hosted by the peer that went silent (a relay whose host stopped answering): its
connection stays open and a question to it is never answered, so it is asked from a thread of
its own and given up on after this."""


def _within(seconds: float, ask: Callable[[], T]) -> T | None:
    """``ask()`` in a daemon thread of its own; its result, or None when it raised or did not
    return within ``seconds`` (the thread is then left to its call, and holds no exit)."""
    done = threading.Event()
    out: list[T] = []

    def run() -> None:
        try:
            out.append(ask())
        except Exception:  # the store is gone with the rank that held it
            pass
        finally:
            done.set()

    threading.Thread(target=run, name="asyncrl pair-group lookup", daemon=True).start()
    done.wait(seconds)
    return out[0] if out else None


def _wait(work: Any, timeout_s: float) -> None:
    """Wait for ``work`` (an ``async_op`` handle) at most ``timeout_s``, then raise its error.

    Polls ``is_completed``: gloo's ``wait`` ignores its timeout argument, so a rank that never
    comes would otherwise hold this one for the whole group's timeout.

    Raises:
        TimeoutError: the work did not complete in time.
    """
    deadline = time.monotonic() + timeout_s
    pause = 1e-5
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not complete after {timeout_s:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)
    work.wait()


@dataclass(eq=False)
class PairGroup:
    """A standalone process group from ``TorchCommunication.pair_group``.

    Attributes:
        backend: the process group (``ProcessGroupGloo``, ``ProcessGroupNCCL``, a vendor's).
        store: the store its ranks met through, where its collectives mark their arrivals.
        rank, world: this rank and the group's size.
        device: where its collectives run: tensors on the CPU are staged there (nccl: the
            current CUDA device), one buffer reused while it is large enough.
    """

    backend: Any
    store: Any
    rank: int
    world: int
    device: torch.device
    count: int = 0
    staging: torch.Tensor | None = None


def _form(backend: str, store: Any, rank: int, world: int, timeout_s: float, address: str) -> Any:
    """The process group of ``backend`` over ``store``, outside the default group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        gloo: Any = dist.ProcessGroupGloo  # its options with devices are not in torch's stubs
        options = gloo._Options()
        options._timeout = timeout
        device = gloo.create_device(hostname=address) if address else gloo.create_default_device()
        options._devices = [device]
        return gloo(store, rank, world, options)
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if backend == "nccl" and nccl is not None:
        options = nccl.Options()
        options._timeout = timeout
        return nccl(store, rank, world, options)
    plugin = getattr(dist.Backend, "_plugins", {}).get(backend.upper())
    if plugin is None:
        raise NotImplementedError(
            f"pair_group: torch.distributed has no backend {backend!r} to form a standalone "
            f"group with; register it (torch.distributed.Backend.register_backend) or give the "
            f"plugin a Communication of its own"
        )
    return plugin.creator_fn(store, rank, world, timeout)


class TorchCommunication:
    """The collectives of the ``Communication`` contract over ``torch.distributed``.

    Args:
        backend: the backend name the group is formed with (``gloo``, ``nccl``, a vendor's).
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._count = 0
        self._marks: deque[str] = deque()  # this rank's marks of its last collectives
        self._group: Any = None  # the process group counted in (kept: ``is`` stays reliable)

    def _run(self, name: str, timeout_s: float, start: Any) -> None:
        """``start()`` (an ``async_op`` collective), waited for at most ``timeout_s``.

        Raises:
            CollectiveTimeoutError: it did not complete in time.
            RuntimeError: the backend's error when it failed otherwise (a peer died).
        """
        group = dist.group.WORLD
        if group is not self._group:
            self._group, self._count, self._marks = group, 0, deque()
        self._count += 1
        rank, world = dist.get_rank(), dist.get_world_size()
        store = _default_store()
        prefix = f"asyncrl/{name}/{self._count}"
        if store is not None:
            store.set(f"{prefix}/{rank}", "1")
            self._marks.append(f"{prefix}/{rank}")
            if len(self._marks) > 2:  # every rank has begun the one before, so ended this one
                _forget(store, self._marks.popleft())
        try:
            _wait(start(), timeout_s)
        except TimeoutError as exc:
            missing: list[int] = []
            if store is not None:
                try:
                    missing = [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
                except Exception:  # the store itself may be gone with the rank that held it
                    missing = []
            raise CollectiveTimeoutError(name, missing, timeout_s, rank) from exc

    def _run_pair(
        self, group: PairGroup, name: str, timeout_s: float, start: Callable[[], Any]
    ) -> None:
        """``start()`` on ``group``, its arrival marked in the group's store, waited for at most
        ``timeout_s``.

        Raises:
            CollectiveTimeoutError: it did not complete in time.
            BrokenError: the backend failed otherwise: a peer died or closed its connection.
        """
        group.count += 1
        prefix = f"asyncrl/{name}/{group.count}"
        try:
            # ``set`` awaits no answer; the marks stay until the group's store goes (one
            # store per group: forgetting them would await its host, which may be the peer).
            group.store.set(f"{prefix}/{group.rank}", "1")
            _wait(start(), timeout_s)
        except TimeoutError as exc:
            keys = [f"{prefix}/{r}" for r in range(group.world)]
            arrived = _within(_LOOKUP_S, lambda: [group.store.check([k]) for k in keys])
            missing = [] if arrived is None else [r for r, a in enumerate(arrived) if not a]
            raise CollectiveTimeoutError(name, missing, timeout_s, group.rank) from exc
        except RuntimeError as exc:
            raise BrokenError(
                f"{name} on a group of {group.world} ranks (this is rank {group.rank}) broke: "
                f"a peer died or closed its connection ({exc}); check that process's log"
            ) from exc

    @contextmanager
    def pair_group(
        self, store: Any, rank: int, world: int, *, timeout_s: float, address: str = ""
    ) -> Iterator[PairGroup]:
        formed: Any = None
        try:
            formed = _form(self.backend, store, rank, world, timeout_s, address)
        except (RuntimeError, dist.DistStoreError) as exc:  # a peer that never came
            raise CollectiveTimeoutError("pair_group", [], timeout_s, rank) from exc
        device = torch.device("cpu")
        if self.backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        group = PairGroup(formed, store, rank, world, device)
        try:
            yield group
        except BaseException:
            # A peer that died leaves the group's work waiting: abort it rather than let it
            # hold a thread (or a device's communicator) until its timeout.
            _release(formed, "abort")
            raise
        else:
            _release(formed, "shutdown")

    def all_reduce(self, tensor: torch.Tensor, *, timeout_s: float) -> None:
        self._run("all_reduce", timeout_s, lambda: dist.all_reduce(tensor, async_op=True))

    def all_gather(self, tensor: torch.Tensor, *, timeout_s: float) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        self._run("all_gather", timeout_s, lambda: dist.all_gather(out, tensor, async_op=True))
        return out

    def broadcast(
        self, tensor: torch.Tensor, src: int, *, timeout_s: float, group: Any = None
    ) -> None:
        if group is None:
            self._run("broadcast", timeout_s, lambda: dist.broadcast(tensor, src, async_op=True))
            return
        assert isinstance(group, PairGroup)
        staged = tensor
        if tensor.device != group.device:
            n = tensor.numel() * tensor.element_size()
            if group.staging is None or group.staging.numel() < n:
                group.staging = torch.empty(n, dtype=torch.uint8, device=group.device)
            staged = group.staging[:n].view(tensor.dtype).view(tensor.shape)
            if group.rank == src:
                staged.copy_(tensor)
        options = dist.BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        self._run_pair(
            group, "broadcast", timeout_s, lambda: group.backend.broadcast([staged], options)
        )
        if staged is not tensor and group.rank != src:
            tensor.copy_(staged)

    def barrier(self, *, timeout_s: float) -> None:
        self._run("barrier", timeout_s, lambda: dist.barrier(async_op=True))
