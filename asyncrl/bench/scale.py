"""``asyncrl bench scale``: how the driver's own cost grows with the number of rollout replicas.

Each row runs the real driver side (``Dispatcher``, a ``Handle``, ``SamplePipeline`` with its
pacer and split-mode reducer, ``WeightSync``'s background version broadcast after every batch)
against n simulated rollout replicas (1, 4, 16, 64, 256), in a fresh driver process. A replica
is a transport ``Server`` at its own ipc endpoint serving ``ScaleRollout`` (``sim.SimRollout``:
a sample is a fixed sleep of ``--gen-ms``, ``--slots`` at once); the replicas are spread over
up to ``--hosts`` helper processes. The learner is instant (``pipe.advance`` after each batch)
and the pacer admits up to ``ETA + 1`` batches of ``max(n x slots, GROUP)`` samples, so the
driver always has work queued. After every replica answered, the driver idles ``--idle``
seconds (``driver_idle_cpu_fraction``: what heartbeats cost), warms up, and measures a window:

- ``samples_per_s`` consumed, next to ``ideal_samples_per_s`` = n x slots / generation time;
- ``driver_cpu_s_per_1k``: the driver's CPU seconds (every thread, ZeroMQ's I/O thread
  included) per 1,000 samples; ``driver_loop_cpu_s_per_1k``: its event-loop thread's alone,
  the serial part, whose inverse is ``driver_ceiling_samples_per_s`` (one core's worth);
  ``driver_loop_busy_fraction``: the loop thread's run plus run-queue wait time over the window
  (near 1: saturated, even where a busy machine gave it less than a core);
- ``dispatch_ms_p50`` / ``_p99`` / ``_max``: slot turnaround (``turnarounds``), from a sample's
  end to the start of the next in its slot on the replica's clock: the reply's trip, the
  driver's handling, the next request's trip;
- ``driver_rss_mb`` at the end of the window and ``driver_peak_rss_mb``;
- ``hosts_cpu_fraction`` and ``hosts_busy_max`` (the busiest helper's loop, as the driver's):
  near 1, the simulated replicas, not the driver, were the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncrl.bench.pipeline import reward
from asyncrl.bench.sim import SimRollout
from asyncrl.dispatch.dispatcher import Dispatcher
from asyncrl.dispatch.handles import Context
from asyncrl.dispatch.pacing import PipelineSpec, percentiles
from asyncrl.manifest.spec import GroupInfo
from asyncrl.observe import logs
from asyncrl.role import Delivery, RoleContext, endpoint, endpoints_of
from asyncrl.roles.payloads import Prompt, Sample, SamplingParams
from asyncrl.roles.sampling.pipeline import SamplePipeline, WeightSync
from asyncrl.supervision.process import die_with_parent
from asyncrl.transport import Call, ChannelOptions, LocalRegistry, Server, run

__all__ = ["ScaleRollout", "format_table", "main", "measure", "project", "turnarounds"]

ROWS = (1, 4, 16, 64, 256)
QUICK_ROWS = (1, 4)
SLOTS = 4
"""Samples one replica works on at once."""
GEN_MS = 50.0
"""The fixed generation time of one sample."""
GROUP = 8
"""Samples per GRPO group."""
ETA = 2
"""The pipeline's staleness bound: up to ETA + 1 batches in flight keep the driver's queue full."""
HOSTS = 4
"""The most helper processes the replicas are spread over."""
TIMES = {"window": 6.0, "warmup": 1.5, "idle": 2.0}
"""Seconds a row measures, warms up before, and idles (for the heartbeats' cost) before that."""
QUICK_TIMES = {"window": 0.6, "warmup": 0.3, "idle": 0.2}
ROW_TIMEOUT_S = 180.0
RUN = "bench-scale"


# -- the simulated replicas (run in the helper processes) -----------------------------------


def turnarounds(
    starts: list[float], ends: list[float], slots: int, window: tuple[float, float]
) -> list[float]:
    """The turnaround of each sample that started in ``window``: its start minus the end of
    the sample whose slot it took.

    With a fixed generation time and work always queued, a replica of ``slots`` slots gives
    its k-th sample (in start order) the slot the (k - slots)-th freed (in end order). The first
    ``slots`` samples took a slot nobody held before, and have none.

    Args:
        starts, ends: the replica's sample start and end times, in any order (``ends`` may be
            shorter: samples still running).
        slots: the replica's slots; window: ``(t0, t1)``, on the same clock.
    """
    starts, ends = sorted(starts), sorted(ends)
    t0, t1 = window
    return [
        start - ends[k - slots]
        for k, start in enumerate(starts)
        if k >= slots and t0 <= start < t1 and k - slots < len(ends)
    ]


class ScaleRollout(SimRollout):
    """``SimRollout`` that also tells its slots' turnaround (see ``turnarounds``).

    Endpoints: those of ``SimRollout``, and ``turnaround([t0, t1]) -> list[float]``
    (idempotent): the turnaround, in seconds, of each sample that started in the window.
    """

    @endpoint(Delivery.IDEMPOTENT)
    async def turnaround(self, window: list[float]) -> list[float]:
        if len(window) != 2 or not window[1] > window[0]:
            raise ValueError(f"turnaround: expected a window [t0, t1] with t1 > t0, got {window}")
        starts = [s for s, _, _ in self.done] + [s for s, _ in self.running.values()]
        ends = [e for _, e, _ in self.done]
        return turnarounds(starts, ends, self.ctx.capacity, (window[0], window[1]))


class HostSpec(msgspec.Struct, frozen=True):
    """What one helper process serves: the replicas ``first`` on, one per endpoint."""

    endpoints: list[str]
    first: int
    replicas: int
    slots: int
    gen_s: float
    run_dir: str
    parent_pid: int


def _handler(method: Any) -> Any:
    async def handle(payload: Any, call: Call) -> Any:
        return await method(payload)

    return handle


def _constant(value: dict[str, Any]) -> Any:
    def answer(payload: Any, call: Call) -> dict[str, Any]:
        return value

    return answer


async def _serve_host(spec: HostSpec) -> None:
    """Serve ``spec``'s replicas until stdin closes (the driver ended or closed it)."""
    config = ScaleRollout.Config(speeds=[1.0] * spec.replicas, sigma=0.0, mean_s=spec.gen_s)
    methods = endpoints_of(ScaleRollout)
    servers = []
    for offset, address in enumerate(spec.endpoints):
        replica = spec.first + offset
        ctx = RoleContext(
            name="rollout",
            replica=replica,
            run=RUN,
            run_dir=spec.run_dir,
            config=config,
            capacity=spec.slots,
            replicas=spec.replicas,
        )
        role = ScaleRollout(ctx)
        server = Server(address, name=f"rollout.{replica}", options=ChannelOptions(run=RUN))
        for ep in methods.values():
            server.add(ep.name, _handler(getattr(role, ep.attr)), ep.request_type)
        described = {
            "role": "rollout",
            "replica": replica,
            "incarnation": 0,
            "pid": os.getpid(),
            "endpoints": {n: e.delivery.value for n, e in methods.items()},
        }
        server.add("_describe", _constant(described))
        await server.start()
        server.set_credit(spec.slots)
        servers.append(server)
    try:
        await asyncio.to_thread(sys.stdin.read)
    finally:
        for server in servers:
            await server.close()


def _host_main() -> int:
    spec = msgspec.json.decode(sys.stdin.readline(), type=HostSpec)
    die_with_parent(spec.parent_pid)
    logs.configure(role="bench-scale-host", console=False)
    run(_serve_host(spec))
    return 0


# -- the driver (one fresh process per row) ---------------------------------------------------


def _start_hosts(
    endpoints: list[str], slots: int, gen_s: float, run_dir: str, hosts: int
) -> list[subprocess.Popen[str]]:
    """Spread the replicas over ``hosts`` helper processes (contiguous runs of replicas)."""
    n = len(endpoints)
    count = max(1, min(hosts, n))
    procs = []
    for h in range(count):
        lo, hi = h * n // count, (h + 1) * n // count
        spec = HostSpec(endpoints[lo:hi], lo, n, slots, gen_s, run_dir, os.getpid())
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.bench.scale", "--host"],
            stdin=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.stdin is not None
        proc.stdin.write(msgspec.json.encode(spec).decode() + "\n")
        proc.stdin.flush()
        procs.append(proc)
    return procs


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` used so far (``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _schedstat(pid: int) -> tuple[float, float]:
    """Seconds the main thread of ``pid`` ran, and waited on a run queue, so far
    (``/proc/<pid>/schedstat``). Their sum over a window is how much of it the thread wanted a
    core: near 1, it was saturated, even on a machine too busy to give it one."""
    with open(f"/proc/{pid}/schedstat") as f:
        ran, waited, _ = f.read().split()
    return int(ran) / 1e9, int(waited) / 1e9


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@dataclass
class _Mark:
    """The clocks at one end of the measured window."""

    t: float  # time.monotonic()
    wall: float  # time.time(), the replicas' clock
    cpu: float  # the driver's CPU, every thread
    loop: tuple[float, float]  # the driver's event-loop thread: ran, waited
    hosts: list[tuple[float, tuple[float, float]]]  # each helper: CPU, and its loop's schedstat

    @classmethod
    def now(cls, pids: list[int]) -> _Mark:
        hosts = [(_cpu_of(p), _schedstat(p)) for p in pids]
        return cls(
            time.monotonic(), time.time(), time.process_time(), _schedstat(os.getpid()), hosts
        )


@dataclass
class _Window:
    """The measured window: its two ends, and the samples and steps consumed in it."""

    start: _Mark | None = None
    end: _Mark | None = None
    consumed: int = 0
    steps: int = 0


async def _consume(
    pipe: SamplePipeline, weights: WeightSync, version: int, until: float, window: _Window | None
) -> int:
    """Take batches until ``time.monotonic()`` passes ``until``; the learner is instant (its
    version goes up by one a batch). Counts them in ``window``; returns the version."""
    while time.monotonic() < until:
        batch = await pipe.next_batch()
        version += 1
        pipe.advance(version)
        await weights.push(version)
        if window is not None:
            window.consumed += len(batch.samples)
            window.steps += 1
    return version


async def _drive(
    n: int, slots: int, gen_s: float, times: dict[str, float], hosts: int
) -> dict[str, Any]:
    """One row in this process: start the helpers, wait for every replica, measure the idle
    driver and the pipeline's window, stop the helpers; the figures of the module docstring."""
    run_dir = tempfile.mkdtemp(prefix="arl-sc-")  # short: ipc socket paths live under it
    endpoints = [LocalRegistry(run_dir).endpoint("rollout", i) for i in range(n)]
    procs = _start_hosts(endpoints, slots, gen_s, run_dir, hosts)
    pids = [p.pid for p in procs]
    dispatcher = Dispatcher({"rollout": GroupInfo(endpoints)}, run=RUN)
    dispatcher.start()
    try:
        ctx = Context(dispatcher, run=RUN, run_dir=run_dir, log=None)
        await ctx.rollout.broadcast("set_version", 0, int, timeout=ROW_TIMEOUT_S)
        cpu0 = time.process_time()
        await asyncio.sleep(times["idle"])
        idle_cpu = (time.process_time() - cpu0) / times["idle"]
        w = await _pipeline_window(ctx, n, slots, times, pids)
        assert w.start is not None and w.end is not None
        edges = [w.start.wall, w.end.wall]
        turn = await ctx.rollout.broadcast("turnaround", edges, list[float])
        usage = await ctx.rollout.broadcast("usage", edges, dict[str, float])
    finally:
        await dispatcher.close()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in procs:
            proc.wait(timeout=30)
        shutil.rmtree(run_dir, ignore_errors=True)
    return _row_figures(n, slots, gen_s, w, idle_cpu, turn, usage) | {"hosts": len(procs)}


async def _pipeline_window(
    ctx: Context, n: int, slots: int, times: dict[str, float], pids: list[int]
) -> _Window:
    """Run the sample pipeline through its warm-up and the measured window."""

    async def feed(cursor: int, count: int) -> list[Prompt]:
        return [Prompt(id=f"p{i}", token_ids=[1, 2, 3]) for i in range(cursor, cursor + count)]

    async def score(samples: list[Sample]) -> list[float]:
        return [reward(s) for s in samples]

    batch = max(GROUP, -(-n * slots // GROUP) * GROUP)
    pipe = SamplePipeline(
        ctx.rollout,
        spec=PipelineSpec(mode="async", eta=ETA, over_eta="correct"),
        feed=feed,
        score=score,
        params=SamplingParams(max_new_tokens=1),
        batch_size=batch,
        group_size=GROUP,
    )
    w = _Window()
    async with WeightSync(ctx.rollout, wait=False, method="set_version") as weights, pipe:
        start = time.monotonic()
        version = await _consume(pipe, weights, 0, start + times["warmup"], None)
        w.start = _Mark.now(pids)
        await _consume(pipe, weights, version, w.start.t + times["window"], w)
        w.end = _Mark.now(pids)
    return w


def _row_figures(
    n: int,
    slots: int,
    gen_s: float,
    w: _Window,
    idle_cpu: float,
    turn: list[list[float]],
    usage: list[dict[str, float]],
) -> dict[str, Any]:
    """One row's figures (see the module docstring) from its window and the replicas' reports."""
    assert w.start is not None and w.end is not None
    a, b = w.start, w.end
    span = b.t - a.t
    gaps = percentiles(g * 1e3 for replica in turn for g in replica)
    hosts_busy = [
        (b1 - b0 + w1 - w0) / span
        for (_, (b0, w0)), (_, (b1, w1)) in zip(a.hosts, b.hosts, strict=True)
    ]
    return {
        "replicas": n,
        "slots": slots,
        "gen_ms": gen_s * 1e3,
        "window_s": span,
        "steps": w.steps,
        "consumed_samples": w.consumed,
        "samples_per_s": w.consumed / span,
        "ideal_samples_per_s": n * slots / gen_s,
        "efficiency": w.consumed / span / (n * slots / gen_s),
        "dispatched_per_s": sum(u["started"] for u in usage) / span,
        "replica_idle_mean": sum(u["idle"] for u in usage) / n,
        **_driver_figures(w, idle_cpu),
        "dispatch_ms_p50": gaps["p50"],
        "dispatch_ms_p99": gaps["p99"],
        "dispatch_ms_max": gaps["max"],
        "dispatch_count": sum(len(r) for r in turn),
        "hosts": len(a.hosts),
        "hosts_cpu_fraction": sum(
            c1 - c0 for (c0, _), (c1, _) in zip(a.hosts, b.hosts, strict=True)
        )
        / span,
        "hosts_busy_max": max(hosts_busy),
        "load_avg_1m": os.getloadavg()[0],
    }


def _driver_figures(w: _Window, idle_cpu: float) -> dict[str, float]:
    """What the driver process spent over window ``w``, and its memory now."""
    assert w.start is not None and w.end is not None
    a, b = w.start, w.end
    span = b.t - a.t
    cpu = b.cpu - a.cpu
    loop_cpu, loop_wait = b.loop[0] - a.loop[0], b.loop[1] - a.loop[1]
    rss = _rss_mb()
    return {
        "driver_cpu_s_per_1k": 1e3 * cpu / w.consumed,
        "driver_cpu_fraction": cpu / span,
        "driver_loop_cpu_s_per_1k": 1e3 * loop_cpu / w.consumed,
        "driver_loop_busy_fraction": (loop_cpu + loop_wait) / span,
        "driver_ceiling_samples_per_s": w.consumed / loop_cpu,
        "driver_idle_cpu_fraction": idle_cpu,
        "driver_rss_mb": rss,
        "driver_peak_rss_mb": max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def _row_main(args: argparse.Namespace) -> int:
    """``--row N``: measure one row in this (fresh) process; print its figures as JSON."""
    logs.configure(role="bench-scale", console=False)
    times = {name: getattr(args, name) for name in TIMES}
    if args.no_gc:
        gc.disable()
    figures = run(_drive(args.row, args.slots, args.gen_ms / 1e3, times, args.hosts))
    print(json.dumps(figures | {"gc": not args.no_gc}))
    return 0


# -- the benchmark: one driver process per row, and the projection ------------------------------


def measure_row(
    n: int,
    *,
    slots: int = SLOTS,
    gen_ms: float = GEN_MS,
    hosts: int = HOSTS,
    times: dict[str, float] = TIMES,
    no_gc: bool = False,
) -> dict[str, Any]:
    """The figures of one row (``n`` replicas), measured in a fresh driver process; ``times``
    as ``TIMES``; ``no_gc``: with Python's cyclic garbage collector off in the driver.

    Raises:
        RuntimeError: the row's process failed; the message holds the end of its output.
    """
    cmd = [sys.executable, "-m", "asyncrl.bench.scale", "--row", str(n), "--slots", str(slots)]
    cmd += ["--gen-ms", str(gen_ms), "--hosts", str(hosts)]
    cmd += [arg for name, value in times.items() for arg in (f"--{name}", str(value))]
    cmd += ["--no-gc"] if no_gc else []
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=ROW_TIMEOUT_S)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise RuntimeError(
            f"bench scale: the row of {n} replicas failed (exit status {out.returncode}); its "
            f"output ends with:\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
        )
    figures: dict[str, Any] = json.loads(lines[-1])
    return figures


def project(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Fit the CPU per sample of the driver's event-loop thread (its serial part: ZeroMQ's I/O
    thread runs beside it) as ``fixed + per_replica x n``, least squares over the rows, and
    solve where that thread is fully busy at the rows' per-replica rate.

    Returns ``cpu_us_per_sample_fixed``, ``cpu_us_per_sample_per_replica``,
    ``replica_rate_per_s`` (slots / generation time) and ``one_core_limit_replicas``: the n at
    which n x rate x (fixed + per_replica x n) reaches one CPU second per second (a negative
    per-replica term, noise on few rows, is taken as 0; infinite when the cost never reaches it).
    """
    xs = [float(r["replicas"]) for r in rows]
    ys = [r["driver_loop_cpu_s_per_1k"] * 1e3 for r in rows]  # microseconds per sample
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    slope = cov / var if var else 0.0
    fixed = mean_y - slope * mean_x
    rate = rows[0]["slots"] / (rows[0]["gen_ms"] / 1e3)
    # n * rate * (fixed + slope * n) * 1e-6 = 1  ->  slope*rate*n^2 + fixed*rate*n - 1e6 = 0
    a, b = max(slope, 0.0) * rate, fixed * rate
    if a > 0:
        limit = (-b + (b * b + 4 * a * 1e6) ** 0.5) / (2 * a)
    else:
        limit = 1e6 / b if b > 0 else float("inf")
    return {
        "cpu_us_per_sample_fixed": fixed,
        "cpu_us_per_sample_per_replica": slope,
        "replica_rate_per_s": rate,
        "one_core_limit_replicas": limit,
    }


def measure(replicas: list[int], **row: Any) -> dict[str, Any]:
    """Every row, in order, and the projection from them: ``{"rows": [...], "projection":
    {...}}`` (see ``measure_row`` for ``row``'s options and ``project``)."""
    rows = [measure_row(n, **row) for n in replicas]
    return {"rows": rows, "projection": project(rows), "cpus": os.cpu_count()}


_COLUMNS = (
    # (heading, width, key, format)
    ("replicas", 8, "replicas", "d"),
    ("ideal/s", 8, "ideal_samples_per_s", ".0f"),
    ("samples/s", 10, "samples_per_s", ".0f"),
    ("eff", 5, "efficiency", ".2f"),
    ("cpu s/1k", 9, "driver_cpu_s_per_1k", ".3f"),
    ("loop s/1k", 10, "driver_loop_cpu_s_per_1k", ".3f"),
    ("loop busy", 10, "driver_loop_busy_fraction", ".2f"),
    ("ceiling/s", 10, "driver_ceiling_samples_per_s", ".0f"),
    ("idle cpu", 9, "driver_idle_cpu_fraction", ".3f"),
    ("p50 ms", 8, "dispatch_ms_p50", ".1f"),
    ("p99 ms", 8, "dispatch_ms_p99", ".1f"),
    ("rss MB", 7, "driver_rss_mb", ".0f"),
    ("peak", 6, "driver_peak_rss_mb", ".0f"),
    ("host busy", 10, "hosts_busy_max", ".2f"),
)


def format_table(figures: dict[str, Any]) -> str:
    """The figures of ``measure`` as a readable table."""
    rows = figures["rows"]
    first = rows[0]
    lines = [
        "asyncrl scale benchmark: the real driver (dispatcher, sample pipeline, reducer, weight "
        "broadcast) against simulated rollout replicas",
        f"{first['slots']} slots a replica, {first['gen_ms']:.0f} ms a sample, groups of "
        f"{GROUP}, eta {ETA}, instant learner; {figures['cpus']} CPUs, "
        f"{first['window_s']:.1f} s windows{'' if first['gc'] else ', no GC'}. p50/p99: slot "
        "turnaround; loop: the driver's event-loop thread (busy: ran + waited for a core)",
        "",
        "".join(f"{head:>{width}}" for head, width, _, _ in _COLUMNS),
    ]
    for r in rows:
        lines.append("".join(f"{r[key]:>{width}{fmt}}" for _, width, key, fmt in _COLUMNS))
    p = figures["projection"]
    lines += [
        "",
        f"driver loop CPU per sample ~ {p['cpu_us_per_sample_fixed']:.0f} us + "
        f"{p['cpu_us_per_sample_per_replica']:.2f} us x replicas; at "
        f"{p['replica_rate_per_s']:.0f} samples/s a replica, one driver core is full at "
        f"~{p['one_core_limit_replicas']:.0f} replicas",
    ]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl bench scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--quick", action="store_true", help="rows of 1 and 4 replicas, short windows (for tests)"
    )
    parser.add_argument(
        "--replicas", type=int, action="append", help="only this replica count (repeatable)"
    )
    parser.add_argument("--slots", type=int, default=SLOTS, help="slots a replica")
    parser.add_argument("--gen-ms", type=float, default=GEN_MS, help="milliseconds a sample")
    parser.add_argument("--window", type=float, help=f"measured seconds a row ({TIMES['window']})")
    parser.add_argument("--warmup", type=float, help=f"warm-up seconds a row ({TIMES['warmup']})")
    parser.add_argument("--idle", type=float, help=f"idle seconds a row ({TIMES['idle']})")
    parser.add_argument("--hosts", type=int, default=HOSTS, help="helper processes, at most")
    parser.add_argument("--no-gc", action="store_true", help="no cyclic GC in the driver")
    parser.add_argument("--row", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.host:
        return _host_main()
    for name, default in (QUICK_TIMES if args.quick else TIMES).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.slots < 1 or args.hosts < 1 or not args.gen_ms > 0:
        parser.error("--slots and --hosts must be >= 1 and --gen-ms > 0")
    if not (args.window > 0 and args.warmup >= 0 and args.idle > 0):
        parser.error("--window and --idle must be > 0 and --warmup >= 0")
    if args.row is not None:
        return _row_main(args)
    replicas = args.replicas or list(QUICK_ROWS if args.quick else ROWS)
    if any(n < 1 for n in replicas):
        parser.error(f"--replicas must be >= 1, got {replicas}")
    times = {name: getattr(args, name) for name in TIMES}
    options = {"slots": args.slots, "gen_ms": args.gen_ms, "hosts": args.hosts, "no_gc": args.no_gc}
    figures = measure(replicas, times=times, **options)
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0


if __name__ == "__main__":
    # ``python -m asyncrl.bench.scale`` runs this file as ``__main__``: call the canonical
    # module's main, so that the role class is the one the rest of asyncrl imports.
    from asyncrl.bench.scale import main as _main

    raise SystemExit(_main())
