"""Shared memory between processes on one host: a sender-owned pool of reused segments.

The sender copies a large tensor into a slot of its pool and sends only a descriptor; the receiver
maps the segment and reads the tensor in place, then releases the slot with a RELEASE message.
Each slot is one segment: a file under ``/dev/shm`` named
``asyncrl.<run>.<pid>.<incarnation>.<seq>``, so that a supervisor can find and sweep the segments
of a process that died.

Only the sender creates and unlinks segments. Receivers only map them, so a receiver killed with
SIGKILL leaves nothing behind; a sender that dies without closing its pool is swept by
``sweep()`` (run by every new pool of the same run, and by the supervisor).

``multiprocessing.shared_memory`` is not used: on Python 3.11 its resource tracker unlinks
segments that another process still maps.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import re
import socket
import stat
import threading
import weakref
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "HOST_ID_ENV",
    "SHM_DIR",
    "ShmPool",
    "ShmReader",
    "Slot",
    "host_id",
    "segment_name",
    "sweep",
]

SHM_DIR = "/dev/shm"
_PREFIX = "asyncrl"
_NAME_RE = re.compile(r"^asyncrl\.([A-Za-z0-9_-]+)\.(\d+)\.(\d+)\.(\d+)\Z")
_MIN_SEGMENT = 1 << 20
_HEADROOM = 64 << 20  # leave this much of /dev/shm free for everyone else
_SEQ = itertools.count(1)  # shared by every pool of the process, so names never collide


HOST_ID_ENV = "ASYNCRL_HOST_ID"
"""An environment variable that splits one machine into simulated hosts: when set (not empty),
``host_id()`` adds its value, so two processes on one machine with different values act as two
hosts. They exchange no shared-memory descriptors (tensor frames travel inline over the socket)
and a ``WeightReader`` refuses the other's weight store. Tests and one-machine rehearsals of a
multi-node run set it per simulated node; on real hosts it can stay unset."""


def host_id(directory: str = SHM_DIR) -> str:
    """Who shares this process's shared memory: host name, boot id and the shm mount, and the
    value of ``ASYNCRL_HOST_ID`` when that is set (``<real id>#<value>``).

    Two processes may exchange shared-memory descriptors only when their host ids are equal.
    """
    real = _real_host_id(directory)
    override = os.environ.get(HOST_ID_ENV, "")
    return f"{real}#{override}" if override else real


def _real_host_id(directory: str) -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        st = os.stat(directory)
        mount = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        return f"{socket.gethostname()}/{boot}/no-shm"
    return f"{socket.gethostname()}/{boot}/{mount}"


def _safe_run(run: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", run) or "run"


def segment_name(run: str, pid: int, incarnation: int, seq: int) -> str:
    """The file name of segment ``seq`` of process ``pid`` in ``run``."""
    return f"{_PREFIX}.{_safe_run(run)}.{pid}.{incarnation}.{seq}"


def _size_class(nbytes: int) -> int:
    size = _MIN_SEGMENT
    while size < nbytes:
        size <<= 1
    return size


@dataclass(eq=False)
class _Segment:
    name: str
    size: int
    mm: mmap.mmap
    array: np.ndarray  # uint8 view over the whole mapping


@dataclass(eq=False)
class Slot:
    """One lent slot: write ``nbytes`` into ``array[:nbytes]``, then send the descriptor."""

    id: int
    segment: str
    nbytes: int
    peer: bytes
    array: np.ndarray = field(repr=False)


class ShmPool:
    """The sender's pool of shared-memory segments, reused across messages.

    Args:
        run: the run id; part of every segment name.
        incarnation: the owner's restart count; part of every segment name.
        max_bytes: the most this pool maps at once. ``acquire`` returns None past it.
        directory: where segments live (``/dev/shm``).
    """

    def __init__(
        self,
        run: str,
        incarnation: int = 0,
        *,
        max_bytes: int = 2 << 30,
        directory: str = SHM_DIR,
    ) -> None:
        self.run = _safe_run(run)
        self.incarnation = incarnation
        self.max_bytes = max_bytes
        self.directory = directory
        self.pid = os.getpid()
        self._slot_ids = 0
        self._free: list[_Segment] = []
        self._lent: dict[int, tuple[_Segment, bytes]] = {}
        self._mapped_bytes = 0
        self._closed = False
        self._lock = threading.Lock()
        self.fallbacks = 0
        self.unknown_releases = 0
        sweep(self.run, directory=directory)
        # The finalizer shares the list of names, not the pool, so the pool can be collected;
        # it runs at exit or collection if close() was never called.
        self._names: list[str] = []
        self._finalizer = weakref.finalize(self, _unlink_all, directory, self._names)
        atexit.register(self._finalizer)

    @property
    def lent(self) -> int:
        """Number of slots the receivers have not released yet."""
        return len(self._lent)

    @property
    def mapped_bytes(self) -> int:
        return self._mapped_bytes

    def segment_names(self) -> list[str]:
        """Names of every segment this pool currently owns."""
        return list(self._names)

    def acquire(self, nbytes: int, peer: bytes = b"") -> Slot | None:
        """Lend a slot of at least ``nbytes`` to ``peer``; None when the pool or /dev/shm is full.

        A None answer is not an error: the caller sends the bytes as frames instead.
        """
        with self._lock:
            if self._closed:
                return None
            segment = self._take_free(nbytes)
            if segment is None:
                segment = self._create(_size_class(nbytes))
            if segment is None:
                self.fallbacks += 1
                return None
            self._slot_ids += 1
            self._lent[self._slot_ids] = (segment, peer)
            return Slot(self._slot_ids, segment.name, nbytes, peer, segment.array)

    def release(self, slot_id: int, peer: bytes | None = None) -> bool:
        """Take back a slot the receiver released.

        With ``peer``, only a slot lent to that peer is taken back, so one receiver cannot free
        another's. Unknown ids are counted and ignored.
        """
        with self._lock:
            entry = self._lent.get(slot_id)
            if entry is None or (peer is not None and entry[1] != peer):
                self.unknown_releases += 1
                return False
            del self._lent[slot_id]
            self._free.append(entry[0])
            return True

    def release_peer(self, peer: bytes, keep: Collection[int] = ()) -> int:
        """Take back every slot lent to ``peer`` (it died or disconnected) but those in ``keep``;
        returns how many."""
        with self._lock:
            ids = [i for i, (_, p) in self._lent.items() if p == peer and i not in keep]
            for i in ids:
                self._free.append(self._lent.pop(i)[0])
            return len(ids)

    def close(self) -> None:
        """Unmap and unlink every segment. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            segments = self._free + [seg for seg, _ in self._lent.values()]
            self._free.clear()
            self._lent.clear()
        for seg in segments:
            self._unlink(seg.name)
            try:
                seg.mm.close()
            except BufferError:
                pass  # a local view still exists; the mapping goes with it
        self._names.clear()
        self._mapped_bytes = 0
        atexit.unregister(self._finalizer)
        self._finalizer.detach()

    def _take_free(self, nbytes: int) -> _Segment | None:
        best: _Segment | None = None
        for seg in self._free:
            if seg.size >= nbytes and (best is None or seg.size < best.size):
                best = seg
        if best is not None:
            self._free.remove(best)
        return best

    def _create(self, size: int) -> _Segment | None:
        if self._mapped_bytes + size > self.max_bytes:
            # Drop idle segments that are too small before refusing.
            for seg in [s for s in self._free if s.size < size]:
                self._free.remove(seg)
                self._drop(seg)
            if self._mapped_bytes + size > self.max_bytes:
                return None
        try:
            stat = os.statvfs(self.directory)
        except OSError:
            return None
        if stat.f_bavail * stat.f_frsize < size + _HEADROOM:
            return None
        name = segment_name(self.run, self.pid, self.incarnation, next(_SEQ))
        path = os.path.join(self.directory, name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            # Left by a dead process that had our pid: its owner is gone, since we hold the pid.
            try:
                os.unlink(path)
                fd = os.open(path, flags, 0o600)
            except OSError:
                return None
        except OSError:
            return None
        try:
            # fallocate reserves the pages now, so a full tmpfs fails here rather than with
            # SIGBUS on the first write.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            self._unlink(name)
            return None
        os.close(fd)
        self._names.append(name)
        self._mapped_bytes += size
        return _Segment(name, size, mm, np.frombuffer(mm, dtype=np.uint8))

    def _drop(self, seg: _Segment) -> None:
        self._unlink(seg.name)
        self._mapped_bytes -= seg.size
        try:
            seg.mm.close()
        except BufferError:
            pass

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.directory, name))
        except FileNotFoundError:
            pass
        if name in self._names:
            self._names.remove(name)


