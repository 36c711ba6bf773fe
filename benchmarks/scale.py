"""``asyncrl bench scale``: how the driver's own cost grows with the number of rollout replicas.

Each row runs the real driver side (``Dispatcher``, a ``Handle``, ``SamplePipeline`` with its
pacer and split-mode reducer, ``WeightSync``'s background version broadcast after every batch)
against n simulated rollout replicas (1, 4, 16, 64, 256), in a fresh driver process. A replica
is a transport ``Server`` at its own ipc endpoint serving ``ScaleRollout`` (``sim.SimRollout``:
a sample is a fixed sleep of ``--gen-ms``, ``--slots`` at once); the replicas are spread over
up to ``--hosts`` helper processes. The learner is instant (``pipe.advance`` after each batch)
and the pacer admits up to ``ETA + 1`` batches of ``max(n x slots x per_call, GROUP)`` samples
(``per_call``: a call's samples, ``GROUP`` with ``--group-calls``, else 1), so the driver always
has work queued. After every replica answered, the driver idles ``--idle`` seconds
(``driver_idle_cpu_fraction``: what heartbeats cost), warms up, and measures a window:

- ``samples_per_s`` consumed, next to ``ideal_samples_per_s`` = n x slots x per_call /
  generation time;
- ``driver_cpu_s_per_1k``: the driver's CPU seconds (every thread, ZeroMQ's I/O thread
  included) per 1,000 samples; ``driver_loop_cpu_s_per_1k``: its event-loop thread's alone,
  the serial part, whose inverse is ``driver_ceiling_samples_per_s`` (one core's worth);
  ``driver_loop_busy_fraction``: the loop thread's run plus run-queue wait time over the window
  (near 1: saturated, even where a busy machine gave it less than a core);
- ``dispatch_ms_p50`` / ``_p99`` / ``_max``: slot turnaround (``turnarounds``, a call's samples
  sharing its slot), from a sample's end to the start of the next in its slot on the replica's
  clock: the reply's trip, the driver's handling, the next request's trip;
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
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncrl.dispatch.dispatcher import Dispatcher
from asyncrl.dispatch.driver import freeze_start_up
from asyncrl.dispatch.handles import Context
from asyncrl.manifest.pipeline_section import PipelineSpec
from asyncrl.manifest.spec import GroupInfo
from asyncrl.observe import logs
from asyncrl.role import RoleContext, endpoints_of
from asyncrl.roles.learning.statistics import percentiles
from asyncrl.roles.payloads import Prompt, Sample, SamplingParams
from asyncrl.roles.sampling.pipeline import BatchSettings, SamplePipeline, WeightSync
from asyncrl.roles.sampling.shard import DispatchShard, owned_replicas
from asyncrl.roles.sampling.sharded import ShardedPipeline
from asyncrl.supervision.process import die_with_parent
from asyncrl.transport import Call, ChannelOptions, LocalRegistry, Server, run
from asyncrl.transport.sockets import reserve_sockets
from benchmarks.pipeline import reward
from benchmarks.sim import ScaleRollout, host_main, start_hosts, turnarounds

__all__ = [
    "ScaleRollout",
    "compare",
    "format_table",
    "main",
    "measure",
    "measure_row",
    "project",
    "score",
    "summarize",
    "turnarounds",
]

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
HOLD_ROWS = (256, 512, 1024)
"""Replica counts of the hold sweep, at ``HOLD_RATE`` samples/s a replica."""
QUICK_HOLD_ROWS = (8,)
HOLD_RATE = 10.0
"""Samples/s one replica asks of the driver in the hold sweep (``SLOTS`` slots of 0.4 s)."""
HELD = 0.9
"""The share of the asked rate a row carries to count as held."""
GC_MODES = ("freeze", "collect", "off")
"""The driver's cyclic collector: frozen after start-up as ``asyncrl.dispatch.driver`` does,
collecting as Python's default does, or off."""
ROW_TIMEOUT_S = 180.0
RUN = "bench-scale"
SHARD_CAPACITY = 65536
"""Groups one shard process of a sharded row works on at once: every group granted to it."""
SHARD_LIVENESS = 30
"""Missed heartbeats (one a second) after which the driver of a sharded row counts a shard dead."""


