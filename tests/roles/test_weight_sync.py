"""Learner -> rollout through the shared-memory weight store, and log-prob agreement across them.

The behaviour log-probs the rollout records must equal the learner's recompute of the same tokens
under the same weights, to 1e-4 in fp32, for a batch with left padding.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from asyncrl.role import RoleContext
from asyncrl.roles.learner import Learner, Scored, TrainBatch
from asyncrl.roles.rollout import (
    GenerateBatch,
    GenerateRequest,
    Prompt,
    Rollout,
    Sample,
    SamplingParams,
)

MODEL = {
    "model_type": "gpt2",
    "vocab_size": 14,
    "n_positions": 24,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 2,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "pad_token_id": 0,
}


def test_weights_flow_through_shared_memory_and_log_probs_agree(tmp_path: Any) -> None:
    torch.set_num_threads(1)

    async def go() -> None:
        learner = Learner(
            RoleContext.local(
                config={"model_config": MODEL, "seed": 1, "lr": 0.01},
                run_dir=str(tmp_path),
                name="learner",
                run="sync-test",
            )
        )
        await learner.setup()
        demo = Sample("d", 0, [2, 3, 12, 4, 5, 13], [6, 7, 1], [], [], True, "stop")
        learner._train_step(TrainBatch([Scored(demo)], algorithm="bc"))
        assert learner.version == 1

        rollout = Rollout(
            RoleContext.local(
                config={"model_config": MODEL, "seed": 99, "weights_from": "learner"},
                run_dir=str(tmp_path),
                name="rollout",
                run="sync-test",
            )
        )
        await rollout.setup()  # a (re)started replica loads the latest weights before work
        assert await rollout.version(None) == 1

        learner._train_step(
            TrainBatch(
                [Scored(Sample("e", 0, [3, 12, 13], [8, 1], [], [], True, "stop"))], algorithm="bc"
            )
        )
        assert await rollout.sync(None) == 2
        for name, tensor in learner.model.state_dict().items():
            assert torch.equal(rollout.engine.model.state_dict()[name], tensor), name

        prompts = [[2, 3, 12, 4, 5, 13], [9, 13], [4, 12, 7, 13, 2, 2, 2, 3]]  # left padding
        params = SamplingParams(temperature=1.0, max_new_tokens=6)
        requests = [
            GenerateRequest(Prompt(f"p{i}", ids), 0, params, seed=i)
            for i, ids in enumerate(prompts)
        ]
        samples = await rollout.generate(GenerateBatch(requests))
        assert all(s.versions == [2] * len(s.token_ids) for s in samples)
        recomputed = learner._logprobs(samples)
        for s, again in zip(samples, recomputed, strict=True):
            torch.testing.assert_close(
                torch.tensor(again), torch.tensor(s.logprobs), atol=1e-4, rtol=0
            )
        await learner.teardown()

    asyncio.run(go())
