"""``durable: wal``: the write-ahead log, asynchronous checkpoints, and a learner killed at every
phase of a step (mid-step, after the log, during a save, during a replay, twice in a row) that
ends with the parameters of a run never killed, bit for bit, for 1 rank and 2 FSDP ranks."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest
import torch

from asyncrl.role import RoleContext
from asyncrl.roles.generation.rollout import Sample
from asyncrl.roles.payloads import ProgramState
from asyncrl.roles.training.checkpoints import CheckpointDir
from asyncrl.roles.training.learner import Learner, Scored, TrainBatch
from asyncrl.roles.training.wal import KeepEntry, StepEntry, WalError, WriteAheadLog
from asyncrl.supervision.faults import FaultPlan
from tests.conftest import ROOT

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
# Two mini-batches and a KL term: more than one optimizer step per batch; dropout on, so that a
# replay that did not restore the RNG would differ.
CONFIG: dict[str, Any] = {
    "model_config": MODEL,
    "seed": 5,
    "lr": 3e-3,
    "mini_batches": 2,
    "micro_batch_tokens": 24,
    "kl_coef": 0.05,
    "dropout": True,
    "durable": "wal",
    "checkpoint_every": 3,
    "dist_timeout_s": 20.0,
}
STEPS = 8


def batch(step: int) -> TrainBatch:
    """Batch ``step``: two prompts of three samples of uneven lengths."""
    samples = []
    for p in range(2):
        for k in range(3):
            n = 1 + (step + p + 2 * k) % 5
            tokens = [2 + (step * 7 + p * 3 + k + j) % 12 for j in range(n)]
            logprobs = [-1.0 - 0.1 * j - 0.05 * k for j in range(n)]
            sample = Sample(
                prompt_id=f"s{step}p{p}",
                sample_index=k,
                prompt_ids=[3 + p, 5, 7 + k],
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
    keep = ProgramState(cursor=step)
    return TrainBatch(samples=samples, algorithm="grpo", id=f"b{step}", keep=keep)


# -- the log ----------------------------------------------------------------------------------


def entry(step: int) -> StepEntry:
    return StepEntry(step, f"batch {step}".encode(), {}, {"step": step})


def test_a_torn_tail_is_cut_and_corruption_before_acknowledged_steps_refused(
    tmp_path: Any,
) -> None:
    warnings: list[str] = []
    wal = WriteAheadLog(str(tmp_path / "wal"), warnings.append)
    for step in (1, 2):
        wal.append(entry(step))
    wal.append(KeepEntry(2, ProgramState(phase="rl")))
    segment = tmp_path / "wal" / "00000001.wal"
    whole = segment.read_bytes()
    segment.write_bytes(whole + whole[:7])  # a record cut short by the crash
    assert [e.step for e in wal.entries()] == [1, 2, 2]
    assert segment.read_bytes() == whole and "cut 7 byte(s)" in warnings[0]
    # A flipped byte in the first record, with acknowledged records after it: refused.
    segment.write_bytes(whole[:12] + bytes([whole[12] ^ 1]) + whole[13:])
    with pytest.raises(WalError, match="the record at byte 0 fails its checksum"):
        wal.entries()


def test_segments_begin_at_checkpoints_and_go_once_covered(tmp_path: Any) -> None:
    wal = WriteAheadLog(str(tmp_path), lambda _: None)
    for step in range(1, 4):
        wal.append(entry(step))
    wal.begin_segment(4)
    for step in range(4, 6):
        wal.append(entry(step))
    wal.begin_segment(6)
    wal.append(entry(6))
    assert wal.drop_through(4) == ["00000001.wal"]  # steps 1..3; 4..5 are not all covered
    assert [e.step for e in wal.entries()] == [4, 5, 6]
    assert wal.cut_after(4) == 2
    assert [e.step for e in wal.entries()] == [4]


# -- checkpoints ---------------------------------------------------------------------------------


def test_a_checkpoint_is_loaded_only_with_its_marker_and_all_its_files(tmp_path: Any) -> None:
    warnings: list[str] = []
    dirs = CheckpointDir(str(tmp_path), 3, FaultPlan.from_env(0), warn=warnings.append)
    state = {"model": {"w": torch.arange(6.0)}, "optimizer": {"state": {0: {"n": 1}}}}
    dirs.save(1, state)
    dirs.save(2, state)
    loaded = CheckpointDir.load(dirs.latest() or "")
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert loaded["optimizer"]["state"] == {0: {"n": 1}}  # int keys come back as ints
    os.remove(os.path.join(tmp_path, "step-00000002", "COMPLETE"))  # a save that died
    shards = [n for n in os.listdir(tmp_path / "step-00000001") if n.endswith(".distcp")]
    dirs.save(3, state)
    os.remove(os.path.join(tmp_path, "step-00000003", shards[0]))  # a missing shard
    assert dirs.steps() == [1]
    dirs.sweep()
    assert sorted(os.listdir(tmp_path)) == ["step-00000001"]
    assert "no completion marker" in warnings[0] and f"{shards[0]} is missing" in warnings[1]


# -- the learner ---------------------------------------------------------------------------------


def make(run_dir: Any, **config: Any) -> Learner:
    ctx = RoleContext.local(config={**CONFIG, **config}, run_dir=str(run_dir), name="learner")
    learner = Learner(ctx)
    asyncio.run(learner.setup())
    return learner


def test_a_restart_replays_the_logged_steps_bit_for_bit(tmp_path: Any) -> None:
    torch.set_num_threads(1)
    straight = make(tmp_path / "straight")
    for step in range(STEPS):
        straight.train(batch(step))
    first = make(tmp_path / "run")
    results = []
    for step in range(STEPS - 1):
        results.append(first.train(batch(step)))
        first.durability.journal.wait()  # each save complete before the next is due: steps 3 and 6
    asyncio.run(first.checkpoint(ProgramState(phase="eval")))  # a keep between steps, logged
    restarted = make(tmp_path / "run")
    assert (
        restarted.durability.restored_step,
        restarted.durability.replayed_steps,
        restarted.step,
    ) == (6, 1, 7)
    assert restarted.keep == ProgramState(cursor=STEPS - 2, phase="eval")
    again = restarted.train(batch(STEPS - 2))  # the last reply was lost: re-sent
    assert again.replayed and again.metrics == results[-1].metrics
    restarted.train(batch(STEPS - 1))
    for (name, a), b in zip(
        straight.trainer.model.state_dict().items(),
        restarted.trainer.model.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b), name
    # The ledger holds each step once. The replay was checkpointed (step 7); the log keeps
    # the steps after the older of the two newest checkpoints (6, 7).
    with open(tmp_path / "run" / "ledger" / "learner.0.steps.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, STEPS + 1))
    restarted.durability.journal.wait()
    assert restarted.durability.checkpoints.steps() == [6, 7]
    entries = restarted.durability.journal.wal.entries()  # type: ignore[union-attr]
    assert [(type(e).__name__, e.step) for e in entries] == [
        ("StepEntry", 7),
        ("KeepEntry", 7),
        ("StepEntry", 8),
    ]


def test_a_damaged_newest_checkpoint_goes_back_one_and_replays_more(tmp_path: Any) -> None:
    torch.set_num_threads(1)
    straight = make(tmp_path / "straight")
    for step in range(STEPS):
        straight.train(batch(step))
    first = make(tmp_path / "run")
    for step in range(STEPS):
        first.train(batch(step))
        first.durability.journal.wait()
    newest = first.durability.checkpoints.latest() or ""
    shard = next(n for n in os.listdir(newest) if n.endswith(".distcp"))
    os.remove(os.path.join(newest, shard))
    restarted = make(tmp_path / "run")
    assert (
        restarted.durability.restored_step,
        restarted.durability.replayed_steps,
        restarted.step,
    ) == (3, 5, 8)
    for a, b in zip(
        straight.trainer.model.state_dict().values(),
        restarted.trainer.model.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b)


# -- killed at every phase, in processes ----------------------------------------------------------

SCRIPT = """
import asyncio, json, os, sys
import torch
torch.set_num_threads(1)
from asyncrl.role import RoleContext
from asyncrl.roles.training.learner import Learner
from tests.training.test_wal import CONFIG, STEPS, batch