# -- the driver (one fresh process per row) ---------------------------------------------------


def samples_a_call(group_calls: bool) -> int:
    """The samples one ``generate`` call carries: a group's with group calls, else one."""
    return GROUP if group_calls else 1


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
    n: int,
    slots: int,
    gen_s: float,
    times: dict[str, float],
    hosts: int,
    gc_mode: str,
    group_calls: bool = False,
    shards: int = 0,
) -> dict[str, Any]:
    """One row in this process: start the helpers (and, with ``shards``, the shard processes,
    which own the replicas; the driver then connects to the shards alone), wait for every
    replica, measure the idle driver and the pipeline's window, stop the helpers; the figures of
    the module docstring."""
    # Before the first socket, as the driver does; with shards, for the replicas' reports too.
    reserve_sockets(n + shards)
    run_dir = tempfile.mkdtemp(prefix="arl-sc-")  # short: ipc socket paths live under it
    registry = LocalRegistry(run_dir)
    endpoints = [registry.endpoint("rollout", i) for i in range(n)]
    procs = start_hosts(endpoints, slots, gen_s, run_dir, hosts, run=RUN)
    shard_endpoints = [registry.endpoint("shard", i) for i in range(shards)]
    shard_procs = start_shards(endpoints, shard_endpoints, run_dir)
    pids = [p.pid for p in procs + shard_procs]
    group = "shard" if shards else "rollout"
    # A shard connecting to its hundreds of replicas on a loaded machine may not answer the
    # driver's heartbeats for seconds: it is given SHARD_LIVENESS of them.
    info = GroupInfo(shard_endpoints, liveness=SHARD_LIVENESS) if shards else GroupInfo(endpoints)
    dispatcher = Dispatcher({group: info}, run=RUN)
    dispatcher.start()
    try:
        ctx = Context(dispatcher, run=RUN, run_dir=run_dir, log=None)
        # Every replica is connected (through its shard) once it answered its version.
        await ctx.roles[group].broadcast(_weights_method(shards), 0, timeout=ROW_TIMEOUT_S)
        if gc_mode == "freeze":
            freeze_start_up()  # every replica is connected: start-up is over
        cpu0 = time.process_time()
        await asyncio.sleep(times["idle"])
        idle_cpu = (time.process_time() - cpu0) / times["idle"]
        w = await _pipeline_window(ctx, n, slots, times, pids, group_calls, shards)
        assert w.start is not None and w.end is not None
        edges = [w.start.wall, w.end.wall]
        per_call = samples_a_call(group_calls)
        turn, usage = await _replica_reports(endpoints, [*edges, per_call], ctx, shards)
    finally:
        await dispatcher.close()
        for proc in procs + shard_procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in procs + shard_procs:
            proc.wait(timeout=30)
        shutil.rmtree(run_dir, ignore_errors=True)
    figures = _row_figures(n, slots, gen_s, w, idle_cpu, turn, usage, per_call, shards)
    return figures | {"hosts": len(procs), "shards": shards}


def _weights_method(shards: int) -> str:
    """What the driver broadcasts a new version with: the replicas' ``set_version``, or, with
    shards, their ``sync``, which has their replicas ``set_version``."""
    return "sync" if shards else "set_version"


