"""What the sample pipeline (``asyncrl.roles.sampling.pipeline``) takes and gives: the rollout
group it calls, the prompt feed, the source of each sample (and the default one, ``Generate``)
and the scorer, its ``BatchSettings``, the ``Batch`` it hands the learner and the
``ResumeState`` a batch carries."""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from asyncrl.roles.learning.groups import STD_KINDS, StdKind
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
    "BatchSettings",
    "Caller",
    "Generate",
    "PromptFeed",
    "PromptsExhausted",
    "ResumeState",
    "SampleSource",
    "Scorer",
]


class PromptsExhausted(EOFError):
    """The prompts ran out (the feed ended, or the prompt schedule retired every prompt) and
    nothing is left to hand out: raised by ``SamplePipeline.next_batch``, and only there."""


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
        resume: what a pipeline resumed after this batch's learner step needs, a
            ``ResumeState`` as a plain mapping (keep it with the step: ``TrainBatch.keep``;
            pass it back as ``SamplePipeline(resume=...)``).
    """

    samples: list[Scored]
    version: int
    staleness: list[int]
    cursor: int
    metrics: dict[str, float]
    resume: dict[str, Any] = {}


@dataclass(frozen=True, kw_only=True)
class BatchSettings:
    """What a batch of the sample pipeline is and how its groups are judged: the program's side
    of the pipeline's settings (the manifest's ``pipeline`` section, ``PipelineSpec``, is the
    run's side).

    Attributes:
        batch_size: samples per batch, in whole groups.
        group_size: samples per prompt: GRPO's group.
        normalize_std, std: the learner's GRPO conventions (``group_advantages``; a learner's
            ``status().advantages`` holds both), so that the advantages the pipeline attaches
            are those the learner computes.
        drop_uniform: drop groups whose rewards are all equal (dynamic sampling); None: the
            spec's ``drop_uniform``.
        max_uniform_drops: the most such groups dropped per batch (the batches in flight
            share theirs: ``asyncrl.roles.sampling.release``); past it they are kept, with
            zero advantages, and counted. None: the spec's ``uniform_drops_per_group`` per
            group of the batch.

    Raises:
        ValueError: a batch smaller than one group, an unknown ``std``, or a negative
            ``max_uniform_drops``.
    """

    batch_size: int
    group_size: int
    normalize_std: bool = True
    std: StdKind = "population"
    drop_uniform: bool | None = None
    max_uniform_drops: int | None = None

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.batch_size < self.group_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must hold at least one group of group_size "
                f"({self.group_size}) samples"
            )
        if self.std not in STD_KINDS:
            raise ValueError(f"std: expected 'population' or 'unbiased', got {self.std!r}")
        if self.max_uniform_drops is not None and self.max_uniform_drops < 0:
            raise ValueError(
                f"max_uniform_drops: expected an int >= 0, got {self.max_uniform_drops}"
            )

    @property
    def groups(self) -> int:
        """Whole groups per batch."""
        return self.batch_size // self.group_size


class ResumeState(msgspec.Struct, kw_only=True):
    """Where a resumed pipeline starts: ``Batch.resume``, typed.

    Attributes:
        cursor: the first prompt index not yet settled (consumed or wasted).
        settled: the indices past the cursor already settled (never admitted again).
        pipeline: the counters by name (``Counters.as_dict``), without the groups still in
            flight.
        schedule: the prompt schedule's state (``PromptSchedule.state``), when it runs.
    """

    cursor: int = 0
    settled: list[int] = []
    pipeline: dict[str, int] = {}
    schedule: dict[str, Any] | None = None

    @classmethod
    def of(cls, state: Mapping[str, Any] | None) -> ResumeState:
        """The resume state in ``state`` (a ``Batch.resume``, as kept with a learner step);
        None or empty: a run from its start.

        Raises:
            ValueError: ``state`` is not such a mapping, naming the field that is wrong.
        """
        if state is None:
            return cls()
        if not isinstance(state, Mapping):
            raise ValueError(
                f"resume: expected a sample pipeline's resume state (a mapping: the 'resume' a "
                f"Batch carried), got {type(state).__name__}"
            )
        try:
            return msgspec.convert(dict(state), cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(
                f"resume: not a sample pipeline's resume state ({exc}); pass the 'resume' a "
                f"Batch carried, as kept with the learner's step"
            ) from exc

    def as_dict(self) -> dict[str, Any]:
        """The plain mapping a ``Batch`` carries: ``cursor``, ``settled``, ``pipeline`` and,
        when the schedule runs, ``schedule``."""
        return {
            "cursor": self.cursor,
            "settled": list(self.settled),
            "pipeline": dict(self.pipeline),
            **({"schedule": self.schedule} if self.schedule is not None else {}),
        }
