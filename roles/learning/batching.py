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

from asyncrl.roles.learning import algorithms as alg
from asyncrl.roles.learning.statistics import Moments
from asyncrl.roles.payloads import Sample, Scored

__all__ = [
    "aligned",
    "batch_moments",
    "check_norm_len",
    "completion_mask",
    "env_tokens_in",
    "gae_targets",
    "loss_masks",
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
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int = 0,
    masks: list[list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ``prompt + completion`` rows.

    Returns:
        input_ids [B, L], attention_mask [B, L], position_ids [B, L] (from the mask, so padding
        never shifts a position), and target_mask [B, L-1]: 1 where ``input_ids[:, t+1]`` is a
        completion token, i.e. where the logits at ``t`` predict a completion token; with
        ``masks`` (``loss_masks``), only where it is one the policy generated.
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
    if masks is not None:
        target = _with_loss_masks(target, masks)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention, position_ids, target


def loss_masks(samples: list[Scored] | list[Sample]) -> list[list[int]] | None:
    """Each sample's loss mask (``Sample.loss_mask``; empty: all its tokens), or None when no
    sample has one: the single-turn batch, whose tensors are then built as they always were.

    Raises:
        ValueError: a loss mask whose length is not its sample's tokens', or with a value other
            than 0 and 1.
    """
    rows = [s.sample if isinstance(s, Scored) else s for s in samples]
    if not any(s.loss_mask for s in rows):
        return None
    for s in rows:
        if s.loss_mask and len(s.loss_mask) != len(s.token_ids):
            raise ValueError(
                f"sample {s.key}: loss_mask has {len(s.loss_mask)} entries for "
                f"{len(s.token_ids)} tokens; it needs one per token (or none)"
            )
        if any(m not in (0, 1) for m in s.loss_mask):
            raise ValueError(f"sample {s.key}: loss_mask holds values other than 0 and 1")
    return [s.loss_mask for s in rows]


def env_tokens_in(target: torch.Tensor, samples: list[Sample]) -> float:
    """How many of the samples' environment tokens (``loss_mask`` 0) ``target`` marks as
    trained: 0 unless the loss mask failed to reach it. Built apart from ``pad_batch``'s mask,
    so it checks that path rather than repeating it."""
    if not any(s.loss_mask for s in samples):
        return 0.0
    env = right_aligned([[1.0 - m for m in s.loss_mask] for s in samples], target.shape[1])
    return float((target * env.to(target.device)).sum())


def _with_loss_masks(target: torch.Tensor, masks: list[list[int]]) -> torch.Tensor:
    """``target`` (right-aligned completion positions) zeroed where a row's loss mask is 0."""
    width = target.shape[1]
    out = target.clone()
    for i, mask in enumerate(masks):
        if mask:
            out[i, width - len(mask) :] = torch.tensor(mask, dtype=target.dtype)
    return out


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


def completion_mask(lengths: list[int], masks: list[list[int]] | None = None) -> torch.Tensor:
    """[B, max length] float mask, right-aligned: row i has ``lengths[i]`` ones at its end;
    with ``masks`` (``loss_masks``), zeros where a row's loss mask is 0."""
    width = max(lengths, default=0)
    columns = torch.arange(width)[None, :]
    mask = (columns >= width - torch.tensor(lengths, dtype=torch.long)[:, None]).float()
    return mask if masks is None else _with_loss_masks(mask, masks)


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

    An episode's environment tokens (``Sample.loss_mask``) are not steps of the policy: GAE runs
    over its policy tokens alone, in order (the value after a turn's last token is the one at
    the next turn's first), the reward on its last policy token; the environment's positions
    hold 0 and are 0 in ``mask``.
    """
    masks = loss_masks(samples)
    rows = [_TokenRows.of(s) for s in samples]
    if masks is None:
        return _gae(rows, [s.reward for s in samples], gamma, lam, kl_coef, kl_estimator, kl_mode)
    kept = [
        [i for i, m in enumerate(mask) if m] if mask else list(range(len(row.logprobs)))
        for mask, row in zip(masks, rows, strict=True)
    ]
    compact = [row.taking(idx) for row, idx in zip(rows, kept, strict=True)]
    adv_c, ret_c, _ = _gae(
        compact, [s.reward for s in samples], gamma, lam, kl_coef, kl_estimator, kl_mode
    )
    lengths = [len(row.logprobs) for row in rows]
    mask = completion_mask(lengths, masks)
    advantages, returns = torch.zeros_like(mask), torch.zeros_like(mask)
    width, width_c = mask.shape[1], adv_c.shape[1]
    for i, idx in enumerate(kept):
        if idx:
            at = torch.tensor(idx, dtype=torch.long) + (width - lengths[i])
            advantages[i, at] = adv_c[i, width_c - len(idx) :]
            returns[i, at] = ret_c[i, width_c - len(idx) :]
    return advantages, returns, mask


class _TokenRows:
    """One sample's per-token rows for GAE: behaviour and reference log-probs, and values."""

    def __init__(self, logprobs: list[float], ref: list[float], values: list[float]) -> None:
        self.logprobs, self.ref, self.values = logprobs, ref, values

    @classmethod
    def of(cls, s: Scored) -> _TokenRows:
        n = len(s.sample.token_ids)
        ref = s.ref_logprobs if s.ref_logprobs else s.sample.logprobs
        return cls(s.sample.logprobs, ref, s.values or [0.0] * n)

    def taking(self, idx: list[int]) -> _TokenRows:
        return _TokenRows(
            [self.logprobs[i] for i in idx],
            [self.ref[i] for i in idx],
            [self.values[i] for i in idx],
        )


def _gae(
    rows: list[_TokenRows],
    rewards: list[float],
    gamma: float,
    lam: float,
    kl_coef: float,
    kl_estimator: alg.KLKind,
    kl_mode: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = completion_mask([len(row.logprobs) for row in rows])
    width = mask.shape[1]
    logp = right_aligned([row.logprobs for row in rows], width)
    ref = right_aligned([row.ref for row in rows], width)
    penalty = kl_coef if kl_mode == "reward" else 0.0
    token_rewards = alg.token_rewards(
        torch.tensor(rewards, dtype=torch.float32),
        mask,
        logp,
        ref,
        kl_coef=penalty,
        kl_kind=kl_estimator,
    )
    values = right_aligned([row.values for row in rows], width)
    advantages, returns = alg.gae(token_rewards, values, mask, gamma, lam)
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
