"""SamplePipeline in one process: a fake rollout whose samples finish when the test says so.

Each generate call waits on the test's release of that sample (an event), so the order in which
samples complete is chosen by the test; straggler deadlines run on a fake clock, so nothing sleeps
to let time pass.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import torch

from asyncrl.clock import FakeClock
from asyncrl.errors import StallError
from asyncrl.manifest.pipeline_section import PipelineSpec, StragglerSpec
from asyncrl.roles.generation.rollout import GenerateBatch, Prompt, Sample, SamplingParams
from asyncrl.roles.learning import algorithms as alg
from asyncrl.roles.learning.statistics import Moments
from asyncrl.roles.payloads import Scored
from asyncrl.roles.sampling.pipeline import BatchSettings, SamplePipeline, group_advantages
from asyncrl.roles.sampling.release import Release
from asyncrl.roles.training.learner_config import LearnerConfig
from asyncrl.roles.training.objective import batch_advantages
from asyncrl.transport import run

WAIT_S = 10.0
DUE_S = 0.5  # a straggler deadline, on the fake clock
G = 4  # group size
B = 8  # batch size: two groups


class FakeRollout:
    """Answers ``generate`` once the test releases the sample (or at once, with ``auto``)."""

    def __init__(self, *, auto: bool = False, chunks: int = 1) -> None:
        self.auto = auto
        self.chunks = chunks  # calls a sample takes: the first chunks - 1 come back partial
        self.version = 0
        self.gates: dict[tuple[str, int], asyncio.Event] = {}
        self.started: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        self.calls: list[tuple[str, int, int]] = []  # (prompt, index, tokens it had before)
        self.in_flight = 0
        self.peak = 0
        self.affinities: list[Any] = []

    def release(self, key: tuple[str, int]) -> None:
        self.gates.setdefault(key, asyncio.Event()).set()

    async def call(
        self,
        method: str,
        payload: Any = None,
        reply_type: Any = Any,
        *,
        timeout: float = 0.0,
        key: Any = None,
        affinity: Any = None,
    ) -> Any:
        assert method == "generate" and isinstance(payload, GenerateBatch)
        (request,) = payload.requests
        sid = (request.prompt.id, request.sample_index)
        before = request.partial.token_ids if request.partial is not None else []
        versions = request.partial.versions if request.partial is not None else []
        self.calls.append((sid[0], sid[1], len(before)))
        self.affinities.append(affinity)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        self.started.put_nowait(sid)
        version = self.version  # the weights a sample starts with
        try:
            if not self.auto:
                await self.gates.setdefault(sid, asyncio.Event()).wait()
        finally:
            self.in_flight -= 1
        tokens = [*before, 2 + len(before)]
        done = len(tokens) >= self.chunks
        return [
            Sample(
                prompt_id=sid[0],
                sample_index=sid[1],
                prompt_ids=request.prompt.token_ids,
                token_ids=tokens,
                logprobs=[-0.5] * len(tokens),
                versions=[*versions, version],
                finished=done,
                stop_reason="stop" if done else "chunk",
            )
        ]


def prompts(n: int) -> list[Prompt]:
    return [Prompt(id=f"p{i}", token_ids=[1, 2, 3], answer=str(i)) for i in range(n)]


def reward_of(sample: Sample) -> float:
    """A reward that differs within a group: a hash of the stable id, in [0, 1)."""
    return random.Random(f"{sample.prompt_id}:{sample.sample_index}").random()


class Feed:
    def __init__(self, total: int) -> None:
        self.data = prompts(total)
        self.asked: list[tuple[int, int]] = []

    async def __call__(self, cursor: int, n: int) -> list[Prompt]:
        self.asked.append((cursor, n))
        return self.data[cursor : cursor + n]


async def score(samples: list[Sample]) -> list[float]:
    return [reward_of(s) for s in samples]


def pipeline(
    rollout: FakeRollout,
    spec: PipelineSpec,
    feed: Feed | None = None,
    *,
    max_uniform_drops: int | None = None,
    **kwargs: Any,
) -> SamplePipeline:
    kwargs.setdefault("score", score)
    return SamplePipeline(
        rollout,
        spec=spec,
        settings=BatchSettings(batch_size=B, group_size=G, max_uniform_drops=max_uniform_drops),
        feed=feed or Feed(1000),
        params=SamplingParams(max_new_tokens=4),
        **kwargs,
    )


def uniform_for(*prompt_ids: str) -> Any:
    """A score function: reward 1.0 for every sample of the prompts named, ``reward_of`` for
    the others (which differs within a group)."""

    async def scored(samples: list[Sample]) -> list[float]:
        return [1.0 if s.prompt_id in prompt_ids else reward_of(s) for s in samples]

    return scored


async def started(rollout: FakeRollout, n: int) -> list[tuple[str, int]]:
    return [await asyncio.wait_for(rollout.started.get(), WAIT_S) for _ in range(n)]


async def until(condition: Callable[[], bool], turns: int = 1000) -> None:
    """Let the loop run until ``condition`` holds; fail after ``turns`` turns without it."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not reached after {turns} turns of the loop")


