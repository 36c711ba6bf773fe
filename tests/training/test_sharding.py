"""Sharded learners (``parallel: fsdp``): two ranks in two processes (gloo, a FileStore) shard
the model with FSDP2 and take the step one learner takes on the whole batch, and the step two
replicated ranks take; they checkpoint their own shards, resume from them, and publish whole
weights bucket by bucket."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest
import torch

from asyncrl.role import RoleContext
from asyncrl.roles.training.checkpoints import CheckpointDir
from asyncrl.roles.training.learner import Learner
from asyncrl.roles.training.sharding import blocks
from tests.training.test_data_parallel import CONFIG, batches, run_ranks

# Demonstrations and a BC term too: the sharded ranks share it out. Activation checkpointing
# (only sharded ranks use it) recomputes the blocks' activations to the same values.
SHARDED = {
    **CONFIG,
    "parallel": "fsdp",
    "bucket_mib": 1,
    "bc_coef": 0.1,
    "activation_checkpointing": True,
}

BLOCKS = {"FSDPCheckpointWrapper", "GPT2Block", "Qwen2DecoderLayer"}

RANK_SCRIPT = """
import asyncio, json, shutil, sys
import torch
torch.set_num_threads(1)
from asyncrl.role import RoleContext
from asyncrl.roles.training.learner import Learner
from asyncrl.roles.payloads import StepResult
from asyncrl.roles.training.sharding import full_buckets
from asyncrl.weights.reader import WeightReader
from tests.training.test_sharding import BLOCKS, SHARDED, with_demos

rank, run_dir, out, parallel = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
extra = json.loads(sys.argv[5])
if extra.get("model_path") and parallel == "fsdp":
    import asyncrl.roles.training.learner as learner_module

    def whole_model_built(*args):
        raise AssertionError("a sharded rank built the whole pretrained model")

    learner_module.build_model = whole_model_built

def whole(learner):
    buckets = full_buckets(learner.trainer.model, 2**20)
    return {k: v.clone() for bucket in buckets for k, v in bucket.items()}

async def main():
    def learner(incarnation):
        config = dict(SHARDED, parallel=parallel, **extra)
        ctx = RoleContext.local(config=config, name="learner", replica=rank, replicas=2,
                                run_dir=run_dir, incarnation=incarnation)
        return Learner(ctx)
    first = learner(0)
    await first.setup()
    # Replica 0 takes the calls; replica 1 runs each with it, until replica 0 closes.
    results = [await first.train_step(b) for b in with_demos()] if rank == 0 else []
    await first.ctx.offload(first.lockstep.close, 120.0)
    if rank == 1:
        last = (await first.learner_status(None)).last["result"]
        results = [StepResult(**last)]
    params = whole(first)  # both ranks, out of the group's calls: a gather of every shard
    torch.save(params, f"{out}/{parallel}{rank}.pt")
    published = None
    if first.published.store is not None:
        with WeightReader(first.published.store.describe()) as reader:
            version, state = reader.read()
        published = {"version": version,
                     "same": state.keys() == params.keys()
                     and all(torch.equal(state[k], params[k]) for k in params)}
    await first.teardown()
    if rank == 1:
        # Rank 1 died after its last step's log line, before that step's checkpoint.
        shutil.rmtree(first.durability.checkpoints.latest())
    second = learner(1)
    await second.setup()
    resumed = {"step": second.step, "version": second.version,
               "consumed": len(second.consumed),
               "checkpoints": second.durability.checkpoints.steps()}
    again = await second.train_step(with_demos()[-1]) if rank == 0 else None
    await second.ctx.offload(second.lockstep.close, 120.0)
    after = whole(second)
    same = all(torch.equal(v, params[k]) for k, v in after.items())
    await second.teardown()
    block = sorted({type(m).__name__ for m in first.trainer.model.modules()} & BLOCKS)
    with open(f"{out}/{parallel}{rank}.json", "w") as f:
        json.dump({"results": [r.metrics | {"version": r.version, "consumed": r.consumed}
                               for r in results], "published": published, "block": block,
                   "resumed": resumed, "again": again and again.replayed,
                   "retrained_same": same}, f)

