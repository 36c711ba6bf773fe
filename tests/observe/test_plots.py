"""asyncrl plot (asyncrl.observe.plots): PNG figures of runs' metrics, several runs on one
figure."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest

from asyncrl.cli import main
from asyncrl.observe.plots import load_run

matplotlib = pytest.importorskip("matplotlib", reason="matplotlib (the plot extra) is missing")

FIGURES = ["reward", "accuracy", "throughput", "staleness", "time"]
BLUE, ORANGE = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's C0 and C1: runs 1 and 2


def make_run(root: Any, name: str, mode: str, *, steps: int = 60, evaluate: bool = True) -> str:
    """A run directory with a saved manifest and ``steps`` records of metrics."""
    run_dir = os.path.join(root, name)
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "manifest.json"), "w") as f:
        json.dump({"run": {"name": name}, "pipeline": {"mode": mode}}, f)
    k = 1.0 if mode == "sync" else 0.5  # every series differs between the two runs
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for step in range(1, steps + 1):
            mean = k * step / steps
            record: dict[str, Any] = {
                "step": step,
                "wall_s": step * 2.0 * k,
                "reward": {"mean": mean, "p10": mean / 2, "p50": mean, "p90": k},
                "staleness": {"p50": 1 - k, "p99": k * (step % 3), "max": 2 * k},
                "throughput": {
                    "samples_per_s": k * (100.0 + step % 7),
                    "tokens_generated_per_s": 400.0 * k,
                    "tokens_trained_per_s": 350.0 * k,
                },
                "time_s": {"step": k, "batch": 0.5 * k, "learn": 0.4 * k, "weights": 0.1 * k},
                "idle": {"learner": 0.6 * k},
                "restarts": 0,
            }
            if evaluate and step % 10 == 0:
                record["accuracy"] = k * step / (steps + 10)
            f.write(json.dumps(record) + "\n")
    return run_dir


def pixels(path: str) -> Any:
    """The image as an array of 8-bit RGB."""
    image = matplotlib.image.imread(path)
    return (image[..., :3] * 255).round().astype(int)


def has_colour(image: Any, rgb: tuple[int, int, int]) -> bool:
    return bool(((abs(image - rgb) <= 2).all(axis=-1)).sum() > 100)


def test_several_runs_are_drawn_on_each_figure(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    sync = make_run(tmp_path, "arith", "sync")
    async_ = make_run(tmp_path / "b", "arith-async", "async")
    out = str(tmp_path / "figures")
    assert main(["plot", sync, async_, "--out", out]) == 0
    written = capsys.readouterr().out.split()
    assert written == [os.path.join(out, f"{name}.png") for name in FIGURES]
    assert sorted(os.listdir(out)) == sorted(f"{name}.png" for name in FIGURES)
    for name in FIGURES:
        image = pixels(os.path.join(out, f"{name}.png"))
        assert image.shape == ((800, 1200, 3) if name == "time" else (450, 1200, 3))
        drawn = (image < 250).any(axis=-1).mean()
        assert drawn > 0.03, f"{name}.png is nearly blank"
        assert has_colour(image, BLUE) and has_colour(image, ORANGE), name
    assert [load_run(d).label for d in (sync, async_)] == ["arith (sync)", "arith-async (async)"]


def test_the_figures_go_to_the_first_runs_plots_folder(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = make_run(tmp_path, "bc", "sync", evaluate=False)
    assert main(["plot", run_dir]) == 0
    # No step evaluated: no accuracy figure.
    assert sorted(os.listdir(os.path.join(run_dir, "plots"))) == sorted(
        f"{name}.png" for name in FIGURES if name != "accuracy"
    )
    image = pixels(os.path.join(run_dir, "plots", "reward.png"))
    assert has_colour(image, BLUE) and not has_colour(image, ORANGE)


def test_a_directory_without_metrics_is_refused(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"asyncrl: error: {os.path.join(tmp_path, 'metrics.jsonl')} does not")
    assert "asyncrl.roles.program.programs.rl_loop" in err


def test_without_matplotlib_the_command_names_the_extra(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = make_run(tmp_path, "arith", "sync")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["plot", run_dir]) == 2
    assert capsys.readouterr().err == (
        "asyncrl: error: asyncrl plot needs matplotlib, which is not installed; install it "
        "with: pip install 'asyncrl[plot]'\n"
    )
    assert not os.path.exists(os.path.join(run_dir, "plots"))


def test_the_reward_band_is_the_95_interval_of_the_mean_or_else_p10_to_p90(tmp_path: Any) -> None:
    from asyncrl.observe.plots import _reward_band

    run = load_run(make_run(tmp_path, "old", "sync", steps=4))
    # Records written before ci95 existed: the band runs from p10 to p90.
    assert _reward_band(run, "step") == ([1.0, 2.0, 3.0, 4.0], [0.125, 0.25, 0.375, 0.5], [1.0] * 4)
    for record in run.records:
        record["reward"]["ci95"] = 0.1
    xs, low, high = _reward_band(run, "wall_s")
    assert xs == [2.0, 4.0, 6.0, 8.0]
    assert low == pytest.approx([0.15, 0.4, 0.65, 0.9])
    assert high == pytest.approx([0.35, 0.6, 0.85, 1.1])
