"""Fault injection for tests of recovery: a plan in the ``ASYNCRL_FAULTS`` environment variable.

``kill_before_reply`` is the hardest case for delivery: the replica has done the work but dies
before it replies, so the caller cannot tell whether the work happened. In a manifest::

    roles:
      worker:
        env:
          ASYNCRL_FAULTS: >-
            {"kill_before_reply": {"method": "work", "every": 40, "incarnations": 3}}

kills the process with SIGKILL after every 40th completed ``work`` call, in each of its first 3
incarnations (so the run ends).

``kill_at`` kills the process at a named point inside a role's own code, reached through
``FaultPlan.at(point)``: the learner names ``mid_step`` (a step trained, nothing of it on
disk), ``after_log`` (a step durable, its reply not yet sent), ``checkpoint_write`` (a
checkpoint's files written, not yet marked complete: in the background with ``durable: wal``)
and ``replay_step`` (a restarted learner replaying its write-ahead log).
"""

from __future__ import annotations

import os
import signal
from collections import Counter

import msgspec

__all__ = ["FAULTS_ENV", "FaultPlan", "KillAt", "KillBeforeReply"]

FAULTS_ENV = "ASYNCRL_FAULTS"


class KillBeforeReply(msgspec.Struct, frozen=True):
    method: str
    every: int = 1
    incarnations: int = 1


class KillAt(msgspec.Struct, frozen=True):
    point: str
    every: int = 1
    incarnations: int = 1


class _Plan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kill_before_reply: KillBeforeReply | None = None
    kill_at: KillAt | None = None


class FaultPlan:
    """The faults this process injects; a plan of None injects nothing."""

    def __init__(self, plan: _Plan, incarnation: int) -> None:
        self._plan = plan
        self._incarnation = incarnation
        self._done: Counter[str] = Counter()

    @classmethod
    def from_env(cls, incarnation: int) -> FaultPlan:
        """The plan in ``ASYNCRL_FAULTS`` (JSON), or an empty one.

        Raises:
            msgspec.ValidationError: the plan is malformed.
        """
        raw = os.environ.get(FAULTS_ENV)
        return cls(msgspec.json.decode(raw, type=_Plan) if raw else _Plan(), incarnation)

    def after_work(self, method: str) -> None:
        """Called after ``method`` computed its result and before the reply is sent."""
        kill = self._plan.kill_before_reply
        if kill is None or kill.method != method or self._incarnation >= kill.incarnations:
            return
        self._done[method] += 1
        if self._done[method] % kill.every == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    def at(self, point: str) -> None:
        """Called by a role at a named point of its own work (see the module)."""
        kill = self._plan.kill_at
        if kill is None or kill.point != point or self._incarnation >= kill.incarnations:
            return
        self._done[f"at:{point}"] += 1
        if self._done[f"at:{point}"] % kill.every == 0:
            os.kill(os.getpid(), signal.SIGKILL)
