"""Prompt scheduling that learns from what was scored: which prompts to generate, and how much.

With dynamic sampling a group whose rewards are all equal carries no GRPO signal and is thrown
away. Most prompts of a task are, for a given policy, either always solved or never solved, so
most generated groups are thrown away (79% of the samples of the README's main job before this
module). Three rules, after the published selective-rollout methods (GRESO's pre-rollout
filtering, and staged sampling of a group), cut that:

- **Deferral by history.** A prompt comes round once per epoch of the prompt source. Each item
  keeps the number of its last groups in a row that were uniform (its *streak*). An item with a
  streak ``z`` is generated again with probability ``explore ** z``, and never less than
  ``ADMIT_MIN``; otherwise it is skipped this epoch (settled at once, nothing generated). The
  policy moves, so no prompt is deferred for good: without the floor, long streaks made the odds
  vanish (``0.02 ** 3`` is 8e-6), the schedule skipped every prompt, and the main job's RL ended
  at step 165 of 300 for want of prompts.
  ``explore`` adapts after every batch so that about ``target_uniform`` of the groups generated
  are uniform: up when fewer are (the filter is too strict), down when more are.
- **Retirement.** With ``retire_after: n``, an item whose last ``n`` groups were all solved
  (uniform at the best reward seen so far, a lower one having been seen too) is never generated
  again: it has nothing left to teach the policy that trains on it. Unsolved items are only
  deferred, never retired.
- **Probing.** Every group first gets ``probe`` of its ``group_size`` samples. If they disagree,
  the rest are generated and the group trains as usual. If they agree the group is dropped after
  ``probe`` samples rather than ``group_size``, and counted as uniform.

The bias this adds to which prompts train: with rewards that are 0 or 1 and a pass rate ``p``, a
full group trains when it is not uniform, with probability ``1 - p^G - (1-p)^G`` (``G`` the group
size); a probed one only when its first ``m`` samples disagree, ``1 - p^m - (1-p)^m``, which is
smaller. For ``G = 8`` and ``m = 4``: at ``p = 0.5`` 0.88 against 0.99, at ``p = 0.9`` (or 0.1)
0.34 against 0.57, at ``p = 0.97`` 0.11 against 0.22. So probing halves at most the chance that
a nearly-always (or nearly-never) solved prompt trains this epoch, and leaves prompts near 50%
almost untouched; deferral then lowers how often a prompt that was uniform comes back, by
``explore`` per uniform group in a row. docs/algorithms.md shows the measured effect on the main
job.

Every decision is a pure function of the seed, the item and the prompt's index in the stream,
and the schedule's state (streaks and ``explore``) is part of the pipeline's resume state, kept
with the learner's step: a resumed run decides exactly as the run it resumes.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

from asyncrl.draws import unit
from asyncrl.manifest.pipeline_section import ScheduleSpec
from asyncrl.roles.learning.groups import uniform

__all__ = ["ADMIT_MIN", "SKIP_BOUND_MIN", "PromptSchedule", "item_key", "item_of"]

EXPLORE_MIN = 0.02
"""``explore`` never falls below this: every prompt keeps a chance to come back."""

ADMIT_MIN = 1 / 64
"""The least chance a deferred (not retired) item has of being generated when it comes round:
the schedule then skips about 64 prompts for each it admits when it defers every one, and 4,096
in a row (``skip_bound``, where the pipeline ends as if the prompts ran out) has odds of about
``exp(-64)``."""

SKIP_BOUND_MIN = 4096
"""``skip_bound`` is never lower: the prompts skipped in a row that end the prompts."""

ADAPT = 1.25
"""Factor by which ``explore`` moves after a batch that missed ``target_uniform``."""


def item_of(prompt_id: str) -> str:
    """The item a prompt id names, without its epoch: ``"17@3"`` -> ``"17"``."""
    item, sep, epoch = prompt_id.rpartition("@")
    return item if sep and epoch.isdigit() else prompt_id


def item_key(seed: int, item: str) -> int:
    """64 bits fixed by (seed, item): the key of an item's draws (``asyncrl.draws.unit`` of
    it and a prompt's index, the same on every run and resume). A late run skips thousands of
    prompts a step, each drawn so: a hash of the key costs a third of hashing the item's name."""
    digest = hashlib.blake2b(f"{seed}/{item}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class PromptSchedule:
    """Decides which prompts are generated and how many samples go first (see the module).

    Args:
        spec: the manifest's ``pipeline.schedule`` section.
        group_size: the samples of a full group.
        seed: what the decisions are drawn from.
        state: ``state()`` of the schedule a resumed run continues.
    """

    def __init__(
        self,
        spec: ScheduleSpec,
        group_size: int,
        *,
        seed: int = 0,
        state: dict[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        self.group_size = group_size
        self.seed = seed
        state = state or {}
        # Every item scored at least once -> its uniform groups in a row (0: the last was not).
        self.streaks: dict[str, int] = {str(k): int(v) for k, v in state.get("streaks", {}).items()}
        # Items whose last groups were solved (uniform at the best reward) -> how many in a row.
        self.solved: dict[str, int] = {str(k): int(v) for k, v in state.get("solved", {}).items()}
        self.best = float(state.get("best", float("-inf")))  # the best reward seen
        self.worst = float(state.get("worst", float("inf")))  # ... and the worst
        self.explore = float(state.get("explore", spec.explore))
        self._keys: dict[str, int] = {}  # item -> item_key(seed, item), once drawn for
        self._uniform = 0  # groups generated since the last batch that were uniform
        self._generated = 0  # ... and all of them

    @property
    def enabled(self) -> bool:
        return self.spec.skip_uniform or self.probe_size > 0 or self.spec.retire_after > 0

    @property
    def probe_size(self) -> int:
        """Samples generated first for a prompt to probe, or 0 for none."""
        probe = self.spec.probe
        return probe if 0 < probe < self.group_size else 0

    def admit(self, prompt_id: str, index: int) -> bool:
        """Generate this prompt now (True), or skip it this epoch (False)."""
        item = item_of(prompt_id)
        if self._retired(item):
            return False
        if not self.spec.skip_uniform:
            return True
        streak = self.streaks.get(item, 0)
        if streak == 0:
            return True
        key = self._keys.get(item)
        if key is None:
            key = self._keys[item] = item_key(self.seed, item)
        return unit(key, index) < max(self.explore**streak, ADMIT_MIN)

    def retired(self, prompt_id: str) -> bool:
        """The prompt's item is retired (``admit`` is always False for it)."""
        return self._retired(item_of(prompt_id))

    def _retired(self, item: str) -> bool:
        retire_after = self.spec.retire_after
        return bool(retire_after) and self.solved.get(item, 0) >= retire_after

    def skip_bound(self) -> int:
        """Prompts skipped in a row after which every prompt counts as retired or deferred for
        good: twice the items known, and never fewer than 4,096."""
        return max(SKIP_BOUND_MIN, 2 * len(self.streaks))

    def first(self, prompt_id: str) -> int:
        """How many of the group's samples to generate first: ``probe`` when probing, else the
        whole group."""
        return self.probe_size or self.group_size

    def repeats(self, logprobs: Sequence[Sequence[float]]) -> bool:
        """Whether a probe whose rewards agree says its group would be uniform: always without
        ``confidence``; with it, when every probe sample was drawn with at least that
        probability (its log-probs sum to at least ``log(confidence)``; a sample without
        log-probs counts as unsure)."""
        if not self.spec.confidence:
            return True
        floor = math.log(self.spec.confidence)
        return all(lp and math.fsum(lp) >= floor for lp in logprobs)  # none: unsure

    def record(self, prompt_id: str, rewards: Sequence[float]) -> bool:
        """Learn from one group's rewards (a probe's or a whole group's); True if uniform."""
        item = item_of(prompt_id)
        flat = uniform(list(rewards))
        self.streaks[item] = self.streaks.get(item, 0) + 1 if flat else 0
        if max(rewards) > self.best:
            self.solved.clear()  # "solved" meant less until now: count again
        self.best = max(self.best, *rewards)
        self.worst = min(self.worst, *rewards)
        if flat and rewards[0] >= self.best > self.worst:  # the best, and not the only value seen
            self.solved[item] = self.solved.get(item, 0) + 1
        else:
            self.solved.pop(item, None)
        self._generated += 1
        self._uniform += int(flat)
        return flat

    def end_batch(self) -> None:
        """Move ``explore`` towards ``target_uniform`` from the groups since the last batch."""
        if self._generated and self.spec.skip_uniform:
            share = self._uniform / self._generated
            if share > self.spec.target_uniform:
                self.explore = max(EXPLORE_MIN, self.explore / ADAPT)
            elif share < self.spec.target_uniform:
                self.explore = min(1.0, self.explore * ADAPT)
        self._uniform = self._generated = 0

    def state(self) -> dict[str, Any]:
        """What a resumed schedule needs: the streaks (of every item scored) and ``explore``."""
        if not self.enabled:
            return {}
        return {
            "streaks": dict(self.streaks),
            "solved": dict(self.solved),
            "best": self.best,
            "worst": self.worst,
            "explore": self.explore,
        }
