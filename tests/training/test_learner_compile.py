"""``compile: true``: the learner's compiled step takes the eager step's losses and updates,
within float rounding, and compiles one graph per length bucket."""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any

import pytest
import torch

from asyncrl.role import RoleContext
from asyncrl.roles.payloads import Sample
from asyncrl.roles.training.learner import Learner, Scored, TrainBatch
from asyncrl.roles.training.learner_compile import (
    COMPILE_BUCKETS,
    MATH_ATTENTION_MAX,
    CompiledStep,
    bucket_of,
)

# torch.compile imports modules of torch's that warn of their own deprecation, and dynamo reads
# the .grad of a non-leaf input (decoupled PPO's proximal log-probs) while it traces.
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
]

MODEL = {
    "model_type": "gpt2",
    "vocab_size": 14,
    "n_positions": 32,
    "n_embd": 32,
    "n_layer": 1,
    "n_head": 2,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "pad_token_id": 0,
}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def make(tmp_path: Any, name: str, **config: Any) -> Learner:
    ctx = RoleContext.local(
        config={"model_config": MODEL, "seed": 0, "durable": False, **config},
        run_dir=str(tmp_path / name),
        name="learner",
    )
    learner = Learner(ctx)
    asyncio.run(learner.setup())
    return learner


def batch(step: int, prompt_len: int, correction: str = "clip") -> TrainBatch:
    """Two groups of four; completions of 1 to 4 tokens."""
    rng = random.Random(step)
    samples = []
    for i in range(8):
        n = rng.randrange(1, 5)
        samples.append(
            Scored(
                sample=Sample(
                    prompt_id=f"p{step}-{i // 4}",
                    sample_index=i % 4,
                    prompt_ids=[1] + [rng.randrange(2, 14) for _ in range(prompt_len - 1)],
                    token_ids=[rng.randrange(2, 14) for _ in range(n)],
                    logprobs=[-rng.random() * 3 for _ in range(n)],
                    versions=[0] * n,
                    finished=True,
                    stop_reason="stop",
                ),
                reward=float(rng.random() < 0.5),
            )
        )
    return TrainBatch(samples=samples, algorithm="grpo", correction=correction)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_compiled_step_matches_the_eager_one(tmp_path: Any) -> None:
    eager = make(tmp_path, "eager", entropy_coef=0.01)
    compiled = make(tmp_path, "compiled", entropy_coef=0.01, compile=True)
    # Lengths 9..12 share bucket 12, 20..23 bucket 24: the third step compiles again, the
    # fourth does not; the fourth is decoupled PPO, whose policy loss is compiled anew.
    steps = [(0, 7, "clip"), (1, 8, "clip"), (2, 19, "clip"), (3, 8, "decoupled")]
    for step, prompt_len, correction in steps:
        a = eager.train(batch(step, prompt_len, correction)).metrics
        b = compiled.train(batch(step, prompt_len, correction)).metrics
        for key in ("policy_loss", "entropy", "clip_fraction", "approx_kl", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (step, key)
        assert ("compile_s" in b) == (step in (0, 2, 3)), step
        assert "compile_s" not in a
    assert compiled.trainer.compiled is not None
    functions = compiled.trainer.compiled.functions
    assert not any(c.eager for c in functions), [c.error for c in functions]
    # The forward pass: buckets 12 and 24; each policy loss: bucket 12, and 24 for clip.
    assert [c.compiles for c in functions] == [2, 2, 1]
    for (name, x), y in zip(
        eager.trainer.model.state_dict().items(),
        compiled.trainer.model.state_dict().values(),
        strict=True,
    ):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5, msg=name)


def test_buckets_pad_by_less_than_half() -> None:
    assert COMPILE_BUCKETS[:10] == [8, 12, 16, 20, 24, 28, 32, 48, 64, 96]
    assert all(b / a <= 1.5 for a, b in itertools.pairwise(COMPILE_BUCKETS))


class _Recording:
    """A compiler whose functions run eagerly and record the attention the model runs."""

    def __init__(self, watched: Any = None) -> None:
        self.seen: list[str] = []
        self.watched = watched

    def compile(self, fn: Any, *, buckets: Any, dim: int = 1) -> Any:
        def run(*args: torch.Tensor) -> Any:
            self.seen.append((self.watched or config)._attn_implementation)
            if args[0].shape[1] == 13:
                raise RuntimeError("boom")
            return fn(*args)

        run.compiles, run.eager, run.error = 0, False, ""  # type: ignore[attr-defined]
        return run


class _Config:
    _attn_implementation = "sdpa"


config = _Config()


@pytest.mark.parametrize(
    ("length", "attention"),
    [(12, "eager"), (MATH_ATTENTION_MAX, "eager"), (MATH_ATTENTION_MAX + 1, "sdpa")],
)
def test_short_buckets_compile_plain_attention(length: int, attention: str) -> None:
    compiler = _Recording()
    model = type("Model", (), {"config": config})()
    step = CompiledStep(compiler, lambda ids: ids.sum(), model)  # type: ignore[arg-type]
    assert step.forward(torch.ones(2, length)) == 2 * length
    assert compiler.seen == [attention]
    assert config._attn_implementation == "sdpa"  # eager calls keep the model's own


def test_the_models_attention_comes_back_when_the_call_fails() -> None:
    model = type("Model", (), {"config": config})()
    step = CompiledStep(_Recording(), lambda ids: ids, model)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="boom"):
        step.forward(torch.ones(1, 13))
    assert config._attn_implementation == "sdpa"


def test_a_length_takes_the_smallest_bucket_that_holds_it() -> None:
    assert [bucket_of(n) for n in (1, 8, 9, 28, 29, 33, 97)] == [8, 8, 12, 28, 32, 48, 128]
    assert bucket_of(10**9) == 10**9


def test_an_eager_fallback_and_a_composite_model_keep_their_own_attention() -> None:
    compiler = _Recording()
    model = type("Model", (), {"config": config})()
    step = CompiledStep(compiler, lambda ids: ids.sum(), model)  # type: ignore[arg-type]
    step.functions[0].eager = True  # compilation failed: the function runs eagerly
    step.forward(torch.ones(1, 12))
    composite = type("Config", (), {"_attn_implementation": "sdpa", "sub_configs": {"t": 0}})()
    outer = type("Model", (), {"config": composite})()
    inner = _Recording(composite)
    step = CompiledStep(inner, lambda ids: ids.sum(), outer)  # type: ignore[arg-type]
    step.forward(torch.ones(1, 12))
    assert compiler.seen == inner.seen == ["sdpa"]
