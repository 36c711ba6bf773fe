"""The sample pipeline's parts on their own: its counters, its settings, its resume state, and a
resume from the state a batch carried before the pipeline was split into its parts."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from asyncrl.manifest.pipeline_section import PipelineSpec
from asyncrl.roles.payloads import SamplingParams
from asyncrl.roles.sampling.contract import BatchSettings, ResumeState
from asyncrl.roles.sampling.counters import Counters
from asyncrl.roles.sampling.pipeline import SamplePipeline
from asyncrl.roles.sampling.reduce import Outcome
from asyncrl.transport import run
from tests.sampling.test_pipeline import WAIT_S, FakeRollout, Feed, score

B, G = 8, 4


def test_counters_read_and_give_the_names_of_every_batchs_metrics() -> None:
    """Fields by their names, ``infra_failed_<cause>`` by cause, any other name the source's;
    a counter at 0 is left out, and a source's name that is also a field's adds to it."""
    counters = Counters.from_dict(
        {
            "admitted_groups": 3,
            "wasted_samples": 0,
            "infra_failed": 2,
            "infra_failed_timeout": 2,
            "episodes": 12,
            "resumed": 0,
        }
    )
    assert (counters.admitted_groups, counters.wasted_samples, counters.infra_failed) == (3, 0, 2)
    assert counters.infra_causes == Counter(timeout=2)
    assert counters.source == Counter(episodes=12, resumed=0)
    counters.released(Outcome.PARTIAL)
    counters.source["admitted_groups"] += 1
    assert counters.as_dict() == {
        "admitted_groups": 4,
        "groups_partial": 1,
        "infra_failed": 2,
        "infra_failed_timeout": 2,
        "episodes": 12,
    }


def test_counters_add_subtract_and_copy_apart() -> None:
    total = Counters(
        admitted_groups=3,
        admitted_samples=12,
        infra_causes=Counter(lost=1),
        source=Counter(episodes=9),
    )
    group = Counters(admitted_groups=1, admitted_samples=4, infra_causes=Counter(lost=1))
    copy = total.copy()
    copy.subtract(group)
    assert copy.as_dict() == {"admitted_groups": 2, "admitted_samples": 8, "episodes": 9}
    assert total.as_dict() == {
        "admitted_groups": 3,
        "admitted_samples": 12,
        "infra_failed_lost": 1,
        "episodes": 9,
    }
    total.add(group)
    assert total.as_dict() == {
        "admitted_groups": 4,
        "admitted_samples": 16,
        "infra_failed_lost": 2,
        "episodes": 9,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"batch_size": 3, "group_size": 4},
            "batch_size (3) must hold at least one group of group_size (4) samples",
        ),
        (
            {"batch_size": 8, "group_size": 0},
            "batch_size (8) must hold at least one group of group_size (0) samples",
        ),
        (
            {"batch_size": 8, "group_size": 4, "std": "sample"},
            "std: expected 'population' or 'unbiased', got 'sample'",
        ),
        (
            {"batch_size": 8, "group_size": 4, "max_uniform_drops": -1},
            "max_uniform_drops: expected an int >= 0, got -1",
        ),
    ],
)
def test_batch_settings_refuse_what_cannot_make_a_batch(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        BatchSettings(**kwargs)
    assert str(err.value) == message


def test_the_uniform_drop_cap_comes_from_the_spec_unless_the_settings_give_it() -> None:
    def cap(spec: PipelineSpec, settings: BatchSettings) -> tuple[bool, int]:
        pipe = SamplePipeline(
            FakeRollout(),
            spec=spec,
            settings=settings,
            feed=Feed(4),
            score=score,
            params=SamplingParams(),
        )
        return pipe.release.drop_uniform, pipe.release.max_uniform_drops

    spec = PipelineSpec(drop_uniform=True, uniform_drops_per_group=3)
    assert cap(spec, BatchSettings(batch_size=B, group_size=G)) == (True, 3 * B // G)
    settings = BatchSettings(batch_size=B, group_size=G, drop_uniform=False, max_uniform_drops=5)
    assert cap(spec, settings) == (False, 5)


def test_a_resume_state_that_is_not_one_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError) as err:
        ResumeState.of({"cursor": 4, "settled": [5, "six"]})
    assert str(err.value) == (
        "resume: not a sample pipeline's resume state (Expected `int`, got `str` - at "
        "`$.settled[1]`); pass the 'resume' a Batch carried, as kept with the learner's step"
    )
    with pytest.raises(ValueError) as err:
        ResumeState.of(4)  # type: ignore[arg-type]
    assert str(err.value) == (
        "resume: expected a sample pipeline's resume state (a mapping: the 'resume' a Batch "
        "carried), got int"
    )


OLD_RESUME = {
    "cursor": 2,
    "settled": [3],
    "pipeline": {
        "admitted_groups": 3,
        "admitted_samples": 12,
        "generated_samples": 12,
        "groups_complete": 3,
        "consumed_samples": 12,
        "batches": 2,
        "wasted_samples": 0,
        "resumed": 0,
        "infra_failed": 1,
        "infra_failed_timeout": 1,
        "infra_replaced": 1,
        "episodes": 13,
    },
}
"""A resume state as ``TrainBatch.keep`` holds it from a run before the pipeline's parts were
split out (the counters a ``collections.Counter``, some of them at 0)."""


def test_a_run_resumes_from_the_state_an_earlier_pipeline_kept() -> None:
    """Sync: the resumed pipeline admits p2, skips p3 (settled), admits p4, and counts on from
    the kept counters; its own resume state has the same keys, the counters at 0 left out."""

    async def main() -> tuple[list[str], dict, Counter[str]]:
        rollout = FakeRollout(auto=True)
        rollout.version = 2  # the learner's: nothing is stale
        async with SamplePipeline(
            rollout,
            spec=PipelineSpec(mode="sync"),
            settings=BatchSettings(batch_size=B, group_size=G),
            feed=Feed(100),
            score=score,
            params=SamplingParams(max_new_tokens=4),
            start_version=2,
            resume=OLD_RESUME,
        ) as pipe:
            batch = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
        return [s.sample.prompt_id for s in batch.samples], batch.resume, pipe.metrics

    prompts, resume, metrics = run(main())
    assert prompts == ["p2"] * G + ["p4"] * G
    counters = {
        "admitted_groups": 5,
        "admitted_samples": 20,
        "generated_samples": 20,
        "scored_samples": 8,  # the earlier pipeline counted none: the resumed one's only
        "consumed_samples": 20,
        "batches": 3,
        "groups_complete": 5,
        "infra_failed": 1,
        "infra_replaced": 1,
        "infra_failed_timeout": 1,
        "episodes": 13,
    }
    assert resume == {"cursor": 5, "settled": [], "pipeline": counters}
    assert metrics == Counter(counters)
