"""What ``asyncrl run`` shows on the console: a shortened main job, quiet by default (progress,
warnings and the summary table) and with every log line under ``-v``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # two short runs, about 25 s each

SHORT = [
    "run.config.bc_max_steps=20",
    "run.config.bc_eval_every=10",
    "run.config.rl_steps=12",
    "run.config.rl_eval_every=12",
    "run.config.prompts_per_step=4",
    "run.config.group_size=4",
    "roles.learner.config.checkpoint_every=2",
]


def run_job(run_dir: str, *args: str) -> str:
    """The console output (stdout and stderr) of the shortened main job in ``run_dir``."""
    env = {k: v for k, v in os.environ.items() if k != "ASYNCRL_VERBOSE"}
    sets = [a for o in SHORT for a in ("--set", o)]
    command = [sys.executable, "-m", "asyncrl.cli", "run", "examples/arith/bc_grpo.yaml"]
    out = subprocess.run(
        [*command, "--run-dir", run_dir, *sets, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def table_rows(run_dir: str) -> list[str]:
    """The rows the summary table must hold, from the run's own summary.json and report."""
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    before, after = summary["accuracy_before_rl"], summary["accuracy_final"]
    pipeline = summary["pipeline"]
    generated, wasted = pipeline["generated_samples"], pipeline["wasted_samples"]
    with open(os.path.join(run_dir, "report.json")) as f:
        restarted = {k: n for k, n in json.load(f)["restarts"].items() if n}
    parts = ", ".join(f"{role} {n}" for role, n in restarted.items())
    return [
        "run summary",
        "  status     completed",
        f"  accuracy   {before:.3f} before RL, {after:.3f} after ({after - before:+.3f})",
        f"  samples    {summary['samples_consumed']:,} trained on, {generated:,} generated "
        f"({wasted / generated:.1%} wasted)",
        f"  restarts   {sum(restarted.values())}" + (f" ({parts})" if parts else ""),
    ]


def test_the_console_shows_progress_and_the_summary_and_v_brings_the_rest_back(
    tmp_path: pytest.TempPathFactory,
) -> None:
    quiet_dir = os.path.join(str(tmp_path), "quiet")
    quiet = run_job(quiet_dir)
    lines = quiet.splitlines()
    assert not [line for line in lines if "checkpoint of step" in line]
    assert not [line for line in lines if "[info" in line or "[debug" in line]
    # No supervisor's starts and serving; a warning (a slow stop on a loaded machine) may show.
    assert not [
        line for line in lines if "[asyncrl.supervision." in line and "[warning" not in line
    ]
    assert "BC plateau: held-out accuracy" in quiet
    assert "GRPO 12/12" in quiet
    for row in table_rows(quiet_dir):
        assert row in lines, (row, quiet)
    assert any(line.startswith("  wall       ") for line in lines)
    # Everything left off the console is in the run's logs.
    with open(os.path.join(quiet_dir, "logs", "learner.0.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert any("checkpoint of step 2 complete" in e["event"] for e in logged)
    assert any(e["event"] == "started" for e in logged)

    verbose_dir = os.path.join(str(tmp_path), "verbose")
    verbose = run_job(verbose_dir, "-v")
    lines = verbose.splitlines()
    assert [line for line in lines if "learner.0: checkpoint of step 2 complete" in line]
    for role in ("prompts", "rollout", "reward", "learner", "driver"):
        started = [
            line
            for line in lines
            if "started" in line
            and "[asyncrl.supervision.supervisor]" in line
            and f"process={role}[0]" in line
            and "incarnation=0" in line
        ]
        assert len(started) == 1, (role, verbose)
    for row in table_rows(verbose_dir):
        assert row in lines, (row, verbose)
