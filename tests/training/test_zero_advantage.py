"""Rows whose advantage is exactly 0 are left out of the learner's passes (``skip_zero_advantage``)
and the step is the one that trains every row: parameters, loss and optimizer state."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from asyncrl.roles.payloads import Sample, Scored, TrainBatch
from tests.training.test_learner import MODEL, make

# Three groups of four: one mixed, one all solved, one all failed (GRPO gives the last two 0).
REWARDS = {"mixed": [1.0, 0.0, 1.0, 0.0], "solved": [1.0] * 4, "failed": [0.0] * 4}


def batch(seed: int, rewards: dict[str, list[float]] = REWARDS) -> list[Scored]:
    rng = random.Random(seed)
    out = []
    for pid, group in rewards.items():
        prompt = [rng.randrange(2, 14) for _ in range(rng.randrange(2, 6))]
        for index, reward in enumerate(group):
            tokens = [rng.randrange(2, 14) for _ in range(rng.randrange(1, 6))]
            out.append(
                Scored(
                    sample=Sample(
                        prompt_id=f"{pid}@{seed}",
                        sample_index=index,
                        prompt_ids=prompt,
                        token_ids=tokens,
                        logprobs=[-rng.uniform(1.5, 3.5) for _ in tokens],
                        versions=[0] * len(tokens),
                        finished=True,
                        stop_reason="stop",
                    ),
                    reward=reward,
                )
            )
    return out


def params(learner: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.trainer.model.parameters()]


def rows_forwarded(learner: Any) -> list[int]:
    """Record how many rows each training forward pass of ``learner`` takes."""
    seen: list[int] = []
    forward = learner.trainer.forward

    def counting(samples: list[Sample], *args: Any) -> Any:
        seen.append(len(samples))
        return forward(samples, *args)

    learner.trainer.forward = counting
    return seen


# Corrections, aggregations and the options that shape a row's loss; RLOO, whose six equal
# rewards of 0.3 give exactly 0 only because such a group is set to 0 (r - mean is 3e-8).
CASES = [
    ("clip", "token_mean", {}),
    ("decoupled", "token_mean", {}),
    ("tis", "token_mean", {}),
    ("clip", "seq_mean_token_mean", {}),
    ("decoupled", "seq_mean_token_mean", {}),
    ("tis", "seq_mean_token_mean", {}),
    (
        "clip",
        "seq_mean_token_sum_norm",
        {"importance": "sequence", "dual_clip": 3.0, "clip_eps_high": 0.28, "norm_len": 5},
    ),
    ("decoupled", "seq_mean_token_sum", {"importance": "sequence", "weight_decay": 0.1}),
    ("clip", "token_mean", {"algorithm": "rloo", "weight_decay": 0.1}),
]


@pytest.mark.parametrize(("correction", "aggregation", "extra"), CASES)
def test_skipping_zero_rows_takes_the_same_step(
    tmp_path: Any, correction: str, aggregation: str, extra: dict[str, Any]
) -> None:
    algorithm = extra.pop("algorithm", "grpo")
    common = {"lr": 0.05, "dtype": "float64", "aggregation": aggregation, "micro_batch_tokens": 24}
    skip = make(tmp_path / "skip", **common, **extra)
    full = make(tmp_path / "full", skip_zero_advantage=False, **common, **extra)
    seen = rows_forwarded(skip)
    solved = [0.3] * 6 if algorithm == "rloo" else [1.0] * 4
    first = {**REWARDS, "solved": solved}
    # Two steps, the second of nothing but uniform groups: AdamW still moves on its momentum.
    for seed, rewards in ((0, first), (1, {"solved": solved, "failed": [0.0] * 4})):
        results = [
            learner.train(
                TrainBatch(samples=batch(seed, rewards), algorithm=algorithm, correction=correction)
            )
            for learner in (skip, full)
        ]
        for a, b in zip(params(skip), params(full), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        got, want = (r.metrics for r in results)
        assert got["policy_loss"] == pytest.approx(want["policy_loss"], abs=1e-12)
        assert "zero_advantage_rows" not in want
        uniform = len(solved) + 4  # the solved and failed groups' rows
        assert got["zero_advantage_rows"] == uniform
    # Step 1 forwarded only the mixed group's four rows; step 2 one row of eight (a zero step).
    assert sum(seen[: len(seen) - 1]) == 4 and seen[-1] == 1
    assert skip.step == full.step == 2


def test_decoupled_ppo_takes_proximal_log_probs_of_the_rows_trained_only(tmp_path: Any) -> None:
    common = {"lr": 0.05, "dtype": "float64", "ppo_epochs": 2, "mini_batches": 2}
    skip = make(tmp_path / "skip", **common)
    full = make(tmp_path / "full", skip_zero_advantage=False, **common)
    proximal_rows: list[int] = []
    logprobs = skip.trainer.logprobs

    def counting(samples: list[Sample]) -> Any:
        proximal_rows.append(len(samples))
        return logprobs(samples)

    skip.trainer.logprobs = counting
    for learner in (skip, full):
        learner.train(TrainBatch(samples=batch(0), algorithm="grpo", correction="decoupled"))
    # Four AdamW steps amplify the rounding of proximal passes over other paddings (float64).
    for a, b in zip(params(skip), params(full), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert sum(proximal_rows) == 4  # the mixed group's rows, of twelve


def test_stats_are_over_the_rows_trained(tmp_path: Any) -> None:
    skip = make(tmp_path / "skip", dtype="float64")
    alone = make(tmp_path / "alone", dtype="float64", skip_zero_advantage=False)
    mixed = batch(0)[:4]  # the mixed group by itself: the very rows the other learner trains
    got = skip.train(TrainBatch(samples=batch(0), algorithm="grpo")).metrics
    want = alone.train(TrainBatch(samples=mixed, algorithm="grpo")).metrics
    stats = ["clip_fraction", "approx_kl"]
    assert set(stats) <= set(want), want
    for key in stats:
        assert got[key] == pytest.approx(want[key], abs=1e-9), key


@pytest.mark.parametrize(
    "config", [{"entropy_coef": 0.01}, {"kl_coef": 0.1}, {"skip_zero_advantage": False}]
)
def test_every_row_is_trained_when_a_term_reads_it(tmp_path: Any, config: dict[str, Any]) -> None:
    learner = make(tmp_path, **config)
    seen = rows_forwarded(learner)
    samples = batch(0)
    if "kl_coef" in config:  # the KL term needs the reference's log-probs
        for s in samples:
            s.ref_logprobs = [lp - 0.1 for lp in s.sample.logprobs]
    result = learner.train(TrainBatch(samples=samples, algorithm="grpo"))
    assert sum(seen) == len(samples)
    assert "zero_advantage_rows" not in result.metrics


def test_bc_trains_every_row(tmp_path: Any) -> None:
    learner = make(tmp_path)
    seen = rows_forwarded(learner)
    learner.train(TrainBatch(samples=batch(0), algorithm="bc"))
    assert sum(seen) == 12


RANK_SCRIPT = """
import asyncio, json, sys
import torch
torch.set_num_threads(1)
from asyncrl.role import RoleContext
from asyncrl.roles.payloads import TrainBatch
from asyncrl.roles.training.learner import Learner
from asyncrl.roles.training.sharding import full_buckets
from tests.training.test_zero_advantage import CONFIG, batch, two_steps

