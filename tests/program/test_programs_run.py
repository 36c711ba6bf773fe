"""A program's run state (asyncrl.roles.program.run, .history), in-process with the fakes of
test_step_report: phases carried by the learner, a history resumed exactly, the summary."""

from __future__ import annotations

import json
import logging
import os
from typing import Any, cast

import pytest

from asyncrl.chaos.accounting import run_figures
from asyncrl.roles.payloads import ProgramState, Prompt, Sample, SamplingParams, TrainBatch
from asyncrl.roles.program.clients import RLContext
from asyncrl.roles.program.evaluation import EvalResult, Evaluation
from asyncrl.roles.program.history import HISTORY_FILE, History
from asyncrl.roles.program.programs import RLLoop, rl_loop
from asyncrl.roles.program.run import DONE, Run
from asyncrl.transport import run
from tests.program.test_programs_stop import Learner
from tests.program.test_step_report import PROMPTS, FakeRL, G, feed, score


class Counting(Evaluation):
    """An evaluation, every 2 steps, whose accuracy is a tenth of the learner's step count."""

    def __init__(self, learner: Learner) -> None:
        prompt = Prompt(id="p", token_ids=[1])
        super().__init__([prompt], max_new_tokens=1, stop_token_ids=[], every=2)
        self.learner = learner
        self.calls = 0

    async def run(self, rl: Any) -> EvalResult:
        self.calls += 1
        value = self.learner.step / 10
        return EvalResult(accuracy=value, score_mean=value, count=1, versions=[self.learner.step])


class RL(FakeRL):
    incarnation = 0


class ExportingLearner(Learner):
    async def export(self, path: str) -> str:
        return f"exports/{path}"


def program(run_dir: str, learner: ExportingLearner, rl_steps: int, *, crash: bool = False) -> Any:
    """Two BC steps, then RL to ``rl_steps``; with ``crash``, stop (as a killed driver) after
    the RL loop, before ending the phase."""

    async def main() -> Any:
        rl = cast(RLContext, RL(run_dir, learner))
        evaluation = Counting(learner)
        r = await Run.open(rl, phases=["bc", "rl"], evaluation=evaluation)
        if r.phase == "bc":
            while r.steps < 2:
                sample = (await feed(r.steps, 1))[0]
                demo = TrainBatch(samples=[], algorithm="bc", id=f"bc-{r.steps + 1}")
                demo.keep = ProgramState(program={"demo": sample.id})
                await r.train_step(demo)
            await r.end_phase(accuracy=await r.evaluate_at(r.steps))
        if r.phase == "rl":
            loop = RLLoop(
                algorithm="grpo",
                steps=rl_steps,
                prompts_per_step=PROMPTS,
                group_size=G,
                params=SamplingParams(max_new_tokens=3),
            )
            await rl_loop(rl, loop, feed=feed, score=score, run=r, display=False)
            if crash:
                return r, evaluation
            await r.end_phase(accuracy=r.history.last("rl")["accuracy"])
        return r, evaluation

    return run(main())


def history(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, HISTORY_FILE)) as f:
        return [json.loads(line) for line in f]


