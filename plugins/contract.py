"""The hardware contract: what training code asks of an accelerator, and nothing of RL.

A plugin is an object with the attributes of ``Plugin``: its device and memory (``Device``),
communication (``Communication``), operators (``Operators``: a fast set, and a reference set
the self-check compares it with), compilation (``Compiler``) and profiling (``Profiler``). Each
part is a ``typing.Protocol``: a vendor implements them with plain classes, inheriting nothing.
A sharded learner also asks for a mesh and a precision (``Sharding``, optional). Roles reach a
plugin only through ``asyncrl.plugins.registry`` and these types, and the errors the contract
names (``CollectiveTimeoutError``, re-exported here) (docs/plugins.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import msgspec
import torch

from asyncrl.plugins.errors import CollectiveTimeoutError

__all__ = [
    "CollectiveTimeoutError",
    "Communication",
    "Compiler",
    "Device",
    "MemoryStats",
    "Operators",
    "Plugin",
    "Profiler",
    "Sharding",
]


class MemoryStats(msgspec.Struct, frozen=True):
    """A device's memory, in bytes.

    Attributes:
        allocated: held by live tensors of this process.
        reserved: held by this process's caching allocator (allocated plus cache).
        peak: the most ``allocated`` since the last reset.
        total: the device's capacity (0 when unknown).
        available: free on the device now, for every process together (0 when unknown).
        limit: this process's share set by ``Device.limit_memory`` (0: none set).
    """

    allocated: int
    reserved: int
    peak: int
    total: int
    available: int = 0
    limit: int = 0


@runtime_checkable
class Device(Protocol):
    """Device selection, synchronisation, RNG and memory.

    Attributes:
        kind: the torch device type (``cpu``, ``cuda``, or a vendor's).
        visible_env: the environment variable that selects visible devices (empty: none).
    """

    kind: str
    visible_env: str

    def available(self) -> bool:
        """Whether this process can use the device at all."""
        ...

    def count(self) -> int:
        """How many devices this process sees."""
        ...

    def select(self, index: int = 0) -> torch.device:
        """Make device ``index`` current for this process and return it."""
        ...

    def synchronize(self) -> None:
        """Wait for the work queued on the current device."""
        ...

    def manual_seed(self, seed: int) -> None:
        """Seed the device's random number generators (and torch's)."""
        ...

    def memory(self) -> MemoryStats:
        """The current device's memory."""
        ...

    def release_cache(self) -> None:
        """Give cached, unused memory back (a role going idle calls it)."""
        ...

    def limit_memory(self, fraction: float) -> None:
        """Hold this process to ``fraction`` (0 < fraction <= 1) of the current device's
        memory, where the device can enforce it; ``memory().limit`` reports the budget either
        way. Two roles sharing a device each set their share (``placement.memory_fraction``).

        Raises:
            ValueError: ``fraction`` is not in (0, 1].
        """
        ...

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in page-locked host memory where that speeds copies (else itself)."""
        ...

    def copy_async(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``tensor`` on ``device``, copied asynchronously where the device allows."""
        ...


