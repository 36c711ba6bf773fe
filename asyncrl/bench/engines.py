"""``asyncrl bench rollout [--json] [--quick]``: the HF and vLLM rollout engines side by side.

Same prompts, same sampling (temperature 1, a seed per request, no stop token, so both engines
generate the same number of tokens), same weights, in one process and with the same torch
threads, on three models built from a config: the arith example's GPT-2, a ~110M-parameter
GPT-2 (128 new tokens per sample) and a ~300M-parameter Qwen2 (tied embeddings, grouped-query
attention). For each: generation throughput (tokens sampled per second of one ``generate`` call
over all prompts, after a warm-up call) and the time to swap in a new state dict
(``set_weights`` + ``apply_pending``: what a rollout's ``sync`` costs past the shared-memory
read). Both engines are built side by side and measured in turns (HF, then vLLM, each round),
so a change in the machine's load reaches both; the figures are medians over the rounds, and
the ratios are vLLM's over HF's of the same run. vLLM's swap is timed on its in-place path and,
for comparison, on ``reload_weights``.

Registered under the ``asyncrl.benchmarks`` entry points (pyproject.toml), since the runtime's
own benchmarks may not import roles. Needs the ``vllm`` extra.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from asyncrl.roles.generation.engine import Engine, HFEngine
from asyncrl.roles.payloads import GenerateRequest, Prompt, SamplingParams

__all__ = ["MODELS", "BenchModel", "main", "measure"]


@dataclass(frozen=True)
class BenchModel:
    """One model of the benchmark and its workload.

    Attributes:
        name: how the table names it.
        config: ``AutoConfig.for_model`` keywords (a ``model_type`` and fields).
        prompts: how many prompts (one sample each).
        prompt_len: tokens per prompt.
        new_tokens: tokens sampled per prompt.
        max_batch: the most sequences one step decodes, in both engines.
    """

    name: str
    config: dict[str, Any]
    prompts: int
    prompt_len: int
    new_tokens: int
    max_batch: int


ARITH = BenchModel(
    "arith",
    {
        "model_type": "gpt2",
        "vocab_size": 14,
        "n_positions": 16,
        "n_embd": 128,
        "n_layer": 2,
        "n_head": 4,
        "bos_token_id": 1,
        "eos_token_id": 1,
        "pad_token_id": 0,
    },
    prompts=256,
    prompt_len=7,
    new_tokens=8,
    max_batch=128,
)
GPT2_110M = BenchModel(
    "gpt2-110m",
    {
        "model_type": "gpt2",
        "vocab_size": 32000,
        "n_positions": 256,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "bos_token_id": 1,
        "eos_token_id": 1,
        "pad_token_id": 0,
    },
    prompts=32,
    prompt_len=16,
    new_tokens=128,
    max_batch=32,
)
QWEN2_300M = BenchModel(
    "qwen2-300m",
    {
        "model_type": "qwen2",
        "vocab_size": 32000,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 1,
        "pad_token_id": 0,
    },
    prompts=16,
    prompt_len=16,
    new_tokens=32,
    max_batch=16,
)
MODELS = (ARITH, GPT2_110M, QWEN2_300M)
SWAPS = 5
ROUNDS = 3


def _requests(model: BenchModel, quick: bool) -> list[GenerateRequest]:
    vocab = int(model.config["vocab_size"])
    gen = torch.Generator().manual_seed(0)
    count = max(model.prompts // 4, 1) if quick else model.prompts
    new = max(model.new_tokens // 4, 1) if quick else model.new_tokens
    return [
        GenerateRequest(
            prompt=Prompt(
                id=f"b{i}",
                token_ids=torch.randint(2, vocab, (model.prompt_len,), generator=gen).tolist(),
            ),
            sample_index=0,
            params=SamplingParams(max_new_tokens=new),
            seed=i,
        )
        for i in range(count)
    ]


def _throughput(engine: Engine, requests: Sequence[GenerateRequest]) -> float:
    start = time.perf_counter()
    samples = engine.generate(requests)
    elapsed = time.perf_counter() - start
    return sum(len(s.token_ids) for s in samples) / elapsed


def _swap_ms(engine: Engine, state: dict[str, torch.Tensor], version: int) -> float:
    start = time.perf_counter()
    engine.set_weights(state, version)
    engine.apply_pending()
    return (time.perf_counter() - start) * 1000


def measure(model: BenchModel, *, quick: bool = False) -> dict[str, Any]:
    """One row of the table: both engines on ``model``'s workload, measured in turns.

    Raises:
        ConfigProblem: vLLM is not installed.
    """
    from asyncrl.roles.generation.vllm_engine import VLLMEngine

    requests = _requests(model, quick)
    hf = HFEngine.from_config(model.config, seed=0, max_batch=model.max_batch)
    params = sum(p.numel() for p in hf.model.parameters())
    vllm = VLLMEngine.from_config(model.config, seed=0, max_batch=model.max_batch, kv_cache_gib=1)
    try:
        # Two states, taken in turns: a new version each swap, without a copy of the model
        # per swap (at 300M parameters each is 1.2 GB).
        base = hf.model.state_dict()
        states = [{k: v + 0.01 * i for k, v in base.items()} for i in (1, 2)]
        del base
        for engine in (hf, vllm):
            engine.generate(requests[:2])  # warm-up: first-call allocations stay out
        rates: dict[str, list[float]] = {"hf": [], "vllm": []}
        for _ in range(1 if quick else ROUNDS):
            rates["hf"].append(_throughput(hf, requests))
            rates["vllm"].append(_throughput(vllm, requests))
        swaps: dict[str, list[float]] = {"hf": [], "vllm": [], "vllm_reload": []}
        for version in range(1, SWAPS + 1):
            state = states[version % 2]
            swaps["hf"].append(_swap_ms(hf, state, version))
            swaps["vllm"].append(_swap_ms(vllm, state, version))
            vllm._in_place = False  # the path every swap took before: for the comparison
            try:
                swaps["vllm_reload"].append(_swap_ms(vllm, states[(version + 1) % 2], version))
            finally:
                vllm._in_place = True
    finally:
        vllm.close()
    rate = {k: statistics.median(v) for k, v in rates.items()}
    swap = {k: statistics.median(v) for k, v in swaps.items()}
    return {
        "name": model.name,
        "params": params,
        "hf_tokens_per_s": round(rate["hf"], 1),
        "vllm_tokens_per_s": round(rate["vllm"], 1),
        "vllm_over_hf": round(rate["vllm"] / rate["hf"], 2),
        "hf_weight_swap_ms_p50": round(swap["hf"], 2),
        "vllm_weight_swap_ms_p50": round(swap["vllm"], 2),
        "vllm_swap_over_hf": round(swap["vllm"] / swap["hf"], 2),
        "vllm_reload_swap_ms_p50": round(swap["vllm_reload"], 2),
        "vllm_reload_over_hf": round(swap["vllm_reload"] / swap["hf"], 2),
        "workload": {
            **asdict(model),
            "quick": quick,
            "threads": torch.get_num_threads(),
            "swaps": SWAPS,
            "rounds": 1 if quick else ROUNDS,
        },
    }


def main(argv: Sequence[str]) -> int:
    """Run the benchmark and print its table (or one JSON object with ``--json``)."""
    parser = argparse.ArgumentParser(prog="asyncrl bench rollout", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a quarter of the work (tests)")
    parser.add_argument("--only", choices=[m.name for m in MODELS], help="one model")
    args = parser.parse_args(list(argv))
    models = [m for m in MODELS if args.only in (None, m.name)]
    rows = [measure(m, quick=args.quick) for m in models]
    if args.json:
        print(json.dumps({"models": rows}))
        return 0
    head = (
        "model",
        "params",
        "hf tok/s",
        "vllm tok/s",
        "vllm/hf",
        "hf swap ms",
        "vllm swap ms",
        "vllm/hf",
        "reload ms",
    )
    print("  ".join(f"{h:>12}" for h in head))
    for r in rows:
        cells = (
            r["name"],
            f"{r['params'] / 1e6:.1f}M",
            r["hf_tokens_per_s"],
            r["vllm_tokens_per_s"],
            r["vllm_over_hf"],
            r["hf_weight_swap_ms_p50"],
            r["vllm_weight_swap_ms_p50"],
            r["vllm_swap_over_hf"],
            r["vllm_reload_swap_ms_p50"],
        )
        print("  ".join(f"{c:>12}" for c in cells))
    sys.stdout.flush()
    return 0
