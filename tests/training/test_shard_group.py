"""A sharded (FSDP) learner group that goes on at a smaller size: 2 ranks on two node folders
train, then rank 0 alone (``members: [0]``, as after node 1's loss) loads the newest checkpoint
both ranks hold complete, resharded, replays its write-ahead log after it, and trains on, with
the parameters of a 1-rank learner fed the same batches from that checkpoint, bit for bit."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from typing import Any

import msgspec
import pytest
import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported from C10d

from asyncrl.manifest.membership import REJOIN_FILE, Rejoin
from asyncrl.role import RoleContext
from asyncrl.roles.training.checkpoints import CheckpointDir, CheckpointError
from asyncrl.roles.training.data_parallel import PREFIX_ENV, STORE_ENV
from asyncrl.roles.training.journal import Journal
from asyncrl.roles.training.learner import Learner
from asyncrl.roles.training.rejoin import take_lead_state
from asyncrl.roles.training.shard_group import GROUP_KEY, WRITTEN_IN, ShardGroup
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_sharded_rank_grows_back_to_two_from_the_lead_s_checkpoint(tmp_path: Any) -> None:
    """Two FSDP ranks on nodes 0 and 1 train 4 steps (a checkpoint at 3); node 1 lost: replica
    0 alone trains to step 8 (whole checkpoints at 4 and 7). Node 1 back, the group grows to
    two again: replica 1, told to rejoin from replica 0, takes its state, and both ranks load
    the lead's step 7 (one whole state) resharded to two, replay step 8 and train on,
    with the shards of a group of 2 given that state and fed the same batches, bit for bit;
    replica 1's own step 3 from before the loss is not what it restores."""
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    root = str(tmp_path / "run")
    folders = [root, os.path.join(root, "node-1")]
    common = {"config": CONFIG, "replicas": 2, "kept": [], "out": ""}
    before, alone, after = 4, 8, 10
    run_group(
        store,
        "two",
        [
            {**common, "replica": r, "members": [], "run_dir": folders[r], "incarnation": 0}
            | {"first": 0, "last": before}
            for r in range(2)
        ],
    )
    run_group(
        store,
        "one",
        [
            {**common, "replica": 0, "members": [0], "run_dir": root, "incarnation": 1}
            | {"first": before, "last": alone}
        ],
    )
    lead, stale = checkpoints(folders[0], 0), checkpoints(folders[1], 1)
    restore = 7  # every 3 steps from the replayed state's checkpoint at 4
    assert (lead.steps(), stale.steps()) == ([3, 4, restore], [3])
    kept = [shutil.copytree(lead.dir_of(restore), str(tmp_path / "kept.0"))]
    with open(os.path.join(folders[1], "roles", "learner.1", REJOIN_FILE), "wb") as f:
        f.write(msgspec.json.encode(Rejoin(lead=0, folder=root)))
    out = str(tmp_path / "out")
    os.makedirs(out)
    run_group(
        store,
        "grown",
        [
            {**common, "replica": r, "members": [], "run_dir": folders[r], "incarnation": 2}
            | {"first": alone, "last": after, "out": os.path.join(out, f"grown.{r}.pt")}
            for r in range(2)
        ],
    )
    run_group(
        store,
        "reference",
        [
            {**common, "replica": r, "members": []}
            | {"run_dir": str(tmp_path / f"reference.{r}"), "incarnation": 0, "kept": kept}
            | {"first": restore, "last": after, "out": os.path.join(out, f"reference.{r}.pt")}
            for r in range(2)
        ],
    )
    for rank in range(2):
        grown = torch.load(os.path.join(out, f"grown.{rank}.pt"))
        expected = torch.load(os.path.join(out, f"reference.{rank}.pt"))
        assert grown["status"] == [restore, alone - restore]
        for name, value in expected["weights"].items():
            assert torch.equal(value, grown["weights"][name]), (rank, name)
    assert not os.path.exists(os.path.join(folders[1], "roles", "learner.1", REJOIN_FILE))


# -- restoring across the writers' folders, without processes ----------------------------------


