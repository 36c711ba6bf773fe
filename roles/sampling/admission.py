"""Admission: which prompt the sample pipeline starts next, how much of its group goes first, and
which prompt indices are settled.

The pipeline admits a prompt as a group whenever its ``Pacer`` has room; ``Admission`` decides
which prompt that is:

- **Feed paging.** It asks the prompt feed for a batch's worth of prompts to admit at a time:
  a batch's worth while the prompt schedule admits them all, more (up to ``FETCH_MAX``) as it
  skips more of them (the share it skipped of the last pages), so that a schedule admitting
  one prompt in forty costs a call a batch, not one an admitted prompt.
- **Resume skips.** It passes over the indices a resume state lists as settled before the run
  resumed, so nothing consumed or wasted then is generated again.
- **Schedule.** It asks the ``PromptSchedule`` whether to admit each prompt: a deferred or
  retired prompt is skipped (``skipped_prompts``, ``retired_skips``), and a schedule that
  skips more than its bound in a row ends the prompts as if the feed ran out.
- **Probes.** A prompt the schedule probes starts with only its probe's samples
  (``Group.probe``); once they are scored, ``end_probe`` says whether their rewards agree, and
  the pipeline drops the group or generates the rest of it.

It keeps the groups admitted and not yet settled (consumed or wasted), in admission order: the
first of them is the cursor, and every index past it not among them is settled. Those, with
the schedule's state, are the admission's part of the pipeline's resume state.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

from asyncrl.manifest.pipeline_section import ScheduleSpec
from asyncrl.roles.learning.groups import uniform
from asyncrl.roles.payloads import Prompt
from asyncrl.roles.sampling.contract import PromptFeed
from asyncrl.roles.sampling.counters import Counters
from asyncrl.roles.sampling.group import Group
from asyncrl.roles.sampling.schedule import SKIP_BOUND_MIN, PromptSchedule

__all__ = ["FETCH_MAX", "Admission"]

log = logging.getLogger("asyncrl.pipeline")

FETCH_MAX = 1024
"""The most prompts asked of the feed at once (while the schedule skips most of them)."""


class Admission:
    """The prompts the pipeline admits, in feed order, and what is settled among them.

    Args:
        feed: the prompts, by index.
        schedule: the manifest's ``pipeline.schedule`` section.
        group_size: samples per group; chunk: prompts asked of the feed at once (more while the
            schedule skips).
        counters: the pipeline's counters, which admission adds to.
        cursor, settled: where a resumed run starts (``ResumeState``): the first index to
            admit, and the indices past it settled already.
        schedule_state: the resumed schedule's state (``PromptSchedule.state``), or None.
    """

    def __init__(
        self,
        feed: PromptFeed,
        schedule: ScheduleSpec,
        *,
        group_size: int,
        chunk: int,
        counters: Counters,
        cursor: int = 0,
        settled: list[int] | None = None,
        schedule_state: dict[str, Any] | None = None,
    ) -> None:
        self.feed = feed
        self.group_size = group_size
        self.chunk = max(1, chunk)
        self.counters = counters
        self.schedule = PromptSchedule(schedule, group_size, state=schedule_state)
        self.unsettled: dict[int, Group] = {}  # index -> group: admitted, not settled; in order
        self.next_index = cursor  # the next prompt to admit
        self.fetching = False  # a call to the feed is out
        self.exhausted = False  # the prompts ran out
        self._fetched = cursor  # the next prompt to ask the feed for
        self._skip = set(settled or ())  # settled before a resume, not reached yet
        self._prompts: deque[Prompt] = deque()  # fetched, not yet admitted or skipped
        self._skipped_run = 0  # prompts the schedule skipped since it last admitted one
        self._page = 0  # prompts in the last page the feed gave
        self._page_skipped = 0  # ... that the schedule skipped
        self._skip_share = 0.0  # a running estimate of the share of a page the schedule skips

    async def next_prompt(self) -> Prompt | None:
        """The next prompt to admit; None once the prompts ran out (``exhausted``)."""
        while True:
            if not self._prompts:
                n = self._next_page_size()
                self.fetching = True
                try:
                    fetched = await self.feed(self._fetched, n)
                finally:
                    self.fetching = False
                self._fetched += len(fetched)
                self._prompts.extend(fetched)
                self._page, self._page_skipped = len(fetched), 0
            if not self._prompts:
                self.exhausted = True
                return None
            prompt = self._prompts.popleft()
            if self.next_index in self._skip:  # consumed before the run resumed
                self._skip.discard(self.next_index)
                self.next_index += 1
                continue
            if not self.schedule.admit(prompt.id, self.next_index):  # deferred: settled now
                if self.schedule.retired(prompt.id):
                    self.counters.retired_skips += 1
                else:
                    self.counters.skipped_prompts += 1
                self._skipped_run += 1
                self._page_skipped += 1
                if self._skipped_too_many():
                    self.exhausted = True
                    return None
                self.next_index += 1
                continue
            self._skipped_run = 0
            return prompt

    def start(self, prompt: Prompt) -> Group:
        """Admit ``prompt`` (the one ``next_prompt`` gave) as a group at the next index; its
        ``probe`` is the samples to generate first when the schedule probes it (0: all)."""
        index = self.next_index
        self.next_index += 1
        group = Group(prompt.id, index, prompt)
        group.counts.admitted_groups = 1
        group.counts.admitted_samples = self.group_size
        self.counters.admitted_groups += 1
        self.counters.admitted_samples += self.group_size
        first = self.schedule.first(prompt.id)
        if first < self.group_size:
            group.probe = first
            group.counts.probed_groups = 1
            self.counters.probed_groups += 1
        self.unsettled[index] = group
        return group

    def probe_scored(self, group: Group) -> bool:
        """Every sample of ``group``'s probe is scored, and the group is not released."""
        return bool(group.probe) and not group.outcome and len(group.samples) == group.probe

    def end_probe(self, group: Group) -> tuple[bool, int]:
        """End ``group``'s probe: whether its rewards agree (and the schedule trusts them to
        say the group would be uniform), and how many samples it had."""
        first, group.probe = group.probe, 0
        rewards = [r for _, r in group.samples.values()]
        agree = uniform(rewards) and self.schedule.repeats(
            [s.logprobs for s, _ in group.samples.values()]
        )
        return agree, first

    def probing(self) -> list[str]:
        """The keys of the groups whose probe is out."""
        return [g.key for g in self.unsettled.values() if g.probe]

    def settle(self, group: Group) -> None:
        """``group`` was consumed or wasted. The schedule learns from it now, as the resume
        state counts it: a released group still unconsumed is admitted again on resume."""
        if self.schedule.enabled and group.samples:
            self.schedule.record(group.prompt.id, [r for _, r in group.samples.values()])
        self.unsettled.pop(group.index, None)

    @property
    def cursor(self) -> int:
        """The first prompt index not yet consumed or wasted."""
        return next(iter(self.unsettled), self.next_index)

    def settled(self) -> list[int]:
        """The indices past the cursor already settled: every index admitted (or skipped as
        settled before a resume) and not unsettled, and those a resume said to skip, not
        reached yet."""
        return [
            *(i for i in range(self.cursor, self.next_index) if i not in self.unsettled),
            *sorted(self._skip),
        ]

    def _next_page_size(self) -> int:
        """Prompts to ask the feed for next, once the page just judged has been weighed into
        the share the schedule skips: enough for a batch's worth (``chunk``) to be admitted at
        that share, and at least as many as it skipped in a row; up to ``FETCH_MAX``."""
        if self._page:  # the page just judged, weighed as much as all those before it
            self._skip_share = (self._skip_share + self._page_skipped / self._page) / 2
        admitted = max(1.0 - self._skip_share, self.chunk / FETCH_MAX)
        return min(FETCH_MAX, max(self.chunk, self._skipped_run, math.ceil(self.chunk / admitted)))

    def _skipped_too_many(self) -> bool:
        """Whether the schedule skipped more than its bound of prompts in a row (then every
        prompt counts as retired or deferred, and the prompts end as if they ran out); says so
        when it did."""
        if self._skipped_run <= SKIP_BOUND_MIN or self._skipped_run <= self.schedule.skip_bound():
            return False
        log.warning(
            "sample pipeline: the prompt schedule skipped %d prompts in a row: every prompt is "
            "retired or deferred; ending as if the prompts ran out",
            self._skipped_run,
        )
        return True
