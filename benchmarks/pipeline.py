"""``asyncrl bench pipeline``: the sample pipeline, sync against async, measured against its model.

Each row runs a manifest twice with ``asyncrl run`` (real processes: the driver, four
``SimRollout`` replicas of 16 slots, a ``SimLearner``), once in sync and once in async mode.
Only generation and training are simulated: a sample sleeps for its drawn duration (lognormal,
mean 50 ms, divided by its replica's speed) and a learner step for a quarter of the ideal time of
a batch. Everything else is the real thing: the dispatcher, ``SamplePipeline`` with its pacing
and split-mode reduction, the weight-version broadcast (awaited in sync mode, in the background
in async mode).

``pipeline_model.simulate`` computes the same workload, with the same draws, on a zero-overhead
runtime; ``measured / model`` (work per second) is therefore what the runtime costs. Figures
are taken from the end of the warm-up steps to the end of the last step.

Targets, at sigma 1.0 with the slow replica: async efficiency >= 0.9, fast-replica idle <= 5%,
measured / model >= 0.9 in both modes.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.bench.harness import finished_run
from asyncrl.roles.learning.statistics import percentiles
from asyncrl.roles.payloads import Prompt, Sample, SamplingParams, StepResult, TrainBatch
from asyncrl.roles.sampling.pipeline import Batch, BatchSettings, SamplePipeline, WeightSync
from benchmarks.pipeline_model import Workload, simulate
from benchmarks.sim import work_of

__all__ = [
    "ROWS",
    "format_table",
    "main",
    "manifest",
    "measure",
    "program",
    "reward",
    "run_manifest",
    "run_row",
    "workload",
]

SLOW = (1.0, 1.0, 1.0, 1 / 3)
EQUAL = (1.0, 1.0, 1.0, 1.0)
ROWS: tuple[tuple[float, bool], ...] = (
    (0.0, True),
    (0.5, True),
    (1.0, True),
    (1.5, True),
    (0.0, False),
    (1.0, False),
)
"""(sigma, slow replica) of each row; the slow replica runs at a third of the others' speed."""
QUICK_ROWS = ((1.0, True), (0.0, False))
TARGET_ROW = (1.0, True)
STRAGGLER = "wait"
RUN_TIMEOUT_S = 900.0

# -- the control-flow program (runs in the driver process) -----------------------------------


def reward(sample: Sample) -> float:
    """A deterministic coin flip per stable id (GRPO's 0/1 rewards, without a verifier)."""
    return float(zlib.crc32(f"{sample.prompt_id}/{sample.sample_index}".encode()) & 1)


@dataclass
class _Window:
    """What the measured steps add up to: the consumed samples' work and staleness, and where
    the driver's loop spent the window (``time.time`` and ``time.process_time`` at its ends)."""

    draws: tuple[float, float, int]
    """``sigma``, ``mean_s`` and ``seed`` of the draws, to know the work of a consumed sample."""
    profile: str
    """A path to write a cProfile of the window to; empty: none."""
    profiler: cProfile.Profile | None = field(init=False, default=None)
    works: list[float] = field(default_factory=list)
    ages: list[int] = field(default_factory=list)
    wait_s: float = 0.0
    train_s: float = 0.0
    push_s: float = 0.0
    t0: float = 0.0
    cpu0: float = 0.0
    t1: float = 0.0
    cpu1: float = 0.0
    before: dict[str, int] = field(default_factory=dict)
    """The pipeline's counters when the window opened."""

    def __post_init__(self) -> None:
        self.profiler = cProfile.Profile() if self.profile else None

    def open(self, metrics: Mapping[str, int]) -> None:
        self.t0, self.cpu0, self.before = time.time(), time.process_time(), dict(metrics)
        if self.profiler is not None:
            self.profiler.enable()

    def add(self, taken: Batch, began: float, got: float, trained: float) -> None:
        """One measured step: ``taken`` waited for from ``began`` to ``got``, trained until
        ``trained``, and its version pushed until now."""
        self.wait_s += got - began
        self.train_s += trained - got
        self.push_s += time.time() - trained
        self.works += [
            work_of(s.sample.prompt_id, s.sample.sample_index, *self.draws) for s in taken.samples
        ]
        self.ages += taken.staleness

    def close(self) -> None:
        self.t1, self.cpu1 = time.time(), time.process_time()
        if self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(self.profile)


