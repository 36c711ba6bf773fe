"""The built-in clients call a learner's or a critic's group at its lead (``to_lead``): replica
0, or the lowest replica left once a node's loss took replica 0 out of the run."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from asyncrl.errors import BrokenError, RoleDeadError
from asyncrl.roles.payloads import LearnerStatus, StepResult, TrainBatch
from asyncrl.roles.program.clients import LearnerClient, lead


@dataclass
class Group:
    """A learner handle whose replica 0 leaves the run with its node as the first call to it
    fails (``fail`` says how): its members are then ``[1]``."""

    fail: type[Exception] = RoleDeadError
    name: str = "learner"
    members: list[int] = field(default_factory=lambda: [0, 1])
    sent: list[tuple[str, int | None]] = field(default_factory=list)

    async def call(self, method: str, payload: Any, reply_type: Any = Any, **kw: Any) -> Any:
        replica = kw.get("replica")
        self.sent.append((method, replica))
        if replica == 0:
            self.members = [1]
            if self.fail is RoleDeadError:
                raise RoleDeadError(self.name, "its node 1 was lost", 0)
            raise self.fail(f"{self.name}[0] left the run with its node with the call in flight")
        if method == "status":
            return LearnerStatus(version=7, step=7)
        return StepResult(version=8, step=8, consumed=1, skipped=0, metrics={})


def test_a_call_waiting_for_a_lead_that_left_goes_to_the_new_lead() -> None:
    """Queued for replica 0 when it left with its node (never sent): sent to replica 1."""
    group = Group()
    client = LearnerClient(cast(Any, group))
    assert lead(cast(Any, group)) == 0
    assert asyncio.run(client.train_step(TrainBatch(samples=[]))).step == 8
    assert group.sent == [("train_step", 0), ("train_step", 1)]
    assert lead(cast(Any, group)) == 1


def test_a_call_broken_in_flight_goes_to_the_new_lead_only_when_a_repeat_is_harmless() -> None:
    """A step with an id and a status go again to replica 1; a step without an id (the lost
    lead may have taken it) fails as it broke."""
    with_id = Group(fail=BrokenError)
    step = asyncio.run(
        LearnerClient(cast(Any, with_id)).train_step(TrainBatch(samples=[], id="b7"))
    )
    assert step.step == 8
    assert with_id.sent[-1] == ("train_step", 1)
    status = Group(fail=BrokenError)
    assert asyncio.run(LearnerClient(cast(Any, status)).status()).step == 7
    assert status.sent == [("status", 0), ("status", 1)]
    without_id = Group(fail=BrokenError)
    with pytest.raises(BrokenError, match=r"^learner\[0\] left the run with its node"):
        asyncio.run(LearnerClient(cast(Any, without_id)).train_step(TrainBatch(samples=[])))
    assert without_id.sent == [("train_step", 0)]


def test_a_group_with_no_replica_left_fails_the_call() -> None:
    group = Group()
    group.members = []

    async def gone(method: str, payload: Any, reply_type: Any = Any, **kw: Any) -> Any:
        group.sent.append((method, kw.get("replica")))
        raise RoleDeadError("learner", "its node 1 was lost", 0)

    group.call = gone  # type: ignore[method-assign]
    with pytest.raises(RoleDeadError, match=r"^role learner\[0\] is dead: its node 1 was lost"):
        asyncio.run(LearnerClient(cast(Any, group)).status())
    assert group.sent == [("status", 0)]
