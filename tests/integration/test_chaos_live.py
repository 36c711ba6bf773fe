"""``asyncrl chaos`` on the arithmetic example, shortened: stateless roles are killed and frozen
while it runs, and the accounting must show a completed run that lost and repeated nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # two whole runs, about 100 s idle

SHORT = [
    "roles.rollout.replicas=2",
    "run.config.bc_max_steps=10",
    "run.config.bc_eval_every=10",
    "run.config.rl_steps=12",
    "run.config.rl_eval_every=12",
    "run.config.prompts_per_step=4",
    "run.config.group_size=4",
]


def test_chaos_kills_stateless_roles_and_accounts_for_them(run_dir: str) -> None:
    sets = [a for o in SHORT for a in ("--set", o)]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "chaos",
            "examples/arith/bc_grpo.yaml",
            "--run-dir",
            run_dir,
            "--roles",
            "rollout,reward",
            "--kill-every",
            "4s",
            "--stop-every",
            "5s",
            "--stop-for",
            "300ms",
            "--seed",
            "1",
            "--json",
            *sets,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    acc = json.loads(out.stdout)  # stdout is the one JSON object; the runs talk on stderr
    with open(os.path.join(run_dir, "accounting.json")) as f:
        assert json.load(f) == acc
    assert "  rollout: 32 restarts in 60 s, backoff 0.05 s doubling to 1 s" in out.stderr

    assert acc["completed"] is True
    assert acc["undisturbed"]["completed"] is True
    kills = acc["kills"]
    assert kills["total"] >= 1
    assert set(kills) - {"total"} <= {"rollout", "reward"}
    assert sum(v for k, v in kills.items() if k != "total") == kills["total"]
    assert acc["stops"]["total"] >= 1
    # every failure the supervisor saw was one we caused, and each was restarted and timed
    restarts = acc["restarts"]
    assert restarts["learner"] == restarts["prompts"] == restarts["driver"] == 0
    restarted = restarts["rollout"] + restarts["reward"]
    assert 1 <= restarted <= kills["total"] + acc["stops"]["total"]
    # each restart served again, but one the run's end caught (a kill in its last moments)
    assert acc["unrecovered"] == 0
    assert acc["recoveries"] <= restarted <= acc["recoveries"] + acc["restarting_at_end"]
    assert acc["restarting_at_end"] <= 3  # the two rollout replicas and the reward
    assert 0 < acc["recover_ms_p50"] <= acc["recover_ms_p99"] <= acc["recover_ms_max"]
    assert set(acc["recover_ms_by_role"]) <= {"rollout", "reward"}

    # nothing lost, nothing counted twice, and the two counts of consumed samples agree
    assert acc["samples_lost"] == 0
    assert acc["duplicates_consumed"] == 0
    assert acc["steps_repeated"] == 0
    assert acc["steps_skipped"] == 0
    assert acc["samples_consumed"] == 12 * 4 * 4
    assert acc["samples_consumed_ledger"] == acc["samples_consumed"]
    assert acc["consistent"] is True
    assert acc["learner_steps"] == acc["undisturbed"]["learner_steps"]
    assert acc["undisturbed"]["samples_lost"] == 0
    for key in ("accuracy_undisturbed", "accuracy_chaos", "slowdown", "wall_s_chaos"):
        assert isinstance(acc[key], float), key
    assert acc["dispatch"]["rollout"]["served"] > 0


def test_chaos_aimed_at_the_rl_phase_kills_nothing_before_it(run_dir: str) -> None:
    """``--from-phase rl --after 1s``: the schedule starts a second after the program's first
    RL entry, so every kill comes after BC ended (on the run's clock, which starts after the
    chaos clock), and the accounting says so."""
    sets = [a for o in SHORT for a in ("--set", o)]
    sets += ["--set", "run.config.rl_steps=40"]  # the last --set wins
    command = [sys.executable, "-m", "asyncrl.cli", "chaos", "examples/arith/bc_grpo.yaml"]
    chaos_args = ["--roles", "rollout", "--kill-every", "1s", "--seed", "1", "--no-baseline"]
    aim = ["--from-phase", "rl", "--after", "1s", "--json"]
    out = subprocess.run(
        [*command, *chaos_args, *aim, "--run-dir", run_dir, *sets],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    acc = json.loads(out.stdout)
    assert "from the start of phase rl, 1 s after it" in out.stderr
    (began,) = re.findall(r"chaos: phase rl began at ([0-9.]+) s", out.stderr)
    with open(os.path.join(run_dir, "chaos", "chaos.json")) as f:
        chaos = json.load(f)
    with open(os.path.join(run_dir, "chaos", "summary.json")) as f:
        bc_ended = json.load(f)["phases"]["bc"]["ended_s"]
    assert (acc["from_phase"], acc["after_s"]) == ("rl", 1.0)
    assert acc["disrupted_from_s"] == chaos["aimed_at_s"] >= float(began) + 0.9  # began: .1f
    assert float(began) >= bc_ended
    assert acc["kills"]["total"] >= 1
    # the first kill a period (1 s, on the event loop's clock) after the aim
    assert min(k["t"] for k in chaos["kills"]) >= chaos["aimed_at_s"] + 0.99
    assert acc["completed"] is True
    assert acc["samples_lost"] == acc["duplicates_consumed"] == acc["steps_repeated"] == 0