class ShmReader:
    """The receiver's side: maps segments by name, read in place, with a bounded cache.

    A segment is mapped only when its name is an asyncrl segment name (no ``/``, no ``..``), and
    the file is a regular file of this user, opened without following a symlink, so a peer cannot
    make the reader map another file through a link planted in ``/dev/shm``.

    Raises:
        ValueError: for a segment name that is not an asyncrl segment, a range outside it, or a
            file that is not a regular file of this user.
        OSError: when the segment no longer exists, or is a symlink (ELOOP).
    """

    def __init__(self, directory: str = SHM_DIR, max_cached: int = 64) -> None:
        self.directory = directory
        self.max_cached = max_cached
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()

    def view(self, segment: str, offset: int, nbytes: int) -> np.ndarray:
        """A writable uint8 array over ``nbytes`` bytes of ``segment`` at ``offset``."""
        if not _NAME_RE.match(segment):
            raise ValueError(f"{segment!r} is not an asyncrl shared-memory segment name")
        mm = self._maps.get(segment)
        if mm is None:
            mm = self._map(segment)
        else:
            self._maps.move_to_end(segment)
        if offset < 0 or nbytes < 0 or offset + nbytes > len(mm):
            raise ValueError(
                f"range [{offset}, {offset + nbytes}) lies outside segment {segment} of "
                f"{len(mm)} bytes"
            )
        return np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=offset)

    def _map(self, segment: str) -> mmap.mmap:
        # O_NONBLOCK: a FIFO planted under a segment's name must not block the open.
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(os.path.join(self.directory, segment), flags)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"shared-memory segment {segment} is not a regular file")
            if st.st_uid != os.getuid():
                raise ValueError(
                    f"shared-memory segment {segment} belongs to uid {st.st_uid}, not to this "
                    f"user ({os.getuid()}); peers that share memory run as the same user"
                )
            mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        self._maps[segment] = mm
        self._evict()
        return mm

    def _evict(self) -> None:
        if len(self._maps) <= self.max_cached:
            return
        for name in list(self._maps)[: len(self._maps) - self.max_cached]:
            try:
                self._maps[name].close()
            except BufferError:
                continue  # tensors still read it; try again later
            del self._maps[name]

    def close(self) -> None:
        """Drop every mapping no tensor still uses."""
        for name in list(self._maps):
            try:
                self._maps[name].close()
            except BufferError:
                continue
            del self._maps[name]


def _unlink_all(directory: str, names: list[str]) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(
    run: str | None = None,
    *,
    pid: int | None = None,
    directory: str = SHM_DIR,
) -> list[str]:
    """Unlink segments left by dead processes; returns the names removed.

    Args:
        run: only segments of this run (all runs when None).
        pid: only segments of this process, whether or not it is alive (the supervisor passes
            the pid of a role it saw die). When None, only segments of dead processes go.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    want_run = _safe_run(run) if run is not None else None
    for name in names:
        match = _NAME_RE.match(name)
        if match is None:
            continue
        seg_run, seg_pid = match.group(1), int(match.group(2))
        if want_run is not None and seg_run != want_run:
            continue
        if pid is not None and seg_pid != pid:
            continue
        if pid is None and (seg_pid == os.getpid() or _alive(seg_pid)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed
