"""A role process's host heap: freed memory kept for the next step rather than handed back.

glibc's allocator starts a process with small thresholds: a block over 128 KiB is its own
``mmap`` (unmapped when freed), and an arena whose free top exceeds 128 KiB gives it back to the
system. It raises both as large blocks come and go, but only up to what it has seen freed: in a
role process the training step runs on a worker thread, in an arena of its own, and there it
kept returning the step's activations each step (``madvise(MADV_DONTNEED)`` of 4 to 8 MiB) and
faulting them in again on the next: about 3,500 page faults and 4 ms of system time a step of
the arith learner, a tenth of its step (``asyncrl bench learner --small-only``).

``hold_heap`` sets the thresholds glibc would end at (its largest: ``mmap`` above 32 MiB, trim
above 64 MiB of free top) when the process starts, so a step's working set stays mapped from the
first step. The price: a worker thread's arena (heaps of 64 MiB at most) no longer gives memory
back on its own, and the main arena keeps up to 64 MiB free, so a process stays near the most
its arenas held. Blocks over 32 MiB (large weights, checkpoint buffers) still come and go as
their own mappings, and a role that gives memory back on purpose (``Device.release_cache``, the
sharded learner between blocks) calls ``malloc_trim``, which ignores the thresholds.

A user who tunes glibc's allocator (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or
``glibc.malloc.mmap_threshold`` or ``trim_threshold`` in ``GLIBC_TUNABLES``) keeps that choice:
``hold_heap`` then changes nothing. Another C library (musl, macOS) is left alone.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "hold_heap", "user_tuned"]

MMAP_THRESHOLD = 32 * 1024 * 1024
"""Blocks up to this size come from the heap (glibc's ``DEFAULT_MMAP_THRESHOLD_MAX``, 64-bit)."""

TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
"""Free memory at an arena's top kept up to this (what glibc pairs with the mmap threshold)."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")


def user_tuned(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` sets either threshold for glibc itself."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    return any(name in environ for name in _ENV) or any(t in tunables for t in _TUNABLES)


def hold_heap(environ: Mapping[str, str] = os.environ) -> bool:
    """Set this process's allocator thresholds (the module's docstring); True when they were
    set, False when the user tuned them or the C library has no ``mallopt``."""
    if user_tuned(environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mapped = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))  # fails on a 32-bit glibc
    trimmed = bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return mapped and trimmed
