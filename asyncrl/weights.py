"""Versioned weight sync from the learner to rollout replicas on one host, through shared memory.

The learner owns a ``WeightStore`` and publishes a state dict under an increasing version number;
each rollout replica owns a ``WeightReader`` and, between generation steps, copies out the latest
complete version. A reader never sees half-written weights: the store keeps two slots, writes
into the one readers are not directed to, and guards every slot with a seqlock, so a reader that
raced with the writer notices and copies again.

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

The protocol
------------
Publishing version ``v`` into slot ``j`` (the one CURRENT does not point at)::

    SEQ[j] += 1 (odd); fence; copy every tensor; VERSION[j] = v; fence;
    SEQ[j] += 1 (even); fence; CURRENT = j; fence; LATEST = v

Reading::

    i = CURRENT; fence; s = SEQ[i]; if s is odd: retry
    fence; copy every tensor; version = VERSION[i]; fence
    if SEQ[i] != s: retry            (the writer started overwriting slot i meanwhile)

Each slot has its own sequence, so a publish disturbs only a reader that is still copying the
slot the writer now reuses, that is one the writer lapped by publishing twice during one copy.
A retry reads CURRENT again and so moves to the newest complete slot. After ``max_retries``
failed attempts ``read`` raises ``TornReadError``.

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
  and a reader would accept a torn copy. Python has no fence, so ``_fence`` makes one from a
  lock: CPython's ``Lock.release`` is a release operation and ``Lock.acquire`` an acquire
  operation (glibc semaphores, whose post and wait are release and acquire atomics, up to 3.12;
  PyMutex's sequentially consistent atomics from 3.13), and on AArch64 a release followed by an
  acquire is not reordered (RCsc: STLR then LDAR/LDAXR/CASA). So every access before
  ``_fence()`` is ordered before every access after it. This rests on how CPython and glibc
  implement locks, not on a documented Python guarantee; it holds for CPython on Linux on
  x86-64 and AArch64, the platforms asyncrl runs on. The race tests exercise the protocol on
  whatever machine runs them, and a negative control shows that a reader without the re-check
  does copy torn data; no test can prove the absence of reordering on a CPU it does not run on.

Lifetime
--------
Only the writer creates and unlinks the segment (``close``, or at exit). Readers map it read-only
and never unlink it, so a reader killed with SIGKILL leaves nothing behind. If the writer dies
without closing, its segment is swept by ``asyncrl.transport.shm.sweep()``, which every new
``ShmPool`` and ``WeightStore`` of the same run runs, and the supervisor too. A reader that
mapped the segment before the writer died keeps reading the last complete version, since a
mapping outlives the unlinked file; one that opens it afterwards gets ``WeightsGoneError``. When
the writer closes, it first marks the header CLOSED, so mapped readers fail with
``WeightsGoneError`` as well.

Across hosts
------------
Not implemented here: between hosts, weights go as ZeroMQ frames through the transport's codec
(or through a plugin's broadcast). A ``WeightReader`` refuses a handle whose host id differs from
its own.
"""

from __future__ import annotations

import atexit
import mmap
import os
import stat
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from asyncrl.errors import ClosedError, NothingPublishedError, TornReadError, WeightsGoneError
from asyncrl.transport.codec import torch_dtypes
from asyncrl.transport.shm import (
    _NAME_RE,  # the name pattern sweep() recognises
    _SEQ,  # shared with every ShmPool of the process: names never collide (see _create)
    SHM_DIR,
    host_id,
    segment_name,
    sweep,
)

__all__ = [
    "NO_VERSION",
    "NothingPublishedError",
    "TensorSpec",
    "TornReadError",
    "WeightReader",
    "WeightStore",
    "WeightsGoneError",
    "WeightsHandle",
    "handle_path",
    "read_handle",
    "write_handle",
]

NO_VERSION = -1
"""What ``WeightReader.version()`` returns before the first publish."""

LAYOUT = 1
ALIGN = 64
HEADER_BYTES = 4096
_PAGE = 4096
_MAGIC = int.from_bytes(b"arlweigh", "little", signed=True)

# Header words (index into the int64 view; byte offset = 8 x index).
_W_MAGIC, _W_LAYOUT, _W_HEADER, _W_SLOT, _W_CLOSED, _W_CURRENT, _W_LATEST, _W_PID = range(8)
_W_SEQ = (8, 16)
_W_VERSION = (9, 17)

DEFAULT_MAX_RETRIES = 100


# -- errors -------------------------------------------------------------------------------------


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


