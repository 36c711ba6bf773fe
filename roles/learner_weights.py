"""The learner's published weights: the shared-memory store its first replica writes every
version into, and the whole model read back from it.

A replicated learner publishes its state dict as it is. A sharded one (``parallel: fsdp``)
gathers it bucket by bucket on every rank in lockstep (``asyncrl.roles.sharding.full_buckets``)
and the first rank writes each bucket as it comes, so no rank holds a second full copy. The
first rank then serves the whole weights (``weights``, ``export``) from its store, since a
sharded model is whole nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from asyncrl.role import RoleContext
from asyncrl.roles.sharding import full_buckets
from asyncrl.weight_reader import WeightReader
from asyncrl.weights import WeightStore, handle_path, write_handle

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

    def close(self) -> None:
        """Unlink the store (readers see it closed)."""
        if self.store is not None:
            self.store.close()
