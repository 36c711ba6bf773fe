"""Data-parallel learners: two ranks in two processes (gloo, a FileStore) take the step one
learner takes on the whole batch (replica 0 takes the calls and runs them on both ranks:
``asyncrl.roles.training.lockstep``), keep bit-identical parameters, and agree where to resume."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from asyncrl.role import RoleContext
from asyncrl.roles.generation.rollout import Sample
from asyncrl.roles.training.checkpoints import CheckpointDir
from asyncrl.roles.training.data_parallel import DataParallelError, fingerprint, token_shares
from asyncrl.roles.training.learner import Learner, Scored, TrainBatch
from tests.conftest import ROOT

MODEL = {
    "model_type": "gpt2",
    "vocab_size": 14,
    "n_positions": 24,
    "n_embd": 32,
    "n_layer": 1,
    "n_head": 2,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "pad_token_id": 0,
}

# Two epochs of two mini-batches with decoupled PPO (proximal log-probs computed in shares and
# gathered), whitening, a KL term, an entropy bonus and small micro-batches: every path that
# differs between one learner and two ranks.
CONFIG: dict[str, Any] = {
    "model_config": MODEL,
    "seed": 3,
    "lr": 3e-3,
    "ppo_epochs": 2,
    "mini_batches": 2,
    "micro_batch_tokens": 24,
    "whiten_advantages": True,
    "kl_coef": 0.05,
    "entropy_coef": 0.01,
    "dist_timeout_s": 60.0,
    # Rounding of float32 sums in another order, amplified by AdamW where a gradient is near
    # zero, moves some parameters by ~1e-5 after a few steps; float64 shows the steps are equal.
    "dtype": "float64",
    # A whole checkpoint before every reply: these tests go back one checkpoint on a rank
    # (tests/training/test_wal.py covers the write-ahead log).
    "durable": "checkpoint",
}
STEPS = 3


def batches() -> list[TrainBatch]:
    """Three batches of two prompts of 3 samples, uneven lengths, stale behaviour log-probs."""
    out = []
    for step in range(STEPS):
        samples = []
        for p in range(2):
            for k in range(3):
                n = 1 + (step + p + 2 * k) % 5
                tokens = [2 + (step * 7 + p * 3 + k + j) % 12 for j in range(n)]
                logprobs = [-1.0 - 0.1 * j - 0.05 * k for j in range(n)]
                sample = Sample(
                    prompt_id=f"s{step}p{p}",
                    sample_index=k,
                    prompt_ids=[3 + p, 5, 7 + k][: 2 + p],
                    token_ids=tokens,
                    logprobs=logprobs,
                    versions=[0] * n,
                    finished=True,
                    stop_reason="stop",
                )
                ref = [lp - 0.02 for lp in logprobs]
                samples.append(
                    Scored(sample=sample, reward=float((k + p + step) % 3), ref_logprobs=ref)
                )
        out.append(
            TrainBatch(samples=samples, algorithm="grpo", correction="decoupled", id=f"b{step}")
        )
    return out


RANK_SCRIPT = """
import asyncio, json, os, shutil, sys
import torch
torch.set_num_threads(1)
from asyncrl.role import RoleContext
from asyncrl.roles.training.learner import Learner
from tests.training.test_data_parallel import CONFIG, batches

rank, run_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]

async def main():
    def learner(incarnation):
        ctx = RoleContext.local(config=dict(CONFIG), name="learner", replica=rank, replicas=2,
                                run_dir=run_dir, incarnation=incarnation)
        return Learner(ctx)
    def last(status):
        return {**status.last["result"]["metrics"], "version": status.version,
                "consumed": status.last["result"]["consumed"]}
    first = learner(0)
    await first.setup()
    # Replica 0 takes the calls; replica 1 runs each with it, until replica 0 closes.
    results = [await first.train_step(b) for b in batches()] if rank == 0 else []
    await first.teardown()
    params = {k: v.clone() for k, v in first.trainer.model.state_dict().items()}
    torch.save(params, f"{out}/rank{rank}.pt")
    status = await first.learner_status(None)
    if rank == 1:
        # Rank 1 died after its last step's log line, before that step's checkpoint.
        shutil.rmtree(first.durability.checkpoints.latest())
    second = learner(1)
    await second.setup()
    resumed = {"step": second.step, "version": second.version,
               "consumed": len(second.consumed),
               "checkpoints": second.durability.checkpoints.steps()}
    again = (await second.train_step(batches()[-1])).replayed if rank == 0 else None
    await second.teardown()
    same = all(torch.equal(v, params[k]) for k, v in second.trainer.model.state_dict().items())
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"results": [r.metrics | {"version": r.version, "consumed": r.consumed}
                               for r in results], "last": last(status),
                   "resumed": resumed, "again": again, "retrained_same": same}, f)

