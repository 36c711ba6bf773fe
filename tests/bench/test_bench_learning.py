"""``asyncrl bench learning --quick --json`` end to end: a BC checkpoint, the plain loop in a
process of its own, asyncrl async and sync as real runs; the figures' shape and what they
must satisfy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from benchmarks.learning import ARMS, THRESHOLDS, _median, heldout_digest, manifest
from tests.conftest import ROOT

KEYS = ["0.7", "0.9", "0.95"]


def test_a_seed_that_never_reached_a_threshold_counts_as_slowest_in_the_median() -> None:
    assert _median([3.0, None, 1.0]) == 3.0
    assert _median([3.0, None, None]) is None
    assert _median([2.0, 4.0]) == 3.0


def test_the_asyncrl_arms_run_the_main_jobs_manifest_with_the_seed_and_mode_changed() -> None:
    p = {"max_steps": 7, "prompts_per_step": 4, "group_size": 8, "eval_every": 2}
    m = manifest("/ckpt", "sync", 5, p)
    assert m["model"]["path"] == "/ckpt"
    assert m["run"]["program"] == "benchmarks.learning:program"
    assert m["run"]["config"] == {**p, "stop_at": 0.95}
    assert m["pipeline"]["mode"] == "sync"
    assert m["pipeline"]["drop_uniform"] is True  # the shipped pipeline otherwise
    assert m["roles"]["prompts"]["config"]["shuffle_seed"] == 5
    assert m["roles"]["rollout"]["config"]["seed"] == 5
    assert m["roles"]["learner"]["config"]["seed"] == 5
    assert m["roles"]["learner"]["config"]["checkpoint_every"] == 10  # as shipped


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_quick_bench_times_three_arms_on_one_heldout_set_and_the_plain_loop_learns() -> None:
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "bench", "learning", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=1400,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    f: dict[str, Any] = json.loads(out.stdout)
    assert f["thresholds"] == list(THRESHOLDS)
    assert f["heldout"] == {"count": 1000, "digest": heldout_digest()}
    assert f["params"]["seeds"] == 1 and f["params"]["max_steps"] == 10
    assert set(f["arms"]) == set(ARMS)
    starts = []
    for arm in ARMS:
        a = f["arms"][arm]
        assert set(a["seconds_to"]) == set(KEYS) and set(a["reached"]) == set(KEYS)
        assert a["steps_per_s"] > 0 and a["samples_per_s"] > 0
        assert a["generated_per_s"] >= a["samples_per_s"]  # dropped groups were generated too
        (seed,) = a["seeds"]
        points = seed["evaluations"]
        # The same held-out set at the same cadence: step 0, then every 5 steps.
        assert all(pt["count"] == 1000 for pt in points)
        steps = [pt["step"] for pt in points]
        assert steps == [0, 5, 10][: len(steps)], (arm, steps)
        clock = [pt["train_s"] for pt in points]
        assert clock == sorted(clock) and clock[0] == 0.0
        # Times are monotone in the thresholds reached, and reaching one means the lower too.
        times = [seed["seconds_to"][k] for k in KEYS]
        reached = [t for t in times if t is not None]
        assert times[: len(reached)] == reached and reached == sorted(reached), times
        for k in KEYS:
            best = max(pt["accuracy"] for pt in points)
            assert (seed["seconds_to"][k] is not None) == (best >= float(k))
        starts.append(seed["start_accuracy"])
    # Every arm starts from the one BC checkpoint: its held-out accuracy is the same in each
    # arm's evaluator (the rollout engine's greedy decoding, or the plain loop's).
    assert starts == [f["bc"]["accuracy"]] * 3
    plain = f["arms"]["plain"]["seeds"][0]
    assert plain["final_accuracy"] > plain["start_accuracy"] + 0.02, plain["evaluations"]
    to = "0.9"
    for ratio, slow in (("async_over_plain_to_0_9", "plain"), ("async_over_sync_to_0_9", "sync")):
        fast_s, slow_s = f["arms"]["async"]["seconds_to"][to], f["arms"][slow]["seconds_to"][to]
        expected = None if fast_s is None or slow_s is None else slow_s / fast_s
        assert f[ratio] == expected
