"""One admitted prompt's group, as the sample pipeline tracks it from admission to settling."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from asyncrl.roles.payloads import Prompt, Sample
from asyncrl.roles.sampling.counters import Counters

__all__ = ["Group"]


@dataclass(eq=False)
class Group:
    """One admitted prompt's group: admitted (``Admission``), generated and scored (the
    pipeline), released and taken into a batch or dropped (``Release``).

    Attributes:
        key: the prompt's id (the reducer's round); index: its place in the prompt feed.
        prompt: the prompt.
        samples: sample index -> (sample, reward), as they are scored.
        tasks: one generating task per sample.
        advantages: sample index -> advantage, set on release.
        outcome: how the reducer released it ("" while it is not).
        probe: while its probe is out, the samples of the probe (the prompt schedule's
            ``first``); 0 otherwise.
        counts: what it added to the pipeline's counters while unsettled (its admission and
            probe, its generated and scored samples, what the sample source counted for them, its
            replaced failures, its release, the missing samples a partial release wasted, its
            late samples): taken back out of a resume state while the group is unsettled,
            released or not, since a resumed run admits, generates and releases it again.
        replaced: the sample indices whose infra-failed sample was replaced by a fresh one
            (once each: ``pipeline.infra_failed: replace``).
        keep_uniform: its probe agreed once the batch could drop no more uniform groups, so
            the rest of it was generated to be kept: it is not dropped if it ends uniform.
    """

    key: str
    index: int
    prompt: Prompt
    samples: dict[int, tuple[Sample, float]] = field(default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    advantages: dict[int, float] = field(default_factory=dict)
    outcome: str = ""
    probe: int = 0
    counts: Counters = field(default_factory=Counters)
    keep_uniform: bool = False
    replaced: set[int] = field(default_factory=set)
