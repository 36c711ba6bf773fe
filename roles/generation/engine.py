"""Rollout engines: the ``Engine`` protocol, and ``HFEngine``: transformers with our own loop.

``HFEngine`` runs its own decode loop, not ``generate()``, for what a rollout needs and
``generate()`` does not give: the behaviour log-prob and weights version of every token, new
weights between two decode steps, interruption and resumption, and per-request seeds.

The decode loop left-pads the prompts into one batch, with position ids from the attention mask
(cumsum - 1, clamped at 0) so that padding does not shift a row's positions. One prefill builds
the KV cache; each step feeds every row's last token, extends the mask by one column and takes
the next position from it. A finished row keeps its place (the shapes do not change) with a
padding token and a 0 in its mask column, and nothing more is recorded for it.

Behaviour log-probs are the log-softmax of the raw logits at temperature 1, before temperature,
top-k or top-p reshape the distribution used to sample. That is the policy's own probability of
the token, which is what the learner recomputes (``score``) for importance weights and decoupled
PPO; the sampling transforms are a property of the rollout, not of the policy.

The operators come from the hardware plugin (``asyncrl.plugins.registry``): behaviour log-probs
and ``score`` are its ``ops.logprobs`` (the learner's own operator, so the two agree to the bit
on the same logits), and the distribution a token is drawn from is its ``ops.sampling_probs``.
The engine hands it each row's logits in falling order, and the draw stays the engine's
(``draw``): an inverse CDF walked in that order, with the row's own uniform number (see Seeds).

New weights (``set_weights``, from any thread) wait in a pending slot and are loaded under the
model lock before the next forward. The generation continues with its KV cache, so keys and
values of the tokens before the switch stay those of the old weights, as in AReaL's interruptible
generation: a token sampled after a switch has its log-prob under the new weights *given that
mixed cache*, recorded with the new version. A learner recompute under the new weights alone
differs from it by the cache's contribution; a caller that wants no mixing interrupts at the
switch and resumes, since a resumed sample's prefill recomputes the whole cache.

Partial rollouts: ``should_interrupt()`` (checked after each step) or the chunk budget
(``chunk_tokens`` new tokens per call) return unfinished samples (``finished=False``). Sent back
as ``GenerateRequest.partial``, a sample resumes with prompt + its tokens as the prefill, keeps
its tokens, log-probs and versions, and only generates what remains of ``max_new_tokens``.

Seeds: the uniform number that picks token ``t`` of a sample is a hash of (request seed, t) alone
(``step_uniform``). So a request is reproducible whatever else is in the batch,
and an interrupted-then-resumed sample draws the same numbers as an uninterrupted one.

Batch invariance: the float rounding of a row's logits depends on the shapes of the forward that
computed them (a CPU matrix product picks its blocking by shape), so the same request decoded in
batches of other sizes, or beside a longer prompt, gets log-probs that differ in the last bits
(about 2e-7 on the arith model), and a learner trained on them drifts from run to run. With
``batch_invariant`` every forward has the same shapes: each batch is filled up to ``max_batch``
rows with finished copies of its first row, and prompts are left-padded to the model's positions
minus the batch's ``max_new_tokens``. A row's tokens and log-probs then do not depend on what else
was in its batch or where it sat (the rollout tests check this bit for bit), at the cost of always
decoding ``max_batch`` rows of full width.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from asyncrl.plugins.contract import Operators
from asyncrl.plugins.registry import current as current_plugin
from asyncrl.roles.generation.engine_rows import (
    Row,
    check_tokens,
    check_weights,
    prepare_row,
    sample_seed,
    step_uniform,
)
from asyncrl.roles.payloads import GenerateRequest, Sample, StopReason

__all__ = [
    "Engine",
    "EngineStats",
    "HFEngine",
    "draw",
    "left_pad",
    "position_ids_from_mask",
    "sample_seed",
]


class Engine(Protocol):
    """What the rollout role needs from an engine: ``HFEngine`` here, ``VLLMEngine`` in
    ``asyncrl.roles.generation.vllm_engine``. ``set_weights`` may be called from any thread while
    ``generate`` runs in another.

    Attributes:
        stats: what the engine computed since it was built.
        on_step: called in the generating thread after each decode step that leaves rows
            unfinished, with the number of steps done (tracing, tests).
    """

    stats: EngineStats
    on_step: Callable[[int], None] | None

    @property
    def version(self) -> int:
        """The weights version active now."""
        ...

    @property
    def has_pending_weights(self) -> bool:
        """Whether weights set by ``set_weights`` still wait to be loaded."""
        ...

    @property
    def pending_version(self) -> int | None:
        """The version of the weights waiting to be loaded, or None."""
        ...

    def apply_pending(self) -> int:
        """Load pending weights now, if any; return the version active after."""
        ...

    def generate(
        self,
        requests: Sequence[GenerateRequest],
        *,
        should_interrupt: Callable[[], bool] | None = None,
    ) -> list[Sample]:
        """One Sample per request, in order; unfinished ones when interrupted."""
        ...

    def set_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Take new weights; they are active from the next decode step."""
        ...

    def score(
        self,
        prompt_ids_batch: Sequence[Sequence[int]],
        completion_ids_batch: Sequence[Sequence[int]],
    ) -> list[list[float]]:
        """The log-prob of every completion token given its prompt and the tokens before it."""
        ...


