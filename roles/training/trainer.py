"""The trainer: a model, its placement and sharding, its optimizer and schedule, one
micro-batched optimizer step of an objective, log-probs, and its state saved and loaded.

A ``Trainer`` is what the learner and the critic train with (vLLM's ``EngineCore`` beside its
process wrapper; torchtune's components): no role, no context, no sockets, so a test drives it
in-process through these methods. The role around it adds the endpoints, the durability
(``asyncrl.roles.training.durability``) and the process.

- **Build.** ``Trainer(settings, build, plugin=..., device=...)`` seeds the plugin's RNGs with
  ``settings.seed``, calls ``build`` for the model, and places it on ``device`` in its storage
  dtype: the plugin's dtype (or ``settings.dtype``), but float32 on ranks that will be sharded
  unless a dtype is named (they compute in the plugin's mixed precision). A model ``build``
  returns on the ``meta`` device keeps its parameters there until sharded ranks read their own
  slices of ``settings.pretrained``.
- **Group.** ``join(dp)`` puts the trainer in a data-parallel group
  (``asyncrl.roles.training.data_parallel``): every rank then trains its token-balanced share of
  each mini-batch. With ``settings.sharded`` it shards the model with FSDP2
  (``asyncrl.roles.training.sharding``) and makes the optimizer again over the shards.
- **Optimizer.** AdamW (fused with ``fused_optimizer`` where the device has a kernel, unless
  sharded), and with a ``schedule`` a ``LambdaLR`` of it (the factor of the peak ``lr`` after
  each optimizer step).
- **Step.** ``optimizer_step`` takes one optimizer step on a mini-batch: this rank's
  micro-batches of at most ``micro_batch_tokens`` tokens, each one's loss (the objective's,
  ``MicroLoss``) weighed by its share of the mini-batch's aggregate so the summed gradient does
  not depend on the cut, a term taken once per step (``once``: the learner's BC term), the
  ranks' gradients summed, clipped to ``grad_clip``, one AdamW step and one schedule step.
  ``train_epochs`` runs ``epochs x parts`` of them over a batch, shuffled by ``(seed, step,
  epoch)``, so a resumed trainer draws the same split.
- **Spans.** With tracing on (``asyncrl.observe.trace``) it records where a step's time goes:
  ``forward`` (rows padded and moved to the device, then the model), ``model forward``,
  ``micro-batch loss`` (the objective on a micro-batch, its forward pass included),
  ``optimizer step`` (a whole step) and ``optimizer`` (AdamW and the schedule);
  ``asyncrl bench learner`` reads them.
- **State.** ``state`` is what a checkpoint holds of the trainer (a sharded rank: its own
  shards and the group size); ``load_state`` puts back one state written at this world size,
  ``load_states`` the states of every rank of a group of any size (resharding).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.observe.trace import span
from asyncrl.plugins.registry import dtype_for, sharding_for
from asyncrl.roles.learning import algorithms as alg
from asyncrl.roles.learning.batching import (
    completion_mask,
    loss_masks,
    micro_batches,
    mini_batch_indices,
    pad_batch,
)
from asyncrl.roles.payloads import Sample, Scored
from asyncrl.roles.training import sharding as sh
from asyncrl.roles.training.data_parallel import DataParallel, rank_chunks, share_out
from asyncrl.roles.training.learner_compile import CompiledStep
from asyncrl.roles.training.objective import Forward

__all__ = ["MicroLoss", "OnceTerm", "Trainer", "TrainerSettings"]

MicroLoss = Callable[[list[int], float], tuple[torch.Tensor, dict[str, float]]]
"""An objective on one micro-batch: called with the micro-batch's indices into the
mini-batch's samples and its weight (its share of the mini-batch's aggregate), it returns the
micro-batch's loss, aggregated over its own tokens (the trainer backpropagates ``loss *
weight``), and its metrics' contributions to the mini-batch's (summed over micro-batches and
ranks)."""

OnceTerm = Callable[[float], dict[str, float]]
"""A term backpropagated once per optimizer step, after the micro-batches (the learner's BC
term): called with the share of it this rank takes (1, or ``1 / world`` on sharded ranks, which
all run its passes), it returns its metrics."""


@dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    """How a ``Trainer`` builds, places and trains its model (a role fills it from its config).

    Attributes:
        seed: seeds the plugin's RNGs before the model is built.
        lr: AdamW's learning rate (the peak, with a schedule).
        betas: AdamW's betas.
        weight_decay: AdamW's decoupled weight decay.
        fused_optimizer: AdamW as one fused kernel where the device has one (not sharded).
        grad_clip: the gradient's maximum norm, at every optimizer step.
        aggregation: how per-token losses become one number (``alg.aggregate``); it weighs the
            micro-batches.
        micro_batch_tokens: prompt and completion tokens per forward (and backward) pass.
        pad_id: the token id of padding.
        dtype: the compute dtype: empty: the hardware plugin's; or a torch dtype's name.
        sharded: the model is sharded with FSDP2 over the group ``join`` is given.
        activation_checkpointing: with ``sharded``, recompute each block's activations in the
            backward pass.
        dropout: keep the model's dropout on while training.
        pretrained: with ``sharded``, the Hugging Face directory each rank reads its own
            slices of after sharding (``build`` returned the model on ``meta``); empty: none.
        compile: compile the forward pass of ``forward`` through the plugin's compiler.
    """

    seed: int = 0
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    fused_optimizer: bool = False
    grad_clip: float = 1.0
    aggregation: alg.Aggregation = "token_mean"
    micro_batch_tokens: int = 8192
    pad_id: int = 0
    dtype: str = ""
    sharded: bool = False
    activation_checkpointing: bool = False
    dropout: bool = False
    pretrained: str = ""
    compile: bool = False


class Trainer:
    """One model and its optimizer, trained in micro-batched steps of an objective.

    Args:
        settings: how to build, place and train it.
        build: makes the model (after the RNGs are seeded), on the host or on ``meta``.
        plugin: the hardware plugin (``asyncrl.plugins.registry.current``): the device's RNGs,
            operators, compiler and sharding.
        device: where the model is placed.
        schedule: the learning rate's factor of ``settings.lr`` after a number of optimizer
            steps; None: no schedule (the rate stays ``lr``).

    Attributes:
        model: the model (sharded after ``join`` with ``settings.sharded``).
        optimizer: AdamW over its parameters.
        scheduler: the ``LambdaLR`` of ``schedule``, or None.
        dtype: the dtype its weights are computed (and published) in.
        dp: the data-parallel group, once joined; None alone.
        compiled: the compiled forward pass (``settings.compile``), or None.
    """

    def __init__(
        self,
        settings: TrainerSettings,
        build: Callable[[], torch.nn.Module],
        *,
        plugin: Any,
        device: torch.device,
        schedule: Callable[[int], float] | None = None,
    ) -> None:
        self.settings = settings
        self.plugin = plugin
        self.device = device
        self.schedule = schedule
        self.dtype = dtype_for(settings.dtype, device, plugin)
        self.sharded = settings.sharded
        self.dp: DataParallel | None = None
        storage = torch.float32 if settings.sharded and not settings.dtype else self.dtype
        plugin.device.manual_seed(settings.seed)
        self.model = sh.placed(build(), device, storage).train(settings.dropout)
        self.scheduler: Any = None
        self._make_optimizer()
        self.compiled: CompiledStep | None = None
        if settings.compile:
            model = None if settings.activation_checkpointing else self.model
            self.compiled = CompiledStep(plugin.compiler, self.model_logprobs, model)

    def _make_optimizer(self) -> None:
        s, params = self.settings, list(self.model.parameters())
        options: dict[str, Any] = {"lr": s.lr, "betas": s.betas, "weight_decay": s.weight_decay}
        try:
            fused = (s.fused_optimizer and not self.sharded) or None
            self.optimizer = torch.optim.AdamW(params, fused=fused, **options)
        except (RuntimeError, ValueError):  # no fused kernel for this device or dtype
            self.optimizer = torch.optim.AdamW(params, **options)
        if self.schedule is not None:
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._factor)

    def _factor(self, step: int) -> float:
        # A bound method, not a lambda: LambdaLR's state then keeps the same entry for it
        # that checkpoints have always held.
        assert self.schedule is not None
        return float(self.schedule(step))

    def join(self, dp: DataParallel) -> None:
        """Train as a rank of ``dp``: with ``settings.sharded``, shard the model over it
        (FSDP2), read this rank's slices of ``settings.pretrained``, and make the optimizer
        again over the shards. Call it before any step, on every rank."""
        self.dp = dp
        if not self.sharded:
            return
        sh.shard(
            self.model,
            sharding_for(self.plugin),
            dp.world,
            activation_checkpointing=self.settings.activation_checkpointing,
        )
        if self.settings.pretrained:
            path = self.settings.pretrained
            sh.load_pretrained_shards(self.model, path, dp.rank, dp.world, self.device)
        self._make_optimizer()

    @property
    def world(self) -> int | None:
        """The size of the group the model is sharded over; None: not sharded (whole here)."""
        return self.dp.world if self.sharded and self.dp is not None else None

    # -- forward passes -----------------------------------------------------------------------

    def inputs(
        self, samples: Sequence[Sample]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The samples' left-padded rows on the device (``pad_batch``): input ids, attention
        mask, position ids, and the target mask of the completion tokens their loss masks
        keep."""
        rows = ([s.prompt_ids for s in samples], [s.token_ids for s in samples])
        input_ids, attention, positions, target = (
            t.to(self.device)
            for t in pad_batch(*rows, self.settings.pad_id, loss_masks(list(samples)))
        )
        return input_ids, attention, positions, target

    def model_logprobs(
        self, input_ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's log-prob of the next one, [B, L] (the last column 0), and the logits
        [B, L, V], of a causal LM: every output keeps the input's length, so a compiled graph's
        padded outputs are cut back (``Compiler.compile``)."""
        with span("model forward"):
            logits = self.model(
                input_ids=input_ids,
                attention_mask=attention,
                position_ids=positions,
                use_cache=False,
            ).logits
        # At least float32 (a bf16 model's logits are widened); a float64 model keeps float64.
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        logprobs = self.plugin.ops.logprobs(logits[:, :-1], input_ids[:, 1:])
        return torch.nn.functional.pad(logprobs, (0, 1)), logits

    def forward(self, samples: Sequence[Sample], compiled: bool = False) -> Forward:
        """A causal LM's forward pass on the samples (with gradients): each completion
        position's log-prob, the target mask, the logits; ``compiled``: through the compiled
        graph of the rows' length bucket (with ``settings.compile``)."""
        with span("forward"):
            input_ids, attention, positions, target = self.inputs(samples)
            run: Any = self.model_logprobs
            if compiled and self.compiled is not None:
                run = self.compiled.forward
            logprobs, logits = run(input_ids, attention, positions)
            return Forward(logprobs[:, :-1], target, logits[:, :-1])

    def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        """Each sample's completion log-probs under the current weights, in eval mode and
        without gradients (one pass: no micro-batching, no group)."""
        self.set_dropout(False)
        try:
            with torch.no_grad():
                logprobs, _, _ = self.forward(samples)
        finally:
            self.set_dropout(self.settings.dropout)
        out = []
        for i, s in enumerate(samples):
            n = len(s.token_ids)
            out.append(logprobs[i, logprobs.shape[1] - n :].tolist() if n else [])
        return out

    def rows(
        self,
        samples: Sequence[Scored],
        compute: Callable[[list[Sample]], list[list[float]]],
        what: str = "the proximal log-probs' all-gather",
    ) -> list[list[float]]:
        """One row of floats per completion token of each sample, ``compute``d in
        micro-batches without gradients; in a group, each rank computes its token share and
        the ranks gather them (every rank returns all of them; ``what`` names the gather in
        errors). Every rank calls it alike."""
        shares, rank = share_out(samples, self.dp)
        mine = [samples[i] for i in shares[rank]]
        out: list[list[float]] = []
        with torch.no_grad():
            chunks = micro_batches(mine, self.settings.micro_batch_tokens) if mine else []
            for chunk in chunks:
                out += compute([mine[i].sample for i in chunk])
            self.keep_pace(samples, len(chunks), backward=False)
        if self.dp is None:
            return out
        lengths = [len(s.sample.token_ids) for s in samples]
        return self.dp.gather_rows(out, shares, lengths, what=what)

    def keep_pace(self, samples: Sequence[Scored], done: int, *, backward: bool) -> None:
        """On a sharded rank that ran ``done`` passes over its share of ``samples``, the idle
        passes that bring it to the busiest rank's count (``sharding.keep_pace``); nothing
        unless sharded."""
        if self.sharded and self.dp is not None:
            sh.keep_pace(self.model, samples, self.dp, self.settings, done, backward=backward)

    # -- training -----------------------------------------------------------------------------

    def set_dropout(self, on: bool) -> None:
        """Run the next passes with the model's dropout ``on`` or off (its train or eval mode).
        Modes are set on the whole model, so its root's flag says which it is in, and a mode it
        is already in is left as it is: ``Module.train`` visits every module (a Hugging Face
        model's does more), about a millisecond of a small step each time."""
        if self.model.training != on:
            self.model.train(on)

    def set_peak_lr(self, lr: float) -> None:
        """A new peak learning rate: the schedule scales it from now on, and the next step
        already uses it."""
        groups = self.optimizer.param_groups
        if self.scheduler is not None:
            self.scheduler.base_lrs = [lr] * len(groups)
        factor = 1.0 if self.schedule is None else float(self.schedule(self.optimizer_steps))
        for group in groups:
            group["initial_lr"] = lr
            group["lr"] = lr * factor

    @property
    def optimizer_steps(self) -> int:
        """The optimizer steps taken with a schedule (its ``last_epoch``); 0 without one."""
        return 0 if self.scheduler is None else int(self.scheduler.last_epoch)

    def train_epochs(
        self,
        count: int,
        *,
        epochs: int,
        parts: int,
        step: int,
        run: Callable[[list[int]], dict[str, float]],
    ) -> list[dict[str, float]]:
        """``epochs`` passes over a batch of ``count`` samples, each cut into ``parts``
        mini-batches (``mini_batch_indices``, shuffled by ``(seed, step, epoch)``), ``run`` on
        each mini-batch's indices in turn (one optimizer step each); returns each step's
        metrics, summed over the group's ranks."""
        steps = []
        for epoch in range(epochs):
            split = mini_batch_indices(
                count, parts, seed=self.settings.seed, step=step, epoch=epoch
            )
            for part in split:
                steps.append(run(part))
        if self.dp is not None:
            steps = self.dp.sum_metrics(steps)
        return steps

    def optimizer_step(
        self,
        samples: Sequence[Scored],
        loss: MicroLoss,
        *,
        mask: torch.Tensor | None = None,
        total: float | None = None,
        adjust: Callable[[dict[str, float]], dict[str, float]] | None = None,
        once: OnceTerm | None = None,
    ) -> dict[str, float]:
        """One optimizer step (and schedule step) on a mini-batch; returns its metrics: the
        objective's, summed over the micro-batches, ``grad_norm``, and with a schedule ``lr``.

        Args:
            samples: the mini-batch (every rank's; this rank trains its token share).
            loss: the objective on one micro-batch (``MicroLoss``).
            mask: the samples' completion mask; None: ``completion_mask`` of them.
            total: the mini-batch's aggregate weight the micro-batches' weights divide; None:
                the sum of every rank's micro-batches' weights.
            adjust: applied to the summed metrics before ``once``'s are added.
            once: a term backpropagated once per step (``OnceTerm``).
        """
        with span("optimizer step"):
            return self._optimizer_step(samples, loss, mask, total, adjust, once)

    def _optimizer_step(
        self,
        samples: Sequence[Scored],
        loss: MicroLoss,
        mask: torch.Tensor | None,
        total: float | None,
        adjust: Callable[[dict[str, float]], dict[str, float]] | None,
        once: OnceTerm | None,
    ) -> dict[str, float]:
        s = self.settings
        self.optimizer.zero_grad(set_to_none=True)
        if mask is None:
            rows = list(samples)
            mask = completion_mask([len(x.sample.token_ids) for x in rows], loss_masks(rows))
        chunks, whole = rank_chunks(samples, mask, self.dp, s.micro_batch_tokens, s.aggregation)
        total = whole if total is None else total
        sums: dict[str, float] = {}
        for chunk in chunks:
            share = float(alg.aggregate_weight(mask[chunk], s.aggregation))
            weight = share / total if total else 0.0
            with span("micro-batch loss"):
                value, parts = loss(chunk, weight)
            (value * weight).backward()  # type: ignore[no-untyped-call]
            for key, part in parts.items():
                sums[key] = sums.get(key, 0.0) + part
        if adjust is not None:
            sums = adjust(sums)
        self.keep_pace(samples, len(chunks), backward=True)
        if once is not None:
            if self.sharded:
                assert self.dp is not None
                # Every rank runs the term's passes (collectives), each a 1/world share of it.
                metrics = once(1.0 / self.dp.world)
                if self.dp.rank == 0:
                    sums.update(metrics)
            elif self.dp is None or self.dp.rank == 0:  # once: the reduction sums the grads
                sums.update(once(1.0))
        if self.dp is not None and not self.sharded:  # sharded: FSDP reduce-scatters them
            self.dp.all_reduce_grads(self.model.parameters())
        grad_norm = sh.full_tensor(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.grad_clip)
        )
        metrics = {**sums, "grad_norm": float(grad_norm)}
        if self.scheduler is not None:  # the rate this step takes (a new peak already counts)
            metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        with span("optimizer"):
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
        return metrics

    # -- state --------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The model's, the optimizer's and the schedule's state for a checkpoint: whole, or on
        a sharded rank its own shards with the group's size (``world``)."""
        state = sh.training_state(self.model, self.optimizer, self.world)
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Put back what ``state`` returned on this rank, at this world size.

        Raises:
            ShardingError: a sharded state of another group size, or shards that do not fit
                this model (load every rank's with ``load_states``).
        """
        if self.world is None and state.get("world") is not None:
            raise sh.ShardingError(
                f"this sharded checkpoint was written by {state['world']} ranks, and this "
                f"model is whole; load every rank's state of that group with load_states"
            )
        sh.load_training_state(self.model, self.optimizer, dict(state), self.world)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])

    def load_states(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Put back the states that every rank of a group wrote (``state``, in rank order: one
        whole state, or the ``world`` shards of a sharded group), resharded to this trainer's
        world size: whole here, or this rank's slices of a group of any size.

        Raises:
            ShardingError: the states are not one whole state nor every rank's shards of one
                group, or they do not fit this model.
        """
        whole = sh.whole_training_state(self.model, self.optimizer, [dict(s) for s in states])
        if self.world is None:
            sh.load_training_state(self.model, self.optimizer, whole, None)
        else:
            assert self.dp is not None
            rank, world = self.dp.rank, self.world
            local = sh.slice_training_state(self.model, self.optimizer, whole, rank, world)
            sh.load_training_state(self.model, self.optimizer, local, self.world)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(states[0]["scheduler"])
