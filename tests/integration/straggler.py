"""A simulated rollout role and a GRPO sample-pipeline program for the live straggler tests.

``TimedRollout`` answers each one-sample ``generate`` after ``duration_s``; it appends
``start <prompt> <k>`` and ``done <prompt> <k>`` lines to ``served-<replica>.txt`` in the run
directory, so a test can tell which replica had which sample, and which never finished there.
Once the test creates ``freeze`` in the run directory, replica ``freeze_replica`` (first
incarnation only) stops itself with SIGSTOP at the start of its next sample, so the freeze always
lands mid-sample.

``program`` drives ``SamplePipeline`` in the manifest's mode with a local prompt feed and a
local reward, and stands in for the learner by advancing the version after each batch. It
writes what it consumed and the pipeline's counters to ``driver.json`` (its return value).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from typing import Any

import msgspec

from asyncrl.role import Delivery, Role, endpoint
from asyncrl.roles.generation.rollout import GenerateBatch, Prompt, Sample, SamplingParams
from asyncrl.roles.sampling.pipeline import BatchSettings, SamplePipeline


class TimedRollout(Role):
    class Config(msgspec.Struct):
        duration_s: float = 0.02
        freeze_replica: int = -1

    async def setup(self) -> None:
        path = os.path.join(self.ctx.run_dir, f"served-{self.ctx.replica}.txt")
        self.log = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the process
        self.version = 0
        first = self.ctx.incarnation == 0
        self.may_freeze = first and self.ctx.replica == self.config.freeze_replica

    @endpoint(Delivery.IDEMPOTENT)
    async def generate(self, batch: GenerateBatch) -> list[Sample]:
        out = []
        for request in batch.requests:
            sid = f"{request.prompt.id} {request.sample_index}"
            self.log.write(f"start {sid}\n")
            if self.may_freeze and os.path.exists(os.path.join(self.ctx.run_dir, "freeze")):
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen until the supervisor kills it
            await asyncio.sleep(self.config.duration_s)
            self.log.write(f"done {sid}\n")
            out.append(
                Sample(
                    prompt_id=request.prompt.id,
                    sample_index=request.sample_index,
                    prompt_ids=request.prompt.token_ids,
                    token_ids=[5],
                    logprobs=[-0.5],
                    versions=[self.version],
                    finished=True,
                    stop_reason="stop",
                )
            )
        return out

    async def teardown(self) -> None:
        self.log.close()


async def program(ctx: Any) -> dict[str, Any]:
    cfg = {"steps": 12, "group_size": 4, "batch_size": 8, **ctx.config}

    async def feed(cursor: int, n: int) -> list[Prompt]:
        return [Prompt(id=f"p{i}", token_ids=[1, 2, 3]) for i in range(cursor, cursor + n)]

    async def score(samples: list[Sample]) -> list[float]:
        return [random.Random(f"{s.prompt_id}:{s.sample_index}").random() for s in samples]

    groups: list[list[str | int]] = []
    keys: list[str] = []
    pipe = SamplePipeline(
        ctx.roles["rollout"],
        spec=ctx.pipeline,
        feed=feed,
        score=score,
        params=SamplingParams(max_new_tokens=1),
        settings=BatchSettings(batch_size=cfg["batch_size"], group_size=cfg["group_size"]),
        timeout=60.0,
    )
    async with pipe:
        for step in range(cfg["steps"]):
            batch = await pipe.next_batch()
            sizes: dict[str, int] = {}
            for s in batch.samples:
                sizes[s.sample.prompt_id] = sizes.get(s.sample.prompt_id, 0) + 1
                keys.append(f"{s.sample.prompt_id} {s.sample.sample_index}")
            groups += [[prompt, n] for prompt, n in sizes.items()]
            pipe.advance(step + 1)
    return {
        "groups": groups,
        "keys": keys,
        "metrics": dict(pipe.metrics),
        "reducer": pipe.release.reducer.metrics,
        "pacer_max_ahead": pipe.pacer.max_ahead,
    }
