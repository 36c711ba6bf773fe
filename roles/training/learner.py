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
``asyncrl.roles.training.durability``, docs/reliability.md). ``durable: checkpoint`` writes a
whole checkpoint before every reply instead. ``export`` writes only into ``RUN_DIR/exports`` (a
relative path goes there) or the ``write_paths`` the manifest allows, never over the run's own
state (``asyncrl.roles.training.learner_export``).

**Replicas** (``replicas: K``, ``supervision.strategy: one_for_all``) form one torch.distributed
group, kept in step as the critic's is (``asyncrl.roles.training.lockstep``): callers send
``train_step`` and ``checkpoint`` to the group's lead (``LearnerClient`` does, through
``to_lead``: replica 0, or the lowest replica left once a node's loss took it out), which
announces each (``TrainStep``, ``Checkpoint``) to the other ranks and runs it with them, in one
order; another replica refuses them (``NotLeaderError``). Each rank gets the whole batch and
trains its token-balanced share of each mini-batch.
They either replicate the model and all-reduce gradients (``asyncrl.roles.training.data_parallel``)
or, with ``parallel: fsdp``, shard it (``asyncrl.roles.training.sharding``, docs/sharding.md);
either way the step is the one a single learner takes on the whole batch. Each rank keeps its own
step log and checkpoints; the group's lead (its rank 0) publishes the weights
(``asyncrl.roles.training.learner_weights``) and sends them to relays of other hosts
(``broadcast_weights``, ``asyncrl.weights.broadcast``).

The model, its placement and sharding, the optimizer and schedule and the micro-batched
optimizer step belong to its ``Trainer`` (``asyncrl.roles.training.trainer``); the learner holds
what makes it the policy's: the objective of each batch, its advantages, epochs and
mini-batches, the ledger, the version, and the endpoints.

Log-probs are computed with left padding and position ids derived from the attention mask, the
same convention as the rollout engine (``asyncrl.roles.learning.batching``), so the learner's
recompute of a sample equals its behaviour log-probs under the same weights.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgspec
import numpy as np
import torch

from asyncrl.observe.trace import span, traced
from asyncrl.plugins.registry import current as current_plugin
from asyncrl.plugins.registry import device_for
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
from asyncrl.roles.training.data_parallel import DataParallel, check_restored, join_role
from asyncrl.roles.training.durability import Durability
from asyncrl.roles.training.learner_config import LearnerConfig
from asyncrl.roles.training.learner_export import export_pretrained, writable
from asyncrl.roles.training.learner_weights import PublishedWeights
from asyncrl.roles.training.lockstep import Lockstep, exit_when_broken, leave
from asyncrl.roles.training.models import build_model, preload_model_class
from asyncrl.roles.training.objective import ALGORITHMS as _ALGORITHMS
from asyncrl.roles.training.objective import (
    MicroBatch,
    Objective,
    batch_objective,
    bc_coef,
    nll,
)
from asyncrl.roles.training.trainer import Trainer, TrainerSettings
from asyncrl.weights.broadcast import Rendezvous

__all__ = [
    "Checkpoint",
    "Learner",
    "Scored",
    "StepResult",
    "TrainBatch",
    "TrainStep",
    "batch_moments",
    "build_model",
    "check_norm_len",
    "gae_targets",
    "pad_batch",
]

ALGORITHMS = tuple(_ALGORITHMS)
"""The algorithms a ``TrainBatch`` may name (``asyncrl.roles.training.objective.ALGORITHMS``)."""

T = TypeVar("T")

MEMORY_EVERY_S = 1.0
"""The step metric ``memory_allocated_mib`` is read at most this often (on the host a read is
two files of /proc, a millisecond of a small step)."""


class TrainStep(msgspec.Struct, tag="train_step", forbid_unknown_fields=True):
    """``Learner.train_step`` on this batch, as every rank of a group runs it (``Lockstep``)."""

    batch: TrainBatch


class Checkpoint(msgspec.Struct, tag="checkpoint", forbid_unknown_fields=True):
    """``Learner.checkpoint`` of this position, as every rank of a group runs it
    (``Lockstep``)."""

    keep: ProgramState


