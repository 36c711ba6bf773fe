"""A discrete-event model of the sample pipeline, in sync and async mode.

The benchmark runs the real pipeline (real processes, simulated generation) on the same
per-sample durations as this model, so the ratio measured/model is the runtime's overhead. The
model therefore implements exactly the runtime's scheduling rules, and nothing else:

- Prompts are admitted in index order; each is a GRPO group of ``G`` samples (``0..G-1``).
- Admitted samples enter one FIFO queue. While a slot is free and the queue is not empty, the head
  goes to the replica with the most free slots (ties: the lowest index), as the credit-based
  dispatcher does. A sample of duration ``d`` holds one slot of replica ``r`` for ``d / s[r]``.
- A group is complete when all its samples are; complete groups queue for the learner in
  completion order.
- The learner version ``v`` starts at ``start_version`` and grows by one after each step. A
  sample's version is ``v`` when it starts on a replica; consumed at version ``v``, its staleness
  is ``v`` minus that.
- Admission (pacing): a group may enter when ``admitted - wasted + G <= (v + eta + 1) * B +
  overprovision``. Sync mode is exactly ``eta = 0``, ``overprovision = 0``.
- An idle learner takes complete groups from the head of the ready queue as they come, as the
  pipeline's ``next_batch`` does, until it holds ``B / G`` of them, then steps for ``learner_s``.
  A group with a sample older than ``eta`` is kept (``"correct"``), or discarded the moment it is
  taken (``"drop"``: counted as wasted, which re-opens admission) and another group is taken in
  its place, so every step trains on ``B`` samples.

Events sit on a heap ordered by (time, sequence number), so equal times resolve in the order
they were scheduled and a run is a pure function of its inputs. After every event the learner,
admission and dispatch are brought up to date, in that order.

Figures are measured from the end of the ``warmup``-th step to the end of the last step.
Percentiles of staleness are nearest-rank: the ``p``-th percentile of ``n`` sorted values is the
value at rank ``ceil(p / 100 * n)``.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

__all__ = ["MODES", "OVER_ETA", "ModelResult", "Workload", "sample_duration", "simulate"]

MODES = ("sync", "async")
OVER_ETA = ("correct", "drop")

Duration = Callable[[int, int], float]

_DONE = 0  # event: a sample finished on a replica
_STEP = 1  # event: the learner finished a step


def sample_duration(
    prompt_index: int, sample_index: int, sigma: float, *, mean_s: float = 0.05, seed: int = 0
) -> float:
    """The generation time of one sample: lognormal with arithmetic mean ``mean_s``.

    ``mu = ln(mean_s) - sigma**2 / 2``, so the mean does not move with ``sigma``; ``sigma = 0``
    gives exactly ``mean_s``. Each sample id draws from its own generator seeded by a string (not
    by ``hash()``, which Python randomizes per process), so the real pipeline and the model draw
    the same value for the same id, in any order.
    """
    if sigma == 0:
        return mean_s
    rng = random.Random(f"{seed}:{prompt_index}:{sample_index}")
    return rng.lognormvariate(math.log(mean_s) - sigma * sigma / 2, sigma)


@dataclass(frozen=True)
class Workload:
    """One configuration of the pipeline.

    Raises:
        ValueError: listing every invalid field at once.
    """

    sigma: float
    """Log-space standard deviation of the sample durations (0: all equal to ``mean_s``)."""
    speeds: tuple[float, ...] = (1.0, 1.0, 1.0, 1 / 3)
    """Relative speed of each rollout replica."""
    slots: int = 16
    """Concurrent samples per replica."""
    group: int = 8
    """Samples per prompt (GRPO group size ``G``)."""
    batch: int = 256
    """Samples per learner step (``B``)."""
    mean_s: float = 0.05
    """Mean sample duration at speed 1, in seconds."""
    learner_factor: float = 0.25
    """Learner step time as a fraction of the ideal batch time ``batch * mean_s / capacity``."""
    eta: int = 2
    """Largest staleness (in learner versions) that async mode allows."""
    over_eta: str = "correct"
    """What happens to a consumed sample older than ``eta``: ``"correct"`` or ``"drop"``."""
    overprovision: int = 0
    """Samples admitted beyond the staleness bound (async mode only)."""
    warmup: int = 5
    """Learner steps before the measured window."""
    steps: int = 30
    """Learner steps in the measured window."""
    seed: int = 0
    """Seed of the default sample durations."""
    start_version: int = 0
    """Learner version at time 0."""

    def __post_init__(self) -> None:
        problems = []
        if self.sigma < 0:
            problems.append(f"sigma: expected >= 0, got {self.sigma}")
        if not self.speeds or any(not s > 0 for s in self.speeds):
            problems.append(f"speeds: expected one or more values > 0, got {self.speeds}")
        for name in ("slots", "group", "batch", "steps"):
            if getattr(self, name) < 1:
                problems.append(f"{name}: expected int >= 1, got {getattr(self, name)}")
        for name in ("eta", "overprovision", "warmup"):
            if getattr(self, name) < 0:
                problems.append(f"{name}: expected int >= 0, got {getattr(self, name)}")
        if not self.mean_s > 0:
            problems.append(f"mean_s: expected > 0, got {self.mean_s}")
        if self.learner_factor < 0:
            problems.append(f"learner_factor: expected >= 0, got {self.learner_factor}")
        if self.over_eta not in OVER_ETA:
            problems.append(f"over_eta: expected one of {OVER_ETA}, got {self.over_eta!r}")
        if self.group >= 1 and self.batch >= 1 and self.batch % self.group:
            problems.append(
                f"batch: expected a multiple of group ({self.group}), got {self.batch}; a "
                "learner taking whole groups would take more than batch and stall admission"
            )
        if problems:
            raise ValueError("workload: " + "; ".join(problems))

    @property
    def capacity(self) -> float:
        """Seconds of speed-1 work the replicas do per second when full: ``slots * sum(speeds)``."""
        return self.slots * sum(self.speeds)

    @property
    def learner_s(self) -> float:
        """Seconds per learner step: ``learner_factor * batch * mean_s / capacity``."""
        return self.learner_factor * self.batch * self.mean_s / self.capacity


@dataclass(frozen=True)
class ModelResult:
    """The figures of one simulated run, over the measured window.

    Work is in seconds of generation at speed 1 (the sum of sample durations).
    """

    mode: str
    window_s: float
    """From the end of the ``warmup``-th step to the end of the last step."""
    window_steps: int
    """Learner steps that ended in the window."""
    samples_per_s: float
    """Samples consumed by the window's steps, per second of window."""
    work_per_s: float
    """Work consumed by the window's steps, per second of window."""
    efficiency: float
    """Consumed work over ``capacity * window_s``. It can pass 1 by a little: the window's first
    batches hold work done before the window began."""
    idle: tuple[float, ...]
    """Per replica: empty slot-time over ``slots * window_s``."""
    consumed_samples: int
    """Samples in the batches of the window's steps."""
    consumed_work: float
    dispatched_samples: int
    """Samples that started on a replica in the window."""
    dispatched_work: float
    wasted_samples: int
    """Samples dropped in the window (``over_eta="drop"``)."""
    wasted_work: float
    waste_fraction: float
    """Wasted work over dispatched work."""
    staleness_p50: int
    """Nearest-rank percentiles and maximum of the consumed samples' staleness."""
    staleness_p99: int
    staleness_max: int
    mean_consumed_s: float
    """Mean duration of consumed samples; below ``mean_dispatched_s`` means short ones win."""
    mean_dispatched_s: float
    admission_excess_max: int
    """Largest ``admitted - wasted - (v + eta + 1) * B`` seen; at most ``overprovision``."""

    def as_dict(self) -> dict[str, object]:
        """The figures as a JSON-ready dict (``idle`` as a list)."""
        out = asdict(self)
        out["idle"] = list(self.idle)
        return out


