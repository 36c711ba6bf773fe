"""``asyncrl selfcheck``: a deliberately broken operator is reported under the operators layer
and the command exits 1; the JSON shape; an unavailable device is skipped with the reason; the
communication layer across 2 processes; memory statistics measured past a tensor that
reused memory the process held."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest
import torch

from asyncrl.plugins import registry, selfcheck
from asyncrl.plugins.contract import MemoryStats
from asyncrl.plugins.cpu import CpuDevice
from asyncrl.plugins.cuda import CudaPlugin
from asyncrl.plugins.selfcheck_comm import run_collectives
from asyncrl.plugins.selfcheck_layers import _statistics
from asyncrl.supervision.heap import user_tuned
from tests.conftest import ROOT
from tests.plugins.broken import BrokenPlugin


@pytest.fixture
def broken_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    found = {**registry.registered(), "broken": "tests.plugins.broken:plugin"}
    monkeypatch.setattr(registry, "registered", lambda: found)


def test_a_broken_operator_fails_its_layer_and_the_command(
    broken_registered: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code = selfcheck.main(["--plugin", "broken", "--json", "--layers", "operators", "memory"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert (report["plugin"], report["ok"]) == ("broken", False)
    assert [(layer["name"], layer["ok"]) for layer in report["layers"]] == [
        ("operators", False),
        ("memory", True),
    ]
    failed = [c["name"] for c in report["layers"][0]["checks"] if not c["ok"]]
    assert failed == ["rms_norm"]
    (rms,) = [c for c in report["layers"][0]["checks"] if c["name"] == "rms_norm"]
    assert rms["max_error"] > 1e-2 and set(rms) == {"name", "ok", "max_error", "speed", "detail"}


def test_the_table_names_the_failing_layer(broken_registered: None) -> None:
    report = selfcheck.run(BrokenPlugin(), ["operators"])
    text = selfcheck.table(report)
    assert text.splitlines()[0] == "asyncrl selfcheck: plugin broken"
    assert text.splitlines()[-1] == "FAILED: operators"
    (row,) = [line for line in text.splitlines() if " rms_norm " in line]
    assert " NO (err " in row


def test_the_cpu_plugin_passes_the_quick_layers() -> None:
    report = selfcheck.run(registry.load("cpu"), ["operators", "memory", "checkpoints"])
    assert [(layer.name, layer.ok) for layer in report.layers] == [
        ("operators", True),
        ("memory", True),
        ("checkpoints", True),
    ]


def test_end_to_end_and_eager_compilation_pass() -> None:
    report = selfcheck.run(BrokenPlugin(), ["compilation", "end_to_end"])
    names = [[c.name for c in layer.checks] for layer in report.layers]
    assert names == [["bucketed compile"], ["behaviour cloning learns", "GRPO raises the reward"]]
    assert report.layers[0].checks[0].detail == "eager fallback (compilation off)"
    assert report.ok


def test_an_unavailable_device_is_skipped_with_the_reason() -> None:
    plugin = CudaPlugin()
    if plugin.device.available():
        pytest.skip("a CUDA device is available here")
    report = selfcheck.run(plugin, ["operators"])
    assert report.ok is False
    assert report.layers[0].skipped == "cuda: no cuda device available in this process"


def test_an_unknown_plugin_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert selfcheck.main(["--plugin", "nope", "--layers", "memory"]) == 2
    assert capsys.readouterr().err.startswith("asyncrl selfcheck: no hardware plugin named 'nope'")


@pytest.mark.slow
def test_each_collective_across_two_processes() -> None:
    checks = run_collectives("cpu", "gloo", timeout=30.0)
    assert [(c["name"], c["ok"]) for c in checks] == [
        ("all_reduce", True),
        ("all_gather", True),
        ("broadcast", True),
        ("barrier", True),
        ("timeout names the missing rank", True),
    ]
    assert checks[-1]["detail"].startswith("barrier: rank(s) [1] did not arrive within 1 s")


_REUSED = """
import ctypes, torch
from asyncrl_plugin_template import TemplateDevice
from asyncrl.plugins.selfcheck_layers import _statistics
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
libc.free(libc.malloc(30 << 20))  # a freed 30 MiB mapping: glibc's heap takes blocks up to it
blocks = [libc.malloc(8 << 20) for _ in range(10)]
for b in blocks:
    libc.memset(b, 1, 8 << 20)
above = libc.malloc(8 << 20)  # keeps the heap's top above them
for b in blocks:
    libc.free(b)  # 80 MiB free in the heap, resident, and not at its top: nothing trims it
print(_statistics(TemplateDevice(), torch.device("cpu"), 64 << 20).detail)
"""


def _glibc_as_it_comes() -> bool:
    """glibc's allocator, with its thresholds not tuned (what the test below arranges needs)."""
    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018 (present in glibc only)
    except (OSError, AttributeError):
        return False
    return not user_tuned(os.environ)


@pytest.mark.skipif(not _glibc_as_it_comes(), reason="needs glibc's malloc, thresholds untuned")
def test_a_tensor_served_from_the_held_heap_is_kept_and_a_fresh_one_measured() -> None:
    """The template's ``release_cache`` does not trim glibc's heap, so a 64 MiB tensor comes
    from a free 80 MiB block the process holds and leaves the resident set where it was."""
    site = os.path.join(ROOT, "examples", "plugin_template")
    out = subprocess.run(
        [sys.executable, "-c", _REUSED],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([site, ROOT])},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    detail = out.stdout.strip()
    assert detail.endswith("(tensor 2: the ones before it reused memory the process held)")
    words = detail.split()
    grown, shrunk = float(words[0]), -float(words[3])
    assert grown >= 0.9 * 64 and shrunk >= 0.9 * 64, detail


class _Still(CpuDevice):
    """The host, with a memory figure that never moves."""

    def __init__(self) -> None:
        super().__init__()
        self.first = super().memory()

    def memory(self) -> MemoryStats:
        return self.first


def test_statistics_that_never_move_fail_after_three_tensors() -> None:
    check = _statistics(_Still(), torch.device("cpu"), 64 << 20)
    assert not check.ok
    assert check.detail == (
        "+0.0 MiB allocated, -0.0 MiB after release (the last of 3 tensors, none of which"
        " moved the figure)"
    )
