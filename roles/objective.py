"""The learner's objective: the advantages of a batch, and the loss of a micro-batch from the
policy's log-probs and logits.

Nothing here runs a model: the learner does the forward pass and hands the results over, so
each term (policy loss under the batch's off-policy correction, KL, entropy) is a function of
tensors and the learner's config.

The corrections (``TrainBatch.correction``), with ``pi`` the policy being trained, ``mu`` the
behaviour policy that sampled the tokens (``Sample.logprobs``) and ``prox`` the proximal policy
(the learner's weights at the start of the batch):

- ``clip``: PPO's clipped surrogate of ``pi / mu``.
- ``decoupled`` (Hilton et al. 2022; AReaL): PPO's clipped surrogate of ``pi / prox``, each token
  weighted by ``prox / mu``, truncated at ``importance_cap``.
- ``tis``: a policy gradient weighted by ``min(pi / mu, importance_cap)``, detached.

``importance: sequence`` (GSPO) clips a sequence-level ratio instead of each token's, in
``clip`` and ``decoupled``; the ``decoupled`` weight and ``tis`` stay per token.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.roles import algorithms as alg
from asyncrl.roles.batching import aligned, batch_moments, gae_targets
from asyncrl.roles.learner_config import LearnerConfig
from asyncrl.roles.payloads import Scored, TrainBatch

__all__ = ["batch_advantages", "bc_coef", "micro_batch_loss", "policy_loss"]


def batch_advantages(cfg: LearnerConfig, algorithm: str, samples: list[Scored]) -> list[Any]:
    """One advantage per sample (GRPO, RLOO), one per completion token (PPO), or None (BC).

    GRPO uses the advantages the pipeline gave when every sample has one; RLOO always computes
    its own over the batch's groups (samples of one prompt id). With ``whiten_advantages`` they
    are whitened over the whole batch (its samples, or PPO's completion tokens).
    """
    if algorithm == "bc":
        return [None] * len(samples)
    if algorithm == "grpo" and all(s.advantage is not None for s in samples):
        given = [float(s.advantage) for s in samples if s.advantage is not None]
        return _whiten(cfg, given)
    if algorithm in ("grpo", "rloo"):
        groups: dict[str, int] = {}
        ids = torch.tensor([groups.setdefault(s.sample.prompt_id, len(groups)) for s in samples])
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        if algorithm == "rloo":
            adv = alg.rloo_advantages(rewards, ids)
        else:
            adv = alg.grpo_advantages(rewards, ids, normalize_std=cfg.normalize_std, std=cfg.std)
        return _whiten(cfg, [float(a) for a in adv])
    # PPO: GAE over the critic's values, whitened over every completion token of the batch.
    adv, _, mask = gae_targets(
        samples,
        gamma=cfg.gamma,
        lam=cfg.lam,
        kl_coef=cfg.kl_coef,
        kl_estimator=cfg.kl_estimator,
        kl_mode=cfg.kl_mode,
    )
    width = mask.shape[1]
    rows = [adv[i, width - len(s.sample.token_ids) :].tolist() for i, s in enumerate(samples)]
    flat = _whiten(cfg, [a for row in rows for a in row])
    out, start = [], 0
    for row in rows:
        out.append(flat[start : start + len(row)])
        start += len(row)
    return out


def _whiten(cfg: LearnerConfig, advantages: list[float]) -> list[float]:
    """Whiten over the batch being consumed (in sync and async mode alike); across
    data-parallel ranks, from every rank's merged moments."""
    if not cfg.whiten_advantages or not advantages:
        return advantages
    moments = batch_moments(advantages)
    return [(a - moments.mean) / (moments.std + 1e-8) for a in advantages]


def _aggregate(cfg: LearnerConfig, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return alg.aggregate(values, mask, cfg.aggregation, cfg.norm_len)


def micro_batch_loss(
    cfg: LearnerConfig,
    algorithm: str,
    batch: TrainBatch,
    samples: list[Scored],
    advantages: list[Any],
    proximal: list[list[float]] | None,
    forward: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's loss, aggregated over its own tokens (the caller weighs it), and its
    parts as floats.

    ``forward``: the policy's ``(logprobs, target, logits)`` on ``samples`` (``[B, T]``, ``[B,
    T]``, ``[B, T, V]``). ``proximal``: decoupled PPO's proximal log-probs of each sample's
    completion; None: the current policy's (detached), right for a batch that takes one
    optimizer step.
    """
    logprobs, target, logits = forward
    if algorithm == "bc":
        loss = -_aggregate(cfg, logprobs, target)
        return loss, {"nll": float(loss.detach())}
    behaviour = aligned([s.sample.logprobs for s in samples], target)
    if algorithm in ("grpo", "rloo"):
        adv = torch.tensor(advantages, dtype=torch.float32)[:, None].expand_as(target) * target
    else:
        adv = aligned(advantages, target)
    prox = logprobs.detach() if proximal is None else aligned(proximal, target)
    loss, stats = policy_loss(cfg, batch, logprobs, behaviour, prox, adv, target)
    parts = {"policy_loss": float(loss.detach()), **{k: float(v) for k, v in stats.items()}}
    # An empty completion needs no reference log-probs.
    if (
        cfg.kl_coef
        and cfg.kl_mode == "loss"
        and all(s.ref_logprobs or not s.sample.token_ids for s in samples)
    ):
        ref = aligned([s.ref_logprobs for s in samples], target)
        kl = _aggregate(cfg, alg.kl_estimator(logprobs, ref, cfg.kl_estimator), target)
        loss = loss + cfg.kl_coef * kl
        parts["kl"] = float(kl.detach())
    if cfg.entropy_coef:
        entropy = _aggregate(cfg, alg.entropy_from_logits(logits), target)
        loss = loss - cfg.entropy_coef * entropy
        parts["entropy"] = float(entropy.detach())
    return loss, parts


def policy_loss(
    cfg: LearnerConfig,
    batch: TrainBatch,
    logprobs: torch.Tensor,
    behaviour: torch.Tensor,
    proximal: torch.Tensor,
    adv: torch.Tensor,
    target: torch.Tensor,
) -> tuple[torch.Tensor, alg.Stats]:
    """The policy loss under ``batch.correction`` (see the module docstring), all tensors
    ``[B, T]``; ``proximal`` is read by ``decoupled`` only."""
    if batch.correction == "decoupled":
        return alg.decoupled_ppo_policy_loss(
            logprobs,
            proximal,
            behaviour,
            adv,
            target,
            cfg.clip_eps,
            cfg.dual_clip,
            cfg.aggregation,
            importance_cap=batch.importance_cap,
            clip_eps_high=cfg.clip_eps_high,
            norm_len=cfg.norm_len,
            importance=cfg.importance,
        )
    if batch.correction == "tis":
        weight = alg.truncated_importance_weights(
            logprobs, behaviour, batch.importance_cap, mask=target
        )
        loss = _aggregate(cfg, -(weight * adv * logprobs), target)
        return loss, {"importance_weight_mean": alg.masked_mean(weight, target)}
    return alg.ppo_policy_loss(
        logprobs,
        behaviour,
        adv,
        target,
        cfg.clip_eps,
        cfg.dual_clip,
        cfg.aggregation,
        clip_eps_high=cfg.clip_eps_high,
        norm_len=cfg.norm_len,
        importance=cfg.importance,
    )


def bc_coef(cfg: LearnerConfig, step: int) -> float:
    """The BC term's weight after ``step`` batches: ``bc_coef``, decayed linearly to 0 over
    ``bc_anneal_steps`` when that is set."""
    coef = float(cfg.bc_coef)
    if not coef or not cfg.bc_anneal_steps:
        return coef
    return coef * max(0.0, 1.0 - step / int(cfg.bc_anneal_steps))
