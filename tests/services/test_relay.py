"""The per-host weight relay, in real processes over real tcp sockets, on two simulated hosts.

The publisher (a real learner, or ``Publisher`` below, which counts its pulls) runs with
``ASYNCRL_HOST_ID=node-0`` in ``RUN/node-0``; the relay with ``node-1`` in ``RUN/node-1``, so no
shared memory passes between them and the weights travel as tensor frames over tcp. This test
process then reads the relay's store as a rollout replica of node 1 would.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import torch

from asyncrl.clock import FakeClock
from asyncrl.errors import ConfigProblem, StallError
from asyncrl.manifest.spec import SPEC_FILE_ENV, GroupInfo, ProcessSpec, write_spec
from asyncrl.role import Delivery, Role, RoleContext, endpoint
from asyncrl.roles.generation.rollout import Rollout, WeightsUpdate
from asyncrl.roles.payloads import Sample, Scored, StepResult, TrainBatch
from asyncrl.roles.sampling.weight_sync import WeightSync, relay_groups
from asyncrl.roles.services.relay import Relay, RelayStatus
from asyncrl.roles.training.lead_refusal import NotLeaderError
from asyncrl.transport import Client, run
from asyncrl.transport.shm import HOST_ID_ENV, sweep
from asyncrl.weights import NO_VERSION, WeightReader, handle_path, read_handle
from benchmarks import multinode
from tests.conftest import ROOT

START_S = 90.0  # a process's start-up (imports torch, and transformers for the learner)

MODEL = {
    "model_type": "gpt2",
    "vocab_size": 14,
    "n_positions": 24,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 2,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "pad_token_id": 0,
}


def state_of(seed: int, version: int) -> dict[str, torch.Tensor]:
    """The fake publisher's weights at ``version``: three dtypes, one tensor over 1 MiB."""
    g = torch.Generator().manual_seed(seed * 1000 + version)
    return {
        "w": torch.randn(512, 640, generator=g),
        "b": torch.randn(640, generator=g).to(torch.bfloat16),
        "step": torch.tensor([version, seed], dtype=torch.int64),
    }


class Publisher(Role):
    """A learner's weight endpoints and nothing else: ``status``, ``weights`` (counted), and
    ``bump`` to publish the next version. ``refusals``: its first pulls are refused as a
    follower of its group refuses them (the new lead's old process, before its agent restarts
    it as the lead)."""

    class Config(msgspec.Struct):
        seed: int = 7
        start_version: int = 0
        refusals: int = 0

    async def setup(self) -> None:
        self.version = self.config.start_version
        self.pulled = 0
        self.refused = 0

    @endpoint(Delivery.IDEMPOTENT)
    async def status(self, _: None) -> dict[str, int]:
        return {"version": self.version, "step": self.version}

    @endpoint(Delivery.IDEMPOTENT)
    async def weights(self, _: None) -> WeightsUpdate:
        if self.refused < self.config.refusals:
            self.refused += 1
            raise NotLeaderError(f"{self.ctx.name}: not its group's lead yet")
        self.pulled += 1
        return WeightsUpdate(self.version, state_of(self.config.seed, self.version))

    @endpoint(Delivery.ONCE)
    async def bump(self, _: None) -> int:
        self.version += 1
        return self.version

    @endpoint(Delivery.IDEMPOTENT)
    async def pulled_count(self, _: None) -> int:
        return self.pulled

    @endpoint(Delivery.IDEMPOTENT)
    async def refused_count(self, _: None) -> int:
        return self.refused


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Hosts:
    """Two simulated hosts' run directories, and the role processes started on them."""

    base: str
    run: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    endpoints: dict[str, str] = field(default_factory=dict)

    def dir(self, node: int) -> str:
        return os.path.join(self.base, f"node-{node}")

    def start(
        self,
        name: str,
        target: str,
        node: int,
        config: dict[str, Any],
        *,
        incarnation: int = 0,
        host: str = "",
        groups: dict[str, list[str]] | None = None,
    ) -> str:
        """Start role ``name`` on simulated node ``node`` (host id ``host`` or ``node-N``);
        ``groups``: the endpoints of groups of several replicas, by role."""
        endpoint = self.endpoints.setdefault(name, f"tcp://127.0.0.1:{_free_port()}")
        groups_ = {n: GroupInfo([e]) for n, e in self.endpoints.items()}
        groups_ |= {n: GroupInfo(list(e)) for n, e in (groups or {}).items()}
        spec = ProcessSpec(
            kind="role",
            name=name,
            incarnation=incarnation,
            target=target,
            endpoint=endpoint,
            run=self.run,
            run_dir=self.dir(node),
            config=config,
            groups=groups_,
        )
        env = {**os.environ, SPEC_FILE_ENV: write_spec(spec), HOST_ID_ENV: host or f"node-{node}"}
        log = open(os.path.join(self.base, f"{name}.{incarnation}.log"), "wb")  # noqa: SIM115
        with log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "asyncrl.supervision.process"], cwd=ROOT, env=env, stderr=log
            )
        return endpoint

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    base = tempfile.mkdtemp(prefix="arl-relay-")
    h = Hosts(base, os.path.basename(base).replace("-", "_"))
    yield h
    h.stop_all()
    sweep(h.run)
    shutil.rmtree(base, ignore_errors=True)


