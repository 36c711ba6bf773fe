"""The write-ahead log of a trainer's steps: what each acknowledged step consumed, fsynced
before the step replies, so that a restarted trainer replays it instead of losing it.

One replica's log is a directory of segments, ``<first step>.wal``. A segment is a sequence of
records, each ``length (u32) | crc32 (u32) | MessagePack payload``; a payload is an ``Entry``:

- ``StepEntry``: one step (its number after the step), the batch it consumed (the role's own
  encoding), and every RNG's state at its start;
- ``KeepEntry``: a ``keep`` the program asked to keep between steps (``checkpoint(keep)``).

A new segment begins with each checkpoint; once a checkpoint covers a segment's steps, the
segment is removed. A record cut short by a crash (the file ends inside it, or the file's last
record fails its checksum) is a write that never finished, so never acknowledged: it is cut,
durably, with a warning. A record that fails its checksum with more records after it is
corruption of acknowledged steps: reading refuses it (``WalError``) rather than replay a hole.
"""

from __future__ import annotations

import itertools
import os
import struct
import zlib
from collections.abc import Callable
from typing import Any

import msgspec

from asyncrl.roles.payloads import ProgramState
from asyncrl.roles.training.checkpoints import fsync_dir
from asyncrl.safe_files import open_append

__all__ = ["Entry", "KeepEntry", "StepEntry", "WalError", "WriteAheadLog"]

_HEADER = struct.Struct("<II")
_SUFFIX = ".wal"


class WalError(RuntimeError):
    """The log is corrupt in the middle: acknowledged steps cannot be replayed."""


class StepEntry(msgspec.Struct, tag="step"):
    """One acknowledged step.

    Attributes:
        step: the trainer's step count after it.
        batch: the batch it consumed, as the role encodes it (MessagePack).
        rng: every RNG's state at the step's start (``checkpoints.rng_bytes``).
        result: what the step replied (a re-sent batch gets it back after a replay).
    """

    step: int
    batch: bytes
    rng: dict[str, Any] = {}
    result: dict[str, Any] = {}


class KeepEntry(msgspec.Struct, tag="keep"):
    """A ``keep`` given between steps, after step ``step``."""

    step: int
    keep: ProgramState


Entry = StepEntry | KeepEntry

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Entry)


class WriteAheadLog:
    """One replica's log, in the directory ``path``; ``warn`` reports what reading cut."""

    def __init__(self, path: str, warn: Callable[[str], None]) -> None:
        self.path = path
        self.warn = warn
        os.makedirs(path, exist_ok=True)
        self._segment: str | None = None

    # -- writing ----------------------------------------------------------------------------

    def append(self, entry: Entry) -> int:
        """Add ``entry`` durably (written and fsynced); returns its size in bytes."""
        payload = _encoder.encode(entry)
        if self._segment is None:
            self.begin_segment(entry.step if isinstance(entry, StepEntry) else entry.step + 1)
        assert self._segment is not None
        with open_append(self._segment) as f:
            f.write(_HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
            f.flush()
            os.fsync(f.fileno())
        return _HEADER.size + len(payload)

    def begin_segment(self, first_step: int) -> None:
        """Start a new segment for the steps from ``first_step`` on (at a checkpoint)."""
        self._segment = os.path.join(self.path, f"{first_step:08d}{_SUFFIX}")
        open_append(self._segment).close()
        fsync_dir(self.path)

    def close(self) -> None:
        self._segment = None

    def drop_through(self, step: int) -> list[str]:
        """Remove the segments whose steps are all at most ``step`` (a checkpoint covers
        them); returns their names."""
        firsts = self._firsts()
        dropped = []
        for first, after in itertools.pairwise(firsts):
            if after - 1 <= step:
                os.remove(os.path.join(self.path, f"{first:08d}{_SUFFIX}"))
                dropped.append(f"{first:08d}{_SUFFIX}")
        if dropped:
            fsync_dir(self.path)
        return dropped

    # -- reading ----------------------------------------------------------------------------

    def _firsts(self) -> list[int]:
        names = [n for n in os.listdir(self.path) if n.endswith(_SUFFIX)]
        return sorted(int(n[: -len(_SUFFIX)]) for n in names if n[: -len(_SUFFIX)].isdigit())

    def first_step(self) -> int | None:
        """The first step the log can hold (its oldest segment's), or None: no segment."""
        firsts = self._firsts()
        return firsts[0] if firsts else None

    def entries(self) -> list[Entry]:
        """Every entry, oldest first; a torn tail is cut (durably, with a warning).

        Raises:
            WalError: a record in the middle fails its checksum or does not decode.
        """
        out: list[Entry] = []
        firsts = self._firsts()
        for i, first in enumerate(firsts):
            name = os.path.join(self.path, f"{first:08d}{_SUFFIX}")
            out += self._read_segment(name, last=i == len(firsts) - 1)
        return out

    def _read_segment(self, name: str, last: bool) -> list[Entry]:
        with open(name, "rb") as f:
            data = f.read()
        out: list[Entry] = []
        at = 0
        while at < len(data):
            bad = self._bad_record(data, at)
            if bad is None:
                length, _ = _HEADER.unpack_from(data, at)
                out.append(_decoder.decode(data[at + _HEADER.size : at + _HEADER.size + length]))
                at += _HEADER.size + length
                continue
            end = at + _HEADER.size + (_HEADER.unpack_from(data, at)[0] if bad != "short" else 0)
            if not last or (bad != "short" and end < len(data)):
                raise WalError(
                    f"write-ahead log {name}: the record at byte {at} {bad}, and acknowledged "
                    f"steps follow it: they cannot be replayed. Restore the file from a backup, "
                    f"or resume from the newest checkpoint by removing {self.path} (the steps "
                    f"after that checkpoint are then lost)"
                )
            self.warn(
                f"write-ahead log {name}: cut {len(data) - at} byte(s) at byte {at}: a record "
                f"whose write never finished ({bad}); its step was never acknowledged"
            )
            with open(name, "r+b") as f:
                f.truncate(at)
                os.fsync(f.fileno())
            break
        return out

    @staticmethod
    def _bad_record(data: bytes, at: int) -> str | None:
        """What is wrong with the record at ``at``, or None: it is whole."""
        if len(data) - at < _HEADER.size:
            return "short"
        length, crc = _HEADER.unpack_from(data, at)
        payload = data[at + _HEADER.size : at + _HEADER.size + length]
        if len(payload) < length:
            return "short"
        if zlib.crc32(payload) != crc:
            return "fails its checksum"
        try:
            _decoder.decode(payload)
        except msgspec.DecodeError:
            return "does not decode"
        return None

    def cut_after(self, step: int) -> int:
        """Remove the entries past ``step`` (steps no other rank logged, never acknowledged);
        returns how many. The log is rewritten durably."""
        entries = self.entries()
        kept = [e for e in entries if e.step <= step]
        cut = len(entries) - len(kept)
        if not cut:
            return 0
        first = self.first_step() or step + 1
        self.close()
        for f in self._firsts():
            os.remove(os.path.join(self.path, f"{f:08d}{_SUFFIX}"))
        self.begin_segment(first)
        for entry in kept:
            self.append(entry)
        return cut
