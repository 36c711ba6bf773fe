"""The relay's second transport: the weights cross through the plugin's broadcast (gloo here) on a
group of two, the relay's and the learner's, formed for each transfer.

As in ``test_relay.py``, the source runs with ``ASYNCRL_HOST_ID=node-0`` in ``RUN/node-0`` and
the relay with ``node-1`` in ``RUN/node-1``, each in its own process, over real tcp sockets; the
fault tests run the relay in this process (as ``node-1``) to see the error its transfer raises.
A source or relay dies mid-transfer by a hook after its first bucket, never after a sleep.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from asyncrl.errors import BrokenError, RemoteError, TornReadError
from asyncrl.manifest.spec import GroupInfo
from asyncrl.role import Delivery, Role, RoleContext, endpoint
from asyncrl.roles.generation.rollout import WeightsUpdate
from asyncrl.roles.payloads import Sample, Scored, StepResult, TrainBatch
from asyncrl.roles.services.relay import Relay, RelayStatus
from asyncrl.roles.training.lead_refusal import NotLeaderError
from asyncrl.roles.training.learner_weights import PublishedWeights
from asyncrl.transport import run
from asyncrl.transport.shm import HOST_ID_ENV
from asyncrl.weights import WeightStore
from asyncrl.weights.broadcast import Rendezvous, bucket_plan
from asyncrl.weights.layout import TensorSpec
from tests.services.test_relay import (
    MODEL,
    START_S,
    Hosts,
    _assert_same,
    _client,
    _read_relayed,
    hosts,
    state_of,
)

__all__ = ["hosts"]  # the fixture, shared with test_relay.py

BROADCAST = {"source": "learner", "transport": "broadcast", "bucket_mib": 1, "poll_s": 0}
"""A relay over the broadcast; 1 MiB buckets part ``state_of``'s weights in two."""


class _Faulty(PublishedWeights):
    """Published weights that, once armed, after the first bucket of a transfer: ``die`` (the
    process kills itself) or ``lap`` (publish two versions, overwriting the one being sent)."""

    armed = ""
    seed = 0
    latest = 0

    def after_bucket(self, number: int) -> None:
        if self.armed == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.armed == "lap" and self.store is not None:
            self.armed = ""
            for _ in range(2):
                self.latest += 1
                self.store.publish(state_of(self.seed, self.latest), self.latest)


class Publisher(Role):
    """A learner's weight endpoints over a real ``PublishedWeights`` store: ``status``,
    ``broadcast_weights`` (the learner's own code; each outcome recorded), ``bump`` to publish
    the next version, ``arm`` a fault in the next transfer, ``outcomes`` to wait for them."""

    class Config(msgspec.Struct):
        seed: int = 7
        start_version: int = 0

    async def setup(self) -> None:
        self.published = _Faulty(
            self.ctx,
            torch.nn.Module(),
            dtype=torch.float32,
            sharded=False,
            bucket_bytes=2**20,
            enabled=True,
        )
        self.published.store = WeightStore(
            state_of(self.config.seed, 0), run=self.ctx.run, incarnation=self.ctx.incarnation
        )
        self.published.seed = self.config.seed
        self.published.latest = version = self.config.start_version
        self.published.store.publish(state_of(self.config.seed, version), version)
        self.done: list[str] = []
        self.changed = asyncio.Event()

    async def teardown(self) -> None:
        self.published.close()

    @endpoint(Delivery.IDEMPOTENT)
    async def status(self, _: None) -> dict[str, int]:
        return {"version": self.published.latest}

    @endpoint(Delivery.IDEMPOTENT)
    async def broadcast_weights(self, rendezvous: Rendezvous) -> int:
        try:
            version = await asyncio.to_thread(self.published.broadcast, rendezvous)
        except Exception as exc:
            self.done.append(type(exc).__name__)
            raise
        finally:
            self.changed.set()
        self.done.append("ok")
        return version

    @endpoint(Delivery.ONCE)
    async def bump(self, _: None) -> int:
        self.published.latest += 1
        version = self.published.latest
        assert self.published.store is not None
        self.published.store.publish(state_of(self.config.seed, version), version)
        return version

    @endpoint(Delivery.ONCE)
    async def arm(self, fault: str) -> None:
        self.published.armed = fault

    @endpoint(Delivery.IDEMPOTENT)
    async def outcomes(self, count: int) -> list[str]:
        """The outcomes of the transfers so far, once there are at least ``count``."""
        while len(self.done) < count:
            self.changed.clear()
            await self.changed.wait()
        return self.done