rank, ranks, run_dir, incarnation, config = (
    int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5]))
acks = os.path.join(run_dir, f"acks.{rank}")

async def main():
    ctx = RoleContext.local(config={**CONFIG, **config}, name="learner", replica=rank,
                            replicas=ranks, run_dir=run_dir, incarnation=incarnation)
    learner = Learner(ctx)
    await learner.setup()
    done = len(open(acks).read().split()) if os.path.exists(acks) else 0
    # Replica 0 takes the calls; another replica runs each with it, until replica 0 closes.
    for step in range(done, STEPS) if rank == 0 else []:
        await learner.train_step(batch(step))
        learner.durability.faults.after_work("train_step")  # the reply, as the runtime sends it
        with open(acks, "a") as f:
            f.write(f"{step} ")
    await learner.teardown()
    weights = learner.trainer.model.state_dict()
    state = {k: getattr(v, "to_local", lambda: v)() for k, v in weights.items()}
    torch.save(state, os.path.join(run_dir, f"final.{rank}.pt"))
    with open(os.path.join(run_dir, f"status.{rank}.json"), "w") as f:
        json.dump({"replayed": learner.durability.replayed_steps, "incarnation": incarnation}, f)

asyncio.run(main())
"""


def run_until_done(
    run_dir: str, ranks: int, config: dict[str, Any], faults: dict[str, Any] | None
) -> int:
    """Start the ranks, and again after each death, until they finish; returns the deaths."""
    os.makedirs(run_dir, exist_ok=True)
    env = {**os.environ, "ASYNCRL_FAULTS": json.dumps(faults)} if faults else dict(os.environ)
    for incarnation in range(6):
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    SCRIPT,
                    str(r),
                    str(ranks),
                    run_dir,
                    str(incarnation),
                    json.dumps(config),
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(ranks)
        ]
        errors = [p.communicate(timeout=240)[1] for p in procs]
        codes = [p.returncode for p in procs]
        if codes == [0] * ranks:
            return incarnation
        # A rank killed by a fault (-9), or one that left its broken group (1); no other error.
        assert set(codes) <= {0, 1, -9}, "\n".join(e[-3000:] for e in errors)
    raise AssertionError(f"{run_dir}: still failing after 6 incarnations")


def finals(run_dir: str, ranks: int) -> list[dict[str, torch.Tensor]]:
    return [torch.load(os.path.join(run_dir, f"final.{r}.pt")) for r in range(ranks)]


PHASES: dict[str, dict[str, Any]] = {
    "mid_step": {"kill_at": {"point": "mid_step", "every": 5}},
    "after_log": {"kill_at": {"point": "after_log", "every": 5}},
    "during_save": {"kill_at": {"point": "checkpoint_write", "every": 2}},
    "during_replay": {
        "kill_before_reply": {"method": "train_step", "every": 5},
        "kill_at": {"point": "replay_step", "every": 2, "incarnations": 2},
    },
    "twice": {"kill_at": {"point": "after_log", "every": 3, "incarnations": 2}},
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("ranks", [1, 2])
def test_killed_at_every_phase_ends_with_the_parameters_of_a_run_never_killed(
    tmp_path: Any, ranks: int
) -> None:
    config = {"parallel": "fsdp"} if ranks == 2 else {}
    straight = str(tmp_path / "straight")
    assert run_until_done(straight, ranks, config, None) == 0
    expected = finals(straight, ranks)
    for phase, faults in PHASES.items():
        run_dir = str(tmp_path / phase)
        deaths = run_until_done(run_dir, ranks, config, faults)
        assert deaths >= (2 if phase in ("during_replay", "twice") else 1), phase
        for r, got in enumerate(finals(run_dir, ranks)):
            for name, value in expected[r].items():
                assert torch.equal(value, got[name]), f"{phase}, rank {r}: {name}"
        with open(os.path.join(run_dir, "ledger", "learner.0.steps.jsonl")) as f:
            assert [json.loads(line)["step"] for line in f] == list(range(1, STEPS + 1)), phase
        shutil.rmtree(run_dir)


def test_an_earlier_releases_checkpoint_still_loads(tmp_path: Any) -> None:
    """One ``state.pt`` renamed into place whole: kept by the sweep and loaded."""
    os.makedirs(tmp_path / "step-00000004")
    torch.save({"step": 4, "model": {"w": torch.ones(2)}}, tmp_path / "step-00000004" / "state.pt")
    dirs = CheckpointDir(str(tmp_path), 2, FaultPlan.from_env(0))
    dirs.sweep()
    assert dirs.steps() == [4]
    assert CheckpointDir.load(dirs.latest() or "")["step"] == 4
