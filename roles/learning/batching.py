"""The learner's batch: samples as tensors, PPO's targets, and a batch split into mini-batches
(one optimizer step each) and micro-batches (one forward and backward each).

Tensors are left-padded ``prompt + completion`` rows with position ids derived from the
attention mask, the rollout engine's convention, so a recomputed log-prob equals the behaviour
one under the same weights; per-completion-token values (log-probs, advantages, values) are
placed right-aligned, where the target mask marks completion tokens.
"""

from __future__ import annotations

import itertools
import random

import torch

from asyncrl.dispatch.reduce import Moments
from asyncrl.roles.learning import algorithms as alg
from asyncrl.roles.payloads import Scored

__all__ = [
    "aligned",
    "batch_moments",
    "check_norm_len",
    "completion_mask",
    "gae_targets",
    "mean_over_steps",
    "micro_batches",
    "mini_batch_indices",
    "pad_batch",
    "right_aligned",
]


def batch_moments(values: list[float], *, gather: bool = False) -> Moments:
    """The moments of ``values``; with ``gather``, merged over every rank of the initialised
    torch.distributed group, for ranks that each hold a part of the batch (one all-gather of
    three numbers per rank, merged with Chan's formula). Data-parallel learners do not gather:
    each holds the whole batch (``asyncrl.roles.training.data_parallel``)."""
    moments = Moments.of(values)
    if not (gather and torch.distributed.is_available() and torch.distributed.is_initialized()):
        return moments
    world = torch.distributed.get_world_size()
    mine = torch.tensor([moments.count, moments.mean, moments.m2], dtype=torch.float64)
    gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
    torch.distributed.all_gather(gathered, mine)
    merged = Moments(0, 0.0, 0.0)
    for rank in gathered:
        merged = merged.merge(Moments(int(rank[0]), float(rank[1]), float(rank[2])))
    return merged


def pad_batch(
    prompts: list[list[int]], completions: list[list[int]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ``prompt + completion`` rows.

    Returns:
        input_ids [B, L], attention_mask [B, L], position_ids [B, L] (from the mask, so padding
        never shifts a position), and target_mask [B, L-1]: 1 where ``input_ids[:, t+1]`` is a
        completion token, i.e. where the logits at ``t`` predict a completion token.
    """
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    length = max(lengths)
    # One boolean mask and one flat tensor per batch, not a tensor per row: at small batches
    # the rows' Python-level copies cost as much as the forward pass.
    columns = torch.arange(length)
    attention = (columns[None, :] >= length - torch.tensor(lengths)[:, None]).long()
    flat = list(
        itertools.chain.from_iterable(
            itertools.chain(p, c) for p, c in zip(prompts, completions, strict=True)
        )
    )
    input_ids = torch.full((len(lengths), length), pad_id, dtype=torch.long)
    input_ids[attention.bool()] = torch.tensor(flat, dtype=torch.long)
    target = _right_mask([len(c) for c in completions], length - 1, torch.float32)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention, position_ids, target


def _right_mask(lengths: list[int], width: int, dtype: torch.dtype) -> torch.Tensor:
    columns = torch.arange(width)
    return (columns[None, :] >= width - torch.tensor(lengths, dtype=torch.long)[:, None]).to(dtype)


def aligned(values: list[list[float]], target: torch.Tensor) -> torch.Tensor:
    """Per-completion-token values placed where ``target`` marks completion tokens (each row's
    values in its last columns)."""
    out = torch.zeros_like(target)
    lengths = [len(row) for row in values]
    if not any(lengths):
        return out
    where = _right_mask(lengths, target.shape[1], torch.bool).to(target.device)
    flat = torch.tensor(list(itertools.chain.from_iterable(values)), dtype=out.dtype)
    out[: len(values)][where] = flat.to(target.device)
    return out


def right_aligned(rows: list[list[float]], width: int) -> torch.Tensor:
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
    logp = right_aligned([s.sample.logprobs for s in samples], width)
    with_ref = [s.ref_logprobs if s.ref_logprobs else s.sample.logprobs for s in samples]
    ref = right_aligned(with_ref, width)
    penalty = kl_coef if kl_mode == "reward" else 0.0
    rewards = alg.token_rewards(
        torch.tensor([s.reward for s in samples], dtype=torch.float32),
        mask,
        logp,
        ref,
        kl_coef=penalty,
        kl_kind=kl_estimator,
    )
    values = right_aligned([s.values or [0.0] * len(s.sample.token_ids) for s in samples], width)
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


def micro_batches(samples: list[Scored], budget: int) -> list[list[int]]:
    """Indices of ``samples`` in consecutive chunks of at most ``budget`` prompt and completion
    tokens each (a sample larger than the budget is a chunk of its own)."""
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


def mini_batch_indices(
    n: int, mini_batches: int, *, seed: int, step: int, epoch: int
) -> list[list[int]]:
    """The ``n`` samples of one batch split into ``mini_batches`` mini-batches for one epoch.

    With one mini-batch the samples keep their order: the mini-batch is the whole batch. With
    more, the indices are shuffled by a generator seeded with ``(seed, step, epoch)`` (so a
    resumed learner draws the same split, and each epoch a different one) and cut into
    ``mini_batches`` consecutive parts whose sizes differ by at most one (the first ``n %
    mini_batches`` parts hold one more).

    Raises:
        ValueError: ``mini_batches`` is below 1 or above ``n``.
    """
    if not 1 <= mini_batches <= n:
        raise ValueError(
            f"mini_batches: expected 1 to {n} (the samples to split), got {mini_batches}"
        )
    order = list(range(n))
    if mini_batches == 1:
        return [order]
    random.Random(f"{seed}:{step}:{epoch}").shuffle(order)
    size, extra = divmod(n, mini_batches)
    parts, start = [], 0
    for part in range(mini_batches):
        end = start + size + (part < extra)
        parts.append(order[start:end])
        start = end
    return parts


def mean_over_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the optimizer steps of one batch that report it."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(key for step in steps for key in step):
        values = [step[key] for step in steps if key in step]
        out[key] = sum(values) / len(values)
    return out
