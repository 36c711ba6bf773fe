"""The critic role: a value model giving per-token values, trained towards GAE returns (PPO).

The model is a transformer with a one-output token-classification head
(``AutoModelForTokenClassification``, ``num_labels=1``), built from a config or loaded from a
path. ``values`` returns, for each completion token, the value of the state just before it:
the head's output at the position that predicts that token, so it lines up with the policy's
log-probs token for token.

``train_step`` computes the returns from each sample's reward (on its last token) and the values
recorded when the sample was scored (``Scored.values``), with the same GAE as the learner, and
takes one clipped value-loss step.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch

from asyncrl.role import Delivery, Role, endpoint
from asyncrl.roles import algorithms as alg
from asyncrl.roles.learner import Scored, pad_batch
from asyncrl.roles.rollout import Sample

__all__ = ["Critic"]


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
        clip_eps: float | None = 0.2
        aggregation: str = "token_mean"
        pad_id: int = 0

    async def setup(self) -> None:
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

    def _train_step(self, batch: list[Scored]) -> dict[str, float]:
        cfg = self.config
        values, mask = self._values([s.sample for s in batch])
        width = mask.shape[1]
        old = torch.zeros_like(mask)
        rewards = torch.zeros_like(mask)
        for i, s in enumerate(batch):
            n = len(s.sample.token_ids)
            if n:
                rewards[i, width - 1] = s.reward
                if s.values:
                    old[i, width - n :] = torch.tensor(s.values)
        _, returns = alg.gae(rewards, old, mask, cfg.gamma, cfg.lam)
        loss, stats = alg.value_loss(values, old, returns, mask, cfg.clip_eps, cfg.aggregation)
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
