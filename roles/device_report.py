"""What a role reports of its device: its memory, as ``asyncrl status`` shows it.

A role on an accelerator asks the hardware plugin (``device.memory()``); a role on the host
asks the ``cpu`` plugin, whichever plugin the process chose, so a host-side reference in a
cuda run still reports its resident memory. Roles override ``Role.status()`` with
``device_status(self.device)``; the process wrapper serves it under ``_status``.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import torch

from asyncrl.plugins.contract import Device, Plugin
from asyncrl.plugins.registry import current, load

__all__ = ["device_of", "device_status"]


@functools.cache
def _host() -> Device:
    return load("cpu").device


def device_of(device: torch.device | str, plugin: Plugin | None = None) -> Device:
    """The plugin's ``Device`` that holds ``device``: the plugin's own for its kind, the
    ``cpu`` plugin's for the host.

    Raises:
        ValueError: ``device`` is neither the host nor of the plugin's kind.
    """
    plugin = current() if plugin is None else plugin
    kind = torch.device(device).type
    if kind == plugin.device.kind:
        return plugin.device
    if kind == "cpu":
        return _host()
    raise ValueError(
        f"device {str(device)!r} is not a device of the {plugin.name!r} plugin "
        f"(its kind is {plugin.device.kind!r}) nor the host; place the role on one of those"
    )


def device_status(device: torch.device | str, plugin: Plugin | None = None) -> dict[str, Any]:
    """A role's ``status()`` facts about ``device``.

    Args:
        device: the torch device the role computes on.
        plugin: the hardware plugin (default: this process's, ``registry.current()``).

    Returns:
        ``{"device": "cuda:0", "memory": {...}}``: ``memory`` holds the fields of
        ``asyncrl.plugins.contract.MemoryStats`` in bytes (allocated, reserved, peak, total,
        available, limit). Cheap: it reads counters, so it may run on the event loop.

    Raises:
        ValueError: as ``device_of``.
    """
    stats = device_of(device, plugin).memory()
    return {"device": str(torch.device(device)), "memory": msgspec.to_builtins(stats)}
