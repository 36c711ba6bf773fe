"""``asyncrl plot``: PNG figures of the per-step metrics of one run, or of several side by side.

``plot_runs`` reads each run's ``metrics.jsonl`` (``asyncrl.observe.metrics``; the RL loop of
``asyncrl.roles.program.programs`` writes it) and writes, into ``RUN_DIR/plots/`` of the first run
unless told otherwise:

- ``reward.png``: the mean reward, with the band of its 95% interval (``ci95``; the band from
  its p10 to its p90 for runs written before), over steps and over wall time;
- ``accuracy.png``: held-out accuracy over steps and over wall time (when some run evaluated);
- ``throughput.png``: samples per second, and tokens generated and trained per second;
- ``staleness.png``: staleness p50, p99 and max, in versions;
- ``time.png``: the seconds of each step spent waiting for the batch, in the learner's step and
  moving weights, and the learner's idle share.

Each run has its colour, named in every legend by its directory and its pipeline mode
(``arith (sync)``), so that sync and async runs of one job compare on one figure. A noisy
series is drawn faint, with its running mean over it.

matplotlib is the ``plot`` extra; without it ``plot_runs`` raises ``ModuleNotFoundError`` saying
how to install it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.observe.metrics import METRICS_FILE, read_metrics

__all__ = ["PLOT_INSTALL", "RunMetrics", "load_run", "plot_runs"]

PLOT_INSTALL = "pip install 'asyncrl[plot]'"
"""What installs matplotlib for ``plot_runs``."""
PLOTS_DIR = "plots"
"""Where the figures go, in the first run's directory, by default."""
_DPI = 100
_SMOOTH_POINTS = 30  # a running mean over about n / this many steps


@dataclass
class RunMetrics:
    """One run's records and the name it has in the legends."""

    run_dir: str
    label: str
    records: list[dict[str, Any]]

    def series(self, *path: str, x: str = "step") -> tuple[list[float], list[float]]:
        """``(xs, ys)`` of the number at ``path`` (``"reward", "mean"``) in the records that
        have it, against ``step`` or ``wall_s``."""
        xs, ys = [], []
        for record in self.records:
            value: Any = record
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if isinstance(value, int | float) and record.get(x) is not None:
                xs.append(float(record[x]))
                ys.append(float(value))
        return xs, ys


def load_run(run_dir: str) -> RunMetrics:
    """``run_dir``'s metrics, labelled with its directory name and pipeline mode.

    Raises:
        FileNotFoundError: ``run_dir`` has no ``metrics.jsonl``.
        ValueError: it holds no step yet.
    """
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} does not exist: {run_dir} is not the directory of a run whose program "
            "uses the RL loop (asyncrl.roles.program.programs.rl_loop), or it took no RL step yet"
        )
    records = read_metrics(path)
    if not records:
        raise ValueError(f"{path} holds no step yet")
    name = os.path.basename(os.path.normpath(run_dir))
    mode = _mode(run_dir)
    return RunMetrics(run_dir, f"{name} ({mode})" if mode else name, records)


def _mode(run_dir: str) -> str | None:
    """The pipeline mode of the manifest saved in ``run_dir``, if it says."""
    try:
        with open(os.path.join(run_dir, "manifest.json")) as f:
            mode = json.load(f).get("pipeline", {}).get("mode")
    except (OSError, ValueError, AttributeError):
        return None
    return mode if isinstance(mode, str) else None