class ThreadRanks:
    """The collectives a restore uses, for ranks that are threads of one process."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list[Any] = [None] * world

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait(timeout=60)
        out = list(self.slots)
        self.barrier.wait(timeout=60)
        return out


class ThreadRank:
    """One rank of ``ThreadRanks``, as the restore sees a ``DataParallel``."""

    def __init__(self, ranks: ThreadRanks, rank: int) -> None:
        self.ranks, self.rank, self.world, self.name = ranks, rank, ranks.world, "learner"

    def all_gather_ints(self, what: str, values: list[int]) -> list[list[int]]:
        return list(self.ranks.exchange(self.rank, list(values)))

    def min_int(self, what: str, value: int) -> int:
        return min(v[0] for v in self.all_gather_ints(what, [value]))

    def broadcast_bytes(self, what: str, data: bytes = b"", src: int = 0) -> bytes:
        return bytes(self.ranks.exchange(self.rank, data)[src])


def folder_of(run_dir: str, node: int, replica: int) -> str:
    base = run_dir if node == 0 else os.path.join(run_dir, f"node-{node}")
    return os.path.join(base, "roles", f"learner.{replica}", "checkpoints")


def write_group(
    writers: list[str], steps: list[int], into: list[str], recorded: list[str] | None = None
) -> None:
    """Checkpoints of ``steps`` in the folders ``into``, each naming the group's ``writers``'
    folders relative to its own (or ``recorded``, as given), as a sharded group writes them."""
    for folder in into:
        group = recorded or [os.path.relpath(f, folder) for f in writers]
        for step in steps:
            CheckpointDir(folder, 5, FaultPlan.from_env(0)).save(
                step, {"w": torch.full((2,), float(step)), "world": len(writers), GROUP_KEY: group}
            )


def journal(
    folder: str, folders: list[str], dp: Any = None, warned: list[str] | None = None
) -> tuple[Journal, ShardGroup]:
    """A rank's journal of its checkpoints in ``folder`` (no log) and its group now."""
    warn = (lambda _: None) if warned is None else warned.append
    checkpoints = CheckpointDir(folder, 5, FaultPlan.from_env(0), warn=warn)
    name = f"learner.{folder.split('learner.')[-1].split(os.sep)[0]}"
    group = ShardGroup(name, checkpoints, folders)
    log = logging.getLogger("test_shard_group")
    wal = os.path.join(os.path.dirname(folder), "wal")
    return Journal(name, checkpoints, None, wal, "off", 0, 0, dp, log), group


def restore_ranks(journals: list[tuple[Journal, ShardGroup]]) -> list[Any]:
    """Each rank's ``restore_point`` (a thread each), or the exception it raised."""

    def one(pair: tuple[Journal, ShardGroup]) -> Any:
        try:
            return pair[0].restore_point(pair[1])
        except Exception as e:  # the test compares what each rank raised
            return e

    with concurrent.futures.ThreadPoolExecutor(len(journals)) as pool:
        return list(pool.map(one, journals))


def test_ranks_that_can_load_none_of_their_checkpoints_refuse_and_remove_none(
    tmp_path: Any,
) -> None:
    """Three ranks wrote steps 3 and 6; node 1's folder is there but empty. Replicas 0 and 2
    go on as a group of 2: neither step is complete in every writer's folder, so both refuse,
    naming the steps and the folder that lacks them, and keep every checkpoint."""
    run_dir = str(tmp_path / "run")
    writers = [folder_of(run_dir, r, r) for r in range(3)]
    write_group(writers, [3, 6], [writers[0], writers[2]])
    os.makedirs(writers[1])
    ranks = ThreadRanks(2)
    now = [writers[0], writers[2]]
    got = restore_ranks([journal(now[i], now, ThreadRank(ranks, i)) for i in range(2)])
    for replica, error in zip((0, 2), got, strict=True):
        assert isinstance(error, CheckpointError), error
        assert str(error) == (
            f"learner.{replica}: none of the checkpoints in {writers[replica]} can be loaded: "
            f"each was written by a sharded group, and step 6 is not complete in {writers[1]}; "
            f"step 3 is not complete in {writers[1]}. Nothing was removed: starting from the "
            f"initial weights would throw away the training they hold. Put those folders back "
            f"as they were written (the run directory on storage every node shares, "
            f"run.shared_storage: true), or start a new run from the newest export"
        )
        assert CheckpointDir(writers[replica], 5, FaultPlan.from_env(0)).steps() == [3, 6]


