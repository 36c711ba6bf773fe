"""The built-in ``cpu`` plugin: torch on the host, gloo collectives, float32 training.

Memory on the host is the process's resident set (torch has no allocator of its own to ask
there). ``release_cache`` collects garbage and then asks glibc to return its free heap to the
system (``malloc_trim``), which is what makes a freed buffer leave the resident set.
``limit_memory`` records a budget and reports usage against it, but does not enforce it: the
only per-process limit Linux offers, ``RLIMIT_AS``, caps address space, not memory, and torch's
thread pools and allocator arenas reserve far more address space than they touch, so a process
under it fails at random allocations long before it uses its share.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import resource
from collections.abc import Callable

import torch

from asyncrl.plugins.collectives import TorchCommunication
from asyncrl.plugins.compiling import BucketCompiler
from asyncrl.plugins.contract import MemoryStats
from asyncrl.plugins.graph_rewrites import tanh_gelu_as_sigmoid
from asyncrl.plugins.profiling import TraceProfiler
from asyncrl.plugins.sharding import TorchSharding
from asyncrl.plugins.torch_ops import FastOps, ReferenceOps

__all__ = ["CpuDevice", "CpuPlugin", "check_fraction", "host_memory", "plugin"]


def check_fraction(fraction: float) -> float:
    """``fraction`` when it is a memory share (0 < fraction <= 1).

    Raises:
        ValueError: it is not.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(
            f"memory fraction must be in (0, 1], got {fraction!r}; it is the share of the "
            f"device's memory this process may use (placement.memory_fraction)"
        )
    return float(fraction)


def _rss() -> int:
    """This process's resident memory in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """The fields of ``/proc/meminfo`` in bytes ({} where it is missing)."""
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    unit = 1024 if fields[1:] == ["kB"] else 1
                    out[key] = int(fields[0]) * unit
    except OSError:
        return {}
    return out


_NO_LIMIT_V1 = 1 << 60
"""cgroup v1 reads its page counter's maximum (about 2**63) where no limit is set."""


def _own_cgroups(path: str) -> dict[str, str]:
    """This process's cgroup paths from ``/proc/self/cgroup``: cgroup v2's under ``""``, each
    cgroup v1 controller's under its name (``memory``)."""
    out: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                _, controllers, rest = line.rstrip("\n").split(":", 2)
                for name in controllers.split(",") if controllers else [""]:
                    out[name] = rest
    except (OSError, ValueError):
        return {}
    return out


def _cgroup_limit(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> tuple[int, int]:
    """This process's memory limit and use, or (0, 0) where there is none: the lowest limit
    of its own cgroup and the cgroups above it (a systemd slice's, a container's), with the
    use counted where that limit is set; cgroup v2's ``memory.max`` and ``memory.current``,
    else cgroup v1's ``memory.limit_in_bytes`` and ``memory.usage_in_bytes`` under
    ``memory/``. A process in a cgroup namespace sees its own cgroup as the root; a path that
    is not under ``root`` (another mount's view) falls back to the root alone."""
    paths = _own_cgroups(own)
    for base, key, limit_file, used_file in (
        (root, "", "memory.max", "memory.current"),
        (os.path.join(root, "memory"), "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"),
    ):
        found = False
        best = (0, 0)
        for folder in _up_to(base, paths.get(key, "/")):
            try:
                with open(os.path.join(folder, limit_file)) as f:
                    raw = f.read().strip()
                with open(os.path.join(folder, used_file)) as f:
                    used = int(f.read().strip())
            except (OSError, ValueError):
                continue
            found = True
            if raw.isdigit() and int(raw) < _NO_LIMIT_V1 and (not best[0] or int(raw) < best[0]):
                best = (int(raw), used)
        if found:
            return best
    return 0, 0


def _up_to(base: str, path: str) -> list[str]:
    """``base`` joined with ``path``, then each folder above it up to ``base`` itself; just
    ``base`` when the joined folder does not exist."""
    folder = os.path.normpath(os.path.join(base, path.lstrip("/")))
    if not os.path.isdir(folder) or os.path.commonpath([folder, base]) != os.path.normpath(base):
        return [base]
    folders = [folder]
    while folder != os.path.normpath(base):
        folder = os.path.dirname(folder)
        folders.append(folder)
    return folders


def host_memory() -> tuple[int, int]:
    """The host's memory as this process can use it, in bytes: (total, available); a cgroup
    limit (a container's) lowers both."""
    info = _meminfo()
    total = info.get("MemTotal") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    available = info.get("MemAvailable", 0)
    limit, used = _cgroup_limit()
    if limit:
        total, available = min(total, limit), min(available, max(0, limit - used))
    return total, available


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None on another C library)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class CpuDevice:
    """The host as the device. Memory is the process's resident set: on CPU, torch has no
    allocator of its own to ask; the peak is the resident set's high-water mark."""

    def __init__(self) -> None:
        self.fraction = 0.0

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
        total, available = host_memory()
        rss = _rss()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return MemoryStats(
            allocated=rss,
            reserved=rss,
            peak=max(peak, rss),
            total=total,
            available=available,
            limit=int(self.fraction * total),
        )

    def release_cache(self) -> None:
        gc.collect()
        trim = _malloc_trim()
        if trim is not None:
            trim(0)

    def limit_memory(self, fraction: float) -> None:
        """Record ``fraction`` of the host's memory as this process's budget (not enforced:
        see the module's docstring)."""
        self.fraction = check_fraction(fraction)

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
        # A CPU computes tanh far slower than exp: the tanh GELU as a sigmoid, the same function.
        self.compiler = BucketCompiler("inductor", rewrites=[tanh_gelu_as_sigmoid])
        self.profiler = TraceProfiler()
        self.sharding = TorchSharding("cpu")


def plugin() -> CpuPlugin:
    """The entry point of ``cpu`` (``asyncrl.plugins``)."""
    return CpuPlugin()