def plot_runs(run_dirs: Sequence[str], out: str | None = None) -> list[str]:
    """Write the figures of ``run_dirs`` into ``out`` (default: the first run's ``plots/``);
    return their paths. ``accuracy.png`` is left out when no run evaluated.

    Raises:
        ModuleNotFoundError: matplotlib is not installed (the message says how to install it).
        FileNotFoundError, ValueError: a run directory without metrics (``load_run``).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ModuleNotFoundError(
            f"asyncrl plot needs matplotlib, which is not installed; install it with: "
            f"{PLOT_INSTALL}",
            name="matplotlib",
        ) from exc
    runs = [load_run(d) for d in run_dirs]
    labels = [r.label for r in runs]
    for run in runs:
        if labels.count(run.label) > 1:  # two runs of one name: their paths tell them apart
            run.label = run.run_dir
    out = out if out is not None else os.path.join(run_dirs[0], PLOTS_DIR)
    os.makedirs(out, exist_ok=True)
    written = []
    for name, draw in _FIGURES.items():
        figure = Figure(figsize=(12, 4.5) if name != "time" else (12, 8), dpi=_DPI)
        if draw(figure, runs):
            figure.tight_layout()
            path = os.path.join(out, f"{name}.png")
            figure.savefig(path, dpi=_DPI)
            written.append(path)
    return written


def _smooth(ys: list[float]) -> list[float]:
    """The trailing running mean of ``ys`` over about ``len(ys) / _SMOOTH_POINTS`` values."""
    window = max(1, len(ys) // _SMOOTH_POINTS)
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y - (ys[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _line(ax: Any, xs: list[float], ys: list[float], color: str, label: str) -> None:
    """A noisy series: faint as measured, with its running mean over it."""
    if len(ys) > _SMOOTH_POINTS:
        ax.plot(xs, ys, color=color, alpha=0.3, linewidth=0.8)
        ax.plot(xs, _smooth(ys), color=color, linewidth=1.8, label=label)
    else:
        ax.plot(xs, ys, color=color, linewidth=1.5, marker=".", label=label)


def _panels(
    figure: Any,
    runs: list[RunMetrics],
    panels: list[tuple[str, tuple[str, ...], str]],
    *,
    floor: bool = True,
) -> bool:
    """One panel per ``(title, path, x)``, every run on each, from 0 up when ``floor``; whether
    any run had a number."""
    axes = figure.subplots(1, len(panels)) if len(panels) < 4 else figure.subplots(2, 2).flat
    drawn = False
    for ax, (title, path, x) in zip(axes, panels, strict=True):
        for i, run in enumerate(runs):
            xs, ys = run.series(*path, x=x)
            if ys:
                _line(ax, xs, ys, f"C{i % 10}", run.label)
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("RL step" if x == "step" else "wall time (s)")
        ax.grid(alpha=0.3)
        if floor and ax.lines:
            top = ax.get_ylim()[1]
            ax.set_ylim(-0.03 * top, top)  # from 0, a line at 0 kept clear of the axis
        if ax.lines:
            ax.legend(loc="best", fontsize="small")
    return drawn


def _reward(figure: Any, runs: list[RunMetrics]) -> bool:
    drawn = _panels(
        figure,
        runs,
        [("reward (mean, 95% interval)", ("reward", "mean"), x) for x in ("step", "wall_s")],
        floor=False,
    )
    for ax, x in zip(figure.axes, ("step", "wall_s"), strict=True):
        for i, run in enumerate(runs):
            xs, low, high = _reward_band(run, x)
            if low and len(low) == len(high) == len(xs):
                ax.fill_between(xs, low, high, color=f"C{i % 10}", alpha=0.12, linewidth=0)
    return drawn


def _reward_band(run: RunMetrics, x: str) -> tuple[list[float], list[float], list[float]]:
    """The x values, low and high edges of the reward's band: the mean plus or minus ``ci95``,
    or, for a run written before ``ci95`` was, from its p10 to its p90."""
    xs, half = run.series("reward", "ci95", x=x)
    _, mean = run.series("reward", "mean", x=x)
    if half and len(half) == len(mean):
        pairs = list(zip(mean, half, strict=True))
        return xs, [m - h for m, h in pairs], [m + h for m, h in pairs]
    xs, low = run.series("reward", "p10", x=x)
    _, high = run.series("reward", "p90", x=x)
    return xs, low, high


def _accuracy(figure: Any, runs: list[RunMetrics]) -> bool:
    return _panels(
        figure, runs, [("held-out accuracy", ("accuracy",), x) for x in ("step", "wall_s")]
    )


def _throughput(figure: Any, runs: list[RunMetrics]) -> bool:
    return _panels(
        figure,
        runs,
        [
            ("samples trained per second", ("throughput", "samples_per_s"), "step"),
            ("tokens generated per second", ("throughput", "tokens_generated_per_s"), "step"),
            ("tokens trained per second", ("throughput", "tokens_trained_per_s"), "step"),
        ],
    )


def _staleness(figure: Any, runs: list[RunMetrics]) -> bool:
    return _panels(
        figure,
        runs,
        [(f"staleness {k} (versions)", ("staleness", k), "step") for k in ("p50", "p99", "max")],
    )


def _time(figure: Any, runs: list[RunMetrics]) -> bool:
    return _panels(
        figure,
        runs,
        [
            ("waiting for the batch (s per step)", ("time_s", "batch"), "step"),
            ("learner step (s per step)", ("time_s", "learn"), "step"),
            ("moving weights (s per step)", ("time_s", "weights"), "step"),
            ("learner idle share", ("idle", "learner"), "step"),
        ],
    )


_FIGURES = {
    "reward": _reward,
    "accuracy": _accuracy,
    "throughput": _throughput,
    "staleness": _staleness,
    "time": _time,
}
