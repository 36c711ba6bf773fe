"""When rl_loop stops: at its steps, on a target, on a callback's Stop, on a wall budget; with an
evaluation, on an evaluation boundary. In-process, with the fakes of test_step_report and a fake
clock that the learner moves 10 s a step (nothing sleeps)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from asyncrl.roles.payloads import (
    LearnerStatus,
    ProgramState,
    Prompt,
    SamplingParams,
    StepResult,
    Stopped,
    TrainBatch,
)
from asyncrl.roles.program.clients import RLContext
from asyncrl.roles.program.evaluation import EvalResult
from asyncrl.roles.program.programs import RLLoop, RLStep, Stop, rl_loop
from asyncrl.transport import run
from tests.program.test_step_report import PROMPTS, FakeLearner, FakeRL, G, feed, score

STEP_S = 10.0


class Learner(FakeLearner):
    """Keeps ``keep`` as the real learner does (merged), takes checkpoints, and moves the fake
    clock ``STEP_S`` seconds per step."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.checkpoints: list[ProgramState] = []

    def clock(self) -> float:
        return self.now

    async def train_step(self, batch: TrainBatch, *, timeout: float = 0.0) -> StepResult:
        keep = self.keep.merged(batch.keep)
        result = await super().train_step(batch, timeout=timeout)
        self.keep = keep
        self.now += STEP_S
        return result

    async def checkpoint(self, keep: ProgramState) -> str:
        self.keep = self.keep.merged(keep)
        self.checkpoints.append(keep)
        return "wal"

    async def status(self) -> LearnerStatus:
        status = await super().status()
        status.keep = self.keep
        return status


def loop_until(
    learner: Learner,
    run_dir: str,
    *,
    steps: int = 8,
    evaluate: bool = True,
    eval_every: int = 2,
    done: int = 0,
    on_step: Any = None,
    prompts: Any = feed,
    **settings: Any,
) -> tuple[dict[str, Any], list[RLStep]]:
    rl = FakeRL(run_dir, learner)
    seen: list[RLStep] = []

    async def accuracy() -> float:
        return 0.25 * learner.step  # 0.25 after step 1, 0.5 after step 2, ...

    async def callback(step: RLStep) -> Stop | None:
        seen.append(step)
        return None if on_step is None else on_step(step)

    loop = RLLoop(
        algorithm="grpo",
        steps=steps,
        prompts_per_step=PROMPTS,
        group_size=G,
        params=SamplingParams(max_new_tokens=3),
        evaluate=accuracy if evaluate else None,
        eval_every=eval_every,
        **settings,
    )

    async def main() -> dict[str, Any]:
        return await rl_loop(
            cast(RLContext, rl),
            loop,
            feed=prompts,
            score=score,
            done=done,
            on_step=callback,
            display=False,
            clock=learner.clock,
        )

    return run(main()), seen


def evaluated(seen: list[RLStep]) -> list[int]:
    return [s.step for s in seen if s.evaluation is not None]


def test_a_stop_asked_between_boundaries_lands_on_the_next_one(tmp_path: Any) -> None:
    out, seen = loop_until(
        Learner(), str(tmp_path), on_step=lambda s: Stop("enough") if s.step == 3 else None
    )
    assert out["steps"] == 4 and out["stop_reason"] == "enough"
    assert evaluated(seen) == [2, 4] and seen[-1].last


def test_a_raised_stop_with_now_stops_at_once(tmp_path: Any) -> None:
    def on_step(step: RLStep) -> None:
        if step.step == 3:
            raise Stop("right now", now=True)

    out, seen = loop_until(Learner(), str(tmp_path), on_step=on_step)
    assert out["steps"] == 3 and out["stop_reason"] == "right now"
    assert evaluated(seen) == [2]


def test_without_an_evaluation_a_stop_takes_effect_after_its_step(tmp_path: Any) -> None:
    out, seen = loop_until(
        Learner(),
        str(tmp_path),
        evaluate=False,
        on_step=lambda s: Stop() if s.step == 3 else None,
    )
    assert out["steps"] == 3 and out["stop_reason"] == "on_step asked to stop"
    assert evaluated(seen) == []


