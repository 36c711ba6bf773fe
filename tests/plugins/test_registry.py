"""The plugin registry: the choice (asked, environment, detection), version refusal, the
contract check, and the built-in plugins' parts."""

from __future__ import annotations

import types

import pytest
import torch

from asyncrl.plugins import registry
from asyncrl.plugins.cpu import CpuPlugin
from asyncrl.plugins.errors import PluginError


def test_builtins_are_registered_and_load() -> None:
    assert {"cpu", "cuda"} <= set(registry.registered())
    cpu = registry.load("cpu")
    assert (cpu.name, cpu.dtype, cpu.comm.backend) == ("cpu", torch.float32, "gloo")
    assert cpu.device.select() == torch.device("cpu")
    cuda = registry.load("cuda")
    assert (cuda.name, cuda.dtype, cuda.comm.backend) == ("cuda", torch.bfloat16, "nccl")
    assert cuda.device.visible_env == "CUDA_VISIBLE_DEVICES"


def test_choice_order() -> None:
    assert registry.choose("cuda", environ={"ASYNCRL_PLUGIN": "cpu"}) == "cuda"
    assert registry.choose("", environ={"ASYNCRL_PLUGIN": "cuda"}) == "cuda"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert registry.choose("", environ={}) == expected


def test_unknown_plugin_is_refused_with_the_registered_names() -> None:
    with pytest.raises(PluginError) as err:
        registry.load("tpu9")
    assert str(err.value).startswith("no hardware plugin named 'tpu9'; registered: cpu, cuda")


def test_an_incompatible_version_is_refused_naming_both() -> None:
    plugin = CpuPlugin()
    plugin.asyncrl_versions = ">=9.0"  # type: ignore[misc]
    with pytest.raises(PluginError) as err:
        registry.check(plugin, "0.1.0")
    assert str(err.value) == (
        "plugin 'cpu' supports asyncrl >=9.0, but this is asyncrl 0.1.0; install a release of "
        "the plugin made for asyncrl 0.1.0"
    )
    registry.check(CpuPlugin(), "0.1.0")


def test_a_plugin_missing_a_part_is_refused() -> None:
    plugin = CpuPlugin()
    plugin.ops = types.SimpleNamespace()  # type: ignore[assignment]
    with pytest.raises(PluginError) as err:
        registry.check(plugin)
    assert str(err.value) == (
        "plugin 'cpu': ops missing or not of the contract's shape "
        "(asyncrl.plugins.contract.Plugin; docs/plugins.md)"
    )


def test_cpu_device_memory_and_copies() -> None:
    dev = registry.load("cpu").device
    mem = dev.memory()
    assert 0 < mem.allocated <= mem.peak and mem.total > mem.allocated
    t = torch.arange(4)
    assert dev.pin(t) is t
    assert torch.equal(dev.copy_async(t, torch.device("cpu")), t)
    with pytest.raises(ValueError, match="cpu: there is one device"):
        dev.select(1)
