"""A sharded (FSDP) learner group that goes on at a smaller size: 2 ranks on two node folders
train, then rank 0 alone (``members: [0]``, as after node 1's loss) loads the newest checkpoint
both ranks hold complete, resharded, replays its write-ahead log after it, and trains on, with
the parameters of a 1-rank learner fed the same batches from that checkpoint, bit for bit."""

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
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported from C10d

from asyncrl.role import RoleContext
from asyncrl.roles.training.checkpoints import CheckpointDir, CheckpointError
from asyncrl.roles.training.data_parallel import PREFIX_ENV, STORE_ENV
from asyncrl.roles.training.learner import Learner
from asyncrl.roles.training.wal import StepEntry
from asyncrl.supervision.faults import FaultPlan
from tests.conftest import ROOT
from tests.training.test_wal import CONFIG as WAL_CONFIG
from tests.training.test_wal import batch

# Dropout off: each rank draws its dropout masks for its own share of the tokens, so a group of
# another size draws others, and no two sizes could take the same step.
CONFIG: dict[str, Any] = {
    **WAL_CONFIG,
    "dropout": False,
    "parallel": "fsdp",
    "checkpoint_every": 3,
    "keep_checkpoints": 3,
}
BEFORE = 7
"""Steps the 2 ranks train before node 1 is lost."""
AFTER = 3
"""Steps rank 0 trains alone after its replay."""

SCRIPT = """
import asyncio, json, sys
import torch
torch.set_num_threads(1)
from asyncrl.role import RoleContext
from asyncrl.roles.training.learner import Learner
from tests.training.test_wal import batch

rank, run_dir, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[4])
config = json.loads(sys.argv[3])

async def main():
    ctx = RoleContext.local(config=config, name="learner", replica=rank, replicas=2,
                            run_dir=run_dir)
    learner = Learner(ctx)
    await learner.setup()
    # Replica 0 takes the calls; replica 1 runs each with it, until replica 0 closes.
    for step in range(steps) if rank == 0 else []:
        await learner.train_step(batch(step))
    await learner.teardown()

asyncio.run(main())
"""


def train_two_ranks(root: str) -> list[str]:
    """Rank 0 in ``root`` (node 0's folder), rank 1 in ``root/node-1``, meeting in a store as
    a launch's ranks do; returns their folders."""
    folders = [root, os.path.join(root, "node-1")]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, STORE_ENV: f"127.0.0.1:{store.port}", PREFIX_ENV: "shrink-test"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(r), folders[r], json.dumps(CONFIG), str(BEFORE)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    return folders


def checkpoints(folder: str, replica: int) -> CheckpointDir:
    path = os.path.join(folder, "roles", f"learner.{replica}", "checkpoints")
    return CheckpointDir(path, 3, FaultPlan.from_env(0))


