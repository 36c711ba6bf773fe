"""Weights & Biases as a sink of a run's per-step metrics, beside ``metrics.jsonl`` and TensorBoard.

A manifest asks for it in its ``run`` section (``asyncrl.manifest.load.WandbSpec``)::

    run:
      metrics:
        wandb: {project: arith, mode: offline}   # online (the default), offline or disabled

and ``pip install 'asyncrl[wandb]'`` installs it. ``MetricsLog`` then opens one W&B run when it
opens (``open_sink``): named after the run, its directory ``RUN_DIR/wandb/``, the run's
resolved manifest (``RUN_DIR/manifest.json``, which ``asyncrl run`` saves) as its config, and
logs each record's numbers under the TensorBoard tags (``reward/mean``) at the record's step. A
resumed run logs into the same W&B run: its id is kept in ``RUN_DIR/wandb/run_id``. W&B's own
console capture is off (the run's output stays where ``asyncrl.observe.logs`` sends it), and
so are its banners.

A W&B run that cannot start (no API key for ``online``, no network) is a warning on the
console, and the run goes on with its other sinks. ``mode: offline`` writes the W&B run to disk
only (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later); ``disabled`` writes nothing.
The manifest's check at load refuses ``online`` and ``offline`` when the package is not
installed, so a run never finds out late.
"""

from __future__ import annotations

import json
import os
import secrets
from typing import Any, Literal

__all__ = ["RUN_ID_FILE", "WANDB_DIR", "WandbSink", "open_sink", "wandb_settings"]

WANDB_DIR = "wandb"
"""Where W&B writes, in the run directory."""
RUN_ID_FILE = "run_id"
"""The W&B run's id, in ``RUN_DIR/wandb/``: a resumed run logs into the same W&B run."""
_MANIFEST_FILE = (
    "manifest.json"  # asyncrl.supervision.rundir.MANIFEST_FILE (observe imports no part)
)


def wandb_settings(run_dir: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The ``run.metrics.wandb`` section of the manifest saved in ``run_dir``, and the whole
    manifest; None when the file is missing or asks for no W&B run (``mode: disabled``
    included)."""
    try:
        with open(os.path.join(run_dir, _MANIFEST_FILE)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    section = ((manifest.get("run") or {}).get("metrics") or {}).get("wandb")
    if not isinstance(section, dict) or section.get("mode") == "disabled":
        return None
    return section, manifest


class WandbSink:
    """One W&B run that takes a run's per-step numbers.

    Args:
        run_dir: the run directory; W&B writes into ``RUN_DIR/wandb/``.
        project: the W&B project.
        mode: ``online`` or ``offline``.
        config: the run's manifest, the W&B run's config.
        name: the W&B run's display name (the manifest's ``run.name``).

    Raises:
        ImportError: the ``wandb`` package is not installed.
    """

    def __init__(
        self,
        run_dir: str,
        *,
        project: str,
        mode: Literal["online", "offline"],
        config: dict[str, Any],
        name: str,
    ) -> None:
        import wandb

        directory = os.path.join(run_dir, WANDB_DIR)
        os.makedirs(directory, exist_ok=True)
        id_path = os.path.join(directory, RUN_ID_FILE)
        try:
            with open(id_path) as f:
                run_id = f.read().strip()
        except FileNotFoundError:
            run_id = ""
        if not run_id:
            run_id = secrets.token_hex(8)
            with open(id_path, "w") as f:
                f.write(run_id + "\n")
        self.run_id = run_id
        self._run = wandb.init(
            project=project,
            mode=mode,
            dir=run_dir,
            id=run_id,
            name=name,
            resume="allow",
            config=config,
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, numbers: dict[str, float], step: int) -> None:
        """Log ``numbers`` (tag to value) at ``step``."""
        self._run.log(numbers, step=step)

    def close(self) -> None:
        """Finish the W&B run and wait for W&B's service process to write all of it
        (``finish`` alone returns before an offline run's file is complete)."""
        import wandb

        self._run.finish()
        wandb.teardown()


def open_sink(run_dir: str) -> WandbSink | None:
    """The W&B run the manifest saved in ``run_dir`` asks for (``run.metrics.wandb``), or None.

    Raises:
        ImportError: it asks for one and ``wandb`` is not installed (the manifest's check at
            load says so first, with how to install it).
    """
    found = wandb_settings(run_dir)
    if found is None:
        return None
    section, manifest = found
    return WandbSink(
        run_dir,
        project=str(section["project"]),
        mode="offline" if section.get("mode") == "offline" else "online",
        config=manifest,
        name=str((manifest.get("run") or {}).get("name") or os.path.basename(run_dir)),
    )
