"""What one node's agent does as the launch's membership changes
(``asyncrl.supervision.membership_follower``) and its heartbeat (``NodeAttempt.heartbeat``),
driven in-process over a store kept in a dict: no torchrun, no process started."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from typing import Any

import msgspec

from asyncrl.manifest.load import parse_manifest
from asyncrl.manifest.membership import Moved
from asyncrl.manifest.spec import SPEC_FILE_ENV, GroupInfo, ProcessSpec
from asyncrl.observe.status import AgentStatus, ask
from asyncrl.supervision import multinode
from asyncrl.supervision.agent import NodeView, status_server
from asyncrl.supervision.hosts import HostRecord
from asyncrl.supervision.membership_follower import MembershipFollower, lost_generation
from asyncrl.supervision.multinode import LaunchEnv, NodeAttempt
from asyncrl.supervision.store_registry import LaunchKeys, NodeRecord

MANIFEST = """\
run: {name: elastic, program: "examples.hello.program:main"}
roles:
  splitter:
    class: examples.hello.roles:Splitter
    replicas: 3
    placement: {nodes: [0, 1, 2]}
  counter:
    class: examples.hello.roles:Counter
    placement: {nodes: [2, 0]}
"""

CHAIN = MANIFEST.replace("placement: {nodes: [2, 0]}", "placement: {nodes: [2, 1, 0]}")
"""The counter's candidates are nodes 2, 1 and 0: lost with node 2, it moves to node 1."""

KEYS = LaunchKeys("elastic")


class DictStore:
    """The launch store's calls that the follower and the heartbeat make, over a dict; every
    ``set`` is kept in ``writes``."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.writes: list[tuple[str, str]] = []
        self.changed = asyncio.Event()

    async def set(self, key: str, value: str) -> None:
        self.values[key] = value
        self.writes.append((key, value))
        self.changed.set()

    async def get(self, key: str) -> str:
        return self.values[key]

    async def peek(self, key: str) -> str | None:
        return self.values.get(key)

    async def check(self, key: str) -> bool:
        return key in self.values

    async def wait_for(self, keys: list[str], timeout_s: float, **_: Any) -> None:
        async with asyncio.timeout(timeout_s):
            while not all(k in self.values for k in keys):
                self.changed.clear()
                await self.changed.wait()


class Adopter:
    """A supervisor that records each replica it is given to adopt, and the ``ProcessSpec``
    of its first incarnation."""

    def __init__(self) -> None:
        self.adopted: list[tuple[str, int]] = []
        self.specs: list[ProcessSpec] = []
        self.envs: list[dict[str, str]] = []

    async def adopt(self, spec: Any) -> None:
        self.adopted.append((spec.name, spec.replica))
        _, env = spec.argv_env(0)
        self.envs.append(env)
        with open(env[SPEC_FILE_ENV], "rb") as f:
            self.specs.append(msgspec.json.decode(f.read(), type=ProcessSpec))


GROUP = (
    MANIFEST
    + """\
  learner:
    class: examples.hello.roles:Counter
    replicas: 3
    placement: {nodes: [0, 1, 2]}
    supervision: {strategy: one_for_all}