def test_phases_travel_with_the_learner_and_nothing_is_recorded_twice(tmp_path: Any) -> None:
    run_dir, learner = str(tmp_path), ExportingLearner()
    r, _ = program(run_dir, learner, rl_steps=3, crash=True)
    assert learner.keep.phase == "rl" and learner.keep.phase_start == 2
    assert learner.keep.phases["bc"]["accuracy"] == 0.2
    assert [(h["phase"], h["step"]) for h in history(run_dir)] == [
        ("bc", 2),
        ("rl", 1),
        ("rl", 2),
        ("rl", 3),
    ]
    # The driver dies after RL step 3, having written nothing of it; and a later line that a
    # crash cut short.
    path = os.path.join(run_dir, HISTORY_FILE)
    with open(path) as f:
        lines = f.readlines()
    with open(path, "w") as f:
        f.writelines(lines[:-1])
        f.write('{"phase": "rl", "st')
    r, _ = program(run_dir, learner, rl_steps=5)
    got = history(run_dir)
    assert [(h["phase"], h["step"]) for h in got] == [
        ("bc", 2),
        ("rl", 1),
        ("rl", 2),
        ("rl", 3),
        ("rl", 4),
        ("rl", 5),
    ]
    recovered = got[3]
    assert recovered["recovered"] is True and recovered["reward"] == 0.5
    assert "accuracy" in got[2] and "accuracy" in got[4]  # every 2 steps ...
    assert got[5]["accuracy"] == 0.7 and got[5]["eval_versions"] == [7]  # ... and the last
    assert learner.step == 7  # 2 BC + 5 RL: nothing trained twice
    assert r.phase == DONE and r.values("rl")["accuracy"] == 0.7
    summary = run(r.finish(accuracy_final=0.7))
    assert summary["accuracy_final"] == 0.7 and summary["learner_steps"] == 7
    bc, rl = summary["phases"]["bc"], summary["phases"]["rl"]
    assert bc == {
        "start": 0,
        "end": 2,
        "started_s": 0.0,
        "ended_s": bc["ended_s"],
        "wall_s": bc["ended_s"],
        "accuracy": 0.2,
    }
    # Phases follow one another on the run's clock; each one's wall_s is its length.
    assert (rl["start"], rl["end"], rl["started_s"]) == (2, 7, bc["ended_s"])
    assert rl["wall_s"] == rl["ended_s"] - rl["started_s"] > 0
    assert rl["ended_s"] <= summary["wall_s"]
    assert summary["samples_consumed"] == 5 * PROMPTS * G  # the pipeline resumed its counts
    assert summary["final"] == "exports/final"
    assert os.path.exists(os.path.join(run_dir, "summary.json"))
    assert os.path.exists(os.path.join(run_dir, "progress.png"))


def test_a_finished_run_resumes_to_its_summary_without_training(tmp_path: Any) -> None:
    run_dir, learner = str(tmp_path), ExportingLearner()
    program(run_dir, learner, rl_steps=2)
    before = history(run_dir)
    r, evaluation = program(run_dir, learner, rl_steps=2)
    assert r.phase == DONE and learner.step == 4 and evaluation.calls == 0
    assert history(run_dir) == before


def test_a_history_entry_past_the_learner_is_dropped(tmp_path: Any) -> None:
    run_dir = str(tmp_path)
    h = History.open(run_dir, fresh=True)
    for step in (1, 2, 3):
        h.record("rl", step, reward=0.1 * step)
    h.record("rl", 2, accuracy=0.5)  # merged into step 2's entry, not a second line
    again = History.open(run_dir, fresh=False, keeps=lambda e: e["step"] <= 2)
    assert [e["step"] for e in again.entries] == [1, 2]
    assert again.get("rl", 2) == {"phase": "rl", "step": 2, "reward": 0.2, "accuracy": 0.5}
    assert len(history(run_dir)) == 2


