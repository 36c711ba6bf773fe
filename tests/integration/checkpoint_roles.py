"""A role for ``test_transfer_faults.py``: the reference (``asyncrl.roles.services.reference``),
whose write of the weights it is given holds halfway once, until a gate file appears.

``HeldReference._save`` writes version ``hold_version`` as the reference does (a temporary file
of the same name, renamed over ``weights.pt`` once written and fsynced), but stops with half of
its bytes on disk, writes the file ``held`` and waits for the file ``gate``: a node lost then
leaves a torn temporary file beside the last whole ``weights.pt``. Every other write is the
reference's own.
"""

from __future__ import annotations

import io
import os
import time

import msgspec
import torch

from asyncrl.roles.services.reference import WEIGHTS_FILE, Reference
from asyncrl.roles.training.checkpoints import fsync_dir
from asyncrl.safe_files import atomic_file, write_atomic

__all__ = ["HeldReference"]

_GATE_WAIT_S = 300.0  # a gate never opened ends the hold rather than keep it for ever


class HeldReference(Reference):
    """The reference, with its write of ``hold_version`` held halfway (once per gate)."""

    class Config(Reference.Config, forbid_unknown_fields=True):
        hold_version: int = -1
        held: str = ""
        gate: str = ""

    def _save(self, state: dict[str, torch.Tensor], version: int) -> None:
        cfg = self.config
        if version != cfg.hold_version or os.path.exists(cfg.gate):
            super()._save(state, version)
            return
        data = io.BytesIO()
        torch.save({"version": version, "state": state}, data)
        raw = data.getvalue()
        final = self.ctx.path(WEIGHTS_FILE)
        with atomic_file(final, fsync=True) as f:
            f.write(raw[: len(raw) // 2])
            f.flush()
            os.fsync(f.fileno())
            write_atomic(cfg.held, msgspec.json.encode({"pid": os.getpid(), "path": final}))
            deadline = time.monotonic() + _GATE_WAIT_S
            while not os.path.exists(cfg.gate) and time.monotonic() < deadline:
                time.sleep(0.02)
            f.write(raw[len(raw) // 2 :])
        fsync_dir(os.path.dirname(final))
