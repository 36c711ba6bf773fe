"""``pipeline.shards`` in the built-in programs' loop, in-process: ``rl_loop`` grants its groups
to dispatch shards (each a ``ShardWorker`` over the fake rollout, scoring as the reward role
does, against each prompt's answer) and trains on the very batches one driver trains on; a
score function or a sample source of the program's own is refused, naming the key."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from asyncrl.manifest.pipeline_section import SHARD_CLASS, PipelineSpec
from asyncrl.roles.payloads import Prompt, Sample, SamplingParams, StepResult, TrainBatch
from asyncrl.roles.program.clients import RewardClient, RLContext
from asyncrl.roles.program.programs import RLLoop, rl_loop
from asyncrl.roles.program.rl_loop import PromptFeed
from asyncrl.roles.sampling.shard import DispatchShard, ShardWorker
from asyncrl.supervision.process import load_role_class
from asyncrl.transport import run
from tests.program.test_step_report import PROMPTS, FakeLearner, FakeRL, FakeRollout, G, score

STEPS = 4


def _reward(samples: list[Sample], answers: list[str]) -> list[float]:
    """What the fake reward role gives: 1 for an odd sample of a prompt whose answer is odd."""
    return [float(s.sample_index % 2 and int(a) % 2) for s, a in zip(samples, answers, strict=True)]


class Learner(FakeLearner):
    """Keeps the ids of every batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[tuple[str, int]]] = []

    async def train_step(self, batch: TrainBatch, *, timeout: float = 0.0) -> StepResult:
        self.batches.append([(s.sample.prompt_id, s.sample.sample_index) for s in batch.samples])
        return await super().train_step(batch, timeout=timeout)


class Prompts:
    """The prompt source: prompt ``i`` answers ``str(i)``."""

    async def take(self, cursor: int, n: int) -> list[Prompt]:
        return [
            Prompt(id=f"p{i}", token_ids=[1, 2], answer=str(i)) for i in range(cursor, cursor + n)
        ]


class Reward:
    """The reward role's client."""

    async def score_samples(self, samples: list[Sample], answers: list[str]) -> list[float]:
        return _reward(samples, answers)


class Shards:
    """The shards' handle: shard i a ``ShardWorker`` in-process, over the fake rollout."""

    def __init__(self, rollout: FakeRollout, shards: int) -> None:
        self.workers = [
            ShardWorker(rollout, score_answers=self.score, shard=i) for i in range(shards)
        ]
        self.answers: set[str] = set()
        self.granted = [0] * shards

    @property
    def replicas(self) -> int:
        return len(self.workers)

    async def score(self, samples: list[Sample], answers: list[str]) -> list[float]:
        self.answers.update(answers)
        return _reward(samples, answers)

    async def call(
        self, method: str, payload: Any = None, reply_type: Any = Any, **options: Any
    ) -> Any:
        assert method == "run_group"
        replica = options["replica"]
        self.granted[replica] += 1
        return await self.workers[replica].run_group(payload)


