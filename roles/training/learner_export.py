"""The learner's ``export``: the trained model as a Hugging Face directory, written only into
the run's ``exports/`` folder or a ``write_paths`` folder the manifest allows, never over the
run's own state (its roles, ledger, sockets, logs, weights, checkpoints) and never through a
link."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncrl.safe_files import (
    MAX_DEPTH,
    UnsafePathError,
    fd_path,
    open_dir,
    open_subdir,
    private_tmpdir_at,
    remove_at,
    replace_dir_at,
)

__all__ = ["EXPORTS_DIR", "EXPORT_MARKER", "ExportTarget", "export_pretrained", "writable"]

EXPORTS_DIR = "exports"
"""The folder of the run directory that ``export`` writes into; a relative path names a folder
in it (``export("final")`` writes ``RUN_DIR/exports/final``)."""
EXPORT_MARKER = ".asyncrl-export"
"""An empty file in every export, so that a later export replaces only an earlier export."""


@dataclass(frozen=True)
class ExportTarget:
    """Where ``export`` writes, resolved once by ``writable``.

    Attributes:
        role: the role's name, for errors.
        root: the folder the export goes under (``RUN_DIR/exports`` or a ``write_paths``
            folder), resolved.
        rel: the export's path under ``root``, with no link in it when it was resolved.
        run_dir: the run directory, resolved; ``root`` is opened from it when it is
            ``RUN_DIR/exports``.
    """

    role: str
    root: str
    rel: str
    run_dir: str

    @property
    def path(self) -> str:
        """The export's folder."""
        return os.path.join(self.root, self.rel)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def writable(path: str, role: str, run_dir: str, write_paths: Sequence[str]) -> ExportTarget:
    """Where ``export`` may write ``path``: resolved once (links followed), strictly inside
    ``RUN_DIR/exports`` or one of ``write_paths``, and neither inside the rest of the run
    directory nor holding it. A relative ``path`` is taken inside ``RUN_DIR/exports``, which is
    created (0700) when missing. ``export_pretrained`` then writes it relative to the opened
    root, never by this path again.

    Args:
        path: where the caller asks to write.
        role: the role's name, for the error and the manifest key it names.
        run_dir: the run directory.
        write_paths: further folders the manifest allows (``roles.<role>.config.write_paths``).

    Raises:
        PermissionError: ``path`` lies elsewhere, is one of those folders itself, is part of
            the run's own state, or is deeper than ``asyncrl.safe_files.MAX_DEPTH`` folders;
            the message names it and what to do.
    """
    depth = len([p for p in path.split(os.sep) if p not in ("", ".")])
    if depth > MAX_DEPTH:
        raise PermissionError(
            f"{role}: refusing to write {path[:60]!r}...: it is {depth} folders deep, over the "
            f"limit of {MAX_DEPTH}; export to a shorter path"
        )
    run = os.path.realpath(run_dir)
    exports = os.path.join(run, EXPORTS_DIR)
    try:
        os.close(_open_exports(run, role))
    except FileNotFoundError as exc:
        raise PermissionError(
            f"{role}: cannot export: the run directory {run_dir} is gone"
        ) from exc
    try:
        real = os.path.realpath(os.path.join(exports, path))
    except OSError as exc:  # a link on the way removed between realpath's lstat and readlink
        raise PermissionError(
            f"{role}: refusing to write {path!r}: a folder on its way changed while it was "
            f"resolved (a link swapped in or out, {exc.strerror}); export again"
        ) from exc
    hint = (
        f"export to a name inside {exports} (a relative path such as 'final' goes there), or "
        f"add a folder to roles.{role}.config.write_paths in the manifest"
    )
    if _inside(run, real) or (_inside(real, run) and not _inside(real, exports)):
        raise PermissionError(
            f"{role}: refusing to write {path!r}: it is the run directory {run_dir!r}, holds "
            f"it, or is part of the run's own state there; {hint}"
        )
    roots = [exports, *(os.path.realpath(p) for p in write_paths)]
    root = next((r for r in roots if _inside(real, r) and real != r), None)
    if root is None:
        raise PermissionError(
            f"{role}: refusing to write {path!r}: it is outside {exports!r} and the configured "
            f"write_paths {list(write_paths)}; {hint}"
        )
    return ExportTarget(role=role, root=root, rel=os.path.relpath(real, root), run_dir=run)


