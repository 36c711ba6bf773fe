"""The reference role: log-probs of samples under a frozen reference policy, for the KL term.

The reference is usually the policy RL starts from (after behaviour cloning): load it from a
path, or build it from a config and send it the starting weights once with ``set_weights``. It
scores with the rollout engine's own ``score``, so its log-probs follow the same conventions (left
padding, positions from the attention mask) as the behaviour log-probs and the learner's.

**Durable.** ``set_weights`` writes the weights it was given, with their version, to the role's
own directory (``RUN_DIR/roles/<name>.<replica>/weights.pt``) before it replies: a temporary
file, fsynced, renamed into place, then the directory fsynced, so a crash mid-write leaves the
previous file whole. ``setup`` loads that file when it exists, over the configured weights, and
logs its version, so a restarted reference scores with what it was last given rather than its
initial weights. The file holds plain tensors and an int (``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import os
from typing import Any, Literal

import msgspec
import torch

from asyncrl.plugins.registry import device_for, dtype_for
from asyncrl.role import Delivery, Role, endpoint
from asyncrl.roles.device_report import DeviceShare
from asyncrl.roles.generation.engine import HFEngine
from asyncrl.roles.generation.rollout import Sample, WeightsUpdate
from asyncrl.roles.training.checkpoints import fsync_dir
from asyncrl.safe_files import atomic_file

__all__ = ["WEIGHTS_FILE", "Reference"]

WEIGHTS_FILE = "weights.pt"
"""The file, in the role's own directory, holding the weights ``set_weights`` was last given."""

_TMP_PREFIX = f".{WEIGHTS_FILE}."
"""The start of a temporary file's name while ``WEIGHTS_FILE`` is written."""


class Reference(Role):
    """Serves reference log-probs of sampled completions; keeps the weights it is sent."""

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        """The reference role's settings (``roles.<name>.config`` in the manifest).

        Attributes:
            model_path: a directory or hub name loaded with ``from_pretrained``: the frozen
                reference policy; set exactly one of ``model_path`` and ``model_config``
                (the manifest's ``model`` section fills one when neither is set).
            model_config: or a transformers config as a mapping (``model_type`` plus fields),
                built with random weights seeded by ``seed``, whose weights then come once
                through ``set_weights`` (the built-in programs send the learner's when RL
                starts); a restarted replica reloads the weights it was last given.
            seed: seeds the random weights of a model built from ``model_config``.
            max_batch: the most sequences one forward pass scores; more run in turns.
            dtype: the reference model's dtype: empty: the hardware plugin's (``float32`` on
                cpu, ``bfloat16`` on cuda); or ``float32``, ``bfloat16``, ``float16``,
                ``float64``.
        """

        model_path: str = ""
        model_config: dict[str, Any] = {}
        seed: int = 0
        max_batch: int = 256
        dtype: Literal["", "float32", "float64", "bfloat16", "float16"] = ""

    share: DeviceShare | None = None
    engine: HFEngine

    async def setup(self) -> None:
        cfg = self.config
        if bool(cfg.model_path) == bool(cfg.model_config):
            raise ValueError("reference: set exactly one of model_path and model_config")
        # The device and dtype come from the hardware plugin registry.
        device = device_for(self.ctx.device)
        # Before the model lands on a device it may share: the placement's memory share.
        self.share = DeviceShare.for_role(self.ctx, device)
        hardware = {"device": device, "dtype": dtype_for(cfg.dtype, device)}
        # In the worker thread: building the model takes seconds, and the loop must keep
        # answering heartbeats meanwhile.
        if cfg.model_path:
            self.engine = await self.ctx.offload(
                HFEngine.from_pretrained, cfg.model_path, max_batch=cfg.max_batch, **hardware
            )
        else:
            self.engine = await self.ctx.offload(
                HFEngine.from_config,
                cfg.model_config,
                seed=cfg.seed,
                max_batch=cfg.max_batch,
                **hardware,
            )
        restored = await self.ctx.offload(self._restore)
        if restored is not None:
            # Logged here, on the loop, where the record carries the replica and incarnation.
            self.ctx.log.info(
                f"{self.ctx.name}[{self.ctx.replica}]: loaded the weights it was last given, "
                f"version {restored}, from {self.ctx.path(WEIGHTS_FILE)}"
            )

    def status(self) -> dict[str, Any]:
        """The device's memory and this replica's share of it, for ``asyncrl status``."""
        return {} if self.share is None else self.share.status()

    @endpoint(Delivery.IDEMPOTENT)
    async def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        score = self.engine.score if self.share is None else self.share.working(self.engine.score)
        return await self.ctx.offload(
            score, [s.prompt_ids for s in samples], [s.token_ids for s in samples]
        )

    @endpoint(Delivery.LATEST)
    async def set_weights(self, update: WeightsUpdate) -> int:
        """Freeze these weights as the reference (sent once, when RL starts) and keep them on
        disk before replying, so a restart reloads them; returns their version.

        Raises:
            ValueError: a tensor name the model does not have, or a shape that differs.
            OSError: the weights could not be written (nothing was replied as kept).
        """
        await self.ctx.offload(self._load, update)
        return self.engine.version

    def _load(self, update: WeightsUpdate) -> None:
        self.engine.set_weights(update.state, update.version)
        version = self.engine.apply_pending()
        # The model's whole state after the update, not the update alone: a partial update
        # then keeps the tensors an earlier one set. Tied tensors are written once.
        self._save(self.engine.model.state_dict(), version)

    def _save(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Write ``state`` and ``version`` to ``WEIGHTS_FILE`` atomically and durably."""
        final = self.ctx.path(WEIGHTS_FILE)
        with atomic_file(final, fsync=True) as f:  # a fresh temporary name, never a planted link
            torch.save({"version": version, "state": state}, f)
        fsync_dir(os.path.dirname(final))

    def _restore(self) -> int | None:
        """Load the weights ``set_weights`` was last given, when a previous incarnation kept
        some, and return their version (None: none kept). A temporary file left by a write
        that died is removed, never loaded."""
        final = self.ctx.path(WEIGHTS_FILE)
        folder = os.path.dirname(final)
        for name in os.listdir(folder):
            if name == WEIGHTS_FILE + ".tmp" or (  # an earlier release's fixed name
                name.startswith(_TMP_PREFIX) and name.endswith(".tmp")
            ):
                os.remove(os.path.join(folder, name))
        if not os.path.exists(final):
            return None
        # weights_only: plain tensors and an int, never pickled objects; on the host, so a file
        # written from one device loads on another (load_state_dict moves and casts).
        kept = torch.load(final, map_location="cpu", weights_only=True)
        self.engine.set_weights(kept["state"], int(kept["version"]))
        return self.engine.apply_pending()