"""
)
"""A data-parallel group with a rank on each node."""


class Restarter(Adopter):
    """A supervisor that records each role it is told to start again, with the group's
    members its processes would be given then."""

    def __init__(self, view: NodeView) -> None:
        super().__init__()
        self.view = view
        self.restarted: list[tuple[str, list[int]]] = []

    async def restart_role(self, name: str, reason: str) -> list[str]:
        self.restarted.append((name, list(self.view.members[name])))
        return [f"{name}[0]"]


SHARED = GROUP.replace('program: "examples', 'shared_storage: true, program: "examples')
"""The group over nodes 0, 1 and 2, with the run directory on shared storage: it grows back."""

STAY = SHARED.replace(
    "supervision: {strategy: one_for_all}", "supervision: {strategy: one_for_all, regrow: false}"
)
"""The same group told to stay smaller when a node of its ranks comes back."""


def _follower(
    store: DictStore, node: int, run_dir: str, manifest: str = MANIFEST
) -> MembershipFollower:
    view = NodeView(
        node=node,
        agents={0: "tcp://127.0.0.1:1000", 1: "tcp://127.0.0.1:1001", 2: "tcp://127.0.0.1:1002"},
        groups={
            "splitter": GroupInfo(["ipc://s0", "tcp://127.0.0.1:2001", "tcp://127.0.0.1:2002"]),
            "counter": GroupInfo(["tcp://127.0.0.1:2100"]),
        },
    )
    return MembershipFollower(
        store=store,  # type: ignore[arg-type]
        keys=KEYS,
        attempt=0,
        node=node,
        nodes=3,
        manifest=parse_manifest(manifest, nodes=3),
        run_dir=run_dir,
        view=view,
        bind_host="127.0.0.1",
        host="127.0.0.1",
        say=lambda node, message: None,
    )


class Launch:
    """Nodes' followers over one ``DictStore``, in the run directory ``tmp_path`` (node 0's
    folder) on ``manifest``, each with its supervisor, and the steps of node 0's words: a node
    lost, back, or its one-replica role moved."""

    def __init__(self, tmp_path: Any, manifest: str = SHARED) -> None:
        self.run_dir = str(tmp_path)
        self.manifest = manifest
        self.store = DictStore()
        self.followers: dict[int, MembershipFollower] = {}
        self.supervisors: dict[int, Adopter] = {}

    def add(
        self, node: int, learner: list[str], store: DictStore | None = None
    ) -> tuple[MembershipFollower, Restarter]:
        """Node ``node``'s follower (its folder made), which sees the learner's group at the
        endpoints ``learner``, over ``store`` (the launch's unless given), with a
        ``Restarter``."""
        follower = self._follower(node, store)
        follower.view.groups["learner"] = GroupInfo(learner)
        supervisor = Restarter(follower.view)
        self.supervisors[node] = supervisor
        return follower, supervisor

    def add_adopter(self, node: int) -> tuple[MembershipFollower, Adopter]:
        """Node ``node``'s follower (its folder made), over a manifest of no group across nodes,
        with an ``Adopter``."""
        follower = self._follower(node, None)
        supervisor = self.supervisors[node] = Adopter()
        return follower, supervisor

    def _follower(self, node: int, store: DictStore | None) -> MembershipFollower:
        if node:
            os.makedirs(os.path.join(self.run_dir, f"node-{node}"), exist_ok=True)
        follower = _follower(store or self.store, node, self.run_dir, self.manifest)
        self.followers[node] = follower
        return follower

    def __getitem__(self, node: int) -> tuple[MembershipFollower, Restarter]:
        """Node ``node``'s follower and its ``Restarter``."""
        supervisor = self.supervisors[node]
        assert isinstance(supervisor, Restarter)
        return self.followers[node], supervisor

    async def follow(self, *nodes: int) -> str:
        """Each of ``nodes`` follows the store once, in that order. Returns the last one's
        answer (why its node must leave, or "")."""
        answer = ""
        for node in nodes:
            answer = await self.followers[node].follow(self.supervisors[node])  # type: ignore[arg-type]
        return answer

    async def mark_lost(self, node: int, reason: str = "silent") -> None:
        """Node 0 marks ``node`` lost, as its agent does: its word carries each group's new
        formation number."""
        await self.followers[0].mark_lost(node, reason)

    def lose(self, node: int, generation: int = 1, lost_with: list[int] | None = None) -> None:
        """Node 0's word that ``node`` is lost (its loss of ``generation``), written by hand:
        without the groups' formations, and with the nodes it was planned with (``lost_with``)
        when given."""
        reason = f"the agent of node {node} sent no heartbeat for 4 s"
        said: dict[str, Any] = {"reason": reason, "generation": generation}
        if lost_with is not None:
            said["with"] = lost_with
        self.store.values[KEYS.lost(0, node)] = json.dumps(said)

    def back(
        self, node: int, generation: int, splitter: str, agent: str = "tcp://127.0.0.1:3002"
    ) -> None:
        """``node`` back from its loss of ``generation``, its splitter at ``splitter`` and its
        new agent at ``agent``."""
        record = NodeRecord(
            replicas={"splitter": {node: splitter}},
            agent=agent,
            host=HostRecord(host="node2", weights="/run/node-2/weights", token="t"),
        )
        self._back(node, generation, record)

    def back_with_rank(self, node: int, generation: int = 1) -> None:
        """``node`` back from its loss of ``generation``: its learner rank is one it does not
        start (the group went on without it), with the port it binds (32<node>) should the
        group grow back."""
        record = NodeRecord(
            replicas={"splitter": {node: f"tcp://127.0.0.1:30{node}1"}},
            agent=f"tcp://127.0.0.1:30{node}0",
            host=HostRecord(host="h", weights="/w", token="t"),
            unserved={"learner": {node: f"tcp://127.0.0.1:220{node}"}},
            regrow={"learner": {node: f"tcp://127.0.0.1:320{node}"}},
        )
        self._back(node, generation, record)

    def _back(self, node: int, generation: int, record: NodeRecord) -> None:
        self.store.values[KEYS.endpoints(0, node)] = msgspec.json.encode(record).decode()
        self.store.values[KEYS.back(0, node)] = json.dumps({"generation": generation})

    def rejoin(self, node: int, shrunk: dict[str, list[int]] | None = None) -> None:
        """``node``'s new agent, started again after its loss of generation 1, keeps its
        learner rank out (it departed with the loss) until node 0 decides that the group grows
        back; ``shrunk``: the groups node 0's record has smaller."""
        self.followers[node].keep_shrunk(shrunk or {}, [("learner", node)], rejoining=1)

    async def lose_1_and_bring_it_back(self, *, marked: bool = True) -> None:
        """Node 0 follows; node 1 is lost (``marked``: by node 0's ``mark_lost``; otherwise its
        word written by hand, of generation 1) and node 0 follows again; node 1 comes back with
        its learner rank, and its new agent, when the launch has it, keeps the rank out."""
        await self.follow(0)
        if marked:
            await self.mark_lost(1)
        else:
            self.lose(1)
        await self.follow(0)
        self.back_with_rank(1)
        if 1 in self.followers:
            self.rejoin(1)

    async def lose_1_and_2(self) -> None:
        """Node 0 follows; nodes 1 and 2 are lost (their words written by hand, of generation
        1) and node 0 follows again: the learner goes on with replica 0 alone."""
        await self.follow(0)
        self.lose(1)
        self.lose(2)
        await self.follow(0)

    def moved(self, node: int, endpoint: str, loss: list[int]) -> None:
        """The counter's new node publishes where it runs, with the loss that moved it there."""
        said = {"node": node, "endpoint": endpoint, "lost": loss}
        self.store.values[KEYS.moved(0, "counter", 0)] = json.dumps(said)


def test_a_node_taken_as_lost_while_it_runs_is_told_to_leave(tmp_path: Any) -> None:
    """Node 2 came back from its first loss; node 0 then marks it lost again (its beats came
    too late): its follower says why it must leave, rather than run on unseen while its
    splitter is out of the groups and its counter runs on node 0."""
    launch = Launch(tmp_path, MANIFEST)
    launch.add_adopter(2)
    launch.lose(2, 1)
    launch.back(2, 1, "tcp://127.0.0.1:4002")

    async def main() -> tuple[str, str]:
        answered = await launch.follow(2)
        launch.lose(2, 2)
        return answered, await launch.follow(2)

    answered, again = asyncio.run(main())
    assert answered == ""
    assert again == (
        "node 0 took this node as lost while it ran (the agent of node 2 sent no heartbeat for "
        "4 s), and the run went on without it: its roles stop, so that none runs twice"
    )


def test_a_singleton_moved_at_an_earlier_loss_is_not_started_again(tmp_path: Any) -> None:
    """Node 2 is lost (the counter moves to node 0 and starts there), comes back (its splitter
    rejoins at its new port, the counter stays), and is lost again: node 0's follower starts
    the counter once, not twice, and its membership says so."""
    launch = Launch(tmp_path, MANIFEST)
    follower, supervisor = launch.add_adopter(0)

    async def main() -> None:
        await launch.follow(0)  # in step with the store
        launch.lose(2, 1)
        await launch.follow(0)
        assert supervisor.adopted == [("counter", 0)]
        launch.back(2, 1, "tcp://127.0.0.1:4002")
        await launch.follow(0)
        assert follower.view.groups["splitter"].endpoints[2] == "tcp://127.0.0.1:4002"
        assert follower.view.agents[2] == "tcp://127.0.0.1:3002"
        launch.lose(2, 2)
        await launch.follow(0)

    asyncio.run(main())
    assert supervisor.adopted == [("counter", 0)]
    # It keeps node 2's folder for its state, and reads node 0's membership, which node 0's
    # agent keeps writing (node 2's never changes again).
    (spec,) = supervisor.specs
    assert (spec.run_dir, spec.node_dir) == (str(tmp_path / "node-2"), str(tmp_path))
    seen = msgspec.json.decode((tmp_path / "membership.json").read_bytes())
    assert seen["lost"] == {"2": "the agent of node 2 sent no heartbeat for 4 s"}
    assert seen["departed"] == {"splitter": {"2": 2}}
    assert {n: {i: m["node"] for i, m in by.items()} for n, by in seen["moved"].items()} == {
        "counter": {"0": 0}
    }
    assert [(c["event"], c["departed"], c["moved"]) for c in seen["changes"]] == [
        ("node_lost", ["splitter[2]"], {"counter[0]": 0}),
        ("node_back", [], {"splitter[2]": 2}),
        ("node_lost", ["splitter[2]"], {}),
    ]


def test_a_group_over_a_lost_node_goes_on_with_the_replicas_left(tmp_path: Any) -> None:
    """Node 1 is lost, then node 2: the learner's group goes on with replicas 0 and 2, then
    with replica 0 alone. Each time node 0 starts its rank again, given the group as it is
    then, and records the change in membership.json and metrics.jsonl."""
    launch = Launch(tmp_path, GROUP)
    learner = ["ipc://l0", "tcp://127.0.0.1:2201", "tcp://127.0.0.1:2202"]
    _, supervisor = launch.add(0, learner)

    async def main() -> None:
        await launch.follow(0)
        launch.lose(1, 1)
        await launch.follow(0)
        assert supervisor.restarted == [("learner", [0, 2])]
        launch.lose(2, 1)
        await launch.follow(0)

    asyncio.run(main())
    assert supervisor.restarted == [("learner", [0, 2]), ("learner", [0])]
    assert supervisor.adopted == [("counter", 0)]
    seen = msgspec.json.decode((tmp_path / "membership.json").read_bytes())
    assert seen["shrunk"] == {"learner": [0]}
    assert seen["departed"] == {"splitter": {"1": 1, "2": 2}, "learner": {"1": 1, "2": 2}}
    assert [(c["node"], c["departed"], c["shrunk"]) for c in seen["changes"]] == [
        (1, ["splitter[1]", "learner[1]"], {"learner": [0, 2]}),
        (2, ["splitter[2]", "learner[2]"], {"learner": [0]}),
    ]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["membership"]["shrunk"] for line in lines] == [
        {"learner": [0, 2]},
        {"learner": [0]},
    ]


