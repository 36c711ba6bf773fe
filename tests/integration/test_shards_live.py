"""Dispatch shards as real supervised processes: a shard is SIGKILLed holding groups mid-run.

Two ``DispatchShard`` processes own two rollout replicas each; the driver's ``ShardedPipeline``
grants them the groups. Shard 0 kills itself with SIGKILL while it holds groups; the supervisor
restarts it, the driver grants those groups again, and the run's accounting shows nothing lost,
nothing consumed twice, and every learner step taken once, in order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

STEPS = 20
G = 4
B = 8

MANIFEST = f"""\
run:
  name: shards
  program: tests.integration.shards:program
  config: {{steps: {STEPS}, group_size: {G}, batch_size: {B}, kill_after: 3}}
roles:
  rollout:
    class: tests.integration.straggler:TimedRollout
    replicas: 4
    capacity: 2
    config: {{duration_s: 0.02}}
  shard:
    class: tests.integration.shards:KillableShard
    replicas: 2
    capacity: 64
    config: {{score: "tests.integration.shards:score", kill_replica: 0}}
    supervision: {{backoff_initial_s: 0.05}}
pipeline:
  mode: async
  eta: 2
"""


def test_a_shard_killed_mid_run_loses_and_repeats_nothing(run_dir: str) -> None:
    path = os.path.join(run_dir, "m.yaml")
    with open(path, "w") as f:
        f.write(MANIFEST)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "run",
            path,
            "--run-dir",
            run_dir,
            "--allow-nonempty",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(os.path.join(run_dir, "driver.json")) as f:
        result = json.load(f)["result"]
    with open(os.path.join(run_dir, "report.json")) as f:
        report = json.load(f)
    metrics = result["metrics"]
    keys = result["keys"]
    # The shard died holding groups, was restarted, and its groups were granted again.
    assert report["restarts"]["shard"] == 1
    assert metrics["groups_regranted"] >= 2
    # Every release that reached the driver, stale ones included: one per group, none of them
    # refused (the killed incarnation's groups were never released by it).
    releases = {int(i): n for i, n in result["releases"].items()}
    assert set(releases.values()) == {1}
    assert result["refused"] == 0
    # Nothing consumed twice.
    assert len(keys) == STEPS * B
    assert not [k for k, n in Counter(keys).items() if n > 1]
    # Every group consumed is whole, and nothing admitted went missing.
    groups = Counter(k.split()[0] for k in keys)
    assert set(groups.values()) == {G}
    assert metrics["admitted_samples"] == metrics["consumed_samples"] + result["in_flight"]
    assert metrics.get("wasted_samples", 0) == 0
    # Every prompt admitted is consumed or still in flight at the end: none lost.
    consumed = [int(p[1:]) for p in groups]
    assert sorted(consumed + result["unsettled"]) == list(range(metrics["admitted_groups"]))
    assert set(consumed) <= set(releases)  # each consumed group was released to the driver
    # Each batch's cursor (where a resumed run starts) never goes back, and the last is the
    # first prompt not yet consumed.
    cursors = result["cursors"]
    assert cursors == sorted(cursors)
    assert cursors[-1] == min(result["unsettled"], default=metrics["admitted_groups"])
    # η held across the death: never more admitted than eta + 1 batches past the version.
    assert result["pacer_max_ahead"] <= 0