def test_a_rank_alone_that_can_load_none_of_its_checkpoints_refuses_and_removes_none(
    tmp_path: Any,
) -> None:
    """Two ranks wrote steps 3 and 6; node 1's folder holds only step 3's checkpoint half
    written. Replica 0 alone refuses (it would have started from the initial weights) and
    keeps its checkpoints."""
    run_dir = str(tmp_path / "run")
    writers = [folder_of(run_dir, r, r) for r in range(2)]
    write_group(writers, [3, 6], writers)
    shutil.rmtree(os.path.join(writers[1], "step-00000006"))
    os.remove(os.path.join(writers[1], "step-00000003", "COMPLETE"))
    alone, group = journal(writers[0], [writers[0]])
    with pytest.raises(CheckpointError) as refused:
        alone.restore_point(group)
    assert str(refused.value) == (
        f"learner.0: none of the checkpoints in {writers[0]} can be loaded: each was written "
        f"by a sharded group, and step 6 is not complete in {writers[1]}; step 3 is not "
        f"complete in {writers[1]}. Nothing was removed: starting from the initial weights "
        f"would throw away the training they hold. Put those folders back as they were "
        f"written (the run directory on storage every node shares, run.shared_storage: true), "
        f"or start a new run from the newest export"
    )
    assert alone.checkpoints.steps() == [3, 6]


def test_a_checkpoint_whose_values_do_not_read_is_skipped_for_the_one_before(
    tmp_path: Any,
) -> None:
    """A 1-rank learner's newest checkpoint has its values file damaged (its size as marked):
    the restore warns and takes the one before, as it does an incomplete one."""
    folder = folder_of(str(tmp_path / "run"), 0, 0)
    for step in (3, 6):
        CheckpointDir(folder, 5, FaultPlan.from_env(0)).save(step, {"w": torch.zeros(2)})
    values = os.path.join(folder, "step-00000006", "values.msgpack")
    with open(values, "r+b") as f:
        f.write(b"\xc1" * os.path.getsize(values))  # 0xc1: never a msgpack byte
    warned: list[str] = []
    alone, group = journal(folder, [folder], warned=warned)
    assert alone.restore_point(group) == os.path.join(folder, "step-00000003")
    assert alone.checkpoints.steps() == [3]
    assert warned == [
        f"checkpoint {os.path.join(folder, 'step-00000006')} skipped: its values do not read "
        f"(MessagePack data is malformed: invalid opcode '\\xc1' (byte 0))"
    ]


def test_a_writers_folder_outside_the_run_directory_or_through_a_link_is_refused(
    tmp_path: Any,
) -> None:
    """A checkpoint whose recorded group names a folder outside the run directory's ranks'
    checkpoint folders, or one reached through a link, is refused, though that folder holds
    the step complete."""
    run_dir = str(tmp_path / "run")
    writers = [folder_of(run_dir, r, r) for r in range(2)]
    outside = os.path.join(str(tmp_path / "elsewhere"), "roles", "learner.1", "checkpoints")
    write_group([writers[0], outside], [3], [writers[0], outside])
    alone, group = journal(writers[0], [writers[0]])
    with pytest.raises(CheckpointError) as refused:
        alone.restore_point(group)
    assert str(refused.value) == (
        f"learner.0: the checkpoint of step 3 in {writers[0]} names {outside} as rank 1's "
        f"folder of it, which is not a rank's checkpoint folder of this run directory "
        f"({run_dir}/[node-R/]roles/learner.R/checkpoints): this rank reads no other folder. "
        f"Remove that checkpoint, or start a new run"
    )

    # The folder where it belongs, but node 1's folder a link to the one outside.
    shutil.rmtree(writers[0])
    write_group(writers, [3], [writers[0]])
    os.symlink(str(tmp_path / "elsewhere"), os.path.join(run_dir, "node-1"))
    alone, group = journal(writers[0], [writers[0]])
    with pytest.raises(CheckpointError) as refused:
        alone.restore_point(group)
    link = os.path.join(run_dir, "node-1")
    assert str(refused.value) == (
        f"learner.0: the checkpoint of step 3 in {writers[0]} names {writers[1]} as rank 1's "
        f"folder of it, reached through a link or a folder of another user ({link} is a link; "
        f"a run writes only into folders of its own, never through a link: remove it, or give "
        f"another path): this rank reads the ranks' shards only from the run directory's own "
        f"folders"
    )
    assert alone.checkpoints.steps() == [3]


