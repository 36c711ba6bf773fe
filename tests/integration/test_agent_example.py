"""The agent example (examples/agent): a multi-turn guessing game against an environment role.
It learns (BC on scripted games, then GRPO, the held-out success rate up by at least 0.3, at least
three turns an episode), and under ``asyncrl chaos`` killing the environment and the rollout it
loses no episode, counts none twice and trains no environment token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MANIFEST = "examples/agent/bc_grpo.yaml"


def _lines(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_the_agent_learns_the_game(run_dir: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", MANIFEST, "--run-dir", run_dir],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["success_final"] - summary["success_before_rl"] >= 0.3, summary
    assert summary["turns_mean"] >= 3.0
    assert summary["learner_steps"] == 300 + 300
    pipe = summary["pipeline"]
    assert pipe["episodes"] == pipe["generated_samples"] <= pipe["admitted_samples"]
    assert pipe["admitted_samples"] == (
        pipe["consumed_samples"] + pipe["wasted_samples"] + pipe["in_flight_at_end"]
    )
    assert pipe["env_tokens"] > 0 and pipe.get("env_errors", 0) == 0  # counters at 0 left out
    trained = [m["learner"]["env_tokens_trained"] for m in _lines(f"{run_dir}/metrics.jsonl")]
    assert len(trained) == 300 and set(trained) == {0.0}


SHORT = [
    "run.config.demos=400",
    "run.config.bc_steps=20",
    "run.config.rl_steps=40",
    "run.config.eval_games=30",
    "run.config.rl_eval_every=20",
]


def test_chaos_on_the_environment_and_the_rollout_loses_and_repeats_nothing(
    run_dir: str,
) -> None:
    sets = [a for o in SHORT for a in ("--set", o)]
    command = [sys.executable, "-m", "asyncrl.cli", "chaos", MANIFEST, "--run-dir", run_dir]
    command += ["--roles", "env,rollout", "--kill-every", "3s", "--seed", "2", "--json"]
    out = subprocess.run(
        [*command, "--no-baseline", *sets],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    acc = json.loads(out.stdout)
    assert acc["completed"] is True
    assert acc["kills"]["total"] >= 2
    assert acc["restarts"]["env"] + acc["restarts"]["rollout"] >= 2
    assert acc["restarts"]["learner"] == acc["restarts"]["driver"] == 0
    assert acc["episodes_lost"] == 0
    assert acc["episodes_counted_twice"] == 0
    assert acc["env_tokens_trained"] == 0.0
    assert acc["consistent"] is True
    assert acc["env_errors"] == 0
