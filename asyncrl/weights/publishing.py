"""Versioned weight sync from the learner to rollout replicas on one host, through shared memory.

The learner owns a ``WeightStore`` and publishes a state dict under an increasing version number;
each rollout replica owns a ``WeightReader`` and, between generation steps, copies out the latest
complete version. A reader never sees half-written weights: the store keeps two slots, writes
into the one readers are not directed to, and guards every slot with a seqlock, so a reader that
raced with the writer notices and copies again.

Modules
-------
- ``asyncrl.weights.layout``: the segment's memory layout, the tensor table (``WeightsHandle``)
  that travels to readers, and why other processes see the protocol's stores and loads in order;
- ``asyncrl.weights.store``: the writer, ``WeightStore``;
- ``asyncrl.weights.reader``: the reader, ``WeightReader``;
- this module: the protocol and lifetime (below), where a publisher leaves its handle for readers
  (``handle_path``, ``write_handle``, ``read_handle``), and keeps it naming the publisher's
  store while another publisher of the host may replace it (``HandlePointer``).

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

import contextlib
import os

import msgspec

from asyncrl.safe_files import write_atomic
from asyncrl.weights.layout import WeightsHandle

__all__ = ["HandlePointer", "handle_path", "read_handle", "write_handle"]


def handle_path(run_dir: str, publisher: str) -> str:
    """Where ``publisher`` (a role name) leaves the handle of its current store for readers."""
    return os.path.join(run_dir, "weights", f"{publisher}.json")


def write_handle(path: str, handle: WeightsHandle) -> None:
    """Write ``handle`` atomically: a reader sees the old handle or the new, never half."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, msgspec.json.encode(handle))


def read_handle(path: str) -> WeightsHandle | None:
    """The handle at ``path``, or None when nothing was published there yet."""
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=WeightsHandle)
    except FileNotFoundError:
        return None


class HandlePointer:
    """Keeps a host's handle file naming one publisher's store, at one ``stat`` a check.

    A host's handle (``handle_path``) has two possible writers: the learner group's lead when
    it runs on the host, and the host's relay when the lead runs elsewhere. As the lead moves
    (a node's loss, a group that grows back) each learns of the move on its own clock, so one
    may replace the file the other wrote and go on publishing into a store the file no longer
    names: the host's rollout replicas then read a store that never changes again, or one
    that closed, and keep their old weights. A publisher calls ``point`` after each version:
    it writes its handle unless the file is the one it wrote for that store.
    """

    def __init__(self) -> None:
        self._written: tuple[str, str, int, int] | None = None  # path, segment, device, inode

    def point(self, path: str, handle: WeightsHandle) -> bool:
        """Make the file at ``path`` name ``handle``'s store; True when it wrote it."""
        try:
            seen = os.stat(path)
            if self._written == (path, handle.segment, seen.st_dev, seen.st_ino):
                return False
        except FileNotFoundError:
            pass
        write_handle(path, handle)
        # The file as it is now, if it is the one just written (else the next call looks
        # again): read through one descriptor, so its inode and its content agree.
        self._written = None
        with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
            there = os.fstat(f.fileno())
            if msgspec.json.decode(f.read(), type=WeightsHandle).segment == handle.segment:
                self._written = (path, handle.segment, there.st_dev, there.st_ino)
        return True
