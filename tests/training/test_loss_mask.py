"""An episode's environment tokens are context, never trained: the loss mask reaches the loss,
BC's likelihood, GAE, whitening and staleness, and a single-turn sample trains as before."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
import torch

from asyncrl.role import RoleContext
from asyncrl.roles.learning.batching import completion_mask, gae_targets, loss_masks, pad_batch
from asyncrl.roles.payloads import Sample, Scored, TrainBatch
from asyncrl.roles.training.learner import Learner
from asyncrl.roles.training.objective import batch_advantages

MODEL = {
    "model_type": "gpt2",
    "vocab_size": 32,
    "n_positions": 64,
    "n_embd": 16,
    "n_layer": 1,
    "n_head": 2,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "pad_token_id": 0,
}

PROMPT = [5, 6, 7]
TOKENS = [9, 10, 11, 12, 13, 14, 1]  # policy 9 10 | environment 11 12 13 | policy 14 1
MASK = [1, 1, 0, 0, 0, 1, 1]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def make(tmp_path: Any, **config: Any) -> Learner:
    ctx = RoleContext.local(
        config={"model_config": MODEL, "seed": 0, "lr": 0.0, "grad_clip": 1e9, **config},
        run_dir=str(tmp_path),
        name="learner",
    )
    learner = Learner(ctx)
    asyncio.run(learner.setup())
    return learner


def episode(
    index: int = 0,
    mask: list[int] | None = None,
    logprobs: list[float] | None = None,
    tokens: list[int] = TOKENS,
    versions: list[int] | None = None,
) -> Sample:
    return Sample(
        prompt_id="ep",
        sample_index=index,
        prompt_ids=PROMPT,
        token_ids=tokens,
        logprobs=logprobs or [0.0] * len(tokens),
        versions=versions or [0] * len(tokens),
        finished=True,
        stop_reason="stop",
        loss_mask=MASK if mask is None else mask,
    )


def grads(learner: Learner) -> torch.Tensor:
    return torch.cat(
        [p.grad.flatten() for p in learner.trainer.model.parameters() if p.grad is not None]
    )


class Legacy(msgspec.Struct, kw_only=True):
    """Sample as it was before episodes existed."""

    prompt_id: str
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finished: bool
    stop_reason: str


def test_a_single_turn_sample_encodes_as_before_and_old_bytes_decode() -> None:
    fields = dict(
        prompt_id="p",
        sample_index=2,
        prompt_ids=[1, 2],
        token_ids=[3],
        logprobs=[-0.5],
        versions=[4],
        finished=True,
        stop_reason="stop",
    )
    assert msgspec.msgpack.encode(Sample(**fields)) == msgspec.msgpack.encode(Legacy(**fields))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(Legacy(**fields)), type=Sample)
    assert decoded.loss_mask == [] and decoded.policy_versions == [4]
    multi = Sample(**{**fields, "token_ids": [3, 4], "logprobs": [0.0, 0.0], "versions": [4, 4]})
    multi.loss_mask = [1, 0]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(multi), type=Sample) == multi


def test_the_target_mask_follows_the_loss_mask() -> None:
    plain = pad_batch([PROMPT, [5]], [TOKENS, [9, 1]])[3]
    masked = pad_batch([PROMPT, [5]], [TOKENS, [9, 1]], masks=[MASK, []])[3]
    assert plain[0].tolist()[-7:] == [1.0] * 7
    assert masked[0].tolist()[-7:] == [float(m) for m in MASK]
    assert masked[1].tolist() == plain[1].tolist()
    assert completion_mask([7, 2], [MASK, []]).tolist() == [
        [float(m) for m in MASK],
        [0.0] * 5 + [1.0, 1.0],
    ]


def test_a_malformed_loss_mask_is_named() -> None:
    with pytest.raises(ValueError, match=r"sample \('ep', 0\): loss_mask has 2 entries for 7"):
        loss_masks([episode(mask=[1, 0])])
    with pytest.raises(ValueError, match="values other than 0 and 1"):
        loss_masks([episode(mask=[2] * 7)])
    assert loss_masks([Scored(sample=episode(mask=[]))]) is None


def test_policy_gradient_reaches_the_policy_tokens_only(tmp_path: Any) -> None:
    """Fresh samples: the clipped loss's gradient is ``-A * mean(grad log pi)`` over the policy's
    tokens (token mean). What the environment wrote is context: changing its behaviour
    log-probs (which no one reads) changes nothing."""
    learner = make(tmp_path)
    current = learner.trainer.logprobs([episode()])[0]
    batch = [Scored(sample=episode(logprobs=current), advantage=1.5)]
    learner.train(TrainBatch(samples=batch, algorithm="grpo"))
    got = grads(learner)

    other = make(tmp_path / "other")
    noisy = [lp if m else lp - 3.0 for lp, m in zip(current, MASK, strict=True)]
    other.train(
        TrainBatch(
            samples=[Scored(sample=episode(logprobs=noisy), advantage=1.5)], algorithm="grpo"
        )
    )
    torch.testing.assert_close(grads(other), got, atol=1e-7, rtol=0)

    manual = make(tmp_path / "manual")
    manual.trainer.model.zero_grad()
    forward = manual.trainer.forward([episode(mask=[])])
    policy = forward.logprobs[0, -7:][torch.tensor(MASK, dtype=torch.bool)]
    (-1.5 * policy.mean()).backward()
    torch.testing.assert_close(got, grads(manual), atol=1e-6, rtol=0)
    assert not torch.allclose(got, torch.zeros_like(got))


def test_bc_imitates_the_policy_tokens_only(tmp_path: Any) -> None:
    learner = make(tmp_path)
    metrics = learner.train(TrainBatch(samples=[Scored(sample=episode())], algorithm="bc")).metrics
    with torch.no_grad():
        forward = learner.trainer.forward([episode(mask=[])])
    policy = forward.logprobs[0, -7:][torch.tensor(MASK, dtype=torch.bool)]
    assert metrics["nll"] == pytest.approx(-float(policy.mean()), rel=1e-5)
    everything = -float(forward.logprobs[0, -7:].mean())
    assert metrics["nll"] != pytest.approx(everything, rel=1e-3)


def test_an_all_ones_mask_trains_exactly_like_no_mask(tmp_path: Any) -> None:
    """The single-turn path is untouched: a mask of ones gives the same step, bit for bit."""
    a, b = make(tmp_path / "a", lr=1e-2), make(tmp_path / "b", lr=1e-2)
    current = a.trainer.logprobs([episode(mask=[])])[0]
    behaviour = [lp - 0.05 * i for i, lp in enumerate(current)]
    for learner, mask in ((a, []), (b, [1] * 7)):
        samples = [
            Scored(sample=episode(0, mask, behaviour), reward=1.0),
            Scored(sample=episode(1, mask, current), reward=0.0),
        ]
        learner.train(TrainBatch(samples=samples, algorithm="grpo"))
    assert torch.equal(grads(a), grads(b))
    for x, y in zip(a.trainer.model.parameters(), b.trainer.model.parameters(), strict=True):
        assert torch.equal(x, y)


def test_gae_runs_over_the_policy_tokens_as_if_the_environment_were_not_there() -> None:
    values = [0.1, 0.2, 9.0, 9.0, 9.0, 0.3, 0.4]
    ref = [-1.0, -0.5, 0.0, 0.0, 0.0, -0.7, -0.2]
    logp = [-0.8, -0.6, 0.0, 0.0, 0.0, -0.9, -0.1]
    masked = Scored(sample=episode(logprobs=logp), reward=1.0, ref_logprobs=ref, values=values)
    keep = [i for i, m in enumerate(MASK) if m]
    compact = Scored(
        sample=episode(
            mask=[],
            tokens=[TOKENS[i] for i in keep],
            logprobs=[logp[i] for i in keep],
        ),
        reward=1.0,
        ref_logprobs=[ref[i] for i in keep],
        values=[values[i] for i in keep],
    )
    kw: dict[str, Any] = dict(gamma=0.9, lam=0.8, kl_coef=0.3, kl_mode="reward")
    adv, ret, mask = gae_targets([masked], **kw)
    adv_c, ret_c, _ = gae_targets([compact], **kw)
    assert mask[0].tolist() == [float(m) for m in MASK]
    torch.testing.assert_close(adv[0, keep], adv_c[0])
    torch.testing.assert_close(ret[0, keep], ret_c[0])
    assert adv[0, [2, 3, 4]].tolist() == [0.0, 0.0, 0.0]


def test_ppo_whitens_over_the_policy_tokens_and_leaves_the_environment_at_zero(
    tmp_path: Any,
) -> None:
    learner = make(tmp_path, algorithm="ppo", gamma=1.0, lam=1.0, whiten_advantages=True)
    values = [0.1, 0.2, 5.0, 5.0, 5.0, 0.3, 0.4]
    scored = Scored(sample=episode(), reward=1.0, values=values)
    (row,) = batch_advantages(learner.config, "ppo", [scored])
    raw = [1.0 - values[i] for i, m in enumerate(MASK) if m]
    mean = sum(raw) / len(raw)
    std = (sum((a - mean) ** 2 for a in raw) / len(raw)) ** 0.5
    expected = iter((a - mean) / (std + 1e-8) for a in raw)
    assert row == pytest.approx([next(expected) if m else 0.0 for m in MASK], abs=1e-6)


def test_staleness_counts_the_policy_tokens_versions(tmp_path: Any) -> None:
    """An observation carries the version of the turn before it; staleness reads the policy's
    tokens: a turn under version 3 after one under version 2 is measured from version 2."""
    s = episode(versions=[2, 2, 0, 0, 0, 3, 3])
    assert s.policy_versions == [2, 2, 3, 3]
    learner = make(tmp_path)
    learner.version = 5
    metrics = learner.train(
        TrainBatch(samples=[Scored(sample=s, advantage=1.0)], algorithm="grpo")
    ).metrics
    assert metrics["staleness_max"] == 3.0


def test_a_step_on_episodes_reports_the_environment_tokens_its_loss_saw(tmp_path: Any) -> None:
    """``env_tokens_trained`` counts environment tokens in the loss's target mask, built apart
    from it: 0 for a sound mask, the environment's tokens when the mask is lost on the way."""
    learner = make(tmp_path)
    batch = TrainBatch(samples=[Scored(sample=episode(), advantage=1.0)], algorithm="grpo")
    assert learner.train(batch).metrics["env_tokens_trained"] == 0.0
    plain = learner.train(
        TrainBatch(samples=[Scored(sample=episode(1, mask=[]), advantage=1.0)], algorithm="grpo")
    )
    assert "env_tokens_trained" not in plain.metrics
    broken = make(tmp_path / "broken")
    forward = broken.trainer.forward
    broken.trainer.forward = lambda samples, compiled=False: forward(  # type: ignore[method-assign]
        [msgspec.structs.replace(s, loss_mask=[]) for s in samples], compiled
    )
    batch = TrainBatch(samples=[Scored(sample=episode(2), advantage=1.0)], algorithm="grpo")
    assert broken.train(batch).metrics["env_tokens_trained"] == 3.0


