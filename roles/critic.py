"""The critic role: a value model giving per-token values, trained towards GAE returns (PPO).

The model is a transformer with a one-output token-classification head
(``AutoModelForTokenClassification``, ``num_labels=1``), built from a config or loaded from a
path. ``values`` returns, for each completion token, the value of the state just before it:
the head's output at the position that predicts that token, so it lines up with the policy's
log-probs token for token.

``train_step`` computes the returns from each sample's reward (on its last token) and the values
recorded when the sample was scored (``Scored.values``), with the learner's own function
(``asyncrl.roles.batching.gae_targets``), once for the whole batch, and then takes
``ppo_epochs x mini_batches`` clipped value-loss steps, as the learner does with its policy
(verl's critic the same): each epoch shuffles the samples into ``mini_batches`` mini-batches
(seeded by ``seed``, the critic's step and the epoch) and each mini-batch makes one AdamW step.
The targets and the old values that the value clip is taken around stay those of the batch
across every step. The defaults (one epoch, one mini-batch) take one step per batch. It replies
with a ``CriticStepResult``: the step count, the optimizer steps taken and the loss figures
averaged over them (a fixed set, so typed fields rather than the learner's open metrics dict).

The returns must be the ones the learner's advantages came from, so the settings that shape
them (``gamma``, ``lam``, and with ``kl_mode: reward`` the per-token penalty ``-kl_coef * KL``
with ``kl_estimator``) mirror the learner's config; ``check_matches_learner`` says where two
configs disagree. The epochs and mini-batches need not match the learner's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

import msgspec
import torch

from asyncrl.plugins.registry import current as current_plugin
from asyncrl.plugins.registry import device_for, dtype_for
from asyncrl.role import Delivery, Role, endpoint
from asyncrl.roles import algorithms as alg
from asyncrl.roles.batching import (
    check_norm_len,
    gae_targets,
    mean_over_steps,
    mini_batch_indices,
    pad_batch,
)
from asyncrl.roles.device_report import DeviceShare
from asyncrl.roles.payloads import CriticStepResult, Scored
from asyncrl.roles.rollout import Sample

__all__ = ["RETURN_SETTINGS", "Critic", "check_matches_learner"]

RETURN_SETTINGS = ("gamma", "lam", "kl_mode", "kl_coef", "kl_estimator")
"""The config keys, shared by learner and critic, that shape PPO's returns."""

_DEFAULTS = {"gamma": 1.0, "lam": 0.95, "kl_mode": "loss", "kl_coef": 0.0, "kl_estimator": "k3"}


