"""Built-in control-flow programs (GRPO, RLOO, PPO, BC) and the one RL loop they share.

Each program is a short async function, readable top to bottom; copy one and change it.
``grpo``, ``rloo`` and ``ppo`` are written on a ``Run`` (``asyncrl.roles.program.run``): one
phase, ``rl``, which stays open so that a resumed run given more ``steps`` trains on, with the
run's history, ``summary.json``, plots and the exported policy (``exports/final``); they return
the loop's result (``rl_loop``), each step's reward (``rewards``), ``learner_steps``,
``samples_consumed`` and ``final``, and with an evaluation ``heldout`` and ``accuracy_final``. A
program of your own calls one with its own evaluation: ``await grpo(ctx, evaluation=...)``
(``examples/reasoning_gym/program.py``). ``bc`` is written on a ``Run`` too: one phase, ``bc``,
of ``Run.bc_step``s, and the same summary. They expect these roles (by these names):
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
returned as ``heldout``: ``[{"step": s, "accuracy": a}, ...]``. An ``evaluation`` given to the
program replaces that role's. ``stop_at`` ends RL early on a
target (``{"accuracy": 0.95}``), ``budget_s`` on a wall budget.

``rl_loop`` (``asyncrl.roles.program.rl_loop``, re-exported here) is the RL loop itself, for
programs of your own (the examples' are): it samples through the pipeline, trains, moves the
weights to the rollout replicas, evaluates on a schedule, stops on a target, a callback's
``Stop`` or a budget, writes every step to ``RUN_DIR/metrics.jsonl`` (and TensorBoard) and shows
a progress display (``asyncrl.roles.program.step_report``). With a ``Run``
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
    SamplingParams,
)
from asyncrl.roles.program.clients import PromptsClient, RLContext, resend
from asyncrl.roles.program.evaluation import Evaluation
from asyncrl.roles.program.rl_loop import (
    PromptFeed,
    RLLoop,
    RLStep,
    Stop,
    learn,
    rl_loop,
    weight_sync,
)
from asyncrl.roles.program.run import Run

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


async def grpo(
    ctx: Context,
    *,
    evaluation: Evaluation | None = None,
    params: SamplingParams | None = None,
) -> dict[str, Any]:
    """Sample a group per prompt, score it, take one GRPO step; repeat.

    Args:
        ctx: the run's context.
        evaluation: the held-out evaluation; None: the ``heldout`` role's, if the run has one.
        params: the rollouts' sampling; None: ``run.config``'s ``temperature``,
            ``max_new_tokens`` and ``stop_token_ids``.
    """
    return await _builtin(ctx, "grpo", evaluation, params)


async def rloo(
    ctx: Context,
    *,
    evaluation: Evaluation | None = None,
    params: SamplingParams | None = None,
) -> dict[str, Any]:
    """As ``grpo``, with RLOO's leave-one-out baseline (the learner computes it)."""
    return await _builtin(ctx, "rloo", evaluation, params)


async def ppo(
    ctx: Context,
    *,
    evaluation: Evaluation | None = None,
    params: SamplingParams | None = None,
) -> dict[str, Any]:
    """Sample, score, ask the critic for values, take one PPO step and one critic step; the
    arguments are ``grpo``'s."""
    return await _builtin(ctx, "ppo", evaluation, params)


PHASE = "rl"
"""The one phase of a built-in RL program. It stays open: it ends at the run's ``steps``, which a
resumed run may raise (``asyncrl run --resume`` with more steps trains on)."""


async def _builtin(
    ctx: Context,
    algorithm: str,
    evaluation: Evaluation | None,
    params: SamplingParams | None,
) -> dict[str, Any]:
    """The RL phase of a ``Run``: its loop, then the run's summary (``summary.json``, plots,
    the exported policy)."""
    rl = RLContext(ctx)
    cfg = {**DEFAULTS, **rl.config}
    if algorithm == "ppo" and rl.critic is not None:
        await asyncio.to_thread(check_critic, ctx)  # imports torch: off the event loop
    params = params or SamplingParams(
        temperature=cfg["temperature"],
        max_new_tokens=cfg["max_new_tokens"],
        stop_token_ids=list(cfg["stop_token_ids"]),
    )
    evaluation = evaluation or await _heldout(rl, cfg, params)
    run = await Run.open(rl, phases=[PHASE], evaluation=evaluation)
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

    out = await run.rl_loop(loop, on_step=on_step)
    final: dict[str, Any] = {}
    if evaluation is not None:  # the last step's, recorded in the history when it was taken
        final["accuracy_final"] = await run.evaluate_at(run.steps)
    summary = await run.finish(**final)
    held = [{"step": e["step"], "accuracy": e["accuracy"]} for e in out["evaluations"]]
    totals = {k: summary[k] for k in ("learner_steps", "samples_consumed", "final")}
    return {
        **out,
        "rewards": rewards,
        **({"heldout": held} if evaluation else {}),
        **final,
        **totals,
    }


async def _heldout(rl: RLContext, cfg: dict[str, Any], params: SamplingParams) -> Evaluation | None:
    """The evaluation over the ``heldout`` role's prompts (all of them, once: epoch 0 of its
    permutation), or None when the run has no such role."""
    if "heldout" not in rl.ctx.roles:
        return None
    source = PromptsClient(rl.ctx.roles["heldout"])
    heldout = await source.take(0, await source.handle.call("size", None, int))
    if not heldout:
        return None
    return Evaluation(
        heldout,
        max_new_tokens=params.max_new_tokens,
        stop_token_ids=params.stop_token_ids,
        verifier=cfg["eval_verifier"] or None,
        every=int(cfg["eval_every"]),
    )


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
    """Behaviour cloning on the prompt source's answers as demonstrations, ``batch`` a step,
    on a ``Run`` of one phase, ``bc``: each step a ``Run.bc_step`` (which mints the ledger
    and batch ids, so a demonstration seen again is trained again), the demonstrations'
    cursor kept with it, each step's ``nll`` in the run's history; then the run's summary
    (``summary.json``, plots, ``exports/final``). Returns ``steps``, each step's ``nll``
    (this incarnation's), the ``cursor``, ``learner_steps`` and ``final`` (the summary's
    ``samples_consumed`` counts an RL loop's samples: 0 here)."""
    rl = RLContext(ctx)
    cfg = {**DEFAULTS, **rl.config}
    run = await Run.open(rl, phases=["bc"])
    cursor = (await rl.learner.status()).keep.cursor or 0
    losses: list[float] = []
    for _ in range(run.steps, int(cfg["steps"])):
        demos = await rl.prompts.demonstrations(cursor, cfg["batch"])
        cursor += len(demos)
        result = await run.bc_step(demos, lr=float(cfg["lr"]), keep=ProgramState(cursor=cursor))
        losses.append(result.metrics.get("nll", float("nan")))
        run.record(nll=losses[-1])
        log.info("bc step %d: nll %.4f", run.steps, losses[-1])
    summary = await run.finish()
    totals = {k: summary[k] for k in ("learner_steps", "final")}
    return {"steps": cfg["steps"], "nll": losses, "cursor": cursor, **totals}
