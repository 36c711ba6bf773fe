"""A node's attempt in a launch (``asyncrl.supervision.multinode``): a store that fails during
the attempt, while its heartbeat runs beside it, reaches ``asyncrl.launch`` as the store's own
error, which it says in one line."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
from typing import Any

import msgspec
import pytest

from asyncrl.supervision import multinode
from asyncrl.supervision.store_registry import StoreError
from tests.conftest import ROOT


class _Store:
    """A store that answers what the attempt asks before it takes part."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def connect(self) -> None:
        pass

    async def peek(self, key: str) -> None:
        return None


class _Attempt:
    """An attempt that prepares, and beats until cancelled."""

    def __init__(self) -> None:
        self.beating = asyncio.Event()

    async def prepare(self, args: argparse.Namespace, timeout_s: float) -> str:
        return ""

    def write_launch(self) -> None:
        pass

    async def heartbeat(self) -> None:
        while True:
            self.beating.set()
            await asyncio.sleep(0.001)


def test_a_store_failing_during_the_attempt_is_said_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    async def join(*args: Any, **kwargs: Any) -> _Attempt:
        return _Attempt()

    async def take_part(args: argparse.Namespace, a: _Attempt) -> int:
        await a.beating.wait()  # the heartbeat runs beside the attempt
        raise StoreError("waited 300 s for node 1 to publish its endpoints")

    monkeypatch.setattr(multinode, "StoreClient", _Store)
    monkeypatch.setattr(multinode.NodeAttempt, "join", join)
    monkeypatch.setattr(multinode, "_take_part", take_part)
    for name, value in {
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
        "TORCHELASTIC_RUN_ID": "r",
    }.items():
        monkeypatch.setenv(name, value)
    umask = os.umask(0o022)
    try:
        code = multinode.main([f"{ROOT}/examples/hello/manifest.yaml", "--run-dir", str(tmp_path)])
    finally:
        os.umask(umask)
    err = capsys.readouterr().err
    assert code == 1
    assert err == "asyncrl.launch[node 0]: waited 300 s for node 1 to publish its endpoints\n"


class _BeatingStore:
    """The store's calls node 0's ``finish`` makes, over a dict; ``beating`` nodes raise their
    heartbeat at each look."""

    def __init__(self, beating: set[str]) -> None:
        self.values: dict[str, str] = {}
        self.beating = beating

    async def set(self, key: str, value: str) -> None:
        self.values[key] = value

    async def set_once(self, key: str, value: str) -> str:
        return self.values.setdefault(key, value)

    async def check(self, key: str) -> bool:
        return key in self.values

    async def peek(self, key: str) -> str | None:
        if key in self.beating:
            self.values[key] = str(int(self.values.get(key, "0")) + 1)
        return self.values.get(key)

    async def add(self, key: str, amount: int) -> int:
        self.values[key] = str(int(self.values.get(key, "0")) + amount)
        return int(self.values[key])