async def _replica_reports(
    endpoints: list[str], window: list[float], ctx: Context, shards: int
) -> tuple[list[list[float]], list[dict[str, float]]]:
    """Every replica's slot turnarounds and usage over ``window``; with shards (the driver
    holds no connection to a replica), over connections made now, after the window."""
    if not shards:
        rollout = ctx.roles["rollout"]
        turn = await rollout.broadcast("turnaround", window, list[float])
        return turn, await rollout.broadcast("usage", window, dict[str, float])
    dispatcher = Dispatcher({"rollout": GroupInfo(endpoints)}, run=RUN)
    dispatcher.start()
    try:
        rollout = Context(dispatcher, run=RUN, run_dir=ctx.run_dir, log=None).roles["rollout"]
        turn = await rollout.broadcast("turnaround", window, list[float], timeout=ROW_TIMEOUT_S)
        return turn, await rollout.broadcast("usage", window, dict[str, float])
    finally:
        await dispatcher.close()


async def _pipeline_window(
    ctx: Context,
    n: int,
    slots: int,
    times: dict[str, float],
    pids: list[int],
    group_calls: bool = False,
    shards: int = 0,
) -> _Window:
    """Run the sample pipeline (with ``shards``, a ``ShardedPipeline`` over them) through its
    warm-up and the measured window."""

    async def feed(cursor: int, count: int) -> list[Prompt]:
        return [Prompt(id=f"p{i}", token_ids=[1, 2, 3]) for i in range(cursor, cursor + count)]

    # A batch is what the replicas decode at once.
    batch = max(GROUP, -(-n * slots * samples_a_call(group_calls) // GROUP) * GROUP)
    spec = PipelineSpec(mode="async", eta=ETA, over_eta="correct", group_calls=group_calls)
    settings = BatchSettings(batch_size=batch, group_size=GROUP)
    params = SamplingParams(max_new_tokens=1)
    group = ctx.roles["shard" if shards else "rollout"]
    pipe = (
        ShardedPipeline(group, spec=spec, feed=feed, params=params, settings=settings)
        if shards
        else SamplePipeline(
            group, spec=spec, feed=feed, score=score, params=params, settings=settings
        )
    )
    w = _Window()
    async with WeightSync(group, wait=False, method=_weights_method(shards)) as weights, pipe:
        start = time.monotonic()
        version = await _consume(pipe, weights, 0, start + times["warmup"], None)
        w.start = _Mark.now(pids)
        await _consume(pipe, weights, version, w.start.t + times["window"], w)
        w.end = _Mark.now(pids)
    return w


async def score(samples: list[Sample]) -> list[float]:
    """The benchmark's reward of each sample (a ``Scorer``: what its shards import too)."""
    return [reward(s) for s in samples]


# -- the shard processes of a sharded row ------------------------------------------------------


class ShardSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one shard process of a sharded row serves: shard ``shard`` of ``shards`` at
    ``endpoint``, over its range of the rollout replicas (``replicas``: all of them)."""

    endpoint: str
    shard: int
    shards: int
    replicas: list[str]
    run_dir: str
    parent_pid: int
    run: str


async def _serve_shard(spec: ShardSpec) -> None:
    """Serve a ``DispatchShard`` until stdin closes (the driver ended or closed it)."""
    config = DispatchShard.Config(score="benchmarks.scale:score", weights_method="set_version")
    ctx = RoleContext(
        name="shard",
        replica=spec.shard,
        run=spec.run,
        run_dir=spec.run_dir,
        config=config,
        capacity=SHARD_CAPACITY,
        replicas=spec.shards,
        groups={"rollout": GroupInfo(spec.replicas)},
    )
    role = DispatchShard(ctx)
    await role.setup()
    methods = endpoints_of(DispatchShard)
    server = Server(spec.endpoint, name=f"shard.{spec.shard}", options=ChannelOptions(run=spec.run))
    for ep in methods.values():
        server.add(ep.name, _served(getattr(role, ep.attr)), ep.request_type)
    described = {
        "role": "shard",
        "replica": spec.shard,
        "incarnation": 0,
        "pid": os.getpid(),
        "endpoints": {name: ep.delivery.value for name, ep in methods.items()},
    }
    server.add("_describe", lambda payload, call: described)
    await server.start()
    server.set_credit(SHARD_CAPACITY)
    try:
        await asyncio.to_thread(sys.stdin.read)
    finally:
        await server.close()
        await role.teardown()


def _served(method: Any) -> Any:
    async def handle(payload: Any, call: Call) -> Any:
        return await method(payload)

    return handle


def shard_main() -> int:
    """A shard process of a sharded row: read its ``ShardSpec`` (one JSON line on stdin),
    serve its shard until stdin closes."""
    spec = msgspec.json.decode(sys.stdin.readline(), type=ShardSpec)
    die_with_parent(spec.parent_pid)
    reserve_sockets(len(owned_replicas(len(spec.replicas), spec.shards, spec.shard)))
    logs.configure(role="bench-scale-shard", console=False)
    run(_serve_shard(spec))
    return 0


def start_shards(
    replicas: list[str], endpoints: list[str], run_dir: str
) -> list[subprocess.Popen[str]]:
    """One ``python -m benchmarks.scale --shard`` process per shard endpoint in ``endpoints``,
    each owning its range of ``replicas``."""
    procs = []
    for i, endpoint in enumerate(endpoints):
        spec = ShardSpec(
            endpoint=endpoint,
            shard=i,
            shards=len(endpoints),
            replicas=replicas,
            run_dir=run_dir,
            parent_pid=os.getpid(),
            run=RUN,
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.scale", "--shard"],
            stdin=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.stdin is not None
        proc.stdin.write(msgspec.json.encode(spec).decode() + "\n")
        proc.stdin.flush()
        procs.append(proc)
    return procs


def _row_figures(
    n: int,
    slots: int,
    gen_s: float,
    w: _Window,
    idle_cpu: float,
    turn: list[list[float]],
    usage: list[dict[str, float]],
    per_call: int,
    shards: int = 0,
) -> dict[str, Any]:
    """One row's figures (see the module docstring) from its window and the replicas' reports;
    ``per_call``: the samples of one ``generate`` call (``GROUP`` with group calls, else 1);
    ``shards``: the last processes of the window's marks that are shard processes."""
    assert w.start is not None and w.end is not None
    a, b = w.start, w.end
    span = b.t - a.t
    gaps = percentiles(g * 1e3 for replica in turn for g in replica)
    busy = [
        (b1 - b0 + w1 - w0) / span
        for (_, (b0, w0)), (_, (b1, w1)) in zip(a.hosts, b.hosts, strict=True)
    ]
    cpu = [c1 - c0 for (c0, _), (c1, _) in zip(a.hosts, b.hosts, strict=True)]
    hosts = len(busy) - shards
    return {
        "replicas": n,
        "slots": slots,
        "gen_ms": gen_s * 1e3,
        "window_s": span,
        "steps": w.steps,
        "consumed_samples": w.consumed,
        "samples_per_s": w.consumed / span,
        "ideal_samples_per_s": n * slots * per_call / gen_s,
        "efficiency": w.consumed / span / (n * slots * per_call / gen_s),
        "dispatched_per_s": sum(u["started"] for u in usage) / span,
        "replica_idle_mean": sum(u["idle"] for u in usage) / n,
        **_driver_figures(w, idle_cpu),
        "dispatch_ms_p50": gaps["p50"],
        "dispatch_ms_p99": gaps["p99"],
        "dispatch_ms_max": gaps["max"],
        "dispatch_count": sum(len(r) for r in turn),
        "hosts": hosts,
        "hosts_cpu_fraction": sum(cpu[:hosts]) / span,
        "hosts_busy_max": max(busy[:hosts]),
        "shards_cpu_fraction": sum(cpu[hosts:]) / span,
        "shards_busy_max": max(busy[hosts:], default=0.0),
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
    if args.gc == "off":
        gc.disable()
    figures = run(
        _drive(
            args.row,
            args.slots,
            args.gen_ms / 1e3,
            times,
            args.hosts,
            args.gc,
            args.group,
            args.shards,
        )
    )
    print(json.dumps(figures | {"gc": args.gc, "group_calls": args.group}))
    return 0


# -- the benchmark: one driver process per row, and the projection ------------------------------


def measure_row(
    n: int,
    *,
    slots: int = SLOTS,
    gen_ms: float = GEN_MS,
    hosts: int = HOSTS,
    times: dict[str, float] = TIMES,
    gc: str = "freeze",
    group_calls: bool = False,
    shards: int = 0,
) -> dict[str, Any]:
    """The figures of one row (``n`` replicas), measured in a fresh driver process; ``times``
    as ``TIMES``; ``gc``: the driver's cyclic garbage collector, one of ``GC_MODES``;
    ``group_calls``: the pipeline's ``group_calls`` (one call a group); ``shards``: that many
    dispatch shard processes own the replicas (0: the driver dispatches every sample).

    Raises:
        RuntimeError: the row's process failed; the message holds the end of its output.
    """
    cmd = [sys.executable, "-m", "benchmarks.scale", "--row", str(n), "--slots", str(slots)]
    cmd += ["--gen-ms", str(gen_ms), "--hosts", str(hosts)]
    cmd += [arg for name, value in times.items() for arg in (f"--{name}", str(value))]
    cmd += ["--gc", gc, *(["--group-calls"] if group_calls else []), "--shards", str(shards)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=ROW_TIMEOUT_S)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        with_shards = f" with {shards} shards" if shards else ""
        raise RuntimeError(
            f"bench scale: the row of {n} replicas{with_shards} failed (exit status "
            f"{out.returncode}); its output ends with:\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
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


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Of one arm's runs of a row, the run of the median samples/s (the lower of the two middle
    ones of an even count), with ``rounds`` and every run's ``samples_per_s_rounds``; a run
    that failed makes the row a failure (its ``error``)."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0] | {"rounds": len(runs)}
    ranked = sorted(runs, key=lambda r: r["samples_per_s"])
    return ranked[(len(ranked) - 1) // 2] | {
        "rounds": len(runs),
        "samples_per_s_rounds": [r["samples_per_s"] for r in runs],
    }


def measure_arms(
    n: int, arms: list[int], rounds: int, *, catch: bool = False, **row: Any
) -> dict[int, dict[str, Any]]:
    """Row ``n`` in each arm of ``arms`` (0: one driver; K: K dispatch shards), ``rounds``
    times, the arms' order alternating by round (as given in even rounds, reversed in odd
    ones), so no arm always runs on the machine as another left it. Returns each arm's
    ``median_row``; with one driver and a sharded arm, the sharded row also has
    ``samples_per_s_ratio_rounds``, each round's sharded over one-driver samples/s, and
    ``samples_per_s_ratio``, their median. ``catch``: a row that fails is recorded (its
    ``error``) rather than raised."""
    runs: dict[int, list[dict[str, Any]]] = {count: [] for count in arms}
    for r in range(rounds):
        for count in arms if r % 2 == 0 else arms[::-1]:
            try:
                runs[count].append(measure_row(n, shards=count, **row))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                if not catch:
                    raise
                runs[count].append({"replicas": n, "shards": count, "error": str(exc)})
    out = {count: median_row(runs[count]) for count in arms}
    for count in arms:
        if count and 0 in arms and "error" not in out[count]:
            pairs = zip(runs[0], runs[count], strict=True)
            ratios = [b["samples_per_s"] / a["samples_per_s"] for a, b in pairs if _measured(a, b)]
            if ratios:
                out[count]["samples_per_s_ratio_rounds"] = ratios
                out[count]["samples_per_s_ratio"] = statistics.median(ratios)
    return out


def _measured(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return "error" not in a and "error" not in b and a["samples_per_s"] > 0


def measure(
    replicas: list[int], hold: list[int], shards: int = 0, rounds: int = 1, **row: Any
) -> dict[str, Any]:
    """Every row of ``replicas``, in order, and the projection from them (``project``); then
    the hold sweep: a row per count in ``hold`` at ``HOLD_RATE`` samples/s a replica, up to
    the first that fails (its ``error`` is recorded); and the ``summarize`` figures. See
    ``measure_row`` for ``row``'s options.

    Each row is measured ``rounds`` times and its median run kept (``measure_arms``). With
    ``shards``, each round measures it in both arms, one driver and ``shards`` dispatch shards,
    in an order that alternates by round, and ``"shards"`` holds the sharded rows, their
    summary and their ratios to one driver, row by row (``compare``)."""
    both = [0, shards] if shards else [0]
    rows, sharded = [], []
    for n in replicas:
        out = measure_arms(n, both, rounds, **row)
        rows.append(out[0])
        if shards:
            sharded.append(out[shards])
    held: list[dict[str, Any]] = []
    sharded_held: list[dict[str, Any]] = []
    for n in hold:
        # An arm is measured up to its first failure.
        arms = [
            count
            for count, out in ((0, held), (shards, sharded_held))
            if count in both and not (out and "error" in out[-1])
        ]
        if not arms:
            break
        measured = measure_arms(n, arms, rounds, catch=True, **hold_options(row))
        if 0 in measured:
            held.append(measured[0])
        if shards in measured and shards:
            sharded_held.append(measured[shards])
    figures = {
        "rows": rows,
        "projection": project(rows) if rows else None,
        "hold": {"samples_per_s_a_replica": HOLD_RATE, "rows": held},
        "rounds": rounds,
        "cpus": os.cpu_count(),
    }
    if shards:
        figures["shards"] = compare(shards, rows, held, sharded, sharded_held)
    return figures | summarize(rows, held)


def compare(
    shards: int,
    rows: list[dict[str, Any]],
    held: list[dict[str, Any]],
    sharded: list[dict[str, Any]],
    sharded_held: list[dict[str, Any]],
) -> dict[str, Any]:
    """The sharded arm against one driver: its rows and hold rows, its ``summarize``
    figures, ``replicas_max_held_ratio`` (None where one driver held none) and, per row
    measured in both, ``row_ratios``: its samples/s in each arm and ``samples_per_s_ratio``,
    the median over the rounds of each round's ratio (measured in the same round, so on the
    same minute of the machine; a row without per-round ratios, the ratio of its rows)."""
    one, mine = summarize(rows, held), summarize(sharded, sharded_held)
    sharded_by_n = {r["replicas"]: r for r in sharded_held}
    pairs = [
        (a, b, hold)
        for a, b, hold in [
            *((a, b, False) for a, b in zip(rows, sharded, strict=True)),
            *(
                (a, sharded_by_n[a["replicas"]], True)
                for a in held
                if a["replicas"] in sharded_by_n
            ),
        ]
        if _measured(a, b)
    ]
    return {
        "count": shards,
        "rows": sharded,
        "hold": sharded_held,
        **mine,
        "replicas_max_held_ratio": (
            mine["replicas_max_held"] / one["replicas_max_held"]
            if one["replicas_max_held"]
            else None
        ),
        "row_ratios": [
            {
                "replicas": a["replicas"],
                "hold": hold,
                "ideal_samples_per_s": a["ideal_samples_per_s"],
                "one_driver_samples_per_s": a["samples_per_s"],
                "sharded_samples_per_s": b["samples_per_s"],
                "samples_per_s_ratio": b.get(
                    "samples_per_s_ratio", b["samples_per_s"] / a["samples_per_s"]
                ),
            }
            for a, b, hold in pairs
        ],
    }


def hold_options(row: dict[str, Any]) -> dict[str, Any]:
    """``row``'s options for a hold row: ``HOLD_RATE`` samples/s a replica in either mode. A
    call holds its slot ``slots x per_call / HOLD_RATE`` seconds, where ``per_call`` is the
    samples of one call (``GROUP`` with group calls, else 1): the same replica, with the same
    slots, gives the same samples/s whether its calls carry one sample or a group (4 slots of
    0.4 s, or of 3.2 s). The warm-up lasts at least two calls and the window three."""
    gen_s = row["slots"] * samples_a_call(row.get("group_calls", False)) / HOLD_RATE
    times = dict(row.get("times", TIMES))
    times["warmup"] = max(times["warmup"], 2 * gen_s)
    times["window"] = max(times["window"], 3 * gen_s)
    return row | {"gen_ms": 1e3 * gen_s, "times": times}


def summarize(rows: list[dict[str, Any]], held: list[dict[str, Any]]) -> dict[str, Any]:
    """What one driver carried over every measured row: ``samples_per_s_max``, the most
    samples/s of any row, with ``loop_cpu_s_per_1k`` and ``driver_ceiling_samples_per_s`` of
    that row; and ``replicas_max_held``, the most replicas of a hold row that carried at least
    ``HELD`` of its asked rate (0 when none did)."""
    measured = [r for r in (*rows, *held) if "error" not in r]
    best = max(measured, key=lambda r: r["samples_per_s"], default=None)
    return {
        "samples_per_s_max": best["samples_per_s"] if best else 0.0,
        "loop_cpu_s_per_1k": best["driver_loop_cpu_s_per_1k"] if best else None,
        "driver_ceiling_samples_per_s": best["driver_ceiling_samples_per_s"] if best else None,
        "replicas_max_held": max(
            (r["replicas"] for r in held if "error" not in r and r["efficiency"] >= HELD),
            default=0,
        ),
    }


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
    """The figures of ``measure`` as readable tables: the rows, the hold sweep, the summary."""
    rows, held = figures["rows"], figures["hold"]["rows"]
    first = (rows or held)[0]
    lines = [
        "asyncrl scale benchmark: the real driver (dispatcher, sample pipeline, reducer, weight "
        "broadcast) against simulated rollout replicas",
        f"{first['slots']} slots a replica, groups of {GROUP}"
        f"{' (a call a group)' if first.get('group_calls') else ''}, eta {ETA}, instant learner; "
        f"{figures['cpus']} CPUs, {first['window_s']:.1f} s windows, GC {first['gc']}. p50/p99: "
        "slot turnaround; loop: the driver's event-loop thread (busy: ran + waited for a core)",
    ]
    header = "".join(f"{head:>{width}}" for head, width, _, _ in _COLUMNS)
    if rows:
        lines += ["", f"{first['gen_ms']:.0f} ms a sample", header]
        lines += [_line(r) for r in rows]
        p = figures["projection"]
        lines += [
            f"driver loop CPU per sample ~ {p['cpu_us_per_sample_fixed']:.0f} us + "
            f"{p['cpu_us_per_sample_per_replica']:.2f} us x replicas; at "
            f"{p['replica_rate_per_s']:.0f} samples/s a replica, one driver core is full at "
            f"~{p['one_core_limit_replicas']:.0f} replicas",
        ]
    if held:
        lines += ["", f"hold: {HOLD_RATE:.0f} samples/s a replica", header]
        lines += [_line(r) if "error" not in r else f"{r['replicas']:>8d}  failed" for r in held]
    lines += [
        "",
        f"one driver carried at most {figures['samples_per_s_max']:.0f} samples/s "
        f"(loop {figures['loop_cpu_s_per_1k'] or 0:.3f} s a 1,000 samples); it held "
        f"{figures['replicas_max_held']} replicas at {HOLD_RATE:.0f} samples/s each "
        f"(>= {HELD:.0%} of the asked rate)",
    ]
    if "shards" in figures:
        lines += _sharded_lines(figures["shards"], header)
    return "\n".join(lines)


def _sharded_lines(sharded: dict[str, Any], header: str) -> list[str]:
    """The sharded arm's rows, hold rows and ratios to one driver, for ``format_table``."""
    count = sharded["count"]
    lines = [
        "",
        f"with {count} dispatch shards (each row measured in both arms every round, in an order "
        "alternating by round; each arm's median round)",
    ]
    for title, rows in (("", sharded["rows"]), ("hold: ", sharded["hold"])):
        if rows:
            lines += [
                f"{title}shards busy: the busiest shard process's loop",
                header + "  shards busy",
            ]
            lines += [
                f"{_line(r)}{r['shards_busy_max']:>13.2f}"
                if "error" not in r
                else f"{r['replicas']:>8d}  failed"
                for r in rows
            ]
    lines += [""] + [
        f"{r['replicas']:>5d} replicas{' (hold)' if r['hold'] else ''}: "
        f"{r['sharded_samples_per_s']:.0f} samples/s with shards against "
        f"{r['one_driver_samples_per_s']:.0f} with one driver ({r['samples_per_s_ratio']:.2f}x, "
        "the median of the rounds' ratios)"
        for r in sharded["row_ratios"]
    ]
    lines.append(
        f"{count} shards carried at most {sharded['samples_per_s_max']:.0f} samples/s and held "
        f"{sharded['replicas_max_held']} replicas"
    )
    return lines


def _line(row: dict[str, Any]) -> str:
    return "".join(f"{row[key]:>{width}{fmt}}" for _, width, key, fmt in _COLUMNS)


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
    parser.add_argument(
        "--hold", type=int, action="append", help="only this hold-sweep replica count (repeatable)"
    )
    parser.add_argument(
        "--gc", choices=GC_MODES, default="freeze", help="the driver's cyclic GC (freeze)"
    )
    parser.add_argument("--no-gc", action="store_const", const="off", dest="gc", help="--gc off")
    parser.add_argument(
        "--group-calls", action="store_true", dest="group", help="one generate call a group"
    )
    parser.add_argument(
        "--shards",
        type=int,
        default=0,
        help="also measure each row with this many dispatch shards, interleaved (0: not)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="measure each row this many times, in both arms in an order alternating by "
        "round, and keep the median (3 with --shards, else 1)",
    )
    parser.add_argument("--row", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shard", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.host:
        return host_main()
    if args.shard:
        return shard_main()
    for name, default in (QUICK_TIMES if args.quick else TIMES).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.slots < 1 or args.hosts < 1 or not args.gen_ms > 0:
        parser.error("--slots and --hosts must be >= 1 and --gen-ms > 0")
    if not (args.window > 0 and args.warmup >= 0 and args.idle > 0):
        parser.error("--window and --idle must be > 0 and --warmup >= 0")
    if args.row is not None:
        return _row_main(args)
    replicas, hold = args.replicas or [], args.hold or []
    if not (replicas or hold):  # neither asked for: both sweeps
        replicas = list(QUICK_ROWS if args.quick else ROWS)
        hold = list(QUICK_HOLD_ROWS if args.quick else HOLD_ROWS)
    if any(n < 1 for n in replicas + hold):
        parser.error(f"--replicas and --hold must be >= 1, got {replicas} and {hold}")
    if args.shards < 0 or (args.shards and min(replicas + hold) < args.shards):
        parser.error(
            f"--shards must be >= 0 and at most the fewest replicas of a row "
            f"({min(replicas + hold)}), got {args.shards}"
        )
    rounds = args.rounds if args.rounds is not None else (3 if args.shards else 1)
    if rounds < 1:
        parser.error(f"--rounds must be >= 1, got {rounds}")
    times = {name: getattr(args, name) for name in TIMES}
    options = {"slots": args.slots, "gen_ms": args.gen_ms, "hosts": args.hosts, "gc": args.gc}
    options["group_calls"] = args.group
    figures = measure(replicas, hold, args.shards, rounds, times=times, **options)
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0


if __name__ == "__main__":
    # ``python -m benchmarks.scale`` runs this file as ``__main__``: call the canonical
    # module's main, so that the role class is the one the rest of asyncrl imports.
    from benchmarks.scale import main as _main

    raise SystemExit(_main())
