"""The reference and critic roles, and the learner's KL and BC terms, in-process."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from asyncrl.role import RoleContext
from asyncrl.roles.critic import Critic
from asyncrl.roles.learner import Learner, Scored, TrainBatch
from asyncrl.roles.reference import Reference
from asyncrl.roles.rollout import Sample, WeightsUpdate

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


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def sample(pid: str, prompt: list[int], tokens: list[int], index: int = 0) -> Sample:
    return Sample(pid, index, prompt, tokens, [0.0] * len(tokens), [0] * len(tokens), True, "stop")


def test_reference_scores_like_the_learner_it_was_given(tmp_path: Any) -> None:
    async def go() -> None:
        learner = Learner(
            RoleContext.local(
                config={"model_config": MODEL, "seed": 3, "publish_weights": False},
                run_dir=str(tmp_path),
            )
        )
        await learner.setup()
        reference = Reference(RoleContext.local(config={"model_config": MODEL, "seed": 9}))
        await reference.setup()
        state = {k: v.clone() for k, v in learner.model.state_dict().items()}
        assert await reference.set_weights(WeightsUpdate(5, state)) == 5
        samples = [sample("a", [2, 3, 12, 4, 13], [5, 6, 1]), sample("b", [7, 13], [8, 1])]
        ref = await reference.logprobs(samples)
        mine = learner._logprobs(samples)
        for r, m in zip(ref, mine, strict=True):
            torch.testing.assert_close(torch.tensor(r), torch.tensor(m), atol=1e-5, rtol=0)

    asyncio.run(go())


def test_critic_values_line_up_and_learn_the_return(tmp_path: Any) -> None:
    async def go() -> None:
        critic = Critic(
            RoleContext.local(config={"model_config": MODEL, "lr": 0.02, "clip_eps": None})
        )
        await critic.setup()
        samples = [sample("a", [2, 3, 12, 4, 13], [5, 6, 1]), sample("b", [7, 13], [8, 1])]
        values = await critic.values(samples)
        assert [len(v) for v in values] == [3, 2]
        losses = []
        for _ in range(30):
            current = await critic.values(samples)
            scored = [
                Scored(s, reward=1.0, values=v) for s, v in zip(samples, current, strict=True)
            ]
            losses.append((await critic.train_step(scored))["value_loss"])
        assert losses[-1] < losses[0] * 0.1
        final = await critic.values(samples)
        # gamma = 1: the return of every token is the final reward, 1.0.
        assert all(abs(v - 1.0) < 0.2 for row in final for v in row)

    asyncio.run(go())


def test_kl_loss_pulls_towards_the_reference(tmp_path: Any) -> None:
    """With zero advantages, only the KL term moves the policy, and it moves it closer."""
    learner = Learner(
        RoleContext.local(
            config={
                "model_config": MODEL,
                "seed": 0,
                "lr": 0.02,
                "kl_coef": 1.0,
                "kl_estimator": "k3",
                "publish_weights": False,
            },
            run_dir=str(tmp_path),
        )
    )
    asyncio.run(learner.setup())
    s = sample("p", [2, 3, 12, 4, 13], [5, 6, 1])
    ref = [lp - 0.5 for lp in learner._logprobs([s])[0]]  # a reference that disagrees

    def gap() -> float:
        now = learner._logprobs([s])[0]
        return sum(abs(a - b) for a, b in zip(now, ref, strict=True))

    before = gap()
    for step in range(5):
        behaviour = learner._logprobs([s])[0]
        batch = [
            Scored(
                Sample(f"p{step}", i, s.prompt_ids, s.token_ids, behaviour, [0] * 3, True, "stop"),
                reward=1.0,
                ref_logprobs=ref,
            )
            for i in range(2)
        ]
        result = learner._train_step(TrainBatch(batch, algorithm="grpo"))
        assert "kl" in result.metrics
    assert gap() < before


def test_bc_term_anneals_to_zero(tmp_path: Any) -> None:
    learner = Learner(
        RoleContext.local(
            config={
                "model_config": MODEL,
                "bc_coef": 0.5,
                "bc_anneal_steps": 4,
                "publish_weights": False,
            },
            run_dir=str(tmp_path),
        )
    )
    asyncio.run(learner.setup())
    demo = sample("d", [2, 12, 3, 13], [5, 1])
    coefs = []
    for step in range(6):
        coefs.append(learner._bc_coef())
        batch = [Scored(sample(f"p{step}", [2, 13], [4, 1], i), reward=float(i)) for i in range(2)]
        metrics = learner._train_step(TrainBatch(batch, algorithm="grpo", demos=[demo])).metrics
        assert ("bc_nll" in metrics) == (coefs[-1] > 0)
    assert coefs == [0.5, 0.375, 0.25, 0.125, 0.0, 0.0]