asyncio.run(main())
"""


def with_demos() -> list[Any]:
    """The data-parallel test's batches, each with two demonstrations for the BC term."""
    out = []
    for b in batches():
        demos = [b.samples[0].sample, b.samples[4].sample]
        out.append(
            type(b)(
                samples=b.samples,
                algorithm=b.algorithm,
                correction=b.correction,
                id=b.id,
                demos=demos,
            )
        )
    return out


def _two_ranks(
    tmp_path: Any, parallel: str, extra: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    run_dir, out = str(tmp_path / f"run-{parallel}"), str(tmp_path)
    argv = [run_dir, out, parallel, json.dumps(extra or {})]
    report = os.path.join(out, f"{parallel}{{rank}}.json")
    return run_ranks(RANK_SCRIPT, argv, report, timeout=300)


def _one_learner(
    tmp_path: Any, extra: dict[str, Any] | None = None
) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    torch.set_num_threads(1)
    config = dict(SHARDED, parallel="replicate", **(extra or {}))
    ctx = RoleContext.local(config=config, name="learner", run_dir=str(tmp_path / "one"))
    learner = Learner(ctx)
    asyncio.run(learner.setup())
    results = [asyncio.run(learner.train_step(b)) for b in with_demos()]
    asyncio.run(learner.teardown())
    return learner.trainer.model.state_dict(), [r.metrics for r in results]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
@pytest.mark.timeout(300)  # four learner processes, one after the other
def test_two_sharded_ranks_take_one_learners_step_and_resume_from_their_shards(
    tmp_path: Any,
) -> None:
    sharded = _two_ranks(tmp_path, "fsdp")
    params = [torch.load(tmp_path / f"fsdp{r}.pt", weights_only=True) for r in range(2)]
    # Both ranks gathered the same whole model.
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    one, metrics = _one_learner(tmp_path)
    assert _max_diff(one, params[0]) < 1e-10
    # The same step as two replicated ranks, which hold the whole model each.
    replicated = _two_ranks(tmp_path, "replicate")
    assert _max_diff(torch.load(tmp_path / "replicate0.pt", weights_only=True), params[0]) < 1e-10
    start = Learner(RoleContext.local(config=dict(CONFIG), run_dir=str(tmp_path / "init")))
    asyncio.run(start.setup())
    assert _max_diff(one, start.trainer.model.state_dict()) > 1e-3  # the steps moved the weights
    # Replica 0 answered each step; replica 1 ran them with it (its last step's result).
    assert [(r["version"], r["consumed"]) for r in sharded[0]["results"]] == [
        (1, 6),
        (2, 6),
        (3, 6),
    ]
    assert [(r["version"], r["consumed"]) for r in sharded[1]["results"]] == [(3, 6)]
    for fsdp, rep, single in zip(
        sharded[0]["results"], replicated[0]["results"], metrics, strict=True
    ):
        assert fsdp["optimizer_steps"] == 4.0
        for key, value in single.items():
            if key == "memory_allocated_mib":  # each process's own
                continue
            assert fsdp[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
            assert fsdp[key] == pytest.approx(rep[key], rel=1e-6, abs=1e-9), key
    assert sharded[0]["block"] == ["FSDPCheckpointWrapper", "GPT2Block"]
    assert replicated[0]["block"] == ["GPT2Block"]
    # Replica 0 published every version whole, bucket by bucket; replica 1 holds no store.
    assert sharded[0]["published"] == {"version": 3, "same": True}
    assert sharded[1]["published"] is None
    # Rank 1 lost its last checkpoint: both resume from step 2 from their own shards, and
    # retraining batch 3 gives the same weights bit for bit.
    for r in sharded:
        assert r["resumed"] == {"step": 2, "version": 2, "consumed": 12, "checkpoints": [2]}
        assert r["retrained_same"] is True
    assert sharded[0]["again"] is False


def test_blocks_are_the_models_repeated_layers() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{**CONFIG["model_config"], "n_layer": 3})
    model = AutoModelForCausalLM.from_config(config)
    found = blocks(model)
    assert [type(b).__name__ for b in found] == ["GPT2Block"] * 3
    assert found == list(model.transformer.h)
    assert blocks(torch.nn.Linear(2, 2)) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_sharded_ranks_of_a_300m_qwen2_each_hold_well_under_one_ranks_memory() -> None:
    from benchmarks.sharding import measure

    # Two steps: from the second on, a backward pass meets AdamW's state (the steady peak).
    result = measure(steps=2, ranks=(1, 2))
    assert result["model"] == "qwen2" and result["params"] >= 300_000_000
    one, two = result["ranks"]
    assert (one["ranks"], two["ranks"]) == (1, 2)
    # The resident set's peak, the model's build included. AdamW's state is 16 bytes a
    # parameter whole, 8 per rank sharded over two; the process itself (~390 MiB) and the root
    # unit's gathered tied embedding with its whole gradients are not halved. With the blocks'
    # collective buffers reused and free heap pages given back in each pass (host_buffers),
    # 0.56 measured (docs/sharding.md), 0.64 before; the goal is 0.6. A replicated rank would
    # be at 1.0.
    assert two["peak_mib_per_rank"] <= 0.6 * one["peak_mib_per_rank"], result
    # The same step, within float32 rounding of sums taken in another order.
    assert result["parity_max_abs_diff"] is not None
    assert result["parity_max_abs_diff"] < 1e-4, result
    assert result["moved_max_abs"] > 1e-6, result


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sharded_ranks_read_only_their_slices_of_a_pretrained_checkpoint(tmp_path: Any) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type="qwen2",
        vocab_size=14,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(5)
    path = str(tmp_path / "pretrained")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)  # model.safetensors
    extra = {"model_path": path, "model_config": {}}
    # The ranks' learner module refuses to build the whole model: each rank builds it empty
    # and reads its own rows of each tensor.
    sharded = _two_ranks(tmp_path, "fsdp", extra)
    params = torch.load(tmp_path / "fsdp0.pt", weights_only=True)
    one, _ = _one_learner(tmp_path, extra)
    assert _max_diff(one, params) < 1e-10
    start = AutoModelForCausalLM.from_pretrained(path).double().state_dict()
    assert _max_diff(one, start) > 1e-3
    for r in sharded:
        assert r["resumed"] == {"step": 2, "version": 2, "consumed": 12, "checkpoints": [2]}
        assert r["retrained_same"] is True


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_with_two_sharded_learners_survives_their_crash(run_dir: str) -> None:
    """``asyncrl run`` with two ``parallel: fsdp`` learners under ``one_for_all``: GRPO on the
    arithmetic task through the real runtime, the rollout fed by the shards gathered bucket by
    bucket. Each rank dies writing its second checkpoint: the group restarts from its shards,
    the batch re-sent is trained once, and the run completes."""
    from tests.integration.test_programs import run_program

    faults = {"kill_at": {"point": "checkpoint_write", "every": 2, "incarnations": 1}}
    overrides = (
        "roles.learner.replicas=2",
        "roles.learner.supervision.strategy=one_for_all",
        "roles.learner.config.parallel=fsdp",
        "roles.learner.config.bucket_mib=1",
        "roles.learner.config.durable=checkpoint",
        f"roles.learner.env.ASYNCRL_FAULTS='{json.dumps(faults)}'",
    )
    result = run_program(run_dir, "grpo", 3, overrides=overrides)
    assert len(result["rewards"]) == 3
    with open(os.path.join(run_dir, "report.json")) as f:
        assert json.load(f)["restarts"]["learner"] == 2  # each replica once, together
    logs = []
    for rank in range(2):
        with open(os.path.join(run_dir, "ledger", f"learner.{rank}.steps.jsonl")) as f:
            logs.append([json.loads(line) for line in f])
    assert [[r["step"] for r in log] for log in logs] == [[1, 2, 3]] * 2
    assert [r["ids"] for r in logs[0]] == [r["ids"] for r in logs[1]]
    assert len({tuple(i) for r in logs[0] for i in r["ids"]}) == 3 * 32
    assert [r["incarnation"] for r in logs[0]] == [0, 1, 1]
    assert result["pipeline"]["consumed_samples"] == 3 * 32
    # Each rank's checkpoint holds its own shards of a group of two.
    shards = [
        CheckpointDir.load(
            os.path.join(run_dir, "roles", f"learner.{r}", "checkpoints", "step-00000003")
        )
        for r in range(2)
    ]
    assert [s["world"] for s in shards] == [2, 2]
    name = next(n for n, t in shards[0]["model"].items() if t.dim() == 2)
    rows = [s["model"][name].shape[0] for s in shards]
    assert sum(rows) > max(rows)  # split between the ranks, not held whole by each
