"""The plugin registry: which hardware plugin this process uses.

Plugins register under the entry-point group ``asyncrl.plugins`` (``name = "module:object"``,
the object a plugin or a function returning one); ``cpu`` and ``cuda`` are built in. The choice,
in order: the name asked for (the manifest's ``run.plugin``, which the run passes to every
process as ``ASYNCRL_PLUGIN``), then ``ASYNCRL_PLUGIN``, then detection: the first plugin other
than ``cpu`` (by name) whose device is available, else ``cpu``. A plugin whose
``asyncrl_versions`` exclude this asyncrl is refused.

Roles call ``current()`` and use what it returns (``device``, ``dtype``, ``comm``, ``ops``):
they never import a plugin module.
"""

from __future__ import annotations

import functools
import importlib
import os
from importlib.metadata import entry_points
from typing import Any

import torch
from packaging.specifiers import InvalidSpecifier, SpecifierSet

import asyncrl
from asyncrl.plugins.contract import (
    Communication,
    Compiler,
    Device,
    Operators,
    Plugin,
    Profiler,
    Sharding,
)
from asyncrl.plugins.errors import PluginError

__all__ = [
    "BUILTIN",
    "DTYPES",
    "ENV",
    "GROUP",
    "choose",
    "current",
    "device_for",
    "dtype_for",
    "load",
    "registered",
    "sharding_for",
]

GROUP = "asyncrl.plugins"
"""The entry-point group plugins register under."""

ENV = "ASYNCRL_PLUGIN"
"""The environment variable that names the plugin of a process."""

BUILTIN = {"cpu": "asyncrl.plugins.cpu:plugin", "cuda": "asyncrl.plugins.cuda:plugin"}
"""The built-in plugins, registered whether or not the package's entry points are installed."""

_PARTS: dict[str, type] = {
    "device": Device,
    "comm": Communication,
    "ops": Operators,
    "reference_ops": Operators,
    "compiler": Compiler,
    "profiler": Profiler,
}


def registered() -> dict[str, str]:
    """Every plugin's name and ``module:object``: the built-ins, then the entry points."""
    found = dict(BUILTIN)
    for ep in entry_points(group=GROUP):
        found[ep.name] = ep.value
    return found


def _resolve(target: str) -> Any:
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


def check(plugin: Any, version: str = asyncrl.__version__) -> None:
    """Raise unless ``plugin`` has every part of the contract and supports ``version``.

    Raises:
        PluginError: a part is missing or of the wrong shape, or the versions exclude ``version``.
    """
    name = getattr(plugin, "name", repr(plugin))
    missing = [
        part for part, proto in _PARTS.items() if not isinstance(getattr(plugin, part, None), proto)
    ]
    missing += [a for a in ("name", "asyncrl_versions", "dtype") if not hasattr(plugin, a)]
    if missing:
        raise PluginError(
            f"plugin {name!r}: {', '.join(missing)} missing or not of the contract's shape "
            f"(asyncrl.plugins.contract.Plugin; docs/plugins.md)"
        )
    try:
        supported = SpecifierSet(plugin.asyncrl_versions)
    except InvalidSpecifier as exc:
        raise PluginError(
            f"plugin {name!r}: asyncrl_versions {plugin.asyncrl_versions!r} is not a version "
            f"specifier; write one like '>=0.1,<0.2'"
        ) from exc
    if version not in supported:
        raise PluginError(
            f"plugin {name!r} supports asyncrl {plugin.asyncrl_versions}, but this is asyncrl "
            f"{version}; install a release of the plugin made for asyncrl {version}"
        )


def load(name: str) -> Plugin:
    """The plugin registered as ``name``, checked against the contract and this version.

    Raises:
        PluginError: no plugin has that name, it fails to import, or ``check`` refuses it.
    """
    found = registered()
    if name not in found:
        raise PluginError(
            f"no hardware plugin named {name!r}; registered: {', '.join(sorted(found))} "
            f"(install the plugin's package, or fix the manifest's run.plugin or {ENV})"
        )
    try:
        obj = _resolve(found[name])
    except Exception as exc:
        raise PluginError(f"plugin {name!r} ({found[name]}) failed to load: {exc}") from exc
    plugin = obj() if callable(obj) and not hasattr(obj, "device") else obj
    check(plugin)
    return plugin  # type: ignore[no-any-return]


def choose(name: str = "", environ: Any = None) -> str:
    """The plugin's name: ``name``, else ``ASYNCRL_PLUGIN``, else detection."""
    env = os.environ if environ is None else environ
    if name or env.get(ENV):
        return name or str(env[ENV])
    for other in sorted(registered()):
        if other == "cpu":
            continue
        try:
            if load(other).device.available():
                return other
        except PluginError:
            continue  # a plugin that cannot load is not detected; asking for it says why
    return "cpu"


@functools.cache
def current() -> Plugin:
    """This process's plugin (chosen by ``choose()`` once, then kept)."""
    return load(choose())


DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""The dtypes a role's ``dtype`` setting may name (empty: the plugin's)."""


def device_for(placement: str, plugin: Plugin | None = None) -> torch.device:
    """The torch device of a role placed on ``placement`` (the manifest's ``placement.device``:
    ``cpu``, or the plugin's kind with an optional index, ``cuda:1``).

    Raises:
        PluginError: ``placement`` names another kind of device than the plugin's.
    """
    plugin = current() if plugin is None else plugin
    kind, _, index = placement.partition(":")
    if kind == "cpu" and plugin.device.kind != "cpu":
        return torch.device("cpu")
    if kind != plugin.device.kind:
        raise PluginError(
            f"placement.device {placement!r} is not a device of the {plugin.name!r} plugin "
            f"(its devices are '{plugin.device.kind}' or '{plugin.device.kind}:N'); fix the "
            f"placement or choose another plugin (run.plugin or {ENV})"
        )
    return plugin.device.select(int(index) if index else 0)


def dtype_for(name: str, device: torch.device, plugin: Plugin | None = None) -> torch.dtype:
    """The dtype a role computes in: ``name`` (a key of ``DTYPES``); empty: the plugin's
    dtype on the plugin's device, float32 on the host.

    Raises:
        ValueError: ``name`` is not a key of ``DTYPES``.
    """
    if name:
        if name not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)} or '', got {name!r}")
        return DTYPES[name]
    plugin = current() if plugin is None else plugin
    return plugin.dtype if device.type == plugin.device.kind else torch.float32


def sharding_for(plugin: Plugin | None = None) -> Sharding:
    """The plugin's ``sharding`` part (mesh and mixed precision of a sharded learner), or
    ``TorchSharding`` for its device kind when it has none: the part is optional."""
    from asyncrl.plugins.sharding import TorchSharding

    plugin = current() if plugin is None else plugin
    own = getattr(plugin, "sharding", None)
    if isinstance(own, Sharding):
        return own
    return TorchSharding(plugin.device.kind)
