"""asyncrl status in-process: agent status servers, the CLI's answers, busy time and idle
fractions (a live run is tests/integration/test_status_live.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

import asyncrl.observe.status as status_module
from asyncrl.dispatch.dispatcher import Busy, Group
from asyncrl.dispatch.handles import Handle
from asyncrl.dispatch.restarts import Restarts
from asyncrl.errors import ClosedError
from asyncrl.manifest.membership import MEMBERSHIP_FILE
from asyncrl.manifest.spec import GroupInfo
from asyncrl.observe.metrics import IdleFractions
from asyncrl.observe.status import (
    AgentStatus,
    NotRunningError,
    agent_endpoint,
    ask,
    format_status,
    main,
)
from asyncrl.restart_request import RestartAnswer, RestartRequest
from asyncrl.transport import Server


def sync(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """``test`` run in a fresh event loop (the fixtures it names still reach it)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeClient:
    def __init__(self) -> None:
        self.futures: list[asyncio.Future[Any]] = []

    def call_future(
        self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any
    ) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.futures.append(fut)
        return fut


@sync
async def test_busy_counts_the_time_with_a_call_in_flight() -> None:
    clock, client = Clock(), FakeClient()
    busy = Busy(client, clock)
    first = busy.call_future("m", timeout=1.0)
    clock.now += 2.0
    second = busy.call_future("m")
    clock.now += 1.0
    first.set_result(1)
    await asyncio.sleep(0)  # done callbacks run on the next turn of the loop
    assert (busy.inflight, busy.busy_s()) == (1, 3.0)
    clock.now += 0.5
    second.set_exception(RuntimeError("failed calls count too"))
    await asyncio.sleep(0)
    clock.now += 4.0  # idle
    assert (busy.inflight, busy.busy_s()) == (0, 3.5)
    assert second.exception() is not None


def test_idle_fractions_per_role_since_the_previous_call() -> None:
    clock = Clock()
    busy = {"rollout": (0.0, 2), "learner": (0.0, 1)}
    idle = IdleFractions(lambda: dict(busy), clock)
    clock.now += 10.0
    busy.update(rollout=(15.0, 2), learner=(2.5, 1))
    assert idle() == {"rollout": 0.25, "learner": 0.75}
    clock.now += 5.0
    busy.update(rollout=(25.0, 2), learner=(2.5, 1))
    assert idle() == {"rollout": 0.0, "learner": 1.0}
    assert idle() == {}  # no time passed


PROCESSES = [
    {
        "role": "splitter",
        "replica": 0,
        "kind": "role",
        "incarnation": 2,
        "pid": 4242,
        "alive": True,
        "serving": True,
        "standby_pid": None,
        "state": "serving",
        "restarts": 2,
        "heartbeat_age_s": 0.25,
    },
    {
        "role": "driver",
        "replica": 0,
        "kind": "driver",
        "incarnation": 0,
        "pid": 4243,
        "alive": True,
        "serving": False,
        "standby_pid": None,
        "state": "starting",
        "restarts": 0,
        "heartbeat_age_s": None,
    },
]
REPLICA = {
    "replica": 0,
    "endpoint": "ipc://x",
    "connected": True,
    "incarnation": 2,
    "credit": 4,
    "inflight": 3,
    "queued": 5,
    "served": 17,
    "busy_s": 12.5,
}
DRIVER = {
    "program": "p:main",
    "incarnation": 0,
    "step": 7,
    "version": 6,
    "roles": {"splitter": {"queued": 9, "counters": {}, "replicas": [REPLICA]}},
}


async def _driver(endpoint: str) -> Server:
    server = Server(endpoint, name="driver")
    server.add("status", lambda payload, call: DRIVER)
    await server.start()
    return server


