"""Quarantine of environment replicas that keep failing: the episode runner's record of each
replica's recent steps, and its choice of the replica a new episode starts on.

A replica that failed more than ``share`` of its last ``window`` steps (a step past its deadline
that is not part of the task, an error, a step it did not answer at all) is quarantined: no new
episode starts on it, and the healthy replicas carry the run. Every ``probe_after_s`` seconds
one new episode goes to it as a probe; a step it then serves lets it back (with a fresh window),
a step it fails keeps it out. A replica that died is restarted by the supervisor as always, and
the episodes it lost with it do not count against it (one death loses every episode it held);
one that is alive and failing stays up, out of the way, until it serves again. When every
replica is quarantined nothing can carry the run: ``pick`` raises ``ReplicasQuarantinedError``,
naming them.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from asyncrl.clock import MONOTONIC, Clock
from asyncrl.errors import AsyncrlError

__all__ = ["Quarantine", "ReplicasQuarantinedError"]

log = logging.getLogger("asyncrl.agents")


class ReplicasQuarantinedError(AsyncrlError):
    """Every replica of the environment is quarantined: the run cannot go on."""


@dataclass
class _Replica:
    steps: deque[bool]  # True: a failed step, newest last
    quarantined: bool = False
    next_probe: float = 0.0  # when a new episode may go to it as a probe
    why: str = ""


@dataclass
class Quarantine:
    """Which replicas of an environment group new episodes may start on.

    Args:
        name: the environment group's name (for messages).
        replicas: how many it has.
        share: the share of failed steps in the window past which a replica is quarantined.
        window: the steps judged (a replica with fewer recorded is never quarantined).
        probe_after_s: seconds between probe episodes sent to a quarantined replica.
        clock: what ``probe_after_s`` runs on (a test passes a ``FakeClock``).

    Raises:
        ValueError: a share outside [0, 1), a window < 1 or a negative probe period.
    """

    name: str
    replicas: int
    share: float = 0.5
    window: int = 20
    probe_after_s: float = 30.0
    clock: Clock = MONOTONIC
    quarantined: int = 0  # times a replica was quarantined
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
        self._state = [_Replica(deque(maxlen=self.window)) for _ in range(self.replicas)]

    def record(self, replica: int, failed: bool) -> None:
        """One step served (``failed`` False) or failed by ``replica``."""
        if not 0 <= replica < self.replicas:
            return
        state = self._state[replica]
        if state.quarantined:
            if not failed:  # it served a probe: let it back, judged afresh
                state.quarantined, state.why = False, ""
                state.steps.clear()
                self.released += 1
                log.warning("%s.%d served a probe: it takes new episodes again", self.name, replica)
            return
        state.steps.append(failed)
        failures = sum(state.steps)
        if len(state.steps) == self.window and failures > self.share * self.window:
            state.quarantined = True
            state.why = f"failed {failures} of its last {self.window} steps"
            state.next_probe = self.clock.now() + self.probe_after_s
            state.steps.clear()
            self.quarantined += 1
            log.warning(
                "%s.%d quarantined: it %s (more than %.0f%%); no new episode goes to it but a "
                "probe every %.0f s",
                self.name,
                replica,
                state.why,
                100 * self.share,
                self.probe_after_s,
            )

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
            self._state[probe].next_probe = now + self.probe_after_s
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