def trainer_settings(cfg: LearnerConfig, sharded: bool) -> TrainerSettings:
    """The ``Trainer``'s settings from a learner's config; ``sharded``: ``parallel: fsdp``
    with replicas (a sharded rank reads its slices of ``model_path``)."""
    return TrainerSettings(
        seed=cfg.seed,
        lr=cfg.lr,
        betas=cfg.betas,
        weight_decay=cfg.weight_decay,
        fused_optimizer=cfg.fused_optimizer,
        grad_clip=cfg.grad_clip,
        aggregation=cfg.aggregation,
        micro_batch_tokens=cfg.micro_batch_tokens,
        pad_id=cfg.pad_id,
        dtype=cfg.dtype,
        sharded=sharded,
        activation_checkpointing=cfg.activation_checkpointing,
        dropout=cfg.dropout,
        pretrained=cfg.model_path if sharded else "",
        compile=cfg.compile,
    )


def policy_model(cfg: LearnerConfig, sharded: bool) -> torch.nn.Module:
    """The policy of a learner's config: ``model_path``'s, or one built from
    ``model_config``; a ``sharded`` rank builds a pretrained model empty (on ``meta``) and
    then reads only its own slices (``Trainer.join``)."""
    if sharded and cfg.model_path:
        model: torch.nn.Module = sh.empty_pretrained(cfg.model_path)
        return model
    built: torch.nn.Module = build_model(cfg.model_path, cfg.model_config, cfg.seed)
    return built