# -- shared pieces -------------------------------------------------------------------------------

_FENCE_LOCK = threading.Lock()


def _fence() -> None:
    """A two-way memory barrier for this thread's accesses to shared memory (see the module doc).

    The lock is free before and after; the middle release-then-acquire pair is the barrier, and
    the outer acquire and release only keep the lock usable from any thread.
    """
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a CPU tensor as a flat uint8 numpy array: its memory when contiguous."""
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8).numpy()


def _check_tensor(name: str, t: torch.Tensor, spec: TensorSpec, what: str) -> list[str]:
    problems = []
    if _dtype_name(t.dtype) != spec.dtype:
        problems.append(f"{what}[{name!r}]: dtype {_dtype_name(t.dtype)}, expected {spec.dtype}")
    if tuple(t.shape) != spec.shape:
        problems.append(f"{what}[{name!r}]: shape {tuple(t.shape)}, expected {spec.shape}")
    return problems


def _check_names(
    names: Mapping[str, object], specs: tuple[TensorSpec, ...], what: str
) -> list[str]:
    expected = [s.name for s in specs]
    missing = [n for n in expected if n not in names]
    extra = sorted(set(names) - set(expected))
    problems = []
    if missing:
        problems.append(f"{what} lacks {missing}")
    if extra:
        problems.append(f"{what} has unknown tensors {extra}")
    return problems


def _raise_problems(what: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(
            "\n  ".join([f"{what} does not match the store's tensor table:", *problems])
        )


@dataclass(eq=False)
class _Mapping:
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


def _views(mm: mmap.mmap, handle: WeightsHandle) -> _Mapping:
    header = np.frombuffer(mm, dtype=np.int64, count=HEADER_BYTES // 8)
    slots: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    for base, views in zip(handle.slot_offsets, slots, strict=True):
        for spec in handle.tensors:
            views.append(
                np.frombuffer(mm, dtype=np.uint8, count=spec.nbytes, offset=base + spec.offset)
            )
    return _Mapping(mm, header, slots)


# -- the writer ----------------------------------------------------------------------------------


class WeightStore:
    """The learner's side: one segment with two slots, published to under a seqlock.

    Args:
        template: name -> CPU tensor; fixes the names, dtypes and shapes for the store's life.
            Only metadata is taken from it; nothing is published until ``publish``.
        run: the run id; part of the segment name (segments of dead processes of this run are
            swept on creation).
        incarnation: the owner's restart count; part of the segment name.
        directory: where the segment lives (``/dev/shm``).

    Raises:
        ValueError: a template tensor of a dtype that cannot travel (quantized).
        OSError: the segment could not be created or its memory reserved (``/dev/shm`` full).
    """

    def __init__(
        self,
        template: Mapping[str, torch.Tensor],
        *,
        run: str = "run",
        incarnation: int = 0,
        directory: str = SHM_DIR,
    ) -> None:
        specs: list[TensorSpec] = []
        offset = 0
        for name, t in template.items():
            dtype = _dtype_name(t.dtype)
            if dtype not in torch_dtypes():
                raise ValueError(f"template[{name!r}]: dtype {t.dtype} cannot be shared")
            nbytes = t.numel() * t.element_size()
            offset = _round_up(offset, ALIGN)
            specs.append(TensorSpec(name, dtype, tuple(t.shape), offset, nbytes))
            offset += nbytes
        slot_bytes = _round_up(offset, _PAGE)
        self.directory = directory
        self.pid = os.getpid()
        sweep(run, directory=directory)
        self._name, mm = self._create(run, incarnation, HEADER_BYTES + 2 * slot_bytes)
        self._handle = WeightsHandle(
            segment=self._name,
            host=host_id(directory),
            pid=self.pid,
            slot_bytes=slot_bytes,
            slot_offsets=(HEADER_BYTES, HEADER_BYTES + slot_bytes),
            tensors=tuple(specs),
        )
        self._map: _Mapping | None = _views(mm, self._handle)
        header = self._map.header
        for word, value in (
            (_W_MAGIC, _MAGIC),
            (_W_LAYOUT, LAYOUT),
            (_W_HEADER, HEADER_BYTES),
            (_W_SLOT, slot_bytes),
            (_W_CLOSED, 0),
            (_W_CURRENT, -1),
            (_W_LATEST, NO_VERSION),
            (_W_PID, self.pid),
        ):
            header[word] = value
        self._current = -1
        self._latest = NO_VERSION
        self._lock = threading.Lock()
        # The finalizer holds the path, not the store, so the store can be collected; it runs
        # at exit or collection if close() was never called.
        self._finalizer = weakref.finalize(self, _unlink, os.path.join(directory, self._name))
        atexit.register(self._finalizer)

    @property
    def name(self) -> str:
        """The segment's name, to send to readers (``describe()`` sends everything they need)."""
        return self._name

    @property
    def version(self) -> int:
        """The latest published version; ``NO_VERSION`` before the first publish."""
        return self._latest

    def describe(self) -> WeightsHandle:
        """The handle readers open: segment name, host, slot size and offsets, tensor table."""
        return self._handle

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state_dict`` into the free slot and make it the current one, as ``version``.

        Args:
            state_dict: exactly the template's names, dtypes and shapes; tensors on another
                device are first copied to the CPU; non-contiguous ones are accepted.
            version: greater than every version published before, and >= 0.

        Raises:
            ValueError: names, dtypes or shapes differ from the template (all listed at once),
                or the version does not increase.
            ClosedError: the store was closed.
        """
        specs = self._handle.tensors
        problems = _check_names(state_dict, specs, "state_dict")
        for spec in specs:
            if spec.name in state_dict:
                problems += _check_tensor(spec.name, state_dict[spec.name], spec, "state_dict")
        _raise_problems("state_dict", problems)
        with self._lock:
            if self._map is None:
                raise ClosedError(
                    f"weight store {self._name} is closed; create a new WeightStore to publish"
                )
            if version < 0 or version <= self._latest:
                raise ValueError(
                    f"version {version} does not increase: {self._name} already holds version "
                    f"{self._latest}; versions are >= 0 and grow with every publish"
                )
            self._write(self._map, state_dict, version)

    def _write(
        self, mapping: _Mapping, state_dict: Mapping[str, torch.Tensor], version: int
    ) -> None:
        header = mapping.header
        slot = 0 if self._current < 0 else 1 - self._current
        seq = int(header[_W_SEQ[slot]])
        header[_W_SEQ[slot]] = seq + 1  # odd: slot is being written
        _fence()  # the odd sequence before any data
        try:
            for index, (spec, dst) in enumerate(
                zip(self._handle.tensors, mapping.slots[slot], strict=True)
            ):
                if spec.nbytes:
                    src = state_dict[spec.name]
                    if src.device.type != "cpu":
                        src = src.to("cpu")
                    np.copyto(dst, _byte_view(src))
                self._after_tensor(slot, index)
        except BaseException:
            # Keep the sequence's parity: the slot is even again but CURRENT never points at
            # it, so no reader is sent to its half-written bytes, and one that was copying it
            # sees the sequence moved and retries. The next publish rewrites the slot.
            _fence()
            header[_W_SEQ[slot]] = seq + 2
            raise
        header[_W_VERSION[slot]] = version
        _fence()  # all data and the version before the even sequence
        header[_W_SEQ[slot]] = seq + 2  # even: slot is complete
        _fence()  # a reader sent to this slot sees it complete
        header[_W_CURRENT] = slot
        _fence()  # a reader that sees LATEST finds CURRENT already pointing at it
        header[_W_LATEST] = version
        self._current = slot
        self._latest = version

    def _after_tensor(self, slot: int, index: int) -> None:
        """Called after each tensor is copied into ``slot``; a hook for tests that pause here."""

    def close(self) -> None:
        """Mark the segment closed for mapped readers, then unlink and unmap it. Idempotent."""
        with self._lock:
            mapping, self._map = self._map, None
            if mapping is None:
                return
            mapping.header[_W_CLOSED] = 1
            _fence()
            _unlink(os.path.join(self.directory, self._name))
            mapping.close()
        atexit.unregister(self._finalizer)
        self._finalizer.detach()

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self, run: str, incarnation: int, size: int) -> tuple[str, mmap.mmap]:
        # _SEQ is the counter ShmPool names its segments with. Sharing it matters: a pool that
        # finds its next name taken assumes a dead process with our pid left it, and unlinks it.
        name = segment_name(run, self.pid, incarnation, next(_SEQ))
        path = os.path.join(self.directory, name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            # Left by a dead process that had our pid: its owner is gone, since we hold the pid.
            os.unlink(path)
            fd = os.open(path, flags, 0o600)
        try:
            # fallocate reserves the pages now, so a full tmpfs fails here rather than with
            # SIGBUS on the first write.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except OSError as exc:
            _unlink(path)
            raise OSError(
                exc.errno,
                f"cannot reserve {size} bytes in {self.directory} for weights: {exc.strerror}; "
                f"free shared memory or enlarge the tmpfs",
            ) from exc
        finally:
            os.close(fd)
        return name, mm


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# -- the readers ---------------------------------------------------------------------------------


class WeightReader:
    """A rollout replica's side: maps a store's segment read-only and copies snapshots out.

    Args:
        handle: from ``WeightStore.describe()``, usually received over the wire.
        directory: where the segment lives (``/dev/shm``); the same as the writer's.
        max_retries: how many times ``read`` copies again after racing with the writer.

    Attributes:
        retries: attempts that raced with the writer and were repeated, over this reader's life.

    Raises:
        ValueError: the handle comes from another host, names no asyncrl segment, or disagrees
            with the segment's header.
        WeightsGoneError: the segment no longer exists (the writer closed or died).
    """

    def __init__(
        self,
        handle: WeightsHandle,
        *,
        directory: str = SHM_DIR,
        max_retries: int = DEFAULT_MAX_RETRIES,
    ) -> None:
        here = host_id(directory)
        if handle.host != here:
            raise ValueError(
                f"weights handle {handle.segment} comes from host {handle.host!r}, this is "
                f"{here!r}: shared memory works on one host only; send the weights as frames"
            )
        if not _NAME_RE.match(handle.segment):
            raise ValueError(f"{handle.segment!r} is not an asyncrl shared-memory segment name")
        if handle.layout != LAYOUT:
            raise ValueError(f"weights handle layout {handle.layout}, this reader reads {LAYOUT}")
        self.handle = handle
        self.directory = directory
        self.max_retries = max_retries
        self.retries = 0
        self._map: _Mapping | None = self._open()

    @property
    def name(self) -> str:
        """The segment this reader maps."""
        return self.handle.segment

    def version(self) -> int:
        """The latest published version (one header load); ``NO_VERSION`` before any publish.

        Raises:
            ClosedError: this reader was closed.
            WeightsGoneError: the writer closed its store.
        """
        header = self._live().header
        return int(header[_W_LATEST])

    def read(
        self, into: dict[str, torch.Tensor] | None = None
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """Copy out the latest complete version.

        Args:
            into: tensors to copy into (the store's names, dtypes and shapes, contiguous, on the
                CPU), reused across calls to avoid allocating; new tensors when None.

        Returns:
            ``(version, state_dict)``; ``state_dict`` is ``into`` when given. Every tensor holds
            the bytes of that one version.

        Raises:
            ValueError: ``into`` does not match the tensor table (all problems listed at once).
            NothingPublishedError: nothing was published yet.
            TornReadError: ``max_retries`` retries all raced with the writer.
            ClosedError: this reader was closed.
            WeightsGoneError: the writer closed its store.
        """
        self._live()
        out = self._destination(into)
        targets = [_byte_view(out[spec.name]) for spec in self.handle.tensors]
        for _ in range(self.max_retries + 1):
            version = self._attempt(self._live(), targets)
            if version is not None:
                return version, out
            self.retries += 1
        raise TornReadError(
            f"no complete snapshot of weights {self.name} in {self.max_retries + 1} attempts: "
            f"the writer (pid {self.handle.pid}) overwrote the slot being copied every time, "
            f"publishing twice during one copy; publish less often or raise max_retries"
        )

    def read_if_newer(
        self, version: int, into: dict[str, torch.Tensor] | None = None
    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Like ``read``, but None (without copying) unless a version above ``version`` exists.

        Raises:
            as ``read``, except NothingPublishedError (None instead).
        """
        if self.version() <= version:
            return None
        _fence()  # LATEST before CURRENT, in the order the writer stored them
        got = self.read(into)
        return got if got[0] > version else None

    def close(self) -> None:
        """Unmap the segment (never unlinks it; the writer owns it). Idempotent."""
        mapping, self._map = self._map, None
        if mapping is not None:
            mapping.close()

    def __enter__(self) -> WeightReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _attempt(self, mapping: _Mapping, targets: list[np.ndarray]) -> int | None:
        """One pass of the seqlock protocol: the version copied, or None to retry."""
        header = mapping.header
        slot = int(header[_W_CURRENT])
        if slot < 0:
            raise NothingPublishedError(
                f"nothing published yet in weights {self.name}; wait for the learner's first "
                f"publish, or use read_if_newer(NO_VERSION)"
            )
        if slot > 1:
            raise self._corrupt(f"CURRENT is {slot}, not a slot (0 or 1)")
        _fence()  # CURRENT before the slot's sequence
        seq = int(header[_W_SEQ[slot]])
        if seq & 1:
            return None  # the writer lapped us and is rewriting this slot; CURRENT has moved on
        _fence()  # the sequence before the data
        self._before_copy(slot)
        for src, dst in zip(mapping.slots[slot], targets, strict=True):
            np.copyto(dst, src)
        version = int(header[_W_VERSION[slot]])
        _fence()  # the data before the second look at the sequence
        if not self._unchanged(header, slot, seq):
            return None
        if version < 0:
            raise self._corrupt(f"slot {slot} holds version {version}, complete but negative")
        return version

    def _corrupt(self, what: str) -> ValueError:
        return ValueError(
            f"weights segment {self.name} has a corrupt header: {what}. Only its writer (pid "
            f"{self.handle.pid}) may write it; restart the learner to publish a fresh store"
        )

    def _unchanged(self, header: np.ndarray, slot: int, seq: int) -> bool:
        """Whether the writer left ``slot`` alone since its sequence read ``seq``."""
        return int(header[_W_SEQ[slot]]) == seq

    def _before_copy(self, slot: int) -> None:
        """Called before the tensors of ``slot`` are copied; a hook for tests that pause here."""

    def _destination(self, into: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        specs = self.handle.tensors
        if into is None:
            dtypes = torch_dtypes()
            return {s.name: torch.empty(s.shape, dtype=dtypes[s.dtype]) for s in specs}
        problems = _check_names(into, specs, "into")
        for spec in specs:
            t = into.get(spec.name)
            if t is None:
                continue
            problems += _check_tensor(spec.name, t, spec, "into")
            if t.device.type != "cpu":
                problems.append(f"into[{spec.name!r}]: on {t.device}, expected the CPU")
            elif not t.is_contiguous():
                problems.append(f"into[{spec.name!r}]: not contiguous")
        _raise_problems("into", problems)
        return into

    def _live(self) -> _Mapping:
        mapping = self._map
        if mapping is None:
            raise ClosedError(f"weight reader of {self.name} is closed; open a new WeightReader")
        if mapping.header[_W_CLOSED]:
            raise WeightsGoneError(self._gone_message("closed its WeightStore"))
        return mapping

    def _gone_message(self, what: str) -> str:
        return (
            f"weights {self.name} are gone: the learner (pid {self.handle.pid}) {what}; get a "
            f"fresh WeightsHandle from it and open a new WeightReader"
        )

    def _open(self) -> _Mapping:
        path = os.path.join(self.directory, self.handle.segment)
        try:
            # Never through a link, never a FIFO or device: only a plain file of this user.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise WeightsGoneError(
                self._gone_message("closed its WeightStore, or died and it was swept")
            ) from exc
        except OSError as exc:
            raise ValueError(
                f"weights segment {path} cannot be opened as a plain file ({exc.strerror}); "
                f"it is not a store a learner of this run wrote"
            ) from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise ValueError(
                    f"weights segment {path} is not a plain file of this user; it is not a "
                    f"store a learner of this run wrote"
                )
            size = info.st_size
            if size != self.handle.total_bytes:
                raise ValueError(
                    f"weights segment {self.name} holds {size} bytes, the handle says "
                    f"{self.handle.total_bytes}"
                )
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        mapping = _views(mm, self.handle)
        header = mapping.header
        expected = {
            "magic": (_W_MAGIC, _MAGIC),
            "layout": (_W_LAYOUT, LAYOUT),
            "header bytes": (_W_HEADER, HEADER_BYTES),
            "slot bytes": (_W_SLOT, self.handle.slot_bytes),
            "writer pid": (_W_PID, self.handle.pid),
        }
        bad = [
            f"{what} {int(header[word])}, expected {value}"
            for what, (word, value) in expected.items()
            if int(header[word]) != value
        ]
        if bad:
            mapping.close()
            raise ValueError(
                f"weights segment {self.name} disagrees with its handle: {'; '.join(bad)}"
            )
        return mapping


def handle_path(run_dir: str, publisher: str) -> str:
    """Where ``publisher`` (a role name) leaves the handle of its current store for readers."""
    return os.path.join(run_dir, "weights", f"{publisher}.json")


def write_handle(path: str, handle: WeightsHandle) -> None:
    """Write ``handle`` atomically: a reader sees the old handle or the new, never half."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(handle))
    os.replace(tmp, path)


def read_handle(path: str) -> WeightsHandle | None:
    """The handle at ``path``, or None when nothing was published there yet."""
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=WeightsHandle)
    except FileNotFoundError:
        return None
