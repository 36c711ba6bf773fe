"""Prompt scheduling from what was scored: deferral of prompts whose groups were uniform, and
probing of new ones (asyncrl.roles.sampling.schedule), alone and in the sample pipeline."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from asyncrl.draws import unit
from asyncrl.manifest.pipeline_section import PipelineSpec, ScheduleSpec
from asyncrl.roles.generation.rollout import Prompt, Sample, SamplingParams
from asyncrl.roles.sampling.pipeline import BatchSettings, SamplePipeline
from asyncrl.roles.sampling.schedule import (
    ADMIT_MIN,
    EXPLORE_MIN,
    PromptSchedule,
    item_key,
    item_of,
)
from asyncrl.transport import run
from tests.sampling.test_pipeline import WAIT_S, FakeRollout, reward_of

G = 4
B = 8
ITEMS = 12
SOLVED = {"0", "3", "5", "8", "11"}  # items every sample of which is right: uniform groups


def test_item_of_strips_the_epoch_only() -> None:
    assert [item_of(p) for p in ("17@3", "a@b@0", "plain", "x@y")] == ["17", "a@b", "plain", "x@y"]


def test_a_uniform_streak_defers_a_prompt_by_explore_to_its_power() -> None:
    """Over many indices, an item with streak z comes back about explore**z of the time; an
    item whose last group was not uniform always comes back; the draws are fixed by the seed."""
    sched = PromptSchedule(ScheduleSpec(skip_uniform=True, explore=0.5), G, seed=7)
    sched.record("a@0", [1, 1, 1, 1])
    sched.record("b@0", [1, 1, 1, 1])
    sched.record("b@1", [0, 0, 0, 0])
    sched.record("c@0", [1, 0, 1, 1])
    n = 4000
    share = {item: sum(sched.admit(f"{item}@9", i) for i in range(n)) / n for item in "abcd"}
    assert share["a"] == pytest.approx(0.5, abs=0.03)
    assert share["b"] == pytest.approx(0.25, abs=0.03)
    assert share["c"] == share["d"] == 1.0
    again = PromptSchedule(ScheduleSpec(skip_uniform=True, explore=0.5), G, seed=7)
    again.record("a@0", [1, 1, 1, 1])
    assert [again.admit("a@5", i) for i in range(50)] == [sched.admit("a@5", i) for i in range(50)]
    other = PromptSchedule(ScheduleSpec(skip_uniform=True, explore=0.5), G, seed=8)
    other.record("a@0", [1, 1, 1, 1])
    assert [other.admit("a@5", i) for i in range(50)] != [sched.admit("a@5", i) for i in range(50)]
    assert (
        0.0
        <= min(unit(item_key(0, "x"), i) for i in range(100))
        < max(unit(item_key(0, "x"), i) for i in range(100))
        < 1.0
    )


def test_a_long_streak_still_comes_back_at_the_floor() -> None:
    sched = PromptSchedule(ScheduleSpec(skip_uniform=True, explore=EXPLORE_MIN), G, seed=3)
    for epoch in range(6):  # 0.02 ** 6: about 6e-11 without the floor
        sched.record(f"a@{epoch}", [0, 0, 0, 0])
    n = 20000
    share = sum(sched.admit("a@9", i) for i in range(n)) / n
    assert 0.85 / 64 < share < 1.15 / 64
    assert ADMIT_MIN == 1 / 64


def test_a_schedule_that_only_defers_never_ends_the_prompts() -> None:
    """Every group is uniform and unsolved (no reward but 0 is ever seen): nothing is retired,
    every item is deferred, ``explore`` sinks to its floor, and the pipeline still hands out
    batches well past the 4,096 skips in a row that end a schedule retiring every prompt."""

    async def nothing_right(samples: list[Sample]) -> list[float]:
        return [0.0 for _ in samples]

    async def main() -> None:
        schedule = ScheduleSpec(skip_uniform=True, explore=EXPLORE_MIN, retire_after=1)
        rollout = FakeRollout(auto=True)
        async with _pipeline(rollout, schedule, score=nothing_right, max_uniform_drops=0) as pipe:
            await _batches(pipe, 40)
        assert pipe.metrics["skipped_prompts"] > 4096
        assert pipe.metrics["retired_skips"] == 0

    run(main())


def test_probing_asks_for_a_few_samples_of_every_group() -> None:
    sched = PromptSchedule(ScheduleSpec(probe=2), G)
    sched.record("mixed@0", [0, 1, 1, 0])
    assert (sched.first("new@0"), sched.first("mixed@1")) == (2, 2)
    assert PromptSchedule(ScheduleSpec(probe=G), G).first("new@0") == G  # a probe of the whole
    assert PromptSchedule(ScheduleSpec(), G).first("new@0") == G
    assert not PromptSchedule(ScheduleSpec(), G).enabled


def test_explore_moves_towards_the_target_share_of_uniform_groups() -> None:
    spec = ScheduleSpec(skip_uniform=True, explore=0.5, target_uniform=0.3)
    sched = PromptSchedule(spec, G)
    for i in range(10):
        sched.record(f"{i}@0", [1, 1, 1, 1])  # all uniform: too many, defer more
    sched.end_batch()
    assert sched.explore == pytest.approx(0.4)
    for _ in range(500):
        sched.record("u@0", [1, 1, 1, 1])
        sched.end_batch()
    assert sched.explore == EXPLORE_MIN  # never below the floor
    for i in range(500):
        sched.record(f"m{i}@0", [1, 0, 0, 0])  # none uniform: defer less
        sched.end_batch()
    assert sched.explore == 1.0
    state = sched.state()
    resumed = PromptSchedule(spec, G, state=state)
    assert (resumed.streaks, resumed.explore) == (sched.streaks, sched.explore)


class Epochs:
    """A prompt feed over ITEMS items, epoch after epoch: index i is item i % ITEMS of epoch
    i // ITEMS, with the id ``<item>@<epoch>`` the prompt source gives."""

    async def __call__(self, cursor: int, n: int) -> list[Prompt]:
        return [
            Prompt(id=f"{i % ITEMS}@{i // ITEMS}", token_ids=[1, 2, 3], answer="")
            for i in range(cursor, cursor + n)
        ]


