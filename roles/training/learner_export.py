"""The learner's ``export``: the trained model as a Hugging Face directory, written only into
the run's ``exports/`` folder or a ``write_paths`` folder the manifest allows, never over the
run's own state (its roles, ledger, sockets, logs, weights, checkpoints) and never through a
link."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from typing import Any

from asyncrl.safe_files import private_tmpdir, replace_dir

__all__ = ["EXPORTS_DIR", "EXPORT_MARKER", "export_pretrained", "writable"]

EXPORTS_DIR = "exports"
"""The folder of the run directory that ``export`` writes into; a relative path names a folder
in it (``export("final")`` writes ``RUN_DIR/exports/final``)."""
EXPORT_MARKER = ".asyncrl-export"
"""An empty file in every export, so that a later export replaces only an earlier export."""


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def writable(path: str, role: str, run_dir: str, write_paths: Sequence[str]) -> str:
    """Where ``export`` may write ``path``: resolved (links followed), strictly inside
    ``RUN_DIR/exports`` or one of ``write_paths``, and neither inside the rest of the run
    directory nor holding it. A relative ``path`` is taken inside ``RUN_DIR/exports``, which is
    created (0700) when missing.

    Args:
        path: where the caller asks to write.
        role: the role's name, for the error and the manifest key it names.
        run_dir: the run directory.
        write_paths: further folders the manifest allows (``roles.<role>.config.write_paths``).

    Raises:
        PermissionError: ``path`` lies elsewhere, is one of those folders itself, or is part of
            the run's own state; the message names it and what to do.
    """
    run = os.path.realpath(run_dir)
    exports = os.path.join(run, EXPORTS_DIR)
    if os.path.islink(exports) or (os.path.lexists(exports) and not os.path.isdir(exports)):
        raise PermissionError(
            f"{role}: refusing to export into {exports!r}: it is a link or not a folder; "
            f"remove it (the run recreates it)"
        )
    os.makedirs(exports, mode=0o700, exist_ok=True)
    real = os.path.realpath(os.path.join(exports, path))
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
    if not any(_inside(real, root) and real != root for root in roots):
        raise PermissionError(
            f"{role}: refusing to write {path!r}: it is outside {exports!r} and the configured "
            f"write_paths {list(write_paths)}; {hint}"
        )
    return real


def export_pretrained(model: Any, path: str, tokenizer_path: str = "") -> str:
    """Save ``model`` (``save_pretrained``) and, with ``tokenizer_path``, its tokenizer into
    the directory ``path``, replacing an earlier export there whole: written into a fresh
    private folder beside it (never a predictable ``.tmp`` name), then renamed, so a reader
    never sees half an export. Returns ``path``.

    Raises:
        PermissionError: ``path`` holds something other than an earlier export (a file, or a
            folder without ``EXPORT_MARKER``); it is left as it is.
    """
    if os.path.lexists(path) and not _replaceable(path):
        raise PermissionError(
            f"refusing to export over {path!r}: it holds something other than an earlier "
            f"export (no {EXPORT_MARKER} in it); remove it yourself or export to another name"
        )
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = private_tmpdir(path)
    try:
        model.save_pretrained(tmp)
        if tokenizer_path:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(tmp)
        with open(os.path.join(tmp, EXPORT_MARKER), "wb"):
            pass
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _replaceable(path: str) -> bool:
    """Whether ``path`` is an empty folder or an earlier export (not a link, not a file)."""
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return not names or EXPORT_MARKER in names
