"""Memory statistics, budgets and cache release of the built-in plugins (colocation)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch

from asyncrl.plugins import cpu, cuda
from asyncrl.plugins.contract import Device, MemoryStats
from asyncrl.roles.device_report import device_of, device_status

MIB = 2**20


def _vm_rss() -> int:
    """VmRSS of /proc/self/status in bytes: a second reading of the resident set."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_cpu_memory_is_the_resident_set_and_the_hosts_memory() -> None:
    dev = cpu.CpuDevice()
    before = _vm_rss()
    mem = dev.memory()
    after = _vm_rss()
    assert before - 4 * MIB <= mem.allocated <= after + 4 * MIB
    assert mem.reserved == mem.allocated <= mem.peak
    info = cpu._meminfo()
    limit, _ = cpu._cgroup_limit()  # a container's limit lowers the host's total
    assert mem.total == min(info["MemTotal"], limit or info["MemTotal"]) > 0
    assert 0 < mem.available <= mem.total
    assert mem.limit == 0
    assert isinstance(dev, Device)


def test_meminfo_and_a_cgroup_limit_are_read_from_their_files(tmp_path: pathlib.Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  1000 kB\nMemAvailable:   600 kB\nHugePages_Total:  3\n")
    assert cpu._meminfo(str(meminfo)) == {
        "MemTotal": 1024000,
        "MemAvailable": 614400,
        "HugePages_Total": 3,
    }
    assert cpu._meminfo(str(tmp_path / "missing")) == {}
    at_root = tmp_path / "self-root"
    at_root.write_text("0::/\n")  # a cgroup namespace's view: the process's own is the root
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("4096\n")
    assert cpu._cgroup_limit(str(tmp_path), str(at_root)) == (0, 0)
    (tmp_path / "memory.max").write_text("65536\n")
    assert cpu._cgroup_limit(str(tmp_path), str(at_root)) == (65536, 4096)
    assert cpu._cgroup_limit(str(tmp_path / "none"), str(at_root)) == (0, 0)
    # cgroup v1 (no memory.max at the root): the memory controller's own folder; no limit
    # there reads as the page counter's maximum.
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text("4096\n")
    assert cpu._cgroup_limit(str(v1), str(at_root)) == (0, 0)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("65536\n")
    assert cpu._cgroup_limit(str(v1), str(at_root)) == (65536, 4096)


def _cgroup(folder: pathlib.Path, limit: str, used: int, v1: bool = False) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    names = (
        ("memory.limit_in_bytes", "memory.usage_in_bytes")
        if v1
        else ("memory.max", "memory.current")
    )
    (folder / names[0]).write_text(limit + "\n")
    (folder / names[1]).write_text(f"{used}\n")


def test_the_lowest_limit_of_the_process_own_cgroup_and_those_above_it_counts(
    tmp_path: pathlib.Path,
) -> None:
    """Outside a cgroup namespace (a systemd service, a batch job's slice) the limit is set on
    the process's own cgroup or one above it, not on the root; the lowest one holds."""
    own = tmp_path / "self"
    own.write_text("0::/system.slice/job.service\n")
    v2 = tmp_path / "v2"
    v2.mkdir()  # the root of cgroup v2 has no memory.max
    _cgroup(v2 / "system.slice", "1048576", 8192)
    _cgroup(v2 / "system.slice" / "job.service", "max", 4096)
    assert cpu._cgroup_limit(str(v2), str(own)) == (1048576, 8192)  # the slice's
    _cgroup(v2 / "system.slice" / "job.service", "65536", 4096)
    assert cpu._cgroup_limit(str(v2), str(own)) == (65536, 4096)  # the service's, lower
    # cgroup v1: the memory controller's line names the path under memory/
    own.write_text("5:cpu,cpuacct:/\n4:memory:/batch/job7\n0::/\n")
    v1 = tmp_path / "v1"
    _cgroup(v1 / "memory", "9223372036854771712", 1 << 30, v1=True)
    _cgroup(v1 / "memory" / "batch", "9223372036854771712", 1 << 20, v1=True)
    _cgroup(v1 / "memory" / "batch" / "job7", "131072", 2048, v1=True)
    assert cpu._cgroup_limit(str(v1), str(own)) == (131072, 2048)
    # a path this mount does not hold (the host's view from inside a container) reads the root
    own.write_text("4:memory:/elsewhere/job9\n")
    assert cpu._cgroup_limit(str(v1), str(own)) == (0, 0)
    assert cpu._own_cgroups(str(tmp_path / "missing")) == {}


def test_a_cpu_budget_is_recorded_and_reported_against_the_hosts_total() -> None:
    dev = cpu.CpuDevice()
    dev.limit_memory(0.25)
    mem = dev.memory()
    assert mem.limit == int(0.25 * mem.total)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError) as err:
            dev.limit_memory(bad)
        assert str(err.value) == (
            f"memory fraction must be in (0, 1], got {bad!r}; it is the share of the "
            "device's memory this process may use (placement.memory_fraction)"
        )
    assert dev.memory().limit == int(0.25 * mem.total)