def _loop(
    run_dir: str, shards: int, mode: str, score_fn: Any = None, **loop: Any
) -> tuple[Learner, Shards, dict[str, Any]]:
    """``rl_loop`` over ``shards`` shards; ``score_fn``: a score function of the program's own
    (``"other reward"``: a ``RewardScorer`` over a reward client not the run's)."""
    learner = Learner()
    rl = FakeRL(run_dir, learner)
    rl.pipeline = PipelineSpec(mode=mode, shards=shards)
    fake = Shards(FakeRollout(learner), max(shards, 1))
    rl.ctx = SimpleNamespace(
        roles={"learner": None, "rollout": None, "shards": fake}, idle=lambda: {}, incarnation=0
    )
    cast(Any, rl).prompts = Prompts()
    cast(Any, rl).reward = Reward()
    feed = PromptFeed(cast(RLContext, rl))
    if score_fn is None or score_fn == "other reward":
        reward = cast(Any, rl).reward if score_fn is None else Reward()
        score_fn = feed.scorer(cast(RewardClient, reward))
    settings = RLLoop(
        algorithm="grpo",
        steps=STEPS,
        prompts_per_step=PROMPTS,
        group_size=G,
        params=SamplingParams(max_new_tokens=3),
        **loop,
    )

    async def main() -> dict[str, Any]:
        return await rl_loop(
            cast(RLContext, rl), settings, feed=feed, score=score_fn, display=False
        )

    return learner, fake, run(main())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_shards_train_on_the_batches_one_driver_trains_on(tmp_path: Any, mode: str) -> None:
    one, _, alone = _loop(str(tmp_path / "one"), 0, mode)
    two, shards, sharded = _loop(str(tmp_path / "two"), 2, mode)
    assert two.batches == one.batches
    assert len(two.batches) == STEPS and all(len(b) == PROMPTS * G for b in two.batches)
    assert sharded["steps"] == alone["steps"] == STEPS
    # Every group went to a shard, scored against its prompt's answer; both shards worked.
    admitted = int(sharded["pipeline"]["admitted_groups"])
    assert sum(shards.granted) == admitted and min(shards.granted) > 0
    assert shards.answers == {str(i) for i in range(admitted)}
    pipeline, driver = sharded["pipeline"], alone["pipeline"]
    if mode == "sync":  # nothing generated ahead: every count as one driver's
        assert {k: v for k, v in pipeline.items() if k != "scored_tokens"} == driver
    # Ahead of the learner (async), what was in flight at the end depends on timing.
    for p in (pipeline, driver):
        ends = p["consumed_samples"] + p.get("wasted_samples", 0) + p["in_flight_at_end"]
        assert ends == p["admitted_samples"] == G * p["admitted_groups"], p
    assert pipeline["consumed_samples"] == driver["consumed_samples"] == STEPS * PROMPTS * G
    # The shards counted the completion tokens they scored (1 + k % 3 tokens for sample k):
    # every group's in sync mode; async may end with some groups in flight.
    per_group = sum(1 + k % 3 for k in range(G))
    complete = pipeline["groups_complete"] * per_group
    assert complete <= pipeline["scored_tokens"] <= admitted * per_group
    if mode == "sync":
        assert pipeline["scored_tokens"] == complete == admitted * per_group


def test_shards_refuse_a_score_function_or_a_sample_source_of_the_programs_own(
    tmp_path: Any,
) -> None:
    with pytest.raises(ValueError) as info:
        _loop(str(tmp_path / "a"), 2, "async", score_fn=score)
    assert str(info.value) == (
        "pipeline.shards: 2 dispatch shards score each sample with the reward role against its "
        "prompt's answer; a score function of the program's own runs in the driver alone, and "
        "the shards cannot call it: leave out Run.rl_loop(score=...), or set pipeline.shards: 0"
    )
    with pytest.raises(ValueError) as info:
        _loop(str(tmp_path / "c"), 2, "async", score_fn="other reward")
    assert str(info.value) == (
        "pipeline.shards: 2 dispatch shards score each sample with the reward role "
        "(roles.shards.config.reward, default 'reward'); a RewardScorer over another reward "
        "client than the run's (RLContext.reward) is the program's own: it runs in the driver "
        "alone, and the shards cannot call it: score with the run's reward client "
        "(Run.rl_loop's default), or set pipeline.shards: 0"
    )
    with pytest.raises(ValueError) as info:
        _loop(str(tmp_path / "b"), 2, "async", source=cast(Any, object()))
    assert str(info.value) == (
        "pipeline.shards: 2 dispatch shards generate with the rollout role; a sample source of "
        "the program's own runs in the driver alone, and the shards cannot run it "
        "(RLLoop.source): leave it out, or set pipeline.shards: 0"
    )


def test_the_role_pipeline_shards_adds_is_the_dispatch_shard() -> None:
    assert load_role_class(SHARD_CLASS) is DispatchShard
