"""``pipeline.shards`` in the built-in programs' loop, in-process: ``rl_loop`` grants its groups
to dispatch shards (each a ``ShardWorker`` over the fake rollout, scoring as the reward role
does, against each prompt's answer) and trains on the very batches one driver trains on, with
the main job's prompt schedule (probes and uniform skips) too; a score function or a sample
source of the program's own is refused, naming the key."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest

from asyncrl.manifest.pipeline_section import SHARD_CLASS, PipelineSpec, ScheduleSpec
from asyncrl.roles.payloads import Prompt, Sample, SamplingParams, StepResult, TrainBatch
from asyncrl.roles.program.clients import RewardClient, RLContext, RolloutClient
from asyncrl.roles.program.programs import RLLoop, rl_loop
from asyncrl.roles.program.rl_loop import PromptFeed
from asyncrl.roles.sampling.schedule import item_of
from asyncrl.roles.sampling.shard import DispatchShard, ShardWorker
from asyncrl.supervision.process import load_role_class
from asyncrl.transport import run
from tests.program.test_step_report import PROMPTS, FakeLearner, FakeRL, FakeRollout, G, score

STEPS = 4


def _reward(samples: list[Sample], answers: list[str]) -> list[float]:
    """What the fake reward role gives: 1 for an odd sample of a prompt whose answer is odd."""
    return [float(s.sample_index % 2 and int(a) % 2) for s, a in zip(samples, answers, strict=True)]


class Learner(FakeLearner):
    """Keeps the ids of every batch it trains on, and the resume state kept with it."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[tuple[str, int]]] = []
        self.resumes: list[dict[str, Any] | None] = []

    async def train_step(self, batch: TrainBatch, *, timeout: float = 0.0) -> StepResult:
        self.batches.append([(s.sample.prompt_id, s.sample.sample_index) for s in batch.samples])
        self.resumes.append(batch.keep.resume)
        return await super().train_step(batch, timeout=timeout)


class Prompts:
    """The prompt source: prompt ``i`` answers ``str(i)``."""

    async def take(self, cursor: int, n: int) -> list[Prompt]:
        return [
            Prompt(id=f"p{i}", token_ids=[1, 2], answer=str(i)) for i in range(cursor, cursor + n)
        ]


ITEMS = 8


def mixed(item: str) -> bool:
    """Items 1 and 5 (of every 4th from 1) have groups some samples of which are right; the
    others' groups are uniform, no sample right."""
    return int(item) % 4 == 1


class Epochs:
    """The prompt source over ``ITEMS`` items, epoch after epoch: prompt ``i`` is item ``i %
    ITEMS`` (``"<item>@<epoch>"``), answering "1" (an odd sample is right) when the item is
    ``mixed``, else "0" (no sample is)."""

    async def take(self, cursor: int, n: int) -> list[Prompt]:
        prompts = []
        for i in range(cursor, cursor + n):
            item = str(i % ITEMS)
            answer = "1" if mixed(item) else "0"
            prompts.append(Prompt(id=f"{item}@{i // ITEMS}", token_ids=[1, 2], answer=answer))
        return prompts


