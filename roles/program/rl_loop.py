"""The RL loop every program shares: sample, score, train, move the weights, evaluate, stop.

    out = await rl_loop(rl, RLLoop(...), feed=PromptFeed(rl), score=score, run=run)

``rl_loop`` samples through the sample pipeline (``asyncrl.roles.sampling.pipeline``) in the
manifest's mode, takes a learner step per batch (``learn``), moves the weights to the rollout
replicas (``weight_sync``), evaluates at the evaluation boundaries, writes every step to
``RUN_DIR/metrics.jsonl`` (``asyncrl.roles.program.step_report``) and, given a ``Run``
(``asyncrl.roles.program.run``), to the run's history, and reports each step to ``on_step``.

It stops at ``RLLoop.steps``, or earlier:

- **on a target**: ``stop_at={"accuracy": 0.95}`` stops at the first evaluation that reaches
  it (``score_mean`` likewise); ``{"reward": 0.9}`` when a trained batch's mean reward does;
- **on request**: ``on_step`` returns ``Stop("why")`` or raises it;
- **on a wall budget**: ``budget_s`` seconds of the loop, earlier incarnations included;
- **when the prompts run out**: the feed ended, or the prompt schedule retired every prompt
  (the pipeline's ``PromptsExhausted``; ``stop_reason`` "the prompts ran out after step N"; the
  steps taken stand, and the program goes on to evaluate and finish as after any stop). Before
  the first step that is an error, and a feed's own error (an ``EOFError`` included) fails the
  loop.

With an evaluation, a stop lands on an evaluation boundary: a stop asked for at a step that did
not evaluate takes effect at the next step that does (``Stop(now=True)`` stops at once), and
the budget stops at the last boundary whose next one would end past it (at the step that runs
past it when that comes before the first boundary). Without one, the budget stops before a step
that would end past it, at the pace of the steps so far. A loop that stopped early keeps why
with the learner, so a driver restarted after it does not train on.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

from asyncrl.manifest.pipeline_section import SHARD_ROLE
from asyncrl.observe.logs import PROGRESS
from asyncrl.roles.payloads import (
    LearnerStatus,
    ProgramState,
    Prompt,
    Sample,
    SamplingParams,
    StepResult,
    Stopped,
    TrainBatch,
)
from asyncrl.roles.program.clients import RewardClient, RLContext
from asyncrl.roles.program.evaluation import EvalResult, Evaluation
from asyncrl.roles.program.step_report import StepReport
from asyncrl.roles.sampling.contract import PromptsExhausted, SampleSource
from asyncrl.roles.sampling.pipeline import Batch, BatchSettings, SamplePipeline, WeightSync
from asyncrl.roles.sampling.sharded import ShardedPipeline
from asyncrl.roles.sampling.weight_sync import relay_groups

if TYPE_CHECKING:
    from asyncrl.roles.program.run import Run

__all__ = [
    "PromptFeed",
    "RLLoop",
    "RLStep",
    "RewardScorer",
    "Stop",
    "learn",
    "rl_loop",
    "weight_sync",
]

log = logging.getLogger("asyncrl.programs")

Correction = Literal["clip", "decoupled", "tis"]
TARGETS = ("accuracy", "score_mean", "reward")
"""The metrics ``RLLoop.stop_at`` may name."""


class Stop(Exception):
    """Ends ``rl_loop`` early: its ``on_step`` callback returns one, or raises it.

    Args:
        reason: why, for the log and the loop's result (``stop_reason``).
        now: stop after this step even when it did not evaluate (else the loop goes on to its
            next evaluation boundary).
    """

    def __init__(self, reason: str = "on_step asked to stop", *, now: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.now = now


@dataclass(kw_only=True)
class RLLoop:
    """What ``rl_loop`` runs.

    Attributes:
        steps: the RL step to reach (a resumed loop goes on from where it was).
        prompts_per_step: prompts per batch; each is sampled ``group_size`` times.
        group_size: samples per prompt (GRPO's group).
        params: sampling parameters of the rollouts.
        algorithm: ``grpo``, ``rloo`` or ``ppo`` (PPO needs a ``critic`` role); "": the
            learner's (``roles.learner.config.algorithm``). One that differs from what the
            learner's config sets overrides it, with a warning (``asyncrl.roles.program.settings``).
        lr: the learner's peak learning rate for these steps; 0: the learner's
            (``roles.learner.config.lr``), overridden as ``algorithm`` is.
        id_prefix: batch ids are ``<id_prefix><step>``: unique in the run, so a step re-sent
            after a learner crash is counted once.
        keep: the program's own state, kept with every step (``ProgramState.program``) and
            read back from the learner's ``status`` (``status.keep.program``).
        evaluate: an ``Evaluation`` (its ``every`` is the default ``eval_every``), or a hook
            returning an accuracy or an ``EvalResult``; None: the ``Run``'s evaluation, if any.
        eval_every: steps between evaluations; 0: the evaluation's ``every``, or only after
            the last step.
        budget_s: a wall-clock budget of the loop in seconds; 0: none.
        stop_at: targets that stop the loop: ``accuracy``, ``score_mean`` (of an evaluation) or
            ``reward`` (a trained batch's mean), each reached at or above its value.
        source: how each sample is produced (``asyncrl.roles.sampling.contract.SampleSource``);
            None: one completion from the rollout group with ``params``. An episode runner's
            ``source`` makes each sample a multi-turn episode (``asyncrl.roles.agents``).
    """

    steps: int
    prompts_per_step: int
    group_size: int
    params: SamplingParams
    algorithm: str = ""
    lr: float = 0.0
    id_prefix: str = "rl-"
    keep: dict[str, Any] = field(default_factory=dict)
    evaluate: Evaluation | Callable[[], Awaitable[float | EvalResult]] | None = None
    eval_every: int = 0
    budget_s: float = 0.0
    stop_at: dict[str, float] = field(default_factory=dict)
    source: SampleSource | None = None


@dataclass
class RLStep:
    """One step of ``rl_loop``, as its ``on_step`` callback sees it.

    Attributes:
        step: the RL step number, from 1.
        batch: the pipeline's batch (samples, rewards, staleness metrics).
        result: the learner's reply.
        reward: the mean reward of the batch the learner trained on.
        reward_scored: the mean reward of every group scored since the previous batch, the
            uniform ones that dynamic sampling dropped included (in async mode, not the
            trained batch's groups: ``reward_scored_mean``).
        evaluation: the accuracy of this step's evaluation, else None.
        eval_result: this step's evaluation in full, else None.
        last: the loop stops after this step (as known before ``on_step`` is called).
    """

    step: int
    batch: Batch
    result: StepResult
    reward: float
    reward_scored: float = float("nan")
    evaluation: float | None = None
    eval_result: EvalResult | None = None
    last: bool = False


Scorer = Callable[[list[Sample]], Awaitable[list[float]]]
OnStep = Callable[[RLStep], "Awaitable[Stop | None] | Stop | None"]


class _Stopper:
    """When ``rl_loop`` stops, and why (see the module's docstring)."""

    def __init__(self, loop: RLLoop, has_eval: bool, every: int) -> None:
        unknown = sorted(set(loop.stop_at) - set(TARGETS))
        if unknown:
            raise ValueError(f"RLLoop.stop_at: unknown metric {unknown}; expected {TARGETS}")
        self.loop, self.has_eval, self.every = loop, has_eval, every
        self.pending = ""  # a stop asked for, waiting for its step
        self.now = False
        self.reason = ""  # why the loop stopped; "" while it goes on

    def boundary(self, step: int) -> bool:
        return self.has_eval and bool(self.every) and step % self.every == 0

    def ask(self, reason: str, *, now: bool = False) -> None:
        if not self.pending:
            self.pending, self.now = reason, now

    def after_training(self, step: int, reward: float, elapsed: float, per_step: float) -> bool:
        """Whether ``step`` is the last, given its reward and the loop's wall time so far."""
        target = self.loop.stop_at.get("reward")
        if target is not None and reward >= target:
            self.ask(f"the reward {reward:.4g} reached its target {target:g}")
        budget = self.loop.budget_s
        if budget and self.boundary(step) and elapsed + self.every * per_step > budget:
            self.ask(f"its {budget:g} s budget ends before the next evaluation")
        elif budget and self.every and self.has_eval and elapsed >= budget:
            self.ask(f"its {budget:g} s budget ran out before an evaluation", now=True)
        elif budget and not (self.every and self.has_eval) and elapsed + per_step > budget:
            self.ask(f"its {budget:g} s budget ends before another step would")
        if step >= self.loop.steps:
            return True
        on_boundary = not (self.has_eval and self.every) or self.boundary(step)
        return bool(self.pending) and (self.now or on_boundary)

    def after_eval(self, result: EvalResult | None) -> bool:
        """Whether an evaluation's result reached a target (the loop stops at it)."""
        for metric in ("accuracy", "score_mean"):
            target = self.loop.stop_at.get(metric)
            value = None if result is None else getattr(result, metric)
            if target is not None and value is not None and value >= target:
                self.pending, self.now = f"the {metric} {value:.4g} reached {target:g}", True
                return True
        return False

    def after_step(self, stop: Stop | None, evaluated: bool, last: bool) -> bool:
        """Whether the loop ends now, after ``on_step`` answered ``stop``."""
        if stop is not None:
            self.ask(stop.reason, now=stop.now or evaluated or not self.has_eval)
        if last or (self.pending and self.now):
            self.reason = self.pending or "steps"
            return True
        return False


async def rl_loop(
    rl: RLContext,
    loop: RLLoop,
    *,
    feed: PromptFeed,
    score: Scorer,
    done: int | None = None,
    on_step: OnStep | None = None,
    display: bool = True,
    run: Run | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """RL from step ``done + 1`` until ``loop.steps`` or a stop (see the module's docstring).

    Args:
        rl, loop: the run's typed context, and what to run.
        feed: the prompts (``PromptFeed`` over the prompt source, or any pipeline feed).
        score: rewards for a group's samples.
        done: RL steps already taken; None: the ``run``'s steps in its phase, else 0.
        on_step: called after each step; may be async; may return or raise ``Stop``.
        display: show the progress display (a live bar on a terminal, plain lines elsewhere).
        run: the program's ``Run``: each step goes to its history, with the phase's position
            kept with the learner; its evaluation is the default one.
        clock: seconds, for the budget and the step times (a test may pass a fake one).

    Returns:
        ``steps`` (the last step taken), ``stop_reason`` (``steps`` when it ran them all),
        ``stopped_by_budget``, ``wall_s``, ``cursor``, ``evaluations``, ``pipeline``.

    Raises:
        ValueError: ``stop_at`` names an unknown metric; the prompts ran out before step 1.
    """
    status = await rl.learner.status()
    algorithm = rl.settings.algorithm(loop.algorithm, "RLLoop.algorithm")
    loop = dataclasses.replace(loop, algorithm=algorithm, lr=rl.settings.lr(loop.lr, "RLLoop.lr"))
    done = (run.steps if run is not None else 0) if done is None else done
    evaluation = loop.evaluate if loop.evaluate is not None or run is None else run.evaluation
    every = loop.eval_every or (evaluation.every if isinstance(evaluation, Evaluation) else 0)
    stopper = _Stopper(loop, evaluation is not None, every)
    resumed = _stopped_before(loop, status, done)
    if resumed is not None:  # nothing left to train: a driver restarted after the last step
        if run is not None:
            await run.resumed_loop(done, evaluation is not None, weight_sync(rl))
            run.loop_ended(resumed)
        return resumed
    weights = await _weights_at_start(rl, done)
    report = StepReport(
        rl.run_dir,
        (loop.algorithm or "rl").upper(),
        loop.steps,
        done=done,
        learner=status,
        clock=clock,
    )
    report.idle, report.progress = rl.ctx.idle, report.progress if display else None
    pipe = _pipeline(rl, loop, feed, score, report, status)
    tokens = pipe.counters.scored_tokens  # what dispatch shards scored, counted in them
    evaluations: list[dict[str, Any]] = []
    step, started = done, clock()
    async with report, pipe:
        if run is not None:
            await run.resumed_loop(done, stopper.boundary(done), weights)
        while stopper.reason == "":
            step += 1
            if (trained := await _train(rl, loop, run, pipe, report, weights, step)) is None:
                step, stopper.reason = step - 1, f"the prompts ran out after step {step - 1}"
                break
            result, batch, reward = trained
            per_step = (clock() - started) / (step - done)
            last = stopper.after_training(step, reward, report.wall(), per_step)
            evaluated = None
            if evaluation is not None and (last or stopper.boundary(step)):
                await weights.ensure(result.version)
                evaluated = await _evaluate(rl, evaluation, step)
                evaluations.append(evaluated.record() | {"step": step})
                last = stopper.after_eval(evaluated) or last
            report.lap("eval")
            report.generated_tokens += pipe.counters.scored_tokens - tokens
            tokens = pipe.counters.scored_tokens
            rl_step = _step(step, batch, result, reward, evaluated, last)
            report.record(rl_step)
            if run is not None:
                run.record_step(rl_step)
            stop = await _call(on_step, rl_step)
            stopper.after_step(stop, evaluated is not None, last)
        await weights.close()
        # Written even at 0: the run's accounting reads a missing one as unknown.
        metrics = {
            **pipe.metrics,
            "scored_samples": pipe.counters.scored_samples,
            "in_flight_at_end": pipe.in_flight,
        }
    wall = clock() - started
    return await _ended(rl, loop, run, stopper, step, wall, pipe.cursor, metrics, evaluations)


async def _weights_at_start(rl: RLContext, done: int) -> WeightSync:
    """The run's weight sync, with every replica (relays first) on the newest weights, and the
    reference on the learner's before the first step (the KL term is measured from there)."""
    if rl.reference is not None and done == 0:
        await rl.reference.set_weights(await rl.learner.weights())
    weights = weight_sync(rl)
    await weights.ensure(None)
    return weights


def _stopped_before(loop: RLLoop, status: LearnerStatus, done: int) -> dict[str, Any] | None:
    """The result of a loop that had taken its last step, or stopped early (kept with the
    learner), at ``done``, for a driver restarted after it; None when it had not."""
    stopped = status.keep.stopped
    early = stopped is not None and (stopped.id, stopped.step) == (loop.id_prefix, done)
    if not early and done < loop.steps:
        return None
    reason = stopped.reason if early and stopped is not None else "steps"
    log.info("RL had stopped at step %d: %s", done, reason, extra=PROGRESS)
    return {
        "steps": done,
        "stop_reason": reason,
        "stopped_by_budget": "budget" in reason,
        "wall_s": 0.0,
        "cursor": status.keep.cursor or 0,
        "evaluations": [],
        "pipeline": {},
    }


async def _train(
    rl: RLContext,
    loop: RLLoop,
    run: Run | None,
    pipe: SamplePipeline,
    report: StepReport,
    weights: WeightSync,
    step: int,
) -> tuple[StepResult, Batch, float] | None:
    """One batch, one learner step, the new weights pushed; the trained batch's mean reward.
    None when the prompts ran out (the pipeline's ``PromptsExhausted``; before step 1, an
    error: an empty feed is not an end to keep with the run)."""
    try:
        batch = await pipe.next_batch()
    except PromptsExhausted as exc:
        if step > 1:
            return None
        raise ValueError(
            "rl_loop: the prompts ran out before the first step: the feed gave no prompt that "
            "could be trained (is the prompt source empty, or does the schedule retire every "
            "prompt?)"
        ) from exc
    report.lap("batch")
    keep = ProgramState(program=loop.keep)
    keep = keep.merged(run.position()) if run is not None else keep
    result = await learn(
        rl, batch, algorithm=loop.algorithm, lr=loop.lr, id=f"{loop.id_prefix}{step}", keep=keep
    )
    if run is not None:
        run.learner_step = result.step
    report.lap("learn")
    # Sync mode: every replica holds the new weights before the next batch is admitted.
    await weights.push(version=result.version)
    pipe.advance(result.version)
    report.lap("weights")
    rewards = [s.reward for s in batch.samples]
    return result, batch, sum(rewards) / max(1, len(rewards))


def _step(
    step: int,
    batch: Batch,
    result: StepResult,
    reward: float,
    evaluated: EvalResult | None,
    last: bool,
) -> RLStep:
    return RLStep(
        step=step,
        batch=batch,
        result=result,
        reward=reward,
        reward_scored=float(batch.metrics.get("reward_scored_mean", float("nan"))),
        evaluation=None if evaluated is None else evaluated.accuracy,
        eval_result=evaluated,
        last=last,
    )


async def _ended(
    rl: RLContext,
    loop: RLLoop,
    run: Run | None,
    stopper: _Stopper,
    step: int,
    wall: float,
    cursor: int,
    metrics: dict[str, Any],
    evaluations: list[dict[str, Any]],
) -> dict[str, Any]:
    """The loop's result; a loop that stopped early keeps why with the learner."""
    reason = stopper.reason
    if step < loop.steps:
        log.info("RL stopped at step %d of %d: %s", step, loop.steps, reason, extra=PROGRESS)
        stopped = Stopped(id=loop.id_prefix, step=step, reason=reason)
        await rl.learner.checkpoint(ProgramState(stopped=stopped))
    out = {
        "steps": step,
        "stop_reason": reason,
        "stopped_by_budget": "budget" in reason and step < loop.steps,
        "wall_s": wall,
        "cursor": cursor,
        "evaluations": evaluations,
        "pipeline": metrics,
    }
    if run is not None:
        run.loop_ended(out)
    return out


def weight_sync(rl: RLContext, **kwargs: Any) -> WeightSync:
    """The run's ``WeightSync``: the rollout group, after the relay groups (``relay_groups``:
    ``run.config.relays``, or the role named ``relay``), in the pipeline's mode (sync mode
    waits); ``kwargs`` go to ``WeightSync`` (``wait``, ``timeout``).

    Raises:
        ValueError: ``run.config.relays`` names a role the run lacks.
    """
    relays = [rl.ctx.roles[name] for name in relay_groups(rl.config, rl.ctx.roles)]
    kwargs.setdefault("wait", rl.pipeline.mode == "sync")
    return WeightSync(rl.rollout.handle, relays=relays, **kwargs)


async def _call(on_step: OnStep | None, step: RLStep) -> Stop | None:
    """``on_step(step)``, awaited when it is async; the ``Stop`` it returned or raised."""
    if on_step is None:
        return None
    try:
        outcome = on_step(step)
        if inspect.isawaitable(outcome):
            outcome = await outcome
    except Stop as stop:
        return stop
    return outcome if isinstance(outcome, Stop) else None


async def _evaluate(
    rl: RLContext, evaluation: Evaluation | Callable[[], Awaitable[Any]], step: int
) -> EvalResult:
    """The evaluation of the weights the replicas hold, as an ``EvalResult`` at ``step``."""
    if isinstance(evaluation, Evaluation):
        result = await evaluation.run(rl)
    else:
        value = await evaluation()
        result = value if isinstance(value, EvalResult) else EvalResult(value, value, 0)
    result.step = step
    return result


def _pipeline(
    rl: RLContext,
    loop: RLLoop,
    feed: PromptFeed,
    score: Scorer,
    report: StepReport,
    status: LearnerStatus,
) -> SamplePipeline:
    """The sample pipeline of ``rl_loop``, resumed where the learner's last step left it: the
    driver's own, or with ``pipeline.shards`` a ``ShardedPipeline`` over the dispatch shards,
    which score each sample with the reward role against its prompt's answer, as
    ``PromptFeed.scorer`` does.

    Raises:
        ValueError: ``pipeline.shards`` with a score function or a sample source of the
            program's own (they run in the driver alone).
    """
    settings = BatchSettings(
        batch_size=loop.prompts_per_step * loop.group_size,
        group_size=loop.group_size,
        **status.advantages,  # computed as the learner computes them
    )
    resume = status.keep.resume or {"cursor": status.keep.cursor or 0}
    shards = rl.pipeline.shards
    if not shards:
        return SamplePipeline(
            rl.rollout.handle,
            spec=rl.pipeline,
            feed=feed,
            score=report.scorer(score),
            params=loop.params,
            settings=settings,
            start_version=status.version,
            resume=resume,
            watchdog=rl.watchdog,
            source=loop.source,
        )
    own = "the program's own runs in the driver alone, and the shards"
    scores = f"pipeline.shards: {shards} dispatch shards score each sample with the reward role"
    if not isinstance(score, RewardScorer):
        raise ValueError(
            f"{scores} against its prompt's answer; a score function of {own} cannot call it: "
            f"leave out Run.rl_loop(score=...), or set pipeline.shards: 0"
        )
    if score.reward is not _reward_of(rl):
        raise ValueError(
            f"{scores} (roles.shards.config.reward, default 'reward'); a RewardScorer over "
            f"another reward client than the run's (RLContext.reward) is the program's own: it "
            f"runs in the driver alone, and the shards cannot call it: score with the run's "
            f"reward client (Run.rl_loop's default), or set pipeline.shards: 0"
        )
    if loop.source is not None:
        raise ValueError(
            f"pipeline.shards: {shards} dispatch shards generate with the rollout role; a "
            f"sample source of {own} cannot run it (RLLoop.source): leave it out, or set "
            f"pipeline.shards: 0"
        )
    return ShardedPipeline(
        rl.ctx.roles[SHARD_ROLE],
        spec=rl.pipeline,
        feed=feed,
        params=loop.params,
        settings=settings,
        start_version=status.version,
        resume=resume,
        watchdog=rl.watchdog,
        driver=rl.ctx.incarnation,
    )


def _reward_of(rl: RLContext) -> RewardClient | None:
    """The run's reward client, or None when the run has no ``reward`` role."""
    try:
        return rl.reward
    except KeyError:
        return None


class PromptFeed:
    """The prompt source as a ``SamplePipeline`` feed; keeps each prompt's answer for the reward."""

    def __init__(self, rl: RLContext) -> None:
        self.prompts = rl.prompts
        self.answers: dict[str, str] = {}

    async def __call__(self, cursor: int, n: int) -> list[Prompt]:
        taken = await self.prompts.take(cursor, n)
        self.answers.update({p.id: p.answer for p in taken})
        return taken

    def scorer(self, reward: RewardClient) -> RewardScorer:
        """A ``Scorer``: ``reward`` scores each sample against its prompt's answer (decoded
        with the reward role's tokenizer)."""
        return RewardScorer(self, reward)


class RewardScorer:
    """A ``Scorer``: the reward role scores each sample against its prompt's answer, kept by
    the ``PromptFeed`` that handed the prompt out. With ``pipeline.shards`` the dispatch shards
    score so themselves, each prompt's answer coming with its group's grant."""

    def __init__(self, feed: PromptFeed, reward: RewardClient) -> None:
        self.feed = feed
        self.reward = reward

    async def __call__(self, samples: list[Sample]) -> list[float]:
        answers = [self.feed.answers[s.prompt_id] for s in samples]
        return await self.reward.score_samples(samples, answers)


async def learn(
    rl: RLContext,
    batch: Batch,
    *,
    algorithm: str,
    lr: float = 0.0,
    timeout: float = 300.0,
    id: str = "",
    keep: ProgramState | None = None,
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
        keep=ProgramState(cursor=batch.cursor, resume=batch.resume).merged(keep or ProgramState()),
        lr=lr,
        correction=cast(Correction, spec.correction),  # validated by the manifest
        importance_cap=spec.importance_cap,
        id=id,
    )
    result = await rl.learner.train_step(train, timeout=timeout)
    if algorithm == "ppo" and rl.critic is not None:
        await rl.critic.train_step(batch.samples, id=id, timeout=timeout)
    return result
