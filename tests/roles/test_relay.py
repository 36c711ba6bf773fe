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

from asyncrl.errors import ConfigProblem
from asyncrl.role import Delivery, Role, RoleContext, endpoint
from asyncrl.roles.payloads import Sample, Scored, StepResult, TrainBatch
from asyncrl.roles.relay import Relay, RelayStatus
from asyncrl.roles.rollout import Rollout, WeightsUpdate
from asyncrl.spec import SPEC_FILE_ENV, GroupInfo, ProcessSpec, write_spec
from asyncrl.transport import Client, run
from asyncrl.transport.shm import HOST_ID_ENV, sweep
from asyncrl.weights import NO_VERSION, WeightReader, handle_path, read_handle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
    ``bump`` to publish the next version."""

    class Config(msgspec.Struct):
        seed: int = 7
        start_version: int = 0

    async def setup(self) -> None:
        self.version = self.config.start_version
        self.pulled = 0

    @endpoint(Delivery.IDEMPOTENT)
    async def status(self, _: None) -> dict[str, int]:
        return {"version": self.version, "step": self.version}

    @endpoint(Delivery.IDEMPOTENT)
    async def weights(self, _: None) -> WeightsUpdate:
        self.pulled += 1
        return WeightsUpdate(self.version, state_of(self.config.seed, self.version))

    @endpoint(Delivery.ONCE)
    async def bump(self, _: None) -> int:
        self.version += 1
        return self.version

    @endpoint(Delivery.IDEMPOTENT)
    async def pulled_count(self, _: None) -> int:
        return self.pulled


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
    ) -> str:
        """Start role ``name`` on simulated node ``node`` (host id ``host`` or ``node-N``)."""
        endpoint = self.endpoints.setdefault(name, f"tcp://127.0.0.1:{_free_port()}")
        groups = {n: GroupInfo([e]) for n, e in self.endpoints.items()}
        spec = ProcessSpec(
            kind="role",
            name=name,
            incarnation=incarnation,
            target=target,
            endpoint=endpoint,
            run=self.run,
            run_dir=self.dir(node),
            config=config,
            groups=groups,
        )
        env = {**os.environ, SPEC_FILE_ENV: write_spec(spec), HOST_ID_ENV: host or f"node-{node}"}
        log = open(os.path.join(self.base, f"{name}.{incarnation}.log"), "wb")  # noqa: SIM115
        with log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "asyncrl.process"], cwd=ROOT, env=env, stderr=log
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
    hosts.start("learner", "asyncrl.roles.learner:Learner", 0, learner_config)
    hosts.start("relay", "asyncrl.roles.relay:Relay", 1, {"source": "learner"})
    demos = [
        Sample("d", 0, [2, 3, 12, 4, 5, 13], [6, 7, 1], [], [], True, "stop"),
        Sample("e", 0, [3, 12, 13], [8, 1], [], [], True, "stop"),
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
                    batch = TrainBatch([Scored(demo)], algorithm="bc", id=f"bc-{version}")
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
    publisher = "tests.roles.test_relay:Publisher"
    relay_config = {"source": "learner", "source_wait_s": 60.0}
    hosts.start("learner", publisher, 0, {"seed": 7})
    hosts.start("relay", "asyncrl.roles.relay:Relay", 1, relay_config)

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
            hosts.start("relay", "asyncrl.roles.relay:Relay", 1, relay_config, incarnation=1)
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
def test_a_relay_on_the_sources_host_copies_nothing(hosts: Hosts) -> None:
    hosts.start("learner", "tests.roles.test_relay:Publisher", 0, {"seed": 3})
    hosts.start("relay", "asyncrl.roles.relay:Relay", 1, {"source": "learner"}, host="node-0")

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


def test_config_and_a_missing_source_are_refused() -> None:
    with pytest.raises(msgspec.ValidationError, match="source_wait_s: expected a number > 0"):
        Relay(RoleContext.local(config={"source_wait_s": 0}))
    relay = Relay(RoleContext.local(config={"source": "learner"}, name="relay"))
    with pytest.raises(ConfigProblem) as caught:
        run(relay.setup())
    assert str(caught.value) == (
        "roles.relay.config.source: the run has no role 'learner' (roles: none); name the role "
        "that publishes the weights"
    )
