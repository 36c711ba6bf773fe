"""Built-in control-flow programs: GRPO, PPO and behaviour cloning.

Each is a short async function, readable top to bottom, that uses only the runtime's handles;
copy one and change it. They expect these roles (by these names): ``prompts`` (PromptSource),
``rollout`` (Rollout with ``weights_from: learner``), ``reward`` (Reward with a
``tokenizer_path``) and ``learner`` (Learner); PPO also ``critic``, and a ``reference`` is used
for the KL term when present. Settings come from the manifest's ``run.config``; the sample
flow (sync or async mode, the staleness bound η, the straggler policy) from its ``pipeline``
section, through ``asyncrl.roles.pipeline.SamplePipeline``: the same program runs both modes.

A restarted driver resumes, never replays: each learner step keeps the program's position with
it (``TrainBatch.keep``: the pipeline's resume state, the phase), durably, before it is
acknowledged, so a restarted program reads it back from the learner's ``status`` and goes on
from the step after. A ``train_step`` whose reply was lost (the learner died) is re-sent with the
same batch id: the learner answers with the step it already took, or takes it if it had not.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asyncrl.errors import BrokenError
from asyncrl.roles.payloads import Prompt, Sample, SamplingParams, Scored, StepResult, TrainBatch
from asyncrl.roles.pipeline import Batch, SamplePipeline, WeightSync
from asyncrl.roles.prompts import Take
from asyncrl.roles.reward import ScoreSamples

__all__ = ["PromptFeed", "bc", "grpo", "learn", "ppo", "resend"]

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
        from asyncrl.roles.rollout import WeightsUpdate  # tensors: torch only when needed

        start = await ctx.learner.call("weights", None, WeightsUpdate)
        await ctx.reference.broadcast("set_weights", start)
    await ctx.rollout.broadcast("sync", None, int)
    feed = PromptFeed(ctx.prompts)
    keep = status["keep"]

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
        **status.get("advantages", {}),  # computed as the learner computes them
        start_version=status["version"],
        resume=keep.get("resume") or {"cursor": int(keep.get("cursor", 0))},
        watchdog=ctx.watchdog,
    )
    weights = WeightSync(ctx.rollout, wait=spec.mode == "sync")
    rewards_seen: list[float] = []
    async with pipe:
        for step in range(status["step"], cfg["steps"]):
            batch = await pipe.next_batch()
            result = await learn(
                ctx, batch, algorithm=algorithm, lr=cfg["lr"], id=f"{algorithm}-{step + 1}"
            )
            # Sync mode: every replica holds the new weights before the next batch is admitted.
            await weights.push(version=result.version)
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
        "pipeline": {**pipe.metrics, "in_flight_at_end": pipe.in_flight},
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


async def resend(
    handle: Any,
    method: str,
    payload: Any,
    reply_type: Any = Any,
    *,
    timeout: float = 300.0,
    first_pause_s: float = 0.05,
    max_pause_s: float = 1.0,
) -> Any:
    """Call a once endpoint whose request is safe to send again, and send it again when the
    replica broke with it in flight (died, hung, restarted, or was not reachable yet) rather
    than fail the run; between tries it pauses, from ``first_pause_s`` doubling up to
    ``max_pause_s``, for ``timeout`` seconds in all.

    Use it only where the role makes a repeat harmless: ``train_step`` with a ``TrainBatch.id``
    (the learner answers a repeat with the step it took), ``checkpoint``.

    Raises:
        BrokenError: it still broke after ``timeout`` seconds.
        DeadlineExceededError, RemoteError: as ``Handle.call``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pause = first_pause_s
    attempt = 1
    while True:
        try:
            return await handle.call(
                method, payload, reply_type, timeout=max(1.0, deadline - loop.time())
            )
        except BrokenError as exc:
            if loop.time() + pause >= deadline:
                raise
            attempt += 1
            log.warning(
                "%s.%s broke in flight (%s); sending it again in %.2f s (attempt %d)",
                handle.name,
                method,
                exc,
                pause,
                attempt,
            )
            await asyncio.sleep(pause)
            pause = min(2 * pause, max_pause_s)


async def learn(
    ctx: Any,
    batch: Batch,
    *,
    algorithm: str,
    lr: float = 0.0,
    timeout: float = 300.0,
    id: str = "",
    keep: dict[str, Any] | None = None,
) -> StepResult:
    """One learner step on a pipeline batch.

    PPO first asks the critic for values, and a ``reference`` role (when the run has one) gives
    the log-probs of the KL term; the learner then trains with the manifest's off-policy
    correction, keeping the pipeline's resume state (and ``keep``) with the step; PPO's critic
    takes its own step last. With an ``id``, a step whose reply was lost to a learner crash is
    sent again and counted once (``resend``).
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
    train = TrainBatch(
        batch.samples,
        algorithm=algorithm,
        keep={"cursor": batch.cursor, "resume": batch.resume, **(keep or {})},
        lr=lr,
        correction=spec.correction,
        importance_cap=spec.importance_cap,
        id=id,
    )
    if id:
        result: StepResult = await resend(
            ctx.learner, "train_step", train, StepResult, timeout=timeout
        )
    else:
        result = await ctx.learner.call("train_step", train, StepResult, timeout=timeout)
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
        result = await resend(
            ctx.learner,
            "train_step",
            TrainBatch(
                [Scored(d) for d in demos],
                algorithm="bc",
                keep={"cursor": cursor},
                lr=cfg["lr"],
                id=f"bc-{step + 1}",
            ),
            StepResult,
        )
        losses.append(result.metrics.get("nll", float("nan")))
        log.info("bc step %d: nll %.4f", step + 1, losses[-1])
    return {"steps": cfg["steps"], "nll": losses, "cursor": cursor}