@sync
async def test_the_agent_answers_with_its_processes_and_the_drivers_status(run_dir: str) -> None:
    driver = await _driver(f"ipc://{run_dir}/driver.0")
    agent = AgentStatus(
        lambda: PROCESSES, run="r", run_dir=run_dir, driver=f"ipc://{run_dir}/driver.0"
    )
    await agent.start()
    try:
        found = await ask(run_dir)
    finally:
        await agent.close()
        await driver.close()
    assert found == {
        "run": "r",
        "run_dir": run_dir,
        "nodes": [{"node": 0, "agent_pid": os.getpid(), "processes": PROCESSES, "driver": DRIVER}],
    }
    lines = format_status(found, width=140).splitlines()
    assert lines[0] == f"run r in {run_dir}"
    assert lines[1] == (
        "driver incarnation 0 running p:main: step 7, version 6; calls waiting for any "
        "replica: splitter 9"
    )
    assert lines[3].split() == [
        "0",
        "splitter",
        "0",
        "2",
        "4242",
        "serving",
        "2",
        "0.25",
        "4",
        "3",
        "5",
        "17",
        *["-"] * 3,  # the replica's own calls, busy time and memory: it was not asked
    ]
    assert lines[4].split() == ["0", "driver", "0", "0", "4243", "starting", "0", *["-"] * 8]


@sync
async def test_a_driver_that_does_not_answer_is_named(run_dir: str) -> None:
    gone = f"ipc://{run_dir}/driver.0"
    agent = AgentStatus(lambda: [], run="r", run_dir=run_dir, driver=gone, timeout_s=0.2)
    answer = await agent.node_status()
    assert answer["driver"]["error"].startswith(f"{gone} did not answer 'status': ")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@sync
async def test_any_nodes_agent_answers_for_every_node(tmp_path: Any) -> None:
    dirs = [str(tmp_path / "0"), str(tmp_path / "0" / "node-1")]
    tcp = [f"tcp://127.0.0.1:{_port()}" for _ in range(3)]
    agents = [
        AgentStatus(
            lambda n=n: [{**PROCESSES[0], "replica": n}],
            run="r",
            run_dir=dirs[n],
            node=n,
            tcp=tcp[n],
            peers={m: tcp[m] for m in (0, 1, 2) if m != n},
            timeout_s=0.5,
        )
        for n in (0, 1)
    ]
    for agent in agents:
        await agent.start()
    try:
        from_1 = await ask(dirs[1])
        from_0 = await ask(dirs[0])
    finally:
        for agent in agents:
            await agent.close()
    for found in (from_0, from_1):
        assert [n["node"] for n in found["nodes"]] == [0, 1, 2]
        assert [p["replica"] for n in found["nodes"][:2] for p in n["processes"]] == [0, 1]
        assert found["nodes"][2]["error"].startswith(f"{tcp[2]} did not answer 'node_status'")
    assert from_1["run_dir"] == dirs[1]


@sync
async def test_no_agent_means_the_run_is_not_running(tmp_path: Any) -> None:
    run_dir = str(tmp_path)
    with pytest.raises(NotRunningError) as caught:
        await ask(run_dir, 0.2)
    assert str(caught.value) == (
        f"no agent answers at {agent_endpoint(run_dir)}; the run is not running; it left no "
        f"report ({run_dir}/report.json does not exist)"
    )
    with open(os.path.join(run_dir, "report.json"), "w") as f:
        f.write("{}")
    open(agent_endpoint(run_dir).removeprefix("ipc://"), "w").close()  # left by a killed agent
    with pytest.raises(NotRunningError) as caught:
        await ask(run_dir, 0.2)
    assert str(caught.value) == (
        f"no agent answers at {agent_endpoint(run_dir)}; the run is not running; its last "
        f"report is {run_dir}/report.json"
    )


def test_the_command_says_what_is_wrong_and_exits_1(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "missing")
    assert main([missing]) == 1
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"{missing} is not a directory; give the run directory of a run\n")