def test_a_group_whose_lead_was_on_the_lost_node_goes_on_led_by_the_next(tmp_path: Any) -> None:
    """The learner's replica 0 (its lead) on node 1: losing node 1 starts node 0's rank
    (replica 2) again as the group's lead, with replica 1 on node 2 beside it, and
    membership.json names the new lead (``lead``) for the roles that call it."""
    from asyncrl.manifest.membership import lead

    launch = Launch(
        tmp_path, GROUP.replace("[0, 1, 2]}\n    supervision", "[1, 2, 0]}\n    supervision")
    )
    endpoints = ["tcp://127.0.0.1:2200", "tcp://127.0.0.1:2201", "ipc://l2"]
    _, supervisor = launch.add(0, endpoints)

    async def main() -> None:
        await launch.follow(0)
        assert lead(str(tmp_path), "learner", endpoints) == (0, "tcp://127.0.0.1:2200")
        launch.lose(1, 1)
        await launch.follow(0)

    asyncio.run(main())
    assert supervisor.restarted == [("learner", [1, 2])]
    seen = msgspec.json.decode((tmp_path / "membership.json").read_bytes())
    assert (seen["shrunk"], seen["departed"]["learner"]) == ({"learner": [1, 2]}, {"0": 1})
    assert lead(str(tmp_path), "learner", endpoints) == (1, "tcp://127.0.0.1:2201")


def test_a_node_without_a_rank_of_the_group_restarts_nothing(tmp_path: Any) -> None:
    """Node 1 is lost: node 2's follower records the learner's new membership, and its own
    rank (replica 2) starts again with it; with node 2 lost instead, node 1 does the same."""
    launch = Launch(tmp_path, GROUP)
    follower, supervisor = launch.add(2, ["tcp://a", "tcp://b", "ipc://l2"])

    async def main() -> None:
        await launch.follow(2)
        launch.lose(1, 1)
        await launch.follow(2)

    asyncio.run(main())
    assert supervisor.restarted == [("learner", [0, 2])]
    assert follower.membership.shrunk == {"learner": [0, 2]}


def test_a_group_that_went_on_smaller_stays_so_in_the_next_attempt(tmp_path: Any) -> None:
    """The learner went on with replicas 0 and 2 in an earlier attempt (node 0's
    membership.json): in the next, node 0 publishes it, node 1 does not start its rank (its
    state is from before the loss), every node gives the group's processes members [0, 2], and
    membership.json keeps replica 1 out of the run."""
    from asyncrl.manifest.membership import Membership
    from asyncrl.supervision.agent import build_children
    from asyncrl.supervision.rundir import node_dir

    run_dir = str(tmp_path)
    earlier = Membership(attempt=0, nodes=3, shrunk={"learner": [0, 2]})
    (tmp_path / "membership.json").write_bytes(msgspec.json.encode(earlier))
    manifest = parse_manifest(GROUP, nodes=3)
    store = DictStore()
    attempts = []
    for node in range(3):
        os.makedirs(node_dir(run_dir, node), exist_ok=True)
        env = LaunchEnv(node, 3, "127.0.0.1", 1, "", False)
        attempts.append(NodeAttempt(env, store, KEYS, 1, manifest, run_dir))  # type: ignore[arg-type]

    async def main() -> list[NodeView]:
        return list(await asyncio.gather(*(a.discover(30.0) for a in attempts)))

    views = asyncio.run(main())
    assert [v.members for v in views] == [{"learner": [0, 2]}] * 3
    assert [a.shrunk_away for a in attempts] == [[], [("learner", 1)], []]
    started = [
        (c.name, c.replica)
        for c in build_children(manifest, node_dir(run_dir, 1), parent_pid=1, view=views[1])
    ]
    assert started == [("splitter", 1)]
    (learner,) = [
        c
        for c in build_children(manifest, run_dir, parent_pid=1, view=views[0])
        if c.name == "learner"
    ]
    _, env = learner.argv_env(0)
    with open(env[SPEC_FILE_ENV], "rb") as f:
        spec = msgspec.json.decode(f.read(), type=ProcessSpec)
    assert (spec.replica, spec.replicas, spec.members) == (0, 3, [0, 2])
    follower = _follower(store, 1, run_dir, GROUP)
    follower.keep_shrunk(views[1].members, attempts[1].shrunk_away)
    seen = msgspec.json.decode((tmp_path / "node-1" / "membership.json").read_bytes())
    assert (seen["shrunk"], seen["departed"]) == ({"learner": [0, 2]}, {"learner": {"1": 1}})


def test_a_returned_node_does_not_start_its_rank_of_a_group_that_went_on(tmp_path: Any) -> None:
    """Node 1 was lost and the learner went on without its rank; node 1's torchrun started
    again joins the running attempt: its splitter starts, its learner rank does not (the
    others reach it, unserved, where it was), and its membership says it left."""
    from asyncrl.supervision.agent import build_children
    from asyncrl.supervision.rundir import node_dir

    run_dir = str(tmp_path)
    manifest = parse_manifest(GROUP, nodes=3)
    store = DictStore()
    host = HostRecord(host="h", weights="/w", token="t")
    for node in range(3):
        os.makedirs(node_dir(run_dir, node), exist_ok=True)
        replicas = {"splitter": {node: f"tcp://127.0.0.1:{2000 + node}"}}
        replicas["learner"] = {node: f"tcp://127.0.0.1:{2200 + node}"}
        if node == 2:
            replicas["counter"] = {0: "tcp://127.0.0.1:2100"}
        record = NodeRecord(replicas=replicas, agent=f"tcp://127.0.0.1:{1000 + node}", host=host)
        store.values[KEYS.endpoints(0, node)] = msgspec.json.encode(record).decode()
    env = LaunchEnv(1, 3, "127.0.0.1", 1, "", False)
    back = NodeAttempt(env, store, KEYS, 0, manifest, run_dir)  # type: ignore[arg-type]
    back.rejoining = 1
    view = asyncio.run(back.discover(30.0))
    assert back.shrunk_away == [("learner", 1)]
    assert view.elsewhere == {("learner", 1): "tcp://127.0.0.1:2201"}
    published = msgspec.json.decode(store.values[KEYS.endpoints(0, 1)], type=NodeRecord)
    assert list(published.replicas) == ["splitter"]
    started = [
        (c.name, c.replica)
        for c in build_children(manifest, node_dir(run_dir, 1), parent_pid=1, view=view)
    ]
    assert started == [("splitter", 1)]


