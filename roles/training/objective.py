"""The learner's objective, composed from pieces its config and the batch choose.

Nothing here runs a model: the learner does the forward pass and hands the results over, so
every piece is a function of tensors and the learner's config. ``objective_for`` builds one
``Objective`` per batch, choosing each piece once, by name, from a registry:

- the algorithm (``ALGORITHMS``, ``TrainBatch.algorithm`` or the config's): how the batch's
  advantages are computed (``advantages``) and laid on its completion tokens, or, for ``bc``,
  no advantages and the negative log-likelihood as the loss;
- the policy loss (``CORRECTIONS``, ``TrainBatch.correction``): one ``PolicyLoss`` per
  off-policy correction;
- the terms added to the loss, as ``(coefficient, Term)`` pieces: the KL to the reference
  (``kl_coef``, with ``kl_mode: loss``) and the entropy (coefficient ``-entropy_coef``).

The corrections, with ``pi`` the policy being trained, ``mu`` the behaviour policy that sampled
the tokens (``Sample.logprobs``) and ``prox`` the proximal policy (the learner's weights at the
start of the batch):

- ``clip``: PPO's clipped surrogate of ``pi / mu``.
- ``decoupled`` (Hilton et al. 2022; AReaL): PPO's clipped surrogate of ``pi / prox``, each token
  weighted by ``prox / mu``, truncated at ``importance_cap``.
- ``tis``: a policy gradient weighted by ``min(pi / mu, importance_cap)``, detached.

``importance: sequence`` (GSPO) clips a sequence-level ratio instead of each token's, in
``clip`` and ``decoupled``, in GSPO-token's form: each token's gradient keeps its own advantage
(PPO's GAE) and its own ``decoupled`` weight; ``tis`` stays per token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Protocol

import torch

from asyncrl.roles.learning import algorithms as alg
from asyncrl.roles.learning.batching import aligned, batch_moments, gae_targets
from asyncrl.roles.learning.groups import grouped_advantages
from asyncrl.roles.payloads import Scored, TrainBatch
from asyncrl.roles.training.learner_config import LearnerConfig

__all__ = [
    "ALGORITHMS",
    "CORRECTIONS",
    "Algorithm",
    "CompiledPolicy",
    "Forward",
    "MicroBatch",
    "Objective",
    "PolicyInputs",
    "PolicyLoss",
    "Term",
    "batch_advantages",
    "batch_objective",
    "bc_coef",
    "compile_policy",
    "nll",
    "objective_for",
]


class Forward(NamedTuple):
    """The policy's forward pass on a micro-batch."""

    logprobs: torch.Tensor
    """[B, T]: the log-prob of each token under the policy being trained (with gradients)."""
    target: torch.Tensor
    """[B, T]: 1 at completion tokens, 0 at prompt tokens and padding."""
    logits: torch.Tensor
    """[B, T, V]: the logits the log-probs come from."""


@dataclass(frozen=True)
class MicroBatch:
    """What one micro-batch's loss is computed from.

    Attributes:
        samples: the micro-batch's scored samples.
        advantages: theirs, as the algorithm computed them over the whole batch.
        proximal: decoupled PPO's proximal log-probs of each completion; None: the current
            policy's (detached), right for a batch that takes one optimizer step.
        forward: the policy's forward pass on ``samples``.
    """

    samples: list[Scored]
    advantages: list[Any]
    proximal: list[list[float]] | None
    forward: Forward


