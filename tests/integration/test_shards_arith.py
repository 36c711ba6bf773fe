"""The main job (examples/arith/bc_grpo.yaml), shortened, with ``pipeline.shards: 2`` and its
prompt schedule as shipped (probes of one sample, uniform skips): the built-in program grants
its groups to two dispatch shard processes, which generate them on their own rollout replicas
and score them with the reward role; each group's probe first, then, unless the driver drops
the group after it, the rest. Each shard is SIGKILLed once, after its 12th answer, with the
grant worked and its answer not yet sent (the fault plan's ``kill_before_reply``), and whatever
else it held in hand; the supervisor restarts it and the driver grants its groups again. The
run completes with nothing lost, nothing consumed twice and no step repeated; the driver took a
release for every probe and every rest of a group consumed or dropped, and no more than its
grants could answer.
"""

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

RL_STEPS = 8
PROMPTS = 8
G = 8
BC_STEPS = 100
SHORT = [
    f"run.config.bc_max_steps={BC_STEPS}",
    f"run.config.bc_eval_every={BC_STEPS}",
    f"run.config.rl_steps={RL_STEPS}",
    f"run.config.rl_eval_every={RL_STEPS}",
    f"run.config.prompts_per_step={PROMPTS}",
    "roles.rollout.replicas=2",
    "pipeline.shards=2",
]
# Every shard dies once, in its first incarnation, after its 12th group worked.
SHARDS = """\
  shards:
    env:
      ASYNCRL_FAULTS: '{"kill_before_reply": {"method": "run_group", "every": 12}}'
    supervision: {backoff_initial_s: 0.05}

"""


def _manifest(folder: str) -> str:
    """examples/arith/bc_grpo.yaml with the shards' role given a fault plan, in ``folder``."""
    with open(os.path.join(ROOT, "examples/arith/bc_grpo.yaml")) as f:
        text = f.read()
    anchor = "# How samples flow to the learner."
    assert anchor in text
    path = os.path.join(folder, "sharded.yaml")
    with open(path, "w") as f:
        f.write(text.replace(anchor, SHARDS + anchor))
    return path


def _json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def test_the_main_job_over_two_shards_each_killed_once_loses_and_repeats_nothing(
    run_dir: str, tmp_path: Any
) -> None:
    manifest = _manifest(str(tmp_path))
    args = ["run", manifest, "--run-dir", run_dir, *(a for o in SHORT for a in ("--set", o))]
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = _json(os.path.join(run_dir, "summary.json"))
    assert summary["learner_steps"] == BC_STEPS + RL_STEPS
    assert summary["samples_consumed"] == RL_STEPS * PROMPTS * G
    figures = run_figures(run_dir)
    assert figures["completed"] is True, figures
    assert (
        figures["samples_lost"],
        figures["duplicate_consumptions"],
        figures["steps_repeated"],
    ) == (0, 0, 0), figures
    assert figures["restarts"]["shards"] == 2, figures["restarts"]
    pipeline = summary["pipeline"]
    # Each shard died holding at least the group it had just worked: granted again.
    assert pipeline["groups_regranted"] >= 2, pipeline
    assert pipeline["scored_tokens"] > 0, pipeline  # the shards scored every sample
    # Every group was probed first: one release for its probe, and one for its rest unless
    # the probe dropped it. A release reached the driver for every probe and rest of a group
    # consumed or dropped, and no more than the grants (a group may still be in its shard at
    # the end); the driver dispatched no sample itself (its rollout calls are the held-out
    # evaluations').
    admitted = pipeline["admitted_groups"]
    probe_dropped = pipeline.get("groups_probe_dropped", 0)
    assert pipeline["probed_groups"] == admitted, pipeline
    dispatch = _json(os.path.join(run_dir, "driver.json"))["dispatch"]
    released = sum(dispatch["shards"]["served"].values())
    whole = pipeline["consumed_samples"] // G + pipeline.get("groups_uniform_dropped", 0)
    settled = 2 * (whole - probe_dropped) + probe_dropped
    assert settled <= released <= 2 * admitted - probe_dropped, (dispatch, pipeline)
    assert dispatch["rollout"]["calls"] < admitted, dispatch
    # A group dropped after its probe of one sample never admitted its other seven.
    assert pipeline["admitted_samples"] == admitted * G - (G - 1) * probe_dropped, pipeline
    # Every admitted sample was consumed, wasted (dynamic sampling) or still in flight at the end.
    ends = ("consumed_samples", "wasted_samples", "in_flight_at_end")
    assert sum(pipeline[k] for k in ends) == pipeline["admitted_samples"], pipeline
    print("pipeline:", json.dumps(pipeline, sort_keys=True))