def test_node_0_does_not_wait_for_a_node_lost_as_the_run_ends(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run ends on node 0 just as node 2 dies, before the watch took it as lost: node 0
    stops waiting for node 2 once its heartbeat has been silent for the liveness (not for the
    join timeout), and counts it in torchrun's exit barrier, so that the live torchruns exit
    at once rather than after the barrier's 300 s. Node 1, whose heartbeat goes on, is
    waited for until it says it stopped its roles, then until its torchrun checked in to the
    barrier: node 0's torchrun, the store's host, is the last to check in, so it exits only
    once every live torchrun is in the barrier (none loses the store on its way in)."""
    from asyncrl.manifest.load import load_manifest
    from asyncrl.supervision.runreport import RunReport
    from asyncrl.supervision.store_registry import LaunchKeys

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r")
    keys = LaunchKeys("r")
    store = _BeatingStore({keys.heartbeat(0, 1)})
    env = multinode.LaunchEnv(0, 3, "127.0.0.1", 1, "r", False)
    manifest = load_manifest(f"{ROOT}/examples/hello/manifest.yaml")
    a = multinode.NodeAttempt(env, store, keys, 0, manifest, str(tmp_path))  # type: ignore[arg-type]

    barrier = f"r/{multinode.TORCHRUN_EXIT_BARRIER}/num_members"
    looked = asyncio.Event()
    add = store.add

    async def counting(key: str, amount: int) -> int:
        if key == barrier and amount == 0:
            looked.set()
        return await add(key, amount)

    store.add = counting  # type: ignore[method-assign]

    async def main() -> int:
        finishing = asyncio.create_task(
            a.finish(RunReport("completed", "the program returned"), 60.0, (), 0.5)
        )
        await asyncio.sleep(1.5)
        assert not finishing.done()  # node 1 beats and has not said it stopped
        await store.set(keys.done(0, 1), '{"restarts": {"splitter": 2}, "served": {}}')
        # Node 1's worker exits; its torchrun checks in a moment later.
        await asyncio.wait_for(looked.wait(), 10)  # node 0 looks at the barrier's count
        await asyncio.sleep(0.5)
        assert not finishing.done()  # node 0 waits for node 1's torchrun in the barrier
        assert store.values.get(barrier, "0") == "0"  # node 2 not counted yet: 1 + 1 < 3
        await store.add(barrier, 1)
        return await asyncio.wait_for(finishing, 10)

    assert asyncio.run(main()) == 0
    # Node 1's torchrun and node 2, counted by node 0: node 0's torchrun makes it 3, the last.
    assert store.values[barrier] == "2"
    err = capsys.readouterr().err
    assert re.search(
        r"the agent of node 2 sent no heartbeat for \d+\.\d s as the run ended: node 2 is lost", err
    )
    assert "waited" not in err


class _RecordStore(_BeatingStore):
    """``_BeatingStore`` with the calls ``discover`` makes."""

    async def get(self, key: str) -> str:
        return self.values[key]

    async def wait_for(self, keys: list[str], timeout_s: float, *, why: str = "") -> None:
        missing = [k for k in keys if k not in self.values]
        assert not missing, missing


def test_a_node_back_twice_keeps_the_endpoint_of_its_rank_that_the_group_went_on_without(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 1 holds learner[1] of a data-parallel group over nodes 0 and 1 that went on without
    it. Back in the running attempt, the node does not start that rank, and the others know it
    at the endpoint of node 1's first record; node 1's new record keeps it among those it does
    not start, so that its second return (its record then replaced once already) still knows
    it, rather than an empty endpoint."""
    from asyncrl.manifest.load import load_manifest
    from asyncrl.supervision.hosts import HostRecord
    from asyncrl.supervision.store_registry import LaunchKeys, NodeRecord
    from tests.integration.test_node_loss import _learner_over_nodes_0_and_1

    monkeypatch.setattr(
        multinode, "announce", lambda folder: HostRecord(host="h", weights="/w", token="t")
    )
    keys = LaunchKeys("r")
    store = _RecordStore(set())
    first = NodeRecord(
        replicas={"learner": {1: "tcp://10.0.0.2:5001"}, "rollout": {1: "tcp://10.0.0.2:5002"}},
        agent="tcp://10.0.0.2:5000",
        host=HostRecord(host="h", weights="/w", token="t"),
    )
    for node in (0, 2):
        other = NodeRecord(
            replicas={}, agent="tcp://x:1", host=HostRecord(host="h", weights="/w", token="t")
        )
        store.values[keys.endpoints(0, node)] = msgspec.json.encode(other).decode()
    store.values[keys.endpoints(0, 1)] = msgspec.json.encode(first).decode()
    manifest = load_manifest(_learner_over_nodes_0_and_1(str(tmp_path)))
    env = multinode.LaunchEnv(1, 3, "127.0.0.1", 1, "r", False)

    def come_back(generation: int) -> tuple[Any, NodeRecord]:
        a = multinode.NodeAttempt(env, store, keys, 0, manifest, str(tmp_path / "run"))  # type: ignore[arg-type]
        a.rejoining = generation
        view = asyncio.run(a.discover(5.0))
        return view, msgspec.json.decode(store.values[keys.endpoints(0, 1)], type=NodeRecord)

    for generation in (1, 2):
        view, record = come_back(generation)
        assert view.elsewhere == {("learner", 1): "tcp://10.0.0.2:5001"}, generation
        assert record.unserved == {"learner": {1: "tcp://10.0.0.2:5001"}}, generation
        assert "learner" not in record.replicas and set(record.replicas["rollout"]) == {1}


def test_a_group_failure_restart_waits_for_a_beat_raised_after_the_failure(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 1, holding learner[1], raised its last heartbeat and died; learner[0]'s collective
    broke; node 0's watch read that last beat only after the failure. The failure restart is
    held (``_Watch.hold_group``) until node 1 could be marked lost, not let go because a beat
    was read after the failure: it is held until node 1 raises a beat of a new value, and a
    live node 1 lets it go at its next beat."""
    import time
    from types import SimpleNamespace

    from asyncrl.manifest.load import load_manifest
    from asyncrl.supervision.store_registry import LaunchKeys
    from tests.integration.test_node_loss import _learner_over_nodes_0_and_1

    monkeypatch.setattr(multinode, "HEARTBEAT_INTERVAL_S", 0.1)
    keys = LaunchKeys("r")
    store = _BeatingStore(set())
    beat = keys.heartbeat(0, 1)
    store.values[beat] = "7"
    manifest = load_manifest(_learner_over_nodes_0_and_1(str(tmp_path)))
    env = multinode.LaunchEnv(0, 3, "127.0.0.1", 1, "r", False)
    a = multinode.NodeAttempt(env, store, keys, 0, manifest, str(tmp_path / "run"))  # type: ignore[arg-type]
    follower = SimpleNamespace(view=SimpleNamespace(members={}))
    watch = multinode._Watch(a, follower, liveness_s=1.0)  # type: ignore[arg-type]

    async def dead() -> float:
        failed = time.monotonic()
        watch.seen[1] = ("7", failed + 0.05)  # the last beat, first read after the failure
        await asyncio.wait_for(watch.hold_group("learner", failed), 10)
        return time.monotonic() - failed

    assert asyncio.run(dead()) >= 1.3 - 0.05  # the liveness and three heartbeats

    async def alive() -> float:
        failed = time.monotonic()
        holding = asyncio.create_task(watch.hold_group("learner", failed))
        await asyncio.sleep(0.3)
        assert not holding.done()
        store.values[beat] = "8"  # node 1's next beat
        raised = time.monotonic()
        await asyncio.wait_for(holding, 10)
        return time.monotonic() - raised

    assert asyncio.run(alive()) < 1.0


def test_a_run_that_ends_here_is_announced_before_this_node_stops_its_processes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The program finished on node 0: its watch tells the other nodes at once (``stop`` in
    the store), while node 0's supervisor is still stopping its processes, not once they are
    all stopped. A rank on node 0 of a group led from another node waits, as it stops, for its
    lead's last word, which the lead sends only as its own node stops."""
    from types import SimpleNamespace

    from asyncrl.manifest.load import load_manifest
    from asyncrl.supervision.runreport import RunReport
    from asyncrl.supervision.store_registry import LaunchKeys

    class Store(_BeatingStore):
        async def get(self, key: str) -> str:
            return self.values[key]

    monkeypatch.setattr(multinode, "HEARTBEAT_INTERVAL_S", 0.01)
    keys = LaunchKeys("r")
    store = Store(set())
    store.values[keys.current] = "0"
    manifest = load_manifest(f"{ROOT}/examples/hello/manifest.yaml")
    env = multinode.LaunchEnv(0, 3, "127.0.0.1", 1, "r", False)
    a = multinode.NodeAttempt(env, store, keys, 0, manifest, str(tmp_path))  # type: ignore[arg-type]

    async def follow(supervisor: Any) -> str:
        return ""

    follower = SimpleNamespace(follow=follow, lost={})
    watch = multinode._Watch(a, follower, liveness_s=10.0)  # type: ignore[arg-type]
    supervisor = SimpleNamespace(ended=None)

    async def main() -> None:
        watching = asyncio.create_task(watch(supervisor))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        assert keys.stop(0) not in store.values and not watching.done()
        supervisor.ended = RunReport("completed", "the control-flow program finished")
        await asyncio.wait_for(watching, 5)

    asyncio.run(main())
    assert store.values[keys.stop(0)] == multinode._ended(
        "completed", "the control-flow program finished", 0
    )