class DyingRelay(Relay):
    """A relay whose process kills itself after writing the first bucket it receives."""

    def _publish_buckets(self, table: Any, buckets: Iterator[dict[str, torch.Tensor]]) -> None:
        def first_then_die() -> Iterator[dict[str, torch.Tensor]]:
            for bucket in buckets:
                yield bucket
                os.kill(os.getpid(), signal.SIGKILL)

        super()._publish_buckets(table, first_then_die())


def _relay_here(hosts: Hosts, **config: Any) -> Relay:
    """A relay of node 1 in this process, its source the publisher ``learner``."""
    groups = {"learner": GroupInfo([hosts.endpoints["learner"]])}
    ctx = RoleContext.local(
        config={**BROADCAST, **config},
        name="relay",
        run=hosts.run,
        run_dir=hosts.dir(1),
        groups=groups,
    )
    return Relay(ctx)


def test_buckets_hold_at_most_their_bytes_or_one_larger_tensor_each() -> None:
    def spec(name: str, nbytes: int) -> TensorSpec:
        return TensorSpec(name, "uint8", (nbytes,), 0, nbytes)

    specs = (spec("a", 100), spec("b", 10), spec("c", 300), spec("d", 0), spec("e", 40))
    # a at 0, b at 128 (aligned to 64): 138; c alone (300 > 256); d and e after it fit no more.
    assert bucket_plan(specs, 256) == ([2, 1, 2], [138, 300, 40])
    assert bucket_plan(specs, 2**20) == ([5], [552])
    assert bucket_plan((), 256) == ([], [])


def test_only_the_replica_holding_the_store_broadcasts() -> None:
    """A replica that does not lead refuses as a follower (its caller asks the lead again);
    the lead with publishing off says so."""

    def published(ctx: RoleContext, enabled: bool = True) -> PublishedWeights:
        model = torch.nn.Module()
        return PublishedWeights(
            ctx, model, dtype=torch.float32, sharded=False, bucket_bytes=1, enabled=enabled
        )

    rendezvous = Rendezvous(host="127.0.0.1", port=1, prefix="p", timeout_s=1.0, bucket_bytes=1)
    follower = published(RoleContext.local(name="learner", replica=1, replicas=2))
    with pytest.raises(NotLeaderError) as err:
        follower.broadcast(rendezvous)
    assert str(err.value) == (
        "learner.1: only its group's lead holds the weight store broadcast_weights sends "
        "from, and this replica does not lead its group; call the group's lead (the lowest "
        "replica still in the run)"
    )
    with pytest.raises(NotLeaderError, match=r"^learner.1: a sharded learner \(parallel: fsdp\) "):
        follower.read()
    # Replica 1 leads once a node's loss left it the group's lowest member.
    off = published(RoleContext.local(name="learner", replica=1, replicas=2, members=[1]), False)
    with pytest.raises(ValueError) as err:
        off.broadcast(rendezvous)
    assert type(err.value) is ValueError
    assert str(err.value) == (
        "learner.1: only its group's lead holds the weight store broadcast_weights sends "
        "from, and it publishes none: set roles.learner.config.publish_weights on"
    )


def _read_at(path: str) -> tuple[str, int, dict[str, torch.Tensor]]:
    """What a rollout replica reads through the handle at ``path``: (the store's segment,
    its version, its tensors)."""
    from asyncrl.weights import read_handle
    from asyncrl.weights.reader import WeightReader

    handle = read_handle(path)
    assert handle is not None
    with WeightReader(handle) as reader:
        version, state = reader.read()
    return handle.segment, version, state


