"""A run with dispatch shards for the live shard tests: a shard that SIGKILLs itself, a reward,
and a program that drives ``ShardedPipeline``.

``KillableShard`` is the library's ``DispatchShard``; its replica ``kill_replica`` (first
incarnation only) kills itself with SIGKILL once the program has created ``kill`` in the run
directory and the shard holds at least two groups, so it always dies with groups in hand. The
rollout is ``tests.integration.straggler:TimedRollout``.

``program`` stands in for the learner by advancing the version after each batch, creates
``kill`` after step ``kill_after``, and returns what it consumed, each batch's cursor, every
release that reached the driver by group index (``CountingShards``) and the pipeline's
accounting (``driver.json``).
"""

from __future__ import annotations

import os
import random
import signal
from collections import Counter
from typing import Any

from asyncrl.role import Delivery, endpoint
from asyncrl.roles.payloads import Prompt, Sample, SamplingParams
from asyncrl.roles.sampling.contract import BatchSettings
from asyncrl.roles.sampling.shard import DispatchShard, ReleasedGroup, ShardGrant
from asyncrl.roles.sampling.sharded import ShardedPipeline


class KillableShard(DispatchShard):
    class Config(DispatchShard.Config, kw_only=True, forbid_unknown_fields=True):
        kill_replica: int = -1

    async def setup(self) -> None:
        await super().setup()
        self.holding = 0
        self.may_kill = self.ctx.incarnation == 0 and self.ctx.replica == self.config.kill_replica

    @endpoint(Delivery.ONCE)
    async def run_group(self, grant: ShardGrant) -> ReleasedGroup:
        self.holding += 1
        try:
            if (
                self.may_kill
                and self.holding >= 2
                and os.path.exists(os.path.join(self.ctx.run_dir, "kill"))
            ):
                os.kill(os.getpid(), signal.SIGKILL)
            return await super().run_group(grant)
        finally:
            self.holding -= 1


async def score(samples: list[Sample]) -> list[float]:
    return [random.Random(f"{s.prompt_id}:{s.sample_index}").random() for s in samples]


class CountingShards:
    """The shards' handle, counting at the driver every release that reaches it, by group
    index, stale ones included (what ``ShardedPipeline`` then accepts or refuses)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.releases: Counter[int] = Counter()

    @property
    def replicas(self) -> int:
        return int(self.handle.replicas)

    async def call(self, method: str, payload: Any = None, *args: Any, **kw: Any) -> Any:
        answer = await self.handle.call(method, payload, *args, **kw)
        if method == "run_group":
            self.releases[answer.index] += 1
        return answer


async def program(ctx: Any) -> dict[str, Any]:
    cfg = {"steps": 20, "group_size": 4, "batch_size": 8, "kill_after": 3, **ctx.config}

    async def feed(cursor: int, n: int) -> list[Prompt]:
        return [Prompt(id=f"p{i}", token_ids=[1, 2, 3]) for i in range(cursor, cursor + n)]

    keys: list[str] = []
    cursors: list[int] = []
    shards = CountingShards(ctx.roles["shard"])
    pipe = ShardedPipeline(
        shards,
        spec=ctx.pipeline,
        feed=feed,
        params=SamplingParams(max_new_tokens=1),
        settings=BatchSettings(batch_size=cfg["batch_size"], group_size=cfg["group_size"]),
        timeout=60.0,
    )
    async with pipe:
        for step in range(cfg["steps"]):
            batch = await pipe.next_batch()
            keys += [f"{s.sample.prompt_id} {s.sample.sample_index}" for s in batch.samples]
            cursors.append(batch.cursor)
            pipe.advance(step + 1)
            if step + 1 == cfg["kill_after"]:
                with open(os.path.join(ctx.run_dir, "kill"), "w") as f:
                    f.write("now")
        in_flight = pipe.in_flight
        unsettled = sorted(pipe.admission.unsettled)
        metrics = dict(pipe.metrics)
    return {
        "keys": keys,
        "cursors": cursors,
        "releases": {str(i): n for i, n in sorted(shards.releases.items())},
        "metrics": metrics,
        "in_flight": in_flight,
        "unsettled": unsettled,
        "refused": pipe.ledger.duplicates,
        "pacer_max_ahead": pipe.pacer.max_ahead,
    }
