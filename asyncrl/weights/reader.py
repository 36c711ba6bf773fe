"""A rollout replica's side of the weight store: ``WeightReader`` maps the writer's segment
read-only and copies out the latest complete version, retrying when it raced with the writer
(the protocol is in ``asyncrl.weights.publishing``, the layout in ``asyncrl.weights.layout``).
"""

from __future__ import annotations

import mmap
import os
import stat

import numpy as np
import torch

from asyncrl.errors import ClosedError, NothingPublishedError, TornReadError, WeightsGoneError
from asyncrl.transport.codec import torch_dtypes
from asyncrl.transport.shm import (
    _NAME_RE,  # the name pattern sweep() recognises
    SHM_DIR,
    host_id,
)
from asyncrl.weights.layout import (
    HEADER_BYTES,
    LAYOUT,
    MAGIC,
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
    WeightsHandle,
    byte_view,
    check_names,
    check_tensor,
    fence,
    raise_problems,
    segment_views,
)

__all__ = ["DEFAULT_MAX_RETRIES", "WeightReader"]

DEFAULT_MAX_RETRIES = 100
"""How many times ``WeightReader.read`` copies again, by default, after racing with the writer."""


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
        self._map: SegmentMap | None = self._open()

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
        return int(header[W_LATEST])

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
        targets = [byte_view(out[spec.name]) for spec in self.handle.tensors]
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
        fence()  # LATEST before CURRENT, in the order the writer stored them
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

    def _attempt(self, mapping: SegmentMap, targets: list[np.ndarray]) -> int | None:
        """One pass of the seqlock protocol: the version copied, or None to retry."""
        header = mapping.header
        slot = int(header[W_CURRENT])
        if slot < 0:
            raise NothingPublishedError(
                f"nothing published yet in weights {self.name}; wait for the learner's first "
                f"publish, or use read_if_newer(NO_VERSION)"
            )
        if slot > 1:
            raise self._corrupt(f"CURRENT is {slot}, not a slot (0 or 1)")
        fence()  # CURRENT before the slot's sequence
        seq = int(header[W_SEQ[slot]])
        if seq & 1:
            return None  # the writer lapped us and is rewriting this slot; CURRENT has moved on
        fence()  # the sequence before the data
        self._before_copy(slot)
        for src, dst in zip(mapping.slots[slot], targets, strict=True):
            np.copyto(dst, src)
        version = int(header[W_VERSION[slot]])
        fence()  # the data before the second look at the sequence
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
        return int(header[W_SEQ[slot]]) == seq

    def _before_copy(self, slot: int) -> None:
        """Called before the tensors of ``slot`` are copied; a hook for tests that pause here."""

    def _destination(self, into: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        specs = self.handle.tensors
        if into is None:
            dtypes = torch_dtypes()
            return {s.name: torch.empty(s.shape, dtype=dtypes[s.dtype]) for s in specs}
        problems = check_names(into, specs, "into")
        for spec in specs:
            t = into.get(spec.name)
            if t is None:
                continue
            problems += check_tensor(spec.name, t, spec, "into")
            if t.device.type != "cpu":
                problems.append(f"into[{spec.name!r}]: on {t.device}, expected the CPU")
            elif not t.is_contiguous():
                problems.append(f"into[{spec.name!r}]: not contiguous")
        raise_problems("into", problems)
        return into

    def _live(self) -> SegmentMap:
        mapping = self._map
        if mapping is None:
            raise ClosedError(f"weight reader of {self.name} is closed; open a new WeightReader")
        if mapping.header[W_CLOSED]:
            raise WeightsGoneError(self._gone_message("closed its WeightStore"))
        return mapping

    def _gone_message(self, what: str) -> str:
        return (
            f"weights {self.name} are gone: the learner (pid {self.handle.pid}) {what}; get a "
            f"fresh WeightsHandle from it and open a new WeightReader"
        )

    def _open(self) -> SegmentMap:
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
        mapping = segment_views(mm, self.handle)
        header = mapping.header
        expected = {
            "magic": (W_MAGIC, MAGIC),
            "layout": (W_LAYOUT, LAYOUT),
            "header bytes": (W_HEADER, HEADER_BYTES),
            "slot bytes": (W_SLOT, self.handle.slot_bytes),
            "writer pid": (W_PID, self.handle.pid),
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
