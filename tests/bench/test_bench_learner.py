"""``asyncrl bench learner`` compares the learner with a plain PyTorch step doing the same work:
from the same weights, steps of each on the same batches leave the same weights, up to float
rounding: at 256 samples (one group) they agree to the bit; in the small case the learner
computes GRPO's advantages of 8 groups in Python floats and the plain step in a tensor, and
AdamW turns a rounding difference in a near-zero gradient into a few percent of one update
(1.5e-5 after three steps at lr 5e-4)."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import pytest
import torch

from asyncrl.bench import learner as big
from asyncrl.bench import learner_small as small
from asyncrl.role import RoleContext
from asyncrl.roles.training.learner import Learner, TrainBatch


def _learner(config: dict[str, Any], run_dir: pathlib.Path) -> Learner:
    ctx = RoleContext.local(config=config, run_dir=str(run_dir), name="learner")
    learner = Learner(ctx)
    asyncio.run(learner.setup())
    return learner


def _assert_same_weights(learner: Learner, plain: torch.nn.Module, atol: float = 0.0) -> None:
    theirs = dict(plain.named_parameters())
    mine = dict(learner.trainer.model.named_parameters())
    assert list(mine) == list(theirs)
    for name, value in mine.items():
        torch.testing.assert_close(value, theirs[name], rtol=0, atol=atol, msg=name)


@pytest.fixture
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_small_plain_step_takes_the_eager_learners_step(
    tmp_path: pathlib.Path, one_thread: None
) -> None:
    learner = _learner(small.CONFIG, tmp_path)
    try:
        plain = small.PlainStep()
        # The learners' fused AdamW: the same optimizer, not the slower per-tensor default.
        assert plain.opt.defaults["fused"] is True
        assert plain.opt.defaults["weight_decay"] == 0.0  # the learner's, not torch's 0.01
        assert learner.trainer.optimizer.defaults["weight_decay"] == 0.0
        _assert_same_weights(learner, plain.model)  # the same start
        for step in range(3):
            batch = small.small_batch(step)
            assert learner.train(batch).consumed == 64
            plain(batch)
        _assert_same_weights(learner, plain.model, atol=0.1 * small.LR)
    finally:
        asyncio.run(learner.teardown())


def test_the_256_sample_plain_step_takes_the_learners_step(
    tmp_path: pathlib.Path, one_thread: None
) -> None:
    config = {"model_config": big.MODEL, "lr": 1e-3, "publish_weights": False, "durable": False}
    learner = _learner(config, tmp_path)
    try:
        plain = big.PlainStep()
        assert plain.opt.defaults["weight_decay"] == 0.0  # the learner's, not torch's 0.01
        assert learner.trainer.optimizer.defaults["weight_decay"] == 0.0
        _assert_same_weights(learner, plain.model)
        for step in range(2):
            samples = big.grpo_batch(256, step)
            result = learner.train(TrainBatch(samples=samples, algorithm="grpo"))
            assert result.consumed == 256
            assert plain(samples) > 0
        _assert_same_weights(learner, plain.model, atol=1e-6)
    finally:
        asyncio.run(learner.teardown())
