"""The sample pipeline's rule for samples that failed through no fault of the policy
(``Sample.infra_failed``, ``pipeline.infra_failed``), in one process with a fake source: such a
sample is never handed to the learner; its group is completed by one fresh sample of the same
prompt, or dropped whole, and every sample stays accounted for."""

from __future__ import annotations

import asyncio
from collections import Counter

import msgspec
import pytest

from asyncrl.manifest.pipeline_section import PipelineSpec
from asyncrl.roles.payloads import Prompt, Sample, SamplingParams
from asyncrl.roles.sampling.contract import Batch, BatchSettings, Generate
from asyncrl.roles.sampling.pipeline import SamplePipeline
from asyncrl.transport import run
from tests.sampling.test_pipeline import WAIT_S, B, FakeRollout, Feed, G, score


class Failing:
    """A sample source over an auto-answering fake rollout whose samples named in ``fail``
    come back flagged ``infra_failed`` with the causes given, one a call, in order."""

    def __init__(self, fail: dict[tuple[str, int], list[str]]) -> None:
        self.generate = Generate(
            FakeRollout(auto=True), SamplingParams(max_new_tokens=4), timeout=WAIT_S
        )
        self.fail = {k: list(v) for k, v in fail.items()}
        self.calls: Counter[tuple[str, int]] = Counter()

    async def __call__(self, prompt: Prompt, index: int, metrics: Counter[str]) -> Sample:
        self.calls[(prompt.id, index)] += 1
        sample = await self.generate(prompt, index, metrics)
        causes = self.fail.get((prompt.id, index))
        if causes:
            sample.infra_failed = causes.pop(0)
        return sample


def batch_of(source: Failing, rule: str) -> tuple[Batch, Counter[str], int]:
    """The first batch of a sync pipeline over ``source``, its counters once settled, and the
    samples still in flight."""

    async def main() -> tuple[Batch, Counter[str], int]:
        spec = PipelineSpec(mode="sync", infra_failed=rule)
        pipe = SamplePipeline(
            FakeRollout(auto=True),
            spec=spec,
            feed=Feed(1000),
            score=score,
            params=SamplingParams(max_new_tokens=4),
            settings=BatchSettings(batch_size=B, group_size=G),
            source=source,
        )
        async with pipe:
            batch = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            return batch, Counter(pipe.metrics), pipe.in_flight

    return run(main())


def lost(counters: Counter[str], in_flight: int) -> int:
    """Samples admitted and neither consumed, wasted nor in flight (``asyncrl accounting``)."""
    return (
        counters["admitted_samples"]
        - counters["consumed_samples"]
        - counters["wasted_samples"]
        - in_flight
    )


def test_an_infra_failed_sample_is_replaced_once_by_a_fresh_one_and_never_handed_out() -> None:
    source = Failing({("p0", 1): ["timeout"]})
    batch, counters, in_flight = batch_of(source, "replace")
    assert [(s.sample.prompt_id, s.sample.sample_index) for s in batch.samples] == [
        (p, k) for p in ("p0", "p1") for k in range(G)
    ]
    assert not any(s.sample.infra_failed for s in batch.samples)
    assert source.calls[("p0", 1)] == 2
    assert counters["infra_failed"] == counters["infra_failed_timeout"] == 1
    assert counters["infra_replaced"] == 1
    assert counters["groups_infra_dropped"] == 0
    assert counters["admitted_samples"] == counters["admitted_groups"] * G + 1
    assert counters["wasted_samples"] == 1
    assert batch.metrics["infra_failed"] == 1.0
    assert lost(counters, in_flight) == 0


def test_a_replacement_that_fails_too_drops_its_group_and_a_fresh_prompt_fills_the_batch() -> None:
    source = Failing({("p0", 1): ["error", "lost"]})
    batch, counters, in_flight = batch_of(source, "replace")
    assert sorted({s.sample.prompt_id for s in batch.samples}) == ["p1", "p2"]
    assert len(batch.samples) == B
    assert source.calls[("p0", 1)] == 2  # replaced exactly once
    assert counters["infra_failed"] == 2
    assert counters["infra_failed_error"] == counters["infra_failed_lost"] == 1
    assert counters["infra_replaced"] == 1
    assert counters["groups_infra_dropped"] == 1
    assert counters["wasted_samples"] == 1 + G  # the replaced sample, then the whole group
    assert lost(counters, in_flight) == 0


def test_under_drop_an_infra_failed_sample_drops_its_group_at_once() -> None:
    source = Failing({("p0", 1): ["timeout"]})
    batch, counters, in_flight = batch_of(source, "drop")
    assert sorted({s.sample.prompt_id for s in batch.samples}) == ["p1", "p2"]
    assert source.calls[("p0", 1)] == 1
    assert counters["infra_failed"] == counters["infra_failed_timeout"] == 1
    assert counters["infra_replaced"] == 0
    assert counters["groups_infra_dropped"] == 1
    assert counters["wasted_samples"] == G
    assert lost(counters, in_flight) == 0


def test_the_group_rule_defaults_to_replace_and_refuses_another_by_its_choices() -> None:
    assert PipelineSpec().infra_failed == "replace"
    with pytest.raises(msgspec.ValidationError, match=r"infra_failed"):
        msgspec.convert({"infra_failed": "retry"}, PipelineSpec)
