"""The learner's settings, validated when the role starts: ``roles.<name>.config`` of a
``asyncrl.roles.training.learner:Learner`` role in the manifest, also ``Learner.Config``."""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from asyncrl.roles.learning import algorithms as alg
from asyncrl.roles.learning.batching import check_norm_len
from asyncrl.roles.training.journal import durability

__all__ = ["LearnerConfig"]


def _check_at_least_one(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


class LearnerConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The learner's settings (``roles.<name>.config`` in the manifest).

    Attributes:
        model_path: a local Hugging Face model directory; empty: build from model_config.
        model_config: ``AutoConfig.for_model`` keywords for a model built from scratch.
        tokenizer_path: a tokenizer saved beside the model by ``export``.
        seed: seeds the model's initialisation, torch's RNG and the mini-batch shuffle.
        algorithm: ``grpo``, ``rloo``, ``ppo`` or ``bc``, for a batch that names none.
        lr: AdamW's peak learning rate (``TrainBatch.lr`` overrides it).
        betas: AdamW's betas.
        weight_decay: AdamW's decoupled weight decay.
        grad_clip: the gradient's maximum norm, at every optimizer step.
        lr_schedule: ``constant``, ``linear`` or ``cosine`` decay after the warm-up.
        warmup_steps: optimizer steps of linear warm-up (a batch takes ppo_epochs x
            mini_batches optimizer steps).
        total_steps: optimizer steps over which ``linear`` and ``cosine`` decay.
        clip_eps: PPO's clip range below 1: the ratio is clipped to ``1 - clip_eps``.
        clip_eps_high: the clip range above 1 (``1 + clip_eps_high``); None: clip_eps.
            Larger than clip_eps for DAPO's clip-higher. With ``importance: sequence``
            (GSPO) both are typically about a thousand times smaller: 3e-4 and 4e-4.
        dual_clip: caps the loss of a token with a negative advantage at ``dual_clip *
            |A|`` (> 1); None: no dual clip.
        importance: ``token``: each token's ratio is clipped; ``sequence`` (GSPO): each
            token carries its sequence's ratio, ``exp`` of the mean log-ratio over the
            sequence's tokens, clipped at the sequence level. Applies to the clipped ratio
            of the ``clip`` and ``decoupled`` corrections, not to ``tis`` weights.
        normalize_std: GRPO divides each group's centred rewards by its std (False: Dr.
            GRPO's plain centring).
        std: GRPO's std, ``population`` (over n) or ``unbiased`` (over n - 1).
        whiten_advantages: whiten the advantages over the batch's samples (GRPO, RLOO) or
            completion tokens (PPO).
        kl_coef: the weight of the KL to the reference (0: none).
        kl_estimator: ``k1``, ``k2`` or ``k3``, Schulman's estimators of that KL.
        kl_mode: ``loss`` (a term of the loss) or ``reward`` (PPO: in the per-token reward).
        entropy_coef: the weight of the entropy bonus (0: none).
        bc_coef: the weight of a BC term on the batch's demonstrations, at every optimizer
            step (0: none).
        bc_anneal_steps: batches over which bc_coef decays linearly to 0 (0: constant).
        gamma: PPO's discount.
        lam: PPO's GAE lambda.
        aggregation: how per-token losses become one number (``alg.aggregate``).
        norm_len: the constant of ``seq_mean_token_sum_norm`` (Dr. GRPO): the sampling
            budget, required by that aggregation.
        micro_batch_tokens: prompt and completion tokens per forward and backward pass.
        ppo_epochs: passes over each batch (>= 1). BC takes one pass whatever it says.
        mini_batches: optimizer steps per pass, each on an equal share of the batch's
            shuffled samples (>= 1, at most the batch's samples). BC takes one.
        checkpoint_every: steps (batches) between checkpoints with ``durable: wal`` or
            ``false`` (0: none by count). With ``wal`` it bounds the steps a restart replays.
        checkpoint_every_s: seconds between those checkpoints, whichever comes first (0: none
            by time).
        durable: what is on disk before a step replies (docs/reliability.md): ``wal`` (the
            step's batch, in a write-ahead log; checkpoints in the background; a restart
            replays the steps after the newest, bit for bit), ``checkpoint`` (a whole
            checkpoint before every reply: small models) or ``false`` (nothing: a restarted
            learner goes back to its last checkpoint and the run fails loudly). ``true`` is
            ``wal``.
        write_paths: directories besides ``RUN_DIR/exports`` that ``export`` may write into
            (never the run's own state, even when one of them holds the run directory).
        publish_weights: publish every version to the shared-memory weight store.
        keep_checkpoints: the newest checkpoints kept (at least 2 with data-parallel replicas:
            a rank may have to go back one to meet the others after a crash).
        pad_id: the token id of padding.
        dropout: keep the model's dropout on while training (off: the learner's log-probs
            of a sample equal its behaviour log-probs under the same weights).
        bc_dropout: keep the model's dropout on in behaviour-cloning steps only: with a few
            hundred demonstrations, BC without it can memorise them and stop generalising.
        dist_backend: the torch.distributed backend of data-parallel replicas (``replicas``
            > 1): empty: the hardware plugin's (``gloo`` on cpu, ``nccl`` on cuda).
        dtype: the parameters' dtype while training: empty: the hardware plugin's
            (``float32`` on cpu, ``bfloat16`` on cuda; float32 for a role placed on the
            host); ``float32``, ``bfloat16``, ``float16``, or ``float64`` where rounding must
            not hide a difference (the data-parallel equivalence test); the weights are
            published in it.
        dist_timeout_s: the longest data-parallel replicas wait for each other, to form
            their group or in a collective (a follower waiting for replica 0's next call
            included: replica 0 says it is alive every quarter of it), before failing with a
            ``DataParallelError``.
        parallel: how ``replicas`` > 1 share the model: ``replicate`` (each rank holds all of
            it and all-reduces gradients) or ``fsdp`` (FSDP2 shards parameters, gradients and
            optimizer state over the ranks: docs/sharding.md). Either way replica 0 leads every
            ``train_step`` and ``checkpoint``. One replica: no effect.
        activation_checkpointing: with ``fsdp``, recompute each block's activations in the
            backward pass instead of keeping them (less memory, about a third more compute).
        bucket_mib: with ``fsdp``, the most MiB of full tensors gathered at once to publish
            or export weights: no rank holds more than this beyond its shards.
        compile: compile the training forward pass and the policy loss with the hardware
            plugin's compiler (``torch.compile``), one graph per padded-length bucket (8, 12,
            ..., 28, then 32, 48, 64, 96, ...); the first step at each new length pays the
            compilation (seconds), reported as ``compile_s`` in that step's metrics. Buckets up
            to 128 tokens run the model's plain attention, which the compiler fuses. A function
            that fails to compile runs eagerly, with a warning.
        fused_optimizer: AdamW as one fused kernel where the device has one (not with
            ``fsdp``): on a CPU thread 1.4 ms instead of 8 ms a step for the arith model, but
            its rounding differs from the default AdamW's, so a run's numbers (and early-stopping
            decisions taken on them) change. Off by default, so that runs repeat across releases.
        skip_zero_advantage: leave out of the forward and backward passes the rows whose
            advantage is exactly 0 on every token (a GRPO or RLOO group whose rewards are all
            equal) when the loss is the policy loss alone (no ``kl_coef`` in the loss, no
            ``entropy_coef``): they add exactly 0 to the loss and its gradient, and the
            aggregate keeps its whole denominator, so the step is the same, at float rounding,
            for less compute. The correction's stats are then over the rows trained, and
            ``zero_advantage_rows`` counts the batch's rows whose advantage is 0.
    """

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
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    importance: alg.Importance = "token"
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
    ppo_epochs: int = 1
    mini_batches: int = 1
    checkpoint_every: int = 100
    checkpoint_every_s: float = 600.0
    durable: bool | Literal["wal", "checkpoint"] = "wal"
    write_paths: list[str] = []
    publish_weights: bool = True
    keep_checkpoints: int = 2
    pad_id: int = 0
    dropout: bool = False
    bc_dropout: bool = False
    dist_backend: str = ""
    dtype: Literal["", "float32", "float64", "bfloat16", "float16"] = ""
    dist_timeout_s: float = 300.0
    parallel: Literal["replicate", "fsdp"] = "replicate"
    activation_checkpointing: bool = False
    bucket_mib: int = 256
    compile: bool = False
    fused_optimizer: bool = False
    skip_zero_advantage: bool = True

    def __post_init__(self) -> None:
        check_norm_len(self.aggregation, self.norm_len)
        _check_at_least_one("ppo_epochs", self.ppo_epochs)
        _check_at_least_one("mini_batches", self.mini_batches)
        _check_at_least_one("bucket_mib", self.bucket_mib)
        durability(self.durable)
        if self.checkpoint_every < 0 or self.checkpoint_every_s < 0:
            raise ValueError(
                f"checkpoint_every, checkpoint_every_s: expected numbers >= 0, got "
                f"{self.checkpoint_every!r}, {self.checkpoint_every_s!r}"
            )
        if not self.dist_timeout_s > 0:
            raise ValueError(f"dist_timeout_s: expected a number > 0, got {self.dist_timeout_s!r}")

    def lr_factor(self, step: int) -> float:
        """The learning rate at optimizer step ``step`` as a factor of the peak: linear
        warm-up over ``warmup_steps``, then ``lr_schedule``'s decay over ``total_steps``."""
        warmup, total = int(self.warmup_steps), int(self.total_steps)
        if warmup and step < warmup:
            return (step + 1) / warmup
        if self.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if self.lr_schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))
