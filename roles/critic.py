"""The critic role: a value model giving per-token values, trained towards GAE returns (PPO).

The model is a transformer with a one-output token-classification head
(``AutoModelForTokenClassification``, ``num_labels=1``), built from a config or loaded from a
path. ``values`` returns, for each completion token, the value of the state just before it:
the head's output at the position that predicts that token, so it lines up with the policy's
log-probs token for token.

``train_step`` computes the returns from each sample's reward (on its last token) and the values
recorded when the sample was scored (``Scored.values``), with the learner's own function
(``asyncrl.roles.learner.gae_targets``), and takes one clipped value-loss step. The returns must be
the ones the learner's advantages came from, so the settings that shape them (``gamma``, ``lam``,
and with ``kl_mode: reward`` the per-token penalty ``-kl_coef * KL`` with ``kl_estimator``) mirror
the learner's config; ``check_matches_learner`` says where two configs disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec
import torch

from asyncrl.role import Delivery, Role, endpoint
from asyncrl.roles import algorithms as alg
from asyncrl.roles.learner import Scored, check_norm_len, gae_targets, pad_batch
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


class Critic(Role):
    """Serves per-token values and learns them."""

    class Config(msgspec.Struct, forbid_unknown_fields=True):
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
        pad_id: int = 0

        def __post_init__(self) -> None:
            check_norm_len(self.aggregation, self.norm_len)

    async def setup(self) -> None:
        # In the worker thread: importing transformers and building the model take seconds,
        # and the loop must keep answering heartbeats meanwhile.
        await self.ctx.offload(self._build)

    def _build(self) -> None:
        from transformers import AutoConfig, AutoModelForTokenClassification

        cfg = self.config
        auto: Any = AutoModelForTokenClassification  # its class methods are untyped
        if cfg.model_path:
            self.model = auto.from_pretrained(cfg.model_path, num_labels=1)
        elif cfg.model_config:
            torch.manual_seed(cfg.seed)
            self.model = auto.from_config(AutoConfig.for_model(**cfg.model_config, num_labels=1))
        else:
            raise ValueError("critic: set model_path or model_config")
        self.model.train(False)  # no dropout: values must not depend on the call
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        self.step = 0

    def _values(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, attention, positions, target = pad_batch(
            [s.prompt_ids for s in samples], [s.token_ids for s in samples], self.config.pad_id
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

        return await self.ctx.offload(compute)

    @endpoint(Delivery.ONCE)
    async def train_step(self, batch: list[Scored]) -> dict[str, float]:
        return await self.ctx.offload(self._train_step, batch)

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

    def _train_step(self, batch: list[Scored]) -> dict[str, float]:
        cfg = self.config
        values, mask = self._values([s.sample for s in batch])
        old, returns = self._targets(batch)
        # The targets cover the completions only; the values' columns end where they end.
        values = values[:, mask.shape[1] - returns.shape[1] :]
        mask = mask[:, mask.shape[1] - returns.shape[1] :]
        loss, stats = alg.value_loss(
            values, old, returns, mask, cfg.clip_eps, cfg.aggregation, norm_len=cfg.norm_len
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.step += 1
        return {
            "value_loss": float(loss.detach()),
            "grad_norm": float(grad_norm),
            **{k: float(v) for k, v in stats.items()},
        }