async def solved(samples: list[Sample]) -> list[float]:
    return [1.0 if item_of(s.prompt_id) in SOLVED else reward_of(s) for s in samples]


class CountingEpochs(Epochs):
    """``Epochs`` that records the size of every page asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    async def __call__(self, cursor: int, n: int) -> list[Prompt]:
        self.asked.append(n)
        return await super().__call__(cursor, n)


def _retiring_all_but_one(feed: Epochs) -> SamplePipeline:
    """A sync pipeline over ``feed`` whose schedule retires an item after one solved group,
    and a reward that solves every item but "1"."""

    async def all_but_one(samples: list[Sample]) -> list[float]:
        return [reward_of(s) if item_of(s.prompt_id) == "1" else 1.0 for s in samples]

    spec = PipelineSpec(mode="sync", drop_uniform=True, schedule=ScheduleSpec(retire_after=1))
    return SamplePipeline(
        FakeRollout(auto=True),
        spec=spec,
        feed=feed,
        score=all_but_one,
        params=SamplingParams(max_new_tokens=4),
        settings=BatchSettings(batch_size=B, group_size=G),
    )


def _pipeline(
    rollout: FakeRollout,
    schedule: ScheduleSpec,
    *,
    mode: str = "sync",
    score: Any = solved,
    max_uniform_drops: int | None = None,
    **kwargs: Any,
) -> SamplePipeline:
    spec = PipelineSpec(mode=mode, eta=2, drop_uniform=True, schedule=schedule)
    return SamplePipeline(
        rollout,
        spec=spec,
        settings=BatchSettings(batch_size=B, group_size=G, max_uniform_drops=max_uniform_drops),
        feed=Epochs(),
        score=score,
        params=SamplingParams(max_new_tokens=4),
        **kwargs,
    )


async def _batches(pipe: SamplePipeline, n: int) -> list[Any]:
    out = []
    for step in range(n):
        out.append(await asyncio.wait_for(pipe.next_batch(), WAIT_S))
        pipe.advance(step + 1)
    return out


def test_a_probe_that_agrees_drops_its_group_after_few_samples() -> None:
    """Probe 2 of 4: the solved items' groups stop after 2 samples, the others are generated
    whole and trained; every admitted sample is consumed or wasted."""

    async def main() -> None:
        rollout = FakeRollout(auto=True)
        async with _pipeline(rollout, ScheduleSpec(probe=2)) as pipe:
            batches = await _batches(pipe, 3)
        calls: dict[str, int] = {}
        for prompt, _, _ in rollout.calls:
            calls[prompt] = calls.get(prompt, 0) + 1
        for prompt, n in calls.items():
            assert n == (2 if item_of(prompt) in SOLVED else G), prompt
        trained = {s.sample.prompt_id for b in batches for s in b.samples}
        assert trained and not {item_of(p) for p in trained} & SOLVED
        m = pipe.metrics
        assert m["groups_probe_dropped"] == sum(item_of(p) in SOLVED for p in calls)
        assert m["wasted_samples"] == 2 * m["groups_probe_dropped"]
        assert m["generated_samples"] == len(rollout.calls)
        settled = m["consumed_samples"] + m["wasted_samples"]
        assert m["admitted_samples"] == settled + pipe.in_flight

    run(main())


def test_uniform_prompts_are_deferred_in_later_epochs_and_a_resume_decides_the_same() -> None:
    """With deferral, solved items come back in later epochs less often, skipped with nothing
    generated; mixed items are never skipped. A pipeline resumed after any batch makes the
    same decisions as the run that went on."""
    schedule = ScheduleSpec(skip_uniform=True, probe=2, explore=0.3, target_uniform=0.0)

    async def whole(steps: int) -> tuple[list[list[str]], Any]:
        rollout = FakeRollout(auto=True)
        async with _pipeline(rollout, schedule) as pipe:
            batches = await _batches(pipe, steps)
        return [[s.sample.prompt_id for s in b.samples] for b in batches], pipe

    async def resumed(steps: int, at: int) -> list[list[str]]:
        async with _pipeline(FakeRollout(auto=True), schedule) as pipe:
            first = await _batches(pipe, at)
        again = _pipeline(
            FakeRollout(auto=True), schedule, resume=first[-1].resume, start_version=at
        )
        async with again as pipe:
            rest = await _batches_from(pipe, at, steps - at)
        return [[s.sample.prompt_id for s in b.samples] for b in first + rest]

    async def _batches_from(pipe: SamplePipeline, start: int, n: int) -> list[Any]:
        out = []
        for step in range(start, start + n):
            out.append(await asyncio.wait_for(pipe.next_batch(), WAIT_S))
            pipe.advance(step + 1)
        return out

    async def main() -> None:
        steps = 12
        ids, pipe = await whole(steps)
        m = pipe.metrics
        assert m["skipped_prompts"] > 0
        assert all(not set(item_of(p) for p in b) & SOLVED for b in ids)
        for at in (1, 5):
            assert await resumed(steps, at) == ids

    run(main())


def test_a_schedule_without_dynamic_sampling_is_refused() -> None:
    with pytest.raises(ValueError, match=r"set pipeline\.drop_uniform: true"):
        PipelineSpec(schedule=ScheduleSpec(probe=2))


def test_a_prompt_solved_in_a_row_is_retired_and_an_unsolved_one_only_deferred() -> None:
    zeros = PromptSchedule(ScheduleSpec(retire_after=1), G)
    zeros.record("w@0", [0.0] * G)
    zeros.record("w@1", [0.0] * G)
    assert not zeros.retired("w@2")  # all zeros and nothing better seen: not "solved"
    sched = PromptSchedule(ScheduleSpec(retire_after=2), G)
    sched.record("w@0", [0.0, 0.0, 0.0, 0.0])
    sched.record("s@0", [1.0, 1.0, 1.0, 1.0])
    sched.record("m@0", [0.0, 1.0, 0.0, 1.0])
    assert [sched.admit(f"{i}@1", 0) for i in "swm"] == [True, True, True]
    sched.record("s@1", [1.0, 1.0, 1.0, 1.0])
    sched.record("w@1", [0.0, 0.0, 0.0, 0.0])
    assert (sched.retired("s@2"), sched.retired("w@2")) == (True, False)
    assert [sched.admit(f"s@{e}", e) for e in range(2, 20)] == [False] * 18
    assert sched.admit("w@2", 2)  # unsolved: never retired (no deferral asked for)
    resumed = PromptSchedule(ScheduleSpec(retire_after=2), G, state=sched.state())
    assert resumed.retired("s@9") and not resumed.retired("w@9")


def test_the_feed_is_asked_for_more_prompts_while_the_schedule_skips_them() -> None:
    """Every item but one is retired after its first group: the pipeline asks the feed for
    growing chunks, not one batch's worth at a time, while it skips."""

    async def main() -> None:
        feed = CountingEpochs()
        pipe = _retiring_all_but_one(feed)
        async with pipe:
            await _batches(pipe, 8)
        assert pipe.metrics["retired_skips"] > 0
        assert max(feed.asked) > B // G

    run(main())