def test_the_lead_points_its_host_s_handle_back_at_its_own_store(tmp_path: Any) -> None:
    """A relay on the lead's host that still took the group's lead to be on another host (the
    lead came here as its group grew back) replaced its store and wrote the host's handle,
    then closed that store as it followed the lead here. The lead's next version writes its
    own handle again, and a reader opening the handle reads that version; a handle nobody
    touched is not written again."""
    from asyncrl.weights import handle_path, read_handle, write_handle

    ctx = RoleContext.local(name="learner", run_dir=str(tmp_path))
    model = torch.nn.Linear(2, 2)
    published = PublishedWeights(
        ctx, model, dtype=torch.float32, sharded=False, bucket_bytes=2**20, enabled=True
    )
    published.open(model.state_dict(), 1)
    assert published.store is not None
    mine = published.store.describe().segment
    path = handle_path(ctx.run_dir, "learner")
    handle = read_handle(path)
    assert handle is not None and handle.segment == mine
    written = os.stat(path).st_ino
    published.publish(2)
    assert os.stat(path).st_ino == written  # nobody touched it: not written again
    relays = WeightStore(model.state_dict(), run=ctx.run, incarnation=5)
    relays.publish(model.state_dict(), 2)
    write_handle(path, relays.describe())
    relays.close()
    with torch.no_grad():
        model.weight.add_(1.0)
    published.publish(3)
    segment, version, state = _read_at(path)
    published.store.close()
    assert segment == mine and version == 3
    assert torch.equal(state["weight"], model.weight.detach())


def test_a_relay_points_its_host_s_handle_back_at_its_own_store(tmp_path: Any) -> None:
    """The group's lead ran on the relay's host for a while (a node's loss) and wrote the
    host's handle, then moved off again (its group grew back) before the relay saw it there:
    the relay publishes the next version into its own store, and writes the handle again, so
    the host's rollouts read that version rather than the lead's closed store."""
    from asyncrl.roles.generation.rollout import WeightsUpdate
    from asyncrl.weights import handle_path, read_handle, write_handle

    ctx = RoleContext.local(config={"source": "learner"}, name="relay", run_dir=str(tmp_path))
    relay = Relay(ctx)
    relay._publish(WeightsUpdate(1, state_of(3, 1)))
    assert relay.store is not None
    path = handle_path(ctx.run_dir, "learner")
    handle = read_handle(path)
    assert handle is not None and handle.segment == relay.store.name
    lead = WeightStore(state_of(3, 1), run=ctx.run, incarnation=9)
    lead.publish(state_of(3, 2), 2)
    write_handle(path, lead.describe())
    lead.close()
    relay._publish(WeightsUpdate(3, state_of(3, 3)))
    segment, version, state = _read_at(path)
    assert segment == relay.store.name and version == 3
    relay.store.close()
    _assert_same(state, state_of(3, 3))


def test_the_transport_is_pull_or_broadcast() -> None:
    assert Relay(RoleContext.local(config={})).config.transport == "pull"
    with pytest.raises(msgspec.ValidationError, match=r"Invalid enum value 'nccl' - at `\$."):
        Relay(RoleContext.local(config={"transport": "nccl"}))
    with pytest.raises(msgspec.ValidationError, match="bucket_mib: expected an int >= 1, got 0"):
        Relay(RoleContext.local(config={"bucket_mib": 0}))


@pytest.mark.slow
def test_a_real_learners_versions_reach_the_relay_bit_exactly_through_the_broadcast(
    hosts: Hosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HOST_ID_ENV, "node-1")  # this process reads as node 1's rollouts do
    learner_config = {"model_config": MODEL, "seed": 1, "lr": 0.05}
    hosts.start("learner", "asyncrl.roles.training.learner:Learner", 0, learner_config)
    hosts.start("relay", "asyncrl.roles.services.relay:Relay", 1, BROADCAST)
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
                segment, got_version, got = _read_relayed(hosts)
                assert (want.version, got_version) == (version, version)
                _assert_same(got, want.state)
                segments.add(segment)
            status = await relay.call("status", None, RelayStatus)
            assert (status.version, status.pulls, status.relaying) == (2, 3, True)
            assert status.bytes_pulled == sum(t.nbytes for t in want.state.values()) * 3
            assert len(segments) == 1  # one store, republished in place
        finally:
            await learner.close()
            await relay.close()

    run(main())


