"""The learner's published weights: the shared-memory store its group's lead (its rank 0)
writes every version into, the whole model read back from it, and the store sent to a relay of
another host.

A replicated learner publishes its state dict as it is. A sharded one (``parallel: fsdp``)
gathers it bucket by bucket on every rank in lockstep
(``asyncrl.roles.training.sharding.full_buckets``) and the first rank writes each bucket as it
comes, so no rank holds a second full copy. The first rank then serves the whole weights
(``weights``, ``export``) from its store, since a sharded model is whole nowhere else, and
sends it to a relay through the plugin's broadcast (the learner's ``broadcast_weights``; the
protocol is ``asyncrl.weights.broadcast``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

import torch

from asyncrl.plugins.registry import current as current_plugin
from asyncrl.role import RoleContext
from asyncrl.roles.training.lead_refusal import NotLeaderError
from asyncrl.roles.training.sharding import full_buckets
from asyncrl.supervision.store_registry import node_address
from asyncrl.weights import HandlePointer, WeightStore, handle_path
from asyncrl.weights.broadcast import Rendezvous, send_store
from asyncrl.weights.reader import WeightReader

__all__ = ["PublishedWeights"]


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
        self._handle = HandlePointer()

    def open(self, template: Mapping[str, torch.Tensor], version: int) -> None:
        """Make the store (the group's lead only: its rank 0, replica 0 until a node's loss
        takes it out) and publish ``version`` into it (every sharded rank takes part), which
        writes the handle a restarted reader finds it by. Blocking: call it in the compute
        thread."""
        if not self.enabled:
            return
        if self.ctx.group_rank == 0:
            # Rollout replicas on this host read the weights from shared memory (a seqlock
            # store); the handle in the run directory lets a restarted one find them.
            self.store = WeightStore(template, run=self.ctx.run, incarnation=self.ctx.incarnation)
        self.publish(version)

    def publish(self, version: int) -> None:
        """The model's current weights as ``version``; then the host's handle names this
        store."""
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
        if self.store is not None:
            # Another writer of this host's handle (a relay that still took the lead to be on
            # another host) may have replaced it: ``HandlePointer`` says how.
            self._handle.point(handle_path(self.ctx.run_dir, self.ctx.name), self.store.describe())

    def read(self) -> tuple[int, dict[str, torch.Tensor]]:
        """A copy of the latest published version, whole, and its number.

        Raises:
            NotLeaderError: this replica does not lead its group (a ``ValueError``).
            ValueError: publishing is off.
        """
        if self.store is None:
            self._no_store(
                "a sharded learner (parallel: fsdp) serves its whole weights from its group's "
                "lead's weight store"
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
        plugin's broadcast (``asyncrl.weights.broadcast.send_store``), as rank 0 of a group of
        two, bucket by bucket. Blocking, and safe beside a publish: call it in a thread of its
        own.

        Returns:
            the version sent.

        Raises:
            NotLeaderError: this replica does not lead its group (a ``ValueError``).
            ValueError: publishing is off.
            NothingPublishedError: nothing was published yet.
            TornReadError: the learner published twice while a bucket was copied (the relay
                drops the version and asks again).
            CollectiveTimeoutError: the relay did not come or answer within the deadline.
            BrokenError: the relay died or closed its end during the transfer.
        """
        if self.store is None:
            self._no_store(
                "only its group's lead holds the weight store broadcast_weights sends from"
            )
        return send_store(
            self.store,
            rendezvous,
            current_plugin().comm,
            address=node_address("", rendezvous.host)[1],
            where=f"{self.ctx.name}.{self.ctx.replica}",
            after_bucket=self.after_bucket,
        )

    def _no_store(self, what: str) -> NoReturn:
        """Raise why this replica holds no store: it does not lead its group (the group's rank
        0: replica 0, or the lowest replica left after a node's loss), or publishing is off.

        Raises:
            NotLeaderError: not the lead; the caller may send it again to the lead.
            ValueError: publishing is off.
        """
        where = f"{self.ctx.name}.{self.ctx.replica}"
        if self.ctx.group_rank != 0:
            raise NotLeaderError(
                f"{where}: {what}, and this replica does not lead its group; call the group's "
                f"lead (the lowest replica still in the run)"
            )
        raise ValueError(
            f"{where}: {what}, and it publishes none: set "
            f"roles.{self.ctx.name}.config.publish_weights on"
        )

    def after_bucket(self, number: int) -> None:
        """Called after bucket ``number`` of a broadcast was sent: nothing here; a subclass
        that fails a transfer at that point (the relay's tests) overrides it."""

    def close(self) -> None:
        """Unlink the store (readers see it closed)."""
        if self.store is not None:
            self.store.close()
