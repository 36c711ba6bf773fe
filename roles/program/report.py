"""What a ``Run`` leaves when it finishes: ``summary.json``, ``progress.png`` and ``plots/``.

``summary.json`` holds what the program passed to ``Run.finish`` and, for every run:
``phases`` (each ended phase's ``start`` and ``end`` learner step, ``started_s`` and
``ended_s``, the run's clock when it began and ended, ``wall_s``, its length, and the values
its ``end_phase`` kept), ``wall_s``, ``learner_steps``, ``samples_consumed`` and
``samples_per_s`` (of the last phase that ran the RL loop, over its wall time), ``restarts``,
``driver_incarnation``, ``mode``, ``staleness_max``, ``pipeline`` (the sample pipeline's
counters at the end of that phase, with ``scored_samples`` and ``in_flight_at_end`` even at 0),
``final`` (the exported policy) and ``config``.

``progress.png`` draws the history: each phase's ``accuracy`` (points) and ``reward`` (a line)
over learner steps, a dotted line where a phase begins. ``plots/`` holds the figures of
``asyncrl plot RUN_DIR`` (``asyncrl.observe.plots``). Both need matplotlib (the ``examples``
extra); without it the run says so and writes neither.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

from asyncrl.observe.metrics import Restarts
from asyncrl.roles.payloads import LearnerStatus
from asyncrl.safe_files import write_atomic

if TYPE_CHECKING:
    from asyncrl.roles.program.run import Run

__all__ = ["PROGRESS_FILE", "SUMMARY_FILE", "plot_progress", "summarize"]

SUMMARY_FILE = "summary.json"
PROGRESS_FILE = "progress.png"


def summarize(run: Run, status: LearnerStatus, final: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Write ``summary.json`` and the figures of ``run``; return the summary."""
    rl = run.rl
    phases = {name: run.values(name) for name in run.phases if name in run.ended}
    looped = [
        name for name in run.phases if run.loops.get(name) or "pipeline" in phases.get(name, {})
    ]
    pipeline: dict[str, Any] = {}
    phase_wall = run.wall()
    if looped:
        name = looped[-1]
        loop = run.loops.get(name) or {}
        pipeline = loop.get("pipeline") or phases.get(name, {}).get("pipeline", {})
        ended = phases.get(name)
        phase_wall = float(ended["wall_s"]) if ended else run.wall() - run.phase_started_s()
    for values in phases.values():
        values.pop("pipeline", None)
    consumed = int(pipeline.get("consumed_samples", 0))
    staleness = [e.get("staleness_max") or 0 for e in run.history.entries]
    summary = {
        **extra,
        "phases": phases,
        "wall_s": run.wall(),
        "learner_steps": status.step,
        "samples_consumed": consumed,
        "samples_per_s": consumed / max(phase_wall, 1e-9),
        "restarts": Restarts(rl.run_dir)(),
        "driver_incarnation": rl.incarnation,
        "mode": rl.pipeline.mode,
        "staleness_max": max(staleness, default=0),
        "pipeline": pipeline,
        "final": final,
        "config": rl.config,
    }
    path = os.path.join(rl.run_dir, SUMMARY_FILE)
    write_atomic(path, json.dumps(summary, indent=2).encode())
    plot_progress(run)
    return summary


def plot_progress(run: Run) -> list[str]:
    """Write ``progress.png`` and ``plots/`` of ``run``; return their paths (none without
    matplotlib, which is then named with how to install it)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(
            f"matplotlib is not installed, so {PROGRESS_FILE} and plots/ are not written; "
            "install it with: pip install 'asyncrl[examples]'",
            file=sys.stderr,
            flush=True,
        )
        return []
    figure = Figure(figsize=(7, 4))
    ax = figure.add_subplot()
    for name in run.phases:
        start = run.ended.get(name, {}).get("start", run.phase_start)
        entries = run.history.phase(name)
        if not entries:
            continue
        reward = [e for e in entries if e.get("reward") is not None]
        if reward:
            xs = [start + e["step"] for e in reward]
            ax.plot(xs, [e["reward"] for e in reward], "-", alpha=0.6, label=f"{name} reward")
        accuracy = [e for e in entries if e.get("accuracy") is not None]
        if accuracy:
            xs = [start + e["step"] for e in accuracy]
            ys = [e["accuracy"] for e in accuracy]
            ax.plot(xs, ys, "o-", label=f"{name} held-out accuracy")
        if start:
            ax.axvline(start, color="grey", linestyle=":")
    ax.set_xlabel("learner step")
    ax.legend(loc="best")
    figure.tight_layout()
    path = os.path.join(run.rl.run_dir, PROGRESS_FILE)
    figure.savefig(path)
    paths = [path]
    from asyncrl.observe.plots import plot_runs

    try:
        paths += plot_runs([run.rl.run_dir])
    except (OSError, ValueError) as exc:  # no RL step was taken: no metrics.jsonl
        print(f"no plots of the RL steps: {exc}", file=sys.stderr, flush=True)
    return paths
