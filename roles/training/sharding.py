"""Sharded learners: the K replicas of a learner with ``parallel: fsdp`` shard its parameters,
gradients and optimizer state over their group with FSDP2 (``fully_shard``).

The group is the data-parallel one (``asyncrl.roles.training.data_parallel``): every rank receives
the whole batch, computes the advantages over it identically and trains its token-balanced share of
each mini-batch. What changes is where the state lives and how gradients meet:

- ``shard`` wraps each transformer block, then the whole model, on the mesh the hardware plugin
  builds (``asyncrl.plugins.registry.sharding_for``: gloo on cpu, nccl on cuda), with the
  plugin's mixed precision (bf16 compute with float32 reduction on cuda; none on cpu). Each rank
  then holds ``1/K`` of every parameter, of its gradient and of AdamW's two moments.
- Gradients are reduce-scattered as sums (``set_gradient_divide_factor(1)``), as the replicated
  learner all-reduces them, so K ranks take the step one learner takes on the whole batch.
- Every forward pass is a collective (each block gathers its parameters), so the ranks must run
  the same number of passes: ``lockstep_passes`` says how many, and a rank with fewer
  micro-batches runs ``idle_pass``, a forward and backward that adds nothing to any gradient.
- A checkpoint holds each rank's own shards (``local_state``), so ranks need no shared disk;
  ``load_local_state`` puts them back on a group of the same size; ``whole_training_state``
  puts every rank's shards of a group of any size together and ``slice_training_state`` cuts
  this rank's out of them, so a checkpoint loads at another world size (``Trainer.load_states``).
- Weights leave the group bucket by bucket (``full_buckets``): every rank gathers one bucket of
  full tensors in lockstep, the publishing rank writes it into the weight store, and the bucket
  is dropped before the next, so no rank ever holds a second full copy of the model.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from asyncrl.roles.learning.batching import micro_batches
from asyncrl.roles.payloads import Scored
from asyncrl.roles.training.data_parallel import DataParallel, share_out

__all__ = [
    "PaceSettings",
    "ShardingError",
    "blocks",
    "empty_pretrained",
    "full_buckets",
    "full_tensor",
    "idle_pass",
    "keep_pace",
    "load_local_state",
    "load_pretrained_shards",
    "load_training_state",
    "local_state",
    "lockstep_passes",
    "placed",
    "shard",
    "slice_training_state",
    "training_state",
    "whole_training_state",
]


class PaceSettings(Protocol):
    """What ``keep_pace`` reads of a role's config (the learner's and the critic's have both).

    Attributes:
        micro_batch_tokens: prompt and completion tokens per forward pass.
        pad_id: the token id of padding.
    """

    @property
    def micro_batch_tokens(self) -> int: ...

    @property
    def pad_id(self) -> int: ...


class ShardingError(ValueError):
    """A sharded checkpoint that does not fit this group (another group size or model)."""


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated transformer blocks, each sharded as one unit: the modules whose
    class the model names in ``_no_split_modules`` (every Hugging Face causal LM does), else
    the children of its largest ``ModuleList``; [] for a model with neither."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if found:
        return found
    lists = [list(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lists, key=len) if lists else []


def shard(
    model: torch.nn.Module,
    sharding: Any,
    world: int,
    *,
    activation_checkpointing: bool = False,
    host_memory: bool = True,
) -> torch.nn.Module:
    """Shard ``model`` in place over the ``world`` ranks of the default process group: each
    block, then the root (its embeddings, final norm and head); gradients reduce as sums.

    Args:
        model: the model, identical on every rank, in its storage dtype.
        sharding: the plugin's sharding part (``mesh``, ``mixed_precision``).
        world: the group's size.
        activation_checkpointing: recompute each block's activations in the backward pass
            instead of keeping them (Hugging Face's gradient checkpointing, non-reentrant).
        host_memory: on a CPU mesh, reuse the blocks' collective buffers and give free heap
            pages back in the backward pass (``_on_host``); off, FSDP2's own allocations.
    """
    from torch.distributed.fsdp import fully_shard

    found = blocks(model)
    if activation_checkpointing:
        found = _checkpointed(model, found)
    mesh = sharding.mesh(world)
    storage = next(model.parameters()).dtype
    options: dict[str, Any] = {"mesh": mesh}
    policy = sharding.mixed_precision(storage)
    if policy is not None:
        options["mp_policy"] = policy
    units = [*found, model]
    for unit in units:
        fully_shard(unit, **options)
    # Sums, as the replicated learner's all-reduce: each rank weighs its micro-batches by the
    # mini-batch's global aggregate already. The factor is each unit's own; plain SUM
    # collectives, since gloo has no pre-multiplied sum (float32 would ask for one).
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    if mesh.device_type == "cpu" and host_memory:
        _on_host(model, found)
    return model


def _on_host(model: torch.nn.Module, found: list[torch.nn.Module]) -> None:
    """Host memory (``asyncrl.roles.training.host_buffers``): the blocks' collective buffers are
    kept and reused, so their pages fault in once and leave no holes; the root's, allocated once a
    step, are not kept, so that they are not held at the end of the backward pass, when the
    root's whole tied gradient is. The heaps' free pages go back to the system in the backward
    pass before it peaks."""
    from asyncrl.roles.training.host_buffers import (
        BufferPool,
        PooledAllGather,
        PooledReduceScatter,
        release_in_backward,
    )

    pool = BufferPool()
    for unit in found:
        unit.set_custom_all_gather(PooledAllGather(pool))  # type: ignore[operator]
        unit.set_custom_reduce_scatter(PooledReduceScatter(pool))  # type: ignore[operator]
    release_in_backward(model, found)


def _checkpointed(model: torch.nn.Module, found: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Each of ``found`` replaced in its parent by a wrapper that recomputes its activations in
    the backward pass (non-reentrant ``torch.utils.checkpoint``); the wrappers, in order. The
    state dict's names are unchanged. Hugging Face's own gradient checkpointing acts only in
    training mode, and the learner trains in eval mode (dropout off), so it would do nothing.

    Raises:
        ShardingError: the model has no blocks to wrap.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    if not found:
        raise ShardingError(
            f"activation_checkpointing: found no transformer blocks in {type(model).__name__} "
            f"(no _no_split_modules, no ModuleList); turn activation_checkpointing off"
        )
    wrapped: dict[int, torch.nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if any(child is block for block in found) and id(child) not in wrapped:
                wrapper = checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
                setattr(parent, name, wrapper)
                wrapped[id(child)] = wrapper
    return [wrapped[id(block)] for block in found]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a sharded (DTensor) parameter or gradient is gathered from every rank (a
    collective: every rank calls it, in the same order); a plain tensor is itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def lockstep_passes(samples: Sequence[Scored], dp: DataParallel, budget: int) -> int:
    """The most micro-batches any rank runs on ``samples`` (each rank's token share, cut into
    micro-batches of at most ``budget`` tokens): computed alike on every rank, no collective."""
    shares, _ = share_out(samples, dp)
    return max(
        (len(micro_batches([samples[i] for i in share], budget)) if share else 0)
        for share in shares
    )


def idle_pass(model: torch.nn.Module, pad_id: int, *, backward: bool) -> None:
    """A forward (and with ``backward``, a backward) pass on two padding tokens whose result is
    multiplied by zero: it takes part in the blocks' collectives and adds nothing to any
    gradient. A rank with fewer micro-batches than the others runs it to stay in lockstep."""
    device = next(model.parameters()).device
    ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
    logits = model(input_ids=ids, use_cache=False).logits
    if backward:
        (logits.float().sum() * 0.0).backward()


def keep_pace(
    model: torch.nn.Module,
    samples: Sequence[Scored],
    dp: DataParallel,
    cfg: PaceSettings,
    done: int,
    *,
    backward: bool,
) -> None:
    """After this rank's ``done`` passes over its share of ``samples`` (in micro-batches of
    ``cfg.micro_batch_tokens``), the ``idle_pass``es that bring it to ``lockstep_passes``: as
    many passes as the busiest rank's; without ``backward``, under ``no_grad``."""
    with contextlib.nullcontext() if backward else torch.no_grad():
        for _ in range(lockstep_passes(samples, dp, cfg.micro_batch_tokens) - done):
            idle_pass(model, cfg.pad_id, backward=backward)


