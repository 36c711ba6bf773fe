"""A rank that rejoins its group as the group grows back takes the lead's state first
(``asyncrl.roles.training.rejoin``), over folders written in place: no process started."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import torch

from asyncrl.manifest.membership import REJOIN_FILE, Rejoin
from asyncrl.role import RoleContext
from asyncrl.roles.training.checkpoints import (
    CheckpointDir,
    CheckpointError,
    StepLog,
    rng_bytes,
    rng_state,
)
from asyncrl.roles.training.durability import Durability
from asyncrl.roles.training.journal import wal_path
from asyncrl.roles.training.rejoin import take_lead_state
from asyncrl.roles.training.wal import StepEntry, WriteAheadLog
from asyncrl.supervision.faults import FaultPlan


def _rank(run_dir: str, replica: int, name: str = "learner") -> RoleContext:
    return RoleContext(
        name=name,
        replica=replica,
        run_dir=run_dir,
        replicas=2,
        log=logging.getLogger("test"),
    )


def _write(ctx: RoleContext, steps: list[int], logged: list[int], value: float) -> None:
    """Checkpoints of ``steps`` (weights all ``value`` + step), a torn one after them, a
    write-ahead log of ``logged`` and a step ledger of every step."""
    checkpoints = CheckpointDir(ctx.path("checkpoints"), 5, FaultPlan.from_env(0))
    for step in steps:
        checkpoints.save(step, {"w": torch.full((3,), value + step), "step": step})
    os.makedirs(checkpoints.dir_of(max(steps) + 4))  # a save that never finished
    log = WriteAheadLog(wal_path(ctx.run_dir, ctx.name, ctx.replica), lambda _: None)
    for step in logged:
        log.append(StepEntry(step, msgspec.msgpack.encode({"batch": step})))
    log.close()
    ledger = StepLog(os.path.join(ctx.run_dir, "ledger", f"learner.{ctx.replica}.steps.jsonl"))
    for step in range(1, max(logged) + 1):
        ledger.append({"step": step, "ids": [[f"p{step}", 0]]})


def _lead_and_back(
    tmp_path: Any,
    name: str = "learner",
    write: Callable[[RoleContext, list[int], list[int], float], None] = _write,
) -> tuple[str, RoleContext, RoleContext]:
    """The run directory ``tmp_path``, replica 0 of ``name`` (the group's lead) on node 0 and
    replica 1 on node 1, their state written by ``write``: replica 1's from before its node's
    loss (steps 4 and 8, logged to 9, weights 0 + step), replica 0's as it trained on alone
    (steps 12 and 16, logged to 18, weights 100 + step)."""
    run_dir = str(tmp_path)
    lead = _rank(run_dir, 0, name)
    back = _rank(os.path.join(run_dir, "node-1"), 1, name)
    write(lead, [12, 16], list(range(13, 19)), 100.0)
    write(back, [4, 8], [9], 0.0)
    return run_dir, lead, back


def _tell(back: RoleContext, folder: str) -> None:
    """Tell ``back`` to rejoin its group from replica 0's state in the run directory
    ``folder`` (``rejoin.json``), as node 0 does."""
    with open(back.path(REJOIN_FILE), "wb") as f:
        f.write(msgspec.json.encode(Rejoin(lead=0, folder=folder)))


def _holds_the_lead_s_log_and_ledger(run_dir: str, back: RoleContext) -> None:
    """``back`` (replica 1) holds replica 0's write-ahead log (steps 13 to 18, as
    ``_lead_and_back`` wrote it) and a copy of its step ledger, under ``run_dir``."""
    log = WriteAheadLog(wal_path(back.run_dir, "learner", 1), lambda _: None)
    assert [e.step for e in log.entries()] == list(range(13, 19))
    with open(os.path.join(back.run_dir, "ledger", "learner.1.steps.jsonl")) as f:
        copied = f.read()
    with open(os.path.join(run_dir, "ledger", "learner.0.steps.jsonl")) as f:
        assert copied == f.read() != ""


def test_a_rejoining_rank_takes_the_lead_s_checkpoints_log_and_ledger(tmp_path: Any) -> None:
    """Replica 1 on node 1 holds its state from before its node's loss (steps 4 and 8, logged
    to 9); replica 0 on node 0 trained on alone (steps 12 and 16, logged to 18). Told to rejoin
    from replica 0, replica 1 then holds replica 0's complete checkpoints (the torn one left
    out), its log and its ledger, and the file is gone: a second start copies nothing."""
    run_dir, _, back = _lead_and_back(tmp_path)
    assert take_lead_state(back) is False  # no rejoin file: its own state stays
    marker = back.path(REJOIN_FILE)
    _tell(back, run_dir)
    assert take_lead_state(back) is True
    assert not os.path.exists(marker)
    mine = CheckpointDir(back.path("checkpoints"), 5, FaultPlan.from_env(0))
    assert mine.steps() == [12, 16]
    assert sorted(os.listdir(back.path("checkpoints"))) == ["step-00000012", "step-00000016"]
    assert torch.equal(CheckpointDir.load(mine.dir_of(16))["w"], torch.full((3,), 116.0))
    _holds_the_lead_s_log_and_ledger(run_dir, back)
    assert take_lead_state(back) is False


def _files(folder: str) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(where, name), folder)
        for where, _, names in os.walk(folder)
        for name in names
    )


def test_a_rejoining_rank_s_checkpoints_are_hard_links_of_the_lead_s(tmp_path: Any) -> None:
    """On one filesystem the rank's checkpoints are the lead's files, linked (same inode): the
    take costs no copy of the state, whatever its size. A later save of the lead's unlinks its
    old checkpoints' files and never writes into them, so the rank's stay as they were."""
    run_dir, lead, back = _lead_and_back(tmp_path)
    _tell(back, run_dir)
    assert take_lead_state(back) is True
    for step in (12, 16):
        name = f"step-{step:08d}"
        theirs = os.path.join(lead.path("checkpoints"), name)
        mine = os.path.join(back.path("checkpoints"), name)
        assert _files(mine) == _files(theirs) != []
        for file in _files(theirs):
            assert (
                os.stat(os.path.join(mine, file)).st_ino
                == os.stat(os.path.join(theirs, file)).st_ino
            )
    checkpoints = CheckpointDir(lead.path("checkpoints"), 1, FaultPlan.from_env(0))
    checkpoints.save(20, {"w": torch.full((3,), 120.0), "step": 20})  # prunes 12 and 16
    assert checkpoints.steps() == [20]
    mine16 = os.path.join(back.path("checkpoints"), "step-00000016")
    assert torch.equal(CheckpointDir.load(mine16)["w"], torch.full((3,), 116.0))


@pytest.mark.parametrize("error", [errno.EXDEV, errno.ENOSYS])
def test_across_filesystems_a_rejoining_rank_copies_every_complete_checkpoint(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    """Where no hard link can be made (``EXDEV``: the rank's folder on another filesystem;
    ``ENOSYS``: a filesystem without the operation),
    the rank copies every complete checkpoint of the lead's: the group resumes from the oldest
    of its ranks' newest, and another rank left may be one behind the lead."""
    run_dir, lead, back = _lead_and_back(tmp_path)
    _tell(back, run_dir)

    def no_link(src: str, dst: str) -> None:
        raise OSError(error, os.strerror(error), src)

    monkeypatch.setattr(os, "link", no_link)
    assert take_lead_state(back) is True
    assert sorted(os.listdir(back.path("checkpoints"))) == ["step-00000012", "step-00000016"]
    mine = os.path.join(back.path("checkpoints"), "step-00000016")
    theirs = os.path.join(lead.path("checkpoints"), "step-00000016")
    assert _files(mine) == _files(theirs)
    assert (
        os.stat(os.path.join(mine, "COMPLETE")).st_ino
        != os.stat(os.path.join(theirs, "COMPLETE")).st_ino
    )
    assert torch.equal(CheckpointDir.load(mine)["w"], torch.full((3,), 116.0))


