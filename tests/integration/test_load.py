"""The main job on a machine it shares with four CPU burners: busy processes, none killed.

On the project's 2-core machine the burners alone make a load of 4 and, with the run's own
processes (five roles, the driver, the agent and its zygote), about 8: every process of the run
waits for a core, its event loop stalls, and none of it is a hang. The run must finish with no
restart at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BURNERS = 4
BURN_S = 840  # a burner ends by itself after this long, should the test be killed first
SHORT = [
    "run.config.bc_max_steps=150",
    "run.config.bc_eval_every=50",
    "run.config.rl_steps=50",
    "run.config.rl_eval_every=25",
]
BURN = f"import time\nend = time.monotonic() + {BURN_S}\nwhile time.monotonic() < end:\n    pass\n"


@pytest.fixture
def burners() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(BURNERS)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def test_the_main_job_beside_four_cpu_burners_has_no_restart(
    run_dir: str, burners: list[subprocess.Popen[bytes]]
) -> None:
    sets = [a for o in SHORT for a in ("--set", o)]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "run",
            "examples/arith/bc_grpo.yaml",
            "--run-dir",
            run_dir,
            *sets,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert all(proc.poll() is None for proc in burners), "a burner ended before the run"
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "report.json")) as f:
        report = json.load(f)
    assert summary["learner_steps"] == 150 + 50
    roles = {"prompts", "rollout", "reward", "learner", "driver"}
    assert report["restarts"] == dict.fromkeys(roles, 0)
    assert report["exits"] == []
    assert not [line for line in out.stdout.splitlines() if "hung" in line]
    assert summary["restarts"] == 0
