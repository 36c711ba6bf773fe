"""The weight store's segment: its memory layout, the tensor table that travels to readers, and
the memory fence the seqlock needs. ``WeightStore`` (``asyncrl.weights.store``) writes it and
``WeightReader`` (``asyncrl.weights.reader``) reads it; ``asyncrl.weights.publishing`` describes the
protocol.

Memory layout
-------------
One segment, a file under ``/dev/shm`` named ``asyncrl.<run>.<pid>.<incarnation>.<seq>`` like
every asyncrl segment (``asyncrl.transport.shm``), holds a header page and two slots::

    offset                        size        what
    0                             4096        header: 64-bit integers in native byte order
    4096                          slot_bytes  slot 0
    4096 + slot_bytes             slot_bytes  slot 1

    header word (8 bytes each)    byte offset
    0  MAGIC     b"arlweigh"      0            tells a weights segment from anything else
    1  LAYOUT    1                8            this layout's version
    2  HEADER    4096             16           bytes before slot 0
    3  SLOT      slot_bytes       24           bytes in one slot (a multiple of 4096)
    4  CLOSED    0 or 1           32           1 once the writer closed the store
    5  CURRENT   -1, 0 or 1       40           the slot readers should copy; -1 before any publish
    6  LATEST    -1 or version    48           the version in slot CURRENT; a cheap hint
    7  PID       writer's pid     56
    8  SEQ[0]                     64           slot 0's sequence: odd while it is being written
    9  VERSION[0]                 72           the version slot 0 holds when SEQ[0] is even
    16 SEQ[1]                     128          (each slot's words sit in their own cache line)
    17 VERSION[1]                 136
    every other word is zero, reserved

Within a slot, tensor ``k`` of the table (in the template's order) starts at ``offset`` (a
multiple of 64) and takes ``nbytes`` bytes, C-contiguous. ``WeightStore.describe()`` returns this
table as a ``WeightsHandle``, which is what travels to the readers.


Why other processes see these stores and loads in this order
------------------------------------------------------------
- The interpreter runs each Python-level access to the mapping (a header word or a tensor copy)
  as its own C call, in program order, and a C compiler cannot move memory accesses through
  memory that escaped (the mapping) across a call it cannot see into. So the stores leave this
  thread in the order written above; what remains is the CPU.
- Every header word is a naturally aligned 8-byte integer, read and written through a numpy
  int64 view. numpy does that with a typed access or an 8-byte memcpy, which compilers emit as
  one aligned load or store, and x86-64 and AArch64 make those single-copy atomic: a reader does
  not see half of a sequence number. (This too is practice, not a promise of numpy's; were a load
  ever split, a torn SEQ could only pass the check after 2**32 publishes.)
- x86-64 (TSO) keeps stores in order with stores and loads in order with loads, which is all a
  seqlock needs: the writer's odd SEQ reaches other cores before its data, and its data before
  the even SEQ; the reader's loads happen in program order.
- AArch64 and other weakly ordered CPUs may reorder both, and the re-check of SEQ alone does not
  help there: without barriers, the even SEQ could become visible before the last data bytes,
  and a reader would accept a torn copy. Python has no fence, so ``fence`` makes one from a
  lock: CPython's ``Lock.release`` is a release operation and ``Lock.acquire`` an acquire
  operation (glibc semaphores, whose post and wait are release and acquire atomics, up to 3.12;
  PyMutex's sequentially consistent atomics from 3.13), and on AArch64 a release followed by an
  acquire is not reordered (RCsc: STLR then LDAR/LDAXR/CASA). So every access before
  ``fence()`` is ordered before every access after it. This rests on how CPython and glibc
  implement locks, not on a documented Python guarantee; it holds for CPython on Linux on
  x86-64 and AArch64, the platforms asyncrl runs on. The race tests exercise the protocol on
  whatever machine runs them, and a negative control shows that a reader without the re-check
  does copy torn data; no test can prove the absence of reordering on a CPU it does not run on.

"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

__all__ = [
    "ALIGN",
    "HEADER_BYTES",
    "LAYOUT",
    "MAGIC",
    "NO_VERSION",
    "PAGE",
    "W_CLOSED",
    "W_CURRENT",
    "W_HEADER",
    "W_LATEST",
    "W_LAYOUT",
    "W_MAGIC",
    "W_PID",
    "W_SEQ",
    "W_SLOT",
    "W_VERSION",
    "SegmentMap",
    "TensorSpec",
    "WeightsHandle",
    "byte_view",
    "check_names",
    "check_tensor",
    "dtype_name",
    "fence",
    "raise_problems",
    "round_up",
    "segment_views",
]

NO_VERSION = -1
"""What ``WeightReader.version()`` returns before the first publish."""

LAYOUT = 1
ALIGN = 64
HEADER_BYTES = 4096
PAGE = 4096
MAGIC = int.from_bytes(b"arlweigh", "little", signed=True)

# Header words (index into the int64 view; byte offset = 8 x index).
W_MAGIC, W_LAYOUT, W_HEADER, W_SLOT, W_CLOSED, W_CURRENT, W_LATEST, W_PID = range(8)
W_SEQ = (8, 16)
W_VERSION = (9, 17)


# -- what travels to readers ---------------------------------------------------------------------


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of a slot: its state-dict name, torch dtype name (``"bfloat16"``), shape, and
    where its C-contiguous bytes lie within a slot."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class WeightsHandle(msgspec.Struct, frozen=True):
    """What a reader needs to open a ``WeightStore``: send it over the wire to rollout replicas.

    ``host`` is ``asyncrl.transport.shm.host_id()`` of the writer; ``slot_offsets`` are byte
    offsets of the two slots within the segment, each ``slot_bytes`` long.
    """

    segment: str
    host: str
    pid: int
    slot_bytes: int
    slot_offsets: tuple[int, int]
    tensors: tuple[TensorSpec, ...]
    layout: int = LAYOUT

    @property
    def total_bytes(self) -> int:
        """The size of the whole segment."""
        return self.slot_offsets[1] + self.slot_bytes


# -- shared by the writer and the readers ------------------------------------------------------

_FENCE_LOCK = threading.Lock()


def fence() -> None:
    """A two-way memory barrier for this thread's accesses to shared memory (see the module doc).

    The lock is free before and after; the middle release-then-acquire pair is the barrier, and
    the outer acquire and release only keep the lock usable from any thread.
    """
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a CPU tensor as a flat uint8 numpy array: its memory when contiguous."""
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8).numpy()