async def _client(endpoint: str) -> Client:
    client = Client(endpoint, name="test")
    await client.connect(timeout=START_S)
    return client


def _read_relayed(
    hosts: Hosts, source: str = "learner"
) -> tuple[str, int, dict[str, torch.Tensor]]:
    """What a rollout replica of node 1 reads: (segment, version, tensors)."""
    handle = read_handle(handle_path(hosts.dir(1), source))
    assert handle is not None
    assert handle.host.endswith("#node-1")
    with WeightReader(handle) as reader:
        version, state = reader.read()
    return handle.segment, version, state


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


@pytest.mark.slow
def test_a_relay_carries_a_real_learners_weights_to_another_host_version_by_version(
    hosts: Hosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HOST_ID_ENV, "node-1")  # this process reads as node 1's rollouts do
    torch.set_num_threads(1)
    learner_config = {"model_config": MODEL, "seed": 1, "lr": 0.05}
    hosts.start("learner", "asyncrl.roles.training.learner:Learner", 0, learner_config)
    hosts.start(
        "relay", "asyncrl.roles.services.relay:Relay", 1, {"source": "learner", "poll_s": 0}
    )
    demos = [
        Sample(
            prompt_id="d",
            sample_index=0,
            prompt_ids=[2, 3, 12, 4, 5, 13],
            token_ids=[6, 7, 1],
            logprobs=[],
            versions=[],
            finished=True,
            stop_reason="stop",
        ),
        Sample(
            prompt_id="e",
            sample_index=0,
            prompt_ids=[3, 12, 13],
            token_ids=[8, 1],
            logprobs=[],
            versions=[],
            finished=True,
            stop_reason="stop",
        ),
    ]

    async def main() -> None:
        learner = await _client(hosts.endpoints["learner"])
        relay = await _client(hosts.endpoints["relay"])
        rollout = Rollout(
            RoleContext.local(
                config={"model_config": MODEL, "seed": 99, "weights_from": "learner"},
                run_dir=hosts.dir(1),
                name="rollout",
                run=hosts.run,
            )
        )
        try:
            segments = set()
            for version, demo in enumerate([None, *demos]):
                if demo is not None:
                    batch = TrainBatch(
                        samples=[Scored(sample=demo)], algorithm="bc", id=f"bc-{version}"
                    )
                    result = await learner.call("train_step", batch, StepResult, timeout=60)
                    assert result.version == version
                assert await relay.call("sync", None, int, timeout=60) == version
                want: WeightsUpdate = await learner.call("weights", None, WeightsUpdate)
                assert want.version == version
                segment, got_version, got = _read_relayed(hosts)
                assert got_version == version
                _assert_same(got, want.state)
                segments.add(segment)
                if version == 0:
                    await rollout.setup()  # a replica of node 1 starts from the relay's store
                else:
                    assert await rollout.sync(None) == version
                _assert_same(dict(rollout.engine.model.state_dict()), want.state)
            status = await relay.call("status", None, RelayStatus)
            assert (status.version, status.pulls, status.relaying) == (2, 3, True)
            assert len(segments) == 1  # one store, republished in place
            learner_handle = read_handle(handle_path(hosts.dir(0), "learner"))
            assert learner_handle is not None and learner_handle.host.endswith("#node-0")
        finally:
            await rollout.teardown()
            await learner.close()
            await relay.close()

    run(main())


