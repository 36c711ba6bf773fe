"""Quarantine of environment replicas that keep failing: the episode runner's record of each
replica's recent steps, and its choice of the replica a new episode starts on.

A replica that failed more than ``share`` of its last ``window`` steps (a step past its
deadline that is not part of the task, an error, a step a live replica did not answer at all;
a reset it failed counts as a failed step) is quarantined: no new episode starts on it, the
healthy replicas carry the run, and ``record`` returns why, so that its caller has the replica
restarted by its supervisor (``EnvironmentClient``). After a backoff one new episode goes to it
as a probe: a step it then serves lets it back (with a fresh window); a probe it fails
quarantines it again, with the backoff doubled (``probe_after_s``, then twice that, up to
``probe_max_s``), until it serves a whole window without a failure. A replica that died is
restarted by the supervisor as always, and the episodes it lost with it do not count against
it (one death loses every episode it held). When every replica is quarantined nothing can
carry the run: ``pick`` raises ``ReplicasQuarantinedError``, naming them.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from asyncrl.clock import MONOTONIC, Clock
from asyncrl.errors import AsyncrlError

__all__ = ["Quarantine", "ReplicasQuarantinedError"]

log = logging.getLogger("asyncrl.agents")

PROBE_MAX_FACTOR = 16
"""``probe_max_s``, when not given, is this many times ``probe_after_s``: four doublings."""


class ReplicasQuarantinedError(AsyncrlError):
    """Every replica of the environment is quarantined: the run cannot go on."""


@dataclass
class _Replica:
    steps: deque[bool]  # True: a failed step (or reset), newest last
    quarantined: bool = False
    next_probe: float = 0.0  # when a new episode may go to it as a probe
    probing: bool = False  # a probe went to it since it was quarantined
    streak: int = 0  # quarantines in a row: the backoff's exponent
    why: str = ""


@dataclass
class Quarantine:
    """Which replicas of an environment group new episodes may start on.

    Args:
        name: the environment group's name (for messages).
        replicas: how many it has.
        share: the share of failed steps in the window past which a replica is quarantined.
        window: the steps judged (a replica with fewer recorded is never quarantined).
        probe_after_s: seconds from a replica's first quarantine to its probe; each
            quarantine in a row (a failed probe) doubles it.
        probe_max_s: the longest wait for a probe, however many quarantines in a row; None:
            16 times ``probe_after_s`` (8 minutes for the default 30 s).
        clock: what the probes' waits run on (a test passes a ``FakeClock``).

    Raises:
        ValueError: a share outside [0, 1), a window < 1, a negative probe period or a
            ``probe_max_s`` below ``probe_after_s``.
    """

    name: str
    replicas: int
    share: float = 0.5
    window: int = 20
    probe_after_s: float = 30.0
    probe_max_s: float | None = None
    clock: Clock = MONOTONIC
    quarantined: int = 0  # times a replica was quarantined (a failed probe again)
    released: int = 0  # times a quarantined replica was let back
    _state: list[_Replica] = field(default_factory=list)
    _next: int = 0  # round robin over the healthy replicas

    def __post_init__(self) -> None:
        if not 0.0 <= self.share < 1.0:
            raise ValueError(f"quarantine_share: expected a number in [0, 1), got {self.share}")
        if self.window < 1:
            raise ValueError(f"quarantine_window: expected an int >= 1, got {self.window}")
        if self.probe_after_s < 0:
            raise ValueError(f"probe_after_s: expected a number >= 0, got {self.probe_after_s}")
        if self.probe_max_s is None:
            self.probe_max_s = PROBE_MAX_FACTOR * self.probe_after_s
        if self.probe_max_s < self.probe_after_s:
            raise ValueError(
                f"probe_max_s: expected a number >= probe_after_s ({self.probe_after_s:g}), "
                f"got {self.probe_max_s}"
            )
        self._state = [_Replica(deque(maxlen=self.window)) for _ in range(self.replicas)]

    def record(self, replica: int, failed: bool) -> str:
        """One step served (``failed`` False) or failed by ``replica`` (a failed reset counts as
        a failed step).

        Returns:
            Why the replica is quarantined, when this step quarantined it (its window's
            failures, or a failed probe): the caller has it restarted. "" otherwise.
        """
        if not 0 <= replica < self.replicas:
            return ""
        state = self._state[replica]
        if state.quarantined:
            if not failed:  # it served a probe: let it back, judged afresh
                state.quarantined, state.probing, state.why = False, False, ""
                state.steps.clear()
                self.released += 1
                log.warning("%s.%d served a probe: it takes new episodes again", self.name, replica)
                return ""
            if not state.probing:  # an episode it held from before: already judged
                return ""
            return self._quarantine(replica, "failed its probe")
        state.steps.append(failed)
        failures = sum(state.steps)
        if len(state.steps) < self.window:
            return ""
        if failures > self.share * self.window:
            return self._quarantine(replica, f"failed {failures} of its last {self.window} steps")
        if state.streak and not any(state.steps):
            state.streak = 0  # a whole window served since it was let back: forgiven
        return ""

    def _quarantine(self, replica: int, why: str) -> str:
        state = self._state[replica]
        state.quarantined, state.probing, state.why = True, False, why
        state.streak += 1
        wait = self.backoff_s(replica)
        state.next_probe = self.clock.now() + wait
        state.steps.clear()
        self.quarantined += 1
        log.warning(
            "%s.%d quarantined (%d in a row): it %s (quarantine_share %g); no new episode goes "
            "to it until a probe in %.0f s",
            self.name,
            replica,
            state.streak,
            why,
            self.share,
            wait,
        )
        return f"quarantined: it {why}"

    def backoff_s(self, replica: int) -> float:
        """Seconds from the replica's latest quarantine to its probe: ``probe_after_s``
        doubled for each quarantine in a row after the first, at most ``probe_max_s``."""
        streak = max(self._state[replica].streak, 1)
        limit = self.probe_max_s if self.probe_max_s is not None else self.probe_after_s
        return float(min(self.probe_after_s * 2 ** (streak - 1), limit))

    def streak(self, replica: int) -> int:
        """The replica's quarantines in a row (0: it served a whole window since the last)."""
        return self._state[replica].streak

    def is_quarantined(self, replica: int) -> bool:
        return self._state[replica].quarantined

    def pick(self, avoid: int | None = None) -> int | None:
        """The replica a new episode starts on: None (any: none is quarantined), a quarantined
        one due a probe, or the next healthy one. ``avoid`` (the replica that failed the
        episode this one plays again) is neither probed nor picked while another healthy
        replica is there.

        Raises:
            ReplicasQuarantinedError: every replica is quarantined and none is due a probe.
        """
        out = [r for r, s in enumerate(self._state) if s.quarantined]
        if not out:
            return None
        now = self.clock.now()
        healthy = [r for r, s in enumerate(self._state) if not s.quarantined]
        due = [r for r in out if now >= self._state[r].next_probe]
        probe = next((r for r in due if r != avoid), due[0] if due and not healthy else None)
        if probe is not None:
            state = self._state[probe]
            state.next_probe = now + self.backoff_s(probe)
            state.probing = True
            return probe
        if avoid in healthy and len(healthy) > 1:
            healthy.remove(avoid)
        if not healthy:
            named = "; ".join(f"{self.name}.{r} {self._state[r].why}" for r in out)
            raise ReplicasQuarantinedError(
                f"every replica of {self.name!r} is quarantined: {named}. Nothing can run "
                "episodes: see the environment's log for why its steps fail, or raise "
                "quarantine_share"
            )
        self._next = (self._next + 1) % len(healthy)
        return healthy[self._next]
