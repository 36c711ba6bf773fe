"""Reused host-memory buffers for the collectives of FSDP2 units on the CPU.

Each FSDP unit allocates, every pass, a flat buffer for its all-gather (the whole unit's
parameters), one for its reduce-scatter's input (the whole unit's gradients) and one for its
output (the rank's shard of them, which becomes the sharded gradients). On the CPU these are
plain ``malloc``s of tens of MiB. glibc serves the largest from fresh ``mmap``s, whose every
page faults in again on first touch (a 303M model's step faulted in about 4 GiB this way),
and the smaller ones from its heaps, where buffers that die interleaved with the sharded
gradients, which live until the next step, leave holes that no later request fits: freed
memory the process keeps resident.

``BufferPool`` keeps every buffer it handed out and hands it out again, for a request of the
same size and dtype, once nothing refers to its storage any more (no view of it is alive: its
storage's reference count is back to the pool's own). The units' buffers are then allocated
once, at the first step, and their pages stay in place. The all-gather output and the
reduce-scatter input of a unit have the same size, and so do all the blocks' buffers, so a
pool holds about one buffer of each kind per concurrent use, plus the sharded gradients.

Only for the CPU: on an accelerator the caching allocator already reuses memory, and buffers
used on side streams must not be handed out again by a reference count alone.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

__all__ = ["BufferPool", "PooledAllGather", "PooledReduceScatter", "release_in_backward"]


def _uses(t: torch.Tensor) -> int:
    """How many tensors (and views) refer to ``t``'s storage."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


class BufferPool:
    """Flat host buffers by (element count, dtype, device), each handed out again once no
    tensor refers to it. Not thread-safe: FSDP2 calls it from the thread that runs the pass."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, torch.dtype, torch.device], list[tuple[torch.Tensor, int]]]
        self._buffers = {}

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A tensor of ``size`` (uninitialised) viewing a free buffer of the pool, or a new one
        the pool keeps."""
        numel = math.prod(int(s) for s in size)
        shape = tuple(int(s) for s in size)
        kept = self._buffers.setdefault((numel, dtype, torch.device(device)), [])
        for buffer, idle in kept:
            if _uses(buffer) == idle:
                return buffer.view(shape)
        buffer = torch.empty(numel, dtype=dtype, device=device)
        kept.append((buffer, _uses(buffer)))
        return buffer.view(shape)

    def held_bytes(self) -> int:
        """The bytes of every buffer the pool keeps, in use or not."""
        return sum(b.numel() * b.element_size() for kept in self._buffers.values() for b, _ in kept)


class PooledAllGather(AllGather):
    """FSDP2's all-gather (``all_gather_single``) into buffers of ``pool``."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return self.pool.allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        return dist.all_gather_single(  # type: ignore[no-any-return]
            output_tensor, input_tensor, group=group, async_op=async_op
        )


class PooledReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter (``reduce_scatter_single``) from and into buffers of ``pool``."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return self.pool.allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work:
        return dist.reduce_scatter_single(  # type: ignore[no-any-return]
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
        )


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    try:
        trim: Any = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]


def _release(_: torch.Tensor) -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def release_in_backward(model: torch.nn.Module, blocks: Sequence[torch.nn.Module]) -> None:
    """Give the free pages of the C library's heaps back to the system at a few points of each
    backward pass of ``model`` (a Hugging Face causal LM): as it starts (the logits' gradient),
    after every quarter of ``blocks`` and before the input embedding's backward, when every
    block's gathered parameters and whole gradients are gone and the root unit is about to
    reduce the tied embedding's whole gradient. glibc keeps every page of a freed heap chunk
    resident, and in the backward pass the blocks' gathered parameters and whole gradients
    land on fresh pages while the activations they free are left behind, so without this the
    resident set climbs through the pass to its peak. A page given back faults in again when
    it is reused, so this is done a few times a pass rather than after every unit; the forward
    pass gets the same points between blocks. A C library without ``malloc_trim`` is left
    alone."""
    if _malloc_trim() is None:
        return
    ends: list[Any] = [getattr(model, name, lambda: None)() for name in _EMBEDDINGS]
    stride = max(1, len(blocks) // 4)
    for module in [*ends, *list(blocks)[stride - 1 : -1 : stride]]:
        if isinstance(module, torch.nn.Module):
            module.register_forward_hook(_hook_output)
    # The forward pass climbs the same way (gathered parameters on fresh pages, the saved
    # activations pinning the old ones): the same points, as it reaches them.
    for block in list(blocks)[stride - 1 : -1 : stride]:
        block.register_forward_pre_hook(_release_before)


_EMBEDDINGS = ("get_input_embeddings", "get_output_embeddings")


def _release_before(_: torch.nn.Module, __: Any) -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _hook_output(_: torch.nn.Module, __: Any, output: Any) -> None:
    first = output[0] if isinstance(output, tuple) and output else output
    if isinstance(first, torch.Tensor) and first.requires_grad:
        first.register_hook(_release)  # type: ignore[no-untyped-call]
