"""A program's run: its phases, history, evaluation, wall time and summary, resumed for it.

    run = await Run.open(ctx, phases=["bc", "rl"], evaluation=evaluation)
    if run.phase == "bc":
        ...                                   # run.bc_step(samples, lr=...), run.evaluate_at(step)
        await run.end_phase(accuracy=(await run.evaluate()).accuracy)
    if run.phase == "rl":
        await run.rl_loop(RLLoop(...))        # prompts and rewards from the run's roles
        await run.end_phase()
    return await run.finish(accuracy_final=...)

A program declares its phases and what it measures; resuming is never its code:

- **Phases** run in the order declared. Where the run is travels with the learner, as the
  pipeline's position does: every step a ``Run`` sends (``train_step``, ``rl_loop``) keeps
  ``phase`` and ``phase_start`` in ``TrainBatch.keep`` (a ``ProgramState``), and
  ``end_phase`` keeps the next phase and the ended one's values (``phases``) with a learner
  checkpoint (a log entry under ``durable: wal``). A restarted driver reads them back from
  the learner's ``status``: ``run.phase`` is where it was, ``run.steps`` the steps the learner
  took in it.
- **History** (``asyncrl.roles.program.history``): ``history.jsonl``, one entry per (phase,
  step), written once; entries past the learner's position are dropped on resume (their steps
  are taken again). A step the learner took while the driver was down is recorded from the
  learner's record of it, and an evaluation due at it is taken then.
- **Evaluation**: ``run.evaluate()`` syncs the rollout replicas to the learner's version and
  runs the run's ``Evaluation``; ``evaluate_at(step)`` does so once per step, across restarts.
- **Summary** (``finish``): ``summary.json`` (the phases and their values, wall time, learner
  steps, samples consumed and per second, restarts, the pipeline's counters, what the program
  adds), ``progress.png`` and ``plots/`` (``asyncrl.roles.program.report``), the policy
  exported in Hugging Face format.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from asyncrl.dispatch.handles import Context
from asyncrl.observe.progress import say
from asyncrl.roles.payloads import (
    LearnerStatus,
    ProgramState,
    Sample,
    Scored,
    StepResult,
    TrainBatch,
)
from asyncrl.roles.program.clients import RLContext
from asyncrl.roles.program.evaluation import EvalResult, Evaluation
from asyncrl.roles.program.history import History
from asyncrl.roles.program.report import summarize
from asyncrl.roles.program.rl_loop import OnStep, PromptFeed, RLLoop, RLStep, rl_loop, weight_sync
from asyncrl.roles.sampling.contract import Scorer
from asyncrl.roles.sampling.pipeline import WeightSync

__all__ = ["DONE", "Run"]

DONE = "done"
"""The phase of a run whose declared phases have all ended."""


class Run:
    """The state a program's run carries across restarts (see the module's docstring).

    Attributes:
        rl: the run's typed context.
        phases: the phases, in order.
        phase: the current phase (``DONE`` after the last).
        phase_start: the learner step at which the current phase began.
        learner_step: the learner's step count, as of the last step this run saw.
        history: ``history.jsonl``.
        evaluation: the run's evaluation, or None.
        ended: each ended phase's values, by phase (``start`` and ``end``: learner steps;
            ``started_s`` and ``ended_s``: the run's clock, ``wall()``, when it began and
            ended; ``wall_s``: its length; and what ``end_phase`` was given).
        loops: the results of ``rl_loop`` in this incarnation, by phase.
    """

    def __init__(
        self,
        rl: RLContext,
        phases: Sequence[str],
        status: LearnerStatus,
        evaluation: Evaluation | None,
    ) -> None:
        self.rl = rl
        self.phases = list(phases)
        keep = status.keep
        self.phase = keep.phase or self.phases[0]
        if self.phase not in (*self.phases, DONE):
            raise ValueError(
                f"the learner kept phase {self.phase!r}, which this program does not declare "
                f"({self.phases}); resume it with the program that started it"
            )
        self.phase_start = keep.phase_start or 0
        self.learner_step = status.step
        self.ended: dict[str, dict[str, Any]] = dict(keep.phases)
        self.evaluation = evaluation
        self.loops: dict[str, dict[str, Any]] = {}
        self.history = History.open(rl.run_dir, fresh=status.step == 0, keeps=self._stands)
        walls = [self.history.wall_s, *(float(p.get("ended_s", 0)) for p in self.ended.values())]
        self._started = time.monotonic() - max(walls)
        self._status = status

    @classmethod
    async def open(
        cls,
        ctx: Context | RLContext,
        *,
        phases: Sequence[str],
        evaluation: Evaluation | None = None,
    ) -> Run:
        """The run, where the learner's last step left it.

        Raises:
            ValueError: no phases, or the learner kept a phase the program does not declare.
            KeyError: the run lacks a role the RL context needs.
        """
        if not phases:
            raise ValueError("a Run needs at least one phase")
        rl = RLContext(ctx) if isinstance(ctx, Context) else ctx
        status = await rl.learner.status()
        run = await asyncio.to_thread(cls, rl, phases, status, evaluation)
        if status.step:
            say(f"resuming at learner step {status.step} ({run.phase} phase, step {run.steps})")
        return run

    def _stands(self, entry: dict[str, Any]) -> bool:
        """Whether a history entry of an earlier incarnation stands: its phase ended, or it
        is at or before the learner's position in the current phase."""
        phase = entry.get("phase")
        if phase in self.ended:
            return True
        return phase == self.phase and int(entry.get("step", 0)) <= self.steps

    @property
    def steps(self) -> int:
        """Learner steps taken in the current phase."""
        return self.learner_step - self.phase_start

    def wall(self) -> float:
        """Seconds of the run so far, earlier incarnations included."""
        return time.monotonic() - self._started

    def phase_started_s(self) -> float:
        """The run's clock (``wall()``) when the current phase began: when the phase before
        it ended (phases run one after another), 0 for the first."""
        return max((float(p.get("ended_s", 0.0)) for p in self.ended.values()), default=0.0)

    def position(self) -> ProgramState:
        """What every learner step keeps of the run's position (``TrainBatch.keep``)."""
        return ProgramState(phase=self.phase, phase_start=self.phase_start)

    def values(self, phase: str) -> dict[str, Any]:
        """The values ``end_phase`` kept for ``phase`` ({} while it has not ended)."""
        return dict(self.ended.get(phase, {}))

    async def train_step(self, batch: TrainBatch) -> StepResult:
        """A learner step keeping the run's position; re-sent if the learner died with it. Its
        ``algorithm`` and ``lr``, when not given, are the learner's; given and different from
        what the learner's config sets, they override it, with a warning
        (``asyncrl.roles.program.settings``)."""
        settings = self.rl.settings
        batch.algorithm = settings.algorithm(batch.algorithm, "TrainBatch.algorithm")
        batch.lr = settings.lr(batch.lr, "TrainBatch.lr")
        batch.keep = batch.keep.merged(self.position())
        result = await self.rl.learner.train_step(batch)
        self.learner_step = result.step
        return result

    async def bc_step(
        self,
        samples: Sequence[Sample],
        *,
        lr: float = 0.0,
        algorithm: str = "bc",
        keep: ProgramState | None = None,
    ) -> StepResult:
        """One behaviour-cloning step on ``samples`` (demonstrations: their tokens are the
        targets), with the ids it needs minted for it. ``lr``: 0 for the learner's
        (``roles.learner.config.lr``); another overrides it as ``train_step`` says. ``keep``:
        what the program keeps of its own with the step (a demonstrations cursor), besides
        the run's position.

        A demonstration is used again and again, so each use gets a ledger id of its own
        (``<prompt id>#<phase><step>``), and the batch the id ``<phase>-<step + 1>`` that
        makes a step re-sent after a restart count once.
        """
        step = self.steps
        lr = self.rl.settings.lr(lr, "Run.bc_step's lr")
        uses = [
            Scored(sample=msgspec.structs.replace(s, prompt_id=f"{s.prompt_id}#{self.phase}{step}"))
            for s in samples
        ]
        batch = TrainBatch(
            samples=uses,
            algorithm=algorithm,
            lr=lr,
            id=f"{self.phase}-{step + 1}",
            keep=keep or ProgramState(),
        )
        return await self.train_step(batch)

    async def rl_loop(
        self,
        loop: RLLoop,
        *,
        feed: PromptFeed | None = None,
        score: Scorer | None = None,
        on_step: OnStep | None = None,
        display: bool = True,
    ) -> dict[str, Any]:
        """``rl_loop`` in the current phase, from where the learner left it: prompts from the
        run's prompt source and rewards from its reward role, unless ``feed`` and ``score``
        are given; each step recorded in the history. Returns ``rl_loop``'s result."""
        if feed is None:
            prompts = PromptFeed(self.rl)
            feed, score = prompts, score or prompts.scorer(self.rl.reward)
        if score is None:
            raise ValueError(
                "Run.rl_loop: a feed of your own needs a score function too (score=...)"
            )
        return await rl_loop(
            self.rl, loop, feed=feed, score=score, on_step=on_step, display=display, run=self
        )

    def record(self, step: int | None = None, **metrics: Any) -> dict[str, Any]:
        """Record ``metrics`` of the current phase at ``step`` (default: ``steps``) in the
        history, with the run's wall time; once per step (see ``History.record``)."""
        step = self.steps if step is None else step
        return self.history.record(self.phase, step, **metrics, wall_s=self.wall())

    async def evaluate(self) -> EvalResult:
        """The run's evaluation of the learner's current weights (the rollout replicas are
        synced to them first).

        Raises:
            ValueError: the run has no evaluation.
        """
        if self.evaluation is None:
            raise ValueError("this Run has no evaluation: give Run.open an Evaluation")
        status = await self.rl.learner.status()
        await weight_sync(self.rl, wait=True, timeout=300).ensure(status.version)
        result = await self.evaluation.run(self.rl)
        result.step = self.steps
        return result

    async def evaluate_at(self, step: int) -> float:
        """The accuracy at ``step`` of the current phase: recorded in the history, or measured
        now (``evaluate``) and recorded."""
        entry = self.history.get(self.phase, step)
        if entry is not None and entry.get("accuracy") is not None:
            return float(entry["accuracy"])
        result = await self.evaluate()
        self.record(step, **_eval_metrics(result))
        return result.accuracy

    def record_step(self, step: RLStep) -> None:
        """``rl_loop``'s record of one step in the history."""
        self.record(
            step.step,
            reward=step.reward,
            reward_scored=step.reward_scored,
            staleness_max=step.batch.metrics.get("staleness_max", 0),
            **(_eval_metrics(step.eval_result) if step.eval_result is not None else {}),
        )

    async def resumed_loop(self, done: int, boundary: bool, weights: WeightSync) -> None:
        """Before ``rl_loop`` resumes at ``done``: record a step the learner took while the
        driver was down, from the learner's record of it, and the evaluation due at it."""
        if not done:
            return
        if self.history.get(self.phase, done) is None:
            metrics = self._status.last.get("result", {}).get("metrics", {})
            self.record(
                done,
                reward=metrics.get("reward_mean", float("nan")),
                staleness_max=metrics.get("staleness_max", 0),
                recovered=True,
            )
        entry = self.history.get(self.phase, done) or {}
        if boundary and self.evaluation is not None and entry.get("accuracy") is None:
            await weights.ensure(self._status.version)
            result = await self.evaluation.run(self.rl)
            self.record(done, **_eval_metrics(result))

    def loop_ended(self, out: dict[str, Any]) -> None:
        """``rl_loop``'s result, kept with the phase when it ends."""
        self.loops[self.phase] = out

    async def end_phase(self, **values: Any) -> None:
        """End the current phase: keep its values and the next phase with the learner.

        ``values`` (JSON-able) are kept with the phase and readable later as
        ``values(phase)``, after any restart."""
        loop = self.loops.get(self.phase)
        started, now = self.phase_started_s(), self.wall()
        ended = {
            "start": self.phase_start,
            "end": self.learner_step,
            "started_s": started,
            "ended_s": now,
            "wall_s": now - started,
            **({"pipeline": loop["pipeline"]} if loop and loop.get("pipeline") else {}),
            **values,
        }
        self.ended[self.phase] = ended
        index = self.phases.index(self.phase) if self.phase in self.phases else len(self.phases)
        following = self.phases[index + 1] if index + 1 < len(self.phases) else DONE
        self.phase, self.phase_start = following, self.learner_step
        await self.rl.learner.checkpoint(self.position().merged(ProgramState(phases=self.ended)))

    async def finish(self, *, export: str = "final", **extra: Any) -> dict[str, Any]:
        """Write ``summary.json``, ``progress.png`` and ``plots/``, export the policy to
        ``RUN_DIR/exports/<export>`` (none when empty); return the summary. ``extra`` goes
        into the summary as it is."""
        final = await self.rl.learner.export(export) if export else ""
        status = await self.rl.learner.status()
        return await asyncio.to_thread(summarize, self, status, final, extra)


def _eval_metrics(result: EvalResult) -> dict[str, Any]:
    return {
        "accuracy": result.accuracy,
        "score_mean": result.score_mean,
        "eval_versions": list(result.versions),
    }
