"""Files and folders a run writes in its run directory without following or reusing a name
that someone else could have planted there.

A temporary name is always a fresh one, created with ``O_EXCL | O_NOFOLLOW`` (``mkstemp``,
``mkdtemp``): a link or a file left at a predictable ``<path>.tmp`` is never written through,
never truncated and never renamed into place. Everything is created private (files 0600,
folders 0700), whatever the umask.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import BinaryIO

__all__ = ["atomic_file", "private_tmpdir", "replace_dir", "write_atomic"]


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
    """A file to write ``path`` through, whole or not at all.

    The bytes go to a fresh temporary file beside ``path`` (0600, ``O_EXCL | O_NOFOLLOW``),
    which is renamed over ``path`` when the block ends without an error (and removed when it
    raises): a link at ``path`` is replaced, not followed. With ``fsync`` the file reaches the
    disk before the rename.

    Raises:
        OSError: the folder of ``path`` does not exist or cannot be written.
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def private_tmpdir(path: str) -> str:
    """A fresh, empty folder (0700) beside ``path``, to be renamed to ``path`` once filled.

    Raises:
        OSError: the folder of ``path`` does not exist or cannot be written.
    """
    folder = os.path.dirname(os.path.abspath(path))
    return tempfile.mkdtemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")


def replace_dir(tmp: str, path: str) -> None:
    """Put the folder ``tmp`` in the place of ``path`` (a folder, or nothing).

    A folder already at ``path`` is first renamed aside to a fresh name, then removed, so
    ``path`` is never half written; a link at ``path`` is removed, never followed.
    """
    if os.path.islink(path):
        os.unlink(path)
    elif os.path.lexists(path):
        old = private_tmpdir(path)
        os.rename(path, os.path.join(old, "old"))
        os.rename(tmp, path)
        shutil.rmtree(old)
        return
    os.rename(tmp, path)
