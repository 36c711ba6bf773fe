"""An environment replica of three that fails every episode (every step, and one reset in two)
in a real run of the agent example (processes and sockets): the quarantine takes it out and its
supervisor restarts it on the program's request (a fresh process: its pid changes, and the
agent's log says why), the healthy replicas carry the work, and the run completes with no
episode lost and none of the failed ones trained on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from asyncrl.chaos.accounting import run_figures
from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MANIFEST = "examples/agent/bc_grpo.yaml"
RL_STEPS = 6
SETTINGS = [
    "roles.env.class=tests.agents.failing_env:FailingResetsAndSteps",
    "roles.env.replicas=3",
    "run.config.step_timeout_s=0.5",
    "run.config.demos=64",
    "run.config.bc_steps=1",
    "run.config.bc_batch=16",
    f"run.config.rl_steps={RL_STEPS}",
    "run.config.eval_games=6",
    "run.config.rl_eval_every=100",
    "run.config.quarantine_window=4",
    "run.config.probe_after_s=3",
]


def _lines(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_a_quarantined_replica_is_restarted_by_its_supervisor_and_the_others_carry_the_run(
    run_dir: str,
) -> None:
    sets = [a for o in SETTINGS for a in ("--set", o)]
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", MANIFEST, "--run-dir", run_dir, *sets],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    figures = run_figures(run_dir)
    assert figures["status"] == "completed"
    assert (figures["episodes_lost"], figures["episodes_counted_twice"]) == (0, 0)
    assert (figures["infra_failed_trained"], figures["env_tokens_trained"]) == (0, 0.0)
    assert figures["infra_failed"] > 0 and figures["env_errors"] > 0
    assert figures["quarantined"] >= 1 and figures["quarantine_restarts"] >= 1
    with open(os.path.join(run_dir, "summary.json")) as f:
        pipe = json.load(f)["pipeline"]
    assert pipe["infra_failed"] == pipe["infra_replaced"] + pipe.get("groups_infra_dropped", 0)
    learner = [m["learner"] for m in _lines(f"{run_dir}/metrics.jsonl") if "learner" in m]
    assert [m["infra_failed_trained"] for m in learner if "infra_failed_trained" in m] == [
        0.0
    ] * RL_STEPS
    # The supervisor restarted env[1] when asked, saying why, each time as a fresh process.
    agent = _lines(os.path.join(run_dir, "logs", "agent.jsonl"))
    asked = [e for e in agent if e["event"] == "restarting on request"]
    assert asked and {e["process"] for e in asked} == {"env[1]"}
    assert asked[0]["reason"] == (
        "quarantined: it failed 4 of its last 4 steps (1 quarantine in a row)"
    )
    assert all(e["reason"].startswith("quarantined: it failed ") for e in asked)
    started = {
        e["incarnation"]: e["pid"]
        for e in agent
        if e["event"] == "started" and e["process"] == "env[1]"
    }
    assert len(started) == len(asked) + 1  # no restart of env[1] but those asked for
    assert len(set(started.values())) == len(started)  # each a fresh process
    with open(os.path.join(run_dir, "report.json")) as f:
        assert json.load(f)["exits"] == []  # no crash: every restart was asked for
    # The healthy replicas carried the work.
    with open(os.path.join(run_dir, "driver.json")) as f:
        served = json.load(f)["dispatch"]["env"]["served"]
    assert served["1"] * 3 < min(served["0"], served["2"]), served
