"""A role process's allocator thresholds (asyncrl.supervision.heap), in fresh processes."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from asyncrl.supervision.heap import user_tuned

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")

# A step's pattern on a worker thread (an arena of its own): eight 1 MiB blocks allocated and
# written, then freed; the page faults of steps 3 to 22 are counted.
_STEPS = """
import ctypes, json, resource, sys, threading
from asyncrl.supervision.heap import hold_heap
held = hold_heap() if sys.argv[1] == "hold" else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size, out = 1 << 20, {}
def steps():
    for step in range(23):
        if step == 3:
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        blocks = [libc.malloc(size) for _ in range(8)]
        for b in blocks:
            ctypes.memset(b, 1, size)
        for b in blocks:
            libc.free(b)
    out["faults"] = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
worker = threading.Thread(target=steps)
worker.start()
worker.join()
print(json.dumps({"held": held, "faults": out["faults"]}))
"""


def _untuned() -> dict[str, str]:
    """This environment without glibc's own allocator settings (as a fresh machine has it)."""
    return {k: v for k, v in os.environ.items() if not user_tuned({k: v})}


def _run(mode: str, env: dict[str, str] | None = None) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", _STEPS, mode],
        capture_output=True,
        text=True,
        env=_untuned() if env is None else env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@glibc
def test_held_heap_keeps_a_steps_blocks_mapped_where_glibcs_defaults_fault_them_in_again() -> None:
    held, default = _run("hold"), _run("default")
    assert held["held"] is True
    # 20 steps of 8 MiB: glibc's defaults give the arena's top back each step and fault it in
    # on the next (2,048 pages a step); held, the blocks stay mapped after the first steps.
    assert isinstance(default["faults"], int) and default["faults"] > 20 * 1000
    assert isinstance(held["faults"], int) and held["faults"] < 200


@glibc
def test_a_user_who_tuned_glibc_keeps_the_tuning() -> None:
    assert _run("hold", {**_untuned(), "MALLOC_TRIM_THRESHOLD_": "131072"})["held"] is False


def test_user_tuned_reads_glibcs_variables_and_tunables() -> None:
    assert not user_tuned({})
    assert not user_tuned({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"})
    assert user_tuned({"MALLOC_MMAP_THRESHOLD_": "1"})
    assert user_tuned({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1:glibc.pthread.x=2"})
