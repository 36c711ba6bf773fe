"""What rl_loop reports at every step (asyncrl.roles.program.step_report), in-process, with
fake roles.

The fakes answer at once: a rollout handle whose samples finish when asked (1, 2 or 3 tokens by
sample index), a learner that takes every batch and keeps the program's position with it, and
a reward that differs within each group. Nothing sleeps: the loop runs as fast as it can.
"""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest

from asyncrl.manifest.pipeline_section import PipelineSpec
from asyncrl.observe.metrics import METRICS_FILE, read_metrics
from asyncrl.roles.generation.rollout import GenerateBatch, Prompt, Sample, SamplingParams
from asyncrl.roles.payloads import LearnerStatus, ProgramState, StepResult, TrainBatch
from asyncrl.roles.program.clients import RLContext, RolloutClient
from asyncrl.roles.program.programs import RLLoop, RLStep, rl_loop
from asyncrl.roles.program.settings import Settings
from asyncrl.transport import run

G = 2  # group size
PROMPTS = 2  # prompts per step: batches of four samples


class FakeLearner:
    """Takes every batch as one step; its status says what a real learner's would."""

    def __init__(self) -> None:
        self.step = 0
        self.keep = ProgramState()
        self.last: dict[str, Any] = {}

    async def status(self) -> LearnerStatus:
        return LearnerStatus(version=self.step, step=self.step, keep=self.keep, last=self.last)

    async def train_step(self, batch: TrainBatch, *, timeout: float = 0.0) -> StepResult:
        self.step += 1
        self.keep = batch.keep
        metrics = {"loss": 0.1 * self.step, "grad_norm": 1.0, "lr": 1e-3, "reward_mean": 0.5}
        result = StepResult(
            version=self.step,
            step=self.step,
            consumed=len(batch.samples),
            skipped=0,
            metrics=metrics,
        )
        self.last = {"id": batch.id, "result": msgspec.to_builtins(result)}
        return result


class FakeRollout:
    """The rollout group's handle: a sample of ``1 + index % 3`` tokens per generate call; every
    replica (one) holds the learner's newest weights."""

    name = "rollout"

    def __init__(self, learner: FakeLearner) -> None:
        self.learner = learner

    async def call(
        self, method: str, payload: Any, reply_type: Any = Any, **options: Any
    ) -> list[Sample]:
        assert method == "generate" and isinstance(payload, GenerateBatch)
        (request,) = payload.requests
        tokens = [2] * (1 + request.sample_index % 3)
        version = [self.learner.step] * len(tokens)
        prompt = request.prompt
        return [
            Sample(
                prompt_id=prompt.id,
                sample_index=request.sample_index,
                prompt_ids=prompt.token_ids,
                token_ids=tokens,
                logprobs=[-0.5] * len(tokens),
                versions=version,
                finished=True,
                stop_reason="stop",
            )
        ]

    async def broadcast(
        self, method: str, payload: Any = None, reply_type: Any = Any, **options: Any
    ) -> list[int]:
        return [self.learner.step]


class FakeRL:
    """What rl_loop uses of an RLContext."""

    def __init__(self, run_dir: str, learner: FakeLearner) -> None:
        self.run_dir = run_dir
        self.learner = learner
        self.rollout = RolloutClient(cast(Any, FakeRollout(learner)))
        self.reference = None
        self.critic = None
        self.pipeline = PipelineSpec(mode="sync")
        self.watchdog = None
        self.config: dict[str, Any] = {}  # no relays: run.config.relays unset, no role "relay"
        self.settings = Settings(None)  # the manifest does not describe the learner
        self.ctx = SimpleNamespace(
            roles={"learner": None, "rollout": None}, idle=lambda: {"rollout": 0.25}
        )


async def feed(cursor: int, n: int) -> list[Prompt]:
    return [Prompt(id=f"p{i}", token_ids=[1, 2, 3], answer="") for i in range(cursor, cursor + n)]


async def score(samples: list[Sample]) -> list[float]:
    return [float(s.sample_index % 2) for s in samples]  # 0 and 1 in every group


def run_loop(rl: FakeRL, steps: int, **kwargs: Any) -> dict[str, Any]:
    async def evaluate() -> float:
        return 0.25 * rl.learner.step

    loop = RLLoop(
        algorithm="grpo",
        steps=steps,
        prompts_per_step=PROMPTS,
        group_size=G,
        params=SamplingParams(max_new_tokens=3),
        evaluate=evaluate,
        eval_every=2,
    )
    kwargs.setdefault("display", False)

    async def main() -> dict[str, Any]:
        return await rl_loop(cast(RLContext, rl), loop, feed=feed, score=score, **kwargs)

    return run(main())


def records(run_dir: str) -> list[dict[str, Any]]:
    return read_metrics(os.path.join(run_dir, METRICS_FILE))


def agent_log(run_dir: str, *events: str) -> None:
    """Append supervisor log lines with these events to RUN_DIR/logs/agent.jsonl."""
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    with open(os.path.join(run_dir, "logs", "agent.jsonl"), "a") as f:
        f.writelines(json.dumps({"event": e, "process": "rollout[0]"}) + "\n" for e in events)