async def program(ctx: Any) -> dict[str, Any]:
    """Drive ``SamplePipeline`` against ``SimRollout`` and ``SimLearner``; measure the window.

    ``ctx.config``: ``batch``, ``group``, ``warmup``, ``steps``, and the draws' ``sigma``,
    ``mean_s`` and ``seed`` (to know the work of consumed samples); ``profile``: a path to write
    a cProfile of the driver's loop to (empty: none).

    Returns the figures of the window, named as ``pipeline_model.ModelResult``'s (``idle`` from
    the replicas' own records; ``waste_fraction`` by sample count, since the pipeline counts
    wasted samples, not their work), and where the loop spent the window: ``batch_wait_s`` in
    ``next_batch``, ``train_call_s`` in ``train_step`` calls, ``push_s`` in version pushes
    (awaited in sync mode only); ``driver_cpu_fraction``: the driver's CPU time over the window.
    """
    cfg = ctx.config
    warmup, steps = int(cfg["warmup"]), int(cfg["steps"])
    draws = (float(cfg["sigma"]), float(cfg["mean_s"]), int(cfg["seed"]))
    window = _Window(draws, cfg.get("profile") or "")
    pipe, weights = await _pipeline(ctx)
    async with pipe:
        if warmup == 0:
            window.open(pipe.metrics)
        for step in range(warmup + steps):
            began = time.time()
            taken = await pipe.next_batch()
            got = time.time()
            result = await ctx.roles["learner"].call(
                "train_step", TrainBatch(samples=taken.samples), StepResult
            )
            trained = time.time()
            pipe.advance(result.version)
            await weights.push(result.version)
            if step >= warmup:
                window.add(taken, began, got, trained)
            if step + 1 == warmup:
                window.open(pipe.metrics)
        window.close()
        metrics = dict(pipe.metrics)
    await weights.close()
    usage = await ctx.roles["rollout"].broadcast("usage", [window.t0, window.t1], dict[str, float])
    return _figures(ctx.pipeline.mode, steps, window, metrics, usage)


async def _pipeline(ctx: Any) -> tuple[SamplePipeline, WeightSync]:
    """The sample pipeline of ``ctx``'s manifest, started at the learner's version (which the
    rollout replicas are told first), and the version pushes its mode makes."""
    cfg, spec = ctx.config, ctx.pipeline

    async def feed(cursor: int, n: int) -> list[Prompt]:
        return [Prompt(id=f"p{i}", token_ids=[1, 2, 3]) for i in range(cursor, cursor + n)]

    async def score(samples: list[Sample]) -> list[float]:
        return [reward(s) for s in samples]

    status = await ctx.roles["learner"].call("status", None)
    await ctx.roles["rollout"].broadcast("set_version", status["version"], int)
    pipe = SamplePipeline(
        ctx.roles["rollout"],
        spec=spec,
        feed=feed,
        score=score,
        params=SamplingParams(max_new_tokens=1),
        settings=BatchSettings(batch_size=int(cfg["batch"]), group_size=int(cfg["group"])),
        start_version=status["version"],
    )
    return pipe, WeightSync(ctx.roles["rollout"], wait=spec.mode == "sync", method="set_version")


