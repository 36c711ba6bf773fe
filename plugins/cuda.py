"""The built-in ``cuda`` plugin: torch.cuda devices, NCCL collectives, bfloat16 training.

Written against ``torch.cuda``; on a machine without a GPU ``device.available()`` is False,
detection passes it over and the self-check reports it as unavailable.
"""

from __future__ import annotations

import os

import torch

from asyncrl.plugins.collectives import TorchCommunication
from asyncrl.plugins.compiling import BucketCompiler
from asyncrl.plugins.contract import MemoryStats
from asyncrl.plugins.cpu import check_fraction
from asyncrl.plugins.profiling import TraceProfiler
from asyncrl.plugins.sharding import TorchSharding
from asyncrl.plugins.torch_ops import FastOps, ReferenceOps

__all__ = ["CudaDevice", "CudaPlugin", "plugin"]


class CudaDevice:
    """A CUDA device of this process (``CUDA_VISIBLE_DEVICES`` chooses which it sees)."""

    kind = "cuda"
    visible_env = "CUDA_VISIBLE_DEVICES"

    def __init__(self) -> None:
        self.fractions: dict[int, float] = {}

    def available(self) -> bool:
        return torch.cuda.is_available()

    def count(self) -> int:
        return torch.cuda.device_count() if self.available() else 0

    def select(self, index: int = 0) -> torch.device:
        if not 0 <= index < self.count():
            raise ValueError(
                f"cuda: device {index} requested, but this process sees {self.count()} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get(self.visible_env, 'unset')!r})"
            )
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def memory(self) -> MemoryStats:
        index = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        return MemoryStats(
            allocated=torch.cuda.memory_allocated(index),
            reserved=torch.cuda.memory_reserved(index),
            peak=torch.cuda.max_memory_allocated(index),
            total=total,
            available=free,
            limit=int(self.fractions.get(index, 0.0) * total),
        )

    def release_cache(self) -> None:
        torch.cuda.empty_cache()

    def limit_memory(self, fraction: float) -> None:
        """Cap this process's caching allocator on the current device at ``fraction`` of its
        memory (``torch.cuda.set_per_process_memory_fraction``): an allocation past it raises
        ``torch.OutOfMemoryError`` in this process, leaving the other roles' share alone. Memory
        outside the allocator (the CUDA context, NCCL's buffers) is not counted."""
        index = torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(check_fraction(fraction), index)
        self.fractions[index] = fraction

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def copy_async(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return tensor.to(device, non_blocking=True)


class CudaPlugin:
    """The ``cuda`` plugin (see ``asyncrl.plugins.contract.Plugin``)."""

    name = "cuda"
    asyncrl_versions = ">=0.1,<0.2"
    dtype = torch.bfloat16

    def __init__(self) -> None:
        self.device = CudaDevice()
        self.comm = TorchCommunication("nccl")
        self.ops = FastOps()
        self.reference_ops = ReferenceOps()
        self.compiler = BucketCompiler("inductor")
        self.profiler = TraceProfiler(self._sync)
        self.sharding = TorchSharding("cuda", torch.bfloat16)

    def _sync(self) -> None:
        if self.device.available():
            torch.cuda.synchronize()


def plugin() -> CudaPlugin:
    """The entry point of ``cuda`` (``asyncrl.plugins``)."""
    return CudaPlugin()