def _aggregate(cfg: LearnerConfig, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return alg.aggregate(values, mask, cfg.aggregation, cfg.norm_len)


def nll(cfg: LearnerConfig, logprobs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Behaviour cloning's loss: the negative log-likelihood of the target tokens, aggregated
    as the config says (BC's loss, and the BC term on a batch's demonstrations)."""
    return -_aggregate(cfg, logprobs, target)


# -- advantages -------------------------------------------------------------------------------


def _whiten(cfg: LearnerConfig, advantages: list[float]) -> list[float]:
    """Whiten over the batch being consumed (in sync and async mode alike); across
    data-parallel ranks, from every rank's merged moments."""
    if not cfg.whiten_advantages or not advantages:
        return advantages
    moments = batch_moments(advantages)
    return [(a - moments.mean) / (moments.std + 1e-8) for a in advantages]


def _group_ids(samples: list[Scored]) -> torch.Tensor:
    groups: dict[str, int] = {}
    return torch.tensor([groups.setdefault(s.sample.prompt_id, len(groups)) for s in samples])


def _rewards(samples: list[Scored]) -> torch.Tensor:
    return torch.tensor([s.reward for s in samples], dtype=torch.float32)


def _grpo(cfg: LearnerConfig, samples: list[Scored]) -> list[Any]:
    """The advantages the pipeline gave, when every sample has one; else GRPO's over the
    batch's groups (samples of one prompt id), computed by the very function the pipeline
    calls on each group it releases (``groups.group_advantages``), so both are the same."""
    if all(s.advantage is not None for s in samples):
        return _whiten(cfg, [float(s.advantage) for s in samples if s.advantage is not None])
    adv = grouped_advantages(
        [s.sample.prompt_id for s in samples],
        [s.reward for s in samples],
        normalize_std=cfg.normalize_std,
        std=cfg.std,
    )
    return _whiten(cfg, adv)


def _rloo(cfg: LearnerConfig, samples: list[Scored]) -> list[Any]:
    """RLOO's over the batch's groups; advantages the pipeline gave (GRPO's) are not used."""
    adv = alg.rloo_advantages(_rewards(samples), _group_ids(samples))
    return _whiten(cfg, [float(a) for a in adv])


def _gae(cfg: LearnerConfig, samples: list[Scored]) -> list[Any]:
    """GAE over the critic's values, whitened over every completion token of the batch."""
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
    # Whitened over the policy's tokens only: an episode's environment tokens keep 0.
    keeps = [s.sample.loss_mask or [1] * len(row) for s, row in zip(samples, rows, strict=True)]
    flat = _whiten(
        cfg,
        [
            a
            for row, keep in zip(rows, keeps, strict=True)
            for a, m in zip(row, keep, strict=True)
            if m
        ],
    )
    out, start = [], 0
    for keep in keeps:
        n = sum(keep)
        taken = iter(flat[start : start + n])
        out.append([next(taken) if m else 0.0 for m in keep])
        start += n
    return out


def _none(cfg: LearnerConfig, samples: list[Scored]) -> list[Any]:
    return [None] * len(samples)


def _per_sample(advantages: list[Any], target: torch.Tensor) -> torch.Tensor:
    return (
        torch.tensor(advantages, dtype=torch.float32, device=target.device)[:, None].expand_as(
            target
        )
        * target
    )


@dataclass(frozen=True)
class Algorithm:
    """One of the learner's algorithms: its advantages, and how they reach the tokens.

    Attributes:
        name: its name in the config and in ``TrainBatch.algorithm``.
        advantages: one advantage per sample, or one list per sample (per completion token),
            computed over the whole batch; with ``whiten_advantages`` whitened over it.
        on_tokens: the micro-batch's advantages as a ``[B, T]`` tensor on its completion
            tokens (0 elsewhere).
        rl: learns from rewards. False for BC, which imitates: its loss is ``nll``, it takes
            one optimizer step per batch whatever ``ppo_epochs`` and ``mini_batches`` say, and
            its samples have no staleness.
    """

    name: str
    advantages: Callable[[LearnerConfig, list[Scored]], list[Any]]
    on_tokens: Callable[[list[Any], torch.Tensor], torch.Tensor] = _per_sample
    rl: bool = True


ALGORITHMS: Mapping[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("grpo", _grpo),
        Algorithm("rloo", _rloo),
        Algorithm("ppo", _gae, on_tokens=aligned),
        Algorithm("bc", _none, rl=False),
    )
}
"""The algorithms by name, in the order error messages list them."""


def _known(kind: str, name: str, known: Mapping[str, Any]) -> None:
    if name not in known:
        raise ValueError(f"unknown {kind} {name!r}; expected one of {tuple(known)}")


def batch_advantages(cfg: LearnerConfig, algorithm: str, samples: list[Scored]) -> list[Any]:
    """One advantage per sample (GRPO, RLOO), one per completion token (PPO), or None (BC),
    over the whole batch (see ``Algorithm``).

    Raises:
        ValueError: an unknown algorithm (the known ones are listed).
    """
    _known("algorithm", algorithm, ALGORITHMS)
    return ALGORITHMS[algorithm].advantages(cfg, samples)


# -- policy losses, one per correction ---------------------------------------------------------


class PolicyInputs(NamedTuple):
    """A policy loss's inputs, all ``[B, T]``."""

    logprobs: torch.Tensor
    """The policy being trained (with gradients)."""
    behaviour: torch.Tensor
    """The behaviour policy that sampled the tokens."""
    proximal: torch.Tensor
    """The proximal policy (read by ``decoupled`` only)."""
    advantages: torch.Tensor
    mask: torch.Tensor


class PolicyLoss(Protocol):
    """A policy loss under one off-policy correction: the 0-dim loss and its stats."""

    @property
    def needs_proximal(self) -> bool:
        """It reads the proximal log-probs: the learner computes them before a batch that
        takes more than one optimizer step."""
        ...

    def __call__(self, x: PolicyInputs) -> tuple[torch.Tensor, alg.Stats]: ...


@dataclass(frozen=True)
class Clip:
    """``clip``: PPO's clipped surrogate of ``pi / mu`` (``alg.ppo_policy_loss``)."""

    cfg: LearnerConfig
    needs_proximal: ClassVar[bool] = False

    def __call__(self, x: PolicyInputs) -> tuple[torch.Tensor, alg.Stats]:
        cfg = self.cfg
        return alg.ppo_policy_loss(
            x.logprobs,
            x.behaviour,
            x.advantages,
            x.mask,
            cfg.clip_eps,
            cfg.dual_clip,
            cfg.aggregation,
            clip_eps_high=cfg.clip_eps_high,
            norm_len=cfg.norm_len,
            importance=cfg.importance,
        )


@dataclass(frozen=True)
class Decoupled:
    """``decoupled``: PPO's clipped surrogate of ``pi / prox``, weighted by ``prox / mu``
    truncated at ``importance_cap`` (``alg.decoupled_ppo_policy_loss``)."""

    cfg: LearnerConfig
    importance_cap: float
    needs_proximal: ClassVar[bool] = True

    def __call__(self, x: PolicyInputs) -> tuple[torch.Tensor, alg.Stats]:
        cfg = self.cfg
        return alg.decoupled_ppo_policy_loss(
            x.logprobs,
            x.proximal,
            x.behaviour,
            x.advantages,
            x.mask,
            cfg.clip_eps,
            cfg.dual_clip,
            cfg.aggregation,
            importance_cap=self.importance_cap,
            clip_eps_high=cfg.clip_eps_high,
            norm_len=cfg.norm_len,
            importance=cfg.importance,
        )


@dataclass(frozen=True)
class TruncatedImportance:
    """``tis``: the policy gradient weighted by ``min(pi / mu, importance_cap)``, detached."""

    cfg: LearnerConfig
    importance_cap: float
    needs_proximal: ClassVar[bool] = False

    def __call__(self, x: PolicyInputs) -> tuple[torch.Tensor, alg.Stats]:
        weight = alg.truncated_importance_weights(
            x.logprobs, x.behaviour, self.importance_cap, mask=x.mask
        )
        loss = _aggregate(self.cfg, -(weight * x.advantages * x.logprobs), x.mask)
        return loss, {"importance_weight_mean": alg.masked_mean(weight, x.mask)}


CORRECTIONS: Mapping[str, Callable[[LearnerConfig, float], PolicyLoss]] = {
    "clip": lambda cfg, importance_cap: Clip(cfg),
    "decoupled": Decoupled,
    "tis": TruncatedImportance,
}
"""The policy loss of each correction, built from the config and ``importance_cap``."""


@dataclass(frozen=True)
class CompiledPolicy:
    """A ``PolicyLoss`` whose tensor maths runs as one compiled function (the learner's
    ``compile: true``): the same loss and stats, within float rounding.

    Attributes:
        policy: the eager policy loss.
        fn: ``policy`` as a function of the five ``PolicyInputs`` tensors returning one vector,
            the loss then the stats, as the plugin's compiler made it.
        keys: the names of the stats, in the vector's order.
    """

    policy: PolicyLoss
    fn: Callable[..., torch.Tensor]
    keys: tuple[str, ...]

    @property
    def needs_proximal(self) -> bool:
        return self.policy.needs_proximal

    def __call__(self, x: PolicyInputs) -> tuple[torch.Tensor, alg.Stats]:
        out = self.fn(*x)
        stats = out[1:].detach()
        return out[0], dict(zip(self.keys, stats, strict=True))


def compile_policy(
    policy: PolicyLoss, compile_fn: Callable[[Callable[..., torch.Tensor]], Any]
) -> CompiledPolicy:
    """``policy`` as one function of its input tensors returning ``[loss, *stats]``, handed to
    ``compile_fn`` (the plugin compiler's ``compile`` with its buckets)."""

    def stacked(*inputs: torch.Tensor) -> torch.Tensor:
        loss, stats = policy(PolicyInputs(*inputs))
        return torch.stack([loss, *(v.to(loss.dtype) for v in stats.values())])

    one = torch.ones(1, 1)
    _, stats = policy(PolicyInputs(one, one, one, one, one))  # the stats' names, in order
    return CompiledPolicy(policy, compile_fn(stacked), tuple(stats))


# -- the loss and its terms ---------------------------------------------------------------------


class Loss(Protocol):
    """The main piece of an objective: a micro-batch's loss and its parts, as floats."""

    def __call__(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]: ...


@dataclass(frozen=True)
class PolicyGradient:
    """The policy loss on the algorithm's advantages; parts ``policy_loss`` and its stats."""

    policy: PolicyLoss
    algorithm: Algorithm

    def __call__(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs, target, _ = micro.forward
        behaviour = aligned([s.sample.logprobs for s in micro.samples], target)
        adv = self.algorithm.on_tokens(micro.advantages, target)
        prox = logprobs.detach() if micro.proximal is None else aligned(micro.proximal, target)
        loss, stats = self.policy(PolicyInputs(logprobs, behaviour, prox, adv, target))
        return loss, {
            "policy_loss": float(loss.detach()),
            **{k: float(v) for k, v in stats.items()},
        }


@dataclass(frozen=True)
class Imitation:
    """BC's loss, ``nll``; part ``nll``."""

    cfg: LearnerConfig

    def __call__(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        loss = nll(self.cfg, micro.forward.logprobs, micro.forward.target)
        return loss, {"nll": float(loss.detach())}


class Term(Protocol):
    """A term added to the loss with a coefficient."""

    @property
    def name(self) -> str:
        """Its part in the step's metrics."""
        ...

    def __call__(self, micro: MicroBatch) -> torch.Tensor | None:
        """The term's 0-dim value on the micro-batch; None where it does not apply."""
        ...


@dataclass(frozen=True)
class KLPenalty:
    """The KL to the reference (``kl_estimator``), aggregated; None when a sample with a
    completion has no reference log-probs (an empty completion needs none)."""

    cfg: LearnerConfig
    name: str = "kl"

    def __call__(self, micro: MicroBatch) -> torch.Tensor | None:
        samples = micro.samples
        if not all(s.ref_logprobs or not s.sample.token_ids for s in samples):
            return None
        logprobs, target, _ = micro.forward
        ref = aligned([s.ref_logprobs for s in samples], target)
        return _aggregate(self.cfg, alg.kl_estimator(logprobs, ref, self.cfg.kl_estimator), target)


@dataclass(frozen=True)
class Entropy:
    """The policy's entropy at the completion tokens, aggregated."""

    cfg: LearnerConfig
    name: str = "entropy"

    def __call__(self, micro: MicroBatch) -> torch.Tensor | None:
        entropy = alg.entropy_from_logits(micro.forward.logits)
        return _aggregate(self.cfg, entropy, micro.forward.target)


def _terms(cfg: LearnerConfig) -> tuple[tuple[float, Term], ...]:
    """The config's terms: the KL in the loss (``kl_mode: reward`` puts it in PPO's rewards
    instead), then the entropy bonus (a negative coefficient: it is maximised)."""
    terms: list[tuple[float, Term]] = []
    if cfg.kl_coef and cfg.kl_mode == "loss":
        terms.append((cfg.kl_coef, KLPenalty(cfg)))
    if cfg.entropy_coef:
        terms.append((-cfg.entropy_coef, Entropy(cfg)))
    return tuple(terms)


@dataclass(frozen=True)
class Objective:
    """What a batch's micro-batches minimise: ``loss`` plus each ``coefficient * term``.

    Attributes:
        algorithm: the batch's algorithm, which computes its advantages.
        loss: the main piece: the policy loss (``PolicyGradient``) or BC's (``Imitation``).
        terms: ``(coefficient, term)`` pieces added in order.
        needs_proximal: the loss reads decoupled PPO's proximal log-probs.
    """

    algorithm: Algorithm
    loss: Loss
    terms: tuple[tuple[float, Term], ...] = ()
    needs_proximal: bool = False

    def advantages(self, cfg: LearnerConfig, samples: list[Scored]) -> list[Any]:
        """The batch's advantages (``Algorithm.advantages``)."""
        return self.algorithm.advantages(cfg, samples)

    def __call__(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's loss, aggregated over its own tokens (the caller weighs it), and
        its parts as floats."""
        loss, parts = self.loss(micro)
        for coefficient, term in self.terms:
            value = term(micro)
            if value is None:
                continue
            loss = loss + coefficient * value
            parts[term.name] = float(value.detach())
        return loss, parts


def objective_for(
    cfg: LearnerConfig, algorithm: str, correction: str, importance_cap: float
) -> Objective:
    """The objective of a batch of ``algorithm`` under ``correction`` (see the module
    docstring); BC has neither a correction nor terms.

    Raises:
        ValueError: an unknown algorithm or correction (the known ones are listed).
    """
    _known("algorithm", algorithm, ALGORITHMS)
    chosen = ALGORITHMS[algorithm]
    if not chosen.rl:
        return Objective(chosen, Imitation(cfg))
    _known("correction", correction, CORRECTIONS)
    policy = CORRECTIONS[correction](cfg, importance_cap)
    return Objective(
        chosen, PolicyGradient(policy, chosen), _terms(cfg), needs_proximal=policy.needs_proximal
    )


def bc_coef(cfg: LearnerConfig, step: int) -> float:
    """The BC term's weight after ``step`` batches: ``bc_coef``, decayed linearly to 0 over
    ``bc_anneal_steps`` when that is set."""
    coef = float(cfg.bc_coef)
    if not coef or not cfg.bc_anneal_steps:
        return coef
    return coef * max(0.0, 1.0 - step / int(cfg.bc_anneal_steps))


def batch_objective(cfg: LearnerConfig, batch: TrainBatch, role: str) -> Objective:
    """``batch``'s objective (``objective_for``), once its algorithm is known to suit the
    learner ``role`` configured by ``cfg``.

    Raises:
        ValueError: an unknown algorithm or correction, or fewer samples than
            ``mini_batches``.
    """
    algorithm = batch.algorithm or cfg.algorithm
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"{role}: unknown algorithm {algorithm!r} in TrainBatch.algorithm; "
            f"expected one of {tuple(ALGORITHMS)} (empty for the configured one)"
        )
    objective = objective_for(cfg, algorithm, batch.correction, batch.importance_cap)
    if objective.algorithm.rl and 0 < len(batch.samples) < cfg.mini_batches:
        raise ValueError(
            f"{role}: a batch of {len(batch.samples)} samples cannot be split into "
            f"mini_batches={cfg.mini_batches}; send batches of at least {cfg.mini_batches} "
            f"samples or lower roles.{role}.config.mini_batches"
        )
    return objective
