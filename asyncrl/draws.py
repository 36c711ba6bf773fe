"""Counter-based draws: numbers fixed by an integer key and an index alone.

The rollout engine's per-token uniforms and the prompt schedule's per-prompt draws must be the
same on every run and resume, whatever else happens around them (the batch a row decodes in,
the prompts skipped before). Both take them from splitmix64 of (key, index): a few integer
operations, with no generator state to seed or carry.
"""

from __future__ import annotations

__all__ = ["splitmix64", "unit"]

_MASK64 = (1 << 64) - 1
_UNIT = 2.0**-53


def splitmix64(key: int, index: int) -> int:
    """64 well-mixed bits fixed by (key, index): splitmix64's output for state key + (index + 1)
    times its increment."""
    x = (key + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def unit(key: int, index: int) -> float:
    """A number in [0, 1) fixed by (key, index): the top 53 bits of ``splitmix64``."""
    return (splitmix64(key, index) >> 11) * _UNIT