def test_every_step_is_one_line_of_metrics(tmp_path: Any) -> None:
    run_dir = str(tmp_path)
    agent_log(run_dir, "started", "restarting", "started")
    rl = FakeRL(run_dir, FakeLearner())
    seen: list[int] = []

    def on_step(step: RLStep) -> None:
        seen.append(step.step)
        if step.step == 1:
            agent_log(run_dir, "restarting")  # a second restart, during step 2

    out = run_loop(rl, 3, on_step=on_step)
    assert out["steps"] == 3 and seen == [1, 2, 3]
    got = records(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert [r["version"] for r in got] == [1, 2, 3]
    assert [r.get("accuracy") for r in got] == [None, 0.5, 0.75]  # eval_every 2, and the last
    assert [r["restarts"] for r in got] == [1, 2, 2]
    for r in got:
        # Rewards 0 and 1 in each group: the mean, the nearest-rank quantiles of 0, 0, 1, 1,
        # and 1.96 standard errors (sample std sqrt(1/3), over sqrt(4)).
        assert r["reward"] == {
            "mean": 0.5,
            "p10": 0.0,
            "p50": 0.0,
            "p90": 1.0,
            "ci95": pytest.approx(1.96 * math.sqrt(1 / 3) / 2),
            "scored_mean": 0.5,
        }
        assert r["staleness"] == {"p50": 0.0, "p99": 0.0, "max": 0.0}
        assert r["pipeline"]["consumed_samples"] == 4 * r["step"]
        assert r["pipeline"]["reward_scored_mean"] == 0.5
        step_s = r["time_s"]["step"]
        parts = sum(r["time_s"][k] for k in ("batch", "learn", "weights", "eval"))
        assert 0 < parts <= step_s
        # Per second over the step: four samples, of 1 + 2 tokens per group.
        assert r["throughput"]["samples_per_s"] * step_s == pytest.approx(4)
        assert r["throughput"]["tokens_trained_per_s"] * step_s == pytest.approx(6)
        assert r["throughput"]["tokens_generated_per_s"] * step_s == pytest.approx(6)
        assert r["idle"]["learner"] == pytest.approx(1 - r["time_s"]["learn"] / step_s)
        assert r["idle"]["rollout"] == 0.25
    assert [r["learner"]["loss"] for r in got] == pytest.approx([0.1, 0.2, 0.3])
    assert got[0]["learner"]["grad_norm"] == 1.0 and got[0]["learner"]["lr"] == 1e-3
    walls = [r["wall_s"] for r in got]
    assert walls == sorted(walls) and walls[0] > 0


def test_a_resumed_loop_appends_and_never_writes_a_step_twice(tmp_path: Any) -> None:
    run_dir = str(tmp_path)
    learner = FakeLearner()
    run_loop(FakeRL(run_dir, learner), 3)
    before = records(run_dir)
    with open(os.path.join(run_dir, METRICS_FILE), "a") as f:
        # A step the learner never acknowledged (it lost it), and a line cut short by a crash.
        f.write(json.dumps({"step": 4, "reward": {"mean": 99.0}}) + "\n")
        f.write('{"step": 5, "rew')
    out = run_loop(FakeRL(run_dir, learner), 5, done=3)
    assert out["steps"] == 5
    got = records(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert got[:3] == before
    assert got[3]["reward"]["mean"] == 0.5  # written again by the resumed loop
    walls = [r["wall_s"] for r in got]
    assert walls == sorted(walls)  # the resumed loop's wall time goes on from the last record
    with open(os.path.join(run_dir, METRICS_FILE)) as f:
        assert len(f.readlines()) == 5


def test_a_fresh_loop_starts_the_file_afresh(tmp_path: Any) -> None:
    run_dir = str(tmp_path)
    run_loop(FakeRL(run_dir, FakeLearner()), 2)
    run_loop(FakeRL(run_dir, FakeLearner()), 1)  # a new learner: a new run
    assert [r["step"] for r in records(run_dir)] == [1]


def test_a_step_taken_while_the_driver_was_down_is_recovered(tmp_path: Any) -> None:
    """The driver died after the learner acknowledged step 2 and before writing its line: the
    resumed loop writes it from the learner's record of its last step."""
    run_dir = str(tmp_path)
    learner = FakeLearner()
    run_loop(FakeRL(run_dir, learner), 2)
    path = os.path.join(run_dir, METRICS_FILE)
    with open(path) as f:
        first = f.readline()
    with open(path, "w") as f:
        f.write(first)
    run_loop(FakeRL(run_dir, learner), 3, done=2)
    got = records(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3]
    recovered = got[1]
    assert recovered["recovered"] is True and "recovered" not in got[2]
    assert recovered["version"] == 2
    assert recovered["learner"]["loss"] == pytest.approx(0.2)
    assert recovered["reward"] == {"mean": 0.5}
    assert recovered["wall_s"] == got[0]["wall_s"]


def test_the_progress_display_writes_plain_lines_off_a_terminal(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    run_loop(FakeRL(str(tmp_path), FakeLearner()), 3, display=True)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("GRPO")]
    # The first step, the steps that evaluated (2 and 3, the last); step 2 is within the pace.
    assert [line.split("  ")[0] for line in lines] == ["GRPO 1/3", "GRPO 2/3", "GRPO 3/3"]
    assert lines[0].split("  ")[1:3] == ["reward 0.500", "held-out -"]
    assert lines[2].split("  ")[2] == "held-out 0.750"
    assert lines[2].endswith("ETA 0:00:00")