@pytest.mark.slow
def test_one_pull_per_version_and_restarts_of_relay_and_source(
    hosts: Hosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HOST_ID_ENV, "node-1")
    publisher = "tests.services.test_relay:Publisher"
    relay_config = {"source": "learner", "source_wait_s": 60.0, "poll_s": 0}
    hosts.start("learner", publisher, 0, {"seed": 7})
    hosts.start("relay", "asyncrl.roles.services.relay:Relay", 1, relay_config)

    async def main() -> None:
        source = await _client(hosts.endpoints["learner"])
        relay = await _client(hosts.endpoints["relay"])
        try:
            for _ in range(3):  # nothing new: nothing pulled after setup's pull
                assert await relay.call("sync", None, int) == 0
            assert await source.call("pulled_count", None, int) == 1
            await source.call("bump")
            assert await source.call("bump") == 2
            assert await relay.call("sync", None, int) == 2  # version 1 is never pulled
            assert await relay.call("sync", None, int) == 2
            assert await source.call("pulled_count", None, int) == 2
            first, version, got = _read_relayed(hosts)
            assert version == 2
            _assert_same(got, state_of(7, 2))
            status = await relay.call("status", None, RelayStatus)
            assert (status.pulls, status.bytes_pulled) == (2, 2 * (512 * 640 * 4 + 640 * 2 + 16))

            # The relay restarts: its setup republishes the newest into a new store.
            hosts.kill("relay")
            hosts.start(
                "relay", "asyncrl.roles.services.relay:Relay", 1, relay_config, incarnation=1
            )
            await relay.close()
            relay = await _client(hosts.endpoints["relay"])
            assert await relay.call("sync", None, int, timeout=START_S) == 2
            second, version, got = _read_relayed(hosts)
            assert second != first and version == 2
            _assert_same(got, state_of(7, 2))
            assert await source.call("pulled_count", None, int) == 3

            # The source restarts at version 5 (a learner resumed from its checkpoint).
            hosts.kill("learner")
            # The relay is asked while the source is down: it tries again until it is back.
            syncing = asyncio.ensure_future(relay.call("sync", None, int, timeout=START_S))
            hosts.start("learner", publisher, 0, {"seed": 7, "start_version": 5}, incarnation=1)
            assert await syncing == 5
            await source.close()
            source = await _client(hosts.endpoints["learner"])
            third, version, got = _read_relayed(hosts)
            assert third == second and version == 5
            _assert_same(got, state_of(7, 5))
            assert await source.call("pulled_count", None, int) == 1
        finally:
            await source.close()
            await relay.close()

    run(main())


