"""``asyncrl bench episodes``: its simulated roles and its model in-process, its argument errors,
and ``--quick --json`` end to end on real processes."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from typing import Any

import pytest

from asyncrl.role import RoleContext
from asyncrl.roles.agents.environment import Reset, Step, Transition
from asyncrl.roles.payloads import GenerateBatch, GenerateRequest, Prompt, Sample, SamplingParams
from asyncrl.transport import run
from benchmarks.episode_sim import (
    MAX_TURNS,
    MIN_TURNS,
    SpreadEnv,
    TurnRollout,
    episode_seconds,
    step_latency,
    turns_of,
)
from benchmarks.episodes import PARAMS, QUICK, format_table, ideal_seconds, main, task_plan
from tests.conftest import ROOT


def test_the_model_waits_for_each_batchs_slowest_in_sync_and_fills_free_replicas_in_async() -> None:
    durations = [3.0, 1.0, 1.0, 1.0]
    assert ideal_seconds(durations, 2, "sync") == 3.0 + 1.0
    assert ideal_seconds(durations, 2, "async") == 3.0  # the three short ones share a replica
    assert ideal_seconds(durations, 1, "sync") == ideal_seconds(durations, 1, "async") == 6.0


def test_the_plan_gives_every_count_and_round_tasks_of_its_own_after_the_warm_up() -> None:
    plan = task_plan([1, 2], batches=2, rounds=2)
    assert plan == [(1, [2, 3]), (1, [4, 5]), (2, [6, 7, 8, 9]), (2, [10, 11, 12, 13])]


def test_draws_depend_on_the_seed_the_task_and_the_turn_alone() -> None:
    turns = [turns_of(task, 0) for task in range(200)]
    assert set(turns) == set(range(MIN_TURNS, MAX_TURNS + 1))
    latencies = [step_latency(task, 0, 0.02, 1.0, 0) for task in range(2001)]
    assert statistics.median(latencies) == pytest.approx(0.02, rel=0.1)  # the median asked
    assert step_latency(7, 1, 0.02, 1.0, 0) == step_latency(7, 1, 0.02, 1.0, 0)
    assert step_latency(7, 1, 0.02, 1.0, 0) != step_latency(7, 1, 0.02, 1.0, 1)
    assert step_latency(7, 1, 0.02, 0.0, 0) == 0.02
    assert episode_seconds(7, 0.01, 0.02, 0.0, 0) == pytest.approx(turns_of(7, 0) * 0.03)


def request(prompt_id: str) -> GenerateBatch:
    params = SamplingParams(max_new_tokens=3)
    prompt = Prompt(id=prompt_id, token_ids=[1, 2])
    return GenerateBatch([GenerateRequest(prompt=prompt, sample_index=0, params=params)])


def test_the_rollout_answers_a_finished_sample_and_records_when_it_was_busy() -> None:
    role = TurnRollout(RoleContext.local({"gen_s": 0.0, "tokens": 3, "version": 4}))
    (sample,) = run(role.generate(request("e/0/1")))
    assert isinstance(sample, Sample) and sample.finished and sample.prompt_ids == [1, 2]
    assert len(sample.token_ids) == 3 and all(97 <= t <= 122 for t in sample.token_ids)
    assert all(lp <= 0.0 for lp in sample.logprobs) and sample.versions == [4, 4, 4]
    assert run(role.generate(request("e/0/1"))) == [sample]  # the same turn, the same tokens
    assert role.in_progress == 0 and len(role.busy) == 2
    role.busy, role.starts = [(1.0, 2.0), (3.0, 5.0)], [1.0, 3.0, 3.5]
    assert run(role.idle([0.0, 4.0])) == {"busy_s": 2.0, "calls": 3.0, "idle": 0.5}
    with pytest.raises(ValueError, match=r"idle: expected a window \[t0, t1\] with t1 > t0"):
        run(role.idle([4.0, 4.0]))


def test_the_environment_ends_an_episode_after_its_drawn_turns() -> None:
    env = SpreadEnv(RoleContext.local({"median_s": 0.001, "sigma": 0.0}))

    async def episode(task: int) -> list[Transition]:
        await env.reset(Reset(episode_id="e", task=task))
        return [
            await env.step(Step(episode_id="e", turn=t, action="x"))
            for t in range(turns_of(task, 0))
        ]

    steps = run(episode(5))
    assert [s.done for s in steps] == [False] * (len(steps) - 1) + [True]
    assert [s.reward for s in steps][-1] == 1.0 and steps[0].observation == "seen 0"
    with pytest.raises(TypeError, match=r"the task is an episode's int index, got 'x'"):
        run(env.start("x"))


def test_bad_arguments_are_refused_all_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--replicas", "0,2"])
    assert exited.value.code == 2
    assert (
        "argument --replicas: expected distinct replica counts >= 1 separated by commas "
        "(e.g. 1,2,4,8), got '0,2'" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main(["--batches", "0", "--sigma", "-1"])
    assert "--batches: expected an int >= 1, got 0; --sigma: expected >= 0, got -1.0" in (
        capsys.readouterr().err
    )


def test_the_table_has_a_line_per_replica_count() -> None:
    row = {
        "replicas": 4,
        "episodes": 24,
        "episodes_per_s_sync": 14.04,
        "episodes_per_s_async": 19.46,
        "ratio": 1.386,
        "model_ratio": 1.392,
        "idle_fraction_sync": 0.6438,
        "idle_fraction_async": 0.4521,
    }
    step = {
        "endpoint_over_runner": 3.334,
        "plain_http_over_runner": 1.284,
        "runner_step_s": 1.113,
        "endpoint_step_s": 3.721,
        "plain_http_step_s": 1.429,
        "step_episodes": 64,
    }
    figures = {"params": PARAMS, "rows": [row], **step, "wall_s": 68.2, "load_avg_1m": 2.81}
    lines = format_table(figures).splitlines()
    assert "median 20 ms, sigma 1.0; 3 to 5 turns an episode; 6 x N episodes" in lines[1]
    header = "replicas episodes sync ep/s async ep/s async/sync model rollout idle sync async"
    assert " ".join(lines[3].split()) == header
    assert lines[4].split() == ["4", "24", "14.0", "19.5", "1.39", "1.39", "64.4%", "45.2%"]
    assert lines[-3] == (
        "an RL step of 64 episodes: runner 1.11 s, endpoint (openai client) 3.72 s, endpoint "
        "(plain HTTP) 1.43 s; over runner: openai client 3.33, plain HTTP 1.28 (medians of the "
        "rounds' ratios)"
    )
    assert lines[-1] == "68 s, load average 2.8"
    unmeasured = {**figures, "endpoint_over_runner": None, "endpoint_unavailable": "no openai"}
    assert format_table(unmeasured).splitlines()[-3] == (
        "endpoint over runner: not measured (no openai)"
    )


ROW_KEYS = {
    "replicas",
    "episodes",
    "episodes_per_s_sync",
    "episodes_per_s_async",
    "ratio",
    "idle_fraction_sync",
    "idle_fraction_async",
    "model_episodes_per_s_sync",
    "model_episodes_per_s_async",
    "model_ratio",
}


def model_ratio(n: int, p: dict[str, Any]) -> float:
    """What the benchmark's model gives at ``n`` replicas for the parameters ``p``."""
    ratios = []
    for count, tasks in task_plan(p["replicas"], p["batches"], p["rounds"]):
        if count == n:
            d = [episode_seconds(t, 0.01, 0.02, 1.0, 0) for t in tasks]
            ratios.append(ideal_seconds(d, n, "sync") / ideal_seconds(d, n, "async"))
    return statistics.median(ratios)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_json_runs_every_row_and_async_beats_sync_with_spread_latency() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "bench", "episodes", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=230,
        cwd=ROOT,
        check=True,
    )
    figures = json.loads(out.stdout)
    p = {**PARAMS, **QUICK}
    assert figures["params"] == {**p, "min_turns": 3, "max_turns": 5, "tokens": 8}
    rows = figures["rows"]
    assert [r["replicas"] for r in rows] == [1, 4]
    assert [r["episodes"] for r in rows] == [4, 16]
    for row in rows:
        assert set(row) >= ROW_KEYS
        assert row["model_ratio"] == pytest.approx(model_ratio(row["replicas"], p), rel=1e-9)
        # Measured against the model: within the overhead of two calls a turn.
        for mode in ("sync", "async"):
            assert 0.5 < row[f"episodes_per_s_{mode}"] / row[f"model_episodes_per_s_{mode}"] < 1.1
            assert 0.0 < row[f"idle_fraction_{mode}"] < 1.0
    one, four = rows
    # One replica: a batch of one is one episode in flight; the two modes are the same.
    assert one["model_ratio"] == 1.0 and 0.8 < one["ratio"] < 1.25
    # Four: async never waits for a batch's slowest episode (the model says 1.22x here).
    assert four["model_ratio"] > 1.15
    assert four["ratio"] > 1.0
    assert four["episodes_per_s_async"] > four["episodes_per_s_sync"]
    assert four["idle_fraction_async"] < four["idle_fraction_sync"]
    # The same RL step's episodes through the endpoint and through the runner, every round.
    assert figures["step_episodes"] == 64 and len(figures["rounds_endpoint_over_runner"]) == 3
    ratio = figures["endpoint_over_runner"]
    assert ratio == statistics.median(figures["rounds_endpoint_over_runner"])
    assert figures["runner_step_s"] > 0 and figures["endpoint_step_s"] > 0 and ratio > 0
    plain = figures["plain_http_over_runner"]
    assert plain == statistics.median(figures["rounds_plain_http_over_runner"])
    assert len(figures["rounds_plain_http_over_runner"]) == 3
    assert figures["plain_http_step_s"] > 0 and plain > 0
