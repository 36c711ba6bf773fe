"""The learner's side of the weight store: ``WeightStore`` creates the shared segment, publishes
each version into the slot readers are not directed to, under the seqlock, and unlinks the
segment when it closes (the protocol is in ``asyncrl.weights.publishing``, the layout in
``asyncrl.weights.layout``).
"""

from __future__ import annotations

import atexit
import mmap
import os
import threading
import weakref
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from asyncrl.errors import ClosedError
from asyncrl.transport.codec import torch_dtypes
from asyncrl.transport.shm import (
    _SEQ,  # shared with every ShmPool of the process: names never collide (see _create)
    SHM_DIR,
    host_id,
    segment_name,
    sweep,
)
from asyncrl.weights.layout import (
    ALIGN,
    HEADER_BYTES,
    LAYOUT,
    MAGIC,
    NO_VERSION,
    PAGE,
    W_CLOSED,
    W_CURRENT,
    W_HEADER,
    W_LATEST,
    W_LAYOUT,
    W_MAGIC,
    W_PID,
    W_SEQ,
    W_SLOT,
    W_VERSION,
    SegmentMap,
    TensorSpec,
    WeightsHandle,
    byte_view,
    check_names,
    check_tensor,
    dtype_name,
    fence,
    raise_problems,
    round_up,
    segment_views,
)

__all__ = ["WeightStore"]


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
            dtype = dtype_name(t.dtype)
            if dtype not in torch_dtypes():
                raise ValueError(f"template[{name!r}]: dtype {t.dtype} cannot be shared")
            nbytes = t.numel() * t.element_size()
            offset = round_up(offset, ALIGN)
            specs.append(TensorSpec(name, dtype, tuple(t.shape), offset, nbytes))
            offset += nbytes
        slot_bytes = round_up(offset, PAGE)
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
        self._map: SegmentMap | None = segment_views(mm, self._handle)
        header = self._map.header
        for word, value in (
            (W_MAGIC, MAGIC),
            (W_LAYOUT, LAYOUT),
            (W_HEADER, HEADER_BYTES),
            (W_SLOT, slot_bytes),
            (W_CLOSED, 0),
            (W_CURRENT, -1),
            (W_LATEST, NO_VERSION),
            (W_PID, self.pid),
        ):
            header[word] = value
        self._index = {spec.name: i for i, spec in enumerate(specs)}
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
        problems = check_names(state_dict, specs, "state_dict")
        for spec in specs:
            if spec.name in state_dict:
                problems += check_tensor(spec.name, state_dict[spec.name], spec, "state_dict")
        raise_problems("state_dict", problems)
        self._publish([state_dict], version, checked=True)

    def publish_buckets(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        """Publish ``version`` from ``buckets``, each a part of the state dict, written into
        the free slot as it arrives: a sharded learner gathers one bucket at a time, so no
        second full copy of the model is ever held. The slot becomes current only once every
        name was written exactly once; readers meanwhile keep reading the other slot.

        Raises:
            ValueError: a bucket holds a name the template lacks, a name twice, or a tensor of
                another dtype or shape (the slot is then left unpublished); names the buckets
                never gave; or the version does not increase.
            ClosedError: the store was closed.
        """
        self._publish(buckets, version, checked=False)

    def _publish(
        self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int, *, checked: bool
    ) -> None:
        """``publish_buckets``; ``checked``: every tensor's dtype and shape was already checked
        against the template (``publish`` checks them all before a byte is written)."""
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
            self._write(self._map, buckets, version, checked)

    def _write(
        self,
        mapping: SegmentMap,
        buckets: Iterable[Mapping[str, torch.Tensor]],
        version: int,
        checked: bool,
    ) -> None:
        header = mapping.header
        slot = 0 if self._current < 0 else 1 - self._current
        seq = int(header[W_SEQ[slot]])
        header[W_SEQ[slot]] = seq + 1  # odd: slot is being written
        fence()  # the odd sequence before any data
        index_of = self._index
        written: set[int] = set()
        try:
            for bucket in buckets:
                problems = []
                for name, src in bucket.items():
                    index = index_of.get(name)
                    if index is None or index in written:
                        problems.append(f"{name}: {'unknown' if index is None else 'given twice'}")
                        continue
                    spec = self._handle.tensors[index]
                    if not checked:
                        problems += check_tensor(name, src, spec, "bucket")
                    if problems:
                        continue
                    if spec.nbytes:
                        if src.device.type != "cpu":
                            src = src.to("cpu")
                        np.copyto(mapping.slots[slot][index], byte_view(src))
                    written.add(index)
                    self._after_tensor(slot, index)
                raise_problems("bucket", problems)
            missing = [s.name for i, s in enumerate(self._handle.tensors) if i not in written]
            raise_problems("buckets", [f"{name}: never given" for name in missing])
        except BaseException:
            # Keep the sequence's parity: the slot is even again but CURRENT never points at
            # it, so no reader is sent to its half-written bytes, and one that was copying it
            # sees the sequence moved and retries. The next publish rewrites the slot.
            fence()
            header[W_SEQ[slot]] = seq + 2
            raise
        header[W_VERSION[slot]] = version
        fence()  # all data and the version before the even sequence
        header[W_SEQ[slot]] = seq + 2  # even: slot is complete
        fence()  # a reader sent to this slot sees it complete
        header[W_CURRENT] = slot
        fence()  # a reader that sees LATEST finds CURRENT already pointing at it
        header[W_LATEST] = version
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
            mapping.header[W_CLOSED] = 1
            fence()
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