def test_a_torn_last_line_is_cut_with_a_warning_and_a_damaged_one_is_refused(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = str(tmp_path)
    path = os.path.join(run_dir, HISTORY_FILE)
    with open(path, "w") as f:
        f.write('{"phase": "bc", "step": 1, "accuracy": 0.1}\n{"phase": "bc", "step": 2, "acc')
    with caplog.at_level(logging.WARNING):
        h = History.open(run_dir, fresh=False)
    assert [e["step"] for e in h.entries] == [1]
    assert "its last line was cut short by a crash; cut it off" in caplog.text
    with open(path) as f:
        assert f.read() == '{"phase": "bc", "step": 1, "accuracy": 0.1}\n'
    with open(path, "w") as f:
        f.write('{"phase": "bc"\n{"phase": "bc", "step": 2}\n')
    with pytest.raises(ValueError, match=f"{path}:1: not a JSON line; the history is damaged"):
        History.open(run_dir, fresh=False)


def test_a_phase_the_program_does_not_declare_is_refused(tmp_path: Any) -> None:
    learner = ExportingLearner()
    learner.keep = ProgramState(phase="sft")
    rl = cast(RLContext, RL(str(tmp_path), learner))
    with pytest.raises(ValueError, match="the learner kept phase 'sft', which this program"):
        run(Run.open(rl, phases=["bc", "rl"]))


def test_train_step_keeps_the_position_with_the_batch(tmp_path: Any) -> None:
    learner = ExportingLearner()
    rl = cast(RLContext, RL(str(tmp_path), learner))

    async def main() -> None:
        r = await Run.open(rl, phases=["warmup"])
        await r.train_step(TrainBatch(samples=[], keep=ProgramState(program={"x": 1})))

    run(main())
    assert learner.keep == ProgramState(phase="warmup", phase_start=0, program={"x": 1})


class Recording(ExportingLearner):
    """Keeps every batch it is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[TrainBatch] = []

    async def train_step(self, batch: TrainBatch, *, timeout: float = 0.0) -> Any:
        self.batches.append(batch)
        return await super().train_step(batch, timeout=timeout)


def demo_sample() -> Sample:
    """A demonstration of prompt ``d7``."""
    return Sample(
        prompt_id="d7",
        sample_index=0,
        prompt_ids=[1],
        token_ids=[2, 3],
        logprobs=[],
        versions=[],
        finished=True,
        stop_reason="stop",
    )


def test_bc_step_mints_an_id_per_use_and_per_step(tmp_path: Any) -> None:
    """Each use of a demonstration gets its own ledger id and each step its own batch id, from
    the phase and the step, so a restarted program that sends a step again sends the same ids."""
    learner = Recording()
    demo = demo_sample()

    async def main() -> Run:
        r = await Run.open(cast(RLContext, RL(str(tmp_path), learner)), phases=["warmup"])
        await r.bc_step([demo, demo], lr=1e-3)
        await r.bc_step([demo], lr=2e-3)
        return r

    r = run(main())
    assert [b.id for b in learner.batches] == ["warmup-1", "warmup-2"]
    assert [[s.sample.prompt_id for s in b.samples] for b in learner.batches] == [
        ["d7#warmup0", "d7#warmup0"],
        ["d7#warmup1"],
    ]
    assert [(b.algorithm, b.lr) for b in learner.batches] == [("bc", 1e-3), ("bc", 2e-3)]
    assert learner.batches[1].keep == ProgramState(phase="warmup", phase_start=0)
    assert r.steps == 2 and demo.prompt_id == "d7"


def test_run_rl_loop_needs_a_score_with_a_feed_of_its_own(tmp_path: Any) -> None:
    async def main() -> None:
        r = await Run.open(cast(RLContext, RL(str(tmp_path), Recording())), phases=["rl"])
        params = SamplingParams(max_new_tokens=1)
        loop = RLLoop(
            algorithm="grpo", steps=1, prompts_per_step=PROMPTS, group_size=G, params=params
        )
        await r.rl_loop(loop, feed=feed)

    with pytest.raises(ValueError) as info:
        run(main())
    assert str(info.value) == (
        "Run.rl_loop: a feed of your own needs a score function too (score=...)"
    )


def test_run_rl_loop_takes_a_feed_and_score_as_rl_loop_does(tmp_path: Any) -> None:
    learner = Recording()

    async def main() -> dict[str, Any]:
        r = await Run.open(cast(RLContext, RL(str(tmp_path), learner)), phases=["rl"])
        params = SamplingParams(max_new_tokens=3)
        loop = RLLoop(
            algorithm="grpo", steps=2, prompts_per_step=PROMPTS, group_size=G, params=params
        )
        return await r.rl_loop(loop, feed=feed, score=score, display=False)

    out = run(main())
    assert out["steps"] == 2 and [b.id for b in learner.batches] == ["rl-1", "rl-2"]
    assert all(b.keep.phase == "rl" for b in learner.batches)


def test_the_accounting_reads_every_pipeline_figure_from_a_programs_summary(
    tmp_path: Any,
) -> None:
    """The figures ``asyncrl chaos`` reads from a built-in program's ``summary.json``: the
    samples scored are known, and every admitted sample is consumed, wasted or in flight."""
    run_dir = str(tmp_path)
    r, _ = program(run_dir, ExportingLearner(), rl_steps=3)
    pipeline = run(r.finish(accuracy_final=0.5))["pipeline"]
    figures = run_figures(run_dir)
    assert "samples_scored" not in figures["unknown"]
    assert figures["samples_scored"] == pipeline["scored_samples"] == pipeline["generated_samples"]
    assert figures["samples_consumed"] == 3 * PROMPTS * G
    assert figures["samples_lost"] == 0