def test_an_accuracy_target_stops_at_the_evaluation_that_reaches_it(tmp_path: Any) -> None:
    learner = Learner()
    out, seen = loop_until(learner, str(tmp_path), stop_at={"accuracy": 0.5})
    assert out["steps"] == 2 and out["stop_reason"] == "the accuracy 0.5 reached 0.5"
    assert out["evaluations"] == [
        {"accuracy": 0.5, "score_mean": 0.5, "count": 0, "versions": [], "step": 2}
    ]
    # The stop is kept with the learner: a driver restarted now does not train on.
    assert learner.checkpoints[-1] == ProgramState(
        stopped=Stopped(id="rl-", step=2, reason="the accuracy 0.5 reached 0.5")
    )
    again, seen = loop_until(learner, str(tmp_path), stop_at={"accuracy": 0.5}, done=2)
    assert again["steps"] == 2 and seen == [] and learner.step == 2


def test_a_reward_target_waits_for_the_evaluation_boundary(tmp_path: Any) -> None:
    out, seen = loop_until(Learner(), str(tmp_path), stop_at={"reward": 0.5})
    assert out["steps"] == 2 and out["stop_reason"] == "the reward 0.5 reached its target 0.5"
    assert [s.reward for s in seen] == [0.5, 0.5] and evaluated(seen) == [2]


def test_the_budget_stops_at_the_last_boundary_whose_next_one_would_end_past_it(
    tmp_path: Any,
) -> None:
    """10 s a step, boundaries every 2 steps: at step 2 (20 s) the next boundary would end at
    40 s, past a 35 s budget."""
    out, seen = loop_until(Learner(), str(tmp_path), budget_s=35)
    assert out["steps"] == 2 and out["stopped_by_budget"]
    assert out["stop_reason"] == "its 35 s budget ends before the next evaluation"
    assert evaluated(seen) == [2]


def test_without_an_evaluation_the_budget_stops_before_a_step_that_would_end_past_it(
    tmp_path: Any,
) -> None:
    out, _ = loop_until(Learner(), str(tmp_path), budget_s=35, evaluate=False)
    assert out["steps"] == 3 and out["stopped_by_budget"]  # ends at 30 s; a 4th, at 40 s
    assert out["wall_s"] == 3 * STEP_S


def test_a_budget_shorter_than_the_first_boundary_stops_at_the_step_past_it(
    tmp_path: Any,
) -> None:
    out, seen = loop_until(Learner(), str(tmp_path), budget_s=25, eval_every=4)
    assert out["steps"] == 3 and evaluated(seen) == [3]


def test_the_reward_is_the_trained_batch_and_the_scored_mean_is_kept_apart(
    tmp_path: Any,
) -> None:
    _, seen = loop_until(Learner(), str(tmp_path), steps=1)
    (step,) = seen
    assert step.reward == pytest.approx(sum(s.reward for s in step.batch.samples) / 4)
    assert step.reward_scored == step.batch.metrics["reward_scored_mean"]
    assert isinstance(step.eval_result, EvalResult) and step.eval_result.step == 1


def test_prompts_that_run_out_end_the_loop_after_the_steps_taken(tmp_path: Any) -> None:
    async def five(cursor: int, n: int) -> list[Prompt]:  # enough for two steps and a half
        return (await feed(cursor, n))[: max(0, 5 - cursor)]

    learner = Learner()
    out, seen = loop_until(learner, str(tmp_path), prompts=five)
    assert out["steps"] == 3 and [s.step for s in seen] == [1, 2, 3]
    assert out["stop_reason"] == "the prompts ran out after step 3"
    stopped = learner.checkpoints[-1].stopped
    assert stopped is not None and stopped.step == 3  # a restarted driver stops too
    again, _ = loop_until(learner, str(tmp_path), prompts=five, done=3)
    assert again["steps"] == 3 and again["stop_reason"] == out["stop_reason"]


def test_a_feed_that_fails_with_eof_fails_the_loop_and_an_empty_one_is_refused(
    tmp_path: Any,
) -> None:
    async def truncated(cursor: int, n: int) -> list[Prompt]:  # a user's broken data file
        if cursor >= 4:
            raise EOFError("Compressed file ended before the end-of-stream marker was reached")
        return await feed(cursor, n)

    learner = Learner()
    with pytest.raises(EOFError, match="Compressed file ended"):
        loop_until(learner, str(tmp_path / "a"), prompts=truncated)
    assert not any("stopped" in c for c in learner.checkpoints)  # nothing kept as a stop

    async def empty(cursor: int, n: int) -> list[Prompt]:
        return []

    learner = Learner()
    with pytest.raises(ValueError, match="ran out before the first step"):
        loop_until(learner, str(tmp_path / "b"), prompts=empty)
    assert not any("stopped" in c for c in learner.checkpoints)


def test_an_unknown_target_is_refused(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"RLLoop.stop_at: unknown metric \['loss'\]"):
        loop_until(Learner(), str(tmp_path), stop_at={"loss": 0.1})