def _percentile(ordered: list[int], p: float) -> int:
    """Nearest-rank percentile of a sorted, non-empty list."""
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


class _Run:
    """The state of one simulation; ``run()`` advances it to the last learner step."""

    def __init__(self, w: Workload, eta: int, overprovision: int, duration: Duration) -> None:
        self.w = w
        self.eta = eta
        self.overprovision = overprovision
        self.duration = duration
        self.total_steps = w.warmup + w.steps
        self.free = [w.slots] * len(w.speeds)
        self.queue: deque[int] = deque()  # sample ids waiting for a slot
        self.ready: deque[int] = deque()  # complete groups, in completion order
        self.taken: list[int] = []  # sample ids of the groups the idle learner holds so far
        self.events: list[tuple[float, int, int, int, int]] = []  # time, seq, kind, replica, id
        self.seq = 0
        self.now = 0.0
        self.version = w.start_version
        self.steps_done = 0
        self.learner_busy = False
        self.admitted = 0
        self.wasted = 0
        self.excess_max = -(self.eta + 1) * w.batch
        # Per sample id (prompt * G + index).
        self.dur: list[float] = []
        self.sample_version: list[int] = []
        self.start: list[float] = []
        self.end: list[float] = []
        self.replica: list[int] = []
        self.done_in_group: list[int] = []
        # Per learner step: (step number, version, sample ids) of each batch; drops as (time, ids).
        self.batches: list[tuple[int, int, list[int]]] = []
        self.drops: list[tuple[float, list[int]]] = []
        self.step_end: list[float] = []

    def push(self, time: float, kind: int, replica: int, item: int) -> None:
        heapq.heappush(self.events, (time, self.seq, kind, replica, item))
        self.seq += 1

    def admit(self) -> None:
        w = self.w
        limit = (self.version + self.eta + 1) * w.batch + self.overprovision
        while self.admitted - self.wasted + w.group <= limit:
            prompt = len(self.done_in_group)
            self.done_in_group.append(0)
            for j in range(w.group):
                sid = len(self.dur)
                self.dur.append(self.duration(prompt, j))
                self.sample_version.append(-1)
                self.start.append(math.nan)
                self.end.append(math.nan)
                self.replica.append(-1)
                self.queue.append(sid)
            self.admitted += w.group
        excess = self.admitted - self.wasted - (self.version + self.eta + 1) * w.batch
        self.excess_max = max(self.excess_max, excess)

    def dispatch(self) -> None:
        free, speeds = self.free, self.w.speeds
        replicas = range(len(free))
        while self.queue:
            r = max(replicas, key=free.__getitem__)  # max() keeps the first: lowest index
            if free[r] == 0:
                return
            sid = self.queue.popleft()
            free[r] -= 1
            end = self.now + self.dur[sid] / speeds[r]
            self.sample_version[sid] = self.version
            self.start[sid] = self.now
            self.end[sid] = end
            self.replica[sid] = r
            self.push(end, _DONE, r, sid)

    def learn(self) -> None:
        w = self.w
        if self.learner_busy:
            return
        while self.ready and len(self.taken) < w.batch:
            g = self.ready.popleft()
            ids = list(range(g * w.group, (g + 1) * w.group))
            stale = any(self.version - self.sample_version[i] > self.eta for i in ids)
            if stale and w.over_eta == "drop":
                self.wasted += len(ids)
                self.drops.append((self.now, ids))
            else:
                self.taken += ids
        if len(self.taken) >= w.batch:
            self.learner_busy = True
            self.batches.append((self.steps_done + 1, self.version, self.taken))
            self.taken = []
            self.push(self.now + w.learner_s, _STEP, -1, -1)

    def settle(self) -> None:
        self.learn()
        self.admit()
        self.dispatch()

    def run(self) -> None:
        w = self.w
        self.settle()
        while self.steps_done < self.total_steps:
            if not self.events:
                raise RuntimeError(
                    f"pipeline model: stalled after {self.steps_done} of {self.total_steps} "
                    f"learner steps at t={self.now:.6g}s with nothing in flight; this is a bug "
                    "in the model (admission should always let a batch complete)"
                )
            self.now, _, kind, r, sid = heapq.heappop(self.events)
            if kind == _DONE:
                self.free[r] += 1
                g = sid // w.group
                self.done_in_group[g] += 1
                if self.done_in_group[g] == w.group:
                    self.ready.append(g)
            else:
                self.learner_busy = False
                self.version += 1
                self.steps_done += 1
                self.step_end.append(self.now)
                if self.steps_done == self.total_steps:
                    return
            self.settle()

    def result(self, mode: str) -> ModelResult:
        w = self.w
        t0 = self.step_end[w.warmup - 1] if w.warmup else 0.0
        t1 = self.step_end[-1]
        window = t1 - t0
        dur = self.dur

        consumed: list[int] = []
        staleness: list[int] = []
        for step, version, ids in self.batches:
            if step > w.warmup:
                consumed += ids
                staleness += [version - self.sample_version[i] for i in ids]
        staleness.sort()
        consumed_work = math.fsum(dur[i] for i in consumed)

        wasted = [i for t, ids in self.drops if t0 <= t < t1 for i in ids]
        wasted_work = math.fsum(dur[i] for i in wasted)

        busy = [0.0] * len(w.speeds)
        dispatched: list[int] = []
        for sid, r in enumerate(self.replica):
            if r < 0:
                continue
            start, end = self.start[sid], self.end[sid]
            if t0 <= start < t1:
                dispatched.append(sid)
            overlap = min(end, t1) - max(start, t0)
            if overlap > 0:
                busy[r] += overlap
        dispatched_work = math.fsum(dur[i] for i in dispatched)

        return ModelResult(
            mode=mode,
            window_s=window,
            window_steps=self.steps_done - w.warmup,
            samples_per_s=len(consumed) / window,
            work_per_s=consumed_work / window,
            efficiency=consumed_work / (w.capacity * window),
            idle=tuple(max(0.0, 1 - b / (w.slots * window)) for b in busy),  # 0, not -1e-16
            consumed_samples=len(consumed),
            consumed_work=consumed_work,
            dispatched_samples=len(dispatched),
            dispatched_work=dispatched_work,
            wasted_samples=len(wasted),
            wasted_work=wasted_work,
            waste_fraction=wasted_work / dispatched_work if dispatched_work else 0.0,
            staleness_p50=_percentile(staleness, 50),
            staleness_p99=_percentile(staleness, 99),
            staleness_max=staleness[-1],
            mean_consumed_s=consumed_work / len(consumed),
            mean_dispatched_s=dispatched_work / len(dispatched) if dispatched else 0.0,
            admission_excess_max=self.excess_max,
        )


def simulate(workload: Workload, mode: str, duration: Duration | None = None) -> ModelResult:
    """Simulate ``workload`` in ``mode`` until ``warmup + steps`` learner steps have ended.

    Args:
        workload: the configuration. Sync mode ignores its ``eta`` and ``overprovision`` (both 0).
        mode: ``"sync"`` or ``"async"``.
        duration: ``duration(prompt_index, sample_index)`` in seconds at speed 1; by default
            ``sample_duration`` with the workload's ``sigma``, ``mean_s`` and ``seed``. The
            benchmark passes the draws its simulated generation uses.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"pipeline model: mode expected one of {MODES}, got {mode!r}")
    if duration is None:
        w = workload

        def duration(prompt: int, index: int) -> float:
            return sample_duration(prompt, index, w.sigma, mean_s=w.mean_s, seed=w.seed)

    sync = mode == "sync"
    run = _Run(
        workload,
        eta=0 if sync else workload.eta,
        overprovision=0 if sync else workload.overprovision,
        duration=duration,
    )
    run.run()
    return run.result(mode)