def _figures(
    mode: str, steps: int, w: _Window, metrics: dict[str, Any], usage: list[dict[str, float]]
) -> dict[str, Any]:
    """The program's result (see ``program``) from its window of ``steps`` steps, the
    pipeline's counters at its end, and the replicas' ``usage`` over it."""
    window = w.t1 - w.t0
    consumed_work = sum(w.works)
    capacity = sum(u["slots"] * u["speed"] for u in usage)
    dispatched = sum(u["started"] for u in usage)
    dispatched_work = sum(u["work_s"] for u in usage)
    wasted = metrics.get("wasted_samples", 0) - w.before.get("wasted_samples", 0)
    stale = percentiles(w.ages)
    return {
        "mode": mode,
        "window_s": window,
        "window_steps": steps,
        "samples_per_s": len(w.works) / window,
        "work_per_s": consumed_work / window,
        "efficiency": consumed_work / (capacity * window),
        "idle": [u["idle"] for u in usage],
        "speeds": [u["speed"] for u in usage],
        "consumed_samples": len(w.works),
        "consumed_work": consumed_work,
        "dispatched_samples": int(dispatched),
        "dispatched_work": dispatched_work,
        "wasted_samples": int(wasted),
        "waste_fraction": wasted / dispatched if dispatched else 0.0,
        "staleness_p50": int(stale["p50"]),
        "staleness_p99": int(stale["p99"]),
        "staleness_max": int(stale["max"]),
        "mean_consumed_s": consumed_work / len(w.works),
        "mean_dispatched_s": dispatched_work / dispatched if dispatched else 0.0,
        "batch_wait_s": w.wait_s,
        "train_call_s": w.train_s,
        "push_s": w.push_s,
        "driver_cpu_fraction": (w.cpu1 - w.cpu0) / window,
        "load_avg_1m": os.getloadavg()[0],
        "pipeline": metrics,
    }


# -- the benchmark (runs the manifests, and the model) ---------------------------------------


def workload(sigma: float, slow: bool, *, warmup: int = 5, steps: int = 30) -> Workload:
    """A row's workload: the pinned parameters of the module docstring."""
    return Workload(sigma=sigma, speeds=SLOW if slow else EQUAL, warmup=warmup, steps=steps)


def manifest(w: Workload, mode: str, profile: str = "") -> dict[str, Any]:
    """The manifest of one run of ``w`` in ``mode``, as a mapping."""
    draws = {"sigma": w.sigma, "mean_s": w.mean_s, "seed": w.seed}
    return {
        "run": {
            "name": f"bench-pipeline-{mode}",
            "program": "benchmarks.pipeline:program",
            "config": {
                "batch": w.batch,
                "group": w.group,
                "warmup": w.warmup,
                "steps": w.steps,
                "profile": profile,
                **draws,
            },
        },
        "roles": {
            "rollout": {
                "class": "benchmarks.sim:SimRollout",
                "replicas": len(w.speeds),
                "capacity": w.slots,
                "config": {"speeds": list(w.speeds), **draws},
            },
            "learner": {"class": "benchmarks.sim:SimLearner", "config": {"step_s": w.learner_s}},
        },
        "pipeline": {
            "mode": mode,
            "eta": w.eta,
            "over_eta": w.over_eta,
            "overprovision": w.overprovision,
            "straggler": {"policy": STRAGGLER},
        },
    }


def run_manifest(w: Workload, mode: str, profile: str = "") -> dict[str, Any]:
    """Run one manifest with ``asyncrl run`` in a fresh run directory; return the program's
    figures.

    Raises:
        RuntimeError: the run failed; the message holds the end of its output.
    """
    run_dir = tempfile.mkdtemp(prefix="arl-pb-")  # short: ipc socket paths live under it
    try:
        what = f"bench pipeline: the {mode} run at sigma {w.sigma}"
        report = finished_run(manifest(w, mode, profile), run_dir, what, RUN_TIMEOUT_S)
        result: dict[str, Any] = report["result"]
        result["dispatch"] = report.get("dispatch", {})
        return result
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _fast_idle(idle: Sequence[float], speeds: Sequence[float]) -> float:
    """The largest idle fraction among the full-speed replicas."""
    top = max(speeds)
    return max(i for i, s in zip(idle, speeds, strict=True) if s == top)