_RELEASE = """
import gc, json, torch
from asyncrl.plugins.cpu import CpuDevice
dev = CpuDevice()
rss = lambda: dev.memory().allocated
t = torch.ones(8 * 2**18); del t   # an 8 MiB free raises glibc's mmap threshold past 1 MiB
base = rss()
held = [torch.ones(2**18) for _ in range(256)]   # 256 tensors of 1 MiB, from the heap
keep = torch.ones(2**18)   # above them, so the freed heap cannot shrink from its top
grown = rss()
del held; gc.collect()
freed = rss()
dev.release_cache()
print(json.dumps({"grown": grown - base, "freed": freed - base, "released": rss() - base}))
"""


def test_release_cache_gives_freed_heap_back_to_the_system() -> None:
    """Freed tensors stay resident in glibc's heap until ``release_cache`` trims it."""
    out = subprocess.run(
        [sys.executable, "-c", _RELEASE], capture_output=True, text=True, timeout=60, check=True
    )
    got = {k: v / MIB for k, v in json.loads(out.stdout).items()}
    assert got["grown"] >= 250, got
    assert got["freed"] >= 250, got  # free() alone keeps it resident
    assert got["released"] <= 16, got


class _FakeCuda:
    """The torch.cuda functions the plugin calls, on a 1000-byte device with 600 free."""

    def __init__(self) -> None:
        self.fraction: tuple[float, int] | None = None

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        values: dict[str, Any] = {
            "current_device": lambda: 1,
            "mem_get_info": lambda i: (600, 1000) if i == 1 else (0, 0),
            "memory_allocated": lambda i: 300 if i == 1 else -1,
            "memory_reserved": lambda i: 350 if i == 1 else -1,
            "max_memory_allocated": lambda i: 320 if i == 1 else -1,
            "set_per_process_memory_fraction": self.set_fraction,
        }
        for name, fn in values.items():
            monkeypatch.setattr(torch.cuda, name, fn)

    def set_fraction(self, fraction: float, index: int) -> None:
        self.fraction = (fraction, index)


def test_cuda_memory_and_budget_use_torch_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCuda()
    fake.install(monkeypatch)
    dev = cuda.CudaDevice()
    assert dev.memory() == MemoryStats(
        allocated=300, reserved=350, peak=320, total=1000, available=600, limit=0
    )
    dev.limit_memory(0.4)
    assert fake.fraction == (0.4, 1)
    assert dev.memory().limit == 400
    with pytest.raises(ValueError, match=r"memory fraction must be in \(0, 1\], got 2"):
        dev.limit_memory(2)
    assert fake.fraction == (0.4, 1)


def test_device_status_reports_the_hosts_memory_for_a_role_on_the_host() -> None:
    status = device_status(torch.device("cpu"))
    assert sorted(status) == ["device", "memory"]
    assert status["device"] == "cpu"
    assert sorted(status["memory"]) == [
        "allocated",
        "available",
        "limit",
        "peak",
        "reserved",
        "total",
    ]
    assert status["memory"]["allocated"] > 0


def test_device_of_refuses_a_device_of_another_kind() -> None:
    plugin = cpu.CpuPlugin()
    assert device_of("cpu", plugin) is plugin.device
    with pytest.raises(ValueError) as err:
        device_of("cuda:0", plugin)
    assert str(err.value) == (
        "device 'cuda:0' is not a device of the 'cpu' plugin (its kind is 'cpu') nor the "
        "host; place the role on one of those"
    )


_TEMPLATE = """
from asyncrl_plugin_template import TemplateDevice
dev = TemplateDevice()
before = dev.memory()
dev.limit_memory(0.25)
print(before.limit, dev.memory().limit == int(0.25 * before.total) > 0)
"""


def test_the_plugin_templates_memory_reports_no_limit_until_one_is_set() -> None:
    """``MemoryStats.limit`` is 0 until ``limit_memory`` sets a share, in the template too (a
    vendor copies it)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": os.pathsep.join([str(root / "examples" / "plugin_template"), str(root)])}
    out = subprocess.run(
        [sys.executable, "-c", _TEMPLATE],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, **env},
    )
    assert out.stdout.split() == ["0", "True"]