def test_a_group_grows_back_when_the_node_of_its_ranks_returns(tmp_path: Any) -> None:
    """Node 1 is lost and the learner goes on with replicas 0 and 2; node 1 comes back. Node 0
    decides that the group grows back to [0, 1, 2] and says so in the store; it starts its
    rank again with those members and records the change (membership.json: the group no
    longer shrunk, replica 1 back at its new port; metrics.jsonl: ``group_grown``). Node 1,
    back, starts its rank with the same members, told first to take replica 0's state from
    node 0's folder (``rejoin.json``)."""
    from asyncrl.manifest.membership import Rejoin

    run_dir = str(tmp_path)
    launch = Launch(tmp_path)
    store = launch.store
    said: list[str] = []
    learner = ["tcp://127.0.0.1:2200", "tcp://127.0.0.1:2201", "tcp://127.0.0.1:2202"]
    node_0, supervisor_0 = launch.add(0, ["ipc://l0", *learner[1:]])
    node_0.say = lambda node, message: said.append(message)
    node_1, supervisor_1 = launch.add(1, learner)
    node_1.view.span_env["ASYNCRL_DIST_STORE"] = "127.0.0.1:29500"

    async def main() -> None:
        await launch.lose_1_and_bring_it_back()
        await launch.follow(1)
        assert supervisor_1.adopted == []  # node 0 has not decided yet
        await launch.follow(0, 1)

    asyncio.run(main())
    assert supervisor_0.restarted == [("learner", [0, 2]), ("learner", [0, 1, 2])]
    decided = json.loads(store.values[KEYS.grown(0, 1, 1)])
    assert decided == {
        "grown": {"learner": [0, 1, 2]},
        "lead": {"learner": 0},
        "endpoints": {"learner": {"1": "tcp://127.0.0.1:3201"}},
        "stays": {},
        "lost": {},
        "sequence": 1,
        "before": [],
        "formations": {"learner": 2},  # node 1's loss was the group's first
    }
    seen = msgspec.json.decode((tmp_path / "membership.json").read_bytes())
    assert (seen["shrunk"], seen["departed"]) == ({}, {})
    assert seen["moved"]["learner"] == {"1": {"node": 1, "endpoint": "tcp://127.0.0.1:3201"}}
    assert [(c["event"], c["grown"]) for c in seen["changes"]] == [
        ("node_lost", {}),
        ("node_back", {}),
        ("group_grown", {"learner": [0, 1, 2]}),
    ]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["membership"]["grown"] == {"learner": [0, 1, 2]}
    assert "learner grows back to replicas [0, 1, 2] (node 1 is back)" in said
    assert supervisor_1.adopted == [("learner", 1)]
    (spec,) = supervisor_1.specs
    assert (spec.replica, spec.members) == (1, [0, 1, 2])
    assert spec.endpoint == node_1.view.groups["learner"].endpoints[1]
    assert spec.endpoint.startswith("ipc://")
    assert supervisor_1.envs[0]["ASYNCRL_DIST_STORE"] == "127.0.0.1:29500"  # the group's store
    rejoin = msgspec.json.decode(
        (tmp_path / "node-1" / "roles" / "learner.1" / "rejoin.json").read_bytes(), type=Rejoin
    )
    assert rejoin == Rejoin(lead=0, folder=run_dir)
    mine = msgspec.json.decode((tmp_path / "node-1" / "membership.json").read_bytes())
    assert (mine["shrunk"], mine["departed"]) == ({}, {})

    async def again() -> None:
        """Node 1 lost a second time, and back again: the group shrinks and grows again."""
        await launch.mark_lost(1)
        await launch.follow(0)
        launch.back_with_rank(1, 2)
        await launch.follow(0)

    asyncio.run(again())
    assert supervisor_0.restarted[2:] == [("learner", [0, 2]), ("learner", [0, 1, 2])]
    assert json.loads(store.values[KEYS.grown(0, 1, 2)])["grown"] == {"learner": [0, 1, 2]}
    assert (node_0.membership.shrunk, node_0.membership.departed) == ({}, {})
    # Each loss and return of node 1 is a new formation of the group: two of each.
    assert node_0.view.formations == {"learner": 4}


def _pair(tmp_path: Any) -> Launch:
    """Node 0 and node 1 over ``SHARED``, each with its supervisor; node 1's folder exists."""
    launch = Launch(tmp_path)
    launch.add(0, ["ipc://l0", "tcp://b", "tcp://c"])
    launch.add(1, ["tcp://a", "tcp://b", "tcp://c"])
    return launch


def test_a_group_led_by_replica_1_grows_back_led_by_its_returning_replica_0(
    tmp_path: Any,
) -> None:
    """Replica 0 of the learner runs on node 1, replica 1 on node 0. Node 1 is lost: the group
    goes on with replicas [1, 2], led by replica 1. Node 1 comes back: node 0 decides that the
    group grows back to [0, 1, 2], replica 0 first taking the state of replica 1 (which led it
    meanwhile, from node 0's folder); replica 0 leads again, as the lowest replica does."""
    from asyncrl.manifest.membership import Rejoin, lead

    head, tail = SHARED.rsplit("placement: {nodes: [0, 1, 2]}", 1)
    launch = Launch(tmp_path, head + "placement: {nodes: [1, 0, 2]}" + tail)
    learner = ["tcp://127.0.0.1:2200", "tcp://127.0.0.1:2201", "tcp://127.0.0.1:2202"]
    node_0, supervisor_0 = launch.add(0, [learner[0], "ipc://l1", learner[2]])
    node_1, supervisor_1 = launch.add(1, ["ipc://l0", *learner[1:]])
    returning = NodeRecord(
        replicas={"splitter": {1: "tcp://127.0.0.1:3011"}},
        agent="tcp://127.0.0.1:3010",
        host=HostRecord(host="h", weights="/w", token="t"),
        unserved={"learner": {0: "tcp://127.0.0.1:2200"}},
        regrow={"learner": {0: "tcp://127.0.0.1:3200"}},
    )

    async def main() -> None:
        await launch.follow(0)
        await launch.mark_lost(1)
        await launch.follow(0)
        assert supervisor_0.restarted == [("learner", [1, 2])]
        assert lead(launch.run_dir, "learner", node_0.view.groups["learner"].endpoints)[0] == 1
        launch._back(1, 1, returning)
        node_1.keep_shrunk({}, [("learner", 0)], rejoining=1)
        await launch.follow(0, 1)

    asyncio.run(main())
    decided = json.loads(launch.store.values[KEYS.grown(0, 1, 1)])
    assert (decided["grown"], decided["lead"], decided["stays"]) == (
        {"learner": [0, 1, 2]},
        {"learner": 1},
        {},
    )
    assert supervisor_0.restarted == [("learner", [1, 2]), ("learner", [0, 1, 2])]
    assert supervisor_1.adopted == [("learner", 0)]
    assert supervisor_1.specs[0].members == [0, 1, 2]
    rejoin = tmp_path / "node-1" / "roles" / "learner.0" / "rejoin.json"
    assert msgspec.json.decode(rejoin.read_bytes(), type=Rejoin) == Rejoin(
        lead=1, folder=launch.run_dir
    )
    # Every node's callers reach replica 0 as the group's lead again, at its new port.
    assert lead(launch.run_dir, "learner", node_0.view.groups["learner"].endpoints) == (
        0,
        "tcp://127.0.0.1:3200",
    )
    assert lead(node_1.dir, "learner", node_1.view.groups["learner"].endpoints)[0] == 0


def test_a_loss_in_the_pass_that_a_node_returns_is_out_of_the_group_it_grows_to(
    tmp_path: Any,
) -> None:
    """The group went on with replicas [0, 2] after node 1's loss; node 1 comes back and node
    2 is lost before node 0 looks again. Node 0 applies node 2's loss first, then decides that
    the group grows to [0, 1] (not [0, 1, 2] from its members before the loss), with the
    losses it had applied; node 1, which applies node 2's loss before it reads the word, ends
    on the same members."""
    launch = _pair(tmp_path)
    (node_0, supervisor_0), (node_1, supervisor_1) = launch[0], launch[1]
    store = launch.store

    async def main() -> None:
        await launch.lose_1_and_bring_it_back()
        await launch.mark_lost(2)
        await launch.follow(0, 1)

    asyncio.run(main())
    assert json.loads(store.values[KEYS.grown(0, 1, 1)]) == {
        "grown": {"learner": [0, 1]},
        "lead": {"learner": 0},
        "endpoints": {"learner": {"1": "tcp://127.0.0.1:3201"}},
        "stays": {},
        "lost": {"2": 1},
        "sequence": 1,
        "before": [],
        "formations": {"learner": 3},  # after the losses of node 1 and node 2
    }
    assert supervisor_0.restarted == [("learner", [0, 2]), ("learner", [0]), ("learner", [0, 1])]
    assert node_0.view.members["learner"] == node_1.view.members["learner"] == [0, 1]
    assert node_0.membership.shrunk == node_1.membership.shrunk == {"learner": [0, 1]}
    departed = {"splitter": {2: 2}, "learner": {2: 2}}
    assert node_0.membership.departed == node_1.membership.departed == departed
    assert supervisor_1.adopted == [("learner", 1)]
    assert supervisor_1.specs[0].members == [0, 1]
    # Node 1's loss and return and node 2's loss: the formation the group's ranks join.
    assert node_0.view.formations == node_1.view.formations == {"learner": 3}
    assert supervisor_1.specs[0].formation == 3


