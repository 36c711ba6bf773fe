"""The critic role: a value model giving per-token values, trained towards GAE returns (PPO).

The model is a transformer with a one-output token-classification head
(``AutoModelForTokenClassification``, ``num_labels=1``), built from a config or loaded from a
path. ``values`` returns, for each completion token, the value of the state just before it:
the head's output at the position that predicts that token, so it lines up with the policy's
log-probs token for token.

``train_step`` computes the returns from each sample's reward (on its last token) and the values
recorded when the sample was scored (``Scored.values``), with the learner's own function
(``asyncrl.roles.learning.batching.gae_targets``), once for the whole batch, and then takes
``ppo_epochs x mini_batches`` clipped value-loss steps, as the learner does with its policy
(verl's critic the same): each epoch shuffles the samples into ``mini_batches`` mini-batches
(seeded by ``seed``, the critic's step and the epoch) and each mini-batch makes one AdamW step,
its forward and backward passes cut into micro-batches of at most ``micro_batch_tokens`` tokens
whose gradients accumulate, each weighed by its share of the mini-batch's aggregate (so the
step does not depend on the cut). The targets and the old values that the value clip is taken
around stay those of the batch across every step. The defaults (one epoch, one mini-batch) take
one step per batch. It replies with a ``CriticStepResult``: the step count, the optimizer steps
taken and the loss figures averaged over them (a fixed set, so typed fields rather than the
learner's open metrics dict).

The model, its placement and sharding, the optimizer and the micro-batched step belong to its
``Trainer`` (``asyncrl.roles.training.trainer``), the learner's too: the clipped value loss is
the objective the critic hands it (``_optimizer_step``).

The returns must be the ones the learner's advantages came from, so the settings that shape
them (``gamma``, ``lam``, and with ``kl_mode: reward`` the per-token penalty ``-kl_coef * KL``
with ``kl_estimator``) mirror the learner's config; ``check_matches_learner`` says where two
configs disagree. The epochs and mini-batches need not match the learner's.

**Replicas** (``replicas: K``, ``supervision.strategy: one_for_all``) form one torch.distributed
group, as a data-parallel learner's do (``asyncrl.roles.training.data_parallel``): they either
replicate the model and all-reduce gradients or, with ``parallel: fsdp``, shard parameters,
gradients and AdamW's state with FSDP2 (``asyncrl.roles.training.sharding``, docs/sharding.md).
Every call then runs on every rank, in one order that replica 0 sets, through the lockstep the
learner's ranks use too (``asyncrl.roles.training.lockstep``): callers reach the critic through
replica 0 only (``CriticClient`` does), which broadcasts each call (``Values``, ``TrainStep``)
to the other ranks before it runs it; another replica refuses a call sent to it. Each rank
works on its token-balanced share of the samples (``token_shares``): ``values`` gathers the
ranks' rows, ``train_step`` sums their gradients, so K ranks give the values and take the step
one critic would, within float rounding. A rank that dies, or a call that fails on any rank,
breaks the group: every rank exits and ``one_for_all`` restarts the group.

**Durable** (``durable: wal``, the default, as the learner): each step's batch is in a
write-ahead log before the reply, checkpoints are written in the background, and a restarted
critic (or group) loads the newest and replays the steps after it, bit for bit
(``asyncrl.roles.training.durability``, as the learner's); a batch re-sent with its id gets the
step's result back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

import msgspec
import torch

from asyncrl.plugins.registry import current as current_plugin
from asyncrl.plugins.registry import device_for
from asyncrl.role import Delivery, Role, endpoint
from asyncrl.roles.device_report import DeviceShare
from asyncrl.roles.generation.rollout import Sample
from asyncrl.roles.learning import algorithms as alg
from asyncrl.roles.learning.batching import (
    check_norm_len,
    completion_mask,
    gae_targets,
    loss_masks,
    mean_over_steps,
)
from asyncrl.roles.payloads import CriticBatch, CriticStepResult, Scored
from asyncrl.roles.training.data_parallel import (
    DataParallel,
    fingerprint,
    join_role,
    state_checksum,
)
from asyncrl.roles.training.durability import Durability
from asyncrl.roles.training.lockstep import Lockstep, exit_when_broken, leave
from asyncrl.roles.training.trainer import Trainer, TrainerSettings

__all__ = [
    "RETURN_SETTINGS",
    "Critic",
    "TrainStep",
    "Values",
    "check_matches_learner",
    "value_model",
    "value_targets",
]

RETURN_SETTINGS = ("gamma", "lam", "kl_mode", "kl_coef", "kl_estimator")
"""The config keys, shared by learner and critic, that shape PPO's returns."""

