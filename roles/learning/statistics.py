"""Statistics the sample pipeline and the learner share: the moments of a set of values, which
merge in any order (split-mode reduction's unit, ``asyncrl.roles.sampling.reduce``), a sample's
staleness, and nearest-rank percentiles. Nothing here imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import msgspec

__all__ = ["Moments", "percentiles", "staleness"]


class Moments(msgspec.Struct, frozen=True, array_like=True):
    """The count, mean and M2 (sum of squared deviations from the mean) of some values.

    ``Moments(0, 0.0, 0.0)`` is the empty set of values. On the wire it is ``[count, mean, m2]``.
    """

    count: int
    mean: float
    m2: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Moments:
        """The moments of ``values``, computed in one go.

        Two passes with exactly rounded sums (``math.fsum``); the second pass subtracts the
        rounding error left in the mean (the corrected two-pass algorithm).
        """
        xs = [float(v) for v in values]
        n = len(xs)
        if n == 0:
            return cls(0, 0.0, 0.0)
        mean = math.fsum(xs) / n
        deviations = [x - mean for x in xs]
        m2 = math.fsum(d * d for d in deviations) - math.fsum(deviations) ** 2 / n
        return cls(n, mean, max(m2, 0.0))

    @classmethod
    def one(cls, value: float) -> Moments:
        """The moments of one value: ``Moments.of([value])``, without its passes."""
        mean = value + 0.0  # as fsum's: -0.0 is 0.0
        return cls(1, mean, 0.0 if math.isfinite(value) else math.nan)

    def merge(self, other: Moments) -> Moments:
        """The moments of both sets of values together (Chan et al.'s parallel formula).

        An empty side returns the other one unchanged.
        """
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        na, nb = self.count, other.count
        n = na + nb
        delta = other.mean - self.mean
        mean = self.mean + delta * nb / n
        m2 = self.m2 + other.m2 + delta * delta * na * nb / n
        return Moments(n, mean, m2)

    @property
    def var(self) -> float:
        """The population variance, M2 / count; 0 for no values."""
        return self.m2 / self.count if self.count else 0.0

    @property
    def std(self) -> float:
        """The population standard deviation."""
        return math.sqrt(self.var)


def staleness(consumer_version: int, versions: Sequence[int]) -> int:
    """The consuming learner version minus the oldest version among a sample's tokens (0 for a
    sample without tokens)."""
    return consumer_version - min(versions) if versions else 0


def percentiles(values: Iterable[float]) -> dict[str, float]:
    """``p50``, ``p99`` and ``max`` by nearest rank (0 for no values)."""
    ordered = sorted(values)
    if not ordered:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}

    def rank(q: float) -> float:
        return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])

    return {"p50": rank(0.50), "p99": rank(0.99), "max": float(ordered[-1])}
