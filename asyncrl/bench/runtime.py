"""``asyncrl bench runtime``: how fast the runtime notices a crash and serves again, and what a
handle costs, each against its baseline measured in the same run.

- crash detection: from SIGKILL of a replica to the supervisor noticing its exit;
- restart to serving: from SIGKILL to the first call answered by the restarted replica, for a
  role that imports torch; its baseline is a cold ``python -c "import torch, <role module>"``,
  timed in the same run, so that restart cost cannot hide in import time;
- restart through a standby (``supervision.standby``): the same kill and first answer for a second
  replica whose next incarnation waits with its modules imported, interleaved kill by kill with
  the cold restart above, which is its baseline;
- handle overhead: a call through a handle (the dispatcher) against the transport client calling
  the same server.

Medians over ``--kills`` kills (at least 10) and over thousands of calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec

from asyncrl import logs
from asyncrl.bench.harness import role_child
from asyncrl.dispatch import Dispatcher
from asyncrl.handles import Context
from asyncrl.manifest import Supervision
from asyncrl.spec import GroupInfo
from asyncrl.supervisor import Supervisor
from asyncrl.transport import Client, run

__all__ = ["main", "measure"]

ROLE = "asyncrl.bench.torch_role:TorchEcho"

TARGETS = {
    "crash_detect_ms_p50": "<= 100 ms",
    "restart_to_serving_ms_p50": "<= role_import_ms_p50 + 1000 ms",
    "handle_overhead_ratio": "<= 1.3",
}


def _import_ms(runs: int) -> list[float]:
    module = ROLE.split(":")[0]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import torch, {module}"], check=True)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


async def _measure(run_dir: str, kills: int, calls: int) -> dict[str, Any]:
    policy = Supervision(
        max_restarts=kills + 5,
        period_s=3600.0,
        backoff_initial_s=0.0,
        backoff_max_s=0.0,
        heartbeat_interval_s=1.0,
    )

    child = role_child(run_dir, "echo", ROLE, {}, policy)
    spare = role_child(run_dir, "spare", ROLE, {}, msgspec.structs.replace(policy, standby=True))
    endpoint = child.endpoint

    seen: dict[tuple[str, str, int], float] = {}
    events: dict[str, asyncio.Queue[tuple[str, int]]] = {
        "echo[0]": asyncio.Queue(),
        "spare[0]": asyncio.Queue(),
    }

    def observe(kind: str, label: str, incarnation: int) -> None:
        seen[(kind, label, incarnation)] = time.perf_counter()
        events[label].put_nowait((kind, incarnation))

    supervisor = Supervisor(
        [child, spare],
        run="bench",
        log_dir=os.path.join(run_dir, "logs"),
        observer=observe,
    )
    supervised = asyncio.get_running_loop().create_task(supervisor.run())
    out: dict[str, Any] = {}
    try:
        async with (
            Client(endpoint, name="bench") as client,
            Client(spare.endpoint, name="bench-spare") as spare_client,
        ):
            await _until(events["echo[0]"], ("serving", 0))
            await _until(events["spare[0]"], ("serving", 0))
            detect: list[float] = []
            serve: list[float] = []
            serve_standby: list[float] = []
            for n in range(kills):
                # Interleaved: a cold restart, then one through a standby, each kill n.
                t0, ms = await _restart(client, n)
                await _until(events["echo[0]"], ("exited", n))
                detect.append((seen[("exited", "echo[0]", n)] - t0) * 1e3)
                serve.append(ms)
                await _until(events["spare[0]"], ("standby", n + 1))  # the next one is ready
                _, ms = await _restart(spare_client, n)
                serve_standby.append(ms)
            out["crash_detect_ms_p50"] = statistics.median(detect)
            out["crash_detect_ms_max"] = max(detect)
            out["restart_to_serving_ms_p50"] = statistics.median(serve)
            out["standby_restart_ms_p50"] = statistics.median(serve_standby)
            out["standby_speedup"] = (
                out["restart_to_serving_ms_p50"] / out["standby_restart_ms_p50"]
            )
            out["kills"] = kills
            bare = []
            for _ in range(200):
                await client.call("echo", 1)
            for _ in range(calls):
                t0 = time.perf_counter()
                await client.call("echo", 1)
                bare.append((time.perf_counter() - t0) * 1e6)
            out["bare_rtt_us_p50"] = statistics.median(bare)
        dispatcher = Dispatcher({"echo": GroupInfo([endpoint])}, run="bench")
        dispatcher.start()
        ctx = Context(dispatcher, run="bench", run_dir=run_dir, log=None)
        try:
            for _ in range(200):
                await ctx.echo.call("echo", 1)
            via_handle = []
            for _ in range(calls):
                t0 = time.perf_counter()
                await ctx.echo.call("echo", 1)
                via_handle.append((time.perf_counter() - t0) * 1e6)
        finally:
            await dispatcher.close()
        out["handle_rtt_us_p50"] = statistics.median(via_handle)
        out["handle_overhead_ratio"] = out["handle_rtt_us_p50"] / out["bare_rtt_us_p50"]
    finally:
        supervisor.stop("benchmark done")
        await supervised
    return out


async def _restart(client: Client, n: int) -> tuple[float, float]:
    """SIGKILL the replica behind ``client`` (its incarnation ``n``); return when it was killed
    (perf_counter) and the milliseconds until its next incarnation answered a call."""
    info = await client.call("_describe", None, timeout=60)
    t0 = time.perf_counter()
    os.kill(info["pid"], signal.SIGKILL)
    while True:  # calls made while it restarts wait for it, or fail and go again
        try:
            answer = await client.call("echo", n, timeout=60)
        except Exception:
            continue
        if answer == n:
            return t0, (time.perf_counter() - t0) * 1e3


async def _until(events: asyncio.Queue[tuple[str, int]], wanted: tuple[str, int]) -> None:
    while await asyncio.wait_for(events.get(), 120) != wanted:
        pass


def measure(*, kills: int = 10, calls: int = 3000) -> dict[str, Any]:
    """Run every measurement and return the figures (see the module docstring)."""
    tmp = tempfile.mkdtemp(prefix="arl-rt-")
    try:
        logs.configure(role="bench", console=False)
        figures = run(_measure(tmp, kills, calls))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    imports = _import_ms(5)
    figures["role_import_ms_p50"] = statistics.median(imports)
    figures["restart_minus_import_ms"] = (
        figures["restart_to_serving_ms_p50"] - figures["role_import_ms_p50"]
    )
    return figures


def format_table(f: dict[str, Any]) -> str:
    verdicts = {
        "crash_detect_ms_p50": f["crash_detect_ms_p50"] <= 100,
        "restart_to_serving_ms_p50": f["restart_minus_import_ms"] <= 1000,
        "handle_overhead_ratio": f["handle_overhead_ratio"] <= 1.3,
    }
    rows = [
        ("crash noticed (p50)", f"{f['crash_detect_ms_p50']:.1f} ms", "crash_detect_ms_p50"),
        ("crash noticed (max)", f"{f['crash_detect_ms_max']:.1f} ms", None),
        (
            "restart to serving (p50)",
            f"{f['restart_to_serving_ms_p50']:.0f} ms",
            "restart_to_serving_ms_p50",
        ),
        ("restart through a standby (p50)", f"{f['standby_restart_ms_p50']:.0f} ms", None),
        ("  cold / standby", f"{f['standby_speedup']:.1f}x", None),
        ("cold import torch + role (p50)", f"{f['role_import_ms_p50']:.0f} ms", None),
        ("  restart - import", f"{f['restart_minus_import_ms']:.0f} ms", None),
        ("call through a handle (p50)", f"{f['handle_rtt_us_p50']:.0f} us", None),
        ("bare transport call (p50)", f"{f['bare_rtt_us_p50']:.0f} us", None),
        ("  handle / bare", f"{f['handle_overhead_ratio']:.2f}x", "handle_overhead_ratio"),
    ]
    lines = [f"asyncrl runtime benchmark ({f['kills']} kills, {os.cpu_count()} CPUs)", ""]
    lines.append(f"{'figure':<34}{'measured':>12}   target")
    for label, value, key in rows:
        target = ""
        if key is not None:
            target = f"{TARGETS[key]}  {'met' if verdicts[key] else 'MISSED'}"
        lines.append(f"{label:<34}{value:>12}   {target}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="asyncrl bench runtime",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--kills", type=int, default=10, help="replica kills to time (>= 1)")
    parser.add_argument("--calls", type=int, default=3000, help="calls per round-trip figure")
    args = parser.parse_args(argv)
    if args.kills < 1:
        parser.error("--kills must be >= 1")
    figures = measure(kills=args.kills, calls=args.calls)
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
