"""``torch.distributed`` collectives with a timeout that names the ranks that did not arrive.

Each collective is numbered in this process, from 1 in each process group (a group formed again
after a restart counts afresh, as its restarted ranks do); before it starts, the rank marks its
arrival in the group's store (``asyncrl/<collective>/<n>/<rank>``). When the collective does not
complete in time, the ranks whose mark is missing are the ones that never came, and the error
names them. A collective that fails otherwise (a peer's connection closed: it died) raises the
backend's own error, which is not a timeout.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.plugins.errors import CollectiveTimeoutError

__all__ = ["TorchCommunication"]


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

    def all_reduce(self, tensor: torch.Tensor, *, timeout_s: float) -> None:
        self._run("all_reduce", timeout_s, lambda: dist.all_reduce(tensor, async_op=True))

    def all_gather(self, tensor: torch.Tensor, *, timeout_s: float) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        self._run("all_gather", timeout_s, lambda: dist.all_gather(out, tensor, async_op=True))
        return out

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout_s: float) -> None:
        self._run("broadcast", timeout_s, lambda: dist.broadcast(tensor, src, async_op=True))

    def barrier(self, *, timeout_s: float) -> None:
        self._run("barrier", timeout_s, lambda: dist.barrier(async_op=True))