_DEFAULTS = {"gamma": 1.0, "lam": 0.95, "kl_mode": "loss", "kl_coef": 0.0, "kl_estimator": "k3"}


class Values(msgspec.Struct, tag="values", forbid_unknown_fields=True):
    """``Critic.values`` on these samples, as every rank of a group runs it (``Lockstep``)."""

    samples: list[Sample]


class TrainStep(msgspec.Struct, tag="train_step", forbid_unknown_fields=True):
    """``Critic.train_step`` on this batch (``id``: its ``CriticBatch.id``), as every rank of a
    group runs it (``Lockstep``)."""

    batch: list[Scored]
    id: str = ""


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


def value_model(config: Any) -> torch.nn.Module:
    """The value model of a critic's config: a one-output token-classification head on
    ``model_path``'s body (a new head) or on one built from ``model_config``.

    Raises:
        ValueError: neither is set.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    auto: Any = AutoModelForTokenClassification  # its class methods are untyped
    if config.model_path:
        model: torch.nn.Module = auto.from_pretrained(config.model_path, num_labels=1)
    elif config.model_config:
        model = auto.from_config(AutoConfig.for_model(**config.model_config, num_labels=1))
    else:
        raise ValueError("critic: set model_path or model_config")
    return model


def value_targets(config: Any, batch: list[Scored]) -> tuple[torch.Tensor, torch.Tensor]:
    """The old values and the return targets of ``batch`` under a critic's ``config``, [B, T]
    right-aligned (T: the longest completion): the same returns the learner's advantages come
    from (``gae_targets``)."""
    _, returns, mask = gae_targets(
        batch,
        gamma=config.gamma,
        lam=config.lam,
        kl_coef=config.kl_coef,
        kl_estimator=config.kl_estimator,
        kl_mode=config.kl_mode,
    )
    old = torch.zeros_like(mask)
    for i, s in enumerate(batch):
        if s.values:
            old[i, mask.shape[1] - len(s.values) :] = torch.tensor(s.values)
    return old, returns


T = TypeVar("T")


class Critic(Role):
    """Serves per-token values and learns them. With replicas (replicated, or sharded with
    ``parallel: fsdp``), callers send every call to replica 0, which runs it on every rank in
    one order (docs/sharding.md)."""

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        """The critic's settings (``roles.<name>.config`` in the manifest).

        Attributes:
            model_path: a local Hugging Face model directory; empty: build from model_config.
            model_config: ``AutoConfig.for_model`` keywords for a model built from scratch.
            seed: seeds the model's initialisation (its value head's, from a model_path) and
                the mini-batch shuffle.
            lr: AdamW's learning rate.
            grad_clip: the gradient's maximum norm, at every optimizer step.
            gamma, lam, kl_coef, kl_estimator, kl_mode: the return settings; they must be the
                learner's (``check_matches_learner``).
            clip_eps: the value clip around the values recorded at scoring (None: no clip).
            aggregation, norm_len: how per-token losses become one number, as the learner's.
            ppo_epochs: passes over each batch (>= 1).
            mini_batches: optimizer steps per pass (>= 1, at most the batch's samples).
            micro_batch_tokens: prompt and completion tokens per forward (and backward) pass,
                in ``values`` and in ``train_step`` (>= 1; a longer sample is a pass alone).
            pad_id: the token id of padding.
            dtype: the value model's dtype: empty: the hardware plugin's (``float32`` on
                cpu, ``bfloat16`` on cuda; with ``parallel: fsdp``, float32 parameters
                computed in the plugin's mixed precision); or ``float32``, ``bfloat16``,
                ``float16``, ``float64``. Values and their loss are computed in at least
                float32 (float64 in a float64 model).
            dist_backend: the torch.distributed backend of the replicas' group (``replicas``
                > 1): empty: the hardware plugin's (``gloo`` on cpu, ``nccl`` on cuda).
            dist_timeout_s: the longest the replicas wait for each other, to form their group
                or in a collective (a follower waiting for replica 0's next call included:
                replica 0 says it is alive every quarter of it), before the group breaks.
            parallel: how ``replicas`` > 1 share the model: ``replicate`` (each rank holds all
                of it and all-reduces gradients) or ``fsdp`` (FSDP2 shards parameters,
                gradients and optimizer state over the ranks: docs/sharding.md). Either way
                replica 0 leads every call. One replica: no effect.
            activation_checkpointing: with ``fsdp``, recompute each block's activations in the
                backward pass instead of keeping them (less memory, about a third more compute).
            durable: as the learner's: ``wal`` (a write-ahead log of each step, checkpoints
                in the background, a restart replays), ``checkpoint`` (a whole checkpoint
                before every reply) or ``false`` (a restart goes back to the last checkpoint).
            checkpoint_every: steps between checkpoints with ``wal`` or ``false`` (0: none by
                count); with ``wal`` it bounds the steps a restart replays.
            checkpoint_every_s: seconds between those checkpoints, whichever comes first.
            keep_checkpoints: the newest checkpoints kept (at least 2 with replicas).
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
        micro_batch_tokens: int = 8192
        pad_id: int = 0
        dtype: Literal["", "float32", "float64", "bfloat16", "float16"] = ""
        dist_backend: str = ""
        dist_timeout_s: float = 300.0
        parallel: Literal["replicate", "fsdp"] = "replicate"
        activation_checkpointing: bool = False
        durable: bool | Literal["wal", "checkpoint"] = "wal"
        checkpoint_every: int = 100
        checkpoint_every_s: float = 600.0
        keep_checkpoints: int = 2

        def __post_init__(self) -> None:
            check_norm_len(self.aggregation, self.norm_len)
            for name in ("ppo_epochs", "mini_batches", "micro_batch_tokens"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)!r}")
            if not self.dist_timeout_s > 0:
                raise ValueError(
                    f"dist_timeout_s: expected a number > 0, got {self.dist_timeout_s!r}"
                )

    share: DeviceShare | None = None
    dp: DataParallel | None = None
    lockstep: Lockstep | None = None

    async def setup(self) -> None:
        # In the worker thread: importing transformers and building the model take seconds,
        # and the loop must keep answering heartbeats meanwhile.
        await self.ctx.offload(self._build)
        if self.ctx.group_size > 1:
            cfg = self.config
            self.dp = await self.ctx.offload(
                join_role, self.ctx, cfg.dist_backend, cfg.dist_timeout_s, self.device
            )
            await self.ctx.offload(self.trainer.join, self.dp)
        cfg = self.config
        self.durability = Durability(
            self.ctx,
            durable=cfg.durable,
            every=cfg.checkpoint_every,
            every_s=cfg.checkpoint_every_s,
            keep=cfg.keep_checkpoints if self.dp is None else max(2, cfg.keep_checkpoints),
            dp=self.dp,
            pin=self.plugin.device.pin,
            step_log=False,  # its batches are the learner's, which keeps the ledger
            sharded=self.trainer.sharded,
        )
        # The newest checkpoint, then the logged steps after it: only then does it serve.
        await self.ctx.offload(self._restore)
        if self.dp is not None:
            await self.ctx.offload(self._check_same_start)
            self.lockstep = Lockstep(
                self.dp,
                (Values, TrainStep),
                self._working(self._call),
                on_broken=exit_when_broken(self.ctx),
                client="CriticClient",
                thread_setup=self._select_device,
                members=self.ctx.members,
            )
            self.lockstep.start()

    def _build(self) -> None:
        cfg = self.config
        # Device, dtype and RNG seeding come from the hardware plugin registry.
        self.plugin = current_plugin()
        self.device = device_for(self.ctx.device, self.plugin)
        # Before the model lands on a device it may share: the placement's memory share.
        self.share = DeviceShare.for_role(self.ctx, self.device, self.plugin)
        # Seeded either way (the trainer seeds before it builds): a pretrained body gets a new
        # value head, the same on every rank. No dropout: values must not depend on the call.
        settings = TrainerSettings(
            seed=cfg.seed,
            lr=cfg.lr,
            grad_clip=cfg.grad_clip,
            aggregation=cfg.aggregation,
            micro_batch_tokens=cfg.micro_batch_tokens,
            pad_id=cfg.pad_id,
            dtype=cfg.dtype,
            sharded=cfg.parallel == "fsdp" and self.ctx.group_size > 1,
            activation_checkpointing=cfg.activation_checkpointing,
        )
        build = lambda: value_model(cfg)  # noqa: E731
        self.trainer = Trainer(settings, build, plugin=self.plugin, device=self.device)
        self.step = 0

    def _check_same_start(self) -> None:
        """Raise unless every rank has the same config and step (and, replicated, the same
        weights): ranks that start apart would drift apart silently."""
        assert self.dp is not None
        values = [fingerprint(msgspec.json.encode(self.config)), self.step]
        labels = ["config", "step"]
        if not self.trainer.sharded:
            values.append(state_checksum(self.trainer.model))
            labels.append("weights")
        self.dp.check_same("the critic's start", values, labels)

    def _select_device(self) -> None:
        """This rank's device as the thread's current one (the current device is per thread)."""
        device_for(self.ctx.device, self.plugin)

    async def teardown(self) -> None:
        # The group's calls end first (a follower waits for the leader's Close): no step is
        # in progress when the log closes.
        if self.lockstep is not None and not await leave(
            self.ctx, self.lockstep, self.config.dist_timeout_s
        ):
            return  # its thread is still in a collective: leave the group to the exit
        await self.ctx.offload(self.durability.close)
        if self.dp is not None:
            await self.ctx.offload(self.dp.close)

    # -- endpoints ------------------------------------------------------------------------

    @endpoint(Delivery.IDEMPOTENT)
    async def values(self, samples: list[Sample]) -> list[list[float]]:
        if self.lockstep is None:
            return await self.ctx.offload(self._working(self._values), samples)
        self.lockstep.check_leader("values")
        out: list[list[float]] = await self.ctx.offload(self.lockstep.lead, Values(samples))
        return out

    @endpoint(Delivery.ONCE)
    async def train_step(self, batch: CriticBatch | list[Scored]) -> CriticStepResult:
        if not isinstance(batch, CriticBatch):
            batch = CriticBatch(batch)
        if self.lockstep is None:
            self._check_batch(batch.samples)
            return await self.ctx.offload(self._working(self.train), batch)
        self.lockstep.check_leader("train_step")
        self._check_batch(batch.samples)  # before every rank has it: a refusal breaks nothing
        call = TrainStep(batch.samples, batch.id)
        result: CriticStepResult = await self.ctx.offload(self.lockstep.lead, call)
        return result

    def _call(self, call: Values | TrainStep) -> Any:
        """Run one call of the group on this rank (``Lockstep.run``)."""
        self._select_device()
        if isinstance(call, Values):
            return self._values(call.samples)
        return self.train(CriticBatch(call.batch, call.id))

    def _working(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn`` as a unit of work of the device share (released after, when idle)."""
        return fn if self.share is None else self.share.working(fn)

    def status(self) -> dict[str, Any]:
        """The device's memory and this replica's share of it, for ``asyncrl status``."""
        return {} if self.share is None else self.share.status()

    # -- compute (worker thread) ------------------------------------------------------------

    def _forward(self, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        """The values of every position that predicts a token, [B, L-1] in at least float32,
        and the target mask of the completion tokens (``pad_batch``)."""
        input_ids, attention, positions, target = self.trainer.inputs(samples)
        out = self.trainer.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=False
        )
        values = out.logits[:, :-1, 0]
        return values.to(torch.promote_types(values.dtype, torch.float32)), target

    def _value_rows(self, samples: list[Sample]) -> list[list[float]]:
        """Each sample's values, from one forward pass (no gradient)."""
        values, _ = self._forward(samples)
        width = values.shape[1]
        return [
            values[i, width - len(s.token_ids) :].tolist() if s.token_ids else []
            for i, s in enumerate(samples)
        ]

    def _values(self, samples: list[Sample]) -> list[list[float]]:
        """Each sample's values; with replicas, each rank computes those of its token share
        and the ranks gather them (every rank returns all of them)."""
        if not samples:
            return []
        scored = [Scored(sample=s) for s in samples]  # what the shares and micro-batches read
        return self.trainer.rows(scored, self._value_rows, what="the values' all-gather")

    def _check_batch(self, batch: list[Scored]) -> None:
        """Raise unless ``batch`` can be split into ``mini_batches``.

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

    def train(self, critic_batch: CriticBatch | list[Scored]) -> CriticStepResult:
        """``ppo_epochs x mini_batches`` value-loss steps on the batch, in the calling thread
        (``train_step`` runs it in the compute thread, on every rank of a group); the metrics
        averaged over the steps, and their count (the last step's result, for its batch
        re-sent).

        Raises:
            ValueError: the batch holds fewer samples than ``mini_batches``.
        """
        if not isinstance(critic_batch, CriticBatch):
            critic_batch = CriticBatch(critic_batch)
        rng = self.durability.step_rng()
        repeat = self.durability.repeat(critic_batch.id, CriticStepResult)
        if repeat is not None:
            return repeat
        cfg, batch = self.config, critic_batch.samples
        self._check_batch(batch)
        old, returns = value_targets(cfg, batch)

        def mini_batch(part: list[int]) -> dict[str, float]:
            return self._optimizer_step([batch[i] for i in part], old[part], returns[part])

        steps = self.trainer.train_epochs(
            len(batch),
            epochs=cfg.ppo_epochs,
            parts=cfg.mini_batches,
            step=self.step,
            run=mini_batch,
        )
        self.step += 1
        means = mean_over_steps(steps)
        result = CriticStepResult(
            step=self.step,
            optimizer_steps=len(steps),
            value_loss=means["value_loss"],
            value_clip_fraction=means["value_clip_fraction"],
            grad_norm=means["grad_norm"],
        )
        self.durability.took(critic_batch.id, result)
        self.durability.made_durable(self.step, critic_batch, rng, self._state)
        return result

    # -- durable state (worker thread) -------------------------------------------------------

    def _restore(self) -> None:
        """The newest checkpoint, then the logged steps after it (``Durability.restore``)."""
        self.durability.restore(
            load=self._load,
            replay=lambda data: self.train(msgspec.msgpack.decode(data, type=CriticBatch)).step,
            state=self._state,
        )

    def _state(self) -> dict[str, Any]:
        """The critic's part of a checkpoint: its trainer's state and its step."""
        return {**self.trainer.state(), "step": self.step}

    def _load(self, state: dict[str, Any], group: list[dict[str, Any]] | None) -> int:
        """Put back a checkpoint's state (``group``: every rank's of the group that wrote it,
        resharded to this one's size)."""
        if group is None:
            self.trainer.load_state(state)
        else:
            self.trainer.load_states(group)
        self.step = int(state["step"])
        return self.step

    def _optimizer_step(
        self, samples: list[Scored], old: torch.Tensor, returns: torch.Tensor
    ) -> dict[str, float]:
        """One clipped value-loss step on a mini-batch (``Trainer.optimizer_step``); ``old``
        and ``returns`` are its rows of the batch's [B, T] right-aligned targets.

        Each micro-batch weighs its part of the mini-batch's aggregate (the trainer's
        weight), so the gradients, summed over micro-batches and ranks, are the mini-batch's;
        the clip fraction is weighed by tokens, so it is the mini-batch's token mean."""
        cfg = self.config
        mask = completion_mask([len(s.sample.token_ids) for s in samples], loss_masks(samples))
        tokens = float(mask.sum())

        def value_loss(chunk: list[int], weight: float) -> tuple[torch.Tensor, dict[str, float]]:
            part = [samples[i] for i in chunk]
            values, target = self._forward([s.sample for s in part])
            # The targets' columns end where the completions end; the micro-batch's longest
            # completion may be shorter than the batch's.
            width = max(len(s.sample.token_ids) for s in part)
            rows_old, rows_returns = old[chunk], returns[chunk]
            rows_old = rows_old[:, rows_old.shape[1] - width :].to(values.device)
            rows_returns = rows_returns[:, rows_returns.shape[1] - width :].to(values.device)
            values = values[:, target.shape[1] - width :]
            target = target[:, target.shape[1] - width :]
            loss, stats = alg.value_loss(
                values,
                rows_old,
                rows_returns,
                target,
                cfg.clip_eps,
                cfg.aggregation,
                norm_len=cfg.norm_len,
            )
            counted = float(target.sum()) / tokens if tokens else 0.0
            return loss, {
                "value_loss": float(loss.detach()) * weight,
                "value_clip_fraction": float(stats["value_clip_fraction"]) * counted,
            }

        metrics = self.trainer.optimizer_step(samples, value_loss, mask=mask)
        # Both figures, 0 on a rank with no micro-batch of this mini-batch.
        return {"value_loss": 0.0, "value_clip_fraction": 0.0, **metrics}
