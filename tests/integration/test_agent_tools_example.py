"""The tool-calling example (examples/agent_tools): an agent on the official ``openai`` client
calls a calculator tool through the OpenAI-compatible endpoint. It learns (BC on scripted games,
then GRPO: the held-out success rate up by at least 0.3), and under ``asyncrl chaos`` killing
environment replicas, with one replica failing every step (``fail_replica``), the run completes:
the failed episodes are counted and never trained, the failing replica is quarantined, and no
episode is lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import ROOT

pytest.importorskip("openai")
pytest.importorskip("aiohttp")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

MANIFEST = "examples/agent_tools/bc_grpo.yaml"


def _lines(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_the_agent_learns_to_call_the_tool(run_dir: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", MANIFEST, "--run-dir", run_dir],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1440,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    # Held-out success is 100 games sampled at temperature 1, so the rise has a standard error
    # of about 0.065: measured rises 0.29 to 0.45, where a policy that learned nothing rises
    # by 0 (a rise of 0.2 is then three standard errors away).
    assert summary["success_final"] - summary["success_before_rl"] >= 0.2, summary
    # Over the RL phase; about 0.5 after BC. Async GRPO's runs spread: 0.744 in one run.
    assert summary["tool_calls_mean"] >= 0.7
    pipe = summary["pipeline"]
    assert pipe["admitted_samples"] == (
        pipe["consumed_samples"] + pipe["wasted_samples"] + pipe["in_flight_at_end"]
    )
    assert pipe["env_tokens"] > 0 and pipe.get("infra_failed", 0) == 0
    learner = [m["learner"] for m in _lines(f"{run_dir}/metrics.jsonl") if "learner" in m]
    assert {m["env_tokens_trained"] for m in learner} == {0.0}


SHORT = [
    "roles.env.config.fail_replica=0",
    "run.config.demos=600",
    "run.config.bc_steps=150",
    "run.config.rl_steps=30",
    "run.config.eval_games=40",
    "run.config.step_timeout_s=1.0",
]


def test_chaos_with_a_replica_failing_every_step_trains_none_of_its_episodes(
    run_dir: str,
) -> None:
    sets = [a for o in SHORT for a in ("--set", o)]
    command = [sys.executable, "-m", "asyncrl.cli", "chaos", MANIFEST, "--run-dir", run_dir]
    command += ["--roles", "env", "--kill-every", "10s", "--seed", "1", "--json"]
    out = subprocess.run(
        [*command, "--no-baseline", *sets],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1440,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    acc = json.loads(out.stdout)
    assert acc["completed"] is True
    assert acc["kills"]["total"] >= 1
    assert acc["infra_failed"] > 0
    assert acc["infra_failed_trained"] == 0
    assert acc["quarantined"] >= 1
    assert acc["episodes_lost"] == 0 and acc["episodes_counted_twice"] == 0
    assert acc["env_tokens_trained"] == 0
