"""A test plugin whose RMSNorm forgets to normalise: the self-check must catch it."""

from __future__ import annotations

import torch

from asyncrl.plugins.compiling import BucketCompiler
from asyncrl.plugins.cpu import CpuPlugin
from asyncrl.plugins.torch_ops import FastOps


class BrokenOps(FastOps):
    """Fast operators with one wrong: RMSNorm only scales by the weight."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return x * weight


class BrokenPlugin(CpuPlugin):
    """The cpu plugin with ``BrokenOps``, registered as ``broken``; it compiles eagerly, so
    tests do not pay for inductor."""

    name = "broken"

    def __init__(self) -> None:
        super().__init__()
        self.ops = BrokenOps()
        self.compiler = BucketCompiler(enabled=False)


def plugin() -> BrokenPlugin:
    return BrokenPlugin()