def test_a_loss_after_node_0_decided_a_growth_is_out_of_the_group_on_every_node(
    tmp_path: Any,
) -> None:
    """Node 0 decides that the group grows back to [0, 1, 2] with node 1; node 2 is lost
    before node 1 reads the word. Node 1 applies node 2's loss first, then leaves node 2's rank
    out of the group it grows to, as node 0 does when it applies the loss after the growth:
    both end on [0, 1]."""
    launch = _pair(tmp_path)
    (node_0, supervisor_0), (node_1, supervisor_1) = launch[0], launch[1]
    store = launch.store

    async def main() -> None:
        await launch.lose_1_and_bring_it_back()
        await launch.follow(0)
        await launch.mark_lost(2)
        await launch.follow(1, 0)

    asyncio.run(main())
    assert json.loads(store.values[KEYS.grown(0, 1, 1)])["grown"] == {"learner": [0, 1, 2]}
    assert supervisor_0.restarted[-1] == ("learner", [0, 1])
    assert node_0.view.members["learner"] == node_1.view.members["learner"] == [0, 1]
    assert node_0.membership.shrunk == node_1.membership.shrunk == {"learner": [0, 1]}
    assert supervisor_1.adopted == [("learner", 1)]
    assert supervisor_1.specs[0].members == [0, 1]
    assert node_0.view.formations == node_1.view.formations == {"learner": 3}
    assert supervisor_1.specs[0].formation == 3


def test_node_0_tells_a_returning_rank_to_take_the_lead_state_before_the_group_grows(
    tmp_path: Any,
) -> None:
    """Node 0 writes the returning rank's rejoin.json in its folder of the shared run
    directory before it says in the store that the group grows back and before its
    membership.json no longer names the group smaller: an attempt that ends before node 1's
    agent reads the word still starts replica 1 from the lead's state. Node 1's agent then
    writes the same file."""
    from asyncrl.manifest.membership import Rejoin

    marker = tmp_path / "node-1" / "roles" / "learner.1" / "rejoin.json"
    launch = _pair(tmp_path)
    supervisor_1 = launch[1][1]
    store = launch.store
    seen_as_grown: list[bool] = []
    plain_set = store.set

    async def set_(key: str, value: str) -> None:
        if key == KEYS.grown(0, 1, 1):
            seen_as_grown.append(marker.exists())
        await plain_set(key, value)

    store.set = set_  # type: ignore[method-assign]

    async def main() -> None:
        await launch.lose_1_and_bring_it_back(marked=False)
        await launch.follow(0)

    asyncio.run(main())
    assert seen_as_grown == [True]
    assert msgspec.json.decode(marker.read_bytes(), type=Rejoin) == Rejoin(
        lead=0, folder=str(tmp_path)
    )
    assert msgspec.json.decode((tmp_path / "membership.json").read_bytes())["shrunk"] == {}
    assert supervisor_1.adopted == []
    asyncio.run(launch.follow(1))
    assert supervisor_1.adopted == [("learner", 1)]
    assert msgspec.json.decode(marker.read_bytes(), type=Rejoin) == Rejoin(
        lead=0, folder=str(tmp_path)
    )


def test_without_shared_storage_only_the_returning_node_tells_its_rank_to_take_the_lead_state(
    tmp_path: Any,
) -> None:
    """Without ``run.shared_storage`` the group grows back as with it, but node 0 writes no
    rejoin.json (its copy of node 1's folder is not the one node 1 reads): node 1's agent
    writes it as it applies the word, saying the run directory is not shared, so the rank
    takes the lead's state over the group."""
    from asyncrl.manifest.membership import Rejoin

    marker = tmp_path / "node-1" / "roles" / "learner.1" / "rejoin.json"
    launch = Launch(tmp_path, GROUP)
    launch.add(0, ["ipc://l0", "tcp://b", "tcp://c"])
    node_1, supervisor_1 = launch.add(1, ["tcp://a", "tcp://b", "tcp://c"])

    async def main() -> None:
        await launch.lose_1_and_bring_it_back()
        await launch.follow(0)

    asyncio.run(main())
    assert not marker.exists()
    assert msgspec.json.decode((tmp_path / "membership.json").read_bytes())["shrunk"] == {}
    asyncio.run(launch.follow(1))
    assert supervisor_1.adopted == [("learner", 1)]
    assert node_1.membership.shrunk == {}
    assert msgspec.json.decode(marker.read_bytes(), type=Rejoin) == Rejoin(
        lead=0, folder=str(tmp_path), shared=False
    )


def test_a_group_stays_smaller_when_the_manifest_says_so(tmp_path: Any) -> None:
    """As above with ``supervision.regrow: false``: node 0 says the group stays at replicas
    [0, 2], and why; nothing starts again and node 1 starts no rank."""
    launch = Launch(tmp_path, STAY)
    said: list[str] = []
    node_0, supervisor_0 = launch.add(0, ["ipc://l0", "tcp://b", "tcp://c"])
    node_0.say = lambda node, message: said.append(message)  # type: ignore[method-assign]
    node_1, supervisor_1 = launch.add(1, ["tcp://a", "tcp://b", "tcp://c"])

    async def main() -> None:
        await launch.lose_1_and_bring_it_back()
        await launch.follow(0, 1)

    asyncio.run(main())
    assert supervisor_0.restarted == [("learner", [0, 2])]
    assert supervisor_1.adopted == supervisor_1.restarted == []
    assert node_0.membership.shrunk == node_1.membership.shrunk == {"learner": [0, 2]}
    assert node_1.membership.departed == {"learner": {1: 1}}
    assert [line for line in said if "stays" in line] == [
        "learner stays at replicas [0, 2] with node 1 back: roles.learner.supervision.regrow "
        "is false"
    ]
    assert not node_1.growing


def _moves(follower: MembershipFollower) -> list[tuple[str, int, list[str], dict[str, int]]]:
    with open(os.path.join(follower.dir, "membership.json"), "rb") as f:
        seen = msgspec.json.decode(f.read())
    return [(c["event"], c["node"], c["departed"], c["moved"]) for c in seen["changes"]]


def test_a_singleton_moved_onto_a_node_moves_on_when_that_node_is_lost(tmp_path: Any) -> None:
    """Node 2 is lost: the counter moves to node 1. Node 2 comes back (the counter stays on
    node 1), then node 1 is lost: the counter runs there now, so it moves again, to its first
    candidate not lost, node 2. Node 0 reaches it at node 2's new address once node 2
    publishes it, never at node 1's dead one, which the store still holds meanwhile."""
    launch = Launch(tmp_path, CHAIN)
    follower, supervisor = launch.add_adopter(0)

    async def follow() -> None:
        assert await launch.follow(0) == ""

    async def main() -> None:
        await follow()
        launch.lose(2, 1)
        await follow()
        launch.moved(1, "tcp://127.0.0.1:5001", [2, 1])
        await follow()
        launch.back(2, 1, "tcp://127.0.0.1:4002")
        await follow()
        launch.lose(1, 1)
        await follow()
        assert follower.membership.moved["counter"][0].endpoint == "tcp://127.0.0.1:5001"
        assert follower.view.groups["counter"].endpoints == ["tcp://127.0.0.1:5001"]
        launch.moved(2, "tcp://127.0.0.1:5002", [1, 1])
        await follow()

    asyncio.run(main())
    assert supervisor.adopted == []  # node 1, then node 2 starts it
    assert follower.membership.moved["counter"][0] == Moved(2, "tcp://127.0.0.1:5002")
    assert follower.view.groups["counter"].endpoints == ["tcp://127.0.0.1:5002"]
    assert _moves(follower) == [
        ("node_lost", 2, ["splitter[2]"], {"counter[0]": 1}),
        ("node_back", 2, [], {"splitter[2]": 2}),
        ("node_lost", 1, ["splitter[1]"], {"counter[0]": 2}),
    ]


