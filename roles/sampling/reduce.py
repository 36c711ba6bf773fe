"""Split-mode reduction: statistics merged from contributions that arrive in any order.

A reduction (the reward statistics of a GRPO group whose samples came from several replicas) is
split into *contributions*. Each worker posts its own as soon as its work is done and moves on; a
``Reducer`` merges them and releases the round. It keeps constant state per round, never the raw
values: a ``Moments`` (count, mean and M2, the sum of squared deviations) and the set of part ids
already merged, so that a part sent twice is merged once. Contributions are merged in arrival order
with Chan et al.'s parallel formula, so the result equals the one-shot computation on the same
data, up to rounding.

Life cycle of a round
---------------------
::

    open(key, expected) ──> add(key, part, moments) ... ──> released ──> forget(key)
         (or the first add with expected=)               (once)      (late parts refused)

A round opens with the number of parts it expects and, under a deadline, arms a timer. It is
released exactly once, by calling ``on_release`` with a ``Released``:

- ``COMPLETE`` as soon as ``expected`` distinct parts are merged, whatever the policy;
- otherwise at its deadline, as the straggler policy says:

  - ``wait``: keep waiting (the round is counted ``overdue``) and release it ``COMPLETE`` when
    the last part arrives;
  - ``emit``: release it ``PARTIAL`` if it has at least ``k_min`` parts; if not, it is
    ``overdue`` and is released ``PARTIAL`` the moment its ``k_min``-th part arrives;
  - ``drop``: release it ``DROPPED`` with what it has; the caller refills it (a fresh prompt).

A part that arrives after its round was released is *late*: it is refused and reported to
``on_late``. The reducer remembers released keys for that until ``forget(key)``.

The reducer lives with whoever consumes the released rounds (the driver's sample pipeline), and the
contributions reach it as the replies of the calls that computed them: the dispatcher re-runs an
idempotent call whose replica died, and the part id makes a second reply harmless.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.clock import MONOTONIC, Clock, Timer
from asyncrl.roles.learning.statistics import Moments

__all__ = ["Moments", "Outcome", "Reducer", "Released", "Straggler"]

log = logging.getLogger("asyncrl.roles.sampling.reduce")


class Straggler(enum.StrEnum):
    """What a round that reaches its deadline incomplete becomes."""

    WAIT = "wait"  # keep waiting for every part
    EMIT = "emit"  # release with the parts it has, if at least k_min
    DROP = "drop"  # release as dropped; the caller refills


class Outcome(enum.StrEnum):
    """How a round was released."""

    COMPLETE = "complete"  # every expected part was merged
    PARTIAL = "partial"  # emitted at or after its deadline with at least k_min parts
    DROPPED = "dropped"  # dropped at its deadline


@dataclass(frozen=True, slots=True)
class Released:
    """One released round.

    Attributes:
        key: the round's key.
        moments: the merged moments of its parts (for ``DROPPED``, of the parts it had).
        parts: the ids of the parts merged.
        expected: the number of parts the round expected.
        outcome: complete, partial or dropped.
        waited_s: seconds from the round's opening to its release.
    """

    key: str
    moments: Moments
    parts: frozenset[str]
    expected: int
    outcome: Outcome
    waited_s: float


class _Round:
    __slots__ = ("deadline_s", "expected", "key", "moments", "opened", "overdue", "parts", "timer")

    def __init__(self, key: str, expected: int, deadline_s: float | None, opened: float) -> None:
        self.key = key
        self.expected = expected
        self.deadline_s = deadline_s
        self.moments = Moments(0, 0.0, 0.0)
        self.parts: set[str] = set()
        self.opened = opened
        self.overdue = False
        self.timer: Timer | None = None


_COUNTERS = (
    "opened",
    "complete",
    "partial",
    "dropped",
    "overdue",
    "duplicates",
    "late",
    "contributions",
    "callback_errors",
)


class Reducer:
    """Merges contributions into rounds and releases each round once.

    One reducer per process, used from its event loop: deadlines are timers of its clock, by
    default the loop's, so a reducer with deadlines must then be used while a loop runs (one
    without needs none).

    Args:
        on_release: called with each ``Released``, synchronously from ``add`` or the deadline
            timer. If it raises, the error is counted (``callback_errors``) and handed to
            ``on_error``, or logged without one; the round stays released.
        policy: what a round that reaches its deadline incomplete becomes.
        deadline_s: seconds from a round's opening to its deadline; None for no deadline (only
            ``wait`` allows that). ``open`` may override it per round.
        k_min: for ``emit``, the fewest parts a partial round is released with.
        on_late: called with ``(key, part)`` for each part that arrives after its round was
            released; errors are logged and counted like those of ``on_release``.
        on_error: called with each exception ``on_release`` or ``on_late`` raises (an owner
            that raises it where it can be handled: ``SamplePipeline``); None: logged.
        clock: what deadlines and ``waited_s`` are measured on (``asyncrl.clock``; a test
            passes a ``FakeClock``).

    Raises:
        ValueError: ``k_min`` under 1, ``deadline_s`` not positive, or ``emit``/``drop``
            without a deadline.
    """

    def __init__(
        self,
        on_release: Callable[[Released], None],
        *,
        policy: Straggler = Straggler.WAIT,
        deadline_s: float | None = None,
        k_min: int = 1,
        on_late: Callable[[str, str], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
        clock: Clock = MONOTONIC,
    ) -> None:
        policy = Straggler(policy)
        if k_min < 1:
            raise ValueError(f"k_min must be at least 1, got {k_min}")
        _check_deadline(deadline_s, "deadline_s")
        if policy is not Straggler.WAIT and deadline_s is None:
            raise ValueError(
                f"straggler policy {policy.value!r} acts at a deadline; pass deadline_s=<seconds>, "
                f"or use policy 'wait'"
            )
        self.policy = policy
        self.deadline_s = deadline_s
        self.k_min = k_min
        self._on_release = on_release
        self._on_late = on_late
        self._on_error = on_error
        self.clock = clock
        self._open: dict[str, _Round] = {}
        self._released: set[str] = set()
        self._counts: Counter[str] = Counter()
        self._closed = False

    # -- rounds ---------------------------------------------------------------------------

    def open(self, key: str, expected: int, *, deadline_s: float | None = None) -> None:
        """Open round ``key`` expecting ``expected`` parts; its deadline runs from now.

        ``deadline_s`` overrides the reducer's deadline for this round. Opening a round that is
        already open does nothing.

        Raises:
            ValueError: ``key`` was released already (``forget`` it to reuse the key), or
                ``expected`` under 1, or ``deadline_s`` not positive.
            RuntimeError: the reducer is closed.
        """
        self._check_open()
        if key in self._open:
            return
        if key in self._released:
            raise ValueError(
                f"round {key!r} was already released; a key is used once (forget({key!r}) to "
                f"reuse it)"
            )
        if expected < 1:
            raise ValueError(f"round {key!r}: expected must be at least 1, got {expected}")
        _check_deadline(deadline_s, f"round {key!r}: deadline_s")
        if deadline_s is None:
            deadline_s = self.deadline_s
        round_ = _Round(key, expected, deadline_s, self.clock.now())
        if deadline_s is not None:
            round_.timer = self.clock.call_later(deadline_s, self._deadline, round_)
        self._open[key] = round_
        self._counts["opened"] += 1

    def add(self, key: str, part: str, moments: Moments, *, expected: int | None = None) -> bool:
        """Merge part ``part`` of round ``key``; True if merged.

        ``expected`` opens the round when ``key`` is new (with the reducer's deadline). False
        means the part was not merged: it was merged before (counted ``duplicates``), or its
        round was released already (counted ``late``; ``on_late`` is called).

        Raises:
            KeyError: ``key`` is not open and ``expected`` was not given.
            ValueError: ``expected`` disagrees with the open round's.
            RuntimeError: the reducer is closed.
        """
        self._check_open()
        if key in self._released:
            self._counts["late"] += 1
            if self._on_late is not None:
                self._call(self._on_late, key, part)
            return False
        round_ = self._open.get(key)
        if round_ is None:
            if expected is None:
                raise KeyError(
                    f"round {key!r} is not open: open it with open({key!r}, expected) first, "
                    f"or pass expected= to add()"
                )
            self.open(key, expected)
            round_ = self._open[key]
        elif expected is not None and expected != round_.expected:
            raise ValueError(
                f"round {key!r} expects {round_.expected} parts, but part {part!r} says {expected}"
            )
        if part in round_.parts:
            self._counts["duplicates"] += 1
            return False
        round_.parts.add(part)
        round_.moments = round_.moments.merge(moments)
        self._counts["contributions"] += 1
        count = len(round_.parts)
        if count >= round_.expected:
            self._release(round_, Outcome.COMPLETE)
        elif round_.overdue and self.policy is Straggler.EMIT and count >= self.k_min:
            self._release(round_, Outcome.PARTIAL)
        return True

    def forget(self, key: str) -> None:
        """Forget that ``key`` was released: its late parts are then unknown, and it may reopen."""
        self._released.discard(key)

    def pending(self) -> list[str]:
        """The keys of the rounds open now, oldest first."""
        return list(self._open)

    @property
    def metrics(self) -> dict[str, int]:
        """Counters: opened, complete, partial, dropped, overdue, duplicates, late,
        contributions (parts merged), callback_errors; and open_rounds, the rounds open now."""
        return {**{name: self._counts[name] for name in _COUNTERS}, "open_rounds": len(self._open)}

    def close(self) -> None:
        """Cancel every deadline; the reducer refuses further rounds and parts."""
        self._closed = True
        for round_ in self._open.values():
            if round_.timer is not None:
                round_.timer.cancel()
                round_.timer = None

    # -- internals ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the reducer is closed")

    def _deadline(self, round_: _Round) -> None:
        round_.timer = None
        if self._open.get(round_.key) is not round_:
            return
        if self.policy is Straggler.DROP:
            self._release(round_, Outcome.DROPPED)
        elif self.policy is Straggler.EMIT and len(round_.parts) >= self.k_min:
            self._release(round_, Outcome.PARTIAL)
        else:
            round_.overdue = True
            self._counts["overdue"] += 1

    def _release(self, round_: _Round, outcome: Outcome) -> None:
        # The state is settled before on_release runs, so whatever it does cannot undo it.
        del self._open[round_.key]
        self._released.add(round_.key)
        if round_.timer is not None:
            round_.timer.cancel()
            round_.timer = None
        self._counts[outcome.value] += 1
        released = Released(
            round_.key,
            round_.moments,
            frozenset(round_.parts),
            round_.expected,
            outcome,
            self.clock.now() - round_.opened,
        )
        self._call(self._on_release, released)

    def _call(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            callback(*args)
        except Exception as exc:
            self._counts["callback_errors"] += 1
            if self._on_error is not None:
                self._on_error(exc)
                return
            name = getattr(callback, "__name__", callback)
            log.exception("reducer: %s raised on %r", name, args)


def _check_deadline(deadline_s: float | None, what: str) -> None:
    if deadline_s is not None and not (deadline_s > 0 and math.isfinite(deadline_s)):
        raise ValueError(f"{what} must be a positive number of seconds or None, got {deadline_s}")
