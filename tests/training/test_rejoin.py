"""A rank that rejoins its group as the group grows back takes the lead's state first
(``asyncrl.roles.training.rejoin``), over folders written in place: no process started."""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec
import pytest
import torch

from asyncrl.manifest.membership import REJOIN_FILE, Rejoin
from asyncrl.role import RoleContext
from asyncrl.roles.training.checkpoints import CheckpointDir, CheckpointError, StepLog
from asyncrl.roles.training.journal import wal_path
from asyncrl.roles.training.rejoin import take_lead_state
from asyncrl.roles.training.wal import StepEntry, WriteAheadLog
from asyncrl.supervision.faults import FaultPlan


def _rank(run_dir: str, replica: int) -> RoleContext:
    return RoleContext(
        name="learner",
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


def test_a_rejoining_rank_takes_the_lead_s_checkpoints_log_and_ledger(tmp_path: Any) -> None:
    """Replica 1 on node 1 holds its state from before its node's loss (steps 4 and 8, logged
    to 9); replica 0 on node 0 trained on alone (steps 12 and 16, logged to 18). Told to rejoin
    from replica 0, replica 1 then holds replica 0's complete checkpoints (the torn one left
    out), its log and its ledger, and the file is gone: a second start copies nothing."""
    run_dir = str(tmp_path)
    lead = _rank(run_dir, 0)
    back = _rank(os.path.join(run_dir, "node-1"), 1)
    _write(lead, [12, 16], list(range(13, 19)), 100.0)
    _write(back, [4, 8], [9], 0.0)
    assert take_lead_state(back) is False  # no rejoin file: its own state stays
    marker = back.path(REJOIN_FILE)
    with open(marker, "wb") as f:
        f.write(msgspec.json.encode(Rejoin(lead=0, folder=run_dir)))
    assert take_lead_state(back) is True
    assert not os.path.exists(marker)
    mine = CheckpointDir(back.path("checkpoints"), 5, FaultPlan.from_env(0))
    assert mine.steps() == [12, 16]
    assert sorted(os.listdir(back.path("checkpoints"))) == ["step-00000012", "step-00000016"]
    assert torch.equal(CheckpointDir.load(mine.dir_of(16))["w"], torch.full((3,), 116.0))
    log = WriteAheadLog(wal_path(back.run_dir, "learner", 1), lambda _: None)
    assert [e.step for e in log.entries()] == list(range(13, 19))
    with open(os.path.join(back.run_dir, "ledger", "learner.1.steps.jsonl")) as f:
        copied = f.read()
    with open(os.path.join(run_dir, "ledger", "learner.0.steps.jsonl")) as f:
        assert copied == f.read() != ""
    assert take_lead_state(back) is False


def test_a_rejoining_rank_without_the_lead_s_folder_says_shared_storage_is_needed(
    tmp_path: Any,
) -> None:
    back = _rank(os.path.join(str(tmp_path), "node-1"), 1)
    _write(back, [4], [5], 0.0)
    elsewhere = os.path.join(str(tmp_path), "not-shared")
    with open(back.path(REJOIN_FILE), "wb") as f:
        f.write(msgspec.json.encode(Rejoin(lead=0, folder=elsewhere)))
    with pytest.raises(CheckpointError) as raised:
        take_lead_state(back)
    assert str(raised.value) == (
        f"learner.1: rejoining its group, it takes the state of learner.0, its lead, but "
        f"{elsewhere}/roles/learner.0/checkpoints is not there: the run directory must be on "
        f"storage every node shares (run.shared_storage: true)"
    )
    assert os.path.exists(back.path(REJOIN_FILE))  # kept: the next start tries again
    assert CheckpointDir(back.path("checkpoints"), 5, FaultPlan.from_env(0)).steps() == [4]