def test_a_returned_node_starts_a_singleton_that_moves_on_to_it(tmp_path: Any) -> None:
    """Node 2 came back while the counter, moved away from it at its loss, runs on node 1:
    its new agent's follower learns that from the store, and when node 1 is lost it starts
    the counter (its home's folder, a fresh tcp port) and publishes it with that loss."""
    launch = Launch(tmp_path, CHAIN)
    store = launch.store
    launch.lose(2, 1)
    launch.moved(1, "tcp://127.0.0.1:5001", [2, 1])
    launch.back(2, 1, "tcp://127.0.0.1:4002")
    follower, supervisor = launch.add_adopter(2)

    async def main() -> None:
        assert await launch.follow(2) == ""
        assert supervisor.adopted == []
        launch.lose(1, 1)
        assert await launch.follow(2) == ""
        assert await launch.follow(2) == ""

    asyncio.run(main())
    assert supervisor.adopted == [("counter", 0)]
    published = json.loads(store.values[KEYS.moved(0, "counter", 0)])
    assert (published["node"], published["lost"]) == (2, [1, 1])
    assert published["endpoint"].startswith("tcp://127.0.0.1:")
    assert follower.membership.moved["counter"][0].node == 2
    assert _moves(follower) == [("node_lost", 1, ["splitter[1]"], {"counter[0]": 2})]


def test_a_returned_node_plans_a_loss_in_progress_as_node_0_did(tmp_path: Any) -> None:
    """Node 1 is lost while node 2, back, has not looked yet; node 0 planned that loss with
    node 2 still lost, so the counter (on node 1, candidates 2, 1, 0) moves to node 0. Node 2
    starts no second counter, and never takes node 1's dead address, which the store holds
    until node 0 publishes the counter's new one."""
    launch = Launch(tmp_path, CHAIN)
    launch.lose(2, 1)
    launch.moved(1, "tcp://127.0.0.1:5001", [2, 1])
    launch.back(2, 1, "tcp://127.0.0.1:4002")
    launch.lose(1, 1, lost_with=[1, 2])
    follower, supervisor = launch.add_adopter(2)

    async def main() -> None:
        assert await launch.follow(2) == ""
        assert follower.view.groups["counter"].endpoints != ["tcp://127.0.0.1:5001"]
        launch.moved(0, "tcp://127.0.0.1:5000", [1, 1])
        assert await launch.follow(2) == ""

    asyncio.run(main())
    assert supervisor.adopted == []
    assert follower.membership.moved["counter"][0] == Moved(0, "tcp://127.0.0.1:5000")
    assert follower.view.groups["counter"].endpoints == ["tcp://127.0.0.1:5000"]


def test_a_returned_node_starts_a_singleton_that_a_loss_before_its_first_look_moves_to_it(
    tmp_path: Any,
) -> None:
    """Node 1 is lost after node 2 came back, before node 2's first look: node 0 planned it
    with node 1 alone, so the counter moves to node 2, which starts it."""
    launch = Launch(tmp_path, CHAIN)
    store = launch.store
    launch.lose(2, 1)
    launch.moved(1, "tcp://127.0.0.1:5001", [2, 1])
    launch.back(2, 1, "tcp://127.0.0.1:4002")
    launch.lose(1, 1, lost_with=[1])
    follower, supervisor = launch.add_adopter(2)

    async def main() -> None:
        assert await launch.follow(2) == ""
        assert await launch.follow(2) == ""

    asyncio.run(main())
    assert supervisor.adopted == [("counter", 0)]
    published = json.loads(store.values[KEYS.moved(0, "counter", 0)])
    assert (published["node"], published["lost"]) == (2, [1, 1])
    assert follower.membership.moved["counter"][0].node == 2


def test_node_0_marks_a_loss_with_the_nodes_lost_beside_it(tmp_path: Any) -> None:
    launch = Launch(tmp_path, CHAIN)
    store = launch.store
    launch.add_adopter(0)

    async def main() -> None:
        await launch.mark_lost(2, "silent")
        assert await launch.follow(0) == ""
        await launch.mark_lost(1, "silent too")

    asyncio.run(main())
    assert json.loads(store.values[KEYS.lost(0, 2)]) == {
        "reason": "silent",
        "generation": 1,
        "with": [2],
        "formations": {},  # no group over several nodes in the manifest
    }
    assert json.loads(store.values[KEYS.lost(0, 1)])["with"] == [1, 2]


def test_a_loss_answered_by_a_return_of_the_same_generation_is_over(tmp_path: Any) -> None:
    launch = Launch(tmp_path)
    store = launch.store

    async def generation() -> int:
        return await lost_generation(store, KEYS, 0, 2)  # type: ignore[arg-type]

    assert asyncio.run(generation()) == 0
    launch.lose(2, 1)
    assert asyncio.run(generation()) == 1
    store.values[KEYS.back(0, 2)] = json.dumps({"generation": 1})
    assert asyncio.run(generation()) == 0
    launch.lose(2, 2)
    assert asyncio.run(generation()) == 2


def test_the_heartbeat_beats_on_its_own_while_the_agent_is_busy(monkeypatch: Any) -> None:
    """The heartbeat is a task of its own: it beats while the rest of the agent waits on
    something else (here an event nobody sets), so that a node starting its roles is not
    taken as lost."""
    monkeypatch.setattr(multinode, "HEARTBEAT_INTERVAL_S", 0.001)
    store = DictStore()
    env = LaunchEnv(
        node=2, nodes=3, master_addr="127.0.0.1", master_port=1, run_id="", agent_store=True
    )
    attempt = NodeAttempt(
        env,
        store,  # type: ignore[arg-type]
        KEYS,
        0,
        parse_manifest(MANIFEST, nodes=3),
        "/nonexistent",
    )

    async def main() -> None:
        busy = asyncio.Event()
        async with asyncio.TaskGroup() as tasks:
            beating = tasks.create_task(attempt.heartbeat())
            while len(store.writes) < 3:
                store.changed.clear()
                await store.changed.wait()
            assert not busy.is_set()
            beating.cancel()

    asyncio.run(main())
    key = KEYS.heartbeat(0, 2)
    assert store.writes[:3] == [(key, "0"), (key, "1"), (key, "2")]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rows(node: int) -> list[dict[str, Any]]:
    """The one process a node's supervisor reports: its splitter replica, not serving yet."""
    return [
        {
            "role": "splitter",
            "replica": node,
            "kind": "role",
            "incarnation": 0,
            "pid": 1000 + node,
            "alive": True,
            "serving": False,
            "standby_pid": None,
            "restarts": 0,
            "heartbeat_age_s": 0.1,
        }
    ]