@sync
async def test_questions_at_once_to_a_new_endpoint_leave_one_client_open(
    run_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ``asyncrl status`` at once both find no client for the driver yet: the one kept is
    the only one left open (the other was closed, not leaked with its socket)."""
    built: list[Any] = []

    class Recorded(status_module.Client):  # type: ignore[misc,name-defined]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(status_module, "Client", Recorded)
    endpoint = f"ipc://{run_dir}/driver.0"
    driver = await _driver(endpoint)
    agent = AgentStatus(lambda: [], run="r", run_dir=run_dir, driver=endpoint)
    try:
        answers = await asyncio.gather(*(agent.node_status() for _ in range(3)))
        assert [a["driver"] for a in answers] == [DRIVER] * 3
        assert len(built) == 3
        assert [c for c in built if not c._closed] == [agent._clients[endpoint]]
    finally:
        await agent.close()
        await driver.close()
    assert [c._closed for c in built] == [True] * 3


def test_a_run_on_episodes_shows_its_episode_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's answer carries the episode counters of its last metrics record, and the
    heading shows them; a run on single completions has none."""
    from types import SimpleNamespace

    from asyncrl.dispatch import driver as driver_module
    from asyncrl.observe import metrics

    spec = SimpleNamespace(target="p:main", incarnation=1)
    dispatcher = SimpleNamespace(status=lambda: DRIVER["roles"])
    counters = {
        "episodes": 90,
        "episode_restarts": 2,
        "episode_replays": 5,
        "env_errors": 1,
        "infra_failed": 4,
        "quarantined": 1,
        "quarantine_restarts": 1,
    }
    monkeypatch.setattr(metrics, "_latest", {"step": 7, "version": 6, "pipeline": counters})
    answer = driver_module._status(spec, dispatcher)(None, None)  # type: ignore[arg-type]
    assert answer["episodes"] == {
        "episodes": 90,
        "episode_restarts": 2,
        "episode_replays": 5,
        "env_timeouts": 0,
        "env_errors": 1,
        "infra_failed": 4,
        "quarantined": 1,
        "quarantine_released": 0,
        "quarantine_restarts": 1,
    }
    status = {"run": "r", "run_dir": "/x", "nodes": [{"node": 0, "driver": answer}]}
    assert format_status(status, width=140).splitlines()[2] == (
        "episodes played 90: restarted 2, replayed 5; environment timeouts 0, errors 1; "
        "infra-failed 4 (never trained); replicas quarantined 1, let back 0, restarted 1"
    )
    monkeypatch.setattr(metrics, "_latest", {"step": 7, "pipeline": {"batches": 3}})
    assert "episodes" not in driver_module._status(spec, dispatcher)(None, None)  # type: ignore[arg-type]


@sync
async def test_a_node_whose_agent_moved_is_asked_at_its_new_endpoint(tmp_path: Any) -> None:
    """The peers are read at each question: node 1's agent restarts on another port, the map
    is updated (as the membership follower does), and the next question reaches it there; the
    client of the old endpoint is closed, not kept reconnecting to a dead port."""
    old, new = (f"tcp://127.0.0.1:{_port()}" for _ in range(2))
    peers = {1: old}
    node_0 = AgentStatus(lambda: [], run="r", run_dir=str(tmp_path), peers=peers, timeout_s=0.5)

    def node_1(tcp: str) -> AgentStatus:
        rows = [{**PROCESSES[0], "replica": 1}]
        return AgentStatus(lambda: rows, run="r", run_dir=str(tmp_path / "node-1"), node=1, tcp=tcp)

    await node_0.start()
    first = node_1(old)
    await first.start()
    try:
        before = await ask(str(tmp_path))
        await first.close()
        peers[1] = new
        second = node_1(new)
        await second.start()
        try:
            after = await ask(str(tmp_path))
            assert list(node_0._clients) == [new]  # the old endpoint's client was closed
        finally:
            await second.close()
    finally:
        await node_0.close()
    for answer in (before, after):
        assert [(n["node"], [p["replica"] for p in n["processes"]]) for n in answer["nodes"]] == [
            (0, []),
            (1, [1]),
        ]


def test_the_heading_says_a_group_went_on_at_a_smaller_size() -> None:
    from asyncrl.observe.status import format_status

    change = {
        "time": 0.0,
        "event": "node_lost",
        "node": 1,
        "reason": "the agent of node 1 sent no heartbeat for 4 s",
        "departed": ["rollout[1]", "learner[1]"],
        "moved": {},
        "shrunk": {"learner": [0]},
    }
    status = {"run": "r", "run_dir": "/r", "nodes": [], "membership": {"changes": [change]}}
    line = format_status(status).splitlines()[1]
    assert line.endswith(
        "(the agent of node 1 sent no heartbeat for 4 s): rollout[1] left the run, learner[1] "
        "left the run, learner goes on with replicas [0]"
    )
    # Its lead (replica 0) was on the lost node: the heading names the new one.
    change |= {"departed": ["learner[0]"], "shrunk": {"learner": [1]}}
    line = format_status(status).splitlines()[1]
    assert line.endswith(
        ": learner[0] left the run, learner goes on with replicas [1], led by replica 1"
    )


def test_the_heading_says_a_group_grew_back() -> None:
    from asyncrl.observe.status import format_status

    change = {
        "time": 0.0,
        "event": "group_grown",
        "node": 1,
        "reason": "node 1 is back",
        "departed": [],
        "moved": {"learner[1]": 1},
        "shrunk": {},
        "grown": {"learner": [0, 1]},
    }
    status = {"run": "r", "run_dir": "/r", "nodes": [], "membership": {"changes": [change]}}
    line = format_status(status).splitlines()[1]
    assert line.startswith("node 1 back at ")
    assert line.endswith("(node 1 is back): learner grows back to replicas [0, 1]")


@sync
async def test_a_restart_request_reaches_the_supervisor_of_the_node_that_runs_the_replica(
    tmp_path: Any,
) -> None:
    """The driver's ``Restarts`` asks node 0's agent; node 0 runs env[0] and answers itself;
    env[1] runs on node 1, whose agent node 0 asks; a replica no node runs is refused, saying
    so. Each supervisor (a fake here) receives the typed request as sent."""
    tcp = [f"tcp://127.0.0.1:{_port()}" for _ in range(2)]
    asked: list[tuple[int, RestartRequest]] = []

    def supervisor(node: int) -> Callable[[RestartRequest], RestartAnswer]:
        def restart(request: RestartRequest) -> RestartAnswer:
            asked.append((node, request))
            if request.replica != node:
                why = f"{request.role}[{request.replica}] is not supervised on this node"
                return RestartAnswer(restarted=False, found=False, why=why)
            return RestartAnswer(restarted=True, incarnation=2, pid=4000 + node)

        return restart

    dirs = [str(tmp_path), str(tmp_path / "node-1")]
    agents = [
        AgentStatus(
            lambda: [],
            run="r",
            run_dir=dirs[n],
            node=n,
            tcp=tcp[n],
            peers={1 - n: tcp[1 - n]},
            timeout_s=0.5,
            restart=supervisor(n),
        )
        for n in (0, 1)
    ]
    for agent in agents:
        await agent.start()
    restarts = Restarts(dirs[0], run="r", timeout_s=5.0)
    try:
        why = "quarantined: it failed 20 of its last 20 steps (1 quarantine in a row)"
        here = await restarts.restart(RestartRequest(role="env", replica=0, reason=why))
        there = await restarts.restart(
            RestartRequest(role="env", replica=1, reason=why, incarnation=2)
        )
        nowhere = await restarts.restart(RestartRequest(role="env", replica=7, reason=why))
    finally:
        await restarts.close()
        for agent in agents:
            await agent.close()
    assert here == RestartAnswer(restarted=True, incarnation=2, pid=4000)
    assert there == RestartAnswer(restarted=True, incarnation=2, pid=4001)
    assert nowhere == RestartAnswer(
        restarted=False, found=False, why="env[7] is not supervised on any node of the run"
    )
    assert [(node, r.replica, r.incarnation, r.reason) for node, r in asked] == [
        (0, 0, -1, why),
        (0, 1, 2, why),
        (1, 1, 2, why),
        (0, 7, -1, why),
        (1, 7, -1, why),
    ]


@sync
async def test_a_restart_request_asks_the_other_nodes_at_once_and_never_a_lost_one(
    tmp_path: Any,
) -> None:
    """Node 0's agent leaves out node 1, lost for good (its agent still answers here), and asks
    nodes 2 and 3 at once: node 2's supervisor answers only once node 3's was asked, which it
    never would if they were asked one after the other. A replica no node runs is refused with
    why, naming the lost node."""
    tcp = [f"tcp://127.0.0.1:{_port()}" for _ in range(4)]
    asked: list[tuple[int, int, bool]] = []  # node, replica, node 3 asked before node 2 answered
    node_3_asked = asyncio.Event()

    def supervisor(node: int) -> Callable[[RestartRequest], Awaitable[RestartAnswer]]:
        async def restart(request: RestartRequest) -> RestartAnswer:
            if node == 3:
                node_3_asked.set()
            elif node == 2:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(node_3_asked.wait(), 3.0)
            asked.append((node, request.replica, node_3_asked.is_set()))
            if request.replica != node:
                why = f"{request.role}[{request.replica}] is not supervised on this node"
                return RestartAnswer(restarted=False, found=False, why=why)
            return RestartAnswer(restarted=True, incarnation=1, pid=4000 + node)

        return restart

    dirs = [str(tmp_path / f"node-{n}") for n in range(4)]
    for folder in dirs:
        os.makedirs(folder)
    lost = {"1": "the agent of node 1 sent no heartbeat for 4 s"}
    with open(os.path.join(dirs[0], MEMBERSHIP_FILE), "w") as f:
        json.dump({"lost": lost}, f)
    agents = [
        AgentStatus(
            lambda: [],
            run="r",
            run_dir=dirs[n],
            node=n,
            tcp=tcp[n],
            peers={p: tcp[p] for p in range(4) if p != n},
            timeout_s=5.0,
            restart=supervisor(n),
        )
        for n in range(4)
    ]
    for agent in agents:
        await agent.start()
    restarts = Restarts(dirs[0], run="r", timeout_s=30.0)
    try:
        why = "quarantined: it failed its probe (2 quarantines in a row)"
        there = await restarts.restart(RestartRequest(role="env", replica=3, reason=why))
        nowhere = await restarts.restart(RestartRequest(role="env", replica=1, reason=why))
    finally:
        await restarts.close()
        for agent in agents:
            await agent.close()
    assert there == RestartAnswer(restarted=True, incarnation=1, pid=4003)
    assert nowhere == RestartAnswer(
        restarted=False,
        found=False,
        why="env[1] is not supervised on any node of the run that answered (node 1 is lost)",
    )
    assert sorted(asked) == [
        (0, 1, True),
        (0, 3, False),
        (2, 1, True),
        (2, 3, True),
        (3, 1, True),
        (3, 3, True),
    ]


@sync
async def test_a_handle_asks_for_a_restart_of_its_own_replicas_only(tmp_path: Any) -> None:
    """``Handle.restart_replica`` names its group and checks what it sends; a handle made
    outside a run has no supervisor to ask."""
    got: list[RestartRequest] = []

    def restart(request: RestartRequest) -> RestartAnswer:
        got.append(request)
        return RestartAnswer(restarted=False, incarnation=3, why="the run is ending")

    agent = AgentStatus(lambda: [], run="r", run_dir=str(tmp_path), restart=restart)
    await agent.start()
    info = GroupInfo(["ipc:///nonexistent/env.0", "ipc:///nonexistent/env.1"], 1.0, 3)
    group = Group("env", info, run="r", startup_timeout_s=1.0)
    restarts = Restarts(str(tmp_path), run="r", timeout_s=5.0)
    try:
        env = Handle(group, restarts=restarts)
        answer = await env.restart_replica(1, "it hangs", incarnation=3)
        with pytest.raises(ValueError) as bad:
            await env.restart_replica(2, "it hangs")
        with pytest.raises(ValueError) as blank:
            await env.restart_replica(0, "")
        with pytest.raises(ClosedError) as outside:
            await Handle(group).restart_replica(0, "it hangs")
    finally:
        await restarts.close()
        await agent.close()
    assert answer == RestartAnswer(restarted=False, incarnation=3, why="the run is ending")
    assert got == [RestartRequest(role="env", replica=1, reason="it hangs", incarnation=3)]
    assert str(bad.value) == "restart_replica: env has replicas 0 to 1, not 2"
    assert str(blank.value) == (
        "restart_replica: reason: expected why the replica should restart, got ''"
    )
    assert str(outside.value) == (
        "restart_replica: the handle of env has no supervisor to ask; only a program run by "
        "asyncrl (its driver) can restart replicas"
    )
