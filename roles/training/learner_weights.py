"""The learner's published weights: the shared-memory store its first replica writes every
version into, and the whole model read back from it.

A replicated learner publishes its state dict as it is. A sharded one (``parallel: fsdp``)
gathers it bucket by bucket on every rank in lockstep
(``asyncrl.roles.training.sharding.full_buckets``) and the first rank writes each bucket as it
comes, so no rank holds a second full copy. The first rank then serves the whole weights
(``weights``, ``export``) from its store, since a sharded model is whole nowhere else.

It also sends its store to a relay of another host through the hardware plugin's broadcast
(``broadcast_weights``, the relay's ``transport: broadcast``): the relay hosts a rendezvous
store (``Rendezvous``) and calls the endpoint; the two form a standalone group of two ranks
(``Communication.pair_group``: never the default group, which a data-parallel learner is in)
and this rank 0 broadcasts the version its store holds, first its length and ``BucketTable``,
then one flat uint8 buffer per bucket, each copied out of the store's current slot under its
seqlock. A bucket the writer overwrote meanwhile goes with its last byte set, and the relay
drops the version (``TornReadError``); any other failure aborts the group on both sides.
"""

from __future__ import annotations

import asyncio
import datetime
import mmap
import os
import time
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np
import torch
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from asyncrl.errors import NothingPublishedError, TornReadError
from asyncrl.observe.trace import traced
from asyncrl.plugins.registry import current as current_plugin
from asyncrl.role import Delivery, RoleContext, endpoint
from asyncrl.roles.training.sharding import full_buckets
from asyncrl.supervision.store_registry import node_address
from asyncrl.weights import WeightStore, handle_path, write_handle
from asyncrl.weights.layout import (
    ALIGN,
    W_CURRENT,
    W_SEQ,
    W_VERSION,
    SegmentMap,
    TensorSpec,
    fence,
    round_up,
    segment_views,
)
from asyncrl.weights.reader import WeightReader

__all__ = [
    "BucketTable",
    "PublishedWeights",
    "Rendezvous",
    "WeightBroadcast",
    "bucket_plan",
    "remaining",
]

READY = "ready"
"""The key rank 0 sets in the rendezvous store before it forms the group: until then the relay
can stop waiting for a learner that refused (this learner's error reaches it as the reply)."""


class Rendezvous(msgspec.Struct, kw_only=True, frozen=True):
    """Where a relay waits for a broadcast of the weights: ``broadcast_weights``' payload.

    Attributes:
        host: the relay's address the learner reaches (its rendezvous store and its end of
            the group).
        port: the port of its rendezvous store (a ``torch.distributed.TCPStore``).
        prefix: this transfer's key prefix in that store (a fresh one per transfer).
        timeout_s: the whole transfer's deadline, from when the learner takes the call.
        bucket_bytes: the most bytes of one bucket (a larger tensor goes alone).
    """

    host: str
    port: int
    prefix: str
    timeout_s: float
    bucket_bytes: int


class BucketTable(msgspec.Struct, kw_only=True, frozen=True):
    """The header of a broadcast: the version and how its buckets are laid out.

    Attributes:
        version: the version that follows.
        tensors: every tensor in store order; ``offset`` is its byte offset within its bucket.
        buckets: how many tensors each bucket holds, in order.
        sizes: each bucket's bytes (its broadcast carries one more: the torn flag).
    """

    version: int
    tensors: list[TensorSpec]
    buckets: list[int]
    sizes: list[int]


def bucket_plan(specs: tuple[TensorSpec, ...], bucket_bytes: int) -> tuple[list[int], list[int]]:
    """Tensors per bucket and bytes per bucket for ``specs`` in order, each bucket at most
    ``bucket_bytes`` (or one larger tensor alone), each tensor at an ``ALIGN``ed offset."""
    counts: list[int] = []
    sizes: list[int] = []
    for spec in specs:
        start = round_up(sizes[-1], ALIGN) if counts else 0
        if not counts or start + spec.nbytes > bucket_bytes:
            counts.append(0)
            sizes.append(0)
            start = 0
        counts[-1] += 1
        sizes[-1] = start + spec.nbytes
    return counts, sizes


def remaining(deadline: float) -> float:
    """Seconds left before ``deadline`` (``time.monotonic``): the timeout of a transfer's next
    step. Never below a millisecond, so a step past the deadline still fails typed, as a
    collective that timed out (``CollectiveTimeoutError``)."""
    return max(deadline - time.monotonic(), 1e-3)