def survivor(run_dir: str) -> Learner:
    """Replica 0 started again alone, as the group's members after node 1's loss."""
    ctx = RoleContext.local(
        config=CONFIG,
        run_dir=run_dir,
        name="learner",
        replica=0,
        replicas=2,
        members=[0],
        incarnation=1,
    )
    learner = Learner(ctx)
    asyncio.run(learner.setup())
    return learner


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sharded_group_goes_on_alone_from_both_ranks_shards(tmp_path: Any) -> None:
    torch.set_num_threads(1)
    root = str(tmp_path / "run")
    folders = train_two_ranks(root)
    ranks = [checkpoints(folders[r], r) for r in range(2)]
    both = sorted(set(ranks[0].steps()) & set(ranks[1].steps()))
    assert len(both) >= 2, both
    # Node 1 died writing its newest checkpoint: rank 0 must go back to the one before, the
    # newest every rank holds complete, and replay more of its log.
    newest, restore = both[-1], both[-2]
    os.remove(os.path.join(ranks[1].dir_of(newest), "COMPLETE"))
    kept = [shutil.copytree(ranks[r].dir_of(restore), str(tmp_path / f"kept.{r}")) for r in (0, 1)]

    # Without node 1's folder (a run directory on node-local disks), rank 0 says why.
    hidden = str(tmp_path / "node-1-elsewhere")
    os.rename(folders[1], hidden)
    with pytest.raises(CheckpointError) as refused:
        survivor(root)
    absent = os.path.join(folders[1], "roles", "learner.1", "checkpoints")
    assert str(refused.value) == (
        f"learner.0: the checkpoint of step {newest} in {ranks[0].path} was written by a sharded "
        f"group of 2 ranks, and rank 1's folder of it, {absent}, is not there: this rank cannot "
        f"read that rank's shards. A sharded group goes on at a smaller size only with the run "
        f"directory on storage every node shares (run.shared_storage: true, docs/multinode.md)"
    )
    os.rename(hidden, folders[1])

    alone = survivor(root)
    assert (
        alone.durability.restored_step,
        alone.durability.replayed_steps,
        alone.step,
        alone.version,
    ) == (restore, BEFORE - restore, BEFORE, BEFORE)
    assert alone.trainer.world is None  # one rank trains whole, with no group
    for step in range(BEFORE, BEFORE + AFTER):
        alone.train(batch(step))

    # An uninterrupted 1-rank learner, given both ranks' states of that checkpoint, fed the
    # same batches from there.
    states = [CheckpointDir.load(k) for k in kept]
    straight = Learner(RoleContext.local(config=CONFIG, name="learner"))
    asyncio.run(straight.setup())
    straight.trainer.load_states(states)
    straight.step, straight.version = states[0]["step"], states[0]["version"]
    for step in range(restore, BEFORE + AFTER):
        straight.train(batch(step))
    got, expected = alone.trainer.model.state_dict(), straight.trainer.model.state_dict()
    for name, value in expected.items():
        assert torch.equal(value, got[name]), name
    moments = alone.trainer.optimizer.state_dict()["state"]
    for index, entry in straight.trainer.optimizer.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, moments[index][key]), (index, key)
    # Every step once in the ledger, and the replayed ones were logged anew.
    with open(os.path.join(root, "ledger", "learner.0.steps.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, BEFORE + AFTER + 1))
    entries = alone.durability.journal.wal.entries()  # type: ignore[union-attr]
    assert [e.step for e in entries if isinstance(e, StepEntry)][-1] == BEFORE + AFTER
    alone.durability.close()
    straight.durability.close()


GROUP_SCRIPT = """
import asyncio, json, os, sys
import torch
torch.set_num_threads(1)
from torch.distributed import TCPStore
from asyncrl.role import RoleContext
from asyncrl.roles.training.checkpoints import CheckpointDir
from asyncrl.roles.training.learner import Learner
from tests.training.test_wal import batch

args = json.loads(sys.argv[1])

async def main():
    ctx = RoleContext.local(config=args["config"], name="learner", replica=args["replica"],
                            replicas=args["replicas"], members=args["members"],
                            run_dir=args["run_dir"], incarnation=args["incarnation"])
    learner = Learner(ctx)
    await learner.setup()
    if args["kept"]:  # the reference: given every old rank's state, then fed the batches
        states = [CheckpointDir.load(k) for k in args["kept"]]
        learner.trainer.load_states(states)
        learner.step, learner.version = states[0]["step"], states[0]["version"]
        host, _, port = os.environ["ASYNCRL_DIST_STORE"].rpartition(":")
        store = TCPStore(host, int(port), is_master=False, wait_for_workers=False)
        store.set(f"reference-loaded/{ctx.group_rank}", "1")  # none trains before all loaded
        store.wait([f"reference-loaded/{r}" for r in range(ctx.group_size)])
    # The group's rank 0 takes the calls; the others run each with it, until it closes.
    for step in range(args["first"], args["last"]) if ctx.group_rank == 0 else []:
        await learner.train_step(batch(step))
    await learner.teardown()
    if args["out"]:
        weights = learner.trainer.model.state_dict()
        local = {k: getattr(v, "to_local", lambda: v)() for k, v in weights.items()}
        status = [learner.durability.restored_step, learner.durability.replayed_steps]
        torch.save({"weights": local, "status": status}, args["out"])

asyncio.run(main())
"""


def run_group(store: Any, prefix: str, ranks: list[dict[str, Any]]) -> None:
    """One group of learner ranks, each a process with ``GROUP_SCRIPT``'s arguments."""
    env = {**os.environ, STORE_ENV: f"127.0.0.1:{store.port}", PREFIX_ENV: prefix}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", GROUP_SCRIPT, json.dumps(args)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for args in ranks
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(o[-3000:] for o in outputs)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_sharded_ranks_go_on_as_two_from_the_three_ranks_shards(tmp_path: Any) -> None:
    """Three FSDP ranks on nodes 0, 1 and 2; node 1 lost: replicas 0 and 2 (ranks 0 and 1 of
    the smaller group, ``members: [0, 2]``) agree on the checkpoint all three wrote, each load
    the three ranks' shards resharded to 2, replay their logs and train on, with the shards of
    a group of 2 given those states and fed the same batches, bit for bit."""
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    root = str(tmp_path / "run")
    folders = [root, os.path.join(root, "node-1"), os.path.join(root, "node-2")]
    config = {**CONFIG, "checkpoint_every": 3}
    common = {"config": config, "replicas": 3, "kept": [], "out": ""}
    before, after = 4, 5
    run_group(
        store,
        "three",
        [
            {**common, "replica": r, "members": [], "run_dir": folders[r], "incarnation": 0}
            | {"first": 0, "last": before}
            for r in range(3)
        ],
    )
    restore = 3  # the only checkpoint: step 4 is in the logs alone
    assert all(restore in checkpoints(folders[r], r).steps() for r in range(3))
    kept = [
        shutil.copytree(checkpoints(folders[r], r).dir_of(restore), str(tmp_path / f"kept.{r}"))
        for r in range(3)
    ]
    out = str(tmp_path / "out")
    os.makedirs(out)
    run_group(
        store,
        "two",
        [
            {**common, "replica": r, "members": [0, 2], "run_dir": folders[r], "incarnation": 1}
            | {"first": before, "last": after, "out": os.path.join(out, f"left.{r}.pt")}
            for r in (0, 2)
        ],
    )
    run_group(
        store,
        "reference",
        [
            {**common, "replicas": 2, "replica": r, "members": []}
            | {"run_dir": str(tmp_path / f"reference.{r}"), "incarnation": 0, "kept": kept}
            | {"first": restore, "last": after, "out": os.path.join(out, f"reference.{r}.pt")}
            for r in (0, 1)
        ],
    )
    for rank, replica in enumerate((0, 2)):
        left = torch.load(os.path.join(out, f"left.{replica}.pt"))
        expected = torch.load(os.path.join(out, f"reference.{rank}.pt"))
        assert left["status"] == [restore, before - restore]
        for name, value in expected["weights"].items():
            assert torch.equal(value, left["weights"][name]), (replica, name)
