"""``asyncrl bench pipeline``: its simulated roles in-process, and ``--quick --json`` end to end on
real processes, every figure next to its model (exactly ``pipeline_model.simulate``'s)."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from asyncrl.role import RoleContext
from asyncrl.roles.generation.rollout import (
    GenerateBatch,
    GenerateRequest,
    Prompt,
    Sample,
    SamplingParams,
)
from asyncrl.roles.training.learner import Scored, StepResult, TrainBatch
from asyncrl.transport import run
from benchmarks.pipeline import workload
from benchmarks.pipeline_model import sample_duration, simulate
from benchmarks.sim import SimLearner, SimRollout
from tests.conftest import ROOT


def rollout(replica: int = 1, **config: object) -> SimRollout:
    config = {"speeds": [1.0, 0.5], "sigma": 0.0, "mean_s": 0.001, **config}
    return SimRollout(RoleContext.local(config, replica=replica, capacity=2))


def request(prompt: str, index: int) -> GenerateBatch:
    return GenerateBatch(
        [
            GenerateRequest(
                prompt=Prompt(id=prompt, token_ids=[7, 8]),
                sample_index=index,
                params=SamplingParams(),
            )
        ]
    )


def test_sim_rollout_returns_a_finished_sample_of_the_version_it_started_at() -> None:
    role = rollout(sigma=1.0, mean_s=0.01)

    async def main() -> list[Sample]:
        assert await role.set_version(3) == 3
        return await role.generate(request("p4", 2))

    (sample,) = run(main())
    assert sample == Sample(
        prompt_id="p4",
        sample_index=2,
        prompt_ids=[7, 8],
        token_ids=[2],
        logprobs=[0.0],
        versions=[3],
        finished=True,
        stop_reason="length",
    )
    ((start, end, work),) = role.done
    assert work == sample_duration(4, 2, 1.0, mean_s=0.01)
    # Replica 1 runs at half speed; uvloop's timers have a granularity of 1 ms.
    assert end - start >= work / 0.5 - 1e-3
    assert role.running == {}


def test_sim_rollout_usage_counts_busy_slot_time_and_the_work_started_in_the_window() -> None:
    role = rollout()
    role.done = [(0.0, 2.0, 1.0), (1.0, 3.0, 0.5), (5.0, 6.0, 0.25)]  # (start, end, work)
    usage = run(role.usage([1.0, 4.0]))
    # Busy: 1 s of the first, 2 s of the second, none of the third; 2 slots over 3 s.
    assert usage == {
        "replica": 1.0,
        "speed": 0.5,
        "slots": 2.0,
        "busy_s": 3.0,
        "work_s": 0.5,
        "started": 1.0,
        "idle": 0.5,
    }
    # Calls of 2 samples: the 2 slots hold 4 samples at once, so 3 busy sample-seconds leave
    # 3/4 of them idle.
    assert run(role.usage([1.0, 4.0, 2]))["idle"] == 0.75
    with pytest.raises(ValueError, match=r"usage: expected a window \[t0, t1\] with t1 > t0"):
        run(role.usage([4.0, 1.0]))


def test_sim_rollout_refuses_a_replica_without_a_speed_and_a_prompt_id_without_an_index() -> None:
    with pytest.raises(msgspec.ValidationError, match=r"speeds: replica 2 has no speed in"):
        rollout(replica=2)
    with pytest.raises(ValueError, match=r"prompt id 'q1' is not 'p<index>'"):
        run(rollout().generate(request("q1", 0)))


def test_sim_learner_keeps_a_ledger_and_steps_only_on_fresh_samples() -> None:
    role = SimLearner(RoleContext.local({"step_s": 0.0}))

    def batch(*keys: tuple[str, int]) -> TrainBatch:
        return TrainBatch(
            samples=[
                Scored(
                    sample=Sample(
                        prompt_id=p,
                        sample_index=k,
                        prompt_ids=[1],
                        token_ids=[2],
                        logprobs=[0.0],
                        versions=[0],
                        finished=True,
                        stop_reason="length",
                    )
                )
                for p, k in keys
            ]
        )

    async def main() -> list[StepResult]:
        return [
            await role.train_step(batch(("p0", 0), ("p0", 1))),
            await role.train_step(batch(("p0", 1), ("p1", 0))),
            await role.train_step(batch(("p1", 0))),
        ]

    first, second, third = run(main())
    assert (first.version, first.step, first.consumed, first.skipped) == (1, 1, 2, 0)
    assert (second.version, second.step, second.consumed, second.skipped) == (2, 2, 1, 1)
    assert (third.version, third.step, third.consumed, third.skipped) == (2, 2, 0, 1)
    status = run(role.sim_status(None))
    assert status == {"version": 2, "step": 2, "consumed": 3, "keep": {}}


KEYS = {
    "sigma",
    "slow_replica",
    "sync_samples_per_s",
    "async_samples_per_s",
    "speedup",
    "async_efficiency",
    "fast_worker_idle_max",
    "sync_fast_worker_idle_max",
    "async_model_ratio",
    "sync_model_ratio",
    "staleness_p50",
    "staleness_p99",
    "staleness_max",
    "waste_fraction",
    "straggler_policy",
    "over_eta",
    "eta",
    "async_mean_consumed_s",
    "async_mean_dispatched_s",
    "model_async_samples_per_s",
    "model_sync_samples_per_s",
    "model_async_efficiency",
    "model_fast_worker_idle_max",
    "model_staleness_max",
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipeline_benchmark_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "bench", "pipeline", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
        check=True,
    )
    rows = json.loads(out.stdout)["rows"]
    assert [(r["sigma"], r["slow_replica"]) for r in rows] == [(1.0, True), (0.0, False)]
    for row in rows:
        assert set(row) >= KEYS
        assert (row["eta"], row["over_eta"], row["straggler_policy"]) == (2, "correct", "wait")
        w = workload(row["sigma"], row["slow_replica"], warmup=1, steps=3)
        for mode in ("sync", "async"):
            measured, model = row["measured"][mode], row["model"][mode]
            assert model == simulate(w, mode).as_dict()
            # Whole batches, every sample accounted for, nothing wasted (correct, wait).
            assert measured["consumed_samples"] == 3 * 256
            assert measured["wasted_samples"] == 0 and measured["waste_fraction"] == 0.0
            assert measured["samples_per_s"] > 0
            assert all(0.0 <= idle <= 1.0 for idle in measured["idle"])
            assert measured["speeds"] == list(w.speeds)
        assert row["speedup"] == pytest.approx(
            row["async_samples_per_s"] / row["sync_samples_per_s"]
        )
        # Two cores shared with other work: generous, but a broken pipeline misses them. Sync
        # mode runs above its model on a loaded machine (1.07 to 1.55 seen, the same before and
        # after the recovery work, measured interleaved); its barrier is checked directly below
        # (staleness 0), so its upper bound only has to catch a runaway.
        assert 0.5 < row["async_model_ratio"] < 1.5
        assert 0.5 < row["sync_model_ratio"] < 2.0
        assert 0.0 <= row["fast_worker_idle_max"] < row["sync_fast_worker_idle_max"] <= 1.0
        assert row["measured"]["sync"]["staleness_max"] == 0  # the barrier: every sample fresh
        assert 0 <= row["staleness_p50"] <= row["staleness_p99"] <= row["staleness_max"] <= 6
    equal = rows[1]
    # Every sample lasts mean_s at sigma 0.
    assert equal["async_mean_consumed_s"] == pytest.approx(0.05)
    assert equal["async_mean_dispatched_s"] == pytest.approx(0.05)
