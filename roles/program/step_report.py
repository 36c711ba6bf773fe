"""What the RL loop reports at every step: ``metrics.jsonl``, TensorBoard and a progress display.

``StepReport`` is what ``asyncrl.roles.program.rl_loop.rl_loop`` opens around its steps; every
program built on that loop (the built-in ones, the arith example) reports the same way, without code
of its own. Each step is one record of ``RUN_DIR/metrics.jsonl`` (written by
``asyncrl.observe.metrics.MetricsLog``, mirrored to TensorBoard when it is installed):

- ``step`` (the RL step, from 1), ``wall_s`` (seconds of the RL loop so far, across resumes),
  ``time`` (Unix time), ``version`` (the policy's, after the step);
- ``reward``: ``mean``, ``p10``, ``p50``, ``p90`` of the rewards of the batch the learner
  trained on (``RLStep.reward``); ``ci95``, the half-width of the 95% interval of that mean
  (1.96 standard errors: for a reward of 0 or 1 the quantiles say little, this says how sure
  the mean is); and ``scored_mean``, the mean reward of every group scored since the previous
  batch, the uniform ones that dynamic sampling dropped included (``RLStep.reward_scored``: in
  async mode these are not the trained batch's groups, and the two means differ);
- ``accuracy``: the held-out accuracy, on the steps that evaluated; ``evaluation``: that
  evaluation in full (``accuracy``, the verifier's ``score_mean``, ``count``, and the weight
  ``versions`` of the completions evaluated: ``asyncrl.roles.program.evaluation``);
- ``learner``: the learner's metrics of the step (its loss and loss parts, ``kl`` and
  ``entropy`` when they are computed, ``grad_norm``, ``lr``, ...);
- ``staleness``: ``p50``, ``p99`` and ``max`` over the batch's samples, in versions;
- ``throughput``, over the time since the previous step: ``samples_per_s`` (trained),
  ``tokens_generated_per_s`` (completion tokens of every sample scored, dropped ones included)
  and ``tokens_trained_per_s`` (completion tokens of the batch);
- ``time_s``: the step's seconds since the previous step's record (``step``), and their parts:
  ``batch`` (waiting for the batch), ``learn`` (the learner's step with the critic's and the
  reference's calls), ``weights`` (moving them to the rollout replicas), ``eval``;
- ``idle``: per role, the share of the step in which its replicas had no call of the driver in
  flight, averaged over its replicas (``ctx.idle()``, ``asyncrl.observe.metrics.IdleFractions``);
- ``restarts``: the restarts the supervisor logged so far (``asyncrl.observe.metrics.Restarts``);
- ``pipeline``: the sample pipeline's counters so far (samples admitted, generated, wasted,
  groups dropped, ...).

A call one role makes to another directly, without the driver, does not count as busy.

A step the learner took while the driver was down, whose record was never written, is written
when the loop resumes, from the learner's record of its last step (``recovered: true``, with the
learner's metrics and the trained batch's mean reward).

The progress display (``asyncrl.observe.progress``) shows the step, the reward, the last held-out
accuracy, samples per second, restarts and the time left.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from asyncrl.observe.metrics import MetricsLog, Restarts
from asyncrl.observe.progress import Progress
from asyncrl.roles.learning.statistics import Moments
from asyncrl.roles.payloads import LearnerStatus, Sample

if TYPE_CHECKING:
    from asyncrl.roles.program.rl_loop import RLStep

__all__ = ["StepReport"]

Scorer = Callable[[list[Sample]], Awaitable[list[float]]]
LAPS = ("batch", "learn", "weights", "eval")
"""The parts of a step's time, in the order the loop takes them."""