def check_tensor(name: str, t: torch.Tensor, spec: TensorSpec, what: str) -> list[str]:
    problems = []
    if dtype_name(t.dtype) != spec.dtype:
        problems.append(f"{what}[{name!r}]: dtype {dtype_name(t.dtype)}, expected {spec.dtype}")
    if tuple(t.shape) != spec.shape:
        problems.append(f"{what}[{name!r}]: shape {tuple(t.shape)}, expected {spec.shape}")
    return problems


def check_names(names: Mapping[str, object], specs: tuple[TensorSpec, ...], what: str) -> list[str]:
    expected = [s.name for s in specs]
    missing = [n for n in expected if n not in names]
    extra = sorted(set(names) - set(expected))
    problems = []
    if missing:
        problems.append(f"{what} lacks {missing}")
    if extra:
        problems.append(f"{what} has unknown tensors {extra}")
    return problems


def raise_problems(what: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(
            "\n  ".join([f"{what} does not match the store's tensor table:", *problems])
        )


@dataclass(eq=False)
class SegmentMap:
    mm: mmap.mmap
    header: np.ndarray  # int64 view over the header page
    slots: tuple[list[np.ndarray], list[np.ndarray]]  # per slot, a uint8 view per tensor

    def close(self) -> None:
        # Views export the mmap's buffer; drop ours before closing it.
        self.header = np.empty(0, dtype=np.int64)
        self.slots = ([], [])
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still held elsewhere; the mapping goes with it


def segment_views(mm: mmap.mmap, handle: WeightsHandle) -> SegmentMap:
    header = np.frombuffer(mm, dtype=np.int64, count=HEADER_BYTES // 8)
    slots: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    for base, views in zip(handle.slot_offsets, slots, strict=True):
        for spec in handle.tensors:
            views.append(
                np.frombuffer(mm, dtype=np.uint8, count=spec.nbytes, offset=base + spec.offset)
            )
    return SegmentMap(mm, header, slots)
