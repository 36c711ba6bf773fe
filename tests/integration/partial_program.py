"""A control-flow program for the live partial-rollout test: chunks resumed on any replica.

The rollout role (two replicas, capacity 1, a chunk budget) gets samples in two groups of
different sizes. Each round sends one ``generate`` call per group at once, every unfinished
sample resumed from its last chunk, so the dispatcher puts one call on each replica; the groups
swap their order every round, so a group moves between replicas. ``stats`` from every replica
before and after the round tell which replica served which call: a replica's
``tokens_generated`` grew by exactly what its call's samples gained, and the two groups gain
different amounts.

The result lists every chunk of every sample (its tokens, log-probs, versions and replica) and
the replicas' final stats, for the test to check.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.roles.generation.rollout import (
    GenerateBatch,
    GenerateRequest,
    Prompt,
    Sample,
    SamplingParams,
)

DEFAULTS: dict[str, Any] = {
    "groups": [1, 2],  # samples per group; the sizes must differ to tell the replicas apart
    "max_new_tokens": 8,
}


async def main(ctx: Any) -> dict[str, Any]:
    """Generate every sample chunk by chunk until all finish; return the chunks and stats."""
    cfg = {**DEFAULTS, **ctx.config}
    params = SamplingParams(max_new_tokens=cfg["max_new_tokens"])
    groups: list[list[int]] = []
    for size in cfg["groups"]:
        start = sum(map(len, groups))
        groups.append(list(range(start, start + size)))
    prompts = [Prompt(id=f"p{i}", token_ids=[2 + i, 3, 4]) for i in range(sum(map(len, groups)))]
    latest: list[Sample | None] = [None] * len(prompts)
    chunks: list[list[dict[str, Any]]] = [[] for _ in prompts]

    def length(i: int) -> int:
        sample = latest[i]
        return 0 if sample is None else len(sample.token_ids)

    def unfinished(group: list[int]) -> list[int]:
        return [i for i in group if (s := latest[i]) is None or not s.finished]

    async def generate(group: list[int]) -> list[Sample]:
        batch = GenerateBatch(
            [
                GenerateRequest(prompt=prompts[i], sample_index=0, params=params, partial=latest[i])
                for i in group
            ]
        )
        samples: list[Sample] = await ctx.roles["rollout"].call("generate", batch, list[Sample])
        return samples

    rounds: list[list[int]] = []
    # The first broadcast also waits until both replicas are up and have advertised credit.
    before = await ctx.roles["rollout"].broadcast("stats", None, dict[str, int])
    while any(unfinished(g) for g in groups):
        order = groups if len(rounds) % 2 == 0 else groups[::-1]
        calls = [g for g in (unfinished(g) for g in order) if g]
        replies = await asyncio.gather(*(generate(g) for g in calls))
        after = await ctx.roles["rollout"].broadcast("stats", None, dict[str, int])
        grown = [
            a["tokens_generated"] - b["tokens_generated"]
            for a, b in zip(after, before, strict=True)
        ]
        rounds.append(grown)
        for group, samples in zip(calls, replies, strict=True):
            gained = sum(len(s.token_ids) - length(i) for i, s in zip(group, samples, strict=True))
            # None when the split is ambiguous (e.g. one replica served both calls).
            served = [r for r, n in enumerate(grown) if n == gained]
            replica = served[0] if len(served) == 1 else None
            for i, s in zip(group, samples, strict=True):
                chunks[i].append(
                    {
                        "token_ids": s.token_ids,
                        "logprobs": s.logprobs,
                        "versions": s.versions,
                        "finished": s.finished,
                        "stop_reason": s.stop_reason,
                        "replica": replica,
                    }
                )
                latest[i] = s
        before = after
    return {"chunks": chunks, "rounds": rounds, "stats": before}