def test_a_step_on_episodes_counts_the_infra_failed_episodes_it_received(tmp_path: Any) -> None:
    """``infra_failed_trained``: the learner's own count of samples flagged ``infra_failed`` in
    what it trained on, apart from the pipeline that should never send one: 0 when it does not,
    1 for each that reaches it."""
    learner = make(tmp_path)
    batch = TrainBatch(samples=[Scored(sample=episode(), advantage=1.0)], algorithm="grpo")
    assert learner.train(batch).metrics["infra_failed_trained"] == 0.0
    failed = msgspec.structs.replace(episode(1), infra_failed="timeout")
    batch = TrainBatch(
        samples=[Scored(sample=failed, advantage=1.0), Scored(sample=episode(2), advantage=0.5)],
        algorithm="grpo",
    )
    assert learner.train(batch).metrics["infra_failed_trained"] == 1.0


def test_the_critic_learns_the_values_of_the_policy_tokens_only() -> None:
    """PPO's critic on an episode: what the values at the environment's positions are changes
    neither its targets at the policy's tokens nor its loss; without the mask, it would."""
    from asyncrl.roles.training.critic import Critic

    def step(mask: list[int], env_value: float) -> float:
        critic = Critic(RoleContext.local(config={"model_config": MODEL, "lr": 0.0, "seed": 0}))
        asyncio.run(critic.setup())
        values = [0.1, 0.2, env_value, env_value, env_value, 0.3, 0.4]
        scored = Scored(sample=episode(mask=mask), reward=1.0, values=values)
        return critic.train([scored]).value_loss

    masked = step(MASK, 0.0)
    assert step(MASK, 5.0) == pytest.approx(masked, rel=1e-6)
    assert step([], 5.0) != pytest.approx(step([], 0.0), rel=1e-3)
