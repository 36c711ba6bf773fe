"""``asyncrl chaos --nodes``, live: examples/arith/multinode3.yaml shortened, launched as three
torchrun nodes on this machine, node 2 lost whole once RL has begun and started again; the
accounting says nothing was lost, consumed twice or repeated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BC_STEPS = 20
RL_STEPS = 200
"""Long enough for node 2 to be lost, marked, started again and serving before RL ends: RL
slows with the machine's load, and so does the node's return."""
SHORT = [
    f"run.config.bc_max_steps={BC_STEPS}",
    f"run.config.bc_eval_every={BC_STEPS}",
    f"run.config.rl_steps={RL_STEPS}",
    f"run.config.rl_eval_every={RL_STEPS}",
    "run.config.prompts_per_step=8",
]


def test_node_2_lost_and_back_costs_nothing_acknowledged(tmp_path: Any) -> None:
    run_dir = os.path.join(tmp_path, "run")
    command = [
        sys.executable,
        "-m",
        "asyncrl.cli",
        "chaos",
        "examples/arith/multinode3.yaml",
        "--nodes",
        "3",
        "--kill-node",
        "2",
        "--every",
        "5s",
        "--rejoin-after",
        "2s",
        "--losses",
        "1",
        "--agent-liveness",
        "4s",
        "--join-timeout",
        "90s",
        "--from-phase",
        "rl",
        "--no-baseline",
        "--json",
        "--run-dir",
        run_dir,
        *(a for o in SHORT for a in ("--set", o)),
    ]
    out = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=540,
    )
    logs = _logs(run_dir)
    assert out.returncode == 0, out.stderr[-5000:] + logs
    acc = json.loads(out.stdout)
    assert (acc["completed"], acc["status"], acc["exit_codes"]) == (
        True,
        "completed",
        {"0": 0, "1": 0, "2": 0},
    ), out.stderr + logs
    figures = (
        acc["samples_lost"],
        acc["duplicates_consumed"],
        acc["steps_repeated"],
        acc["steps_skipped"],
        acc["consistent"],
        acc["learner_steps"],
    )
    assert figures == (0, 0, 0, 0, True, BC_STEPS + RL_STEPS), acc
    assert (acc["node_losses"], acc["node_losses_unmarked"], acc["node_rejoins"]) == (1, 0, 1)
    (to_step,) = acc["node_loss_to_step_s"]
    (to_serving,) = acc["rejoin_to_serving_s"]
    assert acc["node_loss_to_step_s_p50"] == to_step > 0
    assert acc["rejoin_to_serving_s_p50"] == to_serving > 0
    assert acc["accuracy_chaos"] is not None
    with open(os.path.join(run_dir, "chaos", "membership.json")) as f:
        seen = json.load(f)
    assert [(c["event"], c["node"]) for c in seen["changes"]] == [
        ("node_lost", 2),
        ("node_back", 2),
    ]
    assert seen["moved"]["reward"]["0"]["node"] == 0  # it stays where it moved
    err = out.stderr
    assert "chaos: 3 nodes; node 2 lost every 5 s from the start of phase rl, started again" in err
    assert "chaos: node 2 lost (SIGKILL of " in err
    assert "chaos: node 2's replicas (relay2[0], rollout[2]) serve the driver again at " in err
    print(
        f"node 2: loss to the next step {to_step:.1f} s, torchrun started again to serving "
        f"{to_serving:.1f} s; chaos launch {acc['wall_s_chaos']:.1f} s"
    )


def _logs(run_dir: str) -> str:
    folder = os.path.join(run_dir, "logs")
    text = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        with open(os.path.join(folder, name), errors="replace") as f:
            text.append(f"--- {name} ---\n" + f.read()[-4000:])
    return "\n".join(text)