class SureOfUniformItems(FakeRollout):
    """The fake rollout, drawing a uniform item's samples with probability 0.99 a token (a
    probe of one of them agrees confidently) and a ``mixed`` item's with 0.61."""

    async def call(
        self, method: str, payload: Any, reply_type: Any = Any, **options: Any
    ) -> list[Sample]:
        samples = await super().call(method, payload, reply_type, **options)
        return [
            msgspec.structs.replace(
                s, logprobs=[-0.5 if mixed(item_of(s.prompt_id)) else -0.01] * len(s.token_ids)
            )
            for s in samples
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
    run_dir: str,
    shards: int,
    mode: str,
    score_fn: Any = None,
    *,
    steps: int = STEPS,
    scheduled: bool = False,
    **loop: Any,
) -> tuple[Learner, Shards, dict[str, Any]]:
    """``rl_loop`` over ``shards`` shards; ``score_fn``: a score function of the program's own
    (``"other reward"``: a ``RewardScorer`` over a reward client not the run's); ``scheduled``:
    the main job's prompt schedule over ``Epochs`` (probes of one sample, confident at 0.9;
    uniform skips; dynamic sampling with one uniform drop a group of a batch)."""
    learner = Learner()
    rl = FakeRL(run_dir, learner)
    rollout = FakeRollout(learner)
    rl.pipeline = PipelineSpec(mode=mode, shards=shards)
    if scheduled:
        rollout = SureOfUniformItems(learner)
        rl.rollout = RolloutClient(cast(Any, rollout))
        rl.pipeline = PipelineSpec(
            mode=mode,
            shards=shards,
            drop_uniform=True,
            uniform_drops_per_group=1,
            schedule=ScheduleSpec(skip_uniform=True, probe=1, confidence=0.9),
        )
    fake = Shards(rollout, max(shards, 1))
    rl.ctx = SimpleNamespace(
        roles={"learner": None, "rollout": None, "shards": fake}, idle=lambda: {}, incarnation=0
    )
    cast(Any, rl).prompts = Epochs() if scheduled else Prompts()
    cast(Any, rl).reward = Reward()
    feed = PromptFeed(cast(RLContext, rl))
    if score_fn is None or score_fn == "other reward":
        reward = cast(Any, rl).reward if score_fn is None else Reward()
        score_fn = feed.scorer(cast(RewardClient, reward))
    settings = RLLoop(
        algorithm="grpo",
        steps=steps,
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


SCHEDULED_STEPS = 12


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_shards_run_the_main_jobs_prompt_schedule_as_one_driver(
    tmp_path: Any, mode: str
) -> None:
    """Probes of one sample (confident at 0.9) and uniform skips, as the main job sets them,
    with one uniform drop a group of a batch: each shard answers a group's probe, the driver
    drops the group or grants the rest of it, and the schedule learns from every group settled.

    In sync mode two shards train on the very batches one driver trains on, and count what it
    counts: probes, probes dropped, uniform groups dropped and kept, prompts skipped, samples
    generated, scored and wasted. In async mode which groups a batch takes depends on when
    each probe ends against the learner's steps (in one driver too: the cap on drops starts
    again at every batch), so there both keep the same books, not the same batches."""
    steps = SCHEDULED_STEPS
    one, _, alone = _loop(str(tmp_path / "one"), 0, mode, steps=steps, scheduled=True)
    two, shards, sharded = _loop(str(tmp_path / "two"), 2, mode, steps=steps, scheduled=True)
    pipeline, driver = sharded["pipeline"], alone["pipeline"]
    if mode == "sync":
        assert two.batches == one.batches
        assert {k: v for k, v in pipeline.items() if k != "scored_tokens"} == driver
        # Each step keeps the schedule's state (streaks, explore) as one driver's does.
        assert [r and r["schedule"] for r in two.resumes] == [
            r and r["schedule"] for r in one.resumes
        ]
        assert all(r and r["schedule"]["streaks"] for r in two.resumes)
    for learner in (one, two):
        assert len(learner.batches) == steps
        assert all(len(b) == PROMPTS * G for b in learner.batches)
        # A uniform item's probe agrees, confidently, and drops its group; once a batch has
        # dropped two, such a group is generated whole and kept (with zero advantages).
        trained = {item_of(p) for b in learner.batches for p, _ in b}
        assert {"1", "5"} <= trained and any(not mixed(i) for i in trained)
    assert sum(shards.granted) > pipeline["admitted_groups"]  # a probe, then the rest
    for p in (pipeline, driver):
        assert p["probed_groups"] == p["admitted_groups"]
        assert p["skipped_prompts"] > 0 and p["groups_uniform_kept"] > 0
        # Every group dropped was dropped after its probe, wasting its one sample.
        dropped = p["groups_probe_dropped"]
        assert dropped > 0
        assert dropped == p["groups_uniform_dropped"] == p["samples_uniform_dropped"]
        assert dropped == p["wasted_samples"]
        # The rest of a dropped group is never admitted.
        assert p["admitted_samples"] == G * p["admitted_groups"] - (G - 1) * dropped
        ends = p["consumed_samples"] + p["wasted_samples"] + p["in_flight_at_end"]
        assert ends == p["admitted_samples"], p
        assert p["consumed_samples"] == steps * PROMPTS * G


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
