"""The learner: GRPO, RLOO, PPO and behaviour cloning on a Hugging Face causal LM.

One ``train_step`` consumes a batch of scored samples (or demonstrations, for BC), splits it into
micro-batches by a token budget, accumulates gradients (each micro-batch weighted by what it adds
to the whole batch's aggregate, so the gradient does not depend on the split), clips them and
takes one AdamW step under the LR schedule; the policy version then goes up by one. Every
sample's stable id goes into the learner's ledger of consumed ids, and a sample already consumed
is skipped, so a batch re-sent after a crash is never trained on twice. The conventions (GRPO's
std, a group of one, the log-ratio clamp, ``norm_len``, whitening, the KL penalty in the reward)
are in docs/algorithms.md.

**A step it acknowledged is never lost** (``durable: true``, the default). Before ``train_step``
replies, the step is on disk: its line in the step log (``RUN_DIR/ledger/<role>.<replica>.steps
.jsonl``: step, version, the ids it consumed; fsynced) and then a checkpoint. A learner killed at
any point restarts at its last acknowledged step, or at the step it finished but could not
acknowledge; a caller that lost the reply re-sends the batch with the same ``TrainBatch.id``
and gets that step's result back instead of a second step. So nothing that saw a version (the
pacer, rollout weights, the program's counters) ever has to roll back. This costs one checkpoint
per step, cheap for small models; with ``durable: false`` checkpoints follow ``checkpoint_every``
and a restart loses the steps after the last one, which the program sees as a version that went
back (``asyncrl.pacing.Pacer.advance`` fails the run rather than stall it).

Checkpoints hold the model, the optimizer and scheduler, every RNG, the policy version, the step,
the last step's result and whatever the program asks to keep with them (its resume state). The
ledger is the step log, read back up to the checkpoint's step. A checkpoint is written into a
temporary directory, fsynced, and renamed into place, so a crash mid-write leaves the previous one
intact (a leftover ``.tmp`` is never loaded); ``setup`` resumes from the latest, exactly.

Endpoints that write files (``export``) write only inside the run directory, or under the
``write_paths`` the manifest allows.

Log-probs are computed with left padding and position ids derived from the attention mask, the
same convention as the rollout engine, so the learner's recompute of a sample equals its
behaviour log-probs under the same weights.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
from collections.abc import Mapping
from typing import Any, Literal

import msgspec
import numpy as np
import torch

from asyncrl.faults import FaultPlan
from asyncrl.pacing import percentiles, staleness
from asyncrl.reduce import Moments
from asyncrl.role import Delivery, Role, endpoint
from asyncrl.roles import algorithms as alg
from asyncrl.roles.payloads import Sample, Scored, StepResult, TrainBatch
from asyncrl.roles.rollout import WeightsUpdate
from asyncrl.weights import WeightStore, handle_path, write_handle

__all__ = [
    "Learner",
    "Scored",
    "StepResult",
    "TrainBatch",
    "build_model",
    "gae_targets",
    "pad_batch",
]

ALGORITHMS = ("grpo", "rloo", "ppo", "bc")


def batch_moments(values: list[float]) -> Moments:
    """The moments of ``values``, merged over every data-parallel rank when torch.distributed
    is initialised (one all-gather of three numbers per rank, merged with Chan's formula)."""
    moments = Moments.of(values)
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return moments
    world = torch.distributed.get_world_size()
    mine = torch.tensor([moments.count, moments.mean, moments.m2], dtype=torch.float64)
    gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
    torch.distributed.all_gather(gathered, mine)
    merged = Moments(0, 0.0, 0.0)
    for rank in gathered:
        merged = merged.merge(Moments(int(rank[0]), float(rank[1]), float(rank[2])))
    return merged


def build_model(model_path: str, model_config: dict[str, Any], seed: int) -> Any:
    """A causal LM from a local path, or built from a config (no download)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM  # its class methods are untyped
    if model_path:
        return auto.from_pretrained(model_path)
    if not model_config:
        raise ValueError("learner: set model_path or model_config")
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**model_config)
    return auto.from_config(config)


def pad_batch(
    prompts: list[list[int]], completions: list[list[int]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ``prompt + completion`` rows.

    Returns:
        input_ids [B, L], attention_mask [B, L], position_ids [B, L] (from the mask, so padding
        never shifts a position), and target_mask [B, L-1]: 1 where ``input_ids[:, t+1]`` is a
        completion token, i.e. where the logits at ``t`` predict a completion token.
    """
    rows = [p + c for p, c in zip(prompts, completions, strict=True)]
    length = max(len(r) for r in rows)
    batch = len(rows)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, length), dtype=torch.long)
    target = torch.zeros((batch, length - 1), dtype=torch.float32)
    for i, (row, completion) in enumerate(zip(rows, completions, strict=True)):
        start = length - len(row)
        input_ids[i, start:] = torch.tensor(row, dtype=torch.long)
        attention[i, start:] = 1
        if completion:
            target[i, length - 1 - len(completion) :] = 1.0
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention, position_ids, target