def check_matches_learner(learner: Mapping[str, Any], critic: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming every return setting on which a learner's and a critic's
    config mappings (as in the manifest, defaults filled in) disagree. The KL settings matter
    only with ``kl_mode: reward`` and a non-zero ``kl_coef`` on either side."""

    def effective(config: Mapping[str, Any]) -> dict[str, Any]:
        values = {key: config.get(key, default) for key, default in _DEFAULTS.items()}
        if values["kl_mode"] != "reward" or not values["kl_coef"]:
            values.update(kl_mode="reward", kl_coef=0.0, kl_estimator="-")
        return values

    mine, theirs = effective(critic), effective(learner)
    wrong = [
        f"{key}: learner {theirs[key]!r}, critic {mine[key]!r}"
        for key in RETURN_SETTINGS
        if mine[key] != theirs[key]
    ]
    if wrong:
        raise ValueError(
            "the critic's return targets would differ from the returns the learner's "
            "advantages come from; set the same values in both configs: " + "; ".join(wrong)
        )


T = TypeVar("T")


class Critic(Role):
    """Serves per-token values and learns them."""

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        """The critic's settings (``roles.<name>.config`` in the manifest).

        Attributes:
            model_path: a local Hugging Face model directory; empty: build from model_config.
            model_config: ``AutoConfig.for_model`` keywords for a model built from scratch.
            seed: seeds the model's initialisation and the mini-batch shuffle.
            lr: AdamW's learning rate.
            grad_clip: the gradient's maximum norm, at every optimizer step.
            gamma, lam, kl_coef, kl_estimator, kl_mode: the return settings; they must be the
                learner's (``check_matches_learner``).
            clip_eps: the value clip around the values recorded at scoring (None: no clip).
            aggregation, norm_len: how per-token losses become one number, as the learner's.
            ppo_epochs: passes over each batch (>= 1).
            mini_batches: optimizer steps per pass (>= 1, at most the batch's samples).
            pad_id: the token id of padding.
            dtype: the value model's dtype: empty: the hardware plugin's (``float32`` on
                cpu, ``bfloat16`` on cuda); or ``float32``, ``bfloat16``, ``float16``,
                ``float64``. Values and their loss are computed in float32 whatever it is.
        """

        model_path: str = ""
        model_config: dict[str, Any] = {}
        seed: int = 0
        lr: float = 1e-3
        grad_clip: float = 1.0
        gamma: float = 1.0
        lam: float = 0.95
        kl_coef: float = 0.0
        kl_estimator: Literal["k1", "k2", "k3"] = "k3"
        kl_mode: Literal["loss", "reward"] = "loss"
        clip_eps: float | None = 0.2
        aggregation: alg.Aggregation = "token_mean"
        norm_len: float | None = None
        ppo_epochs: int = 1
        mini_batches: int = 1
        pad_id: int = 0
        dtype: Literal["", "float32", "float64", "bfloat16", "float16"] = ""

        def __post_init__(self) -> None:
            check_norm_len(self.aggregation, self.norm_len)
            for name in ("ppo_epochs", "mini_batches"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)!r}")

    share: DeviceShare | None = None

    async def setup(self) -> None:
        # In the worker thread: importing transformers and building the model take seconds,
        # and the loop must keep answering heartbeats meanwhile.
        await self.ctx.offload(self._build)

    def _build(self) -> None:
        from transformers import AutoConfig, AutoModelForTokenClassification

        cfg = self.config
        # Device, dtype and RNG seeding come from the hardware plugin registry.
        plugin = current_plugin()
        self.device = device_for(self.ctx.device, plugin)
        # Before the model lands on a device it may share: the placement's memory share.
        self.share = DeviceShare.for_role(self.ctx, self.device, plugin)
        auto: Any = AutoModelForTokenClassification  # its class methods are untyped
        if cfg.model_path:
            model = auto.from_pretrained(cfg.model_path, num_labels=1)
        elif cfg.model_config:
            plugin.device.manual_seed(cfg.seed)
            model = auto.from_config(AutoConfig.for_model(**cfg.model_config, num_labels=1))
        else:
            raise ValueError("critic: set model_path or model_config")
        dtype = dtype_for(cfg.dtype, self.device, plugin)
        self.model = model.to(device=self.device, dtype=dtype)
        self.model.train(False)  # no dropout: values must not depend on the call
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        self.step = 0

    def _values(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, attention, positions, target = (
            t.to(self.device)
            for t in pad_batch(
                [s.prompt_ids for s in samples], [s.token_ids for s in samples], self.config.pad_id
            )
        )
        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions)
        return out.logits[:, :-1, 0].float(), target

    @endpoint(Delivery.IDEMPOTENT)
    async def values(self, samples: list[Sample]) -> list[list[float]]:
        def compute() -> list[list[float]]:
            with torch.no_grad():
                values, _ = self._values(samples)
            width = values.shape[1]
            return [
                values[i, width - len(s.token_ids) :].tolist() if s.token_ids else []
                for i, s in enumerate(samples)
            ]

        return await self.ctx.offload(self._working(compute))

    @endpoint(Delivery.ONCE)
    async def train_step(self, batch: list[Scored]) -> CriticStepResult:
        return await self.ctx.offload(self._working(self._train_step), batch)

    def _working(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn`` as a unit of work of the device share (released after, when idle)."""
        return fn if self.share is None else self.share.working(fn)

    def status(self) -> dict[str, Any]:
        """The device's memory and this replica's share of it, for ``asyncrl status``."""
        return {} if self.share is None else self.share.status()

    def _targets(self, batch: list[Scored]) -> tuple[torch.Tensor, torch.Tensor]:
        """The old values and the return targets, [B, T] right-aligned (T: the longest
        completion), the same returns the learner's advantages come from."""
        cfg = self.config
        _, returns, mask = gae_targets(
            batch,
            gamma=cfg.gamma,
            lam=cfg.lam,
            kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator,
            kl_mode=cfg.kl_mode,
        )
        old = torch.zeros_like(mask)
        for i, s in enumerate(batch):
            if s.values:
                old[i, mask.shape[1] - len(s.values) :] = torch.tensor(s.values)
        return old, returns

    def _train_step(self, batch: list[Scored]) -> CriticStepResult:
        """``ppo_epochs x mini_batches`` value-loss steps on the batch; the metrics averaged
        over the steps, and their count.

        Raises:
            ValueError: the batch holds fewer samples than ``mini_batches``.
        """
        cfg = self.config
        if len(batch) < cfg.mini_batches:
            raise ValueError(
                f"{self.ctx.name}: a batch of {len(batch)} samples cannot be split into "
                f"mini_batches={cfg.mini_batches}; send batches of at least {cfg.mini_batches} "
                f"samples or lower roles.{self.ctx.name}.config.mini_batches"
            )
        old, returns = self._targets(batch)
        steps = []
        for epoch in range(cfg.ppo_epochs):
            split = mini_batch_indices(
                len(batch), cfg.mini_batches, seed=cfg.seed, step=self.step, epoch=epoch
            )
            for part in split:
                steps.append(
                    self._optimizer_step([batch[i] for i in part], old[part], returns[part])
                )
        self.step += 1
        means = mean_over_steps(steps)
        return CriticStepResult(
            step=self.step,
            optimizer_steps=len(steps),
            value_loss=means["value_loss"],
            value_clip_fraction=means["value_clip_fraction"],
            grad_norm=means["grad_norm"],
        )

    def _optimizer_step(
        self, samples: list[Scored], old: torch.Tensor, returns: torch.Tensor
    ) -> dict[str, float]:
        """One clipped value-loss step on a mini-batch; ``old`` and ``returns`` are its rows of
        the batch's [B, T] right-aligned targets."""
        cfg = self.config
        values, mask = self._values([s.sample for s in samples])
        # The targets' columns end where the completions end; the mini-batch's longest
        # completion may be shorter than the batch's.
        width = max(len(s.sample.token_ids) for s in samples)
        old, returns = old[:, old.shape[1] - width :], returns[:, returns.shape[1] - width :]
        old, returns = old.to(values.device), returns.to(values.device)
        values = values[:, mask.shape[1] - width :]
        mask = mask[:, mask.shape[1] - width :]
        loss, stats = alg.value_loss(
            values, old, returns, mask, cfg.clip_eps, cfg.aggregation, norm_len=cfg.norm_len
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        return {
            "value_loss": float(loss.detach()),
            "grad_norm": float(grad_norm),
            **{k: float(v) for k, v in stats.items()},
        }
