"""PPO epochs and mini-batches in the learner and the critic; decoupled PPO's proximal policy;
the sequence-level importance ratio (GSPO) reaching the learner's loss."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import msgspec
import pytest
import torch

from asyncrl.role import RoleContext
from asyncrl.roles.generation.rollout import Sample
from asyncrl.roles.learning import algorithms as alg
from asyncrl.roles.learning.batching import aligned, mini_batch_indices
from asyncrl.roles.training.critic import Critic
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


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def make(tmp_path: Any, **config: Any) -> Learner:
    ctx = RoleContext.local(
        config={"model_config": MODEL, "seed": 0, "publish_weights": False, **config},
        run_dir=str(tmp_path),
        name="learner",
    )
    learner = Learner(ctx)
    asyncio.run(learner.setup())
    return learner


def stale_batch(
    learner: Learner, tag: str, n: int = 6, offset: float = 0.3, jitter: float = 0.0
) -> list[Scored]:
    """``n`` samples of two prompts, with behaviour log-probs ``offset + jitter * j`` below the
    learner's current ones at token j (as if sampled by older weights) and given
    advantages."""
    rng = random.Random(tag)
    out = []
    for i in range(n):
        prompt = [2, 3, 12, 4 + i % 2]
        tokens = [rng.randrange(2, 14) for _ in range(rng.randrange(1, 4))] + [1]
        sample = Sample(
            prompt_id=f"{tag}{i % 2}",
            sample_index=i,
            prompt_ids=prompt,
            token_ids=tokens,
            logprobs=[0.0] * len(tokens),
            versions=[0] * len(tokens),
            finished=True,
            stop_reason="stop",
        )
        current = learner.trainer.logprobs([sample])[0]
        sample.logprobs = [lp - offset - jitter * j for j, lp in enumerate(current)]
        advantage = [1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1.5, -1.5][i % 8]
        out.append(Scored(sample=sample, reward=float(advantage > 0), advantage=advantage))
    return out


def params(learner: Learner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.trainer.model.parameters()]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def adam_steps(learner: Learner) -> int:
    return int(next(iter(learner.trainer.optimizer.state.values()))["step"])


def test_mini_batch_indices_split_and_shuffle_deterministically() -> None:
    parts = mini_batch_indices(8, 3, seed=0, step=5, epoch=0)
    assert [len(p) for p in parts] == [3, 3, 2]
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert parts == mini_batch_indices(8, 3, seed=0, step=5, epoch=0)
    assert parts != mini_batch_indices(8, 3, seed=0, step=5, epoch=1)
    assert parts != mini_batch_indices(8, 3, seed=0, step=6, epoch=0)
    assert mini_batch_indices(5, 1, seed=0, step=5, epoch=3) == [[0, 1, 2, 3, 4]]
    with pytest.raises(
        ValueError, match=r"^mini_batches: expected 1 to 2 \(the samples to split\), got 3$"
    ):
        mini_batch_indices(2, 3, seed=0, step=0, epoch=0)


def test_epochs_and_mini_batches_are_validated(tmp_path: Any) -> None:
    with pytest.raises(msgspec.ValidationError, match=r"^ppo_epochs: expected an int >= 1, got 0"):
        make(tmp_path, ppo_epochs=0)
    with pytest.raises(
        msgspec.ValidationError, match=r"^mini_batches: expected an int >= 1, got -1"
    ):
        make(tmp_path, mini_batches=-1)
    learner = make(tmp_path, mini_batches=4)
    batch = stale_batch(learner, "v", n=3)
    with pytest.raises(
        ValueError,
        match=r"^learner: a batch of 3 samples cannot be split into mini_batches=4; send "
        r"batches of at least 4 samples or lower roles.learner.config.mini_batches$",
    ):
        learner.train(TrainBatch(samples=batch, algorithm="grpo"))
    assert learner.version == 0 and adam_steps_or_zero(learner) == 0
    # BC takes one step per batch whatever the epochs and mini-batches say.
    bc = make(tmp_path / "bc", ppo_epochs=3, mini_batches=4)
    result = bc.train(TrainBatch(samples=stale_batch(bc, "d", n=2), algorithm="bc"))
    assert result.metrics["optimizer_steps"] == 1.0 and adam_steps(bc) == 1


def adam_steps_or_zero(learner: Learner) -> int:
    return adam_steps(learner) if learner.trainer.optimizer.state else 0


@pytest.mark.parametrize("correction", ["clip", "decoupled", "tis"])
def test_one_epoch_and_one_mini_batch_is_the_single_step_it_was(
    tmp_path: Any, correction: str
) -> None:
    """The defaults take one optimizer step per batch, bit for bit the step written out by hand
    here: decoupled PPO's proximal policy is then the current one."""
    learner = make(tmp_path / "l", lr=0.01, ppo_epochs=1, mini_batches=1)
    by_hand = make(tmp_path / "h", lr=0.01)
    batch = stale_batch(learner, "s")
    result = learner.train(TrainBatch(samples=batch, algorithm="grpo", correction=correction))
    assert result.metrics["optimizer_steps"] == 1.0 and adam_steps(learner) == 1

    logprobs, target, _ = by_hand.trainer.forward([s.sample for s in batch])
    behaviour = aligned([s.sample.logprobs for s in batch], target)
    adv = torch.tensor([s.advantage for s in batch])[:, None].expand_as(target) * target
    if correction == "clip":
        loss, _ = alg.ppo_policy_loss(logprobs, behaviour, adv, target, 0.2)
    elif correction == "decoupled":
        loss, _ = alg.decoupled_ppo_policy_loss(
            logprobs, logprobs.detach(), behaviour, adv, target, 0.2, importance_cap=2.0
        )
    else:
        weight = alg.truncated_importance_weights(logprobs, behaviour, 2.0, mask=target)
        loss = alg.aggregate(-(weight * adv * logprobs), target, "token_mean")
    by_hand.trainer.optimizer.zero_grad()
    (loss * 1.0).backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(by_hand.trainer.model.parameters(), 1.0)
    by_hand.trainer.optimizer.step()
    assert result.metrics["policy_loss"] == float(loss.detach())
    assert_same(params(learner), params(by_hand))