def test_advantages_equal_the_one_shot_computation_in_any_completion_order() -> None:
    async def main() -> None:
        rollout = FakeRollout()
        async with pipeline(rollout, PipelineSpec(mode="async", eta=1)) as pipe:
            # eta 1: two batches (four groups) in flight; complete them in a random order.
            sids = await started(rollout, 2 * B)
            random.Random(7).shuffle(sids)
            for sid in sids:
                rollout.release(sid)
            batches = [await asyncio.wait_for(pipe.next_batch(), WAIT_S) for _ in range(2)]
        samples = [s for b in batches for s in b.samples]
        assert sorted(s.sample.key for s in samples) == sorted(sids)
        ids = {}
        group_ids = torch.tensor([ids.setdefault(s.sample.prompt_id, len(ids)) for s in samples])
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        one_shot = alg.grpo_advantages(rewards, group_ids)
        got = torch.tensor([s.advantage for s in samples], dtype=torch.float64)
        assert torch.allclose(got, one_shot, rtol=1e-6, atol=1e-9)
        assert all(len(b.samples) == B for b in batches)

    run(main())


@pytest.mark.parametrize("std", ["population", "unbiased"])
def test_group_advantages_match_grpo_without_std_too(std: str) -> None:
    """The pipeline's advantages equal the learner's one-shot ones for either std
    convention, and a group of one sample gets 0 like there."""
    rewards = [0.0, 1.0, 1.0, 0.25, 3.0]
    for normalize in (True, False):
        expected = alg.grpo_advantages(torch.tensor(rewards), normalize_std=normalize, std=std)
        got = group_advantages(rewards, normalize_std=normalize, std=std)
        assert torch.allclose(torch.tensor(got), expected, rtol=1e-6)
    alone = group_advantages([0.7], std=std)
    assert alone == alg.grpo_advantages(torch.tensor([0.7]), std=std).tolist() == [0.0]


@pytest.mark.parametrize("std", ["population", "unbiased"])
@pytest.mark.parametrize("normalize", [True, False])
def test_the_pipeline_and_the_learner_compute_identical_advantages(
    std: str, normalize: bool
) -> None:
    """The advantages the pipeline attaches are, to the bit, those the learner computes over
    the same samples sent without them: groups completed in a random order, a uniform group
    whose mean 0.1 is not a binary fraction, and groups of one sample."""

    async def scored(samples: list[Sample]) -> list[float]:
        return [0.1 if s.prompt_id == "p1" else 3 * reward_of(s) - 1 for s in samples]

    async def batches(group_size: int, order_seed: int) -> list[Scored]:
        rollout = FakeRollout()
        spec = PipelineSpec(mode="async", eta=1)
        async with SamplePipeline(
            rollout,
            spec=spec,
            feed=Feed(1000),
            params=SamplingParams(max_new_tokens=4),
            settings=BatchSettings(
                batch_size=2 * group_size, group_size=group_size, normalize_std=normalize, std=std
            ),
            score=scored,
        ) as pipe:
            sids = await started(rollout, 4 * group_size)
            random.Random(order_seed).shuffle(sids)
            for sid in sids:
                rollout.release(sid)
            got = [await asyncio.wait_for(pipe.next_batch(), WAIT_S) for _ in range(2)]
        return [s for b in got for s in b.samples]

    config = LearnerConfig(normalize_std=normalize, std=std)  # type: ignore[arg-type]
    for group_size, seed in [(G, 7), (G, 8), (1, 7)]:
        samples = run(batches(group_size, seed))
        given = [s.advantage for s in samples]
        bare = [msgspec.structs.replace(s, advantage=None) for s in samples]
        assert batch_advantages(config, "grpo", bare) == given
        assert batch_advantages(config, "grpo", bare[::-1]) == given[::-1]
        if group_size == 1:
            assert given == [0.0] * len(samples)
        else:
            assert [s.advantage for s in samples if s.sample.prompt_id == "p1"] == [0.0] * G
            others = [s.advantage for s in samples if s.sample.prompt_id != "p1"]
            assert others and 0.0 not in others


def test_sync_mode_keeps_one_batch_in_flight_and_waits_for_the_learner() -> None:
    async def main() -> None:
        rollout = FakeRollout(auto=True)
        async with pipeline(rollout, PipelineSpec(mode="sync", eta=5)) as pipe:
            first = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            assert rollout.peak <= B
            for _ in range(10):
                await asyncio.sleep(0)
            # No learner step yet: nothing beyond the first batch was admitted.
            assert len(rollout.calls) == B
            rollout.version = 1  # the program syncs the weights before the next batch
            pipe.advance(1)
            second = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            assert len(rollout.calls) == 2 * B
        assert first.version == 0 and second.version == 1
        assert first.staleness == [0] * B and second.staleness == [0] * B
        assert {s.sample.prompt_id for s in first.samples} == {"p0", "p1"}
        assert {s.sample.prompt_id for s in second.samples} == {"p2", "p3"}

    run(main())