def _local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def local_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: int
) -> dict[str, Any]:
    """This rank's shards of the model and of the optimizer's state, as plain tensors (what a
    sharded checkpoint holds), with the group size they belong to."""
    model_state = {name: _local(t).detach() for name, t in model.state_dict().items()}
    optim = optimizer.state_dict()
    optim["state"] = {
        index: {key: _local(value) for key, value in entry.items()}
        for index, entry in optim["state"].items()
    }
    return {"model": model_state, "optimizer": optim, "world": world}


def load_local_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], world: int
) -> None:
    """Put back what ``local_state`` saved on this rank, into a model sharded over a group of
    the same size (and the optimizer over its parameters).

    Raises:
        ShardingError: the checkpoint was written by a group of another size, or its shards do
            not fit this model's (another model or sharding).
    """
    from torch.distributed.tensor import DTensor

    saved_world = int(state.get("world", 0))
    if saved_world != world:
        raise ShardingError(
            f"this sharded checkpoint was written by {saved_world} ranks, and this group has "
            f"{world}; restart with replicas: {saved_world}, or start a new run from an export"
        )
    saved = state["model"]
    problems = []
    with torch.no_grad():
        for name, t in model.state_dict().items():
            local = _local(t)
            if name not in saved or tuple(saved[name].shape) != tuple(local.shape):
                got = tuple(saved[name].shape) if name in saved else "missing"
                problems.append(f"{name}: shard {tuple(local.shape)}, checkpoint {got}")
                continue
            local.copy_(saved[name])
    if problems:
        raise ShardingError(
            "the sharded checkpoint does not fit this model: " + "; ".join(problems[:5])
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optim = dict(state["optimizer"])
    entries: dict[Any, Any] = {}
    for index, entry in optim["state"].items():
        p = params[int(index)]
        entries[index] = {
            key: DTensor.from_local(
                value,
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
            if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0
            else value
            for key, value in entry.items()
        }
    optim["state"] = entries
    optimizer.load_state_dict(optim)


def full_buckets(
    model: torch.nn.Module, bucket_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """The model's whole state dict, one bucket at a time: each bucket's tensors (at most
    ``bucket_bytes`` together, or one larger tensor alone) gathered from every rank, cast to
    ``dtype`` when given, on the host. Every rank iterates it in lockstep (each gather is a
    collective); names that share one tensor (tied embeddings) share one gather."""
    state = model.state_dict()
    order: list[tuple[str, torch.Tensor]] = list(state.items())
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0

    def gather(items: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        done: dict[int, torch.Tensor] = {}
        for name, t in items:
            key = id(t)
            if key not in done:
                whole = full_tensor(t.detach())
                if dtype is not None and whole.is_floating_point():
                    whole = whole.to(dtype)
                done[key] = whole.cpu()
            out[name] = done[key]
        return out

    for name, t in order:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield gather(bucket)
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield gather(bucket)


def training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: int | None
) -> dict[str, Any]:
    """The model's and the optimizer's state for a checkpoint: whole (``world`` None: not
    sharded), or this rank's shards of a group of ``world`` ranks (``local_state``)."""
    if world is None:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    return local_state(model, optimizer, world)


def load_training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    world: int | None,
) -> None:
    """Put back what ``training_state`` saved.

    Raises:
        ShardingError: see ``load_local_state``.
    """
    if world is None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    else:
        load_local_state(model, optimizer, state, world)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _joined(parts: list[Any], shape: tuple[int, ...]) -> Any:
    """One tensor whole from every rank's ``parts`` of it (in rank order): the first part when
    it already has the whole ``shape`` (a replicated buffer, a scalar, one rank), else the
    parts concatenated along dimension 0 (FSDP2 shards dimension 0)."""
    first = parts[0]
    if not isinstance(first, torch.Tensor) or first.dim() == 0 or tuple(first.shape) == shape:
        return first
    return torch.cat(parts, dim=0)


def whole_training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, states: list[dict[str, Any]]
) -> dict[str, Any]:
    """The whole model's and optimizer's state from what every rank of a group saved
    (``training_state``, in rank order): one whole state as it is, or the ``world`` sharded
    states of a sharded group put together. ``model`` and ``optimizer`` (whole or sharded over
    any group) give each tensor's whole shape.

    Raises:
        ShardingError: not one whole state nor every rank's shards of one group; or a tensor
            whose shards do not make this model's.
    """
    worlds = [s.get("world") for s in states]
    if worlds == [None]:
        return {"model": states[0]["model"], "optimizer": states[0]["optimizer"]}
    if not states or any(w != len(states) for w in worlds):
        raise ShardingError(
            f"expected one whole state or every rank's shards of one sharded group, got "
            f"{len(states)} state(s) written by groups of {worlds} rank(s); pass the newest "
            f"checkpoint of every rank of the group that wrote it, in rank order"
        )
    model_state, problems = {}, []
    for name, t in model.state_dict().items():
        if any(name not in s["model"] for s in states):
            problems.append(f"{name}: missing")
            continue
        joined = _joined([s["model"][name] for s in states], tuple(t.shape))
        if tuple(joined.shape) != tuple(t.shape):
            problems.append(f"{name}: whole {tuple(t.shape)}, shards make {tuple(joined.shape)}")
        model_state[name] = joined
    if problems:
        raise ShardingError(
            "the sharded checkpoint does not fit this model: " + "; ".join(problems[:5])
        )
    params = _params(optimizer)
    optim = dict(states[0]["optimizer"])
    optim["state"] = {
        index: {
            key: _joined(
                [s["optimizer"]["state"][index][key] for s in states],
                tuple(params[int(index)].shape),
            )
            for key in entry
        }
        for index, entry in optim["state"].items()
    }
    return {"model": model_state, "optimizer": optim}


def _slice(value: Any, like: torch.Tensor, rank: int, world: int) -> Any:
    """This rank's FSDP2 slice (``torch.chunk`` along dimension 0, empty past the chunks) of a
    whole tensor ``value`` of the sharded parameter ``like``; anything else as it is."""
    from torch.distributed.tensor import DTensor

    if not (isinstance(like, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0):
        return value
    chunks = torch.chunk(value, world, dim=0)
    return chunks[rank] if rank < len(chunks) else value[0:0]


def slice_training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    whole: dict[str, Any],
    rank: int,
    world: int,
) -> dict[str, Any]:
    """What ``local_state`` would hold on ``rank`` of a group of ``world`` sharding ``model``,
    cut from the whole state ``whole`` (``whole_training_state``): load it with
    ``load_local_state``."""
    model_state = {
        name: _slice(whole["model"][name], t, rank, world)
        for name, t in model.state_dict().items()
        if name in whole["model"]
    }
    params = _params(optimizer)
    optim = dict(whole["optimizer"])
    optim["state"] = {
        index: {key: _slice(value, params[int(index)], rank, world) for key, value in entry.items()}
        for index, entry in optim["state"].items()
    }
    return {"model": model_state, "optimizer": optim, "world": world}


_WRAPPED = "_checkpoint_wrapped_module."
"""What activation checkpointing's wrapper adds to its parameters' names (not to the state
dict's)."""


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Within the block, every parameter a module registers is moved to the ``meta`` device
    (no memory, no initialisation cost), while buffers are made as usual: the rotary
    embeddings' frequencies, which nothing loads, keep their values."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original  # type: ignore[method-assign]


def empty_pretrained(model_path: str) -> Any:
    """The causal LM of ``model_path``'s config with its parameters on the ``meta`` device:
    what a sharded rank shards before it loads its own slices (``load_pretrained_shards``), so
    that no rank ever holds the whole model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    auto: Any = AutoModelForCausalLM  # its class methods are untyped
    config = AutoConfig.from_pretrained(model_path)
    with _parameters_on_meta():
        return auto.from_config(config)


def placed(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` on ``device`` in ``dtype`` (its floating-point tensors); a model whose
    parameters are on ``meta`` keeps them there, cast, and moves only its buffers."""
    if next(model.parameters()).device.type != "meta":
        return model.to(device=device, dtype=dtype)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_floating_point():
                module._parameters[name] = torch.nn.Parameter(p.to(dtype), p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = b.to(device)
    tie: Any = getattr(model, "tie_weights", None)  # new parameters: tie them again
    if tie is not None:
        tie()
    return model


def _checkpoint_files(model_path: str) -> dict[str, str]:
    """Each tensor name of the safetensors checkpoint in ``model_path`` and its file.

    Raises:
        ShardingError: the folder holds no safetensors checkpoint.
    """
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return {name: os.path.join(model_path, file) for name, file in weight_map.items()}
    single = os.path.join(model_path, "model.safetensors")
    if os.path.exists(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise ShardingError(
        f"{model_path}: a sharded learner loads its slices from a safetensors checkpoint "
        f"(model.safetensors or model.safetensors.index.json), and this folder has none; "
        f"convert it with save_pretrained(safe_serialization=True)"
    )


def load_pretrained_shards(
    model: torch.nn.Module, model_path: str, rank: int, world: int, device: torch.device
) -> None:
    """Allocate a sharded model built by ``empty_pretrained`` on ``device`` and fill each of
    this rank's shards from ``model_path``'s safetensors files, reading only its own rows: no
    rank reads or holds a whole tensor it does not own. Names are matched as they are, or
    with the model's ``base_model_prefix`` added or removed (older checkpoints).

    Raises:
        ShardingError: the checkpoint lacks a tensor, or one has another shape.
    """
    from safetensors import safe_open

    files = _checkpoint_files(model_path)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    problems: list[str] = []
    opened: dict[str, Any] = {}
    with contextlib.ExitStack() as stack, torch.no_grad():
        for wrapped, p in model.named_parameters():
            name = wrapped.replace(_WRAPPED, "")  # the state dict's name
            candidates = [name, name.removeprefix(prefix + "."), f"{prefix}.{name}"]
            key = next((k for k in candidates if k in files), None)
            if key is None:
                problems.append(f"{name}: not in the checkpoint")
                continue
            if files[key] not in opened:
                path = files[key]
                opened[path] = stack.enter_context(safe_open(path, framework="pt"))
            part = opened[files[key]].get_slice(key)
            shape = tuple(part.get_shape())
            if shape != tuple(p.shape):
                problems.append(f"{name}: {shape} in the checkpoint, {tuple(p.shape)} here")
                continue
            local = _local(p.data)
            if local.dim() == 0 or local.shape == p.shape:
                local.copy_(part[:] if local.dim() else part[()])
                continue
            rows = -(-p.shape[0] // world)  # torch.chunk's: ceil(n / world) rows a rank
            start = min(rank * rows, p.shape[0])
            local.copy_(part[start : start + local.shape[0]])
    if problems:
        raise ShardingError(
            f"{model_path} does not fit this model: "
            + "; ".join(problems[:5])
            + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        )
