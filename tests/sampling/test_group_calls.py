"""One generate call per group (``pipeline.group_calls``, asyncrl.roles.sampling.coalesce): the
samples of a prompt that start in one loop turn travel as one call; each is still its own
sample, resumed alone when partial; a cancelled leader's followers call for themselves."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from asyncrl.manifest.pipeline_section import PipelineSpec
from asyncrl.roles.payloads import GenerateBatch, Prompt, Sample, SamplingParams
from asyncrl.roles.sampling.coalesce import GroupCalls
from asyncrl.roles.sampling.pipeline import BatchSettings, SamplePipeline
from asyncrl.transport import run

G = 4


class BatchRollout:
    """Answers a call of any number of requests; a sample is token ``10 + index``. ``partial``
    names samples whose first call comes back unfinished; ``gate`` holds every call."""

    def __init__(self, partial: set[int] | None = None, fail: bool = False) -> None:
        self.calls: list[list[int]] = []  # the sample indices of each call
        self.partial = partial or set()
        self.fail = fail
        self.gate: asyncio.Event | None = None
        self.called = asyncio.Event()

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        assert method == "generate" and isinstance(payload, GenerateBatch)
        self.calls.append([r.sample_index for r in payload.requests])
        self.called.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError("the rollout broke")
        out = []
        for r in payload.requests:
            resumed = r.partial is not None
            unfinished = r.sample_index in self.partial and not resumed
            tokens = (
                [10 + r.sample_index] if unfinished or not resumed else [10 + r.sample_index, 1]
            )
            out.append(
                Sample(
                    prompt_id=r.prompt.id,
                    sample_index=r.sample_index,
                    prompt_ids=r.prompt.token_ids,
                    token_ids=tokens,
                    logprobs=[0.0] * len(tokens),
                    versions=[0] * len(tokens),
                    finished=not unfinished,
                    stop_reason="interrupted" if unfinished else "stop",
                )
            )
        return out


def test_a_groups_samples_travel_as_one_call_and_come_back_each_its_own() -> None:
    async def feed(cursor: int, n: int) -> list[Prompt]:
        return [Prompt(id=f"p{i}", token_ids=[1, 2]) for i in range(cursor, cursor + n)]

    async def score(samples: list[Sample]) -> list[float]:
        return [float(s.sample_index % 2) for s in samples]

    async def main() -> tuple[list[Sample], BatchRollout, Counter[str]]:
        rollout = BatchRollout(partial={2})
        async with SamplePipeline(
            rollout,
            spec=PipelineSpec(mode="sync", group_calls=True),
            feed=feed,
            score=score,
            params=SamplingParams(max_new_tokens=4),
            settings=BatchSettings(batch_size=2 * G, group_size=G),
        ) as pipe:
            batch = await asyncio.wait_for(pipe.next_batch(), 10)
            return [s.sample for s in batch.samples], rollout, pipe.metrics

    samples, rollout, metrics = run(main())
    assert sorted(rollout.calls) == [
        [0, 1, 2, 3],
        [0, 1, 2, 3],
        [2],
        [2],
    ]  # two groups, two resumes
    assert [(s.prompt_id, s.sample_index) for s in samples] == [
        (p, k) for p in ("p0", "p1") for k in range(G)
    ]
    assert all(s.token_ids[0] == 10 + s.sample_index and s.finished for s in samples)
    assert [s.token_ids for s in samples if s.sample_index == 2] == [[12, 1], [12, 1]]
    assert metrics["resumed"] == 2 and metrics["generated_samples"] == 2 * G


def test_followers_of_a_cancelled_leader_call_for_themselves_and_errors_reach_everyone() -> None:
    async def cancelled() -> tuple[list[Sample], BatchRollout]:
        rollout = BatchRollout()
        rollout.gate = asyncio.Event()
        source = GroupCalls(rollout, SamplingParams(), timeout=10.0)
        prompt = Prompt(id="p", token_ids=[1])
        tasks = [asyncio.create_task(source(prompt, k, Counter())) for k in range(3)]
        await rollout.called.wait()
        tasks[0].cancel()  # the leader's sample: its group was released
        rollout.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        return [await t for t in tasks[1:]], rollout

    followers, rollout = run(cancelled())
    assert rollout.calls[0] == [0, 1, 2] and sorted(rollout.calls[1:]) == [[1], [2]]
    assert [s.sample_index for s in followers] == [1, 2]

    async def broken() -> list[BaseException | Sample]:
        rollout = BatchRollout(fail=True)
        source = GroupCalls(rollout, SamplingParams(), timeout=10.0)
        prompt = Prompt(id="p", token_ids=[1])
        return await asyncio.gather(
            *(source(prompt, k, Counter()) for k in range(3)), return_exceptions=True
        )

    results = run(broken())
    assert [str(r) for r in results] == ["the rollout broke"] * 3
