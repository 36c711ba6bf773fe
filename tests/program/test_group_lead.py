"""The built-in clients call a learner's or a critic's group at its lead (``to_lead``): replica
0, or the lowest replica left once a node's loss took replica 0 out of the run."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from asyncrl.errors import BrokenError, RemoteError, RoleDeadError, StallError
from asyncrl.roles.payloads import LearnerStatus, StepResult, TrainBatch
from asyncrl.roles.program.clients import LearnerClient, lead, to_lead
from asyncrl.roles.training.lead_refusal import NotLeaderError, refused_as_follower
from asyncrl.transport import ChannelOptions, Client, Server


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


REFUSAL = (
    "learner.1: a learner with 2 replicas runs every call on all of them in the order replica "
    "0 sets; send train_step to replica 0"
)


@dataclass
class OldFollower:
    """Replica 1's process before its node's agent restarts it as the group's lead: a real
    server that refuses the first ``refusals`` steps as a follower does (``NotLeaderError``),
    then answers them as the new lead."""

    refusals: int
    answered: int = 0

    def train_step(self, batch: TrainBatch, call: Any) -> StepResult:
        if self.refusals:
            self.refusals -= 1
            raise NotLeaderError(REFUSAL)
        self.answered += 1
        return StepResult(version=8, step=8, consumed=1, skipped=0, metrics={})


@dataclass
class MovedLead:
    """A learner handle whose replica 0 leaves the run with its node (``fail``, as ``Group``)
    and whose replica 1 is ``OldFollower``'s server, reached over the transport."""

    client: Client
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
        return await self.client.call(method, payload, reply_type, timeout=kw["timeout"])


async def _with_old_follower(run_dir: str, follower: OldFollower, body: Any) -> Any:
    server = Server(f"ipc://{run_dir}/learner1", options=ChannelOptions(run="t"))
    server.add("train_step", follower.train_step, TrainBatch)
    await server.start()
    try:
        async with Client(server.endpoint, options=ChannelOptions(run="t")) as client:
            return await body(client)
    finally:
        await server.close()


def test_the_new_leads_old_process_refuses_the_call_as_a_follower_and_it_goes_again(
    run_dir: str,
) -> None:
    """The lead moved to replica 1, whose old process (a follower) refuses the call until its
    node's agent restarts it as the lead: the refusal crosses the wire as ``NotLeaderError``,
    and the call goes to replica 1 again until it answers (a step with an id that broke in
    flight on the lost lead, and one without an id that never reached it: a refusal ran
    nothing, so either may go again)."""
    follower = OldFollower(refusals=3)

    async def step_with_id(client: Client) -> tuple[StepResult, MovedLead]:
        group = MovedLead(client, fail=BrokenError)
        step = await LearnerClient(cast(Any, group)).train_step(TrainBatch(samples=[], id="b7"))
        return step, group

    step, group = asyncio.run(_with_old_follower(run_dir, follower, step_with_id))
    assert step.step == 8
    assert group.sent == [("train_step", 0)] + [("train_step", 1)] * 4
    assert (follower.refusals, follower.answered) == (0, 1)

    follower = OldFollower(refusals=2)

    async def step_without_id(client: Client) -> tuple[StepResult, MovedLead]:
        group = MovedLead(client)
        return await LearnerClient(cast(Any, group)).train_step(TrainBatch(samples=[])), group

    step, group = asyncio.run(_with_old_follower(run_dir, follower, step_without_id))
    assert step.step == 8
    assert group.sent == [("train_step", 0)] + [("train_step", 1)] * 3


def test_a_lead_that_refuses_past_the_bound_fails_the_call_saying_so(run_dir: str) -> None:
    follower = OldFollower(refusals=1000)

    async def body(client: Client) -> None:
        group = MovedLead(client)
        await to_lead(
            cast(Any, group), "train_step", TrainBatch(samples=[]), StepResult, lead_wait_s=0.5
        )

    with pytest.raises(StallError) as caught:
        asyncio.run(_with_old_follower(run_dir, follower, body))
    assert caught.match(
        r"^learner\[1\], the lead of learner's group \(its replicas left: \[1\]\), still "
        r"refused train_step as not the group's lead for 0\.[0-9] s: its process is the "
        r"follower it was before the lead moved, and its node's agent restarts it as the lead "
        r"when it reads the node's membership.json; is that agent running\?$"
    )
    cause = caught.value.__cause__
    assert isinstance(cause, RemoteError) and refused_as_follower(cause)
    assert cause.remote_type == "NotLeaderError" and REFUSAL in str(cause)
    # Other errors of the call are not a refusal: they fail it as before.
    assert not refused_as_follower(RemoteError("handler_error", "x", remote_type="ValueError"))
