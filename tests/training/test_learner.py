"""The learner in-process: losses move the policy the right way; ledger, exact resume, export."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
from typing import Any

import msgspec
import pytest
import torch

from asyncrl.role import RoleContext
from asyncrl.roles.generation.rollout import Sample
from asyncrl.roles.learning.batching import micro_batches
from asyncrl.roles.payloads import LearnerStatus, ProgramState
from asyncrl.roles.training.learner import Learner, Scored, TrainBatch, pad_batch
from asyncrl.roles.training.learner_config import LearnerConfig
from asyncrl.roles.training.objective import (
    ALGORITHMS,
    Decoupled,
    Entropy,
    Imitation,
    KLPenalty,
    MicroBatch,
    PolicyGradient,
    TruncatedImportance,
    batch_advantages,
    objective_for,
)

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


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def make(tmp_path: Any, **config: Any) -> Learner:
    ctx = RoleContext.local(
        config={"model_config": MODEL, "seed": 0, **config}, run_dir=str(tmp_path), name="learner"
    )
    learner = Learner(ctx)
    run(learner.setup())
    return learner


def sample(
    pid: str,
    prompt: list[int],
    tokens: list[int],
    index: int = 0,
    logprobs: list[float] | None = None,
) -> Sample:
    return Sample(
        prompt_id=pid,
        sample_index=index,
        prompt_ids=prompt,
        token_ids=tokens,
        logprobs=logprobs or [0.0] * len(tokens),
        versions=[0] * len(tokens),
        finished=True,
        stop_reason="stop",
    )


def test_pad_batch_positions_ignore_left_padding() -> None:
    ids, attention, positions, target = pad_batch([[5, 6, 7], [8]], [[2, 3], [4]])
    assert ids.tolist() == [[5, 6, 7, 2, 3], [0, 0, 0, 8, 4]]
    assert attention.tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert positions.tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 0, 1]]
    assert target.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]


def test_logprobs_do_not_depend_on_padding(tmp_path: Any) -> None:
    learner = make(tmp_path)
    a = sample("a", [5, 6, 7, 8, 9], [2, 3, 1])
    b = sample("b", [5], [4, 1])
    together = learner.trainer.logprobs([a, b])
    alone = learner.trainer.logprobs([a]) + learner.trainer.logprobs([b])
    for x, y in zip(together, alone, strict=True):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-5, rtol=0)


def test_bc_lowers_the_nll_of_demonstrations(tmp_path: Any) -> None:
    learner = make(tmp_path, lr=0.01)
    demos = [sample(f"d{i}", [2 + i, 12, 3, 13], [4 + i, 1]) for i in range(4)]

    def nll() -> float:
        return -sum(sum(lp) for lp in learner.trainer.logprobs(demos))

    before = nll()
    for step in range(10):
        batch = [
            Scored(sample=sample(f"{d.prompt_id}@{step}", d.prompt_ids, d.token_ids)) for d in demos
        ]
        learner.train(TrainBatch(samples=batch, algorithm="bc"))
    assert nll() < before * 0.5
    assert learner.version == 10 and learner.step == 10


def test_grpo_raises_the_probability_of_rewarded_samples(tmp_path: Any) -> None:
    learner = make(tmp_path, lr=0.01)
    prompt = [2, 3, 12, 4, 5, 13]
    good, bad = [6, 7, 1], [8, 9, 1]

    def logp(tokens: list[int]) -> float:
        return sum(learner.trainer.logprobs([sample("x", prompt, tokens)])[0])

    before = logp(good) - logp(bad)
    for step in range(5):
        behaviour = learner.trainer.logprobs([sample("x", prompt, good), sample("x", prompt, bad)])
        group = [
            Scored(sample=sample(f"p{step}", prompt, good, 0, behaviour[0]), reward=1.0),
            Scored(sample=sample(f"p{step}", prompt, bad, 1, behaviour[1]), reward=0.0),
        ]
        result = learner.train(TrainBatch(samples=group, algorithm="grpo"))
        assert result.consumed == 2
    assert logp(good) - logp(bad) > before + 1.0


def test_zero_learning_rate_changes_nothing(tmp_path: Any) -> None:
    learner = make(tmp_path, lr=0.0)
    prompt = [2, 3, 12, 4, 5, 13]
    before = {k: v.clone() for k, v in learner.trainer.model.state_dict().items()}
    group = [
        Scored(sample=sample("p", prompt, [6, 1], 0), reward=1.0),
        Scored(sample=sample("p", prompt, [7, 1], 1)),
    ]
    learner.train(TrainBatch(samples=group, algorithm="grpo"))
    for k, v in learner.trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_consumed_samples_are_skipped(tmp_path: Any) -> None:
    learner = make(tmp_path)
    batch = TrainBatch(
        samples=[Scored(sample=sample("p", [2, 13], [3, 1], i), reward=float(i)) for i in range(2)]
    )
    first = learner.train(batch)
    again = learner.train(batch)
    assert (first.consumed, first.skipped) == (2, 0)
    assert (again.consumed, again.skipped) == (0, 2)
    assert learner.version == 1


def test_micro_batches_give_the_same_step(tmp_path: Any) -> None:
    """Splitting by a token budget accumulates the same gradient as one big batch."""
    demos = [sample(f"d{i}", [2 + i, 12, 3, 13], [4 + i, 5, 1]) for i in range(6)]
    whole = make(tmp_path / "a", lr=0.01, micro_batch_tokens=10_000)
    split = make(tmp_path / "b", lr=0.01, micro_batch_tokens=8)
    assert (
        len(micro_batches([Scored(sample=d) for d in demos], split.config.micro_batch_tokens)) == 6
    )
    whole.train(TrainBatch(samples=[Scored(sample=d) for d in demos], algorithm="bc"))
    split.train(TrainBatch(samples=[Scored(sample=d) for d in demos], algorithm="bc"))
    # Compare the accumulated gradients: Adam's first step divides by |g|, which would blow up
    # float rounding in gradients that are nearly zero.
    for (name, a), b in zip(
        whole.trainer.model.named_parameters(), split.trainer.model.parameters(), strict=True
    ):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(
            a.grad, b.grad, atol=1e-7, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_checkpoints_resume_exactly(tmp_path: Any) -> None:
    def batch(step: int) -> TrainBatch:
        return TrainBatch(
            samples=[
                Scored(sample=sample(f"p{step}", [2, 3, 13], [4 + step, 1], i), reward=float(i))
                for i in range(2)
            ],
            algorithm="grpo",
            keep=ProgramState(cursor=step),
        )

    straight = make(tmp_path / "straight", lr=0.01)
    for step in range(3):
        straight.train(batch(step))

    first = make(tmp_path / "resumed", lr=0.01, checkpoint_every=2)
    for step in range(2):
        first.train(batch(step))
    resumed = make(tmp_path / "resumed", lr=0.01, checkpoint_every=2)  # setup() loads step 2
    assert (resumed.step, resumed.version, resumed.keep) == (2, 2, ProgramState(cursor=1))
    assert len(resumed.consumed) == 4
    assert resumed.train(batch(1)).skipped == 2  # already consumed before the crash
    resumed.train(batch(2))
    for (name, a), b in zip(
        straight.trainer.model.state_dict().items(),
        resumed.trainer.model.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b), name


def test_export_loads_with_transformers(tmp_path: Any) -> None:
    from transformers import AutoModelForCausalLM

    learner = make(tmp_path)
    path = asyncio.run(learner.export("final"))
    assert path == str(tmp_path / "exports" / "final")
    loaded = AutoModelForCausalLM.from_pretrained(path)
    for (name, a), b in zip(
        learner.trainer.model.state_dict().items(), loaded.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert not os.path.exists(path + ".tmp")


def _group(learner: Learner, pid: str, versions: int = 0) -> list[Scored]:
    prompt = [2, 3, 12, 4, 5, 13]
    tokens = [[6, 7, 1], [8, 9, 1], [6, 9, 1]]
    behaviour = learner.trainer.logprobs([sample(pid, prompt, t) for t in tokens])
    return [
        Scored(
            sample=Sample(
                prompt_id=pid,
                sample_index=i,
                prompt_ids=prompt,
                token_ids=t,
                logprobs=b,
                versions=[versions] * len(t),
                finished=True,
                stop_reason="stop",
            ),
            reward=float(i == 0),
        )
        for i, (t, b) in enumerate(zip(tokens, behaviour, strict=True))
    ]


@pytest.mark.parametrize("correction", ["decoupled", "tis"])
def test_corrections_give_plain_ppo_gradients_on_fresh_samples(
    tmp_path: Any, correction: str
) -> None:
    plain = make(tmp_path / "a", lr=0.01)
    other = make(tmp_path / "b", lr=0.01)
    plain.train(TrainBatch(samples=_group(plain, "p"), algorithm="grpo", correction="clip"))
    other.train(TrainBatch(samples=_group(other, "p"), algorithm="grpo", correction=correction))
    for a, b in zip(
        plain.trainer.model.parameters(), other.trainer.model.parameters(), strict=True
    ):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-4)


def test_stale_samples_are_weighted_by_their_importance(tmp_path: Any) -> None:
    """Behaviour log-probs from other weights: the corrections now differ from plain PPO, and
    the staleness is reported against the version that consumed the samples."""
    learner = make(tmp_path, lr=0.01)
    for step in range(2):  # two steps: the policy is now version 2
        learner.train(TrainBatch(samples=_group(learner, f"warm{step}"), algorithm="grpo"))
    stale = _group(make(tmp_path / "old", lr=0.01), "stale", versions=0)
    grads = {}
    for correction in ("clip", "decoupled", "tis"):
        fresh = make(tmp_path / correction, lr=0.01)
        fresh.trainer.model.load_state_dict(learner.trainer.model.state_dict())
        fresh.version = learner.version
        result = fresh.train(TrainBatch(samples=stale, algorithm="grpo", correction=correction))
        assert result.metrics["staleness_max"] == 2 and result.metrics["staleness_p50"] == 2
        grads[correction] = torch.cat(
            [p.grad.flatten() for p in fresh.trainer.model.parameters() if p.grad is not None]
        )
    assert not torch.allclose(grads["clip"], grads["decoupled"])
    # One optimizer step per batch (the default): decoupled PPO's proximal policy is the current
    # one, so it weighs each token like truncated importance sampling does.
    torch.testing.assert_close(grads["decoupled"], grads["tis"], atol=1e-6, rtol=1e-4)


def test_given_advantages_are_used_and_whitened_over_the_batch(tmp_path: Any) -> None:
    learner = make(tmp_path, whiten_advantages=True)
    group = _group(learner, "p")
    computed = batch_advantages(learner.config, "grpo", group)
    given = [
        Scored(sample=s.sample, reward=s.reward, advantage=a)
        for s, a in zip(group, [3.0, 1.0, -1.0], strict=True)
    ]
    assert batch_advantages(learner.config, "grpo", given) == pytest.approx(
        [(a - 1.0) / (8 / 3) ** 0.5 for a in (3.0, 1.0, -1.0)], rel=1e-6
    )
    assert sum(computed) == pytest.approx(0.0, abs=1e-6)
    assert sum(a * a for a in computed) / 3 == pytest.approx(1.0, rel=1e-4)


DP_SCRIPT = """
import sys, torch, torch.distributed as dist
from asyncrl.roles.training.learner import batch_moments
rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
values = [[1.0, 2.0, 3.0], [10.0, -4.0]][rank]
m = batch_moments(values, gather=True)
print(m.count, repr(m.mean), repr(m.m2))
dist.destroy_process_group()
"""


def test_whitening_moments_merge_across_data_parallel_ranks(tmp_path: Any) -> None:
    import subprocess
    import sys

    from asyncrl.roles.learning.statistics import Moments

    store = str(tmp_path / "store")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DP_SCRIPT, str(rank), store],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    expected = Moments.of([1.0, 2.0, 3.0, 10.0, -4.0])
    for out, _ in outs:
        count, mean, m2 = out.split()
        assert int(count) == 5
        assert float(mean) == pytest.approx(expected.mean, rel=1e-12)
        assert float(m2) == pytest.approx(expected.m2, rel=1e-12)


def test_a_durable_step_is_never_lost_and_a_resent_batch_is_not_trained_twice(
    tmp_path: Any,
) -> None:
    """durable (the default): each step is on disk before the reply. A learner rebuilt from the
    run directory after any step is exactly where the first one was; the batch re-sent with
    the same id gets the step's result back (replayed) and trains nothing; the step log holds
    every step once, with the ids it consumed."""

    def batch(step: int) -> TrainBatch:
        samples = [
            Scored(sample=sample(f"p{step}", [2, 3, 13], [4 + step, 1], i), reward=float(i))
            for i in (0, 1)
        ]
        keep = ProgramState(phase="rl")
        return TrainBatch(samples=samples, algorithm="grpo", keep=keep, id=f"rl-{step}")

    first = make(tmp_path, lr=0.01)
    results = [first.train(batch(step)) for step in range(3)]
    restarted = make(tmp_path, lr=0.01)  # a new incarnation, from the run directory
    assert (restarted.step, restarted.version) == (3, 3)
    again = restarted.train(batch(2))  # its reply was lost: re-sent
    assert again.replayed and (again.step, again.version, again.consumed) == (3, 3, 2)
    assert again.metrics == results[-1].metrics
    assert restarted.step == 3
    for a, b in zip(
        first.trainer.model.state_dict().values(),
        restarted.trainer.model.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b)
    with open(tmp_path / "ledger" / "learner.0.steps.jsonl") as f:
        log = [json.loads(line) for line in f]
    assert [r["step"] for r in log] == [1, 2, 3]
    assert log[2]["ids"] == [["p2", 0], ["p2", 1]] and log[2]["phase"] == "rl"
    status = run(restarted.learner_status(None))
    assert isinstance(status, LearnerStatus)
    assert (status.version, status.step, status.consumed) == (3, 3, 6)
    assert status.keep == ProgramState(phase="rl") and status.last["id"] == "rl-2"
    assert status.durable
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(status), type=LearnerStatus)
    assert wire == status  # what a program's typed client decodes


def test_a_torn_checkpoint_and_an_orphan_log_line_are_never_loaded(tmp_path: Any) -> None:
    """A crash inside a checkpoint write leaves step-N.tmp and a step-log line for step N: the
    restarted learner loads step N-1, ignores the .tmp, and cuts the line (step N is then
    trained again, once)."""
    learner = make(tmp_path, lr=0.01)
    for step in range(2):
        learner.train(
            TrainBatch(
                samples=[Scored(sample=sample(f"p{step}", [2, 3], [4, 1]), reward=1.0)],
                algorithm="grpo",
            )
        )
    checkpoints = tmp_path / "roles" / "learner.0" / "checkpoints"
    (checkpoints / "step-00000003.tmp").mkdir()
    (checkpoints / "step-00000003.tmp" / "state.pt").write_bytes(b"half a checkpo")
    with open(tmp_path / "ledger" / "learner.0.steps.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "version": 3, "ids": [["p9", 0]], "skipped": 0}) + "\n")
        f.write('{"step": 4, "vers')  # torn by the crash
    restarted = make(tmp_path, lr=0.01)
    assert restarted.step == 2 and ("p9", 0) not in restarted.consumed
    with open(tmp_path / "ledger" / "learner.0.steps.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]


def test_export_writes_only_inside_the_run_directory(tmp_path: Any) -> None:
    run_dir = tmp_path / "run"
    learner = make(run_dir)
    inside = asyncio.run(learner.export(str(run_dir / "exports" / "final")))
    assert os.path.exists(os.path.join(inside, "config.json"))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious")
    with pytest.raises(PermissionError, match=r"refusing to write .* it is outside .*/exports'"):
        asyncio.run(learner.export(str(outside)))
    os.symlink(outside, run_dir / "exports" / "link")
    with pytest.raises(PermissionError):
        asyncio.run(
            learner.export(str(run_dir / "exports" / "link"))
        )  # a link out of the run directory
    with pytest.raises(PermissionError, match="part of the run's own state"):
        asyncio.run(learner.export(str(run_dir / "roles" / "learner.0")))  # its checkpoints
    with pytest.raises(PermissionError):
        asyncio.run(learner.export(str(run_dir)))  # never the run directory itself
    assert (outside / "keep.txt").read_text() == "precious"
    allowed = make(tmp_path / "run2", write_paths=[str(outside)])
    assert asyncio.run(allowed.export(str(outside / "model"))) == str(outside / "model")


AGGREGATIONS = [
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
]


def _uneven_batch(learner: Learner) -> list[Scored]:
    """Two groups whose completions have 3, 1, 0 (empty), 5, 2 and 4 tokens."""
    rows = [
        ("a", [2, 3, 12], [6, 7, 1], 1.0),
        ("a", [2, 3, 12], [8], 0.0),
        ("a", [2, 3, 12], [], 0.5),
        ("b", [4, 13], [5, 6, 7, 8, 1], 1.0),
        ("b", [4, 13], [9, 1], 0.0),
        ("b", [4, 13], [10, 11, 6, 1], 0.0),
    ]
    out = []
    for i, (pid, prompt, tokens, reward) in enumerate(rows):
        # Behaviour log-probs a little off the current ones, so that no ratio is 1.
        current = learner.trainer.logprobs([sample(pid, prompt, tokens)])[0]
        behaviour = [lp - 0.03 * (j + 1) for j, lp in enumerate(current)]
        out.append(Scored(sample=sample(pid, prompt, tokens, i, behaviour), reward=reward))
    return out


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batches_weigh_like_the_whole_batch(tmp_path: Any, aggregation: str) -> None:
    """Token means weigh each token once (an empty completion adds none); sequence means weigh
    each non-empty sequence 1/B: split into micro-batches, the loss and the gradient are those
    of the whole batch."""
    config = {
        "lr": 0.0,
        "grad_clip": 1e9,  # clipping to a norm would hide a wrong scale
        "aggregation": aggregation,
        "norm_len": 8.0,
        "entropy_coef": 0.1,
    }
    whole = make(tmp_path / "whole", micro_batch_tokens=10_000, **config)
    split = make(tmp_path / "split", micro_batch_tokens=6, **config)
    batch = _uneven_batch(whole)
    assert len(micro_batches(batch, split.config.micro_batch_tokens)) == 6
    a = whole.train(TrainBatch(samples=batch, algorithm="grpo")).metrics
    b = split.train(TrainBatch(samples=batch, algorithm="grpo")).metrics
    assert abs(a["policy_loss"]) > 0.01
    assert b["policy_loss"] == pytest.approx(a["policy_loss"], rel=1e-6, abs=1e-6)
    assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-6, abs=1e-6)
    for (name, x), y in zip(
        whole.trainer.model.named_parameters(), split.trainer.model.parameters(), strict=True
    ):
        assert x.grad is not None and y.grad is not None
        torch.testing.assert_close(
            x.grad, y.grad, atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def _grads(learner: Learner) -> torch.Tensor:
    return torch.cat(
        [p.grad.flatten() for p in learner.trainer.model.parameters() if p.grad is not None]
    )


def test_dr_grpo_aggregation_divides_sequence_sums_by_norm_len(tmp_path: Any) -> None:
    """seq_mean_token_sum_norm is seq_mean_token_sum divided by the configured norm_len."""
    common = {"lr": 0.0, "grad_clip": 1e9, "micro_batch_tokens": 6}
    summed = make(tmp_path / "sum", aggregation="seq_mean_token_sum", **common)
    normed = make(tmp_path / "norm", aggregation="seq_mean_token_sum_norm", norm_len=8, **common)
    batch = _uneven_batch(summed)
    a = summed.train(TrainBatch(samples=batch, algorithm="grpo")).metrics["policy_loss"]
    b = normed.train(TrainBatch(samples=batch, algorithm="grpo")).metrics["policy_loss"]
    assert b == pytest.approx(a / 8, rel=1e-6)
    torch.testing.assert_close(_grads(normed), _grads(summed) / 8, atol=1e-6, rtol=0)


def test_dr_grpo_aggregation_needs_norm_len(tmp_path: Any) -> None:
    import msgspec

    with pytest.raises(
        msgspec.ValidationError,
        match=r"^norm_len: aggregation 'seq_mean_token_sum_norm' \(Dr. GRPO\) divides each "
        r"sequence's token sum by norm_len; set it to the sampling budget "
        r"\(SamplingParams.max_new_tokens\)$",
    ):
        make(tmp_path, aggregation="seq_mean_token_sum_norm")
    with pytest.raises(msgspec.ValidationError, match=r"^norm_len: expected a number > 0, got 0"):
        make(tmp_path, aggregation="seq_mean_token_sum_norm", norm_len=0)


def _ppo_batch() -> list[Scored]:
    """Three samples with critic values, rewards and reference log-probs; one is empty."""
    rows = [
        ([6, 7, 1], [-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5], [0.1, 0.4, 0.2], 1.0),
        ([8, 1], [-0.3, -0.7], [-0.2, -1.7], [0.5, -0.3], 0.0),
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


def test_ppo_advantages_are_whitened_over_the_batch_tokens(tmp_path: Any) -> None:
    """gamma = lam = 1: A_t = R - V_t. Whitened over the five completion tokens, with the
    population std the data-parallel moments give."""
    plain = make(tmp_path / "a", algorithm="ppo", gamma=1.0, lam=1.0)
    white = make(tmp_path / "b", algorithm="ppo", gamma=1.0, lam=1.0, whiten_advantages=True)
    batch = _ppo_batch()
    raw = [1.0 - 0.1, 1.0 - 0.4, 1.0 - 0.2, 0.0 - 0.5, 0.0 + 0.3]
    got = batch_advantages(plain.config, "ppo", batch)
    assert [len(row) for row in got] == [3, 2, 0]
    assert [a for row in got for a in row] == pytest.approx(raw, abs=1e-6)
    mean = sum(raw) / 5
    std = (sum((a - mean) ** 2 for a in raw) / 5) ** 0.5
    whitened = batch_advantages(white.config, "ppo", batch)
    assert [len(row) for row in whitened] == [3, 2, 0]
    flat = [a for row in whitened for a in row]
    assert flat == pytest.approx([(a - mean) / (std + 1e-8) for a in raw], abs=1e-6)


def test_ppo_kl_in_the_reward_uses_the_configured_estimator(tmp_path: Any) -> None:
    """kl_mode reward, gamma = lam = 1: A_t = reward - kl_coef * sum_{t' >= t} KL_t' - V_t."""
    learner = make(tmp_path, algorithm="ppo", gamma=1.0, lam=1.0, kl_mode="reward", kl_coef=0.5)
    kl = [(-1.0 + 1.5), (-2.0 + 1.0), (-0.5 + 0.5)]  # k1: logp - ref
    kl = [math.expm1(-x) + x for x in kl]  # k3 (the default): exp(ref - logp) - (ref - logp) - 1
    values = [0.1, 0.4, 0.2]
    expected = [1.0 - 0.5 * sum(kl[t:]) - values[t] for t in range(3)]
    assert batch_advantages(learner.config, "ppo", _ppo_batch())[0] == pytest.approx(
        expected, abs=1e-6
    )


@pytest.mark.parametrize("std", ["population", "unbiased"])
def test_grpo_std_convention(tmp_path: Any, std: str) -> None:
    """Group a: rewards 1, 0, 0 (mean 1/3); group b: one sample, advantage 0."""
    learner = make(tmp_path, std=std)
    batch = [
        Scored(sample=sample("a", [2, 13], [4, 1], 0), reward=1.0),
        Scored(sample=sample("a", [2, 13], [5, 1], 1), reward=0.0),
        Scored(sample=sample("a", [2, 13], [6, 1], 2), reward=0.0),
        Scored(sample=sample("b", [2, 13], [6, 1], 0), reward=7.0),
    ]
    squares = (2 / 3) ** 2 + 2 * (1 / 3) ** 2
    sd = (squares / (3 if std == "population" else 2)) ** 0.5
    expected = [(2 / 3) / (sd + 1e-6), (-1 / 3) / (sd + 1e-6), (-1 / 3) / (sd + 1e-6), 0.0]
    assert batch_advantages(learner.config, "grpo", batch) == pytest.approx(expected, abs=1e-6)


def test_rloo_is_selectable(tmp_path: Any) -> None:
    """algorithm: rloo: A_i = r_i - mean of the group's other rewards; a lone sample gets 0.
    Given (pipeline) advantages are GRPO's and are not used."""
    learner = make(tmp_path, algorithm="rloo", lr=0.01)
    rewards = [1.0, 0.0, 0.5, 3.0]
    batch = [
        Scored(
            sample=sample("a" if i < 3 else "b", [2, 13], [4 + i, 1], i), reward=r, advantage=9.0
        )
        for i, r in enumerate(rewards)
    ]
    assert batch_advantages(learner.config, "rloo", batch) == pytest.approx(
        [0.75, -0.75, 0.0, 0.0], abs=1e-6
    )
    result = learner.train(TrainBatch(samples=batch))  # the configured algorithm
    # The same step as GRPO given those advantages.
    given = make(tmp_path / "given", lr=0.01)
    rloo = [
        Scored(sample=s.sample, reward=s.reward, advantage=a)
        for s, a in zip(batch, [0.75, -0.75, 0, 0], strict=True)
    ]
    expected = given.train(TrainBatch(samples=rloo, algorithm="grpo"))
    assert result.consumed == 4
    assert result.metrics["policy_loss"] == pytest.approx(expected.metrics["policy_loss"])
    assert abs(result.metrics["policy_loss"]) > 0.01
    torch.testing.assert_close(_grads(learner), _grads(given), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"unknown algorithm 'reinforce' in TrainBatch"):
        learner.train(TrainBatch(samples=batch, algorithm="reinforce"))


def test_the_objective_is_composed_once_from_the_config_and_the_batch(tmp_path: Any) -> None:
    """Each piece is chosen by name from a registry: the algorithm, the policy loss of the
    correction, and the (coefficient, term) pieces; unknown names list the known ones."""
    cfg = LearnerConfig(kl_coef=0.1, entropy_coef=0.02, importance="sequence")
    decoupled = objective_for(cfg, "grpo", "decoupled", 1.5)
    assert decoupled.algorithm is ALGORITHMS["grpo"]
    assert isinstance(decoupled.loss, PolicyGradient)
    assert decoupled.loss.policy == Decoupled(cfg, 1.5)
    assert decoupled.needs_proximal
    assert decoupled.terms == ((0.1, KLPenalty(cfg)), (-0.02, Entropy(cfg)))
    tis = objective_for(cfg, "ppo", "tis", 2.0)
    assert tis.loss == PolicyGradient(TruncatedImportance(cfg, 2.0), ALGORITHMS["ppo"])
    assert not tis.needs_proximal
    assert objective_for(LearnerConfig(), "rloo", "clip", 2.0).terms == ()
    reward_kl = LearnerConfig(kl_coef=0.1, kl_mode="reward", algorithm="ppo")
    assert objective_for(reward_kl, "ppo", "clip", 2.0).terms == ()  # in the rewards instead
    bc = objective_for(cfg, "bc", "clip", 2.0)
    assert (bc.loss, bc.terms, bc.needs_proximal) == (Imitation(cfg), (), False)
    with pytest.raises(
        ValueError,
        match=r"^unknown correction 'ppo'; expected one of \('clip', 'decoupled', 'tis'\)$",
    ):
        objective_for(cfg, "grpo", "ppo", 2.0)
    with pytest.raises(
        ValueError,
        match=r"^unknown algorithm 'reinforce'; expected one of \('grpo', 'rloo', 'ppo', 'bc'\)$",
    ):
        objective_for(cfg, "reinforce", "clip", 2.0)
    learner = make(tmp_path)
    with pytest.raises(ValueError, match=r"^unknown correction 'ppo'; expected one of"):
        learner.train(TrainBatch(samples=_group(learner, "p"), correction="ppo"))  # type: ignore[arg-type]


def test_a_term_composes_into_the_loss_with_its_coefficient(tmp_path: Any) -> None:
    """An objective's loss is its main piece plus each coefficient times its term, in order;
    a term that does not apply to a micro-batch (None) is left out of the loss and parts."""

    class Constant:
        def __init__(self, name: str, value: float | None) -> None:
            self.name, self.value = name, value

        def __call__(self, micro: MicroBatch) -> torch.Tensor | None:
            return None if self.value is None else torch.tensor(self.value)

    learner = make(tmp_path)
    group = _group(learner, "p")
    plain = objective_for(learner.config, "grpo", "clip", 2.0)
    advantages = plain.advantages(learner.config, group)
    forward = learner.trainer.forward([s.sample for s in group])
    micro = MicroBatch(group, advantages, None, forward)
    base, base_parts = plain(micro)
    terms = (
        (2.0, Constant("two", 0.25)),
        (-1.0, Constant("skipped", None)),
        (-3.0, Constant("x", 1.0)),
    )
    loss, parts = dataclasses.replace(plain, terms=terms)(micro)
    assert torch.equal(loss, base + 2.0 * torch.tensor(0.25) + -3.0 * torch.tensor(1.0))
    assert float(loss.detach()) == pytest.approx(float(base.detach()) - 2.5)
    assert parts == {**base_parts, "two": 0.25, "x": 1.0}


def test_bc_dropout_acts_in_bc_steps_only(tmp_path: Any) -> None:
    """bc_dropout: a BC step trains with dropout (its update differs from one without), an RL
    step is bit-identical to one without it, and the model is left in eval mode either way, so
    the learner's log-probs stay the sampler's."""
    model = {**MODEL, "resid_pdrop": 0.5, "embd_pdrop": 0.5, "attn_pdrop": 0.5}
    demos = [Scored(sample=sample(f"d{i}", [2, 3, 13], [4 + i, 5, 1])) for i in range(4)]
    rl = [Scored(sample=sample("p", [2, 3, 13], [4 + i, 1], i), reward=float(i)) for i in range(4)]
    plain = make(tmp_path / "plain", lr=0.01, model_config=model)
    dropped = make(tmp_path / "dropped", lr=0.01, model_config=model, bc_dropout=True)
    for learner in (plain, dropped):
        learner.train(TrainBatch(samples=demos, algorithm="bc"))
        assert not learner.trainer.model.training
    after_bc = [p.clone() for p in dropped.trainer.model.parameters()]
    assert any(
        not torch.equal(a, b)
        for a, b in zip(plain.trainer.model.parameters(), after_bc, strict=True)
    )
    again = make(tmp_path / "again", lr=0.01, model_config=model, bc_dropout=True)
    reference = make(tmp_path / "reference", lr=0.01, model_config=model)
    for learner in (again, reference):
        learner.train(TrainBatch(samples=rl, algorithm="grpo"))
        assert not learner.trainer.model.training
    for a, b in zip(
        again.trainer.model.parameters(), reference.trainer.model.parameters(), strict=True
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize("durable", ["wal", "checkpoint"])
def test_a_given_lr_stays_the_peak_until_another_is_given_across_a_restart(
    tmp_path: Any, durable: str
) -> None:
    """``TrainBatch.lr`` > 0 is the peak from that step on; 0 keeps the last one given, never
    the config's; a batch whose samples the ledger skips takes no step and changes nothing; a
    restarted learner has the peak back (from its checkpoint, or from the batch its log
    replays)."""

    def batch(step: int, lr: float, pid: str = "") -> TrainBatch:
        samples = [
            Scored(sample=sample(pid or f"p{step}", [2, 3], [4 + step, 1], i), reward=float(i))
            for i in range(2)
        ]
        return TrainBatch(samples=samples, algorithm="grpo", lr=lr, id=f"b{step}")

    def rate(learner: Learner) -> float:  # what the next step takes (the schedule: constant)
        return float(learner.trainer.optimizer.param_groups[0]["lr"])

    learner = make(tmp_path, lr=0.01, durable=durable)
    rates = []
    for step, lr in enumerate([0.0, 0.5, 0.0]):
        learner.train(batch(step, lr))
        rates.append(rate(learner))
    assert rates == [0.01, 0.5, 0.5]
    skipped = learner.train(batch(3, 0.2, pid="p2"))  # p2's samples: consumed at step 3
    assert (skipped.step, skipped.consumed, skipped.skipped) == (3, 0, 2)
    assert rate(learner) == 0.5
    learner.train(batch(4, 0.0))
    run(learner.teardown())
    restarted = make(tmp_path, lr=0.01, durable=durable)
    assert (restarted.step, rate(restarted)) == (4, 0.5)
    restarted.train(batch(5, 0.0))
    assert rate(restarted) == 0.5
