"""Sharding's hardware side: the device mesh a sharded learner's ranks form, and the precision
FSDP2 computes in on this device.

A sharded learner (``parallel: fsdp``) asks its plugin for these through
``asyncrl.plugins.registry.sharding_for``; a plugin without a ``sharding`` part of its own gets
``TorchSharding`` for its device kind, which is what the built-in ``cpu`` and ``cuda`` plugins
use.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["TorchSharding"]


class TorchSharding:
    """``torch.distributed``'s device mesh and FSDP2's mixed precision for one device kind.

    Args:
        kind: the torch device type of the mesh (``cpu``, ``cuda``, a vendor's).
        compute_dtype: the dtype parameters are cast to for the forward and backward passes
            when the learner keeps them in float32 (``bfloat16`` on cuda); None: no cast.
    """

    def __init__(self, kind: str, compute_dtype: torch.dtype | None = None) -> None:
        self.kind = kind
        self.compute_dtype = compute_dtype

    def mesh(self, world: int) -> Any:
        """The 1-D mesh of the default process group's ``world`` ranks (formed already)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.kind, (world,))

    def mixed_precision(self, storage: torch.dtype) -> Any:
        """FSDP2's policy for parameters kept in ``storage``: computed in ``compute_dtype``
        with gradients reduced in float32, when ``storage`` is float32 and the device computes
        in another dtype; None (no cast) otherwise, e.g. on the CPU, or a learner that asked
        for float64 so that rounding hides nothing."""
        if self.compute_dtype is None or storage != torch.float32:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
