"""What every engine does with a request before decoding it: check it, seed it, resume it;
and with new weights before taking them (``check_weights``).

A ``Row`` is one sample being generated: its request, its sampling seed, and the tokens,
behaviour log-probs and versions it has so far (those of its partial when it resumes one).
``prepare_row`` checks a request and builds its row; the engines (``HFEngine``, ``VLLMEngine``)
share it, so they refuse the same requests with the same messages and resume partials alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.draws import splitmix64, unit
from asyncrl.roles.payloads import GenerateRequest, Sample, SamplingParams, StopReason

__all__ = [
    "Row",
    "check_tokens",
    "check_weights",
    "prepare_row",
    "sample_seed",
    "step_seed",
    "step_uniform",
]


def sample_seed(base: int, prompt_id: str, sample_index: int) -> int:
    """The seed of a request that brings none: a hash of the engine seed and the stable id, so a
    request that runs again, here or on another replica, samples the same tokens."""
    key = f"{base}\x00{prompt_id}\x00{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def step_seed(seed: int, t: int) -> int:
    """A 63-bit seed for token ``t`` of a sample, from (seed, t) alone: what an engine that
    draws with its own generator (vLLM) seeds token ``t`` with."""
    return splitmix64(seed, t) >> 1


def step_uniform(seed: int, t: int) -> float:
    """The uniform number in [0, 1) that picks token ``t`` of a sample: 53 bits of splitmix64 of
    (seed, t), so it depends on nothing else (what else is in the batch, a resume). A
    generator seeded for each draw costs ten times as much (about 4 µs against 0.35)."""
    return unit(seed, t)


@dataclass
class Row:
    """One sample being generated: its request, its seed, and what it has so far."""

    request: GenerateRequest
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reason: str = ""
    done: bool = False  # finished: stopped or out of max_new_tokens

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def finish(self, reason: str) -> None:
        self.reason, self.done = reason, True

    @property
    def context(self) -> list[int]:
        return [*self.request.prompt.token_ids, *self.tokens]

    def sample(self) -> Sample:
        prompt = self.request.prompt
        return Sample(
            prompt_id=prompt.id,
            sample_index=self.request.sample_index,
            prompt_ids=list(prompt.token_ids),
            token_ids=self.tokens,
            logprobs=self.logprobs,
            versions=self.versions,
            finished=self.done,
            stop_reason=str(self.reason),
        )


def prepare_row(
    request: GenerateRequest, vocab: int, max_positions: int | None, base_seed: int
) -> Row:
    """A request checked and turned into a ``Row``, resumed from its partial if it has one.

    Raises:
        ValueError: an empty prompt, a token outside ``[0, vocab)``, a partial of another
        sample, or a prompt plus ``max_new_tokens`` over ``max_positions``.
    """
    prompt, params = request.prompt, request.params
    where = f"request {prompt.id!r}#{request.sample_index}"
    if not prompt.token_ids:
        raise ValueError(f"{where}: the prompt has no tokens")
    check_tokens(prompt.token_ids, vocab, where)
    if max_positions is not None:
        total = len(prompt.token_ids) + params.max_new_tokens
        if total > max_positions:
            raise ValueError(
                f"{where}: prompt ({len(prompt.token_ids)}) + max_new_tokens "
                f"({params.max_new_tokens}) = {total} tokens, over the model's "
                f"{max_positions} positions; shorten the prompt or max_new_tokens"
            )
    seed = request.seed
    if seed is None:
        seed = sample_seed(base_seed, prompt.id, request.sample_index)
    row = Row(request, seed)
    partial = request.partial
    if partial is not None:
        if partial.key != (prompt.id, request.sample_index):
            raise ValueError(f"{where}: the partial is sample {partial.key}, not this one")
        if partial.prompt_ids != prompt.token_ids:
            raise ValueError(f"{where}: the partial's prompt_ids differ from the prompt's")
        if not len(partial.token_ids) == len(partial.logprobs) == len(partial.versions):
            raise ValueError(
                f"{where}: the partial has {len(partial.token_ids)} tokens, "
                f"{len(partial.logprobs)} logprobs and {len(partial.versions)} versions"
            )
        check_tokens(partial.token_ids, vocab, where)
        row.tokens, row.logprobs = list(partial.token_ids), list(partial.logprobs)
        row.versions = list(partial.versions)
        if partial.finished:
            row.finish(partial.stop_reason)
            return row
    if len(row.tokens) >= params.max_new_tokens:
        row.finish(StopReason.LENGTH)
    return row


def check_tokens(ids: Sequence[int], vocab: int, where: str) -> None:
    """Raise ValueError naming the ids of ``ids`` outside ``[0, vocab)``."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{where}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")


def check_weights(
    state: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], version: int
) -> None:
    """Raise ValueError listing every tensor of ``state`` (weights ``version``) whose name is
    not in ``shapes`` (the model's tensors) or whose shape differs."""
    problems = []
    for name, tensor in state.items():
        shape = shapes.get(name)
        if shape is None:
            problems.append(f"{name}: not a tensor of the model")
        elif tuple(tensor.shape) != shape:
            problems.append(f"{name}: shape {tuple(tensor.shape)}, the model has {shape}")
    if problems:
        raise ValueError(f"weights version {version} do not fit the model: " + "; ".join(problems))