def _aligned(values: list[list[float]], target: torch.Tensor) -> torch.Tensor:
    """Per-completion-token values placed where ``target`` marks completion tokens."""
    out = torch.zeros_like(target)
    for i, row in enumerate(values):
        if row:
            out[i, target.shape[1] - len(row) :] = torch.tensor(row, dtype=out.dtype)
    return out


def _right_aligned(rows: list[list[float]], width: int) -> torch.Tensor:
    """``rows`` as a [B, width] float tensor, each row's values in its last columns."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        if row:
            out[i, width - len(row) :] = torch.tensor(row, dtype=torch.float32)
    return out


def completion_mask(lengths: list[int]) -> torch.Tensor:
    """[B, max length] float mask, right-aligned: row i has ``lengths[i]`` ones at its end."""
    width = max(lengths, default=0)
    columns = torch.arange(width)[None, :]
    return (columns >= width - torch.tensor(lengths, dtype=torch.long)[:, None]).float()


def gae_targets(
    samples: list[Scored],
    *,
    gamma: float,
    lam: float,
    kl_coef: float = 0.0,
    kl_estimator: alg.KLKind = "k1",
    kl_mode: str = "loss",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's GAE advantages and returns of scored samples, as the learner and critic both use.

    Each sample's reward sits on its last completion token; with ``kl_mode == "reward"`` every
    completion token also carries ``-kl_coef * KL`` (``kl_estimator`` of the behaviour against
    the reference log-probs; a sample without reference log-probs has no penalty). Values are
    ``Scored.values`` (0 where the sample has none). Returns ``(advantages, returns, mask)``,
    each [B, T] right-aligned (row i's completion tokens are its last columns; T the longest
    completion), advantages not whitened.
    """
    lengths = [len(s.sample.token_ids) for s in samples]
    mask = completion_mask(lengths)
    width = mask.shape[1]
    logp = _right_aligned([s.sample.logprobs for s in samples], width)
    with_ref = [s.ref_logprobs if s.ref_logprobs else s.sample.logprobs for s in samples]
    ref = _right_aligned(with_ref, width)
    penalty = kl_coef if kl_mode == "reward" else 0.0
    rewards = alg.token_rewards(
        torch.tensor([s.reward for s in samples], dtype=torch.float32),
        mask,
        logp,
        ref,
        kl_coef=penalty,
        kl_kind=kl_estimator,
    )
    values = _right_aligned([s.values or [0.0] * len(s.sample.token_ids) for s in samples], width)
    advantages, returns = alg.gae(rewards, values, mask, gamma, lam)
    return advantages, returns, mask


