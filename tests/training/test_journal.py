"""What a trainer's journal makes durable before a step replies, by ``durable`` mode."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

from asyncrl.roles.training.checkpoints import CheckpointDir
from asyncrl.roles.training.journal import Journal
from asyncrl.supervision.faults import FaultPlan


class Log:
    """A step log that records whether each line was asked to be synced."""

    def __init__(self) -> None:
        self.synced: list[bool] = []

    def append(self, record: dict[str, Any], sync: bool = True) -> None:
        self.synced.append(sync)


@pytest.mark.parametrize(("mode", "synced"), [("off", False), ("wal", False), ("checkpoint", True)])
def test_the_step_log_is_synced_only_where_it_makes_the_step_durable(
    tmp_path: Any, mode: str, synced: bool
) -> None:
    """``checkpoint`` relies on the step log; ``wal`` has the step in its log; ``off`` promises
    nothing before the reply (its checkpoints sync the log before their marker)."""
    log = Log()
    checkpoints = CheckpointDir(os.path.join(tmp_path, "ck"), 2, FaultPlan.from_env(0))
    journal = Journal(
        "learner",
        checkpoints,
        log,  # type: ignore[arg-type]
        os.path.join(tmp_path, "wal"),
        mode,  # type: ignore[arg-type]
        100,
        600.0,
        None,
        logging.getLogger("test"),
    )
    try:
        journal.log_step(1, {"step": 1, "ids": []}, b"batch", {}, {})
    finally:
        journal.close()
    assert log.synced == [synced]
