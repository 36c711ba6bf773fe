"""Roles for ``test_transfer_faults.py``: a publisher of weights that holds a broadcast to one
relay after its first bucket, or a relay's pull after it read the version out of its store,
until a gate file appears, and a reader of its host's weight store, as a rollout replica
reads it.

``Publisher`` keeps a real ``PublishedWeights`` store (the learner's own code for
``broadcast_weights``) holding ``state_of(version)``; ``Reader`` opens the handle its host's
store left (the publisher's on its own host, a relay's elsewhere) and reports the version it
read with a digest of every byte of it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from typing import Any

import msgspec
import torch

from asyncrl import Delivery, Role, endpoint
from asyncrl.roles.generation.rollout import WeightsUpdate
from asyncrl.roles.training.learner_weights import PublishedWeights
from asyncrl.safe_files import write_atomic
from asyncrl.weights import WeightReader, handle_path, read_handle
from asyncrl.weights.broadcast import Rendezvous

__all__ = ["Publisher", "Reader", "digest", "state_of"]

_GATE_WAIT_S = 300.0  # a gate never opened fails the transfer rather than hold it for ever


def state_of(version: int) -> dict[str, torch.Tensor]:
    """The weights of ``version``: two float32 tensors of 1.2 MB each, so a transfer in
    buckets of 1 MiB takes two buckets."""
    g = torch.Generator().manual_seed(1000 + version)
    return {"a": torch.randn(300_000, generator=g), "b": torch.randn(300_000, generator=g)}


def digest(state: dict[str, torch.Tensor]) -> str:
    """A digest of every byte of ``state``, in name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _Held(PublishedWeights):
    """Published weights whose broadcast to the relay ``hold_to`` of version ``hold_version``
    stops after its first bucket: it writes the file ``held`` and waits for the file
    ``gate``. Once."""

    hold_to = ""
    hold_version = -1
    held = ""
    gate = ""
    sending: dict[int, str] = {}  # thread id: the prefix of the transfer it sends

    def broadcast(self, rendezvous: Rendezvous) -> int:
        self.sending[threading.get_ident()] = rendezvous.prefix
        try:
            return super().broadcast(rendezvous)
        finally:
            self.sending.pop(threading.get_ident(), None)

    def after_bucket(self, number: int) -> None:
        prefix = self.sending.get(threading.get_ident(), "")
        assert self.store is not None
        if (
            number != 0
            or f"/{self.hold_to}." not in prefix
            or self.store.version != self.hold_version
        ):
            return
        self.hold_version = -1  # once
        _wait_at_gate(self.held, prefix, self.gate)


class Publisher(Role):
    """The learner's weight endpoints over a real ``PublishedWeights`` store: ``status``,
    ``weights`` (a copy of the store's version, as a sharded learner answers a relay's pull),
    ``held_weights`` (the same, but the pull of version ``hold_pull`` writes the file ``held``
    once it read the version and waits for the file ``gate`` before it answers; once),
    ``broadcast_weights``, ``bump`` (publish the next version), and ``outcomes``: each
    transfer's relay (a pull's endpoint), version and outcome (``ok`` or the error's type),
    once there are as many as asked."""

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        hold_to: str = ""
        hold_version: int = -1
        hold_pull: int = -1
        held: str = ""
        gate: str = ""

    async def setup(self) -> None:
        cfg = self.config
        self.published = _Held(
            self.ctx,
            torch.nn.Module(),
            dtype=torch.float32,
            sharded=False,
            bucket_bytes=2**20,
            enabled=True,
        )
        self.published.hold_to, self.published.hold_version = cfg.hold_to, cfg.hold_version
        self.published.held, self.published.gate = cfg.held, cfg.gate
        self.latest = 0
        self.published.sending = {}
        self.published.model = _Fixed(state_of(0))
        self.published.open(state_of(0), 0)
        self.hold_pull = cfg.hold_pull
        self.pulling = 0  # pulls being answered
        self.done: list[list[Any]] = []
        self.changed = asyncio.Event()

    async def teardown(self) -> None:
        self.published.close()

    @endpoint(Delivery.IDEMPOTENT)
    async def status(self, _: None) -> dict[str, int]:
        return {"version": self.latest}

    @endpoint(Delivery.IDEMPOTENT)
    async def weights(self, _: None) -> WeightsUpdate:
        return await self._pull("weights", hold=False)

    @endpoint(Delivery.IDEMPOTENT)
    async def held_weights(self, _: None) -> WeightsUpdate:
        return await self._pull("held_weights", hold=True)

    async def _pull(self, method: str, *, hold: bool) -> WeightsUpdate:
        """The store's version, read whole under its seqlock; with ``hold``, the pull of
        ``hold_pull`` waits at the gate (in a thread: the other endpoints go on) before its
        reply is sent."""
        self.pulling += 1
        try:
            version, state = await asyncio.to_thread(self.published.read)
            if hold and version == self.hold_pull:
                self.hold_pull = -1  # once
                await asyncio.to_thread(_wait_at_gate, self.config.held, method, self.config.gate)
            self.done.append([method, version, "ok"])
        finally:
            self.pulling -= 1
            self.changed.set()
        return WeightsUpdate(version, state)

    @endpoint(Delivery.IDEMPOTENT)
    async def broadcast_weights(self, rendezvous: Rendezvous) -> int:
        relay, sending = rendezvous.prefix.split("/")[2], self.latest
        try:
            version = await asyncio.to_thread(self.published.broadcast, rendezvous)
        except Exception as exc:
            self.done.append([relay, sending, type(exc).__name__])
            raise
        finally:
            self.changed.set()
        self.done.append([relay, version, "ok"])
        return version

    @endpoint(Delivery.ONCE)
    async def bump(self, _: None) -> int:
        self.latest += 1
        self.published.model = _Fixed(state_of(self.latest))
        self.published.publish(self.latest)
        return self.latest

    @endpoint(Delivery.IDEMPOTENT)
    async def outcomes(self, count: int) -> list[list[Any]]:
        """The outcomes of the transfers so far, once there are at least ``count`` and no
        pull is being answered."""
        while len(self.done) < count or self.pulling:
            self.changed.clear()
            await self.changed.wait()
        return self.done


def _wait_at_gate(held: str, what: str, gate: str) -> None:
    """Write the file ``held`` (holding ``what``), then wait for the file ``gate``."""
    write_atomic(held, what.encode())
    deadline = time.monotonic() + _GATE_WAIT_S
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)


class _Fixed(torch.nn.Module):
    """A module whose state dict is ``state`` (what ``PublishedWeights.publish`` reads)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in state.items():
            self.register_buffer(name, t)


class Reader(Role):
    """Reads the newest version its host's store holds, as a rollout replica does: ``sync``
    answers its version, ``held`` the version and the digest of what it read."""

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        weights_from: str = "publisher"

    async def setup(self) -> None:
        self.version = -1
        self.digest = ""

    @endpoint(Delivery.LATEST)
    async def sync(self, _: None) -> int:
        handle = read_handle(handle_path(self.ctx.run_dir, self.config.weights_from))
        if handle is None:
            return self.version
        with WeightReader(handle) as reader:
            version, state = await asyncio.to_thread(reader.read)
        self.version, self.digest = version, digest(state)
        return version

    @endpoint(Delivery.IDEMPOTENT)
    async def held(self, _: None) -> list[Any]:
        return [self.version, self.digest]