class PublishedWeights:
    """Where a learner replica publishes its versions, and reads them back.

    Args:
        ctx: the replica's context (its name, replica, run and incarnation).
        model: the model, sharded or not.
        dtype: the dtype the weights are published in.
        sharded: whether ``model`` is sharded over the replicas (all of them publish together).
        bucket_bytes: with ``sharded``, the most bytes of whole tensors gathered at once.
        enabled: ``publish_weights``: off, nothing is published and no store is made.
    """

    def __init__(
        self,
        ctx: RoleContext,
        model: torch.nn.Module,
        *,
        dtype: torch.dtype,
        sharded: bool,
        bucket_bytes: int,
        enabled: bool,
    ) -> None:
        self.ctx = ctx
        self.model = model
        self.dtype = dtype
        self.sharded = sharded
        self.bucket_bytes = bucket_bytes
        self.enabled = enabled
        self.store: WeightStore | None = None

    def open(self, template: Mapping[str, torch.Tensor], version: int) -> None:
        """Make the store (replica 0 only) and publish ``version`` into it (every sharded
        rank takes part); then write the handle a restarted reader finds it by. Blocking:
        call it in the compute thread."""
        if not self.enabled:
            return
        if self.ctx.replica == 0:
            # Rollout replicas on this host read the weights from shared memory (a seqlock
            # store); the handle in the run directory lets a restarted one find them.
            self.store = WeightStore(template, run=self.ctx.run, incarnation=self.ctx.incarnation)
        self.publish(version)
        if self.store is not None:
            write_handle(handle_path(self.ctx.run_dir, self.ctx.name), self.store.describe())

    def publish(self, version: int) -> None:
        """The model's current weights as ``version``."""
        if not self.enabled:
            return
        if self.sharded:
            buckets = full_buckets(self.model, self.bucket_bytes, self.dtype)
            if self.store is None:
                for _ in buckets:  # gather in step with the rank that writes
                    pass
            else:
                self.store.publish_buckets(buckets, version)
        elif self.store is not None:
            self.store.publish(self.model.state_dict(), version)

    def read(self) -> tuple[int, dict[str, torch.Tensor]]:
        """A copy of the latest published version, whole, and its number.

        Raises:
            ValueError: this replica holds no store (not replica 0, or publishing is off).
        """
        if self.store is None:
            raise ValueError(
                f"{self.ctx.name}.{self.ctx.replica}: a sharded learner (parallel: fsdp) serves "
                f"its whole weights from replica 0's weight store; call replica 0 and keep "
                f"roles.{self.ctx.name}.config.publish_weights on"
            )
        with WeightReader(self.store.describe()) as reader:
            return reader.read()

    def whole_model(self) -> Any:
        """The model whole and unsharded, built from the latest published version (what a
        sharded learner exports)."""
        from transformers import AutoModelForCausalLM

        _, state = self.read()
        auto: Any = AutoModelForCausalLM  # its class methods are untyped
        with torch.device("meta"):
            whole = auto.from_config(self.model.config)
        whole.load_state_dict(state, assign=True)
        whole.tie_weights()
        return whole

    def broadcast(self, rendezvous: Rendezvous) -> int:
        """Send the store's current version to the relay waiting at ``rendezvous`` through the
        plugin's broadcast, as rank 0 of a group of two, bucket by bucket: one bucket is held
        beyond the store, never a second copy of the model. Blocking, and safe beside a
        publish (it reads the current slot under its seqlock): call it in a thread of its own.

        Returns:
            the version sent.

        Raises:
            ValueError: this replica holds no store (not replica 0, or publishing is off).
            NothingPublishedError: nothing was published yet.
            TornReadError: the learner published twice while a bucket was copied (the relay
                drops the version and asks again).
            CollectiveTimeoutError: the relay did not come or answer within the deadline.
            BrokenError: the relay died or closed its end during the transfer.
        """
        if self.store is None:
            raise ValueError(
                f"{self.ctx.name}.{self.ctx.replica}: only replica 0 holds the weight store "
                f"broadcast_weights sends from; ask replica 0, with "
                f"roles.{self.ctx.name}.config.publish_weights on"
            )
        deadline = time.monotonic() + rendezvous.timeout_s
        handle = self.store.describe()
        counts, sizes = bucket_plan(handle.tensors, rendezvous.bucket_bytes)
        mapping = _map_store(self.store)
        try:
            slot, seq, version = _current_slot(mapping, self.store.name)
            table = _table(handle.tensors, counts, sizes, version)
            header = msgspec.msgpack.encode(table)
            tcp = TCPStore(
                rendezvous.host,
                rendezvous.port,
                None,
                False,
                timeout=datetime.timedelta(seconds=remaining(deadline)),
            )
            store = PrefixStore(rendezvous.prefix, tcp)
            store.set(READY, "1")
            comm = current_plugin().comm
            address = node_address("", rendezvous.host)[1]
            left = remaining(deadline)
            with comm.pair_group(store, 0, 2, timeout_s=left, address=address) as group:

                def send(t: torch.Tensor) -> None:
                    left = remaining(deadline)
                    comm.broadcast(t, 0, timeout_s=left, group=group)

                send(torch.tensor([len(header)], dtype=torch.int64))
                send(torch.frombuffer(bytearray(header), dtype=torch.uint8))
                buffer = torch.empty(max(sizes, default=0) + 1, dtype=torch.uint8)
                staged = buffer.numpy()
                first = 0
                for number, (count, size) in enumerate(zip(counts, sizes, strict=True)):
                    for index in range(first, first + count):
                        at = table.tensors[index].offset
                        src = mapping.slots[slot][index]
                        np.copyto(staged[at : at + src.size], src)
                    fence()  # the copy before the second look at the sequence
                    torn = int(mapping.header[W_SEQ[slot]]) != seq
                    staged[size] = torn
                    send(buffer[: size + 1])
                    if torn:
                        raise TornReadError(
                            f"{self.ctx.name}.{self.ctx.replica}: version {version} was "
                            f"overwritten while bucket {number} was sent (two publishes during "
                            f"one transfer); the relay asks again"
                        )
                    self._after_bucket(number)
                    first += count
            return version
        finally:
            mapping.close()

    def _after_bucket(self, number: int) -> None:
        """Called after bucket ``number`` was broadcast; a hook for tests that fail here."""

    def close(self) -> None:
        """Unlink the store (readers see it closed)."""
        if self.store is not None:
            self.store.close()


