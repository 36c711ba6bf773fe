"""The reference and critic roles, and the learner's KL and BC terms, in-process."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec
import pytest
import torch

from asyncrl.role import RoleContext
from asyncrl.roles.generation.rollout import Sample, WeightsUpdate
from asyncrl.roles.payloads import CriticStepResult
from asyncrl.roles.program.clients import CriticClient
from asyncrl.roles.services.reference import Reference
from asyncrl.roles.training.critic import Critic, check_matches_learner, value_targets
from asyncrl.roles.training.learner import Learner, Scored, TrainBatch
from asyncrl.roles.training.objective import batch_advantages, bc_coef

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
    return Sample(
        prompt_id=pid,
        sample_index=index,
        prompt_ids=prompt,
        token_ids=tokens,
        logprobs=[0.0] * len(tokens),
        versions=[0] * len(tokens),
        finished=True,
        stop_reason="stop",
    )


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
        state = {k: v.clone() for k, v in learner.trainer.model.state_dict().items()}
        assert await reference.set_weights(WeightsUpdate(5, state)) == 5
        samples = [sample("a", [2, 3, 12, 4, 13], [5, 6, 1]), sample("b", [7, 13], [8, 1])]
        ref = await reference.logprobs(samples)
        mine = learner.trainer.logprobs(samples)
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
                Scored(sample=s, reward=1.0, values=v)
                for s, v in zip(samples, current, strict=True)
            ]
            losses.append((await critic.train_step(scored)).value_loss)
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
    ref = [lp - 0.5 for lp in learner.trainer.logprobs([s])[0]]  # a reference that disagrees

    def gap() -> float:
        now = learner.trainer.logprobs([s])[0]
        return sum(abs(a - b) for a, b in zip(now, ref, strict=True))

    before = gap()
    for step in range(5):
        behaviour = learner.trainer.logprobs([s])[0]
        batch = [
            Scored(
                sample=Sample(
                    prompt_id=f"p{step}",
                    sample_index=i,
                    prompt_ids=s.prompt_ids,
                    token_ids=s.token_ids,
                    logprobs=behaviour,
                    versions=[0] * 3,
                    finished=True,
                    stop_reason="stop",
                ),
                reward=1.0,
                ref_logprobs=ref,
            )
            for i in range(2)
        ]
        result = learner.train(TrainBatch(samples=batch, algorithm="grpo"))
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
        coefs.append(bc_coef(learner.config, learner.step))
        batch = [
            Scored(sample=sample(f"p{step}", [2, 13], [4, 1], i), reward=float(i)) for i in range(2)
        ]
        metrics = learner.train(TrainBatch(samples=batch, algorithm="grpo", demos=[demo])).metrics
        assert ("bc_nll" in metrics) == (coefs[-1] > 0)
    assert coefs == [0.5, 0.375, 0.25, 0.125, 0.0, 0.0]


def _ppo_batch() -> list[Scored]:
    """Samples with critic values, rewards and reference log-probs; one without a reference and
    one empty."""
    rows = [
        ([6, 7, 1], [-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5], [0.1, 0.4, 0.2], 1.0),
        ([8, 1], [-0.3, -0.7], [-0.2, -1.7], [0.5, -0.3], 0.0),
        ([9, 10, 11, 1], [-0.1, -0.2, -0.3, -0.4], [], [0.0, 0.1, 0.2, 0.3], 1.0),
        ([], [], [], [], 0.5),
    ]
    return [
        Scored(
            sample=Sample(
                prompt_id="p",
                sample_index=i,
                prompt_ids=[2, 3, 13],
                token_ids=tokens,
                logprobs=logp,
                versions=[0] * len(tokens),
                finished=True,
                stop_reason="stop",
            ),
            reward=reward,
            ref_logprobs=ref,
            values=values,
        )
        for i, (tokens, logp, ref, values, reward) in enumerate(rows)
    ]


KL_CONFIG = {"gamma": 0.9, "lam": 0.8, "kl_mode": "reward", "kl_coef": 0.3}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_critic_targets_are_the_returns_of_the_learners_advantages(
    tmp_path: Any, estimator: str
) -> None:
    """kl_mode reward: the critic's targets include the -kl_coef * KL penalty the learner's
    advantages used: returns = advantages + values, token for token."""
    config = {**KL_CONFIG, "kl_estimator": estimator}
    learner = Learner(
        RoleContext.local(
            config={"model_config": MODEL, "publish_weights": False, "algorithm": "ppo", **config},
            run_dir=str(tmp_path),
        )
    )
    asyncio.run(learner.setup())
    critic = Critic(RoleContext.local(config={"model_config": MODEL, **config}))
    asyncio.run(critic.setup())
    batch = _ppo_batch()
    advantages = batch_advantages(learner.config, "ppo", batch)
    old, returns = value_targets(critic.config, batch)
    width = returns.shape[1]
    for i, s in enumerate(batch):
        n = len(s.sample.token_ids)
        expected = [a + v for a, v in zip(advantages[i], s.values, strict=True)]
        assert returns[i, width - n :].tolist() == pytest.approx(expected, abs=1e-6)
        assert old[i, width - n :].tolist() == pytest.approx(s.values, abs=1e-6)
    # The penalty is there: the second sample's last return is its reward, 0, minus 0.3 * KL
    # at its last token, where log(ref / policy) = -1.7 + 0.7.
    assert returns[1, -1].item() == pytest.approx(-0.3 * _kl(-1.0, estimator), abs=1e-6)
    check_matches_learner(config, config)


def _kl(log_ratio: float, estimator: str) -> float:
    """A KL estimate from x = log(ref / policy), by hand."""
    import math

    x = log_ratio
    return {"k1": -x, "k2": 0.5 * x * x, "k3": math.expm1(x) - x}[estimator]


def test_critic_and_learner_return_settings_must_match() -> None:
    check_matches_learner({"kl_mode": "loss", "kl_coef": 0.1}, {})  # no penalty in the reward
    with pytest.raises(
        ValueError,
        match=r"^the critic's return targets would differ from the returns the learner's "
        r"advantages come from; set the same values in both configs: lam: learner 0.8, critic "
        r"0.95; kl_coef: learner 0.3, critic 0.0; kl_estimator: learner 'k3', critic '-'$",
    ):
        check_matches_learner(KL_CONFIG, {"gamma": 0.9})


def test_critic_dr_grpo_aggregation_divides_by_norm_len(tmp_path: Any) -> None:
    def loss(**config: Any) -> float:
        critic = Critic(RoleContext.local(config={"model_config": MODEL, "lr": 0.0, **config}))
        asyncio.run(critic.setup())
        return critic.train(_ppo_batch()).value_loss

    summed = loss(aggregation="seq_mean_token_sum")
    assert summed > 0.01
    assert loss(aggregation="seq_mean_token_sum_norm", norm_len=4) == pytest.approx(
        summed / 4, rel=1e-6
    )
    with pytest.raises(msgspec.ValidationError, match=r"^norm_len: aggregation"):
        Critic(RoleContext.local(config={"aggregation": "seq_mean_token_sum_norm"}))


class WireHandle:
    """A handle on a role in this process whose replies go through msgpack, as on the wire."""

    def __init__(self, role: Any) -> None:
        self.role = role
        self.name = "critic"
        self.members = [0]  # the replicas in the run, as a ``Handle`` has them

    async def call(self, method: str, payload: Any, reply_type: Any = Any, **_: Any) -> Any:
        reply = await getattr(self.role, method)(payload)
        return msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=reply_type)


def test_the_critic_replies_to_train_step_with_a_typed_result() -> None:
    async def go() -> tuple[CriticStepResult, CriticStepResult]:
        critic = Critic(
            RoleContext.local(config={"model_config": MODEL, "ppo_epochs": 2, "mini_batches": 2})
        )
        await critic.setup()
        client = CriticClient(cast(Any, WireHandle(critic)))
        first = await client.train_step(_ppo_batch())
        return first, await client.train_step(_ppo_batch())

    first, second = asyncio.run(go())
    assert isinstance(first, CriticStepResult)
    assert (first.step, first.optimizer_steps, second.step) == (1, 4, 2)
    assert first.value_loss > 0.01 and first.grad_norm > 0.0
    assert 0.0 <= first.value_clip_fraction <= 1.0
