"""The plugins' sharding part: the built-ins' precision, and the default where a plugin has none."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from asyncrl.plugins.registry import load, sharding_for
from asyncrl.plugins.sharding import TorchSharding


def test_cpu_computes_in_the_storage_dtype_and_cuda_in_bf16_with_float32_reduction() -> None:
    cpu = sharding_for(load("cpu"))
    assert cpu.mixed_precision(torch.float32) is None
    cuda = sharding_for(load("cuda"))
    policy = cuda.mixed_precision(torch.float32)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    # A learner that asked for another dtype keeps it: no cast.
    assert cuda.mixed_precision(torch.float64) is None
    assert cuda.mixed_precision(torch.bfloat16) is None


def test_a_plugin_without_a_sharding_part_gets_torchs_for_its_device() -> None:
    vendor = SimpleNamespace(device=SimpleNamespace(kind="xpu"))
    default = sharding_for(vendor)  # type: ignore[arg-type]
    assert isinstance(default, TorchSharding)
    assert default.kind == "xpu" and default.mixed_precision(torch.float32) is None
