"""The role the runtime benchmark kills and restarts: it imports torch, as real roles do, so
that restart-to-serving is measured against a realistic import."""

from __future__ import annotations

import torch

from asyncrl.role import Delivery, Role, endpoint


class TorchEcho(Role):
    async def setup(self) -> None:
        self.scale = torch.ones(1)

    @endpoint(Delivery.IDEMPOTENT)
    async def echo(self, x: int) -> int:
        return x