@pytest.mark.slow
def test_a_torn_or_broken_transfer_fails_typed_and_leaves_the_last_version(
    hosts: Hosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HOST_ID_ENV, "node-1")
    publisher = "tests.services.test_relay_broadcast:Publisher"
    hosts.start("learner", publisher, 0, {"seed": 7})
    relay = _relay_here(hosts, source_wait_s=START_S)

    async def main() -> None:
        source = await _client(hosts.endpoints["learner"])
        try:
            await relay.setup()  # its first transfer: version 0
            assert relay.version == 0
            _assert_same(_read_relayed(hosts)[2], state_of(7, 0))
            assert await source.call("bump") == 1
            assert await relay.sync(None) == 1
            segment, version, got = _read_relayed(hosts)
            assert version == 1
            _assert_same(got, state_of(7, 1))

            # The source publishes twice while it sends version 1: the bucket after goes
            # flagged, and the relay drops the transfer.
            await source.call("arm", "lap")
            with pytest.raises(TornReadError) as torn:
                await relay._broadcast()
            assert str(torn.value) == (
                "learner overwrote version 1 while sending bucket 1; the relay asks again"
            )
            assert await source.call("outcomes", 3, list[str]) == ["ok", "ok", "TornReadError"]
            assert relay.version == 1
            assert _read_relayed(hosts)[:2] == (segment, 1)
            assert await relay.sync(None) == 3
            again, version, got = _read_relayed(hosts)
            assert (again, version) == (segment, 3)
            _assert_same(got, state_of(7, 3))

            # The source publishes version 4, then dies after sending its first bucket.
            assert await source.call("bump") == 4
            await source.call("arm", "die")
            with pytest.raises(BrokenError) as err:
                await relay._broadcast()
            assert "a peer died or closed its connection" in str(err.value)
            assert relay.version == 3
            again, version, got = _read_relayed(hosts)
            assert (again, version) == (segment, 3)  # nothing of version 4 is visible
            _assert_same(got, state_of(7, 3))

            # The source comes back at version 4: the relay's next sync gets it whole.
            hosts.procs.pop("learner").wait(timeout=30)
            hosts.start("learner", publisher, 0, {"seed": 7, "start_version": 4}, incarnation=1)
            assert await relay.sync(None) == 4
            again, version, got = _read_relayed(hosts)
            assert (again, version) == (segment, 4)
            _assert_same(got, state_of(7, 4))
            assert (relay.pulls, relay.bytes_pulled) == (4, 4 * (512 * 640 * 4 + 640 * 2 + 16))
        finally:
            await relay.teardown()
            await source.close()

    run(main())


@pytest.mark.slow
def test_a_relay_dying_mid_transfer_leaves_the_source_serving(
    hosts: Hosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(HOST_ID_ENV, "node-1")
    hosts.start("learner", "tests.services.test_relay_broadcast:Publisher", 0, {"seed": 5})
    hosts.start("relay", "tests.services.test_relay_broadcast:DyingRelay", 1, BROADCAST)

    async def main() -> None:
        source = await _client(hosts.endpoints["learner"])
        try:
            # The relay's setup asks for version 0 and dies in the middle of it; the source
            # sees its side of the transfer broken, typed, and goes on serving.
            assert await source.call("outcomes", 1, list[str], timeout=START_S) == ["BrokenError"]
            hosts.procs.pop("relay").wait(timeout=30)
            assert await source.call("bump") == 1
            hosts.start("relay", "asyncrl.roles.services.relay:Relay", 1, BROADCAST, incarnation=1)
            relay = await _client(hosts.endpoints["relay"])
            try:
                assert await relay.call("sync", None, int, timeout=START_S) == 1
            finally:
                await relay.close()
            assert await source.call("outcomes", 2, list[str]) == ["BrokenError", "ok"]
            _, version, got = _read_relayed(hosts)
            assert version == 1
            _assert_same(got, state_of(5, 1))
        finally:
            await source.close()

    run(main())


@pytest.mark.slow
def test_a_source_that_refuses_fails_the_transfer_with_its_error_at_once(
    hosts: Hosts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A source without ``broadcast_weights`` (or a learner replica other than 0) never comes
    to the rendezvous: the relay stops waiting and raises the source's error, not a timeout."""
    monkeypatch.setenv(HOST_ID_ENV, "node-1")
    hosts.start("learner", "tests.services.test_relay:Publisher", 0, {"seed": 3})
    relay = _relay_here(hosts, timeout_s=START_S)

    async def main() -> None:
        try:
            started = asyncio.get_running_loop().time()
            with pytest.raises(RemoteError, match="broadcast_weights"):
                await relay.setup()
            assert asyncio.get_running_loop().time() - started < START_S
            assert relay.version == -1
        finally:
            await relay.teardown()

    run(main())
