"""Built-in control-flow programs: GRPO, PPO and behaviour cloning.

Each is a short async function, readable top to bottom, that uses only the runtime's handles;
copy one and change it. They expect these roles (by these names): ``prompts`` (PromptSource),
``rollout`` (Rollout with ``weights_from: learner``), ``reward`` (Reward with a
``tokenizer_path``) and ``learner`` (Learner); PPO also ``critic``, and a ``reference`` is used
for the KL term when present. Settings come from the manifest's ``run.config``; the sample
flow (sync or async mode, the staleness bound η, the straggler policy) from its ``pipeline``
section, through ``asyncrl.roles.pipeline.SamplePipeline``: the same program runs both modes.

A restarted driver resumes at the learner's version and at the prompt cursor its last step kept,
so pacing still holds and the learner's ledger skips anything already consumed.
"""

from __future__ import annotations

import logging
from typing import Any

from asyncrl.roles.learner import Scored, StepResult, TrainBatch
from asyncrl.roles.pipeline import Batch, SamplePipeline, WeightSync
from asyncrl.roles.prompts import Take
from asyncrl.roles.reward import ScoreSamples
from asyncrl.roles.rollout import Prompt, Sample, SamplingParams, WeightsUpdate

__all__ = ["PromptFeed", "bc", "grpo", "learn", "ppo"]

log = logging.getLogger("asyncrl.programs")

DEFAULTS: dict[str, Any] = {
    "steps": 100,  # learner steps
    "prompts_per_step": 32,
    "group_size": 8,  # samples per prompt (GRPO's group)
    "temperature": 1.0,
    "max_new_tokens": 16,
    "stop_token_ids": [],
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
    spec = ctx.pipeline  # sync or async mode, eta, straggler policy: the manifest's pipeline
    status = await ctx.learner.call("status", None)
    params = SamplingParams(
        temperature=cfg["temperature"],
        max_new_tokens=cfg["max_new_tokens"],
        stop_token_ids=list(cfg["stop_token_ids"]),
    )
    if "reference" in ctx.roles and status["step"] == 0:
        start = await ctx.learner.call("weights", None, WeightsUpdate)
        await ctx.reference.broadcast("set_weights", start)
    await ctx.rollout.broadcast("sync", None, int)
    feed = PromptFeed(ctx.prompts)

    async def score(samples: list[Sample]) -> list[float]:
        request = ScoreSamples(samples, [feed.answers[s.prompt_id] for s in samples])
        return await ctx.reward.call("score_samples", request, list[float])  # type: ignore[no-any-return]

    pipe = SamplePipeline(
        ctx.rollout,
        spec=spec,
        feed=feed,
        score=score,
        params=params,
        batch_size=cfg["prompts_per_step"] * cfg["group_size"],
        group_size=cfg["group_size"],
        start_version=status["version"],
        start_cursor=int(status["keep"].get("cursor", 0)),
    )
    weights = WeightSync(ctx.rollout, wait=spec.mode == "sync")
    rewards_seen: list[float] = []
    async with pipe:
        for step in range(status["step"], cfg["steps"]):
            batch = await pipe.next_batch()
            result = await learn(ctx, batch, algorithm=algorithm, lr=cfg["lr"])
            # Sync mode: every replica holds the new weights before the next batch is admitted.
            await weights.push()
            pipe.advance(result.version)
            mean = sum(s.reward for s in batch.samples) / max(1, len(batch.samples))
            rewards_seen.append(mean)
            log.info(
                "%s step %d: reward %.3f, version %d, staleness max %d",
                algorithm,
                step + 1,
                mean,
                result.version,
                batch.metrics["staleness_max"],
            )
    await weights.close()
    return {
        "steps": cfg["steps"],
        "rewards": rewards_seen,
        "cursor": pipe.cursor,
        "pipeline": dict(pipe.metrics),
    }


class PromptFeed:
    """The prompt source as a ``SamplePipeline`` feed; keeps each prompt's answer for the reward."""

    def __init__(self, prompts: Any) -> None:
        self.prompts = prompts  # the prompt source's handle
        self.answers: dict[str, str] = {}

    async def __call__(self, cursor: int, n: int) -> list[Prompt]:
        taken: list[Prompt] = await self.prompts.call("take", Take(cursor, n), list[Prompt])
        self.answers.update({p.id: p.answer for p in taken})
        return taken


async def learn(
    ctx: Any, batch: Batch, *, algorithm: str, lr: float = 0.0, timeout: float = 300.0
) -> StepResult:
    """One learner step on a pipeline batch.

    PPO first asks the critic for values, and a ``reference`` role (when the run has one) gives
    the log-probs of the KL term; the learner then trains with the manifest's off-policy
    correction and keeps the prompt cursor with its next checkpoint; PPO's critic takes its own
    step last.
    """
    spec = ctx.pipeline
    samples = [s.sample for s in batch.samples]
    if algorithm == "ppo":
        values = await ctx.critic.call("values", samples, list[list[float]], timeout=timeout)
        for scored, v in zip(batch.samples, values, strict=True):
            scored.values = v
    if "reference" in ctx.roles:
        refs = await ctx.reference.call("logprobs", samples, list[list[float]], timeout=timeout)
        for scored, ref in zip(batch.samples, refs, strict=True):
            scored.ref_logprobs = ref
    result: StepResult = await ctx.learner.call(
        "train_step",
        TrainBatch(
            batch.samples,
            algorithm=algorithm,
            keep={"cursor": batch.cursor},
            lr=lr,
            correction=spec.correction,
            importance_cap=spec.importance_cap,
        ),
        StepResult,
        timeout=timeout,
    )
    if algorithm == "ppo":
        await ctx.critic.call("train_step", batch.samples, timeout=timeout)
    return result


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
