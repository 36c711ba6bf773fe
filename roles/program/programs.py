"""Built-in control-flow programs (GRPO, RLOO, PPO, BC) and the one RL loop they share.

Each program is a short async function, readable top to bottom, over the typed clients of
``asyncrl.roles.program.clients``; copy one and change it. They expect these roles (by these names):
``prompts`` (PromptSource), ``rollout`` (Rollout with ``weights_from: learner``), ``reward``
(Reward with a ``tokenizer_path``) and ``learner`` (Learner); PPO also ``critic``, and a
``reference`` is used for the KL term when present. Settings come from the manifest's
``run.config`` (``DEFAULTS`` lists them); the sample flow (sync or async mode, the staleness
bound η, the straggler policy, dynamic sampling) from its ``pipeline`` section, through
``asyncrl.roles.sampling.pipeline.SamplePipeline``: the same program runs both modes. A run over
several hosts has a weight relay per host without the learner (``asyncrl.roles.services.relay``),
named by ``run.config.relays`` or simply called ``relay``: after each step the weights go to the
relays first, then to the rollout replicas (``weight_sync``).

A role named ``heldout`` (a second PromptSource, over held-out prompts) turns on evaluation in
``grpo``, ``rloo`` and ``ppo``: every ``eval_every`` steps and after the last, the rollout
replicas decode all its prompts greedily with the weights just trained, the role named by
``eval_verifier`` (default: the reward role) scores them, a completion with a full score counts
as correct (``asyncrl.roles.program.evaluation.Evaluation``), and the accuracy is logged and
returned as ``heldout``: ``[{"step": s, "accuracy": a}, ...]``. ``stop_at`` ends RL early on a
target (``{"accuracy": 0.95}``), ``budget_s`` on a wall budget.

``rl_loop`` (``asyncrl.roles.program.loop``, re-exported here) is the RL loop itself, for
programs of your own (the examples' are): it samples through the pipeline, trains, moves the
weights to the rollout replicas, evaluates on a schedule, stops on a target, a callback's
``Stop`` or a budget, writes every step to ``RUN_DIR/metrics.jsonl`` (and TensorBoard) and shows
a progress display (``asyncrl.roles.program.metrics``). With a ``Run``
(``asyncrl.roles.program.run``) it also keeps the run's history and phases.

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

from asyncrl.dispatch.handles import Context
from asyncrl.observe.logs import PROGRESS
from asyncrl.roles.payloads import (
    ProgramState,
    Prompt,
    Sample,
    SamplingParams,
    Scored,
    TrainBatch,
)
from asyncrl.roles.program.clients import PromptsClient, RLContext, resend
from asyncrl.roles.program.evaluation import Evaluation
from asyncrl.roles.program.loop import (
    PromptFeed,
    RLLoop,
    RLStep,
    Stop,
    learn,
    rl_loop,
    weight_sync,
)

__all__ = [
    "DEFAULTS",
    "PromptFeed",
    "RLLoop",
    "RLStep",
    "Stop",
    "bc",
    "check_critic",
    "grpo",
    "learn",
    "ppo",
    "resend",
    "rl_loop",
    "rloo",
    "weight_sync",
]

log = logging.getLogger("asyncrl.programs")

DEFAULTS: dict[str, Any] = {
    "steps": 100,  # learner steps
    "prompts_per_step": 32,
    "group_size": 8,  # samples per prompt (GRPO's group)
    "temperature": 1.0,
    "max_new_tokens": 16,
    "stop_token_ids": [],
    "lr": 0.0,  # 0: the learner's configured learning rate
    "budget_s": 0.0,  # wall-clock budget of the RL loop in seconds; 0: none
    "eval_every": 0,  # steps between held-out evaluations (a `heldout` role); 0: after the last
    "eval_verifier": "",  # the role that checks held-out answers; "": the `reward` role
    "stop_at": {},  # targets that end RL early: {accuracy: 0.95}, {reward: 0.9}
    "batch": 64,  # BC: demonstrations per step
    "relays": None,  # relay roles pushed to before the rollouts; None: the role `relay`, if any
}


async def grpo(ctx: Context) -> dict[str, Any]:
    """Sample a group per prompt, score it, take one GRPO step; repeat."""
    return await _builtin(RLContext(ctx), "grpo")


async def rloo(ctx: Context) -> dict[str, Any]:
    """As ``grpo``, with RLOO's leave-one-out baseline (the learner computes it)."""
    return await _builtin(RLContext(ctx), "rloo")


