"""GRPO groups spread over two real rollout replicas, one of them frozen with SIGSTOP mid-run.

Groups that do not depend on the frozen replica are still released and consumed; the groups that
do follow the manifest's straggler policy. The supervisor sees the hang, kills the replica and
restarts it; the dispatcher re-runs its samples elsewhere under the same stable ids, so a sample
is never consumed twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

STEPS = 40
G = 4
B = 8

MANIFEST = """\
run:
  name: straggler
  program: tests.integration.straggler:program
  config: {{steps: {steps}, group_size: {g}, batch_size: {b}}}
roles:
  rollout:
    class: tests.integration.straggler:TimedRollout
    replicas: 2
    capacity: 2
    config: {{duration_s: 0.05, freeze_replica: 1}}
    supervision: {{heartbeat_interval_s: 0.2, liveness: 5, backoff_initial_s: 0.05}}
pipeline:
  mode: async
  eta: 2
  straggler: {straggler}
"""


def _served(run_dir: str, replica: int) -> list[tuple[str, str]]:
    try:
        with open(os.path.join(run_dir, f"served-{replica}.txt")) as f:
            return [(line.split(" ", 1)[0], line.split(" ", 1)[1].strip()) for line in f]
    except FileNotFoundError:
        return []


def run_with_a_frozen_replica(run_dir: str, straggler: str) -> dict:  # type: ignore[type-arg]
    path = os.path.join(run_dir, "m.yaml")
    with open(path, "w") as f:
        f.write(textwrap.dedent(MANIFEST.format(steps=STEPS, g=G, b=B, straggler=straggler)))
    proc = subprocess.Popen(
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
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Once the supervisor hears replica 1 (a stop before that is a slow start, left to the
        # startup timeout), replica 1 stops itself with SIGSTOP at the start of its next sample.
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if all(
                n in line
                for n in ("serving", "[asyncrl.supervision.supervisor]", "process=rollout[1]")
            ):
                break
        else:
            raise AssertionError("the run ended before replica 1 was heard:\n" + "".join(seen))
        with open(os.path.join(run_dir, "freeze"), "w") as f:
            f.write("now")
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    with open(os.path.join(run_dir, "driver.json")) as f:
        result: dict = json.load(f)["result"]  # type: ignore[type-arg]
    with open(os.path.join(run_dir, "report.json")) as f:
        result["report"] = json.load(f)
    return result


def stuck_samples(run_dir: str) -> set[str]:
    """Samples replica 1 started but never finished (it was frozen, then killed)."""
    events = _served(run_dir, 1)
    started = {sid for kind, sid in events if kind == "start"}
    done = {sid for kind, sid in events if kind == "done"}
    return started - done


def check_common(result: dict, run_dir: str) -> None:  # type: ignore[type-arg]
    keys = result["keys"]
    # Every batch was handed out although a replica froze: no barrier waited for it.
    assert len(result["groups"]) >= STEPS * B // G
    # No sample is consumed twice, even those re-run after the replica was killed.
    assert not [k for k, n in Counter(keys).items() if n > 1]
    # The frozen replica really held samples, and was replaced by the supervisor.
    assert stuck_samples(run_dir)
    assert result["report"]["restarts"]["rollout"] >= 1
    # Pacing held across the restart: never more admitted than eta + 1 batches past the version.
    assert result["pacer_max_ahead"] <= 0


def test_emit_releases_a_stuck_group_with_what_arrived(run_dir: str) -> None:
    result = run_with_a_frozen_replica(run_dir, "{policy: emit, deadline_s: 0.4, k_min: 2}")
    check_common(result, run_dir)
    partial = {prompt: n for prompt, n in result["groups"] if n < G}
    assert partial, "a group with a frozen sample should have been emitted partial"
    assert all(n >= 2 for n in partial.values())
    # What a partial group lacks is exactly what never arrived; nothing else was missing.
    consumed = set(result["keys"])
    for prompt in partial:
        missing = {f"{prompt} {k}" for k in range(G)} - consumed
        assert missing and all(m not in consumed for m in missing)
    assert result["metrics"]["groups_partial"] == result["reducer"]["partial"] >= len(partial)
    assert all(n == G for prompt, n in result["groups"] if prompt not in partial)


def test_drop_drops_a_stuck_group_and_admits_a_fresh_one(run_dir: str) -> None:
    result = run_with_a_frozen_replica(run_dir, "{policy: drop, deadline_s: 0.4}")
    check_common(result, run_dir)
    stuck_groups = {s.split()[0] for s in stuck_samples(run_dir)}
    consumed_groups = {prompt for prompt, _ in result["groups"]}
    assert result["metrics"]["groups_dropped"] >= 1
    assert result["metrics"]["wasted_samples"] >= G
    # Dropped groups are never consumed; every consumed group is whole.
    assert stuck_groups - consumed_groups
    assert all(n == G for _, n in result["groups"])


def test_wait_keeps_a_stuck_group_until_its_samples_are_rerun(run_dir: str) -> None:
    result = run_with_a_frozen_replica(run_dir, "{policy: wait, deadline_s: 0.4}")
    check_common(result, run_dir)
    stuck = stuck_samples(run_dir)
    consumed = set(result["keys"])
    # The frozen samples were re-run elsewhere under the same ids and their groups completed.
    assert stuck <= consumed
    assert all(n == G for _, n in result["groups"])
    assert result["reducer"]["overdue"] >= 1
    assert result["metrics"].get("groups_partial", 0) == 0
    assert result["metrics"].get("groups_dropped", 0) == 0