@pytest.mark.parametrize(("algorithm", "epochs"), [("grpo", 1), ("grpo", 2), ("ppo", 2)])
def test_mini_batches_are_optimizer_steps_on_shuffled_shares(
    tmp_path: Any, algorithm: str, epochs: int
) -> None:
    """ppo_epochs x 2 mini-batches: as many optimizer steps, each exactly a one-step batch of
    its share of the samples (advantages given or per sample, behaviour log-probs fixed); one
    published version."""
    config = {"lr": 0.01, "gamma": 1.0, "lam": 1.0}
    learner = make(tmp_path / "l", ppo_epochs=epochs, mini_batches=2, **config)
    steps = make(tmp_path / "s", **config)
    batch = stale_batch(learner, "m")
    for s in batch:
        s.values = [0.1 * j for j in range(len(s.sample.token_ids))]  # PPO's critic values
    result = learner.train(TrainBatch(samples=batch, algorithm=algorithm))
    expected = []
    for epoch in range(epochs):
        for part in mini_batch_indices(6, 2, seed=0, step=0, epoch=epoch):
            shares = [
                Scored(sample=batch[i].sample, reward=batch[i].reward, values=batch[i].values)
                for i in part
            ]
            for share, i in zip(shares, part, strict=True):
                share.advantage = batch[i].advantage
                share.sample = msgspec.structs.replace(share.sample, prompt_id=f"{epoch}{i}")
            expected.append(steps.train(TrainBatch(samples=shares, algorithm=algorithm)))
    assert (result.version, result.step, result.consumed) == (1, 1, 6)
    assert result.metrics["optimizer_steps"] == 2 * epochs
    assert adam_steps(learner) == 2 * epochs and learner.trainer.scheduler.last_epoch == 2 * epochs
    assert steps.version == 2 * epochs
    mean_loss = sum(r.metrics["policy_loss"] for r in expected) / len(expected)
    assert result.metrics["policy_loss"] == pytest.approx(mean_loss, rel=1e-12)
    assert_same(params(learner), params(steps))


