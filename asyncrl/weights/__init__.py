"""The weight store: versioned weights from a publisher to the readers of one host, through
shared memory.

Owns: the segment's layout (``layout``), its writer (``store``), its reader (``reader``),
where a publisher leaves its handle (``handles``, which also describes the protocol), and the
broadcast of a store's version to a relay of another host (``broadcast``).

May import: the core (``asyncrl.errors``, ``asyncrl.safe_files``) and the transport.
"""

from __future__ import annotations

from asyncrl.errors import NothingPublishedError, TornReadError, WeightsError, WeightsGoneError
from asyncrl.weights.layout import NO_VERSION, TensorSpec, WeightsHandle
from asyncrl.weights.publishing import HandlePointer, handle_path, read_handle, write_handle
from asyncrl.weights.reader import WeightReader
from asyncrl.weights.store import WeightStore

__all__ = [
    "NO_VERSION",
    "HandlePointer",
    "NothingPublishedError",
    "TensorSpec",
    "TornReadError",
    "WeightReader",
    "WeightStore",
    "WeightsError",
    "WeightsGoneError",
    "WeightsHandle",
    "handle_path",
    "read_handle",
    "write_handle",
]
