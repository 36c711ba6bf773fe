"""Cross-hardware checkpoints with the real learner: a checkpoint written under one dtype setting
(float32, bfloat16) loads under the other; the first forward pass matches within bf16's
rounding, and training continues from it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from asyncrl.role import RoleContext
from asyncrl.roles.generation.rollout import Sample
from asyncrl.roles.training.learner import Learner, Scored, TrainBatch

MODEL = {
    "model_type": "gpt2",
    "vocab_size": 14,
    "n_positions": 16,
    "n_embd": 32,
    "n_layer": 1,
    "n_head": 2,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
TOLERANCE = 0.05
"""The largest difference of a log-prob after crossing bf16 (8 bits of mantissa): the weights
are rounded once, and the forward pass of the bf16 model rounds each activation."""


def _make(run_dir: Any, dtype: str) -> Learner:
    ctx = RoleContext.local(
        config={
            "model_config": MODEL,
            "seed": 0,
            "lr": 0.01,
            "dtype": dtype,
            "checkpoint_every": 1,
        },
        run_dir=str(run_dir),
        name="learner",
    )
    learner = Learner(ctx)
    asyncio.run(learner.setup())
    return learner


def _sample(pid: str, tokens: list[int], index: int = 0) -> Sample:
    return Sample(
        prompt_id=pid,
        sample_index=index,
        prompt_ids=[2, 3, 13],
        token_ids=tokens,
        logprobs=[0.0] * len(tokens),
        versions=[0] * len(tokens),
        finished=True,
        stop_reason="stop",
    )


def _batch(step: int) -> TrainBatch:
    samples = [
        Scored(sample=_sample(f"p{step}", [4 + i, 5, 1], i), reward=float(i)) for i in range(4)
    ]
    return TrainBatch(samples=samples, algorithm="grpo")


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.mark.parametrize(("saved", "loaded"), [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_a_checkpoint_loads_under_the_other_dtype(tmp_path: Any, saved: str, loaded: str) -> None:
    writer = _make(tmp_path, saved)
    writer.train(_batch(0))
    probe = [_sample("probe", [6, 7, 1])]
    before = writer.trainer.logprobs(probe)[0]
    reader = _make(tmp_path, loaded)  # setup() loads the writer's checkpoint
    assert (reader.step, reader.version) == (1, 1)
    assert next(reader.trainer.model.parameters()).dtype == getattr(torch, loaded)
    after = reader.trainer.logprobs(probe)[0]
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) <= TOLERANCE
    assert before != after  # the dtypes really differ: the probe sees the rounding
    result = reader.train(_batch(1))
    assert (result.step, reader.version) == (2, 2)
    assert all(torch.isfinite(p).all() for p in reader.trainer.model.parameters())
