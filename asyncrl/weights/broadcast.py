"""The weight broadcast: a weight store's current version sent to a relay of another host
through a collective broadcast (the hardware plugin's: NCCL on cuda, gloo on cpu).

The relay hosts a rendezvous store (a ``torch.distributed.TCPStore``) and asks the publisher
to send (the learner's ``broadcast_weights`` endpoint, whose payload is a ``Rendezvous``). The
two form a standalone group of two ranks (``pair_group``: never the default group, which a
data-parallel publisher is in); the publisher is rank 0. It first sets ``READY`` in the
rendezvous store (until then the relay can stop waiting for a publisher that refused), then
broadcasts, in order:

1. the header's length, one int64;
2. the header: a ``BucketTable`` in MessagePack (the version, every tensor's place in its
   bucket, the tensors per bucket, each bucket's bytes);
3. one flat uint8 buffer per bucket, its tensors at their offsets, plus one last byte: 1 when
   the publisher overwrote the version while the bucket was copied out of its store's slot
   (under the slot's seqlock). The relay then drops the version (``TornReadError``) and asks
   again.

Any other failure aborts the group on both sides. One bucket is held beyond the store, never a
second copy of the model (``send_store``, ``received_buckets``).
"""

from __future__ import annotations

import datetime
import mmap
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import msgspec
import numpy as np
import torch
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from asyncrl.errors import NothingPublishedError, TornReadError
from asyncrl.transport.codec import torch_dtypes
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
from asyncrl.weights.store import WeightStore

__all__ = [
    "READY",
    "BucketTable",
    "PairBroadcast",
    "Rendezvous",
    "bucket_plan",
    "received_buckets",
    "remaining",
    "send_store",
]

READY = "ready"
"""The key the publisher sets in the rendezvous store before it forms the group: until then
the relay can stop waiting for a publisher that refused (its error reaches the relay as the
reply)."""


class Rendezvous(msgspec.Struct, kw_only=True, frozen=True):
    """Where a relay waits for a broadcast of the weights: ``broadcast_weights``' payload.

    Attributes:
        host: the relay's address the publisher reaches (its rendezvous store and its end of
            the group).
        port: the port of its rendezvous store (a ``torch.distributed.TCPStore``).
        prefix: this transfer's key prefix in that store (a fresh one per transfer).
        timeout_s: the whole transfer's deadline, from when the publisher takes the call.
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


class PairBroadcast(Protocol):
    """What the broadcast needs of the hardware plugin's communication (``Communication``)."""

    def pair_group(
        self, store: Any, rank: int, world: int, *, timeout_s: float, address: str = ""
    ) -> AbstractContextManager[Any]: ...

    def broadcast(
        self, tensor: torch.Tensor, src: int, *, timeout_s: float, group: Any = None
    ) -> None: ...


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


def send_store(
    store: WeightStore,
    rendezvous: Rendezvous,
    comm: PairBroadcast,
    *,
    address: str,
    where: str,
    after_bucket: Callable[[int], None] | None = None,
) -> int:
    """Send ``store``'s current version to the relay waiting at ``rendezvous``, as rank 0 of a
    group of two, bucket by bucket. Blocking, and safe beside a publish (it reads the current
    slot under its seqlock): call it in a thread of its own.

    Args:
        store: the publisher's own store (this process's).
        rendezvous: where the relay waits.
        comm: the plugin's communication.
        address: this host's address the relay reaches (``pair_group``'s).
        where: the publisher, for messages (``learner.0``).
        after_bucket: called with each bucket's number once it was sent.

    Returns:
        the version sent.

    Raises:
        NothingPublishedError: nothing was published yet.
        TornReadError: the store was published into twice while a bucket was copied (the relay
            drops the version and asks again).
        CollectiveTimeoutError: the relay did not come or answer within the deadline.
        BrokenError: the relay died or closed its end during the transfer.
    """
    deadline = time.monotonic() + rendezvous.timeout_s
    handle = store.describe()
    counts, sizes = bucket_plan(handle.tensors, rendezvous.bucket_bytes)
    mapping = _map_store(store)
    try:
        slot, seq, version = _current_slot(mapping, store.name)
        table = _table(handle.tensors, counts, sizes, version)
        header = msgspec.msgpack.encode(table)
        tcp = TCPStore(
            rendezvous.host,
            rendezvous.port,
            None,
            False,
            timeout=datetime.timedelta(seconds=remaining(deadline)),
        )
        meeting = PrefixStore(rendezvous.prefix, tcp)
        meeting.set(READY, "1")
        left = remaining(deadline)
        with comm.pair_group(meeting, 0, 2, timeout_s=left, address=address) as group:

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
                        f"{where}: version {version} was overwritten while bucket {number} was "
                        f"sent (two publishes during one transfer); the relay asks again"
                    )
                if after_bucket is not None:
                    after_bucket(number)
                first += count
        return version
    finally:
        mapping.close()


def received_buckets(
    table: BucketTable, receive: Callable[[torch.Tensor], None], source: str
) -> Iterator[dict[str, torch.Tensor]]:
    """The relay's side: each bucket of ``table`` as ``receive`` fills it, its tensors views of
    one reused buffer (write a bucket into the store before taking the next).

    Raises:
        TornReadError: the source overwrote the version while it sent this bucket.
    """
    dtypes = torch_dtypes()
    buffer = torch.empty(max(table.sizes, default=0) + 1, dtype=torch.uint8)
    first = 0
    for number, (count, size) in enumerate(zip(table.buckets, table.sizes, strict=True)):
        chunk = buffer[: size + 1]
        receive(chunk)
        if chunk[size].item():
            raise TornReadError(
                f"{source} overwrote version {table.version} while sending bucket {number}; "
                f"the relay asks again"
            )
        yield {
            spec.name: chunk[spec.offset : spec.offset + spec.nbytes]
            .view(dtypes[spec.dtype])
            .view(spec.shape)
            for spec in table.tensors[first : first + count]
        }
        first += count


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