def test_status_asks_a_returned_node_at_its_new_agent(tmp_path: Any) -> None:
    """Node 2 is lost (``asyncrl status`` on node 0 lists it lost), then its torchrun starts
    again with a new agent on another port: the follower writes that endpoint into the view,
    and node 0's status server, built on the same view, asks the new agent and shows node 2
    back with its processes, not an error from the dead agent's old port."""
    launch = Launch(tmp_path, MANIFEST)
    run_dir = launch.run_dir
    follower, _ = launch.add_adopter(0)
    agents = {n: f"tcp://127.0.0.1:{_port()}" for n in (0, 1, 2)}
    follower.view.agents.update(agents)
    returned = f"tcp://127.0.0.1:{_port()}"
    manifest = parse_manifest(MANIFEST, nodes=3)
    node_0 = status_server(lambda: _rows(0), manifest, run_dir, follower.view, log=None)
    node_0.timeout_s = 0.5  # node 0 has no driver here: it answers with the error at once
    node_1 = AgentStatus(
        lambda: _rows(1), run="elastic", run_dir=str(tmp_path / "node-1"), node=1, tcp=agents[1]
    )
    node_2 = AgentStatus(
        lambda: _rows(2), run="elastic", run_dir=str(tmp_path / "node-2"), node=2, tcp=returned
    )

    def seen(answer: dict[str, Any]) -> list[tuple[int, str]]:
        return [
            (n["node"], n.get("lost") or n.get("error") or f"pid {n['processes'][0]['pid']}")
            for n in answer["nodes"]
        ]

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        await launch.follow(0)
        await node_0.start()
        await node_1.start()
        try:
            launch.lose(2, 1)
            await launch.follow(0)
            while_lost = await ask(run_dir, 0.5)
            await node_2.start()
            launch.back(2, 1, "tcp://127.0.0.1:4002", agent=returned)
            await launch.follow(0)
            return while_lost, await ask(run_dir, 0.5)
        finally:
            for agent in (node_0, node_1, node_2):
                await agent.close()

    while_lost, after = asyncio.run(main())
    assert follower.view.agents[2] == returned
    assert seen(while_lost) == [
        (0, "pid 1000"),
        (1, "pid 1001"),
        (2, "the agent of node 2 sent no heartbeat for 4 s"),
    ]
    assert seen(after) == [(0, "pid 1000"), (1, "pid 1001"), (2, "pid 1002")]
    assert [c["event"] for c in after["membership"]["changes"]] == ["node_lost", "node_back"]


def test_two_nodes_back_in_one_look_of_node_0_both_grow_the_group(tmp_path: Any) -> None:
    """Nodes 1 and 2 are lost and the learner goes on with replica 0 alone; both come back
    before node 0 looks again. Node 0 decides node 1's return first ([0, 1]), then node 2's
    from the members the first grew to ([0, 1, 2]), in that order (``sequence``); node 1, which
    applies both, ends on the same members."""
    launch = _pair(tmp_path)
    (node_0, supervisor_0), (node_1, supervisor_1) = launch[0], launch[1]
    store = launch.store

    async def main() -> None:
        await launch.lose_1_and_2()
        launch.rejoin(1, {"learner": [0]})
        launch.back_with_rank(1)
        launch.back_with_rank(2)
        await launch.follow(1, 0, 1)

    asyncio.run(main())
    first = json.loads(store.values[KEYS.grown(0, 1, 1)])
    second = json.loads(store.values[KEYS.grown(0, 2, 1)])
    assert (first["grown"], second["grown"]) == ({"learner": [0, 1]}, {"learner": [0, 1, 2]})
    assert (first["sequence"], first["before"]) == (1, [])
    assert (second["sequence"], second["before"]) == (2, [[1, 1]])
    assert [members for _, members in supervisor_0.restarted] == [
        [0, 2],
        [0],
        [0, 1],
        [0, 1, 2],
    ]
    assert node_0.view.members["learner"] == node_1.view.members["learner"] == [0, 1, 2]
    assert node_0.membership.shrunk == node_1.membership.shrunk == {}
    assert node_0.membership.departed == node_1.membership.departed == {}
    assert supervisor_1.adopted == [("learner", 1)]


def test_a_node_applies_growth_words_in_the_order_node_0_decided_them(tmp_path: Any) -> None:
    """Nodes 1 and 2 are lost; node 2 comes back and node 0 decides that the learner grows to
    [0, 2]; node 1 comes back and node 0 decides [0, 1, 2]. Node 2, which looks only now, has
    both words to apply: it applies them in the order node 0 decided them, not in node order,
    and ends on [0, 1, 2] as node 0 does."""
    launch = _pair(tmp_path)
    node_0 = launch.followers[0]
    node_2, supervisor_2 = launch.add(2, ["tcp://a", "tcp://b", "tcp://c"])
    store = launch.store

    async def main() -> None:
        await launch.lose_1_and_2()
        launch.rejoin(2, {"learner": [0]})
        launch.back_with_rank(2)
        await launch.follow(2, 0)
        launch.back_with_rank(1)
        await launch.follow(0, 2)

    asyncio.run(main())
    assert json.loads(store.values[KEYS.grown(0, 2, 1)])["grown"] == {"learner": [0, 2]}
    assert json.loads(store.values[KEYS.grown(0, 1, 1)])["grown"] == {"learner": [0, 1, 2]}
    assert node_0.view.members["learner"] == node_2.view.members["learner"] == [0, 1, 2]
    assert node_0.membership.shrunk == node_2.membership.shrunk == {}
    assert supervisor_2.restarted == [("learner", [0, 2]), ("learner", [0, 1, 2])]
    assert supervisor_2.adopted == [("learner", 2)]
    assert supervisor_2.specs[0].members == [0, 2]


def test_a_group_stays_smaller_when_a_rejoin_file_cannot_be_written(
    tmp_path: Any, monkeypatch: Any
) -> None:
    """Node 1 comes back while the shared run directory refuses writes: node 0 says that
    replica 1's rejoin.json cannot be written and that the group stays at [0, 2], says so in
    the store, and goes on following; node 1 starts no rank."""
    from asyncrl.supervision import membership_follower

    launch = _pair(tmp_path)
    (node_0, supervisor_0), (node_1, supervisor_1) = launch[0], launch[1]
    store = launch.store
    said: list[str] = []
    node_0.say = lambda node, message: said.append(message)

    def refuse(*args: Any, **kwargs: Any) -> str:
        raise OSError(116, "Stale file handle")

    async def main() -> None:
        await launch.lose_1_and_bring_it_back(marked=False)
        with monkeypatch.context() as patch:
            patch.setattr(membership_follower, "write_rejoin", refuse)
            assert await launch.follow(0) == ""
        await launch.follow(1)

    asyncio.run(main())
    path = tmp_path / "node-1" / "roles" / "learner.1" / "rejoin.json"
    assert [line for line in said if "stays" in line] == [
        f"learner stays at replicas [0, 2] with node 1 back: {path} cannot be written "
        "([Errno 116] Stale file handle)"
    ]
    decided = json.loads(store.values[KEYS.grown(0, 1, 1)])
    assert (decided["grown"], decided["stays"]) == ({}, {"learner": [0, 2]})
    assert supervisor_0.restarted == [("learner", [0, 2])]
    assert supervisor_1.adopted == supervisor_1.restarted == []
    assert node_0.membership.shrunk == node_1.membership.shrunk == {"learner": [0, 2]}
    assert not path.exists()


def test_a_node_that_misses_a_return_and_the_next_loss_follows_the_later_loss(
    tmp_path: Any,
) -> None:
    """Node 1 is lost, comes back (node 0 grows the group back) and is lost again, all
    between two looks of node 2: node 2 takes the later loss, so its formation of the group
    is node 0's, and it waits on no word for the return in between."""
    launch = _pair(tmp_path)
    node_0 = launch.followers[0]
    node_2, supervisor_2 = launch.add(2, ["tcp://a", "tcp://b", "ipc://c"])

    async def main() -> None:
        await launch.follow(0, 2)
        await launch.mark_lost(1)
        await launch.follow(0, 2)
        launch.back_with_rank(1)
        await launch.follow(0)
        await launch.mark_lost(1)
        await launch.follow(0, 2)

    asyncio.run(main())
    assert node_0.view.formations == node_2.view.formations == {"learner": 3}
    assert node_0.view.members["learner"] == node_2.view.members["learner"] == [0, 2]
    assert node_2.losses == {1: 2}
    assert node_2.growing == set()
    assert supervisor_2.restarted == [("learner", [0, 2])]