class WeightBroadcast:
    """The learner's ``broadcast_weights`` endpoint, a base of ``Learner`` that wires only it
    (its transfer is ``PublishedWeights.broadcast``)."""

    published: PublishedWeights

    @endpoint(Delivery.IDEMPOTENT)
    async def broadcast_weights(self, rendezvous: Rendezvous) -> int:
        """Broadcast the latest published version to the relay waiting at ``rendezvous``;
        return that version. In a thread of its own, not the compute thread: a step in
        progress goes on, and its publish lands in the store's other slot."""
        send = traced("weight broadcast", self.published.broadcast)
        return await asyncio.to_thread(send, rendezvous)


def _map_store(store: WeightStore) -> SegmentMap:
    """A read-only mapping of ``store``'s own segment (this process's)."""
    handle = store.describe()
    fd = os.open(os.path.join(store.directory, store.name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        mm = mmap.mmap(fd, handle.total_bytes, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    return segment_views(mm, handle)


def _current_slot(mapping: SegmentMap, name: str, tries: int = 100) -> tuple[int, int, int]:
    """``(slot, sequence, version)`` of the store's current, complete slot.

    Raises:
        NothingPublishedError: nothing was published yet.
        TornReadError: the writer was rewriting the current slot at every try.
    """
    header = mapping.header
    for _ in range(tries):
        slot = int(header[W_CURRENT])
        if slot < 0:
            raise NothingPublishedError(
                f"nothing published yet in weights {name}: nothing to broadcast"
            )
        fence()
        seq = int(header[W_SEQ[slot]])
        fence()
        version = int(header[W_VERSION[slot]])
        fence()
        if not seq & 1 and int(header[W_SEQ[slot]]) == seq:
            return slot, seq, version
    raise TornReadError(f"weights {name}: the current slot was being rewritten {tries} times")


def _table(
    specs: tuple[TensorSpec, ...], counts: list[int], sizes: list[int], version: int
) -> BucketTable:
    """The header of a broadcast of ``specs`` in the buckets ``counts``/``sizes``."""
    tensors: list[TensorSpec] = []
    first = 0
    for count in counts:
        offset = 0
        for spec in specs[first : first + count]:
            tensors.append(TensorSpec(spec.name, spec.dtype, spec.shape, offset, spec.nbytes))
            offset = round_up(offset + spec.nbytes, ALIGN)
        first += count
    return BucketTable(version=version, tensors=tensors, buckets=counts, sizes=sizes)