class Learner(Role):
    """Trains the policy; serves its weights, log-probs, checkpoints and exports."""

    Config = LearnerConfig
    share: DeviceShare | None = None
    lockstep: Lockstep | None = None

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
        self.env_tokens_trained = 0.0  # in this step's loss (episodes; see env_tokens_in)
        self.dp: DataParallel | None = None
        keep = cfg.keep_checkpoints
        if self.ctx.group_size > 1:
            self.dp = await self.ctx.offload(
                join_role, self.ctx, cfg.dist_backend, cfg.dist_timeout_s, self.device
            )
            keep = max(2, keep)  # a rank may have to go back one checkpoint to meet the others
            await self.ctx.offload(self.trainer.join, self.dp)
        self.durability = Durability(
            self.ctx,
            durable=cfg.durable,
            every=cfg.checkpoint_every,
            every_s=cfg.checkpoint_every_s,
            keep=keep,
            dp=self.dp,
            pin=self.plugin.device.pin,
            step_log=True,
            sharded=self.trainer.sharded,
        )
        # The newest checkpoint, then the logged steps after it: only then does it serve.
        await self.ctx.offload(traced("restore", self._restore))
        if self.dp is not None:
            await self.ctx.offload(
                check_restored,
                self.dp,
                None if self.trainer.sharded else self.trainer.model,
                self.step,
                self.version,
                self.consumed,
            )
        # One rank publishes: the ranks' weights are the same, bit for bit (sharded ranks
        # gather each bucket together, and the first writes it).
        self.published = PublishedWeights(
            self.ctx,
            self.trainer.model,
            dtype=self.trainer.dtype,
            sharded=self.trainer.sharded,
            bucket_bytes=cfg.bucket_mib * 2**20,
            enabled=cfg.publish_weights,
        )
        await self.ctx.offload(self.published.open, self.template, self.version)
        if self.dp is not None:
            # Last: from here on the group's collectives run only inside its calls.
            self.lockstep = Lockstep(
                self.dp,
                (TrainStep, Checkpoint),
                self._call,
                on_broken=exit_when_broken(self.ctx),
                client="LearnerClient",
                thread_setup=self._select_device,
                members=self.ctx.members,
            )
            self.lockstep.start()

    def _build(self) -> None:
        cfg = self.config
        # The hardware comes from the plugin registry: the device of this replica's placement,
        # the dtype (the plugin's unless the config names one), the RNGs and the operators.
        self.plugin = current_plugin()
        self.device = device_for(self.ctx.device, self.plugin)
        # Before the model lands on a device it may share: the placement's memory share.
        self.share = DeviceShare.for_role(self.ctx, self.device, self.plugin)
        sharded = cfg.parallel == "fsdp" and self.ctx.group_size > 1
        self.trainer = Trainer(
            trainer_settings(cfg, sharded),
            lambda: policy_model(cfg, sharded),
            plugin=self.plugin,
            device=self.device,
            schedule=cfg.lr_factor,
        )
        # The published tensors' names, dtypes and shapes, whole (sharding splits them).
        dtype = self.trainer.dtype
        self.template = {
            name: torch.empty(
                t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device="meta"
            )
            for name, t in self.trainer.model.state_dict().items()
        }
        self._memory_mib, self._memory_at = 0.0, -MEMORY_EVERY_S

    async def teardown(self) -> None:
        # The group's calls end first (a follower waits for the leader's Close): no step is
        # in progress when the log and the weight store close.
        if self.lockstep is not None and not await leave(
            self.ctx, self.lockstep, self.config.dist_timeout_s
        ):
            return  # its thread is still in a collective: leave the group to the exit
        await self.ctx.offload(self.durability.close)
        self.published.close()
        if self.dp is not None:
            await self.ctx.offload(self.dp.close)

    def _select_device(self) -> None:
        """This rank's device as the thread's current one (the current device is per thread)."""
        device_for(self.ctx.device, self.plugin)

    def _call(self, call: TrainStep | Checkpoint) -> Any:
        """Run one call of the group on this rank (``Lockstep.run``)."""
        self._select_device()
        if isinstance(call, TrainStep):
            return traced("training step", self.train)(call.batch)
        return traced("checkpoint", self._checkpoint)(call.keep)

    def _exclusive(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn``, kept apart from the group's calls on this rank (``Lockstep.exclusive``):
        what a replica computes from the model on its own never sees a step half-taken."""
        lockstep = self.lockstep
        if lockstep is None:
            return fn

        def run(*args: Any) -> T:
            with lockstep.exclusive():
                return fn(*args)

        return run

    def status(self) -> dict[str, Any]:
        """The device's memory and this replica's share of it, for ``asyncrl status``."""
        return {} if self.share is None else self.share.status()

    # -- endpoints ------------------------------------------------------------------------

    @endpoint(Delivery.ONCE)
    async def train_step(self, batch: TrainBatch) -> StepResult:
        if self.lockstep is None:
            return await self.ctx.offload(traced("training step", self.train), batch)
        self.lockstep.check_leader("train_step")
        # Before every rank has it: a refusal breaks nothing.
        batch_objective(self.config, batch, self.ctx.name)
        result: StepResult = await self.ctx.offload(self.lockstep.lead, TrainStep(batch))
        return result

    @endpoint(Delivery.IDEMPOTENT)
    async def weights(self, _: Any) -> WeightsUpdate:
        # In the compute thread, after any step in progress: a copy taken on the event loop
        # could hold half-updated parameters under the old version (a relay pulls while the
        # learner trains), and copying a large model there would stall heartbeats.
        return await self.ctx.offload(traced("weight copy", self._weights))

    def _weights(self) -> WeightsUpdate:
        if self.trainer.sharded:
            return WeightsUpdate(*self.published.read())
        return self._exclusive(self._copy_weights)()

    def _copy_weights(self) -> WeightsUpdate:
        state = {k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()}
        return WeightsUpdate(self.version, state)

    @endpoint(Delivery.IDEMPOTENT)
    async def broadcast_weights(self, rendezvous: Rendezvous) -> int:
        """Broadcast the latest published version to the relay waiting at ``rendezvous``;
        return that version (``PublishedWeights.broadcast``). In a thread of its own, not the
        compute thread: a step in progress goes on, and its publish lands in the store's other
        slot."""
        send = traced("weight broadcast", self.published.broadcast)
        return await asyncio.to_thread(send, rendezvous)

    @endpoint(Delivery.IDEMPOTENT)
    async def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        if self.trainer.sharded:
            # Every forward pass of a sharded model is a collective of all its ranks.
            raise ValueError(
                f"{self.ctx.name}: a sharded learner (parallel: fsdp) does not serve logprobs: "
                f"a forward pass needs every rank; compute them with a reference role"
            )
        return await self.ctx.offload(self._exclusive(self.trainer.logprobs), samples)

    @endpoint(Delivery.IDEMPOTENT)
    async def export(self, path: str) -> str:
        return await self.ctx.offload(self._exclusive(self._export), path)

    @endpoint(Delivery.IDEMPOTENT, name="status")
    async def learner_status(self, _: Any) -> LearnerStatus:
        """The learner's progress (version, step, ledger size): the ``status`` endpoint."""
        return LearnerStatus(
            version=self.version,
            step=self.step,
            consumed=len(self.consumed),
            keep=self.keep,
            last=self.durability.last,
            durable=self.durability.mode != "off",
            replayed=self.durability.replayed_steps,
            restored_step=self.durability.restored_step,
            # How GRPO advantages are computed here: a program's sample pipeline attaches
            # advantages computed the same way (asyncrl.roles.sampling.pipeline.group_advantages).
            advantages={"normalize_std": self.config.normalize_std, "std": self.config.std},
        )

    @endpoint(Delivery.ONCE)
    async def checkpoint(self, keep: ProgramState) -> str:
        """Keep ``keep`` (the program's position) durably; returns where it is kept (replica
        0's path, with replicas: every rank keeps it in its own checkpoints)."""
        if self.lockstep is None:
            return await self.ctx.offload(traced("checkpoint", self._checkpoint), keep)
        self.lockstep.check_leader("checkpoint")
        path: str = await self.ctx.offload(self.lockstep.lead, Checkpoint(keep))
        return path

    # -- durable state (worker thread) -------------------------------------------------------

    def _checkpoint(self, keep: ProgramState) -> str:
        self.keep = self.keep.merged(keep)
        return self.durability.keep_position(self.step, keep, self._state)

    def _merge_keep(self, keep: ProgramState) -> None:
        self.keep = self.keep.merged(keep)

    def _restore(self) -> None:
        """The newest checkpoint, the ledger up to it, the logged steps after it
        (``Durability.restore``)."""
        self.durability.restore(
            load=self._load,
            replay=lambda data: self.train(msgspec.msgpack.decode(data, type=TrainBatch)).step,
            state=self._state,
            ledger=self._set_consumed,
            keep=self._merge_keep,
        )

    def _set_consumed(self, consumed: set[tuple[str, int]]) -> None:
        self.consumed = consumed

    def _state(self) -> dict[str, Any]:
        """The learner's part of a checkpoint: its trainer's state (a sharded rank: its own
        shards), version, step and the program's position."""
        return {
            **self.trainer.state(),
            "version": self.version,
            "step": self.step,
            "keep": msgspec.to_builtins(self.keep),
        }

    def _load(self, state: dict[str, Any], group: list[dict[str, Any]] | None) -> int:
        """Put back a checkpoint's state (``group``: every rank's of the group that wrote it,
        resharded to this one's size)."""
        if group is None:
            self.trainer.load_state(state)
        else:
            self.trainer.load_states(group)
        self.version = state["version"]
        self.step = state["step"]
        self.keep = msgspec.convert(state["keep"], ProgramState)
        return self.step

    # -- compute (worker thread) ------------------------------------------------------------

    def train(self, batch: TrainBatch) -> StepResult:
        """Take one step on ``batch`` in the calling thread (``train_step`` runs it in the
        compute thread): the ledger's fresh samples, ``ppo_epochs x mini_batches`` optimizer
        steps, the step made durable and its weights published; a batch re-sent with the last
        step's id gets that step's result back (``replayed``).

        **The learning rate persists.** A batch with ``lr`` > 0 that takes a step makes ``lr``
        the peak learning rate from that step on (this step's optimizer steps included; the
        schedule's ``lr_factor`` scales it at each optimizer step): every later batch whose
        ``lr`` is 0 trains at it too, until a batch that takes a step gives another. ``lr`` 0
        never goes back to the config's ``lr``. A batch that takes no step (the ledger skips
        every sample) and a re-sent batch answered with its step's result leave the peak as it
        is. The peak is part of the optimizer's and the schedule's state: every checkpoint
        holds it, and a restarted learner has it back, from its checkpoint or from the logged
        batch its replay takes again.

        Raises:
            ValueError: an unknown algorithm or correction, or fewer samples than
                ``mini_batches``.
            DataParallelError: a collective failed.
        """
        rng = self.durability.step_rng()
        # Re-sent after a failure that lost the reply: the step happened; say what it did.
        repeat = self.durability.repeat(batch.id, StepResult)
        if repeat is not None:
            return repeat
        objective = batch_objective(self.config, batch, self.ctx.name)
        graphs, started = 0, time.perf_counter()
        if self.trainer.compiled is not None:
            objective = self.trainer.compiled.objective(objective, batch)
            graphs = self.trainer.compiled.graphs()
        fresh = [
            s
            for s in batch.samples
            if (s.sample.prompt_id, s.sample.sample_index) not in self.consumed
        ]
        skipped = len(batch.samples) - len(fresh)
        metrics: dict[str, float] = {}
        if fresh:
            if batch.lr:
                # A new peak: the schedule scales it from now on, and this step already uses
                # it. Only with a step taken: a batch that takes none is in no log, so a replay
                # would not set it again.
                self.trainer.set_peak_lr(batch.lr)
            self.env_tokens_trained = 0.0
            with span("training epochs"):  # advantages, mini-batches, optimizer steps
                metrics = self._epochs(objective, fresh, batch)
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
            if self.trainer.compiled is not None:
                seconds = time.perf_counter() - started
                self.trainer.compiled.report(graphs, seconds, metrics, self.ctx.log, self.ctx.name)
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
            self.durability.took(batch.id, result)
            record = {
                "step": self.step,
                "version": self.version,
                "ids": ids,
                "skipped": skipped,
                "incarnation": self.ctx.incarnation,
                "phase": self.keep.phase or "",
            }
            self.durability.made_durable(self.step, batch, rng, self._state, record)
            if self.durability.replaying:
                return result
            traced("weight publish", self.published.publish)(self.version)
            if self.share is not None:  # placement.release_when_idle: the cache goes back
                self.share.idle()
        return result

    def _epochs(
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

        def mini_batch(part: list[int]) -> dict[str, float]:
            return self._optimizer_step(
                objective,
                [fresh[i] for i in part],
                [advantages[i] for i in part],
                None if proximal is None else [proximal[i] for i in part],
                batch.demos,
            )

        # BC on a few demonstrations memorises them unless dropout is on (``bc_dropout``); RL
        # steps keep it as ``dropout`` says, so their log-probs are the sampler's.
        self.trainer.set_dropout(cfg.dropout or (cfg.bc_dropout and not objective.algorithm.rl))
        try:
            steps = self.trainer.train_epochs(
                len(fresh), epochs=epochs, parts=parts, step=self.step, run=mini_batch
            )
        finally:
            self.trainer.set_dropout(cfg.dropout)
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
        return self.trainer.rows(samples, self.trainer.logprobs)

    def _optimizer_step(
        self,
        objective: Objective,
        samples: list[Scored],
        advantages: list[Any],
        proximal: list[list[float]] | None,
        demos: list[Sample],
    ) -> dict[str, float]:
        """One optimizer and scheduler step on a mini-batch (``Trainer.optimizer_step``) under
        ``objective``; returns its metrics.

        The rows ``trained_rows`` leaves out (advantage 0) are left out of its passes, and the
        mini-batch's aggregate keeps its whole denominator; the BC term on the batch's
        demonstrations is backpropagated once.
        """
        cfg = self.config
        mask = completion_mask([len(s.sample.token_ids) for s in samples], loss_masks(samples))
        # The whole mini-batch's denominator, over the rows that can have a gradient.
        total = float(alg.aggregate_weight(mask, cfg.aggregation))
        rows = zero_rows.trained_rows(objective, advantages, cfg.skip_zero_advantage)
        adjust = None
        if len(samples) - len(rows):
            samples, advantages, mask = (
                [samples[i] for i in rows],
                [advantages[i] for i in rows],
                mask[rows],
            )
            proximal = None if proximal is None else [proximal[i] for i in rows]
            trained = float(alg.aggregate_weight(mask, cfg.aggregation))

            def adjust(sums: dict[str, float]) -> dict[str, float]:
                return zero_rows.over_trained_rows(sums, total, trained)

        def loss(chunk: list[int], weight: float) -> tuple[torch.Tensor, dict[str, float]]:
            value, parts = self._loss(
                objective,
                [samples[i] for i in chunk],
                [advantages[i] for i in chunk],
                None if proximal is None else [proximal[i] for i in chunk],
            )
            return value, {key: part * weight for key, part in parts.items()}

        return self.trainer.optimizer_step(
            samples,
            loss,
            mask=mask,
            total=total,
            adjust=adjust,
            once=lambda share: self._bc_term(demos, share),
        )

    def _loss(
        self,
        objective: Objective,
        samples: list[Scored],
        advantages: list[Any],
        proximal: list[list[float]] | None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's forward pass and its loss under ``objective``."""
        forward = self.trainer.forward([s.sample for s in samples], self.config.compile)
        self.env_tokens_trained += env_tokens_in(forward.target, [s.sample for s in samples])
        return objective(MicroBatch(samples, advantages, proximal, forward))

    def _bc_term(self, demos: list[Sample], share: float = 1.0) -> dict[str, float]:
        """Backpropagate the optional BC term over the batch's demonstrations, once per
        optimizer step (``share`` of it: each sharded rank backpropagates its part)."""
        coef = bc_coef(self.config, self.step)
        if not (coef and demos):
            return {}
        demo_logp, demo_target, _ = self.trainer.forward(demos)
        loss = nll(self.config, demo_logp, demo_target)
        (coef * share * loss).backward()  # type: ignore[no-untyped-call]
        return {"bc_nll": float(loss.detach())}

    def _export(self, path: str) -> str:
        where = writable(path, self.ctx.name, self.ctx.run_dir, self.config.write_paths)
        if self.trainer.sharded:
            model = self.published.whole_model()
            return export_pretrained(model, where, self.config.tokenizer_path)
        return export_pretrained(self.trainer.model, where, self.config.tokenizer_path)