def test_only_a_change_of_members_changes_a_group_s_formation(tmp_path: Any) -> None:
    """Node 1 is lost, comes back while its group stays smaller (``regrow: false``), and is
    lost again. Only the first loss changes the group's members, so only it changes the
    formation its ranks join: between node 0's look and node 2's, a rank of the group started
    again on either node (a failure restart) joins the same rendezvous as the other's."""
    launch = Launch(tmp_path, STAY)
    store = launch.store
    node_0, supervisor_0 = launch.add(0, ["ipc://l0", "tcp://b", "tcp://c"])
    node_2, supervisor_2 = launch.add(2, ["tcp://a", "tcp://b", "ipc://c"])
    seen: list[tuple[dict[str, int], dict[str, int]]] = []

    async def main() -> None:
        await launch.follow(0, 2)
        await launch.mark_lost(1, "silent")
        await launch.follow(0, 2)
        launch.back_with_rank(1)
        await launch.follow(0)
        seen.append((dict(node_0.view.formations), dict(node_2.view.formations)))
        await launch.follow(2)
        await launch.mark_lost(1, "silent again")
        await launch.follow(0)
        seen.append((dict(node_0.view.formations), dict(node_2.view.formations)))
        await launch.follow(2)

    asyncio.run(main())
    assert seen == [({"learner": 1}, {"learner": 1})] * 2
    assert node_0.view.formations == node_2.view.formations == {"learner": 1}
    assert json.loads(store.values[KEYS.grown(0, 1, 1)])["formations"] == {}
    assert json.loads(store.values[KEYS.lost(0, 1)])["formations"] == {}  # the second loss
    assert supervisor_0.restarted == supervisor_2.restarted == [("learner", [0, 2])]


def test_a_returning_rank_takes_the_state_of_a_replica_left_when_the_lead_is_lost(
    tmp_path: Any,
) -> None:
    """The learner's replica 0, its lead, runs on node 1. Node 2 is lost and the group goes on
    with [0, 1]; node 2 comes back and node 0 decides that the group grows to [0, 1, 2], led by
    replica 0; node 1 is lost before node 2 reads the word. Node 2 applies node 1's loss first
    and grows the group to [1, 2]: its rank takes the state of replica 1, which stayed in the
    group, not that of replica 0, which left it."""
    from asyncrl.manifest.membership import Rejoin

    manifest = SHARED.replace(
        "placement: {nodes: [0, 1, 2]}\n    supervision",
        "placement: {nodes: [1, 0, 2]}\n    supervision",
    )
    launch = Launch(tmp_path, manifest)
    store = launch.store
    node_0, _ = launch.add(0, ["tcp://a", "ipc://b", "tcp://c"])
    node_2, supervisor_2 = launch.add(2, ["tcp://a", "tcp://b", "tcp://c"])

    async def main() -> None:
        await launch.follow(0)
        launch.lose(2, 1)
        await launch.follow(0)
        launch.rejoin(2)
        launch.back_with_rank(2)
        await launch.follow(0)
        launch.lose(1, 1)
        await launch.follow(2, 0)

    asyncio.run(main())
    decided = json.loads(store.values[KEYS.grown(0, 2, 1)])
    assert (decided["grown"], decided["lead"]) == ({"learner": [0, 1, 2]}, {"learner": 0})
    assert node_0.view.members["learner"] == node_2.view.members["learner"] == [1, 2]
    assert supervisor_2.adopted == [("learner", 2)]
    rejoin = msgspec.json.decode(
        (tmp_path / "node-2" / "roles" / "learner.2" / "rejoin.json").read_bytes(), type=Rejoin
    )
    assert rejoin == Rejoin(lead=1, folder=str(tmp_path))


class LateStore(DictStore):
    """A ``DictStore`` whose ``peek`` does not yet see the keys in ``late``: they were set
    after the follower looked at them in the same pass."""

    def __init__(self, store: DictStore) -> None:
        self.values, self.writes, self.changed = store.values, store.writes, store.changed
        self.late: set[str] = set()

    async def peek(self, key: str) -> str | None:
        return None if key in self.late else self.values.get(key)


def test_a_growth_word_waits_for_the_return_node_0_decided_before_it(tmp_path: Any) -> None:
    """Nodes 1 and 2 are lost; both come back, and node 0 decides node 1's return ([0, 1])
    before node 2's ([0, 1, 2]). Node 2 reads its word in a pass that has not yet seen node 1
    back: it holds the word back until it has seen that return and applied its word first, and
    ends on [0, 1, 2] as node 0 does."""
    launch = _pair(tmp_path)
    node_0 = launch.followers[0]
    store = launch.store
    late = LateStore(store)
    node_2, supervisor_2 = launch.add(2, ["tcp://a", "tcp://b", "tcp://c"], store=late)

    async def main() -> None:
        await launch.lose_1_and_2()
        launch.rejoin(2, {"learner": [0]})
        launch.back_with_rank(2)
        await launch.follow(2)
        launch.back_with_rank(1)
        await launch.follow(0)
        late.late = {KEYS.back(0, 1)}
        await launch.follow(2)
        assert (supervisor_2.adopted, node_2.growing) == ([], {(2, 1)})
        late.late = set()
        await launch.follow(2)

    asyncio.run(main())
    assert json.loads(store.values[KEYS.grown(0, 2, 1)])["before"] == [[1, 1]]
    assert node_0.view.members["learner"] == node_2.view.members["learner"] == [0, 1, 2]
    assert node_0.membership.shrunk == node_2.membership.shrunk == {}
    assert supervisor_2.restarted == [("learner", [0, 1]), ("learner", [0, 1, 2])]
    assert supervisor_2.adopted == [("learner", 2)]
    assert supervisor_2.specs[0].members == [0, 1, 2]


def test_a_rejoining_node_takes_a_return_decided_before_its_own_from_its_own_word(
    tmp_path: Any,
) -> None:
    """Nodes 1 and 2 are lost; node 2 comes back and node 0 grows the learner to [0, 2]; node 1
    comes back and node 0 grows it to [0, 1, 2]. Node 1's agent looks for the first time only
    now: node 2's return came before it, and its word before node 1's, whose members hold it
    already: node 1 applies its own word alone, and reaches node 2's rank at its new port."""
    launch = _pair(tmp_path)
    (node_0, _), (node_1, supervisor_1) = launch[0], launch[1]
    store = launch.store

    async def main() -> None:
        await launch.lose_1_and_2()
        launch.back_with_rank(2)
        await launch.follow(0)
        launch.rejoin(1, {"learner": [0]})
        launch.back_with_rank(1)
        await launch.follow(0, 1)

    asyncio.run(main())
    assert json.loads(store.values[KEYS.grown(0, 1, 1)])["grown"] == {"learner": [0, 1, 2]}
    assert node_0.view.members["learner"] == node_1.view.members["learner"] == [0, 1, 2]
    assert node_1.membership.shrunk == {}
    assert supervisor_1.restarted == [("learner", [0, 1, 2])]
    assert [(c.event, c.node) for c in node_1.membership.changes] == [("group_grown", 1)]
    assert node_1.view.groups["learner"].endpoints[2] == "tcp://127.0.0.1:3202"
    assert node_1.membership.moved["learner"][2] == Moved(2, "tcp://127.0.0.1:3202")
    assert node_1.growing == set()
