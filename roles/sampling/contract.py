"""What the sample pipeline (``asyncrl.roles.sampling.pipeline``) takes and gives: the rollout
group it calls, the prompt feed, the source of each sample and the scorer, the ``Batch`` it
hands the learner, and the checks of its arguments."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import msgspec

from asyncrl.roles.payloads import (
    GenerateBatch,
    GenerateRequest,
    Prompt,
    Sample,
    SamplingParams,
    Scored,
)

__all__ = [
    "Batch",
    "Caller",
    "Generate",
    "PromptFeed",
    "PromptsExhausted",
    "RewardTally",
    "SampleSource",
    "Scorer",
    "check_args",
    "max_drops",
    "skipped_too_many",
    "warn_capped",
]


class PromptsExhausted(EOFError):
    """The prompts ran out (the feed ended, or the prompt schedule retired every prompt) and
    nothing is left to hand out: raised by ``SamplePipeline.next_batch``, and only there."""


CAPPED_WARN_EVERY = 50
"""The warning that a batch reached ``max_uniform_drops`` with a constant reward is given for
the first such batch and then once every this many."""

PromptFeed = Callable[[int, int], Awaitable[list[Prompt]]]
"""``feed(cursor, n)``: the n prompts from index ``cursor`` on (fewer at the end of the data)."""

Scorer = Callable[[list[Sample]], Awaitable[list[float]]]
"""``score(samples)``: one reward per sample, in order."""


class Caller(Protocol):
    """What the pipeline needs of the rollout group's handle
    (``asyncrl.dispatch.handles.Handle``)."""

    async def call(
        self,
        method: str,
        payload: Any = None,
        reply_type: Any = Any,
        *,
        timeout: float = ...,
        key: Any = None,
        affinity: Any = None,
    ) -> Any: ...


class SampleSource(Protocol):
    """How the pipeline produces sample ``index`` of ``prompt`` (its stable id ``(prompt.id,
    index)``): ``Generate`` (one completion from the rollout group), or an episode runner's
    (``asyncrl.roles.agents.episodes.EpisodeRunner.source``: a multi-turn episode as one
    sample with its loss mask). It may count what happened in ``metrics``, the pipeline's
    counters (they reach every batch's metrics and its resume state)."""

    async def __call__(self, prompt: Prompt, index: int, metrics: Counter[str]) -> Sample: ...


class Generate:
    """The default ``SampleSource``: one ``generate`` call per sample on whichever replica has
    room; an unfinished sample (out of its chunk budget, or interrupted by a weight update) is
    resumed on any replica, keeping its tokens and their versions (counted in ``resumed``).

    Args:
        rollout: the rollout group's handle; params: how to sample; timeout: per call.
        affinity: ask the dispatcher to keep a group's samples on one replica.
    """

    def __init__(
        self, rollout: Caller, params: SamplingParams, *, timeout: float, affinity: bool = False
    ) -> None:
        self.rollout, self.params, self.timeout, self.affinity = rollout, params, timeout, affinity

    async def __call__(
        self, prompt: Prompt, index: int, metrics: Counter[str], partial: Sample | None = None
    ) -> Sample:
        """Sample ``index`` of ``prompt``, or the rest of ``partial``, an unfinished one."""
        request = GenerateRequest(
            prompt=prompt, sample_index=index, params=self.params, partial=partial
        )
        while True:
            sample: Sample
            (sample,) = await self.rollout.call(
                "generate",
                GenerateBatch([request]),
                list[Sample],
                timeout=self.timeout,
                key=(prompt.id, index),
                affinity=prompt.id if self.affinity else None,
            )
            if sample.finished:
                return sample
            metrics["resumed"] += 1
            request = GenerateRequest(
                prompt=prompt, sample_index=index, params=self.params, partial=sample
            )


class Batch(msgspec.Struct):
    """Whole groups for one learner step.

    Attributes:
        samples: scored samples, each with its group's advantage.
        version: the learner version that consumes them (the one staleness is measured against).
        staleness: per sample, in order.
        cursor: the first prompt index not yet consumed or wasted (where a resumed run starts).
        metrics: the pipeline's counters so far, this batch's staleness p50/p99/max, and
            ``reward_scored_mean``: the mean reward of every group scored since the last
            batch, the uniform groups dynamic sampling dropped included.
        resume: what a pipeline resumed after this batch's learner step needs (keep it with
            the step: ``TrainBatch.keep``; pass it back as ``SamplePipeline(resume=...)``).
    """

    samples: list[Scored]
    version: int
    staleness: list[int]
    cursor: int
    metrics: dict[str, float]
    resume: dict[str, Any] = {}


class RewardTally:
    """The rewards scored since the last batch: their sum, count, least and most."""

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0
        self.low, self.high = math.inf, -math.inf

    def add(self, rewards: Sequence[float]) -> None:
        if rewards:
            self.total += sum(rewards)
            self.count += len(rewards)
            self.low, self.high = min(self.low, *rewards), max(self.high, *rewards)

    def constant(self) -> float | None:
        """The one value every reward had; None when they differ or there is none."""
        return self.low if self.count and self.low == self.high else None


def warn_capped(log: Any, drops: int, batches: int, constant: float | None) -> None:
    """A batch reached ``max_uniform_drops`` (``drops``): the ``batches``-th of the run to.

    With dynamic sampling that is routine (late in a run most groups of a good policy are
    uniform), so it is counted (``batches_uniform_capped``) and logged at debug. Only when
    every reward scored since the previous batch was the same value (``constant``) does it
    point at the reward or the data, and then a warning says so, for the first such batch
    and every ``CAPPED_WARN_EVERY``-th after it (``batches`` counts those)."""
    if constant is None:
        log.debug(
            "sample pipeline: %d groups with uniform rewards dropped while filling one batch "
            "(max_uniform_drops); keeping such groups, with zero advantages, until the next "
            "batch",
            drops,
        )
        return
    if (batches - 1) % CAPPED_WARN_EVERY == 0:
        log.warning(
            "sample pipeline: %d groups with uniform rewards dropped while filling one batch "
            "(max_uniform_drops), and every reward scored since the previous batch was %g; "
            "keeping such groups, with zero advantages, until the next batch (%d batches so "
            "far; said again every %d). Is the reward constant, or the data far too hard or "
            "too easy? (A policy at a perfect score gets here too.)",
            drops,
            constant,
            batches,
            CAPPED_WARN_EVERY,
        )


def skipped_too_many(log: Any, skipped: int, bound: int) -> bool:
    """Whether the prompt schedule skipped more than ``bound`` prompts in a row (then every
    prompt counts as retired or deferred, and the pipeline ends as if the prompts ran out);
    says so when it did."""
    if skipped <= bound:
        return False
    log.warning(
        "sample pipeline: the prompt schedule skipped %d prompts in a row: every prompt is "
        "retired or deferred; ending as if the prompts ran out",
        skipped,
    )
    return True


def max_drops(batch_size: int, group_size: int, given: int | None, per_group: int) -> int:
    """``max_uniform_drops``: as given, or ``per_group`` per group of a batch."""
    if given is not None:
        return given
    return per_group * (batch_size // max(1, group_size))


def check_args(
    batch_size: int, group_size: int, std: str, drop_uniform: bool, max_uniform_drops: int
) -> None:
    if group_size < 1 or batch_size < group_size:
        raise ValueError(
            f"batch_size ({batch_size}) must hold at least one group of group_size "
            f"({group_size}) samples"
        )
    if drop_uniform and group_size < 2:
        raise ValueError(
            "drop_uniform needs group_size >= 2: a group of one sample is always uniform, so "
            "every group would be dropped; raise group_size or set drop_uniform false"
        )
    if std not in ("population", "unbiased"):
        raise ValueError(f"std: expected 'population' or 'unbiased', got {std!r}")
    if max_uniform_drops < 0:
        raise ValueError(f"max_uniform_drops: expected an int >= 0, got {max_uniform_drops}")