def run_row(w: Workload, profile_dir: str = "") -> dict[str, Any]:
    """Both modes of one workload, measured and modelled; the row's figures."""
    slow = len(set(w.speeds)) > 1
    measured: dict[str, dict[str, Any]] = {}
    model: dict[str, dict[str, Any]] = {}
    for mode in ("sync", "async"):
        profile = ""
        if profile_dir:
            tag = f"sigma{w.sigma}-{'slow' if slow else 'equal'}-{mode}"
            profile = os.path.join(os.path.abspath(profile_dir), f"{tag}.prof")
        measured[mode] = run_manifest(w, mode, profile)
        model[mode] = simulate(w, mode).as_dict()
    sync, fast = measured["sync"], measured["async"]
    msync, mfast = model["sync"], model["async"]
    return {
        "sigma": w.sigma,
        "slow_replica": slow,
        "speeds": list(w.speeds),
        "eta": w.eta,
        "over_eta": w.over_eta,
        "straggler_policy": STRAGGLER,
        "warmup": w.warmup,
        "steps": w.steps,
        "sync_samples_per_s": sync["samples_per_s"],
        "async_samples_per_s": fast["samples_per_s"],
        "speedup": fast["samples_per_s"] / sync["samples_per_s"],
        "sync_efficiency": sync["efficiency"],
        "async_efficiency": fast["efficiency"],
        "fast_worker_idle_max": _fast_idle(fast["idle"], w.speeds),
        "sync_fast_worker_idle_max": _fast_idle(sync["idle"], w.speeds),
        "async_model_ratio": fast["work_per_s"] / mfast["work_per_s"],
        "sync_model_ratio": sync["work_per_s"] / msync["work_per_s"],
        "staleness_p50": fast["staleness_p50"],
        "staleness_p99": fast["staleness_p99"],
        "staleness_max": fast["staleness_max"],
        "sync_staleness_max": sync["staleness_max"],
        "waste_fraction": fast["waste_fraction"],
        "async_mean_consumed_s": fast["mean_consumed_s"],
        "async_mean_dispatched_s": fast["mean_dispatched_s"],
        "sync_mean_consumed_s": sync["mean_consumed_s"],
        "sync_mean_dispatched_s": sync["mean_dispatched_s"],
        "model_sync_samples_per_s": msync["samples_per_s"],
        "model_async_samples_per_s": mfast["samples_per_s"],
        "model_speedup": mfast["samples_per_s"] / msync["samples_per_s"],
        "model_sync_efficiency": msync["efficiency"],
        "model_async_efficiency": mfast["efficiency"],
        "model_fast_worker_idle_max": _fast_idle(mfast["idle"], w.speeds),
        "model_sync_fast_worker_idle_max": _fast_idle(msync["idle"], w.speeds),
        "model_staleness_p50": mfast["staleness_p50"],
        "model_staleness_p99": mfast["staleness_p99"],
        "model_staleness_max": mfast["staleness_max"],
        "model_waste_fraction": mfast["waste_fraction"],
        "measured": measured,
        "model": model,
    }


def measure(
    rows: list[tuple[float, bool]], *, warmup: int = 5, steps: int = 30, profile_dir: str = ""
) -> dict[str, Any]:
    """Every row, in order; ``{"rows": [...]}``."""
    return {
        "rows": [
            run_row(workload(sigma, slow, warmup=warmup, steps=steps), profile_dir)
            for sigma, slow in rows
        ]
    }


# -- the report --------------------------------------------------------------------------------

TARGETS = (
    # (what, row key, bound, True: an upper bound)
    ("async efficiency", "async_efficiency", 0.9, False),
    ("fast-replica idle, async", "fast_worker_idle_max", 0.05, True),
    ("measured / model, async", "async_model_ratio", 0.9, False),
    ("measured / model, sync", "sync_model_ratio", 0.9, False),
)
"""The targets, at sigma 1.0 with the slow replica (``TARGET_ROW``)."""


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _row_lines(row: dict[str, Any]) -> list[str]:
    speeds = tuple(row["speeds"])
    columns = [row["measured"]["async"], row["model"]["async"]]
    columns += [row["measured"]["sync"], row["model"]["sync"]]

    def each(name: str, cell: Callable[[dict[str, Any]], str]) -> str:
        return f"{name:<30}" + "".join(f"{cell(c):>10}" for c in columns)

    def measured(name: str, in_async: str, in_sync: str) -> str:
        return f"{name:<30}{in_async:>10}{'':>10}{in_sync:>10}"

    cpu = [_pct(row["measured"][m]["driver_cpu_fraction"]) for m in ("async", "sync")]
    return [
        f"sigma {row['sigma']}, speeds ({', '.join('1/3' if v < 1 else '1' for v in speeds)})",
        f"{'':<30}{'async':>10}{'model':>10}{'sync':>10}{'model':>10}",
        each("samples per second", lambda r: f"{r['samples_per_s']:.0f}"),
        each("efficiency (work / capacity)", lambda r: f"{r['efficiency']:.3f}"),
        each("fast-replica idle, max", lambda r: _pct(_fast_idle(r["idle"], speeds))),
        measured(
            "measured / model (work/s)",
            f"{row['async_model_ratio']:.3f}",
            f"{row['sync_model_ratio']:.3f}",
        ),
        each(
            "staleness p50/p99/max",
            lambda r: f"{r['staleness_p50']}/{r['staleness_p99']}/{r['staleness_max']}",
        ),
        each("waste", lambda r: _pct(r["waste_fraction"])),
        each(
            "mean ms consumed/dispatched",
            lambda r: f"{r['mean_consumed_s'] * 1e3:.0f}/{r['mean_dispatched_s'] * 1e3:.0f}",
        ),
        measured("driver CPU (share of a core)", *cpu),
        f"speedup async / sync: {row['speedup']:.2f}x (model {row['model_speedup']:.2f}x)",
        "",
    ]