def ci95(values: list[float]) -> float:
    """The half-width of the 95% interval of ``values``' mean: 1.96 times its standard error
    (the sample standard deviation over the square root of the count); 0 for fewer than two."""
    moments = Moments.of(values)
    n = moments.count
    return 1.96 * math.sqrt(moments.m2 / (n - 1) / n) if n >= 2 else 0.0


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (NaN for none)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class StepReport:
    """The metrics file, TensorBoard and the progress display of one ``rl_loop``.

    Use it as an async context manager around the loop; inside, ``lap`` after each part of a
    step and ``record`` at its end. Wrap the pipeline's scorer with ``scorer`` to count the
    tokens generated.

    Args:
        run_dir: the run directory.
        title: what the progress display calls the loop (``GRPO``).
        total: the step the loop ends at.
        done: the steps taken before (a resumed loop's).
        learner: the learner's status when the loop starts (its last step, to recover a step
            whose record the driver never wrote).
        display: show the progress display.
        idle: each role's idle fraction since its previous call (``ctx.idle``); without it,
            only the learner's, from the loop's own laps.
        clock: seconds, for the step's times (a test may pass a fake one).
    """

    def __init__(
        self,
        run_dir: str,
        title: str,
        total: int,
        *,
        done: int,
        learner: LearnerStatus,
        display: bool = True,
        clock: Callable[[], float] = time.monotonic,
        idle: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        self.log = MetricsLog(run_dir, done=done)
        self.restarts = Restarts(run_dir)
        self.progress = Progress(title, total, done=done, clock=clock) if display else None
        self.done = done
        self.learner = learner
        self.clock = clock
        self.idle = idle
        self.generated_tokens = 0  # completion tokens of the samples scored so far
        self.accuracy: float | None = None  # the last held-out accuracy
        self._laps: dict[str, float] = {}
        self._entered = self._mark = self._previous = clock()
        self._wall_before = 0.0  # the loop's wall time before this incarnation
        self._tokens_before = 0

    def scorer(self, score: Scorer) -> Scorer:
        """``score``, counting the completion tokens of the samples it scores."""

        async def counted(samples: list[Sample]) -> list[float]:
            self.generated_tokens += sum(len(s.token_ids) for s in samples)
            return await score(samples)

        return counted

    async def __aenter__(self) -> StepReport:
        await self.log.__aenter__()
        if self.done and self.log.last_step < self.done and self.learner.last.get("result"):
            self.log.write(self._recovered())
        accuracies = [r["accuracy"] for r in self.log.records if r.get("accuracy") is not None]
        self.accuracy = accuracies[-1] if accuracies else None
        self._wall_before = self.log.wall_s
        self._entered = self._mark = self._previous = self.clock()
        if self.progress is not None:
            self.progress.__enter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.close()
        await self.log.__aexit__()

    def wall(self) -> float:
        """Seconds of the loop so far, earlier incarnations included."""
        return self._wall_before + self.clock() - self._entered

    def lap(self, name: str) -> None:
        """The part ``name`` of the step ends now (its time runs from the previous lap)."""
        now = self.clock()
        self._laps[name] = self._laps.get(name, 0.0) + now - self._mark
        self._mark = now

    def record(self, step: RLStep) -> dict[str, Any]:
        """Write ``step``'s record and show it; return the record."""
        now = self.clock()
        interval = max(now - self._previous, 1e-9)
        samples = step.batch.samples
        rewards = [s.reward for s in samples]
        metrics = step.batch.metrics
        record: dict[str, Any] = {
            "step": step.step,
            "wall_s": self._wall_before + now - self._entered,
            "time": time.time(),
            "version": step.result.version,
            "reward": {
                "mean": step.reward,
                **{f"p{q}": quantile(rewards, q / 100) for q in (10, 50, 90)},
                "ci95": ci95(rewards),
                "scored_mean": step.reward_scored,
            },
            **({"accuracy": step.evaluation} if step.evaluation is not None else {}),
            **({"evaluation": step.eval_result.record()} if step.eval_result else {}),
            "learner": dict(step.result.metrics),
            "staleness": {k: metrics.get(f"staleness_{k}", 0.0) for k in ("p50", "p99", "max")},
            "throughput": {
                "samples_per_s": len(samples) / interval,
                "tokens_generated_per_s": (self.generated_tokens - self._tokens_before) / interval,
                "tokens_trained_per_s": sum(len(s.sample.token_ids) for s in samples) / interval,
            },
            "time_s": {"step": interval, **{k: self._laps.get(k, 0.0) for k in LAPS}},
            "idle": {
                "learner": max(0.0, 1.0 - self._laps.get("learn", 0.0) / interval),
                **(self.idle() if self.idle is not None else {}),
            },
            "restarts": self.restarts(),
            "pipeline": {k: v for k, v in metrics.items() if not k.startswith("staleness_")},
        }
        self.log.write(record)
        self._previous = self._mark = now
        self._laps = {}
        self._tokens_before = self.generated_tokens
        if step.evaluation is not None:
            self.accuracy = step.evaluation
        if self.progress is not None:
            self.progress.update(step.step, self._fields(record), notable="accuracy" in record)
        return record

    def _fields(self, record: dict[str, Any]) -> dict[str, str]:
        accuracy = "-" if self.accuracy is None else f"{self.accuracy:.3f}"
        return {
            "reward": f"{record['reward']['mean']:.3f}",
            "held-out": accuracy,
            "samples/s": f"{record['throughput']['samples_per_s']:.1f}",
            "restarts": str(record["restarts"]),
        }

    def _recovered(self) -> dict[str, Any]:
        """The record of the learner's last step, taken while the driver was down."""
        result = self.learner.last["result"]
        metrics: dict[str, Any] = result.get("metrics", {})
        return {
            "step": self.done,
            "wall_s": self.log.wall_s,
            "time": time.time(),
            "version": result.get("version", self.learner.version),
            "reward": {"mean": metrics.get("reward_mean", math.nan)},
            "learner": metrics,
            "staleness": {
                k: metrics[f"staleness_{k}"]
                for k in ("p50", "p99", "max")
                if f"staleness_{k}" in metrics
            },
            "restarts": self.restarts(),
            "recovered": True,
        }