@pytest.mark.slow
def test_a_relay_follows_its_source_s_group_to_its_new_lead(
    hosts: Hosts, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The learner as two replicas: replica 0 leads and the relay pulls from it. Replica 0's
    node is lost and the node's ``membership.json`` says the group goes on with replica 1: the
    relay's next sync pulls from replica 1, once replica 1 stops refusing the pull as the
    follower its old process was (its first three pulls: ``NotLeaderError``)."""
    from asyncrl.manifest.membership import MEMBERSHIP_FILE, Membership

    monkeypatch.setenv(HOST_ID_ENV, "node-1")
    publisher = "tests.services.test_relay:Publisher"
    hosts.start("learner", publisher, 0, {"seed": 7, "start_version": 3})
    hosts.start("learner1", publisher, 2, {"seed": 9, "start_version": 4, "refusals": 3})
    group = {"learner": [hosts.endpoints["learner"], hosts.endpoints["learner1"]]}
    relay_config = {"source": "learner", "source_wait_s": 60.0, "poll_s": 0}
    hosts.start("relay", "asyncrl.roles.services.relay:Relay", 1, relay_config, groups=group)

    async def main() -> None:
        relay = await _client(hosts.endpoints["relay"])
        try:
            assert await relay.call("sync", None, int, timeout=START_S) == 3
            _, version, got = _read_relayed(hosts)
            assert version == 3
            _assert_same(got, state_of(7, 3))
            hosts.kill("learner")
            membership = Membership(nodes=3, shrunk={"learner": [1]}, lost={0: "gone"})
            with open(os.path.join(hosts.dir(1), MEMBERSHIP_FILE), "wb") as f:
                f.write(msgspec.json.encode(membership))
            assert await relay.call("sync", None, int, timeout=START_S) == 4
            _, version, got = _read_relayed(hosts)
            assert version == 4
            _assert_same(got, state_of(9, 4))
            learner1 = await _client(hosts.endpoints["learner1"])
            try:
                assert await learner1.call("refused_count", None, int) == 3
                assert await learner1.call("pulled_count", None, int) == 1
            finally:
                await learner1.close()
        finally:
            await relay.close()

    run(main())
    said = capfd.readouterr().out
    assert "relay relay: learner's group is led by replica 1 now (tcp://127.0.0.1:" in said


def test_a_call_to_a_lead_lost_with_its_node_is_given_up_once_the_membership_moves_the_lead(
    tmp_path: Any,
) -> None:
    """A call the relay sent to the source's lead just as the lead's node died is answered by
    nobody, and its client may wait for its deadline (``timeout_s``, 300 s by default). Once
    the node's ``membership.json`` says the group goes on led by replica 1, the relay gives
    the call up within a look or two (about a second each) and follows the new lead; a call
    that answers first is answered as usual."""
    from asyncrl.manifest.membership import MEMBERSHIP_FILE, Membership
    from asyncrl.roles.services import relay as relay_module

    endpoints = ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
    ctx = RoleContext.local(
        config={"source": "learner"},
        name="relay",
        run_dir=str(tmp_path),
        groups={"learner": GroupInfo(endpoints)},
    )
    relay = Relay(ctx)
    relay._endpoint = endpoints[0]
    cancelled = asyncio.Event()

    async def never_answered() -> int:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
        return 0

    async def answered() -> int:
        return 7

    async def main() -> None:
        assert await relay._unless_lead_moves(answered()) == 7
        waiting = asyncio.ensure_future(relay._unless_lead_moves(never_answered()))
        done, _ = await asyncio.wait({waiting}, timeout=2.5)
        assert not done  # the lead has not moved: the call goes on waiting
        membership = Membership(nodes=3, shrunk={"learner": [1]}, lost={0: "gone"})
        with open(os.path.join(str(tmp_path), MEMBERSHIP_FILE), "wb") as f:
            f.write(msgspec.json.encode(membership))
        with pytest.raises(relay_module._LeadMoved):
            await asyncio.wait_for(waiting, timeout=10)
        assert cancelled.is_set()

    asyncio.run(main())


@pytest.mark.slow
def test_a_lead_that_moves_onto_the_relays_host_mid_sync_is_not_copied_over(
    hosts: Hosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay (in this process, on node 1) asks replica 0 (node 0) its version; then, before
    the pull, node 0 is lost and the lead moves to replica 1, which runs on node 1's host: the
    relay copies nothing from it and writes no handle (the new lead's own store serves the
    host), and says it relays no more. The relay moved to node 1 off a lost node: its run_dir
    is its home node's folder, whose membership.json (the group whole) no agent writes any
    more, and it follows node 1's (``node_dir``)."""
    from asyncrl.manifest.membership import MEMBERSHIP_FILE, Membership

    monkeypatch.setenv(HOST_ID_ENV, "node-1")
    publisher = "tests.services.test_relay:Publisher"
    hosts.start("learner", publisher, 0, {"seed": 7, "start_version": 3})
    hosts.start("learner1", publisher, 2, {"seed": 9, "start_version": 4}, host="node-1")
    os.makedirs(hosts.dir(1), exist_ok=True)
    home = hosts.dir(3)
    os.makedirs(home)
    with open(os.path.join(home, MEMBERSHIP_FILE), "wb") as f:
        f.write(msgspec.json.encode(Membership(nodes=4, lost={3: "gone"})))
    ctx = RoleContext.local(
        name="relay",
        run=hosts.run,
        run_dir=home,
        node_dir=hosts.dir(1),
        config={"source": "learner", "source_wait_s": 60.0, "poll_s": 0, "timeout_s": START_S},
        groups={"learner": GroupInfo([hosts.endpoints["learner"], hosts.endpoints["learner1"]])},
    )
    relay = Relay(ctx)
    ask = relay._source_version
    asked: list[int] = []

    async def then_the_lead_moves() -> int:
        version = await ask()
        asked.append(version)
        membership = Membership(nodes=3, shrunk={"learner": [1]}, lost={0: "gone"})
        with open(os.path.join(hosts.dir(1), MEMBERSHIP_FILE), "wb") as f:
            f.write(msgspec.json.encode(membership))
        return version

    monkeypatch.setattr(relay, "_source_version", then_the_lead_moves)

    async def main() -> None:
        await relay.setup()  # its first sync: the race above
        try:
            assert asked[0] == 3  # replica 0 answered the version, then the lead moved
            assert read_handle(handle_path(hosts.dir(1), "learner")) is None
            assert read_handle(handle_path(home, "learner")) is None
            assert relay.relaying is False and relay.store is None
            assert await relay.sync(None) == 4  # the new lead's version, read on its host
            status = await relay.relay_status(None)
            assert status == RelayStatus(NO_VERSION, 0, 0, False, "", "learner")
            for name in ("learner", "learner1"):
                source = await _client(hosts.endpoints[name])
                try:
                    assert await source.call("pulled_count", None, int) == 0, name
                finally:
                    await source.close()
        finally:
            await relay.teardown()

    run(main())


@pytest.mark.slow
def test_a_relay_on_the_sources_host_copies_nothing(hosts: Hosts) -> None:
    hosts.start("learner", "tests.services.test_relay:Publisher", 0, {"seed": 3})
    hosts.start(
        "relay", "asyncrl.roles.services.relay:Relay", 1, {"source": "learner"}, host="node-0"
    )

    async def main() -> None:
        source = await _client(hosts.endpoints["learner"])
        relay = await _client(hosts.endpoints["relay"])
        try:
            await source.call("bump")
            assert await relay.call("sync", None, int) == 1
            status = await relay.call("status", None, RelayStatus)
            assert status == RelayStatus(NO_VERSION, 0, 0, False, "", "learner")
            assert await source.call("pulled_count", None, int) == 0
            assert read_handle(handle_path(hosts.dir(1), "learner")) is None
        finally:
            await source.close()
            await relay.close()

    run(main())


@pytest.mark.slow
def test_a_relay_that_is_not_pushed_to_catches_up_by_polling(
    hosts: Hosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HOST_ID_ENV, "node-1")
    hosts.start("learner", "tests.services.test_relay:Publisher", 0, {"seed": 5})
    hosts.start(
        "relay", "asyncrl.roles.services.relay:Relay", 1, {"source": "learner", "poll_s": 0.1}
    )

    async def main() -> None:
        source = await _client(hosts.endpoints["learner"])
        relay = await _client(hosts.endpoints["relay"])
        try:
            assert (await relay.call("status", None, RelayStatus)).version == 0
            assert await source.call("bump") == 1
            deadline = asyncio.get_running_loop().time() + 30.0
            while (await relay.call("status", None, RelayStatus)).version != 1:
                assert asyncio.get_running_loop().time() < deadline, "the relay never polled"
                await asyncio.sleep(0.05)
            _, version, got = _read_relayed(hosts)
            assert version == 1
            _assert_same(got, state_of(5, 1))
            assert await source.call("pulled_count", None, int) == 2
        finally:
            await source.close()
            await relay.close()

    run(main())


def test_config_and_a_missing_source_are_refused() -> None:
    with pytest.raises(msgspec.ValidationError, match="source_wait_s: expected a number > 0"):
        Relay(RoleContext.local(config={"source_wait_s": 0}))
    with pytest.raises(msgspec.ValidationError, match="poll_s: expected a number >= 0, got -1"):
        Relay(RoleContext.local(config={"poll_s": -1}))
    relay = Relay(RoleContext.local(config={"source": "learner"}, name="relay"))
    with pytest.raises(ConfigProblem) as caught:
        run(relay.setup())
    assert str(caught.value) == (
        "roles.relay.config.source: the run has no role 'learner' (roles: none); name the role "
        "that publishes the weights"
    )


class Group:
    """A role group's ``broadcast`` that logs each call as ``(group, method)`` in a shared log
    and answers the versions scripted, one list per call (the last one repeats)."""

    def __init__(self, name: str, log: list[tuple[str, str]], answers: list[list[int]]) -> None:
        self.name = name
        self.log = log
        self.answers = answers
        self.asked = 0

    async def broadcast(
        self, method: str, payload: Any = None, reply_type: Any = Any, *, timeout: float = 0.0
    ) -> list[Any]:
        self.log.append((self.name, method))
        self.asked += 1
        return self.answers[min(self.asked - 1, len(self.answers) - 1)]


def test_sync_mode_brings_the_relays_to_the_version_before_any_rollout_is_asked() -> None:
    async def main() -> None:
        clock = FakeClock()
        log: list[tuple[str, str]] = []
        relays = [Group("relay", log, [[1], [2]]), Group("relay2", log, [[3]])]
        rollout = Group("rollout", log, [[2, 3]])
        sync = WeightSync(rollout, wait=True, timeout=5.0, clock=clock, relays=relays)
        push = asyncio.ensure_future(sync.push(version=2))
        await clock.wait_for_timers(1)  # relay 1 still holds version 1: asked again later
        assert log == [("relay", "sync")]
        clock.advance(0.1)
        await asyncio.wait_for(push, 10.0)
        assert log == [
            ("relay", "sync"),
            ("relay", "sync"),
            ("relay2", "sync"),
            ("rollout", "sync"),
        ]
        await sync.close()

    run(main())


def test_async_mode_pushes_to_the_relays_then_the_rollouts_in_the_background() -> None:
    async def main() -> None:
        log: list[tuple[str, str]] = []
        rollout = Group("rollout", log, [[0]])
        relay = Group("relay", log, [[0]])
        async with WeightSync(rollout, wait=False, relays=[relay], relay_method="pull") as sync:
            await sync.push()
            await sync.push()
        assert log == [("relay", "pull"), ("rollout", "sync")] * 2

    run(main())


def test_a_relay_that_never_reaches_the_version_stalls_the_push_by_name() -> None:
    async def main() -> None:
        clock = FakeClock()
        log: list[tuple[str, str]] = []
        relay = Group("relay", log, [[1]])
        sync = WeightSync(
            Group("rollout", log, [[2]]), wait=True, timeout=0.25, clock=clock, relays=[relay]
        )
        ensure = asyncio.ensure_future(sync.ensure(2))
        while not ensure.done():
            await clock.wait_for_timers(1)
            clock.advance(0.125)
            await asyncio.sleep(0)
        with pytest.raises(StallError) as err:
            await ensure
        assert str(err.value) == (
            "relays hold weights versions [1] after 0.25 s, not version 2: the publisher's "
            "store never came back (is the learner restarting over and over?)"
        )
        assert ("rollout", "sync") not in log

    run(main())


@pytest.mark.parametrize(
    ("config", "roles", "names"),
    [
        ({}, {"learner", "rollout"}, []),
        ({}, {"learner", "rollout", "relay"}, ["relay"]),
        ({"relays": None}, {"relay"}, ["relay"]),
        ({"relays": []}, {"relay"}, []),
        ({"relays": ["relay-b", "relay-a"]}, {"relay-a", "relay-b"}, ["relay-b", "relay-a"]),
    ],
)
def test_relay_groups_come_from_the_config_or_the_role_named_relay(
    config: dict[str, Any], roles: set[str], names: list[str]
) -> None:
    assert relay_groups(config, dict.fromkeys(roles)) == names


def test_relay_groups_refuse_what_names_no_relay() -> None:
    with pytest.raises(ValueError) as err:
        relay_groups({"relays": ["relay", "relay1"]}, {"relay": None, "learner": None})
    assert str(err.value) == (
        "run.config.relays: no role named 'relay1' in the run (roles: learner, relay); list the "
        "relay roles, or remove relays"
    )
    with pytest.raises(ValueError) as err:
        relay_groups({"relays": "relay"}, {"relay": None})
    assert str(err.value) == "run.config.relays: expected a list of role names, got 'relay'"


def test_the_benchmarks_parameter_count_is_the_built_models() -> None:
    from asyncrl.roles.training.learner import build_model

    model = build_model("", multinode.ARITH, 0)
    assert multinode.parameters(multinode.ARITH) == sum(p.numel() for p in model.parameters())
    assert multinode.parameters(multinode.GPT2_100M) == 99_260_928


@pytest.mark.slow
def test_the_benchmark_syncs_every_path_to_each_rounds_version() -> None:
    """Two rounds of ``asyncrl bench multinode``'s weight sync on the arith model: every sync
    (local, the relay's tcp pull, the relay's broadcast) must end at the round's version (the
    benchmark raises otherwise)."""
    figures = multinode.weight_sync(multinode.ARITH, 1)
    assert sorted(figures) == [
        "cross_host",
        "cross_host_broadcast",
        "local",
        "relay_broadcast",
        "relay_pull",
    ]
    assert 0 < figures["relay_pull"] < figures["cross_host"]
    assert 0 < figures["relay_broadcast"] < figures["cross_host_broadcast"]
    assert figures["local"] > 0