def format_table(figures: dict[str, Any]) -> str:
    """The figures of ``measure`` as a readable table, each next to its baselines."""
    rows = figures["rows"]
    first = rows[0]
    w = workload(first["sigma"], first["slow_replica"])
    lines = [
        "asyncrl pipeline benchmark: real processes and runtime, simulated generation",
        f"{len(w.speeds)} replicas x {w.slots} slots, groups of {w.group}, batches of {w.batch}, "
        f"lognormal samples of mean {w.mean_s * 1e3:.0f} ms, learner step "
        f"{w.learner_factor} x ideal batch time, eta {first['eta']}, over_eta "
        f"{first['over_eta']}, straggler {first['straggler_policy']}; {first['warmup']} warm-up "
        f"+ {first['steps']} measured steps. Model: pipeline_model on the same draws.",
        "",
    ]
    for row in rows:
        lines += _row_lines(row)
    target = [r for r in rows if (r["sigma"], r["slow_replica"]) == TARGET_ROW]
    if not target:
        lines.append("The targets apply at sigma 1.0 with the slow replica, not run here.")
        return "\n".join(lines)
    lines.append("Targets at sigma 1.0 with the slow replica:")
    for name, key, bound, upper in TARGETS:
        value = target[0][key]
        met = value <= bound if upper else value >= bound
        goal = f"{'<=' if upper else '>='} {bound}"
        lines.append(f"  {name:<28}{value:>8.3f}   {goal:<8}{'met' if met else 'MISSED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="asyncrl bench pipeline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help='print one JSON object {"rows": [...]}')
    parser.add_argument(
        "--quick", action="store_true", help="1 warm-up + 3 measured steps, two rows (for tests)"
    )
    parser.add_argument(
        "--sigma", type=float, action="append", help="only rows with this sigma (repeatable)"
    )
    parser.add_argument(
        "--speeds",
        choices=("slow", "equal"),
        help="only rows with (slow) or without a slow replica",
    )
    parser.add_argument("--warmup", type=int, help="warm-up steps (default 5; 1 with --quick)")
    parser.add_argument("--steps", type=int, help="measured steps (default 30; 3 with --quick)")
    parser.add_argument(
        "--profile", metavar="DIR", default="", help="write a cProfile of each run's driver to DIR"
    )
    args = parser.parse_args(argv)
    rows = list(QUICK_ROWS if args.quick else ROWS)
    if args.sigma:
        rows = [r for r in rows if r[0] in args.sigma]
    if args.speeds:
        rows = [r for r in rows if r[1] == (args.speeds == "slow")]
    if not rows:
        parser.error("no row matches --sigma and --speeds")
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    steps = args.steps if args.steps is not None else (3 if args.quick else 30)
    if warmup < 0 or steps < 1:
        parser.error(f"--warmup must be >= 0 and --steps >= 1, got {warmup} and {steps}")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    figures = measure(rows, warmup=warmup, steps=steps, profile_dir=args.profile)
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0
