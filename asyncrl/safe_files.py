"""Files and folders a run writes in its run directory without following or reusing a name
that someone else could have planted there.

Every write goes through a directory file descriptor opened once: a folder is opened
(``open_subdir``) one component at a time with ``O_NOFOLLOW``, so a link anywhere on the way is
an error naming it, and what is written afterwards lands in the folder that was opened, whatever
is renamed or linked in its place meanwhile (``openat``-style: ``dir_fd`` for every create,
rename and remove). A temporary name is always a fresh one, created with ``O_EXCL |
O_NOFOLLOW`` in that folder: a link or a file left at a predictable ``<path>.tmp`` is never
written through, never truncated and never renamed into place. Everything is created private
(files 0600, folders 0700), whatever the umask.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from typing import BinaryIO

__all__ = [
    "MAX_DEPTH",
    "UnsafePathError",
    "atomic_file",
    "atomic_file_at",
    "fd_path",
    "open_append",
    "open_dir",
    "open_subdir",
    "private_tmpdir_at",
    "remove_at",
    "replace_dir_at",
    "write_atomic",
]

MAX_DEPTH = 64
"""The most folders ``open_subdir`` walks down in one path: deeper is refused with a message
(a path thousands of folders deep is a mistake, and would exhaust ``PATH_MAX`` anyway)."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_TRIES = 100


class UnsafePathError(OSError):
    """A folder on the way to a write is a link, not a folder, or not this user's, or the path
    is too deep: nothing was written. The message names the component and what to do."""


def open_dir(path: str) -> int:
    """Open the folder ``path`` (its own links followed: the caller's path, resolved once here)
    and return its descriptor; the caller closes it.

    Raises:
        OSError: it does not exist or is not a folder.
    """
    return os.open(path, _DIR_FLAGS)


def fd_path(fd: int) -> str:
    """A path that names the very folder (or file) ``fd`` holds open, for a library that takes
    only paths (``save_pretrained``): ``/proc/self/fd/N`` is the open folder itself, not a name
    that could be swapped for a link since it was opened."""
    return f"/proc/self/fd/{fd}"