async def ppo(ctx: Context) -> dict[str, Any]:
    """Sample, score, ask the critic for values, take one PPO step and one critic step."""
    return await _builtin(RLContext(ctx), "ppo")


async def _builtin(rl: RLContext, algorithm: str) -> dict[str, Any]:
    cfg = {**DEFAULTS, **rl.config}
    if algorithm == "ppo" and rl.critic is not None:
        await asyncio.to_thread(check_critic, rl.ctx)  # imports torch: off the event loop
    status = await rl.learner.status()
    feed = PromptFeed(rl)
    params = SamplingParams(
        temperature=cfg["temperature"],
        max_new_tokens=cfg["max_new_tokens"],
        stop_token_ids=list(cfg["stop_token_ids"]),
    )

    async def score(samples: list[Sample]) -> list[float]:
        return await rl.reward.score_samples(samples, [feed.answers[s.prompt_id] for s in samples])

    heldout: list[Prompt] = []
    if "heldout" in rl.ctx.roles:  # all its prompts, once (epoch 0 of its permutation)
        source = PromptsClient(rl.ctx.roles["heldout"])
        heldout = await source.take(0, await source.handle.call("size", None, int))
    evaluation = None
    if heldout:
        evaluation = Evaluation(
            heldout,
            max_new_tokens=params.max_new_tokens,
            stop_token_ids=params.stop_token_ids,
            verifier=cfg["eval_verifier"] or None,
            every=int(cfg["eval_every"]),
        )
    loop = RLLoop(
        algorithm=algorithm,
        steps=int(cfg["steps"]),
        prompts_per_step=int(cfg["prompts_per_step"]),
        group_size=int(cfg["group_size"]),
        params=params,
        lr=float(cfg["lr"]),
        budget_s=float(cfg["budget_s"]),
        stop_at={k: float(v) for k, v in (cfg["stop_at"] or {}).items()},
        id_prefix=f"{algorithm}-",
        evaluate=evaluation,
    )
    rewards: list[float] = []

    def on_step(step: RLStep) -> None:
        rewards.append(step.reward)
        log.info(
            "%s step %d: reward %.3f, version %d, staleness max %d",
            algorithm,
            step.step,
            step.reward,
            step.result.version,
            step.batch.metrics["staleness_max"],
        )
        if step.eval_result is not None:
            log.info(
                "%s step %d: held-out accuracy %.3f (%d prompts, greedy, versions %s)",
                algorithm,
                step.step,
                step.eval_result.accuracy,
                step.eval_result.count,
                step.eval_result.versions,
                extra=PROGRESS,
            )

    out = await rl_loop(rl, loop, feed=feed, score=score, done=status.step, on_step=on_step)
    held = [{"step": e["step"], "accuracy": e["accuracy"]} for e in out["evaluations"]]
    return {**out, "rewards": rewards, **({"heldout": held} if heldout else {})}


def check_critic(ctx: Context) -> None:
    """Refuse a critic whose return settings (``gamma``, ``lam``, the KL penalty in the reward)
    differ from the learner's, as the manifest gives them
    (``asyncrl.roles.training.critic.check_matches_learner``).

    Raises:
        ValueError: they differ (the message names each setting, with both values).
    """
    from asyncrl.roles.training.critic import check_matches_learner

    check_matches_learner(ctx.role_config("learner", dict), ctx.role_config("critic", dict))


async def bc(ctx: Context) -> dict[str, Any]:
    """Behaviour cloning on the prompt source's answers as demonstrations."""
    rl = RLContext(ctx)
    cfg = {**DEFAULTS, **rl.config}
    status = await rl.learner.status()
    cursor = status.keep.cursor or 0
    losses: list[float] = []
    for step in range(status.step, cfg["steps"]):
        demos = await rl.prompts.demonstrations(cursor, cfg["batch"])
        cursor += len(demos)
        batch = TrainBatch(
            samples=[Scored(sample=d) for d in demos],
            algorithm="bc",
            keep=ProgramState(cursor=cursor),
            lr=cfg["lr"],
            id=f"bc-{step + 1}",
        )
        result = await rl.learner.train_step(batch)
        losses.append(result.metrics.get("nll", float("nan")))
        log.info("bc step %d: nll %.4f", step + 1, losses[-1])
    return {"steps": cfg["steps"], "nll": losses, "cursor": cursor}