@dataclass
class EngineStats:
    """Counters of what an engine computed, since it was built.

    Attributes:
        forward_passes: model forwards (prefills, decode steps and scores).
        prefill_tokens: real (not padding) tokens fed to generation prefills.
        tokens_generated: tokens sampled and recorded in a sample.
        weight_switches: pending weights loaded into the model.
    """

    forward_passes: int = 0
    prefill_tokens: int = 0
    tokens_generated: int = 0
    weight_switches: int = 0


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: each row counts from 0 at its first real token."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def left_pad(
    seqs: Sequence[Sequence[int]],
    pad_id: int,
    device: torch.device | str = "cpu",
    *,
    width: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of ``seqs`` left-padded to the longest (or to ``width``,
    when that is longer), as int64 tensors."""
    width = max(width, *(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(list(s), dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def draw(probs: torch.Tensor, uniform: Sequence[float]) -> torch.Tensor:
    """One column per row of ``probs`` ([N, V]: a distribution per row, zero where a token is
    out) by inverse CDF: walking the columns in order, the first whose cumulative probability
    passes the row's ``uniform`` (in [0, 1)) times the row's total. A column of zero
    probability is never picked, wherever it sits.

    The engine's columns are the tokens in order of falling logits (the lower id first on a
    tie), so a uniform picks the same token of the same logits whatever else is in the batch.
    """
    cdf = probs.cumsum(-1)
    u = torch.tensor(list(uniform), device=cdf.device, dtype=cdf.dtype)[:, None] * cdf[:, -1:]
    pick = torch.searchsorted(cdf, u, right=True)
    # Rounding may step past the last column with probability (u * total == total): take it.
    last = (probs > 0).cumsum(-1).argmax(-1, keepdim=True)
    return torch.minimum(pick, last).squeeze(-1)


class HFEngine:
    """A transformers causal LM behind the ``Engine`` protocol (see the module docstring).

    Thread-safe: ``set_weights`` may be called from any thread while ``generate`` runs in
    another; forwards and weight loads take turns under one lock.

    Args:
        model: a causal LM (``AutoModelForCausalLM``); it is moved to ``device`` and ``dtype``,
            put in eval mode, and its parameters stop requiring grad.
        device: where the model runs.
        dtype: the model's dtype; fp32 by default, in which behaviour log-probs and ``score``
            agree to 1e-4.
        seed: seeds requests that bring no seed (see ``sample_seed``).
        max_batch: the most sequences one forward takes; more requests run in turns.
        chunk_tokens: the most new tokens a sample gets per ``generate`` call (0: no budget).
        batch_invariant: decode every batch with the same shapes, so that a row's result does
            not depend on the rest of its batch (see the module docstring).
        version: the version of the model's initial weights.
        on_step: called in the generating thread after each decode step but the last, with the
            number of steps done; for tracing and tests.
        ops: the operators behaviour log-probs, ``score`` and sampling use; None: those of the
            process's hardware plugin (``asyncrl.plugins.registry.current()``).
    """

    def __init__(
        self,
        model: Any,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        max_batch: int = 64,
        chunk_tokens: int = 0,
        batch_invariant: bool = False,
        version: int = 0,
        on_step: Callable[[int], None] | None = None,
        ops: Operators | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch: expected an int >= 1, got {max_batch}")
        if chunk_tokens < 0:
            raise ValueError(f"chunk_tokens: expected an int >= 0, got {chunk_tokens}")
        self.device = torch.device(device)
        self.ops = current_plugin().ops if ops is None else ops
        self.model = model.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.seed = seed
        self.max_batch = max_batch
        self.chunk_tokens = chunk_tokens
        self.batch_invariant = batch_invariant
        self.on_step = on_step
        self.stats = EngineStats()
        self._version = version
        self._lock = threading.RLock()  # the model, its version and the stats
        self._pending_lock = threading.Lock()  # only the pending slot: set_weights never waits
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        self._shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values to cache (the old name warns).
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" in params
        config = self.model.config
        self._vocab = int(self.model.get_input_embeddings().num_embeddings)
        self._max_positions: int | None = getattr(config, "max_position_embeddings", None)
        pad = getattr(config, "pad_token_id", None)
        self._pad_id = pad if isinstance(pad, int) and 0 <= pad < self._vocab else 0
        if batch_invariant and self._max_positions is None:
            raise ValueError(
                "batch_invariant: the model's config has no max_position_embeddings to pad "
                "prompts to; turn batch_invariant off for this model"
            )

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> HFEngine:
        """An engine over ``AutoModelForCausalLM.from_pretrained(path)``; kwargs as ``__init__``."""
        from transformers import AutoModelForCausalLM

        dtype = kwargs.get("dtype", torch.float32)
        return cls(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), **kwargs)

    @classmethod
    def from_config(cls, model_config: Mapping[str, Any], **kwargs: Any) -> HFEngine:
        """An engine over a model with random weights seeded by ``seed``.

        ``model_config`` is ``AutoConfig.for_model``'s keywords: a ``model_type`` and fields.

        Raises:
            ValueError: ``model_config`` names no ``model_type``.
        """
        from transformers import AutoConfig, AutoModelForCausalLM

        fields = dict(model_config)
        model_type = fields.pop("model_type", None)
        if not isinstance(model_type, str):
            raise ValueError(
                f"model_config: expected a 'model_type' string (e.g. 'gpt2'), got {model_type!r}"
            )
        config = AutoConfig.for_model(model_type, **fields)
        auto: Any = AutoModelForCausalLM  # from_config is untyped
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(kwargs.get("seed", 0))
            model = auto.from_config(config)
        return cls(model, **kwargs)

    @property
    def version(self) -> int:
        """The weights version active now (pending weights are not active yet)."""
        return self._version

    @property
    def has_pending_weights(self) -> bool:
        """Whether weights set by ``set_weights`` still wait to be loaded."""
        return self._pending is not None

    @property
    def pending_version(self) -> int | None:
        """The version of the weights waiting in the pending slot, or None when none wait."""
        pending = self._pending
        return None if pending is None else pending[1]

    def set_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Put ``state`` in the pending slot, replacing any weights still waiting there.

        The weights are loaded before the next forward (a decode step of a generation in
        progress, a prefill, a score) or by ``apply_pending``. Every update is taken, whatever
        its version: the newest delivered wins. ``state`` may hold a subset of the model's
        tensors; the others keep their values.

        Raises:
            ValueError: a name the model does not have or a shape that differs, all listed.
        """
        check_weights(state, self._shapes, version)
        with self._pending_lock:
            self._pending = (dict(state), version)

    def apply_pending(self) -> int:
        """Load pending weights now, if any; return the version active after."""
        with self._lock:
            self._apply_pending_locked()
            return self._version

    def _apply_pending_locked(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        state, version = pending
        with torch.no_grad():
            self.model.load_state_dict(state, strict=False)
        self._version = version
        self.stats.weight_switches += 1

    def generate(
        self,
        requests: Sequence[GenerateRequest],
        *,
        should_interrupt: Callable[[], bool] | None = None,
    ) -> list[Sample]:
        """Sample (or resume) one completion per request; one Sample per request, in order.

        ``should_interrupt`` is called after each decode step that leaves rows unfinished; when
        it returns True, those rows come back with ``finished=False`` and stop reason
        ``interrupted``, as do requests of later ``max_batch`` turns that had not started.

        Raises:
            ValueError: an empty prompt, a token out of the vocabulary, a partial of another
                sample, or a prompt plus ``max_new_tokens`` longer than the model's positions;
                all requests are checked before any is run.
        """
        rows = [self._row(r) for r in requests]
        todo = [row for row in rows if not row.done]
        interrupted = False
        for start in range(0, len(todo), self.max_batch):
            group = todo[start : start + self.max_batch]
            if interrupted:
                for row in group:
                    row.reason = StopReason.INTERRUPTED
            else:
                interrupted = self._decode(group, should_interrupt)
        return [row.sample() for row in rows]

    def _row(self, request: GenerateRequest) -> Row:
        return prepare_row(request, self._vocab, self._max_positions, self.seed)

    def _decode(self, rows: list[Row], should_interrupt: Callable[[], bool] | None) -> bool:
        """Generate for ``rows`` until all finish or the loop is cut; True if interrupted."""
        real, width = len(rows), 0
        if self.batch_invariant:
            # Finished copies of the first row: decoded along, never recorded.
            first = rows[0]
            rows = rows + [
                Row(first.request, first.seed, reason=StopReason.LENGTH, done=True)
                for _ in range(self.max_batch - real)
            ]
            assert self._max_positions is not None  # checked in __init__
            width = self._max_positions - max(row.params.max_new_tokens for row in rows)
        ids, mask = left_pad([row.context for row in rows], self._pad_id, self.device, width=width)
        positions = position_ids_from_mask(mask)
        inputs, cache = ids, None
        with self._lock:
            self.stats.prefill_tokens += int(mask[:real].sum())
        steps = 0
        while True:
            logits, cache, version = self._forward(
                inputs, mask, positions, cache, keep=1, use_cache=True
            )
            tokens, logprobs = self._choose(logits[:, -1, :], rows)
            steps += 1
            recorded = 0
            for row, token, logprob in zip(rows, tokens, logprobs, strict=True):
                if row.done:
                    continue
                row.tokens.append(token)
                row.logprobs.append(logprob)
                row.versions.append(version)
                recorded += 1
                if token in row.params.stop_token_ids:
                    row.finish(StopReason.STOP)
                elif len(row.tokens) >= row.params.max_new_tokens:
                    row.finish(StopReason.LENGTH)
            with self._lock:
                self.stats.tokens_generated += recorded
            if all(row.done for row in rows):
                return False
            if self.on_step is not None:
                self.on_step(steps)
            cut = ""
            if self.chunk_tokens and steps >= self.chunk_tokens:
                cut = StopReason.CHUNK
            elif should_interrupt is not None and should_interrupt():
                cut = StopReason.INTERRUPTED
            if cut:
                for row in rows:
                    if not row.done:
                        row.reason = cut
                return cut == StopReason.INTERRUPTED
            alive = torch.tensor([not row.done for row in rows], device=self.device)
            last = torch.tensor(tokens, device=self.device)
            inputs = torch.where(alive, last, self._pad_id)[:, None]
            mask = torch.cat([mask, alive.long()[:, None]], dim=1)
            positions = position_ids_from_mask(mask)[:, -1:]

    def _forward(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        *,
        keep: int,
        use_cache: bool,
    ) -> tuple[torch.Tensor, Any, int]:
        """One forward with the newest weights: fp32 logits of the last ``keep`` positions,
        the cache, and the version that computed them."""
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": use_cache}
        if self._keep_kw:
            kwargs["logits_to_keep"] = keep
        with self._lock:
            self._apply_pending_locked()
            version = self._version
            with torch.inference_mode():
                out = self.model(
                    input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs
                )
            self.stats.forward_passes += 1
        logits = out.logits[:, -keep:, :].float()
        return logits, getattr(out, self._cache_kw, None), version

    def _choose(self, logits: torch.Tensor, rows: list[Row]) -> tuple[list[int], list[float]]:
        """The next token of each row and its behaviour log-prob (the plugin's ``logprobs`` of
        the raw logits, temperature 1).

        A greedy row takes the argmax. The others are drawn from the plugin's
        ``sampling_probs`` (rows with the same temperature, top-p and top-k in one call) by
        ``draw``, with the row's uniform for token t (``step_uniform`` of the row's seed and t)."""
        vocab = logits.shape[-1]
        chosen = logits.argmax(-1)
        groups: dict[tuple[float, float, int], list[int]] = {}
        uniform: dict[int, float] = {}
        for i, row in enumerate(rows):
            params = row.params
            if row.done or params.greedy or params.temperature == 0.0:
                continue
            uniform[i] = step_uniform(row.seed, len(row.tokens))
            top_k = params.top_k if params.top_k < vocab else 0
            groups.setdefault((params.temperature, params.top_p, top_k), []).append(i)
        for (temperature, top_p, top_k), index in groups.items():
            at = torch.tensor(index, device=logits.device)
            # The plugin gets each row's logits in falling order (stable, so rank 0 is the
            # argmax, the first on ties: top_k=1 is greedy), and the draw walks them so.
            order = torch.sort(logits[at] / temperature, dim=-1, descending=True, stable=True)[1]
            probs = self.ops.sampling_probs(
                logits[at].gather(-1, order), temperature=temperature, top_p=top_p, top_k=top_k
            )
            pick = draw(probs, [uniform[i] for i in index])
            chosen[at] = order.gather(-1, pick[:, None]).squeeze(-1)
        logprobs = self.ops.logprobs(logits, chosen)
        return [int(t) for t in chosen.tolist()], [float(x) for x in logprobs.tolist()]

    def score(
        self,
        prompt_ids_batch: Sequence[Sequence[int]],
        completion_ids_batch: Sequence[Sequence[int]],
    ) -> list[list[float]]:
        """Log-probs of each completion's tokens under the newest weights, one forward per
        ``max_batch`` sequences: the learner-side recompute of behaviour log-probs.

        Raises:
            ValueError: the two batches differ in length, a prompt is empty, or a token is
                outside the vocabulary.
        """
        prompts, completions = prompt_ids_batch, completion_ids_batch
        if len(prompts) != len(completions):
            raise ValueError(
                f"score: {len(prompts)} prompts but {len(completions)} completions; "
                "give one completion per prompt"
            )
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            if not prompt:
                raise ValueError(f"score: prompt {i} has no tokens")
            check_tokens([*prompt, *completion], self._vocab, f"score: sequence {i}")
        out: list[list[float]] = []
        for at in range(0, len(prompts), self.max_batch):
            out += self._score_group(
                prompts[at : at + self.max_batch], completions[at : at + self.max_batch]
            )
        return out

    def _score_group(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        longest = max(len(c) for c in completions)
        if longest == 0:
            return [[] for _ in completions]
        seqs = [[*p, *c] for p, c in zip(prompts, completions, strict=True)]
        ids, mask = left_pad(seqs, self._pad_id, self.device)
        positions = position_ids_from_mask(mask)
        # Logits at the last longest+1 positions; the one at column j predicts token j + 1.
        logits, _, _ = self._forward(ids, mask, positions, None, keep=longest + 1, use_cache=False)
        token_logprobs = self.ops.logprobs(logits[:, :-1, :], ids[:, -longest:])
        return [
            token_logprobs[i, longest - len(c) :].tolist() if c else []
            for i, c in enumerate(completions)
        ]