def test_the_feed_pages_grow_with_the_share_the_schedule_skips() -> None:
    """Every item but one of twelve is retired after its first group, so the schedule admits one
    prompt in twelve and never skips more than eleven in a row: pages sized by the share it
    skips hold a batch's worth of admitted prompts each, where pages sized by the skips in a row
    held fewer than one (two calls to the feed for every prompt admitted)."""

    async def main() -> None:
        feed = CountingEpochs()
        pipe = _retiring_all_but_one(feed)
        async with pipe:
            for step in range(24):
                if step == 4:  # the share skipped is learnt: count from here
                    admitted, calls = pipe.metrics["admitted_groups"], len(feed.asked)
                await asyncio.wait_for(pipe.next_batch(), WAIT_S)
                pipe.advance(step + 1)
            admitted, calls = pipe.metrics["admitted_groups"] - admitted, len(feed.asked) - calls
        assert pipe.metrics["retired_skips"] > 10 * admitted
        assert admitted >= 40
        # A batch's worth is B // G = 2 prompts: a page holds about two admitted ones.
        assert calls * 3 <= admitted * 2, (calls, admitted, feed.asked[-5:])

    run(main())


def test_a_schedule_that_retires_every_prompt_ends_the_prompts_instead_of_spinning() -> None:
    async def all_solved_after_a_miss(samples: list[Sample]) -> list[float]:
        return [0.0 if s.prompt_id == "0@0" and s.sample_index == 0 else 1.0 for s in samples]

    async def main() -> None:
        spec = PipelineSpec(mode="sync", drop_uniform=True, schedule=ScheduleSpec(retire_after=1))
        pipe = SamplePipeline(
            FakeRollout(auto=True),
            spec=spec,
            feed=Epochs(),
            score=all_solved_after_a_miss,
            params=SamplingParams(max_new_tokens=4),
            settings=BatchSettings(batch_size=B, group_size=G, max_uniform_drops=0),
        )
        async with pipe:
            with pytest.raises(EOFError, match="ran out"):
                for step in range(50):
                    await asyncio.wait_for(pipe.next_batch(), WAIT_S)
                    pipe.advance(step + 1)
        assert pipe.metrics["retired_skips"] > 4096

    run(main())