def _open_exports(run: str, role: str) -> int:
    """Open ``RUN_DIR/exports`` (made 0700 when missing) from the run directory, not through
    a link."""
    run_fd = open_dir(run)
    try:
        return open_subdir(run_fd, EXPORTS_DIR, create=True, where=run)
    except UnsafePathError as exc:
        raise PermissionError(
            f"{role}: refusing to export into {os.path.join(run, EXPORTS_DIR)!r}: it is a link "
            f"or not a folder; remove it (the run recreates it)"
        ) from exc
    finally:
        os.close(run_fd)


def export_pretrained(model: Any, target: ExportTarget, tokenizer_path: str = "") -> str:
    """Save ``model`` (``save_pretrained``) and, with ``tokenizer_path``, its tokenizer into
    ``target`` (``writable``), replacing an earlier export there whole. Returns its path.

    The root is opened once, then every folder down to the export's with ``O_NOFOLLOW``
    (``asyncrl.safe_files.open_subdir``; missing ones made 0700); the export is written into a
    fresh private folder in the opened parent (named through ``/proc/self/fd``, so a link
    swapped in anywhere on the path meanwhile changes nothing), then renamed there, so a reader
    never sees half an export.

    Raises:
        PermissionError: a folder on the way is a link or not a folder (swapped in since
            ``writable`` looked), or went away while the export ran, or the target holds
            something other than an earlier export (a file, or a folder without
            ``EXPORT_MARKER``); it is left as it is.
    """
    folder, name = os.path.split(target.rel)
    if target.root == os.path.join(target.run_dir, EXPORTS_DIR):
        root_fd = _open_exports(target.run_dir, target.role)
    else:  # resolved by writable: a link there now was swapped in since
        try:
            root_fd = os.open(target.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            raise PermissionError(
                f"{target.role}: refusing to export into {target.root!r}: it is a link or not "
                f"a folder now ({exc.strerror})"
            ) from exc
    try:
        try:
            parent = open_subdir(root_fd, folder, create=True, where=target.root)
        except UnsafePathError as exc:
            raise PermissionError(f"{target.role}: refusing to export: {exc}") from exc
    finally:
        os.close(root_fd)
    try:
        if not _replaceable(parent, name):
            raise PermissionError(
                f"refusing to export over {target.path!r}: it holds something other than an "
                f"earlier export (no {EXPORT_MARKER} in it); remove it yourself or export to "
                "another name"
            )
        tmp = private_tmpdir_at(parent, name)
        try:
            tmp_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
            try:
                model.save_pretrained(fd_path(tmp_fd))
                if tokenizer_path:
                    from transformers import AutoTokenizer

                    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(fd_path(tmp_fd))
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                os.close(os.open(EXPORT_MARKER, flags, 0o600, dir_fd=tmp_fd))
            finally:
                os.close(tmp_fd)
            replace_dir_at(parent, tmp, name)
        except BaseException:
            with contextlib.suppress(OSError):
                remove_at(parent, tmp)
            raise
    except FileNotFoundError as exc:
        if os.fstat(parent).st_nlink:
            raise
        # The folder opened above was removed, or replaced by a rename, meanwhile: what was
        # written went with it, never anywhere else.
        raise PermissionError(
            f"{target.role}: refusing to export to {target.path!r}: its folder was removed or "
            "replaced while the export ran; export again"
        ) from exc
    finally:
        os.close(parent)
    return target.path


def _replaceable(dir_fd: int, name: str) -> bool:
    """Whether ``name`` in the open folder is missing, an empty folder or an earlier export
    (not a link, not a file)."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    if not stat.S_ISDIR(st.st_mode):
        return False
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        names = os.listdir(fd)
    finally:
        os.close(fd)
    return not names or EXPORT_MARKER in names
