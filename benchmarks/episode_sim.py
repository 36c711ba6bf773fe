"""Simulated roles of ``asyncrl bench episodes``: a policy whose turns take a set time, and an
environment whose steps take log-normal times.

``TurnRollout`` answers ``generate`` as ``Rollout`` does: each request sleeps the turn's
generation time and comes back finished, with ``tokens`` lowercase-letter token ids drawn from
the prompt id, negative log-probs and the replica's weights version. It records when it had
at least one ``generate`` call in progress, and its ``idle`` endpoint tells the fraction of a
window it had none. (``sim.SimRollout`` does not fit: it needs prompt ids ``p<index>``, where
the episode runner names a turn ``<episode>/<attempt>/<turn>``, and counts busy slot-seconds
rather than time with any call in progress.)

``SpreadEnv`` is an ``Environment``: an episode of task ``i`` (an int) lasts ``turns_of(i)``
steps, and step ``t`` of it sleeps ``step_latency(i, t)``: log-normal, median ``median_s``,
log-space standard deviation ``sigma``. Every draw is a function of the seed, the task and the
turn alone, so two runs of the same task (sync and async mode) wait exactly as long, and
``episode_seconds`` knows an episode's ideal duration without running it.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Any

import msgspec

from asyncrl.role import Delivery, Role, RoleContext, endpoint
from asyncrl.roles.agents.environment import Environment, Transition
from asyncrl.roles.payloads import GenerateBatch, GenerateRequest, Sample

__all__ = [
    "MAX_TURNS",
    "MIN_TURNS",
    "SpreadEnv",
    "TurnRollout",
    "busy_seconds",
    "episode_seconds",
    "step_latency",
    "turns_of",
]

MIN_TURNS = 3
MAX_TURNS = 5
"""An episode takes from ``MIN_TURNS`` to ``MAX_TURNS`` steps, drawn per task."""


def turns_of(task: int, seed: int) -> int:
    """The steps an episode of ``task`` takes."""
    return random.Random(f"{seed}:turns:{task}").randint(MIN_TURNS, MAX_TURNS)


def step_latency(task: int, turn: int, median_s: float, sigma: float, seed: int) -> float:
    """Seconds step ``turn`` of an episode of ``task`` takes: log-normal, median ``median_s``.

    Seeded by a string, not by ``hash()`` (randomized per process), so the environment's
    replicas and the benchmark's model draw the same value.
    """
    if sigma == 0:
        return median_s
    return random.Random(f"{seed}:step:{task}:{turn}").lognormvariate(math.log(median_s), sigma)


def episode_seconds(task: int, gen_s: float, median_s: float, sigma: float, seed: int) -> float:
    """The ideal duration of an episode of ``task``: its turns' generation and steps, with
    nothing between them."""
    steps = range(turns_of(task, seed))
    return sum(gen_s + step_latency(task, t, median_s, sigma, seed) for t in steps)


def busy_seconds(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of the window ``[t0, t1)`` that the disjoint ``intervals`` cover."""
    return sum(max(0.0, min(end, t1) - max(start, t0)) for start, end in intervals)


class TurnRollout(Role):
    """A rollout replica whose every turn takes ``gen_s``; it records when it is busy.

    Endpoints:

    - ``generate(GenerateBatch) -> list[Sample]``, idempotent: the requests run one after the
      other, each sleeping ``gen_s`` and coming back finished (see the module docstring).
    - ``idle([t0, t1]) -> dict``, idempotent: over a wall-clock window (``time.time()``), the
      seconds with at least one ``generate`` call in progress (``busy_s``), the calls started
      in it, and ``idle``, the fraction of the window with none.
    """

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        """The simulated policy's config.

        Attributes:
            gen_s: seconds one turn's generation takes.
            tokens: tokens one turn generates.
            version: the weights version every token is tagged with.
        """

        gen_s: float = 0.01
        tokens: int = 8
        version: int = 0

        def __post_init__(self) -> None:
            if not self.gen_s >= 0:
                raise ValueError(f"gen_s: expected >= 0, got {self.gen_s}")
            if self.tokens < 1:
                raise ValueError(f"tokens: expected an int >= 1, got {self.tokens}")

    def __init__(self, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.in_progress = 0
        self.busy_since = 0.0
        self.busy: list[tuple[float, float]] = []  # disjoint: each from 0 to 0 calls in progress
        self.starts: list[float] = []

    @endpoint(Delivery.IDEMPOTENT)
    async def generate(self, batch: GenerateBatch) -> list[Sample]:
        now = time.time()
        self.starts.append(now)
        if self.in_progress == 0:
            self.busy_since = now
        self.in_progress += 1
        try:
            return [await self._one(request) for request in batch.requests]
        finally:
            self.in_progress -= 1
            if self.in_progress == 0:
                self.busy.append((self.busy_since, time.time()))

    async def _one(self, request: GenerateRequest) -> Sample:
        cfg = self.config
        await asyncio.sleep(cfg.gen_s)
        rng = random.Random(f"{request.prompt.id}/{request.sample_index}")
        return Sample(
            prompt_id=request.prompt.id,
            sample_index=request.sample_index,
            prompt_ids=request.prompt.token_ids,
            token_ids=[rng.randint(ord("a"), ord("z")) for _ in range(cfg.tokens)],
            logprobs=[-rng.expovariate(2.0) for _ in range(cfg.tokens)],
            versions=[cfg.version] * cfg.tokens,
            finished=True,
            stop_reason="length",
        )

    @endpoint(Delivery.IDEMPOTENT)
    async def idle(self, window: list[float]) -> dict[str, float]:
        if len(window) != 2 or not window[1] > window[0]:
            raise ValueError(f"idle: expected a window [t0, t1] with t1 > t0, got {window}")
        t0, t1 = window
        spans = list(self.busy)
        if self.in_progress:
            spans.append((self.busy_since, time.time()))
        busy = busy_seconds(spans, t0, t1)
        return {
            "busy_s": busy,
            "calls": float(sum(t0 <= s < t1 for s in self.starts)),
            "idle": max(0.0, 1.0 - busy / (t1 - t0)),
        }


class SpreadEnv(Environment):
    """An environment whose steps take log-normal times (see the module docstring).

    The task is an int; the reset's observation is ``"task <i>:"``, a step's ``"seen <turn>"``;
    the last step is rewarded 1.0 and ends the episode.
    """

    deterministic = True

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        """The simulated environment's config.

        Attributes:
            median_s: the median seconds of one step.
            sigma: the log-space standard deviation of a step's seconds (0: all ``median_s``).
            seed: seeds the draws (with the task and the turn).
        """

        median_s: float = 0.02
        sigma: float = 1.0
        seed: int = 0

        def __post_init__(self) -> None:
            if not self.median_s > 0:
                raise ValueError(f"median_s: expected > 0, got {self.median_s}")
            if not self.sigma >= 0:
                raise ValueError(f"sigma: expected >= 0, got {self.sigma}")

    async def start(self, task: Any) -> tuple[str, Any]:
        if not isinstance(task, int):
            raise TypeError(f"SpreadEnv: the task is an episode's int index, got {task!r}")
        return f"task {task}:", {"task": task, "turns": turns_of(task, self.config.seed), "at": 0}

    async def act(self, state: Any, action: str) -> Transition:
        cfg = self.config
        turn = state["at"]
        await asyncio.sleep(step_latency(state["task"], turn, cfg.median_s, cfg.sigma, cfg.seed))
        state["at"] = turn + 1
        done = state["at"] >= state["turns"]
        return Transition(observation=f"seen {turn}", reward=1.0 if done else 0.0, done=done)