asyncio.run(main())
"""


def run_ranks(
    script: str, args: list[str], report: str, *, ranks: int = 2, timeout: float = 180
) -> list[dict[str, Any]]:
    """Run ``script`` once per rank (``python -c script RANK *args``), each in its own
    process, and return the JSON each wrote to ``report.format(rank=...)``."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(ranks)
    ]
    errors = [p.communicate(timeout=timeout)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * ranks, "\n".join(e[-3000:] for e in errors)
    reports = []
    for rank in range(ranks):
        with open(report.format(rank=rank)) as f:
            reports.append(json.load(f))
    return reports


def _two_ranks(tmp_path: Any) -> list[dict[str, Any]]:
    run_dir, out = str(tmp_path / "run"), str(tmp_path)
    return run_ranks(RANK_SCRIPT, [run_dir, out], os.path.join(out, "rank{rank}.json"))


def _one_learner(tmp_path: Any) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    torch.set_num_threads(1)
    ctx = RoleContext.local(config=dict(CONFIG), name="learner", run_dir=str(tmp_path / "one"))
    learner = Learner(ctx)
    asyncio.run(learner.setup())
    results = [asyncio.run(learner.train_step(b)) for b in batches()]
    asyncio.run(learner.teardown())
    return learner.trainer.model.state_dict(), [r.metrics for r in results]


@pytest.mark.slow
def test_two_ranks_take_one_learners_step_with_identical_parameters(tmp_path: Any) -> None:
    ranks = _two_ranks(tmp_path)
    params = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    # Bit for bit: the same reduced gradients met the same optimizer on both ranks.
    assert params[0].keys() == params[1].keys()
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    # Replica 1 took no call itself; its last step gave replica 0's result but its own memory
    # (its process's), which every step reports.
    assert ranks[1]["results"] == []
    assert ranks[0]["last"] == ranks[0]["results"][-1]
    own = [r["last"].pop("memory_allocated_mib") for r in ranks]
    own += [r.pop("memory_allocated_mib") for r in ranks[0]["results"]]
    assert all(m > 0 for m in own)
    assert ranks[0]["last"] == ranks[1]["last"]
    # One learner on the whole batch: the same losses and update, to float rounding.
    one, metrics = _one_learner(tmp_path)
    moved = max(float((one[k] - params[0][k]).abs().max()) for k in one)
    assert moved < 1e-10
    start = Learner(RoleContext.local(config=dict(CONFIG), run_dir=str(tmp_path / "init")))
    asyncio.run(start.setup())
    assert (
        max(float((one[k] - v).abs().max()) for k, v in start.trainer.model.state_dict().items())
        > 1e-3
    )
    assert [(r["version"], r["consumed"]) for r in ranks[0]["results"]] == [(1, 6), (2, 6), (3, 6)]
    for dp, single in zip(ranks[0]["results"], metrics, strict=True):
        assert dp["optimizer_steps"] == 4.0
        assert set(single) == (set(dp) | {"memory_allocated_mib"}) - {"version", "consumed"}
        single.pop("memory_allocated_mib")  # its own process's, not the ranks'
        for key, value in single.items():
            assert dp[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    # Rank 1 lost its last checkpoint: both resume from step 2, the newest both hold; rank 0
    # dropped its step 3 (another timeline), and retraining batch 3 gives the same weights.
    for r in ranks:
        assert r["resumed"] == {"step": 2, "version": 2, "consumed": 12, "checkpoints": [2]}
        assert r["retrained_same"] is True
    assert [r["again"] for r in ranks] == [False, None]


def test_token_shares_balance_tokens_deterministically() -> None:
    # Largest first to the lighter share: 5 | 4, 3 | 2 (7 vs 7), 1 to the lower rank on the tie.
    assert token_shares([5, 1, 4, 2, 3], 2) == [[0, 1, 3], [2, 4]]
    assert token_shares([5, 1, 4, 2, 3], 1) == [[0, 1, 2, 3, 4]]
    assert token_shares([3], 2) == [[0], []]
    assert token_shares([2, 2, 2, 2], 3) == [[0, 3], [1], [2]]
    with pytest.raises(ValueError, match="expected ranks >= 1, got 0"):
        token_shares([1], 0)


def test_fingerprint_tells_batches_apart() -> None:
    assert fingerprint("b1", [("p", 0)]) == fingerprint("b1", [("p", 0)])
    assert fingerprint("b1", [("p", 0)]) != fingerprint("b1", [("p", 1)])
    assert 0 <= fingerprint("x") < 2**31


def test_a_rank_that_never_arrives_is_named(tmp_path: Any) -> None:
    from asyncrl.roles.training.data_parallel import DataParallel

    with pytest.raises(DataParallelError) as caught:
        DataParallel.join(
            name="learner", rank=0, world=3, run_dir=str(tmp_path), generation=0, timeout_s=0.5
        )
    message = str(caught.value)
    assert (
        "learner: data-parallel group of 3 ranks: rank(s) [1, 2] did not arrive within 0.5 s"
        in message
    )
    assert "this is rank 0" in message and f"{tmp_path}/dist/learner." in message


def _ledgers(run_dir: str) -> list[list[dict[str, Any]]]:
    logs = []
    for rank in range(2):
        with open(os.path.join(run_dir, "ledger", f"learner.{rank}.steps.jsonl")) as f:
            logs.append([json.loads(line) for line in f])
    return logs


@pytest.mark.slow
def test_a_run_with_two_data_parallel_learners_survives_their_crash(run_dir: str) -> None:
    """``asyncrl run`` with ``roles.learner.replicas: 2`` under ``one_for_all``: GRPO on the
    arithmetic task through the real runtime. Each rank dies writing its second checkpoint (the
    first to die takes the other with it, which may by then have saved that step): the group
    restarts, the ranks agree on the newest checkpoint both hold, the batch re-sent is trained
    once, and the run completes with both ranks' weights the same."""
    from tests.integration.test_programs import run_program

    faults = {"kill_at": {"point": "checkpoint_write", "every": 2, "incarnations": 1}}
    overrides = (
        "roles.learner.replicas=2",
        "roles.learner.supervision.strategy=one_for_all",
        "roles.learner.config.durable=checkpoint",
        f"roles.learner.env.ASYNCRL_FAULTS='{json.dumps(faults)}'",
    )
    result = run_program(run_dir, "grpo", 3, overrides=overrides)
    assert len(result["rewards"]) == 3
    with open(os.path.join(run_dir, "report.json")) as f:
        assert json.load(f)["restarts"]["learner"] == 2  # each replica once, together
    logs = _ledgers(run_dir)
    assert [[r["step"] for r in log] for log in logs] == [[1, 2, 3]] * 2
    assert [r["ids"] for r in logs[0]] == [r["ids"] for r in logs[1]]
    assert len({tuple(i) for r in logs[0] for i in r["ids"]}) == 3 * 32
    assert [r["incarnation"] for r in logs[0]] == [0, 1, 1]
    assert result["pipeline"]["consumed_samples"] == 3 * 32
    states = [
        CheckpointDir.load(
            os.path.join(run_dir, "roles", f"learner.{r}", "checkpoints", "step-00000003")
        )["model"]
        for r in range(2)
    ]
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


@pytest.mark.slow
def test_the_data_parallel_benchmark_measures_both_groups() -> None:
    from asyncrl.bench.learner import measure_data_parallel

    figures = measure_data_parallel(samples_per_step=8, steps=1)
    assert set(figures) == {
        "dp1_step_ms_p50",
        "dp2_step_ms_p50",
        "dp2_speedup",
        "dp_samples_per_step",
        "dp_steps",
    }
    assert figures["dp1_step_ms_p50"] > 0 and figures["dp2_step_ms_p50"] > 0
    assert figures["dp2_speedup"] == figures["dp1_step_ms_p50"] / figures["dp2_step_ms_p50"]
    assert (figures["dp_samples_per_step"], figures["dp_steps"]) == (8, 1)


BROKEN_SCRIPT = """
import os, sys
from asyncrl.roles.training.data_parallel import DataParallel, DataParallelError
rank, run_dir = int(sys.argv[1]), sys.argv[2]
dp = DataParallel.join(name="learner", rank=rank, world=2, run_dir=run_dir, generation=0,
                       timeout_s=20)
if rank == 1:
    os._exit(3)  # dies with the group formed
for attempt in range(2):
    try:
        dp.barrier("the test's barrier")
    except DataParallelError as exc:
        print(exc)
"""


@pytest.mark.slow
def test_a_collective_with_a_dead_rank_breaks_the_group_for_good(tmp_path: Any) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BROKEN_SCRIPT, str(rank), str(tmp_path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 3], outs[0][1][-2000:]
    first, again = outs[0][0].splitlines()
    assert first.startswith("learner: rank 0: the test's barrier failed (RuntimeError: "), first
    assert first.endswith(
        "in a group of 2 (the timeout is 20 s): a rank died, or did not take part; every rank "
        "must run every call replica 0 announces (LearnerClient and CriticClient send their "
        "calls to replica 0; a call sent to another replica is refused)"
    )
    assert again.startswith("learner: rank 0: the data-parallel group broke earlier (rank 0: ")
    assert again.endswith("); the group must restart")


JOIN_SCRIPT = """
import sys
from asyncrl.roles.training.data_parallel import DataParallel
rank = int(sys.argv[1])
dp = DataParallel.join(name="learner", rank=rank, world=2, run_dir=sys.argv[2], generation=4,
                       timeout_s=30)
print(dp.all_gather_ints("the test's gather", [10 + rank]))
dp.close()
"""


@pytest.mark.slow
def test_ranks_meet_in_the_launchs_tcp_store_under_its_prefix(tmp_path: Any) -> None:
    import datetime

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        timeout=datetime.timedelta(seconds=30),
        wait_for_workers=False,
        multi_tenant=True,
    )
    env = {
        **os.environ,
        "ASYNCRL_DIST_STORE": f"127.0.0.1:{store.port}",
        "ASYNCRL_DIST_PREFIX": "asyncrl/run7/0",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", JOIN_SCRIPT, str(rank), str(tmp_path)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert [out.strip() for out, _ in outs] == ["[[10], [11]]"] * 2
    # Arrivals were written under the launch's prefix, the role and the generation (each rank's
    # first join: 0, whatever its incarnation); no file.
    assert store.get("asyncrl/run7/0/learner/0/arrived/1") == str(procs[1].pid).encode()
    assert not os.path.exists(tmp_path / "dist")


def test_across_nodes_the_generation_counts_a_ranks_joins_not_its_incarnation(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datetime

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from asyncrl.roles.training.data_parallel import _store

    store = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        timeout=datetime.timedelta(seconds=30),
        wait_for_workers=False,
        multi_tenant=True,
    )
    monkeypatch.setenv("ASYNCRL_DIST_STORE", f"127.0.0.1:{store.port}")
    monkeypatch.setenv("ASYNCRL_DIST_PREFIX", "asyncrl/run7/0")
    where = [
        _store("learner", str(tmp_path), inc, 30.0, rank)[1]
        for inc, rank in [(0, 0), (3, 1), (1, 0), (4, 1)]
    ]
    # Rank 1 crashed three times before it first joined: its incarnation is 3, its generation 0.
    assert [w.rpartition(" under ")[2] for w in where] == [
        "'asyncrl/run7/0/learner/0'",
        "'asyncrl/run7/0/learner/0'",
        "'asyncrl/run7/0/learner/1'",
        "'asyncrl/run7/0/learner/1'",
    ]


def test_a_group_that_went_on_smaller_meets_apart_with_ranks_by_place(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After node 1's loss the learner goes on with replicas 0 and 2: replica 2 is rank 1 of 2,
    and the group meets under its members in the store, never with the group of 3."""
    import datetime

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from asyncrl.role import RoleContext
    from asyncrl.roles.training.data_parallel import _store

    ctx = RoleContext(name="learner", replica=2, replicas=3, members=[0, 2], run_dir=str(tmp_path))
    assert (ctx.group_rank, ctx.group_size) == (1, 2)
    whole = RoleContext(name="learner", replica=2, replicas=3, run_dir=str(tmp_path))
    assert (whole.group_rank, whole.group_size) == (2, 3)
    store = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        timeout=datetime.timedelta(seconds=30),
        wait_for_workers=False,
        multi_tenant=True,
    )
    monkeypatch.setenv("ASYNCRL_DIST_STORE", f"127.0.0.1:{store.port}")
    monkeypatch.setenv("ASYNCRL_DIST_PREFIX", "asyncrl/run7/0")
    before = _store("learner", str(tmp_path), 0, 30.0, 1)[1]
    after = _store("learner", str(tmp_path), 5, 30.0, 1, [0, 2])[1]
    assert before.rpartition(" under ")[2] == "'asyncrl/run7/0/learner/0'"
    assert after.rpartition(" under ")[2] == "'asyncrl/run7/0/learner/members-0-2/0'"


def test_ranks_whose_joins_diverged_meet_in_the_next_formation_of_their_group(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Formation 3 of the group [0, 1]: rank 0 joined, then node 1 was lost before rank 1
    joined; the group shrank and grew back to [0, 1] as formation 5. Under formation 3 their
    counts of joins differ (rank 0 would meet under /1, rank 1 under /0); under formation 5 both
    count afresh and meet."""
    import datetime

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from asyncrl.roles.training.data_parallel import _store

    store = TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        timeout=datetime.timedelta(seconds=30),
        wait_for_workers=False,
        multi_tenant=True,
    )
    monkeypatch.setenv("ASYNCRL_DIST_STORE", f"127.0.0.1:{store.port}")
    monkeypatch.setenv("ASYNCRL_DIST_PREFIX", "asyncrl/run7/0")

    def join(rank: int, formation: int) -> tuple[Any, str]:
        found, where = _store("learner", str(tmp_path), 0, 30.0, rank, [0, 1], formation)
        return found, where.rpartition(" under ")[2]

    assert join(0, 3)[1] == "'asyncrl/run7/0/learner/members-0-1/f3/0'"
    assert join(0, 3)[1] == "'asyncrl/run7/0/learner/members-0-1/f3/1'"
    assert join(1, 3)[1] == "'asyncrl/run7/0/learner/members-0-1/f3/0'"
    (rank_0, at_0), (rank_1, at_1) = join(0, 5), join(1, 5)
    assert at_0 == at_1 == "'asyncrl/run7/0/learner/members-0-1/f5/0'"
    rank_0.set("arrived/0", "7")
    assert rank_1.get("arrived/0") == b"7"


SKIPPING_SCRIPT = """
import os, sys
from asyncrl.roles.training.data_parallel import DataParallel, DataParallelError
rank, run_dir = int(sys.argv[1]), sys.argv[2]
dp = DataParallel.join(name="learner", rank=rank, world=2, run_dir=run_dir, generation=0,
                       timeout_s=60)
if rank == 1:
    sys.stdin.read()  # alive but never at the barrier, until the test closes its stdin
    os._exit(0)
dp.timeout_s = 1.0
try:
    dp.barrier("the test's barrier")
except DataParallelError as exc:
    print(exc)
    print(type(exc.__cause__).__name__, exc.__cause__.collective, exc.__cause__.missing)
sys.stdout.flush()
os._exit(0)  # rank 1 still holds the group: leave without destroying it
"""


@pytest.mark.slow
def test_a_collective_a_rank_skips_times_out_through_the_plugin_naming_that_rank(
    tmp_path: Any,
) -> None:
    """The group's collectives are the plugin's (``plugin.comm``), bounded by the group's
    timeout: a barrier rank 1 never reaches fails on rank 0 within it, naming rank 1."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SKIPPING_SCRIPT, str(rank), str(tmp_path)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        out, err = procs[0].communicate(timeout=120)
    finally:
        procs[1].communicate(input="", timeout=120)
    assert procs[0].returncode == 0, err[-2000:]
    message, cause = out.splitlines()
    assert message == (
        "learner: rank 0: the test's barrier failed (CollectiveTimeoutError: barrier: rank(s) "
        "[1] did not arrive within 1 s (this is rank 0); check that process's log for a crash "
        "or a hang, or raise dist_timeout_s in the manifest) in a group of 2 (the timeout is "
        "1 s): a rank died, or did not take part; every rank must run every call replica 0 "
        "announces (LearnerClient and CriticClient send their calls to replica 0; a call sent "
        "to another replica is refused)"
    )
    assert cause == "CollectiveTimeoutError barrier [1]"
