"""A role's own status: the process wrapper's ``Tally`` of handler time, the ``_status`` answer,
and ``Role.status()`` (one replica served in-process over its real inbox)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, ClassVar

import msgspec

from asyncrl.manifest.spec import ProcessSpec
from asyncrl.observe.status import AgentStatus, ask, format_status
from asyncrl.role import Role, RoleContext, endpoint
from asyncrl.supervision.process import Tally, serve_role, status_answer
from asyncrl.transport import Client, LocalRegistry, Server

START_S = 20.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_tally_counts_overlapping_calls_once_as_busy_and_each_in_its_method() -> None:
    clock = Clock()
    tally = Tally(clock, wall=lambda: 1700000000.0)
    first = tally.begin()
    clock.now += 2.0
    second = tally.begin()
    clock.now += 1.0
    tally.end("score", first, ok=True)
    assert (tally.inflight, tally.busy_s()) == (1, 3.0)
    clock.now += 0.5
    tally.end("generate", second, ok=False)
    clock.now += 4.0  # idle: not busy
    third = tally.begin()
    clock.now += 0.25
    assert tally.snapshot() == {
        "calls": {"score": 1},
        "errors": {"generate": 1},
        "handler_s": {"score": 3.0, "generate": 1.5},
        "busy_s": 3.75,
        "inflight": 1,
        "started_at": 1700000000.0,
        "uptime_s": 7.75,
    }
    tally.end("score", third, ok=True)
    assert (tally.calls["score"], tally.busy_s()) == (2, 3.75)


class Memory(msgspec.Struct):
    """Memory as a role may report it (a Struct, answered as a plain mapping)."""

    allocated: int
    reserved: int
    peak: int
    total: int


class Reporting(Role):
    """A role that reports its device memory as a Struct, or fails to report."""

    built: ClassVar[list[Reporting]] = []  # every instance, so a test reaches the served one

    def __init__(self, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.broken = False
        self.release = asyncio.Event()
        Reporting.built.append(self)

    def status(self) -> dict[str, Any]:
        if self.broken:
            raise RuntimeError("device lost")
        return {"memory": Memory(allocated=10, reserved=20, peak=15, total=100), "step": 3}

    @endpoint()
    async def work(self, x: int) -> int:
        await self.release.wait()
        return x + 1


def test_status_answer_merges_the_role_facts_and_survives_a_failing_status() -> None:
    role = Reporting(RoleContext.local())
    tally = Tally(Clock(), wall=lambda: 5.0)
    answer = status_answer({"process": "r.0"}, tally, role)
    assert answer["process"] == "r.0"
    assert answer["role"] == {
        "memory": {"allocated": 10, "reserved": 20, "peak": 15, "total": 100},
        "step": 3,
    }
    role.broken = True
    answer = status_answer({"process": "r.0"}, tally, role)
    assert answer["role"] == {
        "error": "Reporting.status() failed: RuntimeError: device lost",
    }
    assert (answer["busy_s"], answer["calls"], answer["started_at"]) == (0.0, {}, 5.0)


def test_the_default_role_status_is_empty() -> None:
    assert Role(RoleContext.local()).status() == {}


def test_status_is_served_on_the_inbox_while_a_call_is_in_flight(tmp_path: Any) -> None:
    asyncio.run(_served(str(tmp_path)))


async def _served(run_dir: str) -> None:
    address = LocalRegistry(run_dir).endpoint("reporting", 0)
    spec = ProcessSpec(
        kind="role",
        name="reporting",
        target="tests.observe.test_status_role:Reporting",
        endpoint=address,
        run="status_role",
        run_dir=run_dir,
    )
    serving = asyncio.create_task(serve_role(spec))
    client = Client(address, name="test")
    try:
        await client.connect(timeout=START_S)
        pending = client.call_future("work", 1, timeout=START_S)
        answer = await _until(client, lambda a: a["inflight"] == 1)
        assert (answer["process"], answer["replica"], answer["incarnation"]) == (
            "reporting.0",
            0,
            0,
        )
        assert answer["role"]["memory"] == {
            "allocated": 10,
            "reserved": 20,
            "peak": 15,
            "total": 100,
        }
        Reporting.built[-1].release.set()
        assert await pending == 2
        answer = await _until(client, lambda a: a["inflight"] == 0)
        assert answer["calls"] == {"work": 1}
        assert answer["errors"] == {}
        assert answer["busy_s"] > 0.0
        assert answer["handler_s"]["work"] == answer["busy_s"]
    finally:
        await client.close()
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving


async def _until(client: Client, done: Any) -> dict[str, Any]:
    """``_status`` asked until ``done(answer)`` holds (the handler starts on the server's next
    turn of the loop); bounded by START_S."""
    async with asyncio.timeout(START_S):
        while True:
            answer = dict(await client.call("_status", None, timeout=START_S))
            if done(answer):
                return answer
            await asyncio.sleep(0)


class EndpointNamedStatus(Role):
    """A role whose endpoint method is called ``status`` (wire name and hook collide)."""

    @endpoint()
    async def status(self, _: Any) -> dict[str, Any]:  # type: ignore[override]
        return {}


def test_an_endpoint_method_named_status_is_reported_not_called() -> None:
    answer = status_answer({}, Tally(Clock()), EndpointNamedStatus(RoleContext.local()))
    assert answer["role"] == {
        "error": "EndpointNamedStatus.status() failed: TypeError: status is an async method "
        "(an endpoint?), not the Role.status() hook; give the endpoint another method name and "
        "keep its wire name with @endpoint(name='status')"
    }


PROCESS = {
    "role": "reference",
    "replica": 0,
    "kind": "role",
    "incarnation": 1,
    "pid": 4242,
    "alive": True,
    "serving": True,
    "standby_pid": None,
    "state": "serving",
    "restarts": 1,
    "heartbeat_age_s": 0.5,
}
OWN = {
    "process": "reference.0",
    "replica": 0,
    "incarnation": 1,
    "pid": 4242,
    "calls": {"logprobs": 40, "ping": 2},
    "errors": {},
    "handler_s": {"logprobs": 30.25, "ping": 0.001},
    "busy_s": 12.75,
    "inflight": 1,
    "started_at": 1700000000.0,
    "uptime_s": 60.0,
    "role": {
        "memory": {"allocated": 3 * 2**30 // 2, "reserved": 0, "peak": 0, "total": 80 * 2**30}
    },
}


def test_the_agent_asks_each_serving_replica_and_names_one_that_does_not_answer(
    tmp_path: Any,
) -> None:
    asyncio.run(_agent_asks(str(tmp_path)))


async def _agent_asks(run_dir: str) -> None:
    served = Server(f"ipc://{run_dir}/reference.0", name="reference.0")
    served.add("_status", lambda payload, call: OWN)
    await served.start()
    silent = f"ipc://{run_dir}/critic.0"  # nothing binds it
    processes = [
        PROCESS,
        {**PROCESS, "role": "critic", "incarnation": 0, "pid": 4243, "restarts": 0},
        {**PROCESS, "role": "rollout", "serving": False, "state": "starting", "pid": 4244},
    ]
    agent = AgentStatus(
        lambda: [dict(p) for p in processes],
        run="r",
        run_dir=run_dir,
        replicas={
            ("reference", 0): served.endpoint,
            ("critic", 0): silent,
            ("rollout", 0): f"ipc://{run_dir}/rollout.0",
        },
        replica_timeout_s=0.3,
    )
    await agent.start()
    try:
        found = await ask(run_dir)
    finally:
        await agent.close()
        await served.close()
    reference, critic, rollout = found["nodes"][0]["processes"]
    assert reference["status"] == OWN
    assert critic["status"]["error"].startswith(f"{silent} did not answer '_status': ")
    assert "status" not in rollout  # not serving: not asked
    lines = format_status(found, width=160).splitlines()
    assert lines[1] == f"critic[0] on node 0: {critic['status']['error']}"
    assert lines[3].split()[-4:] == ["-", "42", "12.8", "1.5G/80.0G"]
    assert lines[4].split()[-4:] == ["-", "-", "-", "-"]