def _decoupled_by_hand(
    learner: Learner, batch: list[Scored], steps: int, *, fixed_proximal: bool, clip_eps: float
) -> list[dict[str, float]]:
    """``steps`` optimizer steps of decoupled PPO on the whole batch, written out; the proximal
    log-probs are the batch's start (``fixed_proximal``) or each step's current policy."""
    start = learner.trainer.logprobs([s.sample for s in batch])
    stats = []
    for _ in range(steps):
        logprobs, target, _ = learner.trainer.forward([s.sample for s in batch])
        proximal = aligned(start, target) if fixed_proximal else logprobs.detach()
        behaviour = aligned([s.sample.logprobs for s in batch], target)
        adv = torch.tensor([s.advantage for s in batch])[:, None].expand_as(target) * target
        loss, step_stats = alg.decoupled_ppo_policy_loss(
            logprobs, proximal, behaviour, adv, target, clip_eps, importance_cap=2.0
        )
        learner.trainer.optimizer.zero_grad()
        (loss * 1.0).backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(learner.trainer.model.parameters(), 1.0)
        learner.trainer.optimizer.step()
        stats.append(
            {"policy_loss": float(loss.detach()), **{k: float(v) for k, v in step_stats.items()}}
        )
    return stats


def test_decoupled_epochs_clip_against_the_proximal_policy(tmp_path: Any) -> None:
    """Two epochs of one mini-batch: the proximal policy is the learner's at the start of the
    batch, so on the second step the ratio to it is no longer 1 and the clip acts; the
    behaviour weight corrects the staleness. The learner's step equals decoupled PPO written
    out with that proximal policy, and not with the current policy as proximal."""
    config = {"lr": 0.05, "clip_eps": 0.02, "ppo_epochs": 2}
    learner = make(tmp_path / "l", **config)
    batch = stale_batch(learner, "d")
    result = learner.train(TrainBatch(samples=batch, algorithm="grpo", correction="decoupled"))
    fixed = make(tmp_path / "f", **config)
    by_hand = _decoupled_by_hand(fixed, batch, 2, fixed_proximal=True, clip_eps=0.02)
    current = make(tmp_path / "c", **config)
    _decoupled_by_hand(current, batch, 2, fixed_proximal=False, clip_eps=0.02)

    first, second = by_hand
    assert first["approx_kl"] < 1e-9 and first["clip_fraction"] == 0.0  # ratio 1 to proximal
    assert second["approx_kl"] > 1e-4 and second["clip_fraction"] > 0.2  # the clip acts
    assert first["importance_weight_mean"] == pytest.approx(second["importance_weight_mean"])
    assert first["importance_weight_mean"] == pytest.approx(float(torch.tensor(0.3).exp()))
    for key in ("policy_loss", "approx_kl", "clip_fraction", "importance_weight_mean"):
        assert result.metrics[key] == pytest.approx((first[key] + second[key]) / 2, abs=1e-6)
    for a, b in zip(params(learner), params(fixed), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert any(
        not torch.allclose(a, b, atol=1e-4, rtol=0)
        for a, b in zip(params(learner), params(current), strict=True)
    )


def test_a_resumed_learner_with_epochs_replays_a_batch_and_shuffles_alike(tmp_path: Any) -> None:
    """A durable learner with epochs, rebuilt from its run directory: a re-sent TrainBatch.id is
    answered from the log without training; the next batch trains exactly as it would have
    without the restart (the same shuffle and proximal policy)."""
    config = {"lr": 0.01, "ppo_epochs": 2, "mini_batches": 2}
    first = make(tmp_path, **config)
    batches = [stale_batch(first, f"r{step}") for step in range(3)]
    for step in range(2):
        first.train(
            TrainBatch(
                samples=batches[step], algorithm="grpo", correction="decoupled", id=f"rl-{step}"
            )
        )
    restarted = make(tmp_path, **config)
    before = params(restarted)
    again = restarted.train(
        TrainBatch(samples=batches[1], algorithm="grpo", correction="decoupled", id="rl-1")
    )
    assert again.replayed and (again.version, again.step) == (2, 2)
    assert again.metrics["optimizer_steps"] == 4.0
    assert_same(params(restarted), before)
    assert adam_steps(restarted) == 8 and restarted.trainer.scheduler.last_epoch == 8
    for learner in (first, restarted):
        learner.train(
            TrainBatch(samples=batches[2], algorithm="grpo", correction="decoupled", id="rl-2")
        )
    assert_same(params(first), params(restarted))


def test_a_batch_with_skipped_samples_splits_what_is_left(tmp_path: Any) -> None:
    """The ledger may leave fewer fresh samples than mini-batches (a batch re-sent after a
    crash without its id): each is then a mini-batch of its own."""
    learner = make(tmp_path, mini_batches=3)
    batch = stale_batch(learner, "k", n=4)
    first = learner.train(TrainBatch(samples=batch[:3], algorithm="grpo"))
    assert first.metrics["optimizer_steps"] == 3.0
    result = learner.train(TrainBatch(samples=batch, algorithm="grpo"))
    assert (result.consumed, result.skipped) == (1, 3)
    assert result.metrics["optimizer_steps"] == 1.0


def test_sequence_importance_reaches_the_learners_loss(tmp_path: Any) -> None:
    """importance: sequence (GSPO) gives the token-level step on one-token completions, and
    another one on longer completions."""

    def grads(importance: str, batch: list[Scored], name: str) -> torch.Tensor:
        learner = make(tmp_path / name, lr=0.0, grad_clip=1e9, importance=importance)
        learner.train(TrainBatch(samples=batch, algorithm="grpo", correction="clip"))
        return torch.cat(
            [p.grad.flatten() for p in learner.trainer.model.parameters() if p.grad is not None]
        )

    reference = make(tmp_path / "ref")
    longer = stale_batch(reference, "g", offset=0.0, jitter=0.1)
    short = []
    for s in longer:
        one = msgspec.structs.replace(
            s.sample, token_ids=s.sample.token_ids[:1], logprobs=[-1.0], versions=[0]
        )
        short.append(Scored(sample=one, reward=s.reward, advantage=s.advantage))
    torch.testing.assert_close(
        grads("sequence", short, "s1"), grads("token", short, "t1"), atol=1e-7, rtol=0
    )
    assert not torch.allclose(grads("sequence", longer, "s2"), grads("token", longer, "t2"))


def test_critic_mini_batches_are_steps_on_shuffled_shares(tmp_path: Any) -> None:
    """The critic's epochs and mini-batches: each optimizer step is a one-step batch of its
    share (returns and old values are per sample)."""

    def critic(**config: Any) -> Critic:
        role = Critic(RoleContext.local(config={"model_config": MODEL, "lr": 0.02, **config}))
        asyncio.run(role.setup())
        return role

    epochs = critic(ppo_epochs=2, mini_batches=2)
    steps = critic()
    rng = random.Random(1)
    batch = []
    for i in range(5):
        tokens = [rng.randrange(2, 14) for _ in range(rng.randrange(1, 5))]
        prompt = [2, 13, 3][: 1 + i % 3]
        sample = Sample(
            prompt_id="c",
            sample_index=i,
            prompt_ids=prompt,
            token_ids=tokens,
            logprobs=[-0.5] * len(tokens),
            versions=[0] * len(tokens),
            finished=True,
            stop_reason="",
        )
        batch.append(
            Scored(sample=sample, reward=rng.random(), values=[rng.random() for _ in tokens])
        )
    metrics = epochs.train(batch)
    losses = []
    for epoch in range(2):
        for part in mini_batch_indices(5, 2, seed=0, step=0, epoch=epoch):
            losses.append(steps.train([batch[i] for i in part]).value_loss)
    assert (metrics.optimizer_steps, metrics.step, epochs.step) == (4, 1, 1)
    assert metrics.value_loss == pytest.approx(sum(losses) / 4, rel=1e-12)
    for a, b in zip(
        epochs.trainer.model.parameters(), steps.trainer.model.parameters(), strict=True
    ):
        assert torch.equal(a, b)