def test_a_take_cut_off_midway_is_taken_again_whole_at_the_next_start(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that fails (or dies) while it takes the lead's state keeps its own checkpoints
    and the rejoin file, with a half-built ``checkpoints.rejoin`` left behind; its next start
    takes the lead's state whole and leaves no ``.rejoin`` folder."""
    run_dir, _, back = _lead_and_back(tmp_path)
    _tell(back, run_dir)
    link = os.link
    made: list[str] = []

    def disk_full_after_two(src: str, dst: str) -> None:
        if len(made) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", dst)
        link(src, dst)
        made.append(dst)

    monkeypatch.setattr(os, "link", disk_full_after_two)
    with pytest.raises(OSError, match="No space left on device"):
        take_lead_state(back)
    assert os.path.exists(back.path(REJOIN_FILE))
    assert os.path.isdir(back.path("checkpoints.rejoin"))  # what the cut-off take left
    assert CheckpointDir(back.path("checkpoints"), 5, FaultPlan.from_env(0)).steps() == [4, 8]
    monkeypatch.setattr(os, "link", link)
    assert take_lead_state(back) is True
    assert not os.path.exists(back.path(REJOIN_FILE))
    assert sorted(os.listdir(back.path())) == ["checkpoints"]
    assert CheckpointDir(back.path("checkpoints"), 5, FaultPlan.from_env(0)).steps() == [12, 16]
    log = WriteAheadLog(wal_path(back.run_dir, "learner", 1), lambda _: None)
    assert [e.step for e in log.entries()] == list(range(13, 19))


def _write_critic(ctx: RoleContext, steps: list[int], logged: list[int], value: float) -> None:
    """A critic's state as its Durability writes it (no ledger): checkpoints of ``steps``
    (weights ``value`` + step) and a write-ahead log of ``logged``."""
    checkpoints = CheckpointDir(ctx.path("checkpoints"), 5, FaultPlan.from_env(0))
    for step in steps:
        state = {"w": torch.full((3,), value + step), "step": step}
        checkpoints.save(step, {**state, "last": "{}", "rng": rng_state()})
    log = WriteAheadLog(wal_path(ctx.run_dir, ctx.name, ctx.replica), lambda _: None)
    for step in logged:
        log.append(StepEntry(step, msgspec.msgpack.encode({"step": step}), rng=rng_bytes()))
    log.close()


def _restore(ctx: RoleContext) -> tuple[list[float], int, list[int]]:
    """What a critic's Durability restores from ``ctx``'s folder: the loaded weights, their
    step and the steps it replays."""
    durability = Durability(
        ctx, durable="wal", every=0, every_s=0, keep=5, dp=None, pin=lambda t: t, step_log=False
    )
    loaded: list[float] = []
    replayed: list[int] = []

    def load(saved: dict[str, Any], states: Any) -> int:
        loaded.extend(saved["w"].tolist())
        return int(saved["step"])

    def replay(batch: bytes) -> int:
        step = int(msgspec.msgpack.decode(batch)["step"])
        replayed.append(step)
        return step

    durability.restore(load=load, replay=replay, state=lambda: {"w": torch.zeros(3)})
    durability.close()
    return loaded, durability.restored_step, replayed


def test_a_rejoining_critic_rank_restores_what_its_lead_restores(tmp_path: Any) -> None:
    """The critic keeps no ledger (``step_log=False``): a returning critic rank takes the
    lead's checkpoints and log, holds no ledger after it (a stale one of its own is removed),
    and restores the lead's checkpoint and replays the lead's logged steps."""
    run_dir, lead, back = _lead_and_back(tmp_path, "critic", _write_critic)
    stale = os.path.join(back.run_dir, "ledger", "critic.1.steps.jsonl")
    os.makedirs(os.path.dirname(stale), exist_ok=True)
    with open(stale, "w") as f:
        f.write('{"step": 9, "ids": [["p9", 0]]}\n')
    _tell(back, run_dir)
    assert take_lead_state(back) is True
    assert not os.path.exists(stale)
    assert not os.path.exists(os.path.join(run_dir, "ledger", "critic.0.steps.jsonl"))
    expected = ([116.0, 116.0, 116.0], 16, [17, 18])
    assert _restore(back) == expected
    assert _restore(lead) == expected


def test_a_rejoining_rank_without_the_lead_s_folder_says_shared_storage_is_needed(
    tmp_path: Any,
) -> None:
    back = _rank(os.path.join(str(tmp_path), "node-1"), 1)
    _write(back, [4], [5], 0.0)
    elsewhere = os.path.join(str(tmp_path), "not-shared")
    _tell(back, elsewhere)
    with pytest.raises(CheckpointError) as raised:
        take_lead_state(back)
    assert str(raised.value) == (
        f"learner.1: rejoining its group, it takes the state of learner.0, its lead, but "
        f"{elsewhere}/roles/learner.0/checkpoints is not there: the run directory must be on "
        f"storage every node shares (run.shared_storage: true)"
    )
    assert os.path.exists(back.path(REJOIN_FILE))  # kept: the next start tries again
    assert CheckpointDir(back.path("checkpoints"), 5, FaultPlan.from_env(0)).steps() == [4]


GROUP_SCRIPT = """
import json, logging, os, sys
import msgspec
import asyncrl.roles.training.rejoin as rejoin
from asyncrl.manifest.membership import REJOIN_FILE, Rejoin
from asyncrl.roles.training.data_parallel import DataParallel
from tests.training.test_rejoin import _rank
rank, run_dir, out, shared = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "shared"
rejoin.CHUNK = 100  # many pieces a file
said = []
class Said(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("test").addHandler(Said())
logging.getLogger("test").setLevel(logging.INFO)
ctx = _rank(run_dir if rank == 0 else os.path.join(run_dir, "node-1"), rank)
dp = DataParallel.join(name="learner", rank=rank, world=2, run_dir=run_dir, generation=0,
                       timeout_s=30)
first = rejoin.rejoin_group(ctx, dp)  # nobody rejoins: one all-gather
if rank == 1:
    # Told to rejoin: from the lead's folder where the run directory is shared; else, with a
    # folder it cannot read, from the lead over the group.
    told = Rejoin(lead=0, folder=run_dir, shared=True) if shared else Rejoin(
        lead=0, folder="/nowhere", shared=False)
    with open(ctx.path(REJOIN_FILE), "wb") as f:
        f.write(msgspec.json.encode(told))
dp.barrier("the rejoin file written")
second = rejoin.rejoin_group(ctx, dp)
dp.check_same("the next collective", [7], ["seven"])  # the ranks' collectives still pair up
dp.close()
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump({"taken": [first, second], "said": said}, f)
"""


def _group_of_two(tmp_path: Any, run_dir: str, how: str) -> list[dict[str, Any]]:
    """Run ``GROUP_SCRIPT``'s two ranks (replica 1 told to rejoin ``how``: ``shared`` or
    ``group``); each one's report."""
    from tests.training.test_data_parallel import run_ranks

    out = str(tmp_path)
    return run_ranks(GROUP_SCRIPT, [run_dir, out, how], os.path.join(out, "rank{rank}.json"))


def test_without_shared_storage_the_lead_sends_its_state_over_the_group(tmp_path: Any) -> None:
    """Two ranks in two processes (gloo, a FileStore). Replica 1 back on node 1, its rejoin
    file saying the run directory is not shared (its ``folder`` unreadable), takes the lead's
    state as the lead sends it over the group, in pieces: the checkpoint the group resumes from
    (16, the newest the lead holds; the torn save left out), byte for byte, the lead's whole
    write-ahead log and its ledger; its own older state is gone, and so is the file. Before
    the file, neither rank takes anything."""
    run_dir, lead, back = _lead_and_back(tmp_path / "run")
    reports = _group_of_two(tmp_path, run_dir, "group")
    assert [r["taken"] for r in reports] == [[False, False], [False, True]]
    assert reports[0]["said"][-1].startswith(
        "learner.0: sent its state to replica(s) [1], rejoining the group: checkpoint 16, its "
        "write-ahead log and step ledger ("
    )
    assert reports[1]["said"][-1].startswith(
        "learner.1: rejoining its group, took the state of learner.0, its lead, over the "
        "group: checkpoints [16] ("
    )
    assert not os.path.exists(back.path(REJOIN_FILE))
    assert sorted(os.listdir(back.path())) == ["checkpoints"]
    assert sorted(os.listdir(back.path("checkpoints"))) == ["step-00000016"]
    theirs = os.path.join(lead.path("checkpoints"), "step-00000016")
    mine = os.path.join(back.path("checkpoints"), "step-00000016")
    assert _files(mine) == _files(theirs) != []
    for file in _files(theirs):
        with open(os.path.join(mine, file), "rb") as a, open(os.path.join(theirs, file), "rb") as b:
            assert a.read() == b.read()
    assert CheckpointDir(back.path("checkpoints"), 5, FaultPlan.from_env(0)).steps() == [16]
    _holds_the_lead_s_log_and_ledger(run_dir, back)


def test_a_rank_that_takes_the_lead_s_state_from_shared_storage_keeps_its_group_in_step(
    tmp_path: Any,
) -> None:
    """With the run directory shared, replica 1 reads the lead's state from its folder and
    still takes part in the group's all-gather of who rejoins, as the lead does: the ranks'
    next collective pairs up (a rank that skipped it set every later collective of the group
    one apart, and the group failed)."""
    run_dir, _, back = _lead_and_back(tmp_path / "run")
    reports = _group_of_two(tmp_path, run_dir, "shared")
    assert [r["taken"] for r in reports] == [[False, False], [False, True]]
    assert "checkpoints [12, 16] (linked)" in reports[1]["said"][-1]
    assert not os.path.exists(back.path(REJOIN_FILE))