def test_ranks_that_see_the_run_directory_at_other_paths_find_each_others_folders(
    tmp_path: Any,
) -> None:
    """Node 0 mounts the shared run directory at ``run``, node 1 at ``mount``: each rank finds
    the other's folder under its own path of it, and records the group's folders relative to
    its own."""
    run_dir, mount = str(tmp_path / "run"), str(tmp_path / "mount")
    os.makedirs(run_dir)
    os.symlink(run_dir, mount)
    folders = [folder_of(run_dir, 0, 0), folder_of(mount, 1, 1)]
    ranks = ThreadRanks(2)

    def gather(rank: int) -> ShardGroup:
        checkpoints = CheckpointDir(folders[rank], 5, FaultPlan.from_env(0))
        dp: Any = ThreadRank(ranks, rank)
        return ShardGroup.gather(f"learner.{rank}", checkpoints, dp)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        groups = list(pool.map(gather, (0, 1)))
    assert groups[0].folders == [folders[0], folder_of(run_dir, 1, 1)]
    assert groups[1].folders == [folder_of(mount, 0, 0), folders[1]]
    assert groups[0].relative() == [".", "../../../node-1/roles/learner.1/checkpoints"]
    assert groups[1].relative() == ["../../../../roles/learner.0/checkpoints", "."]


def test_a_returning_sharded_rank_restores_the_lead_s_checkpoint_not_its_own_stale_ones(
    tmp_path: Any,
) -> None:
    """Two sharded ranks wrote steps 3 and 6 (weights all ``step``, each rank its shard); node
    1 was lost with step 6 torn on node 1, so replica 0 went back to step 3 alone and wrote
    steps 6 and 9 whole (weights ``100 + step``, no group). Node 1's stale step 6 is then made
    complete again, as a node that finished it after node 0 took it as lost would. As the group
    grows back, replica 1 takes the lead's state: its own stale step 6 is gone, step 3 (the
    group's, which the lead still holds) stays its own shard, and the lead's 6 and 9 are
    linked, each naming the folder it was written in. Both ranks then agree on step 9 and load
    it from the lead's folder alone (a whole state, to be resharded), not from replica 1's."""
    run_dir = str(tmp_path / "run")
    writers = [folder_of(run_dir, r, r) for r in range(2)]
    write_group(writers, [3, 6], writers)
    lead, stale = (CheckpointDir(w, 5, FaultPlan.from_env(0)) for w in writers)
    lead.drop_after(3)
    for step in (6, 9):
        lead.save(step, {"w": torch.full((4,), 100.0 + step)})
    back = RoleContext(
        name="learner",
        replica=1,
        run_dir=os.path.join(run_dir, "node-1"),
        replicas=2,
        log=logging.getLogger("test_shard_group"),
    )
    with open(back.path(REJOIN_FILE), "wb") as f:
        f.write(msgspec.json.encode(Rejoin(lead=0, folder=run_dir)))
    assert stale.steps() == [3, 6]

    assert take_lead_state(back, sharded=True) is True
    assert stale.steps() == [3, 6, 9]
    assert not os.path.exists(os.path.join(stale.dir_of(3), WRITTEN_IN))  # its own shard
    for step in (6, 9):
        with open(os.path.join(stale.dir_of(step), WRITTEN_IN)) as f:
            assert f.read() == "../../../../roles/learner.0/checkpoints"
        assert not os.path.exists(os.path.join(lead.dir_of(step), WRITTEN_IN))
        assert torch.equal(
            CheckpointDir.load(stale.dir_of(step))["w"], torch.full((4,), 100.0 + step)
        )

    ranks = ThreadRanks(2)
    pairs = [journal(writers[r], writers, ThreadRank(ranks, r)) for r in range(2)]
    assert restore_ranks(pairs) == [lead.dir_of(9), stale.dir_of(9)]
    for (_, group), path in zip(pairs, (lead.dir_of(9), stale.dir_of(9)), strict=True):
        assert group.writers(9) == [writers[0]]
        states = group.states(path, CheckpointDir.load(path))
        assert states is not None and len(states) == 1
        assert torch.equal(states[0]["w"], torch.full((4,), 109.0))
        assert states[0].get("world") is None
    # Step 3, which both ranks wrote, is each rank's own shard of the group that wrote it.
    assert [g.writers(3) for _, g in pairs] == [None, None]
