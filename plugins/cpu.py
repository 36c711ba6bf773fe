"""The built-in ``cpu`` plugin: torch on the host, gloo collectives, float32 training."""

from __future__ import annotations

import gc
import os
import resource

import torch

from asyncrl.plugins.collectives import TorchCommunication
from asyncrl.plugins.compiling import BucketCompiler
from asyncrl.plugins.contract import MemoryStats
from asyncrl.plugins.profiling import TraceProfiler
from asyncrl.plugins.torch_ops import FastOps, ReferenceOps

__all__ = ["CpuDevice", "CpuPlugin", "plugin"]


def _rss() -> int:
    """This process's resident memory in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class CpuDevice:
    """The host as the device. Memory is the process's resident set: on CPU, torch has no
    allocator of its own to ask."""

    kind = "cpu"
    visible_env = ""

    def available(self) -> bool:
        return True

    def count(self) -> int:
        return 1

    def select(self, index: int = 0) -> torch.device:
        if index != 0:
            raise ValueError(f"cpu: there is one device (index 0), got index {index}")
        return torch.device("cpu")

    def synchronize(self) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def memory(self) -> MemoryStats:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        rss = _rss()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return MemoryStats(allocated=rss, reserved=rss, peak=max(peak, rss), total=total)

    def release_cache(self) -> None:
        gc.collect()

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def copy_async(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return tensor.to(device)


class CpuPlugin:
    """The ``cpu`` plugin (see ``asyncrl.plugins.contract.Plugin``)."""

    name = "cpu"
    asyncrl_versions = ">=0.1,<0.2"
    dtype = torch.float32

    def __init__(self) -> None:
        self.device = CpuDevice()
        self.comm = TorchCommunication("gloo")
        self.ops = FastOps()
        self.reference_ops = ReferenceOps()
        self.compiler = BucketCompiler("inductor")
        self.profiler = TraceProfiler()


def plugin() -> CpuPlugin:
    """The entry point of ``cpu`` (``asyncrl.plugins``)."""
    return CpuPlugin()