def check_norm_len(aggregation: str, norm_len: float | None) -> None:
    """Raise ``ValueError`` unless ``norm_len`` suits ``aggregation`` (a learner or critic
    config's pair)."""
    if norm_len is not None and not norm_len > 0:
        raise ValueError(f"norm_len: expected a number > 0, got {norm_len!r}")
    if aggregation == "seq_mean_token_sum_norm" and norm_len is None:
        raise ValueError(
            "norm_len: aggregation 'seq_mean_token_sum_norm' (Dr. GRPO) divides each "
            "sequence's token sum by norm_len; set it to the sampling budget "
            "(SamplingParams.max_new_tokens)"
        )


def _fsync_dir(path: str) -> None:
    """Make a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    numpy_state: tuple[Any, ...] = tuple(np.random.get_state(legacy=True))
    kind, keys, pos, has_gauss, cached = numpy_state
    return {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, cached],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


class Learner(Role):
    """Trains the policy; serves its weights, log-probs, checkpoints and exports."""

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        model_path: str = ""
        model_config: dict[str, Any] = {}
        tokenizer_path: str = ""
        seed: int = 0
        algorithm: Literal["grpo", "rloo", "ppo", "bc"] = "grpo"
        lr: float = 1e-3
        betas: tuple[float, float] = (0.9, 0.999)
        weight_decay: float = 0.0
        grad_clip: float = 1.0
        lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
        warmup_steps: int = 0
        total_steps: int = 1000
        clip_eps: float = 0.2
        dual_clip: float | None = None
        normalize_std: bool = True
        std: alg.StdKind = "population"
        whiten_advantages: bool = False
        kl_coef: float = 0.0
        kl_estimator: Literal["k1", "k2", "k3"] = "k3"
        kl_mode: Literal["loss", "reward"] = "loss"
        entropy_coef: float = 0.0
        bc_coef: float = 0.0
        bc_anneal_steps: int = 0
        gamma: float = 1.0
        lam: float = 0.95
        aggregation: alg.Aggregation = "token_mean"
        norm_len: float | None = None
        micro_batch_tokens: int = 8192
        checkpoint_every: int = 0
        durable: bool = True
        write_paths: list[str] = []
        publish_weights: bool = True
        keep_checkpoints: int = 2
        pad_id: int = 0
        dropout: bool = False

        def __post_init__(self) -> None:
            check_norm_len(self.aggregation, self.norm_len)

    @classmethod
    def preload(cls, config: Mapping[str, Any]) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

    async def setup(self) -> None:
        cfg = self.config
        # In the worker thread, like every slow step of setup: the loop keeps answering
        # heartbeats, so a slow start is never taken for a hang.
        await self.ctx.offload(self._build)
        self.version = 0
        self.step = 0
        self.consumed: set[tuple[str, int]] = set()
        self.keep: dict[str, Any] = {}
        self.last: dict[str, Any] = {}  # the last step: its batch id and result
        self.faults = FaultPlan.from_env(self.ctx.incarnation)
        self.checkpoints = self.ctx.path("checkpoints")
        os.makedirs(self.checkpoints, exist_ok=True)
        self.step_log = os.path.join(
            self.ctx.run_dir, "ledger", f"{self.ctx.name}.{self.ctx.replica}.steps.jsonl"
        )
        os.makedirs(os.path.dirname(self.step_log), exist_ok=True)
        latest = self._latest_checkpoint()
        if latest is not None:
            await self.ctx.offload(self._load, latest)
        await self.ctx.offload(self._read_step_log)
        self.store: WeightStore | None = None
        if cfg.publish_weights:
            await self.ctx.offload(self._open_store)

    def _build(self) -> None:
        cfg = self.config
        torch.manual_seed(cfg.seed)
        # Dropout stays off unless asked for: with it, the learner's log-probs of a sample would
        # differ from its behaviour log-probs under the very same weights.
        self.model = build_model(cfg.model_path, cfg.model_config, cfg.seed).train(cfg.dropout)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)

    def _open_store(self) -> None:
        # Rollout replicas on this host read the weights from shared memory (a seqlock store);
        # the handle in the run directory lets a restarted one find them.
        self.store = WeightStore(
            self.model.state_dict(), run=self.ctx.run, incarnation=self.ctx.incarnation
        )
        self.store.publish(self.model.state_dict(), self.version)
        write_handle(handle_path(self.ctx.run_dir, self.ctx.name), self.store.describe())

    async def teardown(self) -> None:
        if self.store is not None:
            self.store.close()

    def _lr_factor(self, step: int) -> float:
        cfg = self.config
        warmup, total = int(cfg.warmup_steps), int(cfg.total_steps)
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if cfg.lr_schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    # -- endpoints ------------------------------------------------------------------------

    @endpoint(Delivery.ONCE)
    async def train_step(self, batch: TrainBatch) -> StepResult:
        return await self.ctx.offload(self._train_step, batch)

    @endpoint(Delivery.IDEMPOTENT)
    async def weights(self, _: Any) -> WeightsUpdate:
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return WeightsUpdate(self.version, state)

    @endpoint(Delivery.IDEMPOTENT)
    async def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        return await self.ctx.offload(self._logprobs, samples)

    @endpoint(Delivery.ONCE)
    async def checkpoint(self, keep: dict[str, Any]) -> str:
        self.keep.update(keep)
        return await self.ctx.offload(self._save)

    @endpoint(Delivery.IDEMPOTENT)
    async def export(self, path: str) -> str:
        return await self.ctx.offload(self._export, path)

    @endpoint(Delivery.IDEMPOTENT)
    async def status(self, _: Any) -> dict[str, Any]:
        return {
            "version": self.version,
            "step": self.step,
            "consumed": len(self.consumed),
            "keep": self.keep,
            "last": self.last,
            "durable": self.config.durable,
            # How GRPO advantages are computed here: a program's sample pipeline attaches
            # advantages computed the same way (asyncrl.roles.pipeline.group_advantages).
            "advantages": {"normalize_std": self.config.normalize_std, "std": self.config.std},
        }

    # -- compute (worker thread) ------------------------------------------------------------

    def _forward_logprobs(
        self, prompts: list[list[int]], completions: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        input_ids, attention, positions, target = pad_batch(
            prompts, completions, self.config.pad_id
        )
        logits = (
            self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions)
            .logits[:, :-1]
            .float()
        )
        logprobs = alg.token_logprobs(logits, input_ids[:, 1:])
        return logprobs, target, logits

    def _logprobs(self, samples: list[Sample]) -> list[list[float]]:
        self.model.eval()
        try:
            with torch.no_grad():
                logprobs, target, _ = self._forward_logprobs(
                    [s.prompt_ids for s in samples], [s.token_ids for s in samples]
                )
        finally:
            self.model.train(self.config.dropout)
        out = []
        for i, s in enumerate(samples):
            n = len(s.token_ids)
            out.append(logprobs[i, logprobs.shape[1] - n :].tolist() if n else [])
        del target
        return out

    def _train_step(self, batch: TrainBatch) -> StepResult:
        cfg = self.config
        if batch.id and batch.id == self.last.get("id"):
            # Re-sent after a failure that lost the reply: the step happened; say what it did.
            result = msgspec.convert(self.last["result"], StepResult)
            result.replayed = True
            return result
        algorithm = batch.algorithm or cfg.algorithm
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"{self.ctx.name}: unknown algorithm {algorithm!r} in TrainBatch.algorithm; "
                f"expected one of {ALGORITHMS} (empty for the configured one)"
            )
        fresh = [
            s
            for s in batch.samples
            if (s.sample.prompt_id, s.sample.sample_index) not in self.consumed
        ]
        skipped = len(batch.samples) - len(fresh)
        metrics: dict[str, float] = {}
        if batch.lr:
            # A new peak: the scheduler scales it from now on, and this step already uses it.
            self.scheduler.base_lrs = [batch.lr] * len(self.optimizer.param_groups)
            for group in self.optimizer.param_groups:
                group["initial_lr"] = batch.lr
                group["lr"] = batch.lr * self._lr_factor(self.step)
        if fresh:
            advantages = self._advantages(algorithm, fresh)
            self.optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            # Each micro-batch weighs what it adds to the whole batch's aggregate (its tokens
            # for a token mean, its non-empty sequences for a sequence mean), so the summed
            # gradient is the whole batch's.
            mask = completion_mask([len(s.sample.token_ids) for s in fresh])
            chunks = self._micro_batches(fresh)
            shares = [float(alg.aggregate_weight(mask[chunk], cfg.aggregation)) for chunk in chunks]
            total = sum(shares)
            for chunk, share in zip(chunks, shares, strict=True):
                weight = share / total if total else 0.0
                loss, parts = self._loss(
                    algorithm,
                    [fresh[i] for i in chunk],
                    [advantages[i] for i in chunk],
                    batch,
                )
                (loss * weight).backward()  # type: ignore[no-untyped-call]
                for key, value in parts.items():
                    sums[key] = sums.get(key, 0.0) + value * weight
            sums.update(self._bc_term(batch.demos))
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            lr = float(self.scheduler.get_last_lr()[0])
            metrics = {**sums, "grad_norm": float(grad_norm), "lr": lr}
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            self.version += 1
            ids = [(s.sample.prompt_id, s.sample.sample_index) for s in fresh]
            self.consumed.update(ids)
            metrics["reward_mean"] = float(np.mean([s.reward for s in fresh]))
            if algorithm != "bc":
                # Measured against the version that consumed them: the one before this step.
                ages = [staleness(self.version - 1, s.sample.versions) for s in fresh]
                metrics.update({f"staleness_{k}": v for k, v in percentiles(ages).items()})
        self.keep.update(batch.keep)
        result = StepResult(self.version, self.step, len(fresh), skipped, metrics)
        if fresh:
            self.last = {"id": batch.id, "result": msgspec.to_builtins(result)}
            self._log_step(ids, skipped)
            periodic = cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0
            if cfg.durable or periodic:
                self._save()
            self.faults.at("after_checkpoint")
            if self.store is not None:
                self.store.publish(self.model.state_dict(), self.version)
        return result

    def _micro_batches(self, samples: list[Scored]) -> list[list[int]]:
        budget = self.config.micro_batch_tokens
        chunks: list[list[int]] = [[]]
        used = 0
        for i, s in enumerate(samples):
            size = len(s.sample.prompt_ids) + len(s.sample.token_ids)
            if chunks[-1] and used + size > budget:
                chunks.append([])
                used = 0
            chunks[-1].append(i)
            used += size
        return chunks

    def _advantages(self, algorithm: str, samples: list[Scored]) -> list[Any]:
        """One advantage per sample (GRPO, RLOO), one per completion token (PPO), or None
        (BC). GRPO uses the advantages the pipeline gave when every sample has one; RLOO always
        computes its own over the batch's groups (samples of one prompt id)."""
        cfg = self.config
        if algorithm == "bc":
            return [None] * len(samples)
        if algorithm == "grpo" and all(s.advantage is not None for s in samples):
            given = [float(s.advantage) for s in samples if s.advantage is not None]
            return self._whiten(given)
        if algorithm in ("grpo", "rloo"):
            groups: dict[str, int] = {}
            ids = torch.tensor(
                [groups.setdefault(s.sample.prompt_id, len(groups)) for s in samples]
            )
            rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
            if algorithm == "rloo":
                adv = alg.rloo_advantages(rewards, ids)
            else:
                adv = alg.grpo_advantages(
                    rewards, ids, normalize_std=cfg.normalize_std, std=cfg.std
                )
            return self._whiten([float(a) for a in adv])
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
        flat = self._whiten([a for row in rows for a in row])
        out, start = [], 0
        for row in rows:
            out.append(flat[start : start + len(row)])
            start += len(row)
        return out

    def _whiten(self, advantages: list[float]) -> list[float]:
        """Whiten over the batch being consumed (in sync and async mode alike); across
        data-parallel ranks, from every rank's merged moments."""
        if not self.config.whiten_advantages or not advantages:
            return advantages
        moments = batch_moments(advantages)
        return [(a - moments.mean) / (moments.std + 1e-8) for a in advantages]

    def _aggregate(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return alg.aggregate(values, mask, self.config.aggregation, self.config.norm_len)

    def _loss(
        self, algorithm: str, samples: list[Scored], advantages: list[Any], batch: TrainBatch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's loss, aggregated over its own tokens (the caller weighs it)."""
        cfg = self.config
        logprobs, target, logits = self._forward_logprobs(
            [s.sample.prompt_ids for s in samples], [s.sample.token_ids for s in samples]
        )
        parts: dict[str, float] = {}
        if algorithm == "bc":
            loss = -self._aggregate(logprobs, target)
            parts["nll"] = float(loss.detach())
            return loss, parts
        behaviour = _aligned([s.sample.logprobs for s in samples], target)
        if algorithm in ("grpo", "rloo"):
            adv = torch.tensor(advantages, dtype=torch.float32)[:, None].expand_as(target) * target
        else:
            adv = _aligned(advantages, target)
        loss, stats = self._policy_loss(logprobs, behaviour, adv, target, batch)
        parts["policy_loss"] = float(loss.detach())
        parts.update({k: float(v) for k, v in stats.items()})
        # An empty completion needs no reference log-probs.
        if (
            cfg.kl_coef
            and cfg.kl_mode == "loss"
            and all(s.ref_logprobs or not s.sample.token_ids for s in samples)
        ):
            ref = _aligned([s.ref_logprobs for s in samples], target)
            kl = self._aggregate(alg.kl_estimator(logprobs, ref, cfg.kl_estimator), target)
            loss = loss + cfg.kl_coef * kl
            parts["kl"] = float(kl.detach())
        if cfg.entropy_coef:
            entropy = self._aggregate(alg.entropy_from_logits(logits), target)
            loss = loss - cfg.entropy_coef * entropy
            parts["entropy"] = float(entropy.detach())
        return loss, parts

    def _bc_term(self, demos: list[Sample]) -> dict[str, float]:
        """Backpropagate the optional BC term over the batch's demonstrations, once per step."""
        bc_coef = self._bc_coef()
        if not (bc_coef and demos):
            return {}
        demo_logp, demo_target, _ = self._forward_logprobs(
            [d.prompt_ids for d in demos], [d.token_ids for d in demos]
        )
        nll = -self._aggregate(demo_logp, demo_target)
        (bc_coef * nll).backward()  # type: ignore[no-untyped-call]
        return {"bc_nll": float(nll.detach())}

    def _policy_loss(
        self,
        logprobs: torch.Tensor,
        behaviour: torch.Tensor,
        adv: torch.Tensor,
        target: torch.Tensor,
        batch: TrainBatch,
    ) -> tuple[torch.Tensor, alg.Stats]:
        cfg = self.config
        if batch.correction == "decoupled":
            # One optimizer step per batch: the proximal policy is the current one.
            return alg.decoupled_ppo_policy_loss(
                logprobs,
                logprobs.detach(),
                behaviour,
                adv,
                target,
                cfg.clip_eps,
                cfg.dual_clip,
                cfg.aggregation,
                importance_cap=batch.importance_cap,
                norm_len=cfg.norm_len,
            )
        if batch.correction == "tis":
            weight = alg.truncated_importance_weights(
                logprobs, behaviour, batch.importance_cap, mask=target
            )
            per_token = -(weight * adv * logprobs)
            loss = self._aggregate(per_token, target)
            return loss, {"importance_weight_mean": alg.masked_mean(weight, target)}
        return alg.ppo_policy_loss(
            logprobs,
            behaviour,
            adv,
            target,
            cfg.clip_eps,
            cfg.dual_clip,
            cfg.aggregation,
            norm_len=cfg.norm_len,
        )

    def _bc_coef(self) -> float:
        cfg = self.config
        coef = float(cfg.bc_coef)
        if not coef or not cfg.bc_anneal_steps:
            return coef
        return coef * max(0.0, 1.0 - self.step / int(cfg.bc_anneal_steps))

    # -- checkpoints ----------------------------------------------------------------------

    def _checkpoint_names(self) -> list[str]:
        """Complete checkpoints, oldest first (a ``.tmp`` directory is a write that died)."""
        names = [
            n
            for n in os.listdir(self.checkpoints)
            if n.startswith("step-") and n[len("step-") :].isdigit()
        ]
        return sorted(names, key=lambda n: int(n[len("step-") :]))

    def _latest_checkpoint(self) -> str | None:
        names = self._checkpoint_names()
        return os.path.join(self.checkpoints, names[-1]) if names else None

    def _save(self) -> str:
        final = os.path.join(self.checkpoints, f"step-{self.step:08d}")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        with open(os.path.join(tmp, "state.pt"), "wb") as f:
            torch.save(
                {
                    "model": self.model.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "version": self.version,
                    "step": self.step,
                    "keep": self.keep,
                    "last": json.dumps(self.last),
                    "rng": _rng_state(),
                },
                f,
            )
            f.flush()
            self.faults.at("checkpoint_write")
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.checkpoints)
        for old in self._checkpoint_names()[: -max(1, self.config.keep_checkpoints)]:
            shutil.rmtree(os.path.join(self.checkpoints, old), ignore_errors=True)
        return final

    def _load(self, path: str) -> None:
        # weights_only: a checkpoint holds tensors and plain values, never pickled objects.
        state = torch.load(os.path.join(path, "state.pt"), weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["version"]
        self.step = state["step"]
        self.keep = state["keep"]
        self.last = json.loads(state.get("last", "{}"))
        _set_rng_state(state["rng"])

    # -- the step log: the ledger of consumed ids, one fsynced line per step ----------------

    def _log_step(self, ids: list[tuple[str, int]], skipped: int) -> None:
        record = {
            "step": self.step,
            "version": self.version,
            "ids": ids,
            "skipped": skipped,
            "incarnation": self.ctx.incarnation,
            "phase": str(self.keep.get("phase", "")),
        }
        with open(self.step_log, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _read_step_log(self) -> None:
        """The ledger from the step log, up to the restored step. Lines past it are steps that
        never became durable (the learner died between the log and the checkpoint, or, with
        ``durable: false``, after the last checkpoint); they are cut, and will be trained
        again."""
        self.consumed = set()
        if not os.path.exists(self.step_log):
            return
        kept: list[str] = []
        cut = 0
        with open(self.step_log) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    cut += 1  # a line torn by a crash mid-write
                    continue
                if record["step"] > self.step:
                    cut += 1
                    continue
                kept.append(line if line.endswith("\n") else line + "\n")
                self.consumed.update((p, int(i)) for p, i in record["ids"])
        if cut:
            self.ctx.log.warning(
                f"step log: cut {cut} line(s) past the restored step {self.step}: steps that "
                f"never became durable, to be trained again"
            )
            tmp = self.step_log + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(kept)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.step_log)

    def _writable(self, path: str) -> str:
        """``path``, resolved, if it lies in the run directory or a configured write path.

        Raises:
            PermissionError: it lies elsewhere.
        """
        real = os.path.realpath(path)
        roots = [self.ctx.run_dir, *self.config.write_paths]
        for root in roots:
            base = os.path.realpath(root)
            if real == base or real.startswith(base + os.sep):
                if real == base:
                    break  # never replace a root itself
                return real
        raise PermissionError(
            f"{self.ctx.name}: refusing to write {path!r}: it is outside the run directory "
            f"{self.ctx.run_dir!r} and the configured write_paths {self.config.write_paths}; "
            f"write inside the run directory, or add its parent to roles.{self.ctx.name}"
            f".config.write_paths in the manifest"
        )

    def _export(self, path: str) -> str:
        path = self._writable(path)
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp)
        if self.config.tokenizer_path:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(self.config.tokenizer_path).save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        return path
