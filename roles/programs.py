"""Built-in control-flow programs: GRPO, PPO and behaviour cloning.

Each is a short async function, readable top to bottom, that uses only the runtime's handles;
copy one and change it. They expect these roles (by these names): ``prompts`` (PromptSource),
``rollout`` (Rollout with ``weights_from: learner``), ``reward`` (Reward with a
``tokenizer_path``) and ``learner`` (Learner); PPO also ``critic``, and a ``reference`` is used
for the KL term when present. Settings come from the manifest's ``run.config``.

A restarted driver resumes where the learner's last step left the prompt cursor, so no prompt
is used twice and the learner's ledger skips anything already consumed.
"""

from __future__ import annotations

import logging
from typing import Any

from asyncrl.roles.learner import Scored, StepResult, TrainBatch
from asyncrl.roles.prompts import Take
from asyncrl.roles.reward import ScoreSamples
from asyncrl.roles.rollout import (
    GenerateBatch,
    GenerateRequest,
    Prompt,
    Sample,
    SamplingParams,
    WeightsUpdate,
)

__all__ = ["bc", "grpo", "ppo"]

log = logging.getLogger("asyncrl.programs")

DEFAULTS: dict[str, Any] = {
    "steps": 100,  # learner steps
    "prompts_per_step": 32,
    "group_size": 8,  # samples per prompt (GRPO's group)
    "temperature": 1.0,
    "max_new_tokens": 16,
    "stop_token_ids": [],
    "chunk": 64,  # samples per generate call; the dispatcher spreads the calls
    "lr": 0.0,  # 0: the learner's configured learning rate
    "batch": 64,  # BC: demonstrations per step
}


async def grpo(ctx: Any) -> dict[str, Any]:
    """Sample a group per prompt, score it, take one GRPO step; repeat."""
    return await _rl(ctx, "grpo")


async def ppo(ctx: Any) -> dict[str, Any]:
    """Sample, score, ask the critic for values, take one PPO step and one critic step."""
    return await _rl(ctx, "ppo")


async def _rl(ctx: Any, algorithm: str) -> dict[str, Any]:
    cfg = {**DEFAULTS, **ctx.config}
    status = await ctx.learner.call("status", None)
    cursor = int(status["keep"].get("cursor", 0))
    params = SamplingParams(
        temperature=cfg["temperature"],
        max_new_tokens=cfg["max_new_tokens"],
        stop_token_ids=list(cfg["stop_token_ids"]),
    )
    if "reference" in ctx.roles and status["step"] == 0:
        start = await ctx.learner.call("weights", None, WeightsUpdate)
        await ctx.reference.broadcast("set_weights", start)
    rewards_seen: list[float] = []
    for step in range(status["step"], cfg["steps"]):
        await ctx.rollout.broadcast("sync", None, int)
        prompts = await ctx.prompts.call(
            "take", Take(cursor, cfg["prompts_per_step"]), list[Prompt]
        )
        cursor += len(prompts)
        requests = [
            GenerateRequest(p, k, params) for p in prompts for k in range(cfg["group_size"])
        ]
        batches = [
            GenerateBatch(requests[i : i + cfg["chunk"]])
            for i in range(0, len(requests), cfg["chunk"])
        ]
        samples: list[Sample] = [
            s
            async for _, chunk in ctx.rollout.map("generate", batches, list[Sample])
            for s in chunk
        ]
        answers = {p.id: p.answer for p in prompts}
        rewards = await ctx.reward.call(
            "score_samples",
            ScoreSamples(samples, [answers[s.prompt_id] for s in samples]),
            list[float],
        )
        values: list[list[float]] = [[] for _ in samples]
        refs: list[list[float]] = [[] for _ in samples]
        if algorithm == "ppo":
            values = await ctx.critic.call("values", samples, list[list[float]])
        if "reference" in ctx.roles:
            refs = await ctx.reference.call("logprobs", samples, list[list[float]])
        scored = [
            Scored(s, r, ref_logprobs=ref, values=v)
            for s, r, ref, v in zip(samples, rewards, refs, values, strict=True)
        ]
        result = await ctx.learner.call(
            "train_step",
            TrainBatch(scored, algorithm=algorithm, keep={"cursor": cursor}, lr=cfg["lr"]),
            StepResult,
        )
        if algorithm == "ppo":
            await ctx.critic.call("train_step", scored)
        mean = sum(rewards) / max(1, len(rewards))
        rewards_seen.append(mean)
        log.info("%s step %d: reward %.3f, version %d", algorithm, step + 1, mean, result.version)
    return {"steps": cfg["steps"], "rewards": rewards_seen, "cursor": cursor}


async def bc(ctx: Any) -> dict[str, Any]:
    """Behaviour cloning on the prompt source's answers as demonstrations."""
    cfg = {**DEFAULTS, **ctx.config}
    status = await ctx.learner.call("status", None)
    cursor = int(status["keep"].get("cursor", 0))
    losses: list[float] = []
    for step in range(status["step"], cfg["steps"]):
        demos = await ctx.prompts.call("demonstrations", Take(cursor, cfg["batch"]), list[Sample])
        cursor += len(demos)
        result = await ctx.learner.call(
            "train_step",
            TrainBatch(
                [Scored(d) for d in demos], algorithm="bc", keep={"cursor": cursor}, lr=cfg["lr"]
            ),
            StepResult,
        )
        losses.append(result.metrics.get("nll", float("nan")))
        log.info("bc step %d: nll %.4f", step + 1, losses[-1])
    return {"steps": cfg["steps"], "nll": losses, "cursor": cursor}