def test_a_probing_group_released_at_its_deadline_is_handled_once() -> None:
    """Emit policy, k_min 2, probe 2 of 4. 0@0 (solved) is dropped after its probe and 2@0
    takes its room; the deadline passes while 1@0's probe lacks a sample. When it arrives, 1@0
    is emitted with its two samples, once: nothing more of it is generated or dropped, and its
    probe is forgotten."""
    from asyncrl.clock import FakeClock
    from asyncrl.manifest.pipeline_section import StragglerSpec
    from tests.sampling.test_pipeline import started, until

    async def main() -> None:
        rollout = FakeRollout()
        clock = FakeClock()
        spec = PipelineSpec(
            mode="sync",
            drop_uniform=True,
            straggler=StragglerSpec(policy="emit", deadline_s=0.5, k_min=2),
            schedule=ScheduleSpec(probe=2),
        )
        pipe = SamplePipeline(
            rollout,
            spec=spec,
            feed=Epochs(),
            score=solved,
            params=SamplingParams(max_new_tokens=4),
            settings=BatchSettings(batch_size=B, group_size=G),
            clock=clock,
        )
        async with pipe:
            late = ("1@0", 1)
            for sid in await started(rollout, 4):  # the probes of 0@0 and 1@0
                if sid != late:
                    rollout.release(sid)
            for sid in await started(rollout, 2):  # 2@0's probe, in 0@0's room
                rollout.release(sid)
            await until(lambda: len(rollout.calls) == 8)  # 2@0 disagrees: its rest starts
            clock.advance(0.5)  # 2@0 is emitted with 2; 1@0, with 1, is overdue
            rollout.release(late)
            await until(lambda: pipe.metrics["groups_partial"] == 2)
            for _ in range(50):  # loop turns in which a wrongly spawned rest would start
                await asyncio.sleep(0)
            assert "1@0" not in pipe.admission.probing()
            assert [c[:2] for c in rollout.calls if c[0] == "1@0"] == [("1@0", 0), ("1@0", 1)]
            assert pipe.metrics["groups_uniform_dropped"] == 1  # 0@0 only
            assert pipe.metrics["wasted_samples"] == 2 + 2 + 2  # 0@0's probe, two of each

    run(main())


