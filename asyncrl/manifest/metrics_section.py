"""The manifest's ``run.metrics`` section: where a run's per-step metrics go besides
``RUN_DIR/metrics.jsonl`` (and TensorBoard, when it is installed).

    run:
      metrics:
        wandb: {project: arith, mode: offline}

``wandb`` asks for a Weights & Biases run (``asyncrl.observe.wandb_sink``): ``project`` names
its project, ``mode`` is ``online`` (the default: uploaded as it runs), ``offline`` (written
under ``RUN_DIR/wandb/`` only, for ``wandb sync`` later) or ``disabled`` (nothing). The check at
load refuses ``online`` and ``offline`` when the ``wandb`` package is not installed here, with
how to install it.
"""

from __future__ import annotations

import importlib.util
from typing import Annotated, Any, Literal

import msgspec

from asyncrl.manifest._schema import at, join

__all__ = ["WANDB_INSTALL", "MetricsSpec", "WandbSpec", "check_wandb"]

WANDB_INSTALL = "pip install 'asyncrl[wandb]'"
"""What installs the W&B client."""


class WandbSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A Weights & Biases run of the metrics (the manifest's ``run.metrics.wandb``).

    Attributes:
        project: the W&B project the run logs to.
        mode: ``online`` (uploaded as it runs), ``offline`` (written to ``RUN_DIR/wandb/``
            only) or ``disabled`` (no W&B run).
    """

    project: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    mode: Literal["online", "offline", "disabled"] = "online"


class MetricsSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Where per-step metrics go besides ``metrics.jsonl`` (the manifest's ``run.metrics``).

    Attributes:
        wandb: a Weights & Biases run of them; none when not given.
    """

    wandb: WandbSpec | None = None


def check_wandb(value: dict[Any, Any], path: str, problems: list[str]) -> None:
    """A W&B run that writes (``online``, ``offline``) needs the ``wandb`` package here."""
    if value.get("mode", "online") == "disabled":
        return
    if importlib.util.find_spec("wandb") is None:
        problems.append(
            f"{at(join(path, 'mode'))}: mode {value.get('mode', 'online')} needs the wandb "
            f"package, which is not installed; install it with: {WANDB_INSTALL} (or set mode: "
            "disabled)"
        )
