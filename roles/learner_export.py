"""The learner's ``export``: the trained model as a Hugging Face directory, written only where
the run may write (its run directory, or a configured ``write_paths`` entry)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from typing import Any

__all__ = ["export_pretrained", "writable"]


def writable(path: str, role: str, run_dir: str, write_paths: Sequence[str]) -> str:
    """``path``, resolved, if it lies inside ``run_dir`` or one of ``write_paths``.

    Args:
        path: where the caller asks to write.
        role: the role's name, for the error and the manifest key it names.
        run_dir: the run directory.
        write_paths: further folders the manifest allows (``roles.<role>.config.write_paths``).

    Raises:
        PermissionError: it lies elsewhere, or is one of those folders itself.
    """
    real = os.path.realpath(path)
    for root in [run_dir, *write_paths]:
        base = os.path.realpath(root)
        if real == base or real.startswith(base + os.sep):
            if real == base:
                break  # never replace a root itself
            return real
    raise PermissionError(
        f"{role}: refusing to write {path!r}: it is outside the run directory "
        f"{run_dir!r} and the configured write_paths {list(write_paths)}; "
        f"write inside the run directory, or add its parent to roles.{role}"
        f".config.write_paths in the manifest"
    )


def export_pretrained(model: Any, path: str, tokenizer_path: str = "") -> str:
    """Save ``model`` (``save_pretrained``) and, with ``tokenizer_path``, its tokenizer into
    the directory ``path``, replacing it whole: written beside it first, then renamed, so a
    reader never sees half an export. Returns ``path``."""
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if tokenizer_path:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path
