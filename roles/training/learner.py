"""The learner: GRPO, RLOO, PPO and behaviour cloning on a Hugging Face causal LM.

One ``train_step`` consumes a batch of scored samples (or demonstrations, for BC). It computes
the advantages over the whole batch, then takes ``ppo_epochs x mini_batches`` optimizer steps:
each epoch shuffles the samples (seeded, so a resumed learner draws the same split) into
``mini_batches`` mini-batches, and each mini-batch is split into micro-batches by a token budget
whose gradients accumulate (each weighted by what it adds to the mini-batch's aggregate, so the
gradient does not depend on the split), are clipped, and make one AdamW step and one step of the
LR schedule. The policy version then goes up by one: one published version per batch, however
many optimizer steps it took. With the defaults (one epoch, one mini-batch) that is one
optimizer step per batch. Every sample's stable id goes into the learner's ledger of consumed
ids, and a sample already consumed is skipped, so a batch re-sent after a crash is never trained
on twice. The conventions (GRPO's std, a group of one, the log-ratio clamp, ``norm_len``,
whitening, the KL penalty in the reward, decoupled PPO's proximal policy, sequence-level
importance ratios) are in docs/algorithms.md.

**Durable** (``durable: wal``, the default): before ``train_step`` replies, the step's batch is
in a write-ahead log on disk, and checkpoints are written in the background every
``checkpoint_every`` steps or ``checkpoint_every_s`` seconds; a restarted learner loads the newest
and replays the logged steps after it, so it resumes at its last acknowledged step, bit for bit,
and a re-sent ``TrainBatch.id`` gets that step's result back (``asyncrl.roles.training.journal``,
``asyncrl.roles.training.learner_durable``, docs/reliability.md). ``durable: checkpoint`` writes a
whole checkpoint before every reply instead. ``export`` writes only into ``RUN_DIR/exports`` (a
relative path goes there) or the ``write_paths`` the manifest allows, never over the run's own
state (``asyncrl.roles.training.learner_export``).

**Replicas** (``replicas: K``, ``supervision.strategy: one_for_all``) form one torch.distributed
group: each rank gets the whole batch and trains its token-balanced share of each mini-batch.
They either replicate the model and all-reduce gradients (``asyncrl.roles.training.data_parallel``)
or, with ``parallel: fsdp``, shard it (``asyncrl.roles.training.sharding``, docs/sharding.md);
either way the step is the one a single learner takes on the whole batch. Each rank keeps its own
step log and checkpoints; replica 0 publishes the weights
(``asyncrl.roles.training.learner_weights``).

Log-probs are computed with left padding and position ids derived from the attention mask, the
same convention as the rollout engine (``asyncrl.roles.learning.batching``), so the learner's
recompute of a sample equals its behaviour log-probs under the same weights.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np
import torch

from asyncrl.observe.trace import traced
from asyncrl.plugins.registry import current as current_plugin
from asyncrl.plugins.registry import device_for, dtype_for, sharding_for
from asyncrl.role import Delivery, Role, endpoint
from asyncrl.roles.device_report import DeviceShare
from asyncrl.roles.generation.rollout import WeightsUpdate
from asyncrl.roles.learning import algorithms as alg
from asyncrl.roles.learning.batching import (
    batch_moments,
    check_norm_len,
    completion_mask,
    env_tokens_in,
    gae_targets,
    loss_masks,
    mean_over_steps,
    micro_batches,
    mini_batch_indices,
    pad_batch,
)
from asyncrl.roles.learning.statistics import percentiles, staleness
from asyncrl.roles.payloads import (
    LearnerStatus,
    ProgramState,
    Sample,
    Scored,
    StepResult,
    TrainBatch,
)
from asyncrl.roles.training import sharding as sh
from asyncrl.roles.training import zero_rows
from asyncrl.roles.training.data_parallel import (
    DataParallel,
    DataParallelError,
    check_restored,
    fingerprint,
    join_role,
    rank_chunks,
    share_out,
)
from asyncrl.roles.training.learner_compile import CompiledStep
from asyncrl.roles.training.learner_config import LearnerConfig
from asyncrl.roles.training.learner_durable import DurableSteps
from asyncrl.roles.training.learner_export import export_pretrained, writable
from asyncrl.roles.training.learner_weights import PublishedWeights, WeightBroadcast
from asyncrl.roles.training.models import build_model, preload_model_class
from asyncrl.roles.training.objective import ALGORITHMS as _ALGORITHMS
from asyncrl.roles.training.objective import (
    Forward,
    MicroBatch,
    Objective,
    batch_advantages,
    batch_objective,
    bc_coef,
    nll,
)
from asyncrl.supervision.faults import FaultPlan

__all__ = [
    "Learner",
    "Scored",
    "StepResult",
    "TrainBatch",
    "batch_moments",
    "build_model",
    "check_norm_len",
    "gae_targets",
    "pad_batch",
]

ALGORITHMS = tuple(_ALGORITHMS)
"""The algorithms a ``TrainBatch`` may name (``asyncrl.roles.training.objective.ALGORITHMS``)."""

MEMORY_EVERY_S = 1.0
"""The step metric ``memory_allocated_mib`` is read at most this often (on the host a read is
two files of /proc, a millisecond of a small step)."""


class Learner(DurableSteps, WeightBroadcast, Role):
    """Trains the policy; serves its weights, log-probs, checkpoints and exports."""

    Config = LearnerConfig
    share: DeviceShare | None = None

    @classmethod
    def preload(cls, config: Mapping[str, Any]) -> None:
        """Import the model's class ahead of the build (``preload_model_class``)."""
        preload_model_class(config)

    async def setup(self) -> None:
        cfg = self.config
        # In the worker thread, like every slow step of setup: the loop keeps answering
        # heartbeats, so a slow start is never taken for a hang.
        await self.ctx.offload(self._build)
        self.version = 0
        self.step = 0
        self.consumed: set[tuple[str, int]] = set()
        self.keep = ProgramState()
        self.last: dict[str, Any] = {}  # the last step: its batch id and result
        self.env_tokens_trained = 0.0  # in this step's loss (episodes; see env_tokens_in)
        self.faults = FaultPlan.from_env(self.ctx.incarnation)
        self.dp: DataParallel | None = None
        keep = cfg.keep_checkpoints
        if self.ctx.replicas > 1:
            self.dp = await self.ctx.offload(
                join_role, self.ctx, cfg.dist_backend, cfg.dist_timeout_s, self.device
            )
            keep = max(2, keep)  # a rank may have to go back one checkpoint to meet the others
            if self.sharded:
                await self.ctx.offload(self._shard)
        self._open_journal(keep)
        # The newest checkpoint, then the logged steps after it: only then does it serve.
        await self.ctx.offload(traced("restore", self._restore))
        if self.dp is not None:
            await self.ctx.offload(
                check_restored,
                self.dp,
                None if self.sharded else self.model,
                self.step,
                self.version,
                self.consumed,
            )
        # One rank publishes: the ranks' weights are the same, bit for bit (sharded ranks
        # gather each bucket together, and the first writes it).
        self.published = PublishedWeights(
            self.ctx,
            self.model,
            dtype=self.dtype,
            sharded=self.sharded,
            bucket_bytes=cfg.bucket_mib * 2**20,
            enabled=cfg.publish_weights,
        )
        await self.ctx.offload(self.published.open, self.template, self.version)

    def _build(self) -> None:
        cfg = self.config
        # The hardware comes from the plugin registry: the device of this replica's placement,
        # the dtype (the plugin's unless the config names one), the RNGs and the operators.
        self.plugin = current_plugin()
        self.device = device_for(self.ctx.device, self.plugin)
        # Before the model lands on a device it may share: the placement's memory share.
        self.share = DeviceShare.for_role(self.ctx, self.device, self.plugin)
        # The dtype weights are computed and published in.
        self.dtype = dtype_for(cfg.dtype, self.device, self.plugin)
        self.sharded = cfg.parallel == "fsdp" and self.ctx.replicas > 1
        # Sharded ranks keep float32 parameters unless the config names a dtype, and compute
        # in the plugin's precision (its mixed-precision policy: bf16 with float32 reduction).
        storage = torch.float32 if self.sharded and not cfg.dtype else self.dtype
        self.plugin.device.manual_seed(cfg.seed)
        # Dropout stays off unless asked for: with it, the learner's log-probs of a sample would
        # differ from its behaviour log-probs under the very same weights.
        # A sharded rank builds a pretrained model empty, then reads only its own slices.
        if self.sharded and cfg.model_path:
            model = sh.empty_pretrained(cfg.model_path)
        else:
            model = build_model(cfg.model_path, cfg.model_config, cfg.seed)
        self.model = sh.placed(model, self.device, storage).train(cfg.dropout)
        # The published tensors' names, dtypes and shapes, whole (sharding splits them).
        self.template = {
            name: torch.empty(
                t.shape, dtype=self.dtype if t.is_floating_point() else t.dtype, device="meta"
            )
            for name, t in self.model.state_dict().items()
        }
        self._make_optimizer()
        # compile: true: the forward pass now, each correction's policy loss when first used.
        self.compiled: CompiledStep | None = None
        if cfg.compile:
            model = None if cfg.activation_checkpointing else self.model
            self.compiled = CompiledStep(self.plugin.compiler, self._model_logprobs, model)
        self._memory_mib, self._memory_at = 0.0, -MEMORY_EVERY_S

    def _make_optimizer(self) -> None:
        """AdamW; fused (one kernel for all parameters) with ``fused_optimizer`` where the
        device has one, unless sharded."""
        cfg, params = self.config, list(self.model.parameters())
        options = {"lr": cfg.lr, "betas": cfg.betas, "weight_decay": cfg.weight_decay}
        try:
            fused = (cfg.fused_optimizer and not self.sharded) or None
            self.optimizer = torch.optim.AdamW(params, fused=fused, **options)
        except (RuntimeError, ValueError):  # no fused kernel for this device or dtype
            self.optimizer = torch.optim.AdamW(params, **options)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)

    def _shard(self) -> None:
        """FSDP2 over the data-parallel group (``asyncrl.roles.training.sharding``); the optimizer
        is made again over the sharded parameters."""
        assert self.dp is not None
        sh.shard(
            self.model,
            sharding_for(self.plugin),
            self.dp.world,
            activation_checkpointing=self.config.activation_checkpointing,
        )
        if self.config.model_path:
            path, rank, world = self.config.model_path, self.dp.rank, self.dp.world
            sh.load_pretrained_shards(self.model, path, rank, world, self.device)
        self._make_optimizer()

    async def teardown(self) -> None:
        await self.ctx.offload(self.journal.close)
        self.published.close()
        if self.dp is not None:
            await self.ctx.offload(self.dp.close)

    def status(self) -> dict[str, Any]:
        """The device's memory and this replica's share of it, for ``asyncrl status``."""
        return {} if self.share is None else self.share.status()

    def _lr_factor(self, step: int) -> float:
        return float(self.config.lr_factor(step))

    # -- endpoints ------------------------------------------------------------------------

    @endpoint(Delivery.ONCE)
    async def train_step(self, batch: TrainBatch) -> StepResult:
        try:
            return await self.ctx.offload(traced("training step", self._train_step), batch)
        except DataParallelError:
            if self.dp is not None and self.dp.broken:
                # A broken group never mends in place: exit, so that the supervisor restarts the
                # whole group (one_for_all) and the caller re-sends the batch to it.
                self.ctx.log.error(f"{self.ctx.name}: exiting: {self.dp.broken}")
                os._exit(1)
            raise

    @endpoint(Delivery.IDEMPOTENT)
    async def weights(self, _: Any) -> WeightsUpdate:
        # In the compute thread, after any step in progress: a copy taken on the event loop
        # could hold half-updated parameters under the old version (a relay pulls while the
        # learner trains), and copying a large model there would stall heartbeats.
        return await self.ctx.offload(traced("weight copy", self._weights))

    def _weights(self) -> WeightsUpdate:
        if self.sharded:
            return WeightsUpdate(*self.published.read())
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return WeightsUpdate(self.version, state)

    @endpoint(Delivery.IDEMPOTENT)
    async def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        if self.sharded:
            # Every forward pass of a sharded model is a collective of all its ranks.
            raise ValueError(
                f"{self.ctx.name}: a sharded learner (parallel: fsdp) does not serve logprobs: "
                f"a forward pass needs every rank; compute them with a reference role"
            )
        return await self.ctx.offload(self._logprobs, samples)

    @endpoint(Delivery.IDEMPOTENT)
    async def export(self, path: str) -> str:
        return await self.ctx.offload(self._export, path)

    @endpoint(Delivery.IDEMPOTENT, name="status")
    async def learner_status(self, _: Any) -> LearnerStatus:
        """The learner's progress (version, step, ledger size): the ``status`` endpoint."""
        return LearnerStatus(
            version=self.version,
            step=self.step,
            consumed=len(self.consumed),
            keep=self.keep,
            last=self.last,
            durable=self.journal.mode != "off",
            replayed=self.replayed_steps,
            restored_step=self.restored_step,
            # How GRPO advantages are computed here: a program's sample pipeline attaches
            # advantages computed the same way (asyncrl.roles.sampling.pipeline.group_advantages).
            advantages={"normalize_std": self.config.normalize_std, "std": self.config.std},
        )

    # -- compute (worker thread) ------------------------------------------------------------

    def _forward_logprobs(self, samples: list[Sample], compiled: bool = False) -> Forward:
        """The forward pass on the samples' left-padded rows, the target mask honouring their
        loss masks; ``compiled``: through the compiled graph of the rows' length bucket."""
        rows = ([s.prompt_ids for s in samples], [s.token_ids for s in samples])
        input_ids, attention, positions, target = (
            t.to(self.device) for t in pad_batch(*rows, self.config.pad_id, loss_masks(samples))
        )
        run: Any = self._model_logprobs
        if compiled and self.compiled is not None:
            run = self.compiled.forward
        logprobs, logits = run(input_ids, attention, positions)
        return Forward(logprobs[:, :-1], target, logits[:, :-1])

    def _model_logprobs(
        self, input_ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's log-prob of the next one, [B, L] (the last column 0), and the logits
        [B, L, V]: every output keeps the input's length, so a compiled graph's padded outputs
        are cut back (``Compiler.compile``)."""
        logits = self.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=False
        ).logits
        # At least float32 (a bf16 model's logits are widened); a float64 model keeps float64.
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        logprobs = self.plugin.ops.logprobs(logits[:, :-1], input_ids[:, 1:])
        return torch.nn.functional.pad(logprobs, (0, 1)), logits

    def _logprobs(self, samples: list[Sample]) -> list[list[float]]:
        self.model.eval()
        try:
            with torch.no_grad():
                logprobs, target, _ = self._forward_logprobs(samples)
        finally:
            self.model.train(self.config.dropout)
        out = []
        for i, s in enumerate(samples):
            n = len(s.token_ids)
            out.append(logprobs[i, logprobs.shape[1] - n :].tolist() if n else [])
        del target
        return out

    def _train_step(self, batch: TrainBatch) -> StepResult:
        rng = self._step_rng()
        if batch.id and batch.id == self.last.get("id"):
            # Re-sent after a failure that lost the reply: the step happened; say what it did.
            result = msgspec.convert(self.last["result"], StepResult)
            result.replayed = True
            return result
        objective = batch_objective(self.config, batch, self.ctx.name)
        graphs, started = 0, time.perf_counter()
        if self.compiled is not None:
            objective = self.compiled.objective(objective, batch)
            graphs = self.compiled.graphs()
        if self.dp is not None:
            ids = [(s.sample.prompt_id, s.sample.sample_index) for s in batch.samples]
            self.dp.check_same(
                "the batch",
                [self.step, self.version, fingerprint(batch.id, ids, batch.lr, batch.algorithm)],
                ["step", "version", "batch"],
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
                group["lr"] = batch.lr * self._lr_factor(self.scheduler.last_epoch)
        if fresh:
            self.env_tokens_trained = 0.0
            metrics = self._train(objective, fresh, batch)
            if any(s.sample.loss_mask for s in fresh):  # episodes: 0 unless the mask broke
                metrics["env_tokens_trained"] = self.env_tokens_trained
                # ... and 0 unless an episode the environment failed reached the learner
                metrics["infra_failed_trained"] = float(
                    sum(bool(s.sample.infra_failed) for s in fresh)
                )
            self.step += 1
            self.version += 1
            ids = [(s.sample.prompt_id, s.sample.sample_index) for s in fresh]
            self.consumed.update(ids)
            metrics["reward_mean"] = float(np.mean([s.reward for s in fresh]))
            if self.share is not None:  # the step's footprint, before any release
                metrics["memory_allocated_mib"] = self._memory_allocated_mib()
            if self.compiled is not None:
                seconds = time.perf_counter() - started
                self.compiled.report(graphs, seconds, metrics, self.ctx.log, self.ctx.name)
            if objective.algorithm.rl:
                # Measured against the version that consumed them: the one before this step.
                ages = [staleness(self.version - 1, s.sample.policy_versions) for s in fresh]
                metrics.update({f"staleness_{k}": v for k, v in percentiles(ages).items()})
        self.keep = self.keep.merged(batch.keep)
        result = StepResult(
            version=self.version,
            step=self.step,
            consumed=len(fresh),
            skipped=skipped,
            metrics=metrics,
        )
        if fresh:
            self.last = {"id": batch.id, "result": msgspec.to_builtins(result)}
            self._durable_step(batch, ids, skipped, rng)
            if self.replaying:
                return result
            traced("weight publish", self.published.publish)(self.version)
            if self.share is not None:  # placement.release_when_idle: the cache goes back
                self.share.idle()
        return result

    def _train(
        self, objective: Objective, fresh: list[Scored], batch: TrainBatch
    ) -> dict[str, float]:
        """The advantages over the whole batch, then ``ppo_epochs x mini_batches`` optimizer
        steps (one for BC); returns the metrics averaged over the steps, and their count."""
        cfg = self.config
        advantages = objective.advantages(cfg, fresh)
        epochs, parts = 1, 1
        if objective.algorithm.rl:
            # Samples the ledger skipped may leave fewer than mini_batches: one each, then.
            epochs, parts = cfg.ppo_epochs, min(cfg.mini_batches, len(fresh))
        proximal = None
        if objective.needs_proximal and epochs * parts > 1:
            proximal = self._proximal_logprobs(fresh, objective, advantages)
        steps = []
        # BC on a few demonstrations memorises them unless dropout is on (``bc_dropout``); RL
        # steps keep it as ``dropout`` says, so their log-probs are the sampler's.
        self.model.train(cfg.dropout or (cfg.bc_dropout and not objective.algorithm.rl))
        try:
            for epoch in range(epochs):
                split = mini_batch_indices(
                    len(fresh), parts, seed=cfg.seed, step=self.step, epoch=epoch
                )
                for part in split:
                    steps.append(
                        self._optimizer_step(
                            objective,
                            [fresh[i] for i in part],
                            [advantages[i] for i in part],
                            None if proximal is None else [proximal[i] for i in part],
                            batch.demos,
                        )
                    )
        finally:
            self.model.train(cfg.dropout)
        if self.dp is not None:
            steps = self.dp.sum_metrics(steps)
        zeros = zero_rows.zero_advantage_metric(objective, advantages, cfg.skip_zero_advantage)
        return {**mean_over_steps(steps), "optimizer_steps": float(len(steps)), **zeros}

    def _memory_allocated_mib(self) -> float:
        """The device memory this process holds, read at most every ``MEMORY_EVERY_S``."""
        assert self.share is not None
        now = time.monotonic()
        if now - self._memory_at >= MEMORY_EVERY_S:
            self._memory_mib = self.share.memory().allocated / 2**20
            self._memory_at = now
        return self._memory_mib

    def _proximal_logprobs(
        self, batch: list[Scored], objective: Objective, advantages: list[Any]
    ) -> list[list[float]]:
        """Decoupled PPO's proximal policy: the log-probs of the ``batch`` under the weights at
        its start (no gradient), of the rows ``trained_rows`` keeps (a row left out has a loss
        of 0 whatever they are: its behaviour log-probs stand in). Data-parallel ranks compute
        their token-balanced shares and gather them."""
        rows = zero_rows.trained_rows(objective, advantages, self.config.skip_zero_advantage)
        out = [list(s.sample.logprobs) for s in batch]
        for i, logprobs in zip(rows, self._proximal_of([batch[i] for i in rows]), strict=True):
            out[i] = logprobs
        return out

    def _proximal_of(self, samples: list[Scored]) -> list[list[float]]:
        shares, rank = share_out(samples, self.dp)
        mine = [samples[i] for i in shares[rank]]
        out: list[list[float]] = []
        chunks = micro_batches(mine, self.config.micro_batch_tokens) if mine else []
        for chunk in chunks:
            out += self._logprobs([mine[i].sample for i in chunk])
        if self.sharded:
            assert self.dp is not None
            sh.keep_pace(self.model, samples, self.dp, self.config, len(chunks), backward=False)
        if self.dp is None:
            return out
        return self.dp.gather_rows(out, shares, [len(s.sample.token_ids) for s in samples])

    def _optimizer_step(
        self,
        objective: Objective,
        samples: list[Scored],
        advantages: list[Any],
        proximal: list[list[float]] | None,
        demos: list[Sample],
    ) -> dict[str, float]:
        """One optimizer and scheduler step on a mini-batch; returns its metrics.

        Each micro-batch weighs what it adds to the mini-batch's aggregate (its tokens for a
        token mean, its non-empty sequences for a sequence mean), so the summed gradient is the
        mini-batch's whatever the split.
        """
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        mask = completion_mask([len(s.sample.token_ids) for s in samples], loss_masks(samples))
        # The whole mini-batch's denominator, over the rows that can have a gradient.
        total = float(alg.aggregate_weight(mask, cfg.aggregation))
        rows = zero_rows.trained_rows(objective, advantages, cfg.skip_zero_advantage)
        if skipped := len(samples) - len(rows):
            samples, advantages, mask = (
                [samples[i] for i in rows],
                [advantages[i] for i in rows],
                mask[rows],
            )
            proximal = None if proximal is None else [proximal[i] for i in rows]
        chunks, _ = rank_chunks(samples, mask, self.dp, cfg.micro_batch_tokens, cfg.aggregation)
        shares = [float(alg.aggregate_weight(mask[chunk], cfg.aggregation)) for chunk in chunks]
        for chunk, share in zip(chunks, shares, strict=True):
            weight = share / total if total else 0.0
            loss, parts = self._loss(
                objective,
                [samples[i] for i in chunk],
                [advantages[i] for i in chunk],
                None if proximal is None else [proximal[i] for i in chunk],
            )
            (loss * weight).backward()  # type: ignore[no-untyped-call]
            for key, value in parts.items():
                sums[key] = sums.get(key, 0.0) + value * weight
        if skipped:
            sums = zero_rows.over_trained_rows(
                sums, total, float(alg.aggregate_weight(mask, cfg.aggregation))
            )
        if self.sharded:
            assert self.dp is not None
            sh.keep_pace(self.model, samples, self.dp, cfg, len(chunks), backward=True)
            # Every rank runs the BC term's passes (collectives), each a 1/world share of it.
            bc = self._bc_term(demos, 1.0 / self.dp.world)
            if self.dp.rank == 0:
                sums.update(bc)
        elif self.dp is None or self.dp.rank == 0:  # once: the reduction sums the ranks' grads
            sums.update(self._bc_term(demos))
        if self.dp is not None and not self.sharded:  # sharded: FSDP reduce-scatters them
            self.dp.all_reduce_grads(self.model.parameters())
        grad_norm = sh.full_tensor(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        )
        lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        return {**sums, "grad_norm": float(grad_norm), "lr": lr}

    def _micro_batches(self, samples: list[Scored]) -> list[list[int]]:
        return micro_batches(samples, self.config.micro_batch_tokens)

    def _advantages(self, algorithm: str, samples: list[Scored]) -> list[Any]:
        return batch_advantages(self.config, algorithm, samples)

    def _loss(
        self,
        objective: Objective,
        samples: list[Scored],
        advantages: list[Any],
        proximal: list[list[float]] | None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's forward pass and its loss under ``objective``."""
        forward = self._forward_logprobs([s.sample for s in samples], self.config.compile)
        self.env_tokens_trained += env_tokens_in(forward.target, [s.sample for s in samples])
        return objective(MicroBatch(samples, advantages, proximal, forward))

    def _bc_term(self, demos: list[Sample], share: float = 1.0) -> dict[str, float]:
        """Backpropagate the optional BC term over the batch's demonstrations, once per
        optimizer step (``share`` of it: each sharded rank backpropagates its part)."""
        coef = bc_coef(self.config, self.step)
        if not (coef and demos):
            return {}
        demo_logp, demo_target, _ = self._forward_logprobs(demos)
        loss = nll(self.config, demo_logp, demo_target)
        (coef * share * loss).backward()  # type: ignore[no-untyped-call]
        return {"bc_nll": float(loss.detach())}

    def _export(self, path: str) -> str:
        where = writable(path, self.ctx.name, self.ctx.run_dir, self.config.write_paths)
        if self.sharded:
            model = self.published.whole_model()
            return export_pretrained(model, where, self.config.tokenizer_path)
        return export_pretrained(self.model, where, self.config.tokenizer_path)
