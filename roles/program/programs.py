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
replicas decode all its prompts greedily with the weights just trained, the reward role scores
them (``asyncrl.roles.program.evaluation.greedy_accuracy``), and the accuracy is logged and returned
as ``heldout``: ``[{"step": s, "accuracy": a}, ...]``.

``rl_loop`` is the RL loop itself, for programs of your own (the arith example's is one): it
samples through the pipeline, trains, moves the weights to the rollout replicas, evaluates
every ``eval_every`` steps when given an ``evaluate`` hook, stops early at a wall-clock
``budget_s``, and reports each step to an ``on_step`` callback. It writes every step to
``RUN_DIR/metrics.jsonl`` (and TensorBoard) and shows a progress display itself
(``asyncrl.roles.program.metrics``).

A restarted driver resumes, never replays: each learner step keeps the program's position with
it (``TrainBatch.keep``: the pipeline's resume state, the phase), durably, before it is
acknowledged, so a restarted program reads it back from the learner's ``status`` and goes on
from the step after. A ``train_step`` whose reply was lost (the learner died) is re-sent with the
same batch id: the learner answers with the step it already took, or takes it if it had not.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from asyncrl.dispatch.handles import Context
from asyncrl.roles.payloads import (
    LearnerStatus,
    Prompt,
    Sample,
    SamplingParams,
    Scored,
    StepResult,
    TrainBatch,
)
from asyncrl.roles.program.clients import PromptsClient, RLContext, resend
from asyncrl.roles.program.evaluation import greedy_accuracy
from asyncrl.roles.program.metrics import StepReport
from asyncrl.roles.sampling.pipeline import Batch, SamplePipeline, WeightSync
from asyncrl.roles.sampling.weight_sync import relay_groups

__all__ = [
    "DEFAULTS",
    "PromptFeed",
    "RLLoop",
    "RLStep",
    "bc",
    "grpo",
    "learn",
    "ppo",
    "resend",
    "rl_loop",
    "rloo",
    "weight_sync",
]

log = logging.getLogger("asyncrl.programs")

Correction = Literal["clip", "decoupled", "tis"]

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
    "batch": 64,  # BC: demonstrations per step
    "relays": None,  # relay roles pushed to before the rollouts; None: the role `relay`, if any
}


async def grpo(ctx: Context) -> dict[str, Any]:
    """Sample a group per prompt, score it, take one GRPO step; repeat."""
    return await _builtin(RLContext.of(ctx), "grpo")


async def rloo(ctx: Context) -> dict[str, Any]:
    """As ``grpo``, with RLOO's leave-one-out baseline (the learner computes it)."""
    return await _builtin(RLContext.of(ctx), "rloo")


async def ppo(ctx: Context) -> dict[str, Any]:
    """Sample, score, ask the critic for values, take one PPO step and one critic step."""
    return await _builtin(RLContext.of(ctx), "ppo")


async def _builtin(rl: RLContext, algorithm: str) -> dict[str, Any]:
    cfg = {**DEFAULTS, **rl.config}
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

    async def evaluate() -> float:
        return await greedy_accuracy(
            rl, heldout, max_new_tokens=params.max_new_tokens, stop_token_ids=params.stop_token_ids
        )

    loop = RLLoop(
        algorithm=algorithm,
        steps=int(cfg["steps"]),
        prompts_per_step=int(cfg["prompts_per_step"]),
        group_size=int(cfg["group_size"]),
        params=params,
        lr=float(cfg["lr"]),
        budget_s=float(cfg["budget_s"]),
        id_prefix=f"{algorithm}-",
        evaluate=evaluate if heldout else None,
        eval_every=int(cfg["eval_every"]),
    )
    rewards: list[float] = []
    accuracies: list[dict[str, Any]] = []

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
        if step.evaluation is not None:
            accuracies.append({"step": step.step, "accuracy": step.evaluation})
            log.info(
                "%s step %d: held-out accuracy %.3f (%d prompts, greedy)",
                algorithm,
                step.step,
                step.evaluation,
                len(heldout),
            )

    out = await rl_loop(rl, loop, feed=feed, score=score, done=status.step, on_step=on_step)
    return {**out, "rewards": rewards, **({"heldout": accuracies} if heldout else {})}


@dataclass
class RLLoop:
    """What ``rl_loop`` runs.

    Attributes:
        algorithm: ``grpo``, ``rloo`` or ``ppo`` (PPO needs a ``critic`` role).
        steps: the RL step to reach (a resumed loop goes on from where it was).
        prompts_per_step: prompts per batch; each is sampled ``group_size`` times.
        group_size: samples per prompt (GRPO's group).
        params: sampling parameters of the rollouts.
        lr: the learner's peak learning rate for these steps; 0 keeps its configured one.
        id_prefix: batch ids are ``<id_prefix><step>``: unique in the run, so a step re-sent
            after a learner crash is counted once.
        keep: more of the program's state to keep with every step (``TrainBatch.keep``).
        evaluate: a held-out evaluation, run every ``eval_every`` steps and after the last.
        eval_every: steps between evaluations; 0 evaluates only after the last step.
        budget_s: stop after the first step that ends past this many seconds of the loop's
            wall-clock time; 0: no budget.
    """

    algorithm: str
    steps: int
    prompts_per_step: int
    group_size: int
    params: SamplingParams
    lr: float = 0.0
    id_prefix: str = "rl-"
    keep: dict[str, Any] = field(default_factory=dict)
    evaluate: Callable[[], Awaitable[float]] | None = None
    eval_every: int = 0
    budget_s: float = 0.0


@dataclass
class RLStep:
    """One step of ``rl_loop``, as its ``on_step`` callback sees it.

    Attributes:
        step: the RL step number, from 1.
        batch: the pipeline's batch (samples, rewards, staleness metrics).
        result: the learner's reply.
        reward: the policy's mean reward: over every group scored for this batch, the
            uniform ones dynamic sampling dropped included (``reward_scored_mean``).
        evaluation: the ``evaluate`` hook's value when this step ran it, else None.
        last: no step follows (the last step, or the budget ran out).
    """

    step: int
    batch: Batch
    result: StepResult
    reward: float
    evaluation: float | None = None
    last: bool = False


Scorer = Callable[[list[Sample]], Awaitable[list[float]]]
OnStep = Callable[[RLStep], Awaitable[None] | None]


async def rl_loop(
    rl: RLContext,
    loop: RLLoop,
    *,
    feed: PromptFeed,
    score: Scorer,
    done: int = 0,
    on_step: OnStep | None = None,
    display: bool = True,
) -> dict[str, Any]:
    """RL from step ``done + 1`` to ``loop.steps``: sample, score, train, move the weights.

    Every step is reported without code of the caller's (``asyncrl.roles.program.metrics``): a line
    of ``RUN_DIR/metrics.jsonl`` (reward, accuracy, the learner's metrics, staleness, throughput,
    where the time went, restarts), TensorBoard scalars when it is installed, and the progress
    display. A resumed loop appends to the file, never writing a step twice.

    Args:
        rl: the run's typed context.
        loop: what to run.
        feed: the prompts (``PromptFeed`` over the prompt source, or any pipeline feed).
        score: rewards for a group's samples.
        done: RL steps already taken (a resumed program's count).
        on_step: called after each step (history, progress, logs); may be async.
        display: show the progress display (a live bar on a terminal, plain lines elsewhere).

    Returns:
        ``steps`` (the last step taken), ``stopped_by_budget``, ``wall_s`` and the pipeline's
        metrics (``pipeline``).
    """
    status = await rl.learner.status()
    if rl.reference is not None and done == 0:  # the KL term is measured against the start
        await rl.reference.set_weights(await rl.learner.weights())
    weights = weight_sync(rl)
    await weights.ensure(None)  # relays first, then every replica loads the newest weights
    title = loop.algorithm.upper()
    report = StepReport(
        rl.run_dir, title, loop.steps, done=done, learner=status, display=display, idle=rl.ctx.idle
    )
    pipe = _pipeline(rl, loop, feed, report.scorer(score), status)
    started = time.monotonic()
    step, out_of_budget = done, False
    async with report, pipe:
        while step < loop.steps and not out_of_budget:
            step += 1
            batch = await pipe.next_batch()
            report.lap("batch")
            result = await learn(
                rl, batch, algorithm=loop.algorithm, lr=loop.lr, id=f"{loop.id_prefix}{step}"
            )
            report.lap("learn")
            # Sync mode: every replica holds the new weights before the next batch is admitted.
            await weights.push(version=result.version)
            pipe.advance(result.version)
            report.lap("weights")
            out_of_budget = bool(loop.budget_s) and time.monotonic() - started >= loop.budget_s
            last = step == loop.steps or out_of_budget
            evaluation = await _evaluate(loop, weights, result.version, step, last)
            report.lap("eval")
            mean = batch.metrics["reward_scored_mean"]
            rl_step = RLStep(step, batch, result, mean, evaluation, last)
            report.record(rl_step)
            await _call(on_step, rl_step)
        await weights.close()
        metrics = {**pipe.metrics, "in_flight_at_end": pipe.in_flight}
    if out_of_budget and step < loop.steps:
        log.info(
            "RL stopped at step %d of %d: its %.0f s budget ran out",
            step,
            loop.steps,
            loop.budget_s,
        )
    return {
        "steps": step,
        "stopped_by_budget": out_of_budget and step < loop.steps,
        "wall_s": time.monotonic() - started,
        "cursor": pipe.cursor,
        "pipeline": metrics,
    }


def weight_sync(rl: RLContext, **kwargs: Any) -> WeightSync:
    """The run's ``WeightSync``: the rollout group, after the relay groups (``relay_groups``:
    ``run.config.relays``, or the role named ``relay``), in the pipeline's mode (sync mode
    waits); ``kwargs`` go to ``WeightSync`` (``wait``, ``timeout``).

    Raises:
        ValueError: ``run.config.relays`` names a role the run lacks.
    """
    relays = [rl.ctx[name] for name in relay_groups(rl.config, rl.ctx.roles)]
    kwargs.setdefault("wait", rl.pipeline.mode == "sync")
    return WeightSync(rl.rollout.handle, relays=relays, **kwargs)


async def _call(on_step: OnStep | None, step: RLStep) -> None:
    """``on_step(step)``, awaited when it is async."""
    if on_step is not None:
        outcome = on_step(step)
        if inspect.isawaitable(outcome):
            await outcome


async def _evaluate(
    loop: RLLoop, weights: WeightSync, version: int, step: int, last: bool
) -> float | None:
    """``loop.evaluate`` of the weights just trained, when step ``step`` is due one."""
    if loop.evaluate is None or not (last or (loop.eval_every and step % loop.eval_every == 0)):
        return None
    await weights.ensure(version)
    return await loop.evaluate()


def _pipeline(
    rl: RLContext, loop: RLLoop, feed: PromptFeed, score: Scorer, status: LearnerStatus
) -> SamplePipeline:
    """The sample pipeline of ``rl_loop``, resumed where the learner's last step left it."""
    return SamplePipeline(
        rl.rollout.handle,
        spec=rl.pipeline,
        feed=feed,
        score=score,
        params=loop.params,
        batch_size=loop.prompts_per_step * loop.group_size,
        group_size=loop.group_size,
        **status.advantages,  # computed as the learner computes them
        start_version=status.version,
        resume=status.keep.get("resume") or {"cursor": int(status.keep.get("cursor", 0))},
        watchdog=rl.watchdog,
    )


class PromptFeed:
    """The prompt source as a ``SamplePipeline`` feed; keeps each prompt's answer for the reward."""

    def __init__(self, rl: RLContext) -> None:
        self.prompts = rl.prompts
        self.answers: dict[str, str] = {}

    async def __call__(self, cursor: int, n: int) -> list[Prompt]:
        taken = await self.prompts.take(cursor, n)
        self.answers.update({p.id: p.answer for p in taken})
        return taken


async def learn(
    rl: RLContext,
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

    Raises:
        ValueError: PPO without a ``critic`` role.
    """
    spec = rl.pipeline
    samples = [s.sample for s in batch.samples]
    if algorithm == "ppo":
        if rl.critic is None:
            raise ValueError("algorithm 'ppo' needs a role named 'critic' in the manifest")
        values = await rl.critic.values(samples, timeout=timeout)
        for scored, v in zip(batch.samples, values, strict=True):
            scored.values = v
    if rl.reference is not None:
        refs = await rl.reference.logprobs(samples, timeout=timeout)
        for scored, ref in zip(batch.samples, refs, strict=True):
            scored.ref_logprobs = ref
    train = TrainBatch(
        samples=batch.samples,
        algorithm=algorithm,
        keep={"cursor": batch.cursor, "resume": batch.resume, **(keep or {})},
        lr=lr,
        correction=cast(Correction, spec.correction),  # validated by the manifest
        importance_cap=spec.importance_cap,
        id=id,
    )
    result = await rl.learner.train_step(train, timeout=timeout)
    if algorithm == "ppo" and rl.critic is not None:
        await rl.critic.train_step(batch.samples, id=id, timeout=timeout)
    return result


async def bc(ctx: Context) -> dict[str, Any]:
    """Behaviour cloning on the prompt source's answers as demonstrations."""
    rl = RLContext.of(ctx)
    cfg = {**DEFAULTS, **rl.config}
    status = await rl.learner.status()
    cursor = int(status.keep.get("cursor", 0))
    losses: list[float] = []
    for step in range(status.step, cfg["steps"]):
        demos = await rl.prompts.demonstrations(cursor, cfg["batch"])
        cursor += len(demos)
        batch = TrainBatch(
            samples=[Scored(sample=d) for d in demos],
            algorithm="bc",
            keep={"cursor": cursor},
            lr=cfg["lr"],
            id=f"bc-{step + 1}",
        )
        result = await rl.learner.train_step(batch)
        losses.append(result.metrics.get("nll", float("nan")))
        log.info("bc step %d: nll %.4f", step + 1, losses[-1])
    return {"steps": cfg["steps"], "nll": losses, "cursor": cursor}
