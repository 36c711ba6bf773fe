"""``asyncrl bench runtime``: how fast the runtime notices a crash and serves again, and what a
handle costs, each against its baseline measured in the same run.

- crash detection: from SIGKILL of a replica to the supervisor noticing its exit;
- restart to serving: from SIGKILL to the first call answered by the restarted replica, for a
  role that imports torch; its baseline is a cold ``python -c "import torch, <role module>"``,
  timed in the same run, so that restart cost cannot hide in import time;
- restart through a standby (``supervision.standby``): the same kill and first answer for a second
  replica whose next incarnation waits with its modules imported, interleaved kill by kill with
  the cold restart above, which is its baseline;
- restart through the zygote (the default: ``asyncrl.supervision.zygote`` forks the next incarnation
  from a process that imported torch and the role once): the same kill and first answer for a third
  replica, under a supervisor of its own with the zygote on (the other two run with it off),
  interleaved kill by kill with the cold restart;
- handle overhead: a call through a handle (the dispatcher) against the transport client calling
  the same server, in alternating blocks of calls (bare, handle, bare, ...), so that noise from
  the rest of the machine falls on both sides alike.

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

from asyncrl.bench.harness import role_child
from asyncrl.dispatch.dispatcher import Dispatcher
from asyncrl.dispatch.handles import Context
from asyncrl.manifest.load import Supervision
from asyncrl.manifest.spec import GroupInfo
from asyncrl.observe import logs
from asyncrl.supervision.supervisor import Supervisor
from asyncrl.transport import Client, run

__all__ = ["main", "measure"]

ROLE = "asyncrl.bench.torch_role:TorchEcho"

TARGETS = {
    "crash_detect_ms_p50": "<= 100 ms",
    "restart_to_serving_ms_p50": "<= role_import_ms_p50 + 1000 ms",
    "handle_overhead_ratio": "<= 1.3",
}
BLOCK = 50
"""Calls in a row of one kind in the handle-overhead figure; bare and handle blocks alternate."""
WARMUP_CALLS = 200
"""Untimed calls each way before the handle-overhead figure."""


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
    forked = role_child(run_dir, "forked", ROLE, {}, policy)
    lives = _Lives(["echo[0]", "spare[0]", "forked[0]"])
    logs_dir = os.path.join(run_dir, "logs")
    supervisor = Supervisor(
        [child, spare], run="bench", log_dir=logs_dir, observer=lives, zygote=False
    )
    zygote = Supervisor([forked], run="bench", log_dir=logs_dir, observer=lives)
    supervised = asyncio.get_running_loop().create_task(supervisor.run())
    supervised_zygote = asyncio.get_running_loop().create_task(zygote.run())
    try:
        async with (
            Client(child.endpoint, name="bench") as client,
            Client(spare.endpoint, name="bench-spare") as spare_client,
            Client(forked.endpoint, name="bench-forked") as forked_client,
        ):
            for label in ("echo[0]", "spare[0]", "forked[0]"):
                await lives.until(label, ("serving", 0))
            await asyncio.wait_for(zygote.launcher.ready.wait(), 120)
            out = await _restarts(lives, client, spare_client, forked_client, kills)
            dispatcher = Dispatcher({"echo": GroupInfo([child.endpoint])}, run="bench")
            dispatcher.start()
            try:
                ctx = Context(dispatcher, run="bench", run_dir=run_dir, log=None)
                out.update(await _handle_overhead(client, ctx, calls))
            finally:
                await dispatcher.close()
    finally:
        supervisor.stop("benchmark done")
        zygote.stop("benchmark done")
        await supervised
        await supervised_zygote
    return out


class _Lives:
    """The supervisor's observer: when each replica entered each state of each incarnation
    (``perf_counter``), and a queue per replica of its ``(state, incarnation)`` events."""

    def __init__(self, labels: list[str]) -> None:
        self.seen: dict[tuple[str, str, int], float] = {}
        self.events: dict[str, asyncio.Queue[tuple[str, int]]] = {
            label: asyncio.Queue() for label in labels
        }

    def __call__(self, kind: str, label: str, incarnation: int) -> None:
        self.seen[(kind, label, incarnation)] = time.perf_counter()
        self.events[label].put_nowait((kind, incarnation))

    async def until(self, label: str, wanted: tuple[str, int]) -> None:
        """Return once ``label`` reports ``wanted``; raise ``TimeoutError`` after 120 s without
        an event."""
        while await asyncio.wait_for(self.events[label].get(), 120) != wanted:
            pass


async def _restarts(
    lives: _Lives, client: Client, spare_client: Client, forked_client: Client, kills: int
) -> dict[str, Any]:
    """Kill the cold replica, the one with a standby and the one the zygote forks ``kills``
    times each, interleaved kill by kill; the crash-detection and restart figures."""
    detect: list[float] = []
    serve: list[float] = []
    serve_standby: list[float] = []
    serve_forked: list[float] = []
    for n in range(kills):
        t0, ms = await _restart(client, n)
        await lives.until("echo[0]", ("exited", n))
        detect.append((lives.seen[("exited", "echo[0]", n)] - t0) * 1e3)
        serve.append(ms)
        await lives.until("spare[0]", ("standby", n + 1))  # the next one is ready
        _, ms = await _restart(spare_client, n)
        serve_standby.append(ms)
        _, ms = await _restart(forked_client, n)
        serve_forked.append(ms)
    cold, standby = statistics.median(serve), statistics.median(serve_standby)
    forked = statistics.median(serve_forked)
    return {
        "crash_detect_ms_p50": statistics.median(detect),
        "crash_detect_ms_max": max(detect),
        "restart_to_serving_ms_p50": cold,
        "standby_restart_ms_p50": standby,
        "standby_speedup": cold / standby,
        "zygote_restart_ms_p50": forked,
        "zygote_restart_ms_max": max(serve_forked),
        "zygote_speedup": cold / forked,
        "kills": kills,
    }


async def _handle_overhead(client: Client, ctx: Context, calls: int) -> dict[str, Any]:
    """``calls`` round trips of the same echo call each way, bare (``client``, the transport)
    and through a handle (``ctx``, the dispatcher), in alternating blocks of ``BLOCK`` calls, so
    that whatever else loads the machine falls on both alike; their medians and ratio."""

    async def bare() -> None:
        await client.call("echo", 1)

    async def handle() -> None:
        await ctx.roles["echo"].call("echo", 1)

    ways = {"bare": bare, "handle": handle}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for call in ways.values():  # warm-up
        for _ in range(WARMUP_CALLS):
            await call()
    for done in range(0, calls, BLOCK):
        for name, call in ways.items():
            for _ in range(min(BLOCK, calls - done)):
                t0 = time.perf_counter()
                await call()
                times[name].append((time.perf_counter() - t0) * 1e6)
    bare_us, handle_us = statistics.median(times["bare"]), statistics.median(times["handle"])
    return {
        "bare_rtt_us_p50": bare_us,
        "handle_rtt_us_p50": handle_us,
        "handle_overhead_ratio": handle_us / bare_us,
    }


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
        ("restart through the zygote (p50)", f"{f['zygote_restart_ms_p50']:.0f} ms", None),
        ("  cold / zygote", f"{f['zygote_speedup']:.1f}x", None),
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