def test_a_probe_that_agrees_past_the_batchs_cap_keeps_its_group() -> None:
    """Async, probe 2 of 4, one uniform drop a batch: a probe that agrees once the batch has
    dropped its one is generated whole and kept, with zero advantages; it is not dropped at
    its release by a later batch's cap, which would waste all four samples, not two."""

    async def main() -> None:
        rollout = FakeRollout(auto=True)
        schedule = ScheduleSpec(probe=2)
        async with _pipeline(rollout, schedule, mode="async", max_uniform_drops=1) as pipe:
            batches = await _batches(pipe, 12)
        m = pipe.metrics
        assert m["groups_uniform_kept"] > 0
        assert m["groups_uniform_dropped"] == m["groups_probe_dropped"]
        assert m["wasted_samples"] == 2 * m["groups_probe_dropped"]
        kept = [s for b in batches for s in b.samples if item_of(s.sample.prompt_id) in SOLVED]
        assert kept and all(s.advantage == 0.0 for s in kept)
        settled = m["consumed_samples"] + m["wasted_samples"]
        assert m["admitted_samples"] == settled + pipe.in_flight

    run(main())


def test_a_probe_agrees_only_as_confidently_as_asked() -> None:
    plain = PromptSchedule(ScheduleSpec(probe=2), G)
    assert plain.repeats([[-5.0], [-9.0]])  # agreement alone
    sure = PromptSchedule(ScheduleSpec(probe=1, confidence=0.9), G)
    assert sure.repeats([[-0.05, -0.05]])  # 0.905 >= 0.9
    assert not sure.repeats([[-0.06, -0.05]])  # 0.896
    assert not sure.repeats([[-0.01], [-0.2]])
    assert not sure.repeats([[]])  # no log-probs: unsure
    with pytest.raises(ValueError, match="probe: 1 needs confidence"):
        ScheduleSpec(probe=1)


class ConfidentRollout(FakeRollout):
    """Draws the solved items' samples with probability 0.99, the others' with 0.37."""

    async def call(self, method: str, payload: Any = None, *args: Any, **kwargs: Any) -> Any:
        samples = await super().call(method, payload, *args, **kwargs)
        sure = item_of(samples[0].prompt_id) in SOLVED
        return [
            msgspec.structs.replace(s, logprobs=[-0.01 if sure else -1.0] * len(s.token_ids))
            for s in samples
        ]


def test_a_confident_probe_of_one_drops_its_group_after_one_sample() -> None:
    """Probe 1 of 4, confidence 0.9: the solved items (drawn at 0.99) stop after one sample;
    the others (0.37) are generated whole and trained."""

    async def main() -> None:
        rollout = ConfidentRollout(auto=True)
        schedule = ScheduleSpec(probe=1, confidence=0.9)
        async with _pipeline(rollout, schedule) as pipe:
            batches = await _batches(pipe, 3)
        calls: dict[str, int] = {}
        for prompt, _, _ in rollout.calls:
            calls[prompt] = calls.get(prompt, 0) + 1
        for prompt, n in calls.items():
            assert n == (1 if item_of(prompt) in SOLVED else G), prompt
        trained = {s.sample.prompt_id for b in batches for s in b.samples}
        assert trained and not {item_of(p) for p in trained} & SOLVED
        m = pipe.metrics
        assert m["groups_probe_dropped"] == sum(item_of(p) in SOLVED for p in calls) > 0
        assert m["wasted_samples"] == m["groups_probe_dropped"]
        assert m["admitted_samples"] == m["consumed_samples"] + m["wasted_samples"] + pipe.in_flight

    run(main())


def test_a_resume_state_counts_only_the_probes_of_the_groups_it_counts() -> None:
    """Probe 2 of 4, every group probed: the groups unsettled at a batch leave its resume state
    with their probes, since the resumed run admits and probes them again."""

    async def main() -> tuple[list[Any], int]:
        async with _pipeline(FakeRollout(auto=True), ScheduleSpec(probe=2), mode="async") as pipe:
            batches = await _batches(pipe, 2)
            return batches, len(pipe.admission.unsettled)

    batches, unsettled = run(main())
    assert unsettled  # groups in flight at the last batch: the case in question
    for batch in batches:
        counted = batch.resume["pipeline"]
        assert counted["probed_groups"] == counted["admitted_groups"]