def open_subdir(
    dir_fd: int, rel: str, *, create: bool = False, where: str = "", max_depth: int = MAX_DEPTH
) -> int:
    """Open the folder ``rel`` (relative, ``a/b/c``) under the open folder ``dir_fd`` one
    component at a time, never following a link; with ``create``, missing folders are made
    (0700). Every component must be a folder of this user's. Returns its descriptor.

    Args:
        dir_fd: the open folder to start from.
        rel: the relative path; "" or "." opens ``dir_fd``'s folder again.
        create: make missing folders.
        where: how to name ``dir_fd``'s folder in an error (its path).
        max_depth: the most components ``rel`` may have.

    Raises:
        UnsafePathError: a component is a link, not a folder, or another user's; ``rel`` is
            absolute, goes up (``..``) or is deeper than ``max_depth``.
        OSError: a component is missing (without ``create``) or cannot be made.
    """
    parts = [p for p in rel.split(os.sep) if p not in ("", ".")]
    if os.path.isabs(rel) or ".." in parts:
        raise UnsafePathError(f"{rel!r} must be a relative path inside {where or 'its folder'}")
    if len(parts) > max_depth:
        raise UnsafePathError(
            f"{rel[:60]!r}... is {len(parts)} folders deep, over the limit of {max_depth}; "
            "give a shorter path"
        )
    fd = os.dup(dir_fd)
    shown = where
    try:
        for part in parts:
            shown = os.path.join(shown, part) if shown else part
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o700, dir_fd=fd)
            try:
                sub = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if create and exc.errno == errno.ENOENT:
                    # It was there (or just made) a moment ago: renamed or removed meanwhile.
                    raise UnsafePathError(
                        f"{shown} went away while it was opened (renamed or removed meanwhile); "
                        "a run writes only into folders that stay where they are: try again"
                    ) from exc
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                st = _lstat_at(fd, part)
                if st is None or stat.S_ISDIR(st.st_mode):
                    head = f"{shown} was no folder when it was opened (a link swapped in)"
                else:
                    head = f"{shown} is {'a link' if stat.S_ISLNK(st.st_mode) else 'not a folder'}"
                raise UnsafePathError(
                    f"{head}; a run writes only into folders of its own, never through a link: "
                    "remove it, or give another path"
                ) from exc
            os.close(fd)
            fd = sub
            owner = os.fstat(fd).st_uid
            if owner != os.getuid():
                raise UnsafePathError(
                    f"{shown} belongs to uid {owner}, not to this user ({os.getuid()}); remove "
                    f"it, or give another path"
                )
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: str, *, truncate: bool = False) -> BinaryIO:
    """Open the file ``path`` (created 0600) for appends, or with ``truncate`` to write it anew,
    never through a link at its name: a log, a journal, a ledger the run keeps adding to.

    Raises:
        UnsafePathError: a link (or something other than a file) is at ``path``.
        OSError: its folder does not exist or cannot be written.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= os.O_TRUNC if truncate else os.O_APPEND
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        st = _lstat_at(None, path) if exc.errno in (errno.ELOOP, errno.EISDIR) else None
        if st is not None and not stat.S_ISREG(st.st_mode):
            what = "a link" if stat.S_ISLNK(st.st_mode) else "not a file"
            raise UnsafePathError(
                f"{path} is {what}; a run writes its files only in its own folders, never "
                "through a link: remove it"
            ) from exc
        raise
    return os.fdopen(fd, "ab")


def _lstat_at(dir_fd: int | None, name: str) -> os.stat_result | None:
    try:
        return os.lstat(name, dir_fd=dir_fd)
    except OSError:
        return None


def write_atomic(path: str, data: bytes, *, fsync: bool = False) -> str:
    """Write ``data`` to ``path`` whole or not at all (``atomic_file``); return ``path``.

    Raises:
        OSError: the folder of ``path`` does not exist or cannot be written.
    """
    with atomic_file(path, fsync=fsync) as f:
        f.write(data)
    return path


@contextlib.contextmanager
def atomic_file(path: str, *, fsync: bool = False) -> Iterator[BinaryIO]:
    """A file to write ``path`` through, whole or not at all (``atomic_file_at`` in the folder
    of ``path``, opened once).

    Raises:
        OSError: the folder of ``path`` does not exist or cannot be written.
    """
    dir_fd = open_dir(os.path.dirname(os.path.abspath(path)))
    try:
        with atomic_file_at(dir_fd, os.path.basename(path), fsync=fsync) as f:
            yield f
    finally:
        os.close(dir_fd)


@contextlib.contextmanager
def atomic_file_at(dir_fd: int, name: str, *, fsync: bool = False) -> Iterator[BinaryIO]:
    """A file to write ``name`` in the open folder ``dir_fd`` through, whole or not at all.

    The bytes go to a fresh temporary file in that folder (``.<name>.<random>.tmp``, 0600,
    ``O_EXCL | O_NOFOLLOW``), which is renamed over ``name`` in the same folder when the block
    ends without an error (and removed when it raises): a link at ``name`` is replaced, not
    followed. With ``fsync`` the file reaches the disk before the rename.

    Raises:
        OSError: the folder cannot be written.
    """
    fd, tmp = _fresh(dir_fd, name, folder=False)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _fresh(dir_fd: int, name: str, *, folder: bool) -> tuple[int, str]:
    """A new file (open, 0600) or folder (0700, fd -1) ``.<name>.<random>.tmp`` in ``dir_fd``."""
    for _ in range(_TRIES):
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            if folder:
                os.mkdir(tmp, 0o700, dir_fd=dir_fd)
                return -1, tmp
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            return os.open(tmp, flags, 0o600, dir_fd=dir_fd), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name for {name} after {_TRIES} tries")


def private_tmpdir_at(dir_fd: int, name: str) -> str:
    """A fresh, empty folder (0700) in the open folder ``dir_fd``, to be renamed to ``name``
    once filled (``replace_dir_at``); returns its name there.

    Raises:
        OSError: the folder cannot be written.
    """
    return _fresh(dir_fd, name, folder=True)[1]


def replace_dir_at(dir_fd: int, tmp: str, name: str) -> None:
    """Put the folder ``tmp`` in the place of ``name`` (a folder, or nothing), both in the open
    folder ``dir_fd``.

    A folder already at ``name`` is first renamed aside to a fresh name, then removed, so
    ``name`` is never half written; a link at ``name`` is removed, never followed.
    """
    st = _lstat_at(dir_fd, name)
    if st is not None and stat.S_ISDIR(st.st_mode):
        old = private_tmpdir_at(dir_fd, name)
        os.rename(name, os.path.join(old, "old"), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        remove_at(dir_fd, old)
        return
    if st is not None:
        os.unlink(name, dir_fd=dir_fd)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def remove_at(dir_fd: int, name: str) -> None:
    """Remove ``name`` from the open folder ``dir_fd``: a folder with all it holds, a file or a
    link (the link itself, never what it points at); nothing when it is gone already."""
    st = _lstat_at(dir_fd, name)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