@runtime_checkable
class Communication(Protocol):
    """Collectives over the default ``torch.distributed`` group, or over a standalone group
    from ``pair_group``, each with a timeout.

    Attributes:
        backend: the ``torch.distributed`` backend name (``gloo``, ``nccl``, a vendor's).

    Every collective raises ``CollectiveTimeoutError`` (naming it and the ranks that did not
    arrive) when it does not complete within ``timeout_s``.
    """

    backend: str

    def all_reduce(self, tensor: torch.Tensor, *, timeout_s: float) -> None:
        """Sum ``tensor`` over the ranks, in place."""
        ...

    def all_gather(self, tensor: torch.Tensor, *, timeout_s: float) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (the same shape on each), in rank order."""
        ...

    def broadcast(
        self, tensor: torch.Tensor, src: int, *, timeout_s: float, group: Any = None
    ) -> None:
        """``tensor`` of rank ``src`` into every rank's ``tensor``, in place; on ``group`` (one
        ``pair_group`` gave) instead of the default group when given. On such a group a CPU
        tensor is staged through the device where the backend needs one (nccl).

        Raises:
            CollectiveTimeoutError: not complete within ``timeout_s``.
            BrokenError: on ``group``, a peer died or closed its connection (the backend's
                error is the cause).
        """
        ...

    def pair_group(
        self, store: Any, rank: int, world: int, *, timeout_s: float, address: str = ""
    ) -> AbstractContextManager[Any]:
        """A standalone group of ``world`` ranks, apart from the default group (this process
        may be in a data-parallel one): ``with comm.pair_group(...) as group:``, then
        ``broadcast(..., group=group)``. A weight relay and its learner form one per transfer.

        Args:
            store: a ``torch.distributed`` store the ranks share (a ``PrefixStore`` of its own
                per group); the group's collectives mark their arrivals in it.
            rank: this process's rank in the group, world: the group's size.
            timeout_s: how long every rank is waited for, here and in the backend.
            address: this host's address the peers reach (gloo binds it); empty: the backend's
                default.

        Leaving the block releases the group; leaving it with an error aborts it, so a peer
        that died leaves no work waiting.

        Raises:
            CollectiveTimeoutError: not every rank came within ``timeout_s``.
        """
        ...

    def barrier(self, *, timeout_s: float) -> None:
        """Return when every rank has arrived."""
        ...


@runtime_checkable
class Operators(Protocol):
    """The numerical kernels a training step and a rollout use."""

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool
    ) -> torch.Tensor:
        """Scaled dot-product attention over [B, H, T, D] inputs."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension."""
        ...

    def layer_norm(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """LayerNorm over the last dimension."""
        ...

    def logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``log softmax(logits)`` at ``targets``: [..., V], [...] -> [...]."""
        ...

    def entropy(self, logits: torch.Tensor) -> torch.Tensor:
        """The entropy of ``softmax(logits)`` at each position: [..., V] -> [...]."""
        ...

    def sampling_probs(
        self, logits: torch.Tensor, *, temperature: float, top_p: float, top_k: int
    ) -> torch.Tensor:
        """The distribution sampling draws from: temperature, then top-k (0: all), then
        top-p (1: all), renormalised. [N, V] -> [N, V]."""
        ...

    def sample(
        self,
        logits: torch.Tensor,
        *,
        temperature: float,
        top_p: float,
        top_k: int,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """One token per row drawn from ``sampling_probs``: [N, V] -> [N]."""
        ...


@runtime_checkable
class Compiled(Protocol):
    """A function compiled per sequence-length bucket.

    Attributes:
        compiles: how many graphs were compiled so far.
        eager: whether it runs eagerly (asked for, or compilation failed).
        error: why compilation failed, when it did (else empty).
    """

    compiles: int
    eager: bool
    error: str

    def __call__(self, *args: torch.Tensor) -> Any:
        """``fn``'s outputs: a tensor or a tuple of tensors."""
        ...


@runtime_checkable
class Compiler(Protocol):
    """Graph compilation with sequence-length bucketing and an eager fallback."""

    def compile(self, fn: Callable[..., Any], *, buckets: Sequence[int], dim: int = 1) -> Compiled:
        """``fn`` compiled for each bucket: inputs are padded along ``dim`` to the smallest
        bucket that holds them, and outputs cut back (each output of a tuple whose size along
        ``dim`` is the bucket's; a 0-dim loss is returned as it is), so changing lengths do not
        recompile."""
        ...


@runtime_checkable
class Profiler(Protocol):
    """Ranges recorded as Chrome trace events (``ph: X``, microseconds)."""

    def range(self, name: str) -> AbstractContextManager[None]:
        """Record the time spent inside the ``with`` block under ``name``."""
        ...

    def events(self) -> Iterator[dict[str, Any]]:
        """The recorded events, oldest first."""
        ...


@runtime_checkable
class Sharding(Protocol):
    """What a sharded learner (FSDP2) needs of the hardware: an optional part of a plugin.
    A plugin without one gets ``asyncrl.plugins.sharding.TorchSharding`` for its device kind
    (``asyncrl.plugins.registry.sharding_for``)."""

    def mesh(self, world: int) -> Any:
        """The 1-D ``DeviceMesh`` of the default process group's ``world`` ranks."""
        ...

    def mixed_precision(self, storage: torch.dtype) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` for parameters kept in ``storage``, or None to
        compute in ``storage`` itself."""
        ...


@runtime_checkable
class Plugin(Protocol):
    """A hardware plugin.

    Attributes:
        name: the name it registers under (``cpu``, ``cuda``, a vendor's).
        asyncrl_versions: the asyncrl versions it supports, a PEP 440 specifier (``>=0.1,<0.2``).
        dtype: the parameters' dtype it trains in by default.
        device, comm, ops, reference_ops, compiler, profiler: the parts of the contract.
    """

    name: str
    asyncrl_versions: str
    dtype: torch.dtype
    device: Device
    comm: Communication
    ops: Operators
    reference_ops: Operators
    compiler: Compiler
    profiler: Profiler
