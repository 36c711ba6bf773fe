"""The reasoning-gym example (examples/reasoning_gym), shortened: it runs, and survives the kill
of its driver in the middle of RL and the kill of the whole run (``--resume``) with every
learner step once, no sample consumed twice, and its history whole."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.helpers.waiting import wait_until
from tests.integration.test_recovery import _driver_pid, finish, start, steps

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        importlib.util.find_spec("reasoning_gym") is None,
        reason="reasoning-gym is not installed (pip install 'asyncrl[examples]')",
    ),
]

STEPS = 16
SHORT = {"steps": STEPS, "prompts_per_step": 4, "group_size": 4, "heldout": 20, "eval_every": 8}
FAST = {"backoff_initial_s": 0.05, "backoff_max_s": 0.5, "max_restarts": 10, "period_s": 60}


def manifest(run_dir: str) -> str:
    import yaml

    with open(os.path.join(ROOT, "examples/reasoning_gym/grpo.yaml")) as f:
        m = yaml.safe_load(f)
    m["run"]["config"].update(SHORT)
    m["driver"] = {"supervision": dict(FAST)}
    path = os.path.join(run_dir, "rg.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(m, f)
    return path


def assert_whole(run_dir: str) -> dict[str, Any]:
    log = steps(run_dir)
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    assert all(r["phase"] == "rl" and len(r["ids"]) == 16 for r in log)
    ids = [tuple(i) for r in log for i in r["ids"]]
    assert len(ids) == len(set(ids)), "a sample was consumed twice"
    with open(os.path.join(run_dir, "history.jsonl")) as f:
        history = [json.loads(line) for line in f]
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert [h["step"] for h in history if "accuracy" in h] == [8, 16]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary: dict[str, Any] = json.load(f)
    assert summary["learner_steps"] == STEPS and summary["samples_consumed"] == STEPS * 16
    assert summary["accuracy_final"] == history[-1]["accuracy"]
    assert summary["phases"] == {}  # the built-in grpo's phase stays open: a resume trains on
    return summary


def test_the_driver_killed_mid_rl_resumes_without_replaying(run_dir: str) -> None:
    proc = start(manifest(run_dir), run_dir)
    try:
        wait_until(lambda: len(steps(run_dir)) >= 5, proc=proc, what="RL step 5", timeout=300)
        os.kill(_driver_pid(run_dir), signal.SIGKILL)
        out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert assert_whole(run_dir)["driver_incarnation"] == 1


def test_a_killed_run_finishes_with_resume(run_dir: str) -> None:
    proc = start(manifest(run_dir), run_dir)
    wait_until(lambda: len(steps(run_dir)) >= 5, proc=proc, what="RL step 5", timeout=300)
    proc.kill()
    proc.communicate()
    resumed = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", "--resume", run_dir],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "ASYNCRL_CONSOLE": "0"},
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert_whole(run_dir)
