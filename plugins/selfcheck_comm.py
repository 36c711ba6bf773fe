"""The self-check's communication layer: each collective across 2 local processes.

Each rank loads the plugin by name, joins a group through a file store, runs every collective of
``Communication`` on known inputs (checking the result and timing the median of a few calls), and
last checks that a rank which does not come makes the other's collective fail in time with a
``CollectiveTimeoutError`` naming it.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue as queue_module
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.plugins.errors import CollectiveTimeoutError

__all__ = ["run_collectives"]

WORLD = 2
REPS = 5
MISSING_TIMEOUT_S = 1.0
"""The timeout of the collective rank 1 skips on purpose."""


def _timed(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    times = []
    for _ in range(REPS):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _checks(plugin: Any, rank: int, device: torch.device, timeout: float) -> list[dict[str, Any]]:
    comm, sync = plugin.comm, plugin.device.synchronize
    out: list[dict[str, Any]] = []

    def record(name: str, ok: bool, seconds: float, detail: str) -> None:
        out.append({"name": name, "ok": ok, "seconds": seconds, "detail": detail})

    t = torch.full((1024,), float(rank + 1), device=device)
    comm.all_reduce(t, timeout_s=timeout)
    ok = bool((t == 3.0).all())
    s = _timed(lambda: comm.all_reduce(torch.ones(1024, device=device), timeout_s=timeout), sync)
    record("all_reduce", ok, s, "sum of 1 and 2 over 1024 floats")
    parts = comm.all_gather(torch.full((4,), float(rank), device=device), timeout_s=timeout)
    ok = [p.tolist() for p in parts] == [[0.0] * 4, [1.0] * 4]
    s = _timed(lambda: comm.all_gather(torch.ones(1024, device=device), timeout_s=timeout), sync)
    record("all_gather", ok, s, "each rank's index, in rank order")
    b = torch.full((8,), 7.0 if rank == 0 else -1.0, device=device)
    comm.broadcast(b, 0, timeout_s=timeout)
    ok = bool((b == 7.0).all())
    s = _timed(lambda: comm.broadcast(torch.ones(1024, device=device), 0, timeout_s=timeout), sync)
    record("broadcast", ok, s, "rank 0's values on every rank")
    comm.barrier(timeout_s=timeout)
    s = _timed(lambda: comm.barrier(timeout_s=timeout), sync)
    record("barrier", True, s, "every rank arrived")
    return out


def _worker(
    name: str, backend: str, rank: int, path: str, timeout: float, queue: Any, done: Any
) -> None:
    from asyncrl.plugins import registry

    plugin = registry.load(name)
    dist.init_process_group(
        backend,
        init_method=f"file://{path}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=timeout),
    )
    on_device = backend == plugin.comm.backend and plugin.device.kind != "cpu"
    device = plugin.device.select(rank) if on_device else torch.device("cpu")
    try:
        checks = _checks(plugin, rank, device, timeout)
    except Exception as exc:
        checks = [{"name": "collectives", "ok": False, "seconds": 0.0, "detail": str(exc)}]
    if rank == 0:
        start = time.perf_counter()
        try:
            plugin.comm.barrier(timeout_s=MISSING_TIMEOUT_S)
            ok, detail = False, "a barrier without rank 1 completed"
        except CollectiveTimeoutError as exc:
            ok, detail = exc.missing == [1], str(exc)
        checks.append(
            {
                "name": "timeout names the missing rank",
                "ok": ok,
                "seconds": time.perf_counter() - start,
                "detail": detail,
            }
        )
        done.set()
    else:
        done.wait(timeout)  # alive, so that rank 0's barrier times out rather than breaks
    queue.put((rank, checks))
    queue.close()
    queue.join_thread()
    # Leave without destroying the group: rank 0 holds a barrier rank 1 never joins.
    os._exit(0)


def _collect(queue: Any, procs: list[Any], wait_s: float) -> dict[int, Any] | str:
    """Each rank's checks, or why they did not all come (a rank died, or time ran out)."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + wait_s
    while len(results) < len(procs):
        try:
            rank, checks = queue.get(timeout=0.5)
            results[rank] = checks
            continue
        except queue_module.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if dead:
            return f"rank(s) {dead} exited early (exit codes {[procs[r].exitcode for r in dead]})"
        if time.monotonic() > deadline:
            return f"no result from every rank within {wait_s:g} s"
    return results


def run_collectives(name: str, backend: str, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Every collective of plugin ``name`` across 2 local processes over ``backend``.

    Output: rank 0's checks (name, ok, seconds: the median call, detail), each marked failed
    when rank 1 saw a different result.
    """
    ctx = multiprocessing.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    with tempfile.TemporaryDirectory(prefix="arl-selfcheck-") as tmp:
        path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(name, backend, r, path, timeout, queue, done))
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        try:
            results = _collect(queue, procs, timeout + 60)
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    if isinstance(results, str):
        return [{"name": "collectives", "ok": False, "seconds": 0.0, "detail": results}]
    theirs = {c["name"]: c["ok"] for c in results[1]}
    return [{**c, "ok": c["ok"] and theirs.get(c["name"], True)} for c in results[0]]
