"""The sample pipeline's counters: one typed field for each thing it counts, read by name.

Every batch's metrics, a run's ``summary.json`` (``pipeline``) and the pipeline's resume state
(``Batch.resume["pipeline"]``) show the counters as one flat mapping of name to count, in which a
counter still at 0 does not appear. ``Counters`` is that mapping's typed form: the pipeline
changes its fields, and ``as_dict`` / ``from_dict`` give and read the names, so no part of the
pipeline spells a counter's name as a string.

Two families of names are open-ended, and kept beside the fields:

- ``infra_failed_<cause>``: the samples that failed through no fault of the policy, by cause
  (``Sample.infra_failed``: ``timeout``, ``error``, ``lost``), in ``infra_causes``;
- what the sample source counts under names of its own (``resumed``; an episode runner's
  ``episodes``, ``episode_turns``, ...), in ``source``: the ``Counter`` a ``SampleSource`` is
  handed.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from asyncrl.roles.sampling.reduce import Outcome

__all__ = ["INFRA_FAILED_PREFIX", "Counters"]

INFRA_FAILED_PREFIX = "infra_failed_"
"""Names ``infra_failed_<cause>``: the samples that failed for that cause."""


@dataclass(slots=True)
class Counters:
    """What the sample pipeline counted, since the run began (a resumed pipeline counts on).

    Every sample admitted ends consumed or wasted: ``admitted_samples`` is ``consumed_samples
    + wasted_samples`` plus the samples still in flight.

    Across a resume every group is counted once. A resume state leaves out all that was counted
    for the groups unsettled then (``Group.counts``: their admission and probe, their generated
    and scored samples, their release and what it wasted, their late samples), whether still
    generating or released and not yet consumed, since the resumed run admits, generates and
    releases them again. So a resume state's ``admitted_samples`` is exactly ``consumed_samples +
    wasted_samples``, and ``groups_complete + groups_partial + groups_dropped`` never exceeds
    ``admitted_groups``. What counts events rather than groups (``batches_uniform_capped``,
    ``groups_regranted``, ``skipped_prompts``) is kept whole.

    Attributes:
        admitted_groups, admitted_samples: prompts admitted, and their samples (a dropped
            probe's rest, never started, is taken back out; a replacement adds one).
        generated_samples: samples the source returned.
        scored_samples: samples scored (by the program's scorer in one driver, by the dispatch
            shards otherwise), late ones and those of groups dropped meanwhile included.
        consumed_samples, batches: samples handed to the learner, and the batches they made.
        wasted_samples, wasted_tokens: samples admitted and not consumed (dropped groups,
            missing samples of partial ones, replaced failures), and the tokens they had.
        late_samples: samples that arrived after their group was released.
        groups_complete, groups_partial, groups_dropped: groups as the reducer released them
            (``Outcome``): whole, at their deadline with some samples, or dropped there.
        groups_infra_dropped: groups dropped for a sample that failed through no fault of the
            policy (``pipeline.infra_failed``).
        groups_over_eta_dropped, groups_over_eta_corrected: groups with a sample over η when
            consumed, dropped or kept for the learner's correction (``pipeline.over_eta``).
        groups_uniform_dropped, samples_uniform_dropped: groups whose rewards were all equal,
            dropped by dynamic sampling (after their probe included), and their samples.
        groups_uniform_kept: such groups kept, once the batches in flight had no drops left
            (``max_uniform_drops`` a batch).
        batches_uniform_capped: batches assembled while the drops had run out.
        probed_groups, groups_probe_dropped: groups the prompt schedule probed first, and
            those dropped after their probe agreed.
        skipped_prompts, retired_skips: prompts the schedule deferred, and those it skipped as
            retired.
        infra_failed, infra_replaced: samples that failed through no fault of the policy, and
            those replaced by a fresh sample of the same prompt.
        infra_causes: ``infra_failed`` by cause.
        groups_regranted: groups granted again because the dispatch shard that held them died
            (``asyncrl.roles.sampling.sharded``).
        scored_tokens: completion tokens of the samples dispatch shards scored (in one
            driver the program's scorer sees them itself).
        source: what the sample source counted, by its own names.
    """

    admitted_groups: int = 0
    admitted_samples: int = 0
    generated_samples: int = 0
    scored_samples: int = 0
    consumed_samples: int = 0
    batches: int = 0
    wasted_samples: int = 0
    wasted_tokens: int = 0
    late_samples: int = 0
    groups_complete: int = 0
    groups_partial: int = 0
    groups_dropped: int = 0
    groups_infra_dropped: int = 0
    groups_over_eta_dropped: int = 0
    groups_over_eta_corrected: int = 0
    groups_uniform_dropped: int = 0
    samples_uniform_dropped: int = 0
    groups_uniform_kept: int = 0
    batches_uniform_capped: int = 0
    probed_groups: int = 0
    groups_probe_dropped: int = 0
    skipped_prompts: int = 0
    retired_skips: int = 0
    infra_failed: int = 0
    infra_replaced: int = 0
    groups_regranted: int = 0
    scored_tokens: int = 0
    infra_causes: Counter[str] = field(default_factory=Counter)
    source: Counter[str] = field(default_factory=Counter)

    def released(self, outcome: Outcome) -> None:
        """Count one group the reducer released with ``outcome``."""
        if outcome is Outcome.COMPLETE:
            self.groups_complete += 1
        elif outcome is Outcome.PARTIAL:
            self.groups_partial += 1
        else:
            self.groups_dropped += 1

    def add(self, other: Counters) -> None:
        """Add ``other``'s counts to these."""
        for name in _FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.infra_causes.update(other.infra_causes)
        self.source.update(other.source)

    def subtract(self, other: Counters) -> None:
        """Take ``other``'s counts out of these (a group still in flight, out of a resume
        state)."""
        for name in _FIELDS:
            setattr(self, name, getattr(self, name) - getattr(other, name))
        self.infra_causes.subtract(other.infra_causes)
        self.source.subtract(other.source)

    def copy(self) -> Counters:
        """An independent copy."""
        return dataclasses.replace(
            self, infra_causes=Counter(self.infra_causes), source=Counter(self.source)
        )

    def as_dict(self) -> dict[str, int]:
        """The counters by name, those at 0 left out: the fields, ``infra_failed_<cause>``,
        then the source's names (a source's name that is also a field's adds to it)."""
        out = {name: value for name, value in self._named() if value}
        for name, value in self.source.items():
            if value:
                out[name] = out.get(name, 0) + value
        return {name: value for name, value in out.items() if value}

    @classmethod
    def from_dict(cls, counts: Mapping[str, int]) -> Counters:
        """Counters from ``as_dict``'s names (a resume state's ``pipeline``): a field's name
        sets it, ``infra_failed_<cause>`` a cause, and any other name is the source's.

        Raises:
            ValueError: a count that is not an integer, naming it.
        """
        counters = cls()
        for name, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
                raise ValueError(
                    f"pipeline counter {name!r}: expected an integer count, got {value!r}"
                )
            if name in _FIELD_SET:
                setattr(counters, name, int(value))
            elif name.startswith(INFRA_FAILED_PREFIX):
                counters.infra_causes[name.removeprefix(INFRA_FAILED_PREFIX)] = int(value)
            else:
                counters.source[name] = int(value)
        return counters

    def _named(self) -> Iterator[tuple[str, int]]:
        for name in _FIELDS:
            yield name, getattr(self, name)
        for cause, value in self.infra_causes.items():
            yield f"{INFRA_FAILED_PREFIX}{cause}", value


_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(Counters) if f.name not in ("infra_causes", "source")
)
"""The counters that are fields of ``Counters``, in order."""

_FIELD_SET = frozenset(_FIELDS)