rank, run_dir, out, parallel = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]

async def main():
    ctx = RoleContext.local(config={**CONFIG, "parallel": parallel}, name="learner",
                            replica=rank, replicas=2, run_dir=run_dir)
    learner = Learner(ctx)
    await learner.setup()
    zeros = []
    for seed, rewards in two_steps() if rank == 0 else []:  # replica 0 takes the calls
        samples = batch(seed, rewards)
        result = await learner.train_step(TrainBatch(samples=samples, algorithm="grpo"))
        zeros.append(result.metrics["zero_advantage_rows"])
    await learner.ctx.offload(learner.lockstep.close, 120.0)  # replica 1: when it closes
    if rank == 1:  # it ran both steps with replica 0: its last step's metric
        last = (await learner.learner_status(None)).last["result"]
        zeros.append(last["metrics"]["zero_advantage_rows"])
    buckets = full_buckets(learner.trainer.model, 2**20)
    params = {k: v.clone() for bucket in buckets for k, v in bucket.items()}
    torch.save(params, f"{out}/{parallel}{rank}.pt")
    await learner.teardown()
    open(f"{out}/{parallel}{rank}.json", "w").write(json.dumps(zeros))

asyncio.run(main())
"""

CONFIG: dict[str, Any] = {
    "model_config": MODEL,
    "seed": 0,
    "lr": 0.05,
    "dtype": "float64",
    "micro_batch_tokens": 24,
    "durable": False,
    "dist_timeout_s": 60.0,
}


def two_steps() -> list[tuple[int, dict[str, list[float]]]]:
    """A step with one mixed group of three, then one of nothing but uniform groups."""
    return [(0, REWARDS), (1, {"solved": [1.0] * 4, "failed": [0.0] * 4})]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["replicate", "fsdp"])
def test_two_ranks_skip_zero_rows_and_take_one_learners_steps(tmp_path: Any, parallel: str) -> None:
    from tests.training.test_data_parallel import run_ranks

    out = str(tmp_path)
    zeros = run_ranks(
        RANK_SCRIPT,
        [str(tmp_path / "run"), out, parallel],
        f"{out}/{parallel}{{rank}}.json",
    )
    ranks = [torch.load(tmp_path / f"{parallel}{r}.pt", weights_only=True) for r in range(2)]
    one = make(tmp_path / "one", skip_zero_advantage=False, **CONFIG)
    for seed, rewards in two_steps():
        one.train(TrainBatch(samples=batch(seed, rewards), algorithm="grpo"))
    for name, value in one.trainer.model.state_dict().items():
        torch.testing.assert_close(ranks[0][name], value, rtol=0, atol=1e-10)
        assert torch.equal(ranks[0][name], ranks[1][name])
    # Each rank reports the batch's, not a sum (replica 1: of its last step).
    assert zeros == [[8.0, 8.0], [8.0]]