def test_async_mode_runs_eta_versions_ahead_and_no_further() -> None:
    async def main() -> None:
        rollout = FakeRollout()
        spec = PipelineSpec(mode="async", eta=2, overprovision=G)
        async with pipeline(rollout, spec) as pipe:
            await started(rollout, (2 + 1) * B + G)
            for _ in range(10):
                await asyncio.sleep(0)
            assert len(rollout.calls) == 3 * B + G  # the window, nothing more
            pipe.advance(1)
            await started(rollout, B)  # one learner step: one more batch may start
            for _ in range(10):
                await asyncio.sleep(0)
            assert len(rollout.calls) == 4 * B + G
            assert pipe.pacer.max_ahead <= G

    run(main())


def test_a_resumed_pipeline_paces_from_the_resumed_version() -> None:
    async def main() -> None:
        rollout = FakeRollout()
        feed = Feed(1000)
        spec = PipelineSpec(mode="async", eta=1)
        async with pipeline(rollout, spec, feed, start_version=5, resume={"cursor": 40}) as pipe:
            await started(rollout, 2 * B)
            for _ in range(10):
                await asyncio.sleep(0)
            # Version 5 does not mean five batches of room: the window is eta + 1 batches.
            assert len(rollout.calls) == 2 * B
            assert feed.asked[0] == (40, B // G)
            assert pipe.cursor == 40
            assert {p for p, _, _ in rollout.calls} == {f"p{i}" for i in range(40, 44)}

    run(main())


def test_stale_groups_are_dropped_and_refilled_under_drop() -> None:
    async def main() -> None:
        rollout = FakeRollout()
        spec = PipelineSpec(mode="async", eta=1, over_eta="drop")
        async with pipeline(rollout, spec) as pipe:
            sids = await started(rollout, 2 * B)
            late_group = {s for s in sids if s[0] == "p0"}
            for sid in sids:
                if sid not in late_group:
                    rollout.release(sid)
            # Three learner steps pass while p0 is still generating at version 0.
            for version in (1, 2, 3):
                batch = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
                assert "p0" not in {s.sample.prompt_id for s in batch.samples}
                pipe.advance(version)
                rollout.version = version
                for sid in await started(rollout, B):
                    rollout.release(sid)
            for sid in late_group:
                rollout.release(sid)
            # p0 is now ready, behind the groups released before it; it is never consumed.
            version = 3
            while not pipe.metrics["groups_over_eta_dropped"] and version < 8:
                batch = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
                assert max(batch.staleness) <= 1
                assert "p0" not in {s.sample.prompt_id for s in batch.samples}
                version += 1
                pipe.advance(version)
                rollout.version = version
                for sid in await started(rollout, B):
                    rollout.release(sid)
            assert pipe.metrics["groups_over_eta_dropped"] == 1
            assert pipe.metrics["wasted_samples"] == G
            # The dropped group's room was refilled by a fresh prompt.
            assert pipe.pacer.wasted == G

    run(main())


def test_stale_groups_are_kept_for_correction_under_correct() -> None:
    async def main() -> None:
        rollout = FakeRollout()
        spec = PipelineSpec(mode="async", eta=0, over_eta="correct")
        async with pipeline(rollout, spec) as pipe:
            sids = await started(rollout, B)
            pipe.advance(1)
            pipe.advance(2)
            for sid in sids:
                rollout.release(sid)
            batch = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            assert batch.staleness == [2] * B
            assert batch.metrics["staleness_max"] == 2
            assert pipe.metrics["groups_over_eta_corrected"] == 2
            assert pipe.metrics["wasted_samples"] == 0

    run(main())


@pytest.mark.parametrize("policy", ["emit", "drop", "wait"])
def test_a_straggler_follows_the_policy(policy: str) -> None:
    async def main() -> None:
        rollout = FakeRollout()
        clock = FakeClock()
        straggler = StragglerSpec(policy=policy, deadline_s=DUE_S)
        spec = PipelineSpec(mode="sync", straggler=straggler)
        async with pipeline(rollout, spec, clock=clock) as pipe:
            sids = await started(rollout, B)  # p0 and p1
            stuck = ("p0", 3)
            for sid in sids:
                if sid != stuck:
                    rollout.release(sid)
            await until(lambda: pipe.release.reducer.metrics["contributions"] == B - 1)
            assert pipe.metrics["groups_complete"] == 1  # p1; p0 waits for its last sample
            clock.advance(DUE_S)
            if policy == "drop":
                # p0 is dropped at its deadline and a fresh prompt takes its room.
                fresh = await started(rollout, G)
                assert {p for p, _ in fresh} == {"p2"}
                for sid in fresh:
                    rollout.release(sid)
            elif policy == "wait":
                assert pipe.release.reducer.metrics["overdue"] == 1
                assert pipe.metrics["groups_complete"] == 1  # p0 still waits
                rollout.release(stuck)
            batch = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            groups = {s.sample.prompt_id for s in batch.samples}
            if policy == "emit":
                p0 = [s for s in batch.samples if s.sample.prompt_id == "p0"]
                assert sorted(s.sample.sample_index for s in p0) == [0, 1, 2]
                rewards = [s.reward for s in p0]
                expected = alg.grpo_advantages(torch.tensor(rewards, dtype=torch.float64))
                got = torch.tensor([s.advantage for s in p0], dtype=torch.float64)
                assert torch.allclose(got, expected)
                assert pipe.metrics["groups_partial"] == 1
                assert pipe.metrics["wasted_samples"] == 1
                assert len(batch.samples) == B - 1
            elif policy == "drop":
                assert groups == {"p1", "p2"}
                assert pipe.metrics["groups_dropped"] == 1
                assert pipe.metrics["wasted_samples"] == G
                assert len(batch.samples) == B
            else:
                assert groups == {"p0", "p1"}
                assert pipe.metrics["groups_complete"] == 2
                assert pipe.metrics["wasted_samples"] == 0
                assert len(batch.samples) == B

    run(main())


def test_partial_rollouts_are_resumed_until_finished() -> None:
    async def main() -> None:
        rollout = FakeRollout(auto=True, chunks=3)
        async with pipeline(rollout, PipelineSpec(mode="sync")) as pipe:
            batch = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
        assert all(len(s.sample.token_ids) == 3 and s.sample.finished for s in batch.samples)
        # Each sample: one call per chunk, each continuing from the tokens made before.
        per_sample: dict[tuple[str, int], list[int]] = {}
        for p, k, before in rollout.calls:
            per_sample.setdefault((p, k), []).append(before)
        assert all(v == [0, 1, 2] for v in per_sample.values())
        assert pipe.metrics["resumed"] == 2 * B

    run(main())


def test_the_end_of_the_prompts_ends_the_batches() -> None:
    async def main() -> None:
        rollout = FakeRollout(auto=True)
        async with pipeline(rollout, PipelineSpec(mode="async"), Feed(3)) as pipe:
            batch = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            assert len(batch.samples) == B
            last = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            assert [s.sample.prompt_id for s in last.samples] == ["p2"] * G
            assert last.cursor == 3
            with pytest.raises(EOFError):
                await asyncio.wait_for(pipe.next_batch(), WAIT_S)

    run(main())


def test_running_statistics_are_tagged_by_the_consuming_version() -> None:
    async def main() -> None:
        rollout = FakeRollout(auto=True)
        spec = PipelineSpec(mode="sync", running_stats=True)
        rewards: list[float] = []
        async with pipeline(rollout, spec) as pipe:
            for version in range(3):
                batch = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
                rewards += [s.reward for s in batch.samples]
                pipe.advance(version + 1)
        assert sorted(pipe.running) == [0, 1, 2]
        assert all(m.count == B for m in pipe.running.values())
        whole = Moments.of(rewards)
        assert batch.metrics["reward_running_mean"] == pytest.approx(whole.mean, rel=1e-9)
        assert batch.metrics["reward_running_std"] == pytest.approx(whole.std, rel=1e-9)
        assert batch.metrics["pacer_max_ahead"] <= 0

    run(main())


@pytest.mark.parametrize("affinity", [False, True])
def test_group_affinity_asks_the_dispatcher_to_keep_a_group_together(affinity: bool) -> None:
    async def main() -> None:
        rollout = FakeRollout(auto=True)
        async with pipeline(rollout, PipelineSpec(mode="sync", group_affinity=affinity)) as pipe:
            await asyncio.wait_for(pipe.next_batch(), WAIT_S)
        expected = [p if affinity else None for p, _, _ in rollout.calls]
        assert rollout.affinities == expected

    run(main())


def test_a_pipeline_that_cannot_progress_says_so_at_once() -> None:
    """Sync mode without advance(): the pacer never has room again, nothing is in flight; the
    next batch raises StallError naming the pacer instead of waiting forever."""

    async def main() -> None:
        rollout = FakeRollout(auto=True)
        async with pipeline(rollout, PipelineSpec(mode="sync")) as pipe:
            await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            with pytest.raises(StallError) as err:
                await asyncio.wait_for(pipe.next_batch(), WAIT_S)
        assert "pacer at learner version 0, room 0 sample(s)" in str(err.value)
        assert "call advance(version) after each learner step" in str(err.value)

    run(main())


def test_a_waiting_pipeline_is_not_a_stall() -> None:
    """Samples still generating: next_batch waits for them, it does not raise."""

    async def main() -> None:
        rollout = FakeRollout()
        async with pipeline(rollout, PipelineSpec(mode="sync")) as pipe:
            sids = await started(rollout, B)
            waiting = asyncio.ensure_future(pipe.next_batch())
            await asyncio.sleep(0)
            assert not waiting.done()
            assert "8 sample(s) generating" in pipe.describe()
            for sid in sids:
                rollout.release(sid)
            batch = await asyncio.wait_for(waiting, WAIT_S)
        assert len(batch.samples) == B

    run(main())


def test_a_resumed_pipeline_admits_from_the_cursor_and_skips_what_was_settled() -> None:
    """Async, eta 1: complete the second batch's groups before the first's; the resume state of
    the first batch consumed (the later groups) lists them, and a pipeline built from it admits
    the unsettled groups again, skips the settled ones, and counts on from there."""

    async def main() -> None:
        rollout = FakeRollout()
        async with pipeline(rollout, PipelineSpec(mode="async", eta=1)) as pipe:
            sids = await started(rollout, 2 * B)
            for sid in sids[B:]:  # groups p2 and p3 complete first
                rollout.release(sid)
            first = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
        assert {s.sample.prompt_id for s in first.samples} == {"p2", "p3"}
        resume = first.resume
        assert resume["cursor"] == 0 and resume["settled"] == [2, 3]
        assert resume["pipeline"]["consumed_samples"] == B
        assert resume["pipeline"]["admitted_samples"] == B  # p0, p1 are in flight: not counted

        again = FakeRollout(auto=True)
        async with pipeline(again, PipelineSpec(mode="async", eta=1), resume=resume) as pipe:
            batch = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            assert {s.sample.prompt_id for s in batch.samples} == {"p0", "p1"}
            pipe.advance(1)
            batch = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            assert {s.sample.prompt_id for s in batch.samples} == {"p4", "p5"}
        assert all(call[0] not in ("p2", "p3") for call in again.calls)
        assert pipe.metrics["consumed_samples"] == 3 * B

    run(main())


# -- dynamic sampling ---------------------------------------------------------------------


def test_uniform_groups_are_dropped_and_refilled_and_stay_settled_on_resume() -> None:
    """Async, eta 1, drop_uniform: p1's rewards are all equal. It is dropped the moment it is
    released, counted, and p4 takes its room; the batch keeps its size. The resume state lists
    p1 as settled, so the resumed run never generates it again."""

    async def main() -> None:
        rollout = FakeRollout()
        spec = PipelineSpec(mode="async", eta=1, drop_uniform=True)
        async with pipeline(rollout, spec, score=uniform_for("p1")) as pipe:
            sids = await started(rollout, 2 * B)  # p0 .. p3: the window
            for sid in sids:
                if sid[0] == "p1":
                    rollout.release(sid)
            fresh = await started(rollout, G)
            assert {p for p, _ in fresh} == {"p4"}
            assert pipe.pacer.room() == 0  # the refill stays within the window
            assert (pipe.metrics["groups_uniform_dropped"], pipe.metrics["wasted_samples"]) == (
                1,
                G,
            )
            for sid in sids:
                if sid[0] in ("p2", "p3"):
                    rollout.release(sid)
            first = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
        assert {s.sample.prompt_id for s in first.samples} == {"p2", "p3"}
        assert len(first.samples) == B
        assert first.metrics["groups_uniform_dropped"] == 1
        assert first.metrics["samples_uniform_dropped"] == G
        resume = first.resume
        assert resume["cursor"] == 0 and resume["settled"] == [1, 2, 3]
        assert resume["pipeline"]["groups_uniform_dropped"] == 1
        assert resume["pipeline"]["admitted_groups"] == 3  # p0 and p4 are in flight

        again = FakeRollout(auto=True)
        resumed = pipeline(again, spec, resume=resume, score=uniform_for("p1"))
        async with resumed as pipe:
            batch = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
        assert {s.sample.prompt_id for s in batch.samples} == {"p0", "p4"}
        assert {call[0] for call in again.calls} == {"p0", "p4", "p5", "p6"}
        assert pipe.metrics["groups_uniform_dropped"] == 1
        assert pipe.metrics["consumed_samples"] == 2 * B

    run(main())


def test_uniform_groups_past_the_cap_are_kept_with_zero_advantages(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every group uniform, at most 3 dropped per batch: the fourth and fifth groups fill the
    batch with zero advantages instead of admitting prompts forever; the count starts again
    with the next batch. The warning is given for the first capped batch, not every one."""

    async def main() -> None:
        rollout = FakeRollout(auto=True)
        everything = uniform_for(*(f"p{i}" for i in range(20)))
        spec = PipelineSpec(mode="sync", drop_uniform=True)
        async with pipeline(rollout, spec, score=everything, max_uniform_drops=3) as pipe:
            first = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            pipe.advance(1)
            second = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
        assert {s.sample.prompt_id for s in first.samples} == {"p3", "p4"}
        assert [s.advantage for s in first.samples] == [0.0] * B
        assert {s.sample.prompt_id for s in second.samples} == {"p8", "p9"}
        assert first.metrics["groups_uniform_dropped"] == 3
        assert first.metrics["groups_uniform_kept"] == 2
        assert pipe.metrics["groups_uniform_dropped"] == 6
        assert pipe.metrics["samples_uniform_dropped"] == 6 * G
        said = [r.getMessage() for r in caplog.records if "max_uniform_drops" in r.getMessage()]
        assert len(said) == 1 and "(1 batches so far; said again every 50)" in said[0]
        assert "every reward scored since then was 1;" in said[0]
        assert pipe.metrics["batches_uniform_capped"] == 2
        assert pipe.metrics["admitted_samples"] == (
            pipe.metrics["consumed_samples"] + pipe.metrics["wasted_samples"]
        )

    run(main())


def test_a_capped_batch_whose_rewards_differ_is_counted_not_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every group uniform, but even prompts score 1.0 and odd ones 0.0 (a policy that is
    sure of each prompt: what dynamic sampling expects late in a run): the capped batches are
    counted in ``batches_uniform_capped`` and logged at debug, with no warning."""

    async def everything_uniform(samples: list[Sample]) -> list[float]:
        return [float(int(s.prompt_id[1:]) % 2 == 0) for s in samples]

    async def main() -> None:
        rollout = FakeRollout(auto=True)
        spec = PipelineSpec(mode="sync", drop_uniform=True)
        caplog.set_level(logging.DEBUG)
        async with pipeline(rollout, spec, score=everything_uniform, max_uniform_drops=3) as pipe:
            first = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            pipe.advance(1)
            second = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
        assert first.metrics["batches_uniform_capped"] == 1
        assert second.metrics["batches_uniform_capped"] == 2
        capped = [r for r in caplog.records if "max_uniform_drops" in r.getMessage()]
        assert [r.levelno for r in capped] == [logging.DEBUG, logging.DEBUG]
        assert not [r for r in caplog.records if "Is the reward constant" in r.getMessage()]

    run(main())


def test_in_async_mode_the_batches_in_flight_share_their_drops() -> None:
    """Async, eta 1, at most 3 uniform drops a batch, every group uniform: the two batches in
    flight bring 6 drops, so six groups are dropped before the first batch is handed out (a
    count that started again at each batch would keep the fourth, whichever batch it was
    admitted for). Each batch handed out brings 3 more: over any run, at most 3 a batch handed
    out plus the 6 of the batches in flight."""

    async def main() -> None:
        rollout = FakeRollout(auto=True)
        everything = uniform_for(*(f"p{i}" for i in range(40)))
        spec = PipelineSpec(mode="async", eta=1, drop_uniform=True)
        async with pipeline(rollout, spec, score=everything, max_uniform_drops=3) as pipe:
            first = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            assert first.metrics["groups_uniform_dropped"] == 6
            assert {s.sample.prompt_id for s in first.samples} == {"p6", "p7"}
            assert [s.advantage for s in first.samples] == [0.0] * B
            for version in range(1, 4):
                pipe.advance(version)
                # The window is full and every group in it released: the drops are spent.
                await until(lambda: pipe.pacer.room() == 0 and len(pipe.release.ready) == 4)
                assert pipe.metrics["groups_uniform_dropped"] == 6 + 3 * version
                assert pipe.release.drops_left == 0
                await asyncio.wait_for(pipe.next_batch(), WAIT_S)
                assert pipe.release.drops_left == 3
        assert pipe.metrics["batches_uniform_capped"] == 4
        assert pipe.metrics["admitted_samples"] == (
            pipe.metrics["consumed_samples"] + pipe.metrics["wasted_samples"] + 2 * G  # ready
        )

    run(main())


def test_the_manifests_drops_per_group_sets_the_cap() -> None:
    """``uniform_drops_per_group: 1`` and batches of two groups: at most two uniform groups
    dropped per batch (the default, 4 a group, would drop eight)."""

    async def main() -> None:
        rollout = FakeRollout(auto=True)
        everything = uniform_for(*(f"p{i}" for i in range(20)))
        spec = PipelineSpec(mode="sync", drop_uniform=True, uniform_drops_per_group=1)
        async with pipeline(rollout, spec, score=everything) as pipe:
            assert pipe.release.max_uniform_drops == B // G
            first = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
        assert {s.sample.prompt_id for s in first.samples} == {"p2", "p3"}
        assert first.metrics["groups_uniform_dropped"] == 2
        assert first.metrics["groups_uniform_kept"] == 2
        assert PipelineSpec().uniform_drops_per_group == 4

    run(main())


def test_the_scored_reward_counts_the_dropped_groups_and_the_batch_mean_does_not() -> None:
    """Sync, drop_uniform: p0 and p1 score 1.0 throughout and are dropped; p2 and p3 fill the
    batch. ``reward_scored_mean`` is the mean over all four groups scored for it (the
    policy's reward), the batch's own mean only over the two it kept."""

    async def main() -> None:
        rollout = FakeRollout(auto=True)
        spec = PipelineSpec(mode="sync", drop_uniform=True)
        async with pipeline(rollout, spec, score=uniform_for("p0", "p1")) as pipe:
            batch = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
        kept = [s.reward for s in batch.samples]
        assert {s.sample.prompt_id for s in batch.samples} == {"p2", "p3"}
        assert batch.metrics["groups_uniform_dropped"] == 2
        assert batch.metrics["reward_scored_mean"] == pytest.approx((2 * G + sum(kept)) / (4 * G))
        assert sum(kept) / len(kept) < batch.metrics["reward_scored_mean"]

    run(main())


def test_drop_uniform_off_keeps_uniform_groups_and_on_needs_groups_of_two() -> None:
    async def main() -> None:
        rollout = FakeRollout(auto=True)
        async with pipeline(rollout, PipelineSpec(mode="sync"), score=uniform_for("p0")) as pipe:
            batch = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
        assert {s.sample.prompt_id for s in batch.samples} == {"p0", "p1"}
        assert pipe.metrics["groups_uniform_dropped"] == 0

    run(main())
    with pytest.raises(ValueError) as err:
        SamplePipeline(
            FakeRollout(),
            spec=PipelineSpec(drop_uniform=True),
            feed=Feed(4),
            score=score,
            params=SamplingParams(),
            settings=BatchSettings(batch_size=B, group_size=1),
        )
    assert str(err.value) == (
        "drop_uniform needs group_size >= 2: a group of one sample is always uniform, so every "
        "group would be dropped; raise group_size or set drop_uniform false"
    )


def test_a_partial_group_with_uniform_rewards_is_dropped_whole() -> None:
    """Straggler policy emit and drop_uniform: p0 is emitted at its deadline with three samples
    of equal reward; it is dropped (its missing sample is waste too), and p2 takes its room."""

    async def main() -> None:
        rollout = FakeRollout()
        clock = FakeClock()
        straggler = StragglerSpec(policy="emit", deadline_s=DUE_S)
        spec = PipelineSpec(mode="sync", straggler=straggler, drop_uniform=True)
        async with pipeline(rollout, spec, score=uniform_for("p0"), clock=clock) as pipe:
            for sid in await started(rollout, B):
                if sid != ("p0", 3):
                    rollout.release(sid)
            await until(lambda: pipe.release.reducer.metrics["contributions"] == B - 1)
            clock.advance(DUE_S)
            fresh = await started(rollout, G)
            assert {p for p, _ in fresh} == {"p2"}
            for sid in fresh:
                rollout.release(sid)
            batch = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
        assert {s.sample.prompt_id for s in batch.samples} == {"p1", "p2"}
        m = pipe.metrics
        assert (m["groups_partial"], m["groups_uniform_dropped"]) == (1, 1)
        assert (m["samples_uniform_dropped"], m["wasted_samples"]) == (G - 1, G)

    run(main())


# -- failures in the background -----------------------------------------------------------


def test_an_error_in_the_score_function_is_raised_by_next_batch_and_stops_the_rest() -> None:
    """A programming error in the score function: next_batch raises it, the samples still
    generating are cancelled, later calls raise it again, and closing does not raise it twice."""

    async def broken(samples: list[Sample]) -> list[float]:
        raise TypeError("score() cannot read a Sample")

    async def main() -> None:
        rollout = FakeRollout()
        async with pipeline(rollout, PipelineSpec(mode="async", eta=1), score=broken) as pipe:
            sids = await started(rollout, 2 * B)
            rollout.release(sids[0])  # one sample is scored; the others keep generating
            with pytest.raises(TypeError) as err:
                await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            assert str(err.value) == "score() cannot read a Sample"
            await until(lambda: rollout.in_flight == 0)  # the other samples were cancelled
            with pytest.raises(TypeError):
                await pipe.next_batch()
        assert pipe.metrics["generated_samples"] == 1

    run(main())


def test_an_error_in_the_release_of_a_group_is_raised_by_next_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The release of a group raises: it runs in the reducer's callback, outside any task, and
    must reach next_batch all the same."""

    def broken(self: Release, released: Any) -> None:
        raise TypeError(f"cannot release {released.key}")

    monkeypatch.setattr(Release, "group_released", broken)

    async def main() -> None:
        rollout = FakeRollout(auto=True)
        pipe = pipeline(rollout, PipelineSpec(mode="sync"), Feed(100))
        async with pipe:
            with pytest.raises(TypeError) as err:
                await asyncio.wait_for(pipe.next_batch(), WAIT_S)
        assert str(err.value) == "cannot release p0"
        # p1 completes in the same scoring call, before the cancellation lands: both counted.
        assert pipe.release.reducer.metrics["callback_errors"] == 2

    run(main())


def test_a_failure_no_next_batch_raised_is_raised_on_closing() -> None:
    """The score fails after the last batch was handed out: leaving the pipeline raises it."""
    failed = asyncio.Event()

    async def fails_after_p1(samples: list[Sample]) -> list[float]:
        if any(s.prompt_id not in ("p0", "p1") for s in samples):
            failed.set()
            raise TypeError("score() cannot read a Sample")
        return [reward_of(s) for s in samples]

    async def main() -> None:
        rollout = FakeRollout(auto=True)
        with pytest.raises(TypeError) as err:
            async with pipeline(rollout, PipelineSpec(mode="sync"), score=fails_after_p1) as pipe:
                await asyncio.wait_for(pipe.next_batch(), WAIT_S)
                pipe.advance(1)
                await asyncio.wait_for(failed.wait(), WAIT_S)
        assert str(err.value) == "score() cannot read a Sample"

    run(main())


def test_what_a_sample_source_counts_is_not_counted_twice_across_a_resume() -> None:
    """A source's counters (an episode runner's episodes, turns, restarts) of groups still in
    flight leave the resume state as their samples do: the resumed run produces them again."""
    from collections import Counter

    from asyncrl.roles.sampling.contract import Generate

    def counting(rollout: FakeRollout) -> Any:
        generate = Generate(rollout, SamplingParams(max_new_tokens=4), timeout=WAIT_S)

        async def source(prompt: Prompt, index: int, metrics: Counter[str]) -> Sample:
            sample = await generate(prompt, index, metrics)
            metrics["episodes"] += 1  # as asyncrl.roles.agents.episodes.count does
            return sample

        return source

    async def main() -> tuple[dict[str, Any], Counter[str]]:
        spec = PipelineSpec(mode="async", eta=1)
        rollout = FakeRollout()
        async with pipeline(rollout, spec, source=counting(rollout)) as pipe:
            sids = await started(rollout, 2 * B)
            for sid in [*sids[B:], ("p0", 0), ("p0", 1)]:  # p0 half done, in flight
                rollout.release(sid)
            await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            await until(lambda: pipe.metrics["episodes"] == B + 2)
            resume = pipe.resume_state()
        again = FakeRollout(auto=True)
        async with pipeline(again, spec, resume=resume, source=counting(again)) as pipe:
            await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            await until(lambda: pipe.metrics["generated_samples"] >= 2 * B)
            return resume, Counter(pipe.metrics)

    resume, after = run(main())
    counters = resume["pipeline"]
    assert counters["episodes"] == counters["generated_samples"] == B
    assert after["episodes"] == after["generated_samples"]


# -- counting across a resume -------------------------------------------------------------


def test_groups_released_and_not_consumed_are_counted_once_across_a_resume() -> None:
    """Async, eta 1, straggler emit: p0, p1 and p3 are released whole and p2 partial at its
    deadline (its fourth sample, scored after that, is late); the first batch takes p0 and p1.
    p2 and p3 are released and not consumed, so the resumed run generates and releases them
    again: the resume state leaves out what their release counted, as it leaves out their
    admission, and no group is counted released more often than admitted."""

    p2_last = ("p2", 3)
    scoring_late = asyncio.Event()
    go_on = asyncio.Event()

    async def late_for_p2(samples: list[Sample]) -> list[float]:
        if any((s.prompt_id, s.sample_index) == p2_last for s in samples):
            scoring_late.set()
            await go_on.wait()
        return await score(samples)

    async def main() -> tuple[dict[str, Any], dict[str, int], dict[str, int]]:
        rollout, clock = FakeRollout(), FakeClock()
        spec = PipelineSpec(
            mode="async", eta=1, straggler=StragglerSpec(policy="emit", deadline_s=DUE_S)
        )
        async with pipeline(rollout, spec, score=late_for_p2, clock=clock) as pipe:
            sids = await started(rollout, 2 * B)  # p0 .. p3: the window
            for sid in sids:
                if sid[0] in ("p0", "p1"):
                    rollout.release(sid)
            await until(lambda: pipe.metrics["groups_complete"] == 2)
            for sid in sids:
                if sid[0] in ("p2", "p3") and sid != p2_last:
                    rollout.release(sid)
            await until(lambda: pipe.release.reducer.metrics["contributions"] == 2 * B - 1)
            rollout.release(p2_last)
            await asyncio.wait_for(scoring_late.wait(), WAIT_S)
            clock.advance(DUE_S)  # p2 is released with three samples
            await until(lambda: pipe.metrics["groups_partial"] == 1)
            go_on.set()
            await until(lambda: pipe.metrics["late_samples"] == 1)
            first = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            assert {s.sample.prompt_id for s in first.samples} == {"p0", "p1"}
            assert [g.key for g in pipe.release.ready] == ["p3", "p2"]
            before = dict(pipe.metrics)
            # p3 and p2 are in flight with their samples less p2's missing one (waste already).
            assert pipe.in_flight == 2 * G - 1
            assert before["admitted_samples"] == (
                before["consumed_samples"] + before["wasted_samples"] + pipe.in_flight
            )
        again = FakeRollout(auto=True)
        async with pipeline(again, spec, resume=first.resume, clock=FakeClock()) as pipe:
            second = await asyncio.wait_for(pipe.next_batch(), WAIT_S)
            assert {s.sample.prompt_id for s in second.samples} == {"p2", "p3"}
        return first.resume["pipeline"], before, second.resume["pipeline"]

    resumed_at, before, after = run(main())
    assert (before["admitted_groups"], before["groups_complete"]) == (4, 3)
    assert (before["groups_partial"], before["wasted_samples"], before["late_samples"]) == (1, 1, 1)
    assert before["scored_samples"] == 2 * B  # the late one included
    # The resume state counts p0 and p1: admitted, released whole and consumed; nothing wasted.
    assert resumed_at["admitted_groups"] == resumed_at["groups_complete"] == 2
    assert resumed_at["admitted_samples"] == resumed_at["consumed_samples"] == B
    assert resumed_at["scored_samples"] == B
    for name in ("groups_partial", "wasted_samples", "late_samples"):
        assert name not in resumed_at, name
    # p2 and p3, generated again, are counted released once each.
    assert after["admitted_groups"] == after["groups_complete"] == 4
    assert after["scored_samples"] == 2 * B
    assert after["admitted_samples"] == after["consumed_samples"] + after.get("wasted_samples", 0)
