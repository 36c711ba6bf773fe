"""A role's part of its device: its memory, as ``asyncrl status`` shows it, its share of a
device it shares with other roles, and giving cached memory back when it goes idle.

A role on an accelerator asks the hardware plugin (``device.memory()``); a role on the host
asks the ``cpu`` plugin, whichever plugin the process chose, so a host-side reference in a
cuda run still reports its resident memory. Roles override ``Role.status()`` with
``device_status(self.device)``, or with ``DeviceShare.status()`` when they hold one; the
process wrapper serves it under ``_status``.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import msgspec
import torch

from asyncrl.manifest.spec import SPEC_FILE_ENV, load_spec_from_env
from asyncrl.plugins.contract import Device, MemoryStats, Plugin
from asyncrl.plugins.registry import current, load

__all__ = ["DeviceShare", "device_of", "device_status", "placement_sharing"]

_log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")


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
    stats = _selected(device_of(device, plugin), torch.device(device)).memory()
    return {"device": str(torch.device(device)), "memory": msgspec.to_builtins(stats)}


def _selected(dev: Device, device: torch.device) -> Device:
    """``dev``, with ``device`` made the calling thread's current device first where it has an
    index of the plugin's kind. The current device is per thread (CUDA's is): a role selects
    ``cuda:1`` in its compute thread, and without this its status, asked on the event loop's
    thread, would read device 0's memory (and open a context there)."""
    if device.type == dev.kind and device.index is not None:
        dev.select(device.index)
    return dev


def placement_sharing(ctx: Any) -> tuple[float, bool]:
    """The placement's ``memory_fraction`` (0: none) and ``release_when_idle`` of a role.

    Read from the role's context when it carries them, else from the spec of this process
    (``ProcessSpec``, which the node agent writes from the manifest's placement); a role
    called in-process without either shares nothing: ``(0.0, False)``.
    """
    fraction, release = (
        getattr(ctx, "memory_fraction", None),
        getattr(ctx, "release_when_idle", None),
    )
    if fraction is None and os.environ.get(SPEC_FILE_ENV):
        spec = load_spec_from_env()
        if (spec.name, spec.replica) == (ctx.name, ctx.replica):
            fraction, release = spec.memory_fraction, spec.release_when_idle
    return float(fraction or 0.0), bool(release)


class DeviceShare:
    """A role's part of a device other roles may share.

    It applies the role's memory share once (``Device.limit_memory``), gives the device's
    cached memory back when the role goes idle (``release_when_idle``), and reports the
    role's memory with both (``status``).

    Args:
        device: the torch device the role computes on (already selected).
        fraction: the share of the device's memory this process may use; 0: no limit.
        release_when_idle: whether ``idle`` releases the cache.
        plugin: the hardware plugin (default: this process's).

    Raises:
        ValueError: ``fraction`` is outside [0, 1], or ``device`` is not the plugin's kind nor
            the host.
    """

    def __init__(
        self,
        device: torch.device | str,
        fraction: float = 0.0,
        release_when_idle: bool = False,
        plugin: Plugin | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.dev = device_of(self.device, plugin)
        self.fraction = fraction
        self.release_when_idle = release_when_idle
        self.releases = 0
        self.last_release: dict[str, int] = {}
        self.release_error = ""  # why the last release that failed did
        self._busy = 0
        self._lock = threading.Lock()
        self._releasing = threading.RLock()  # one release at a time
        if fraction:
            _selected(self.dev, self.device).limit_memory(fraction)

    @classmethod
    def for_role(
        cls, ctx: Any, device: torch.device | str, plugin: Plugin | None = None
    ) -> DeviceShare:
        """The share of the role whose context is ``ctx`` (``placement_sharing``)."""
        fraction, release = placement_sharing(ctx)
        return cls(device, fraction, release, plugin)

    def memory(self) -> MemoryStats:
        """This process's memory on the share's device (``Device.memory``), from any thread."""
        return _selected(self.dev, self.device).memory()

    def release(self) -> dict[str, int]:
        """Give the device's cached memory back now; returns the memory this process held
        before and after (``allocated`` and ``reserved`` in bytes), also kept for ``status``.
        Slow-ish (a garbage collection): call it off the event loop. Releases run one at a
        time."""
        with self._releasing:
            before = self.memory()
            self.dev.release_cache()  # on the device memory() just made current
            after = self.dev.memory()
            self.releases += 1
            self.last_release = {
                "allocated_before": before.allocated,
                "allocated_after": after.allocated,
                "reserved_before": before.reserved,
                "reserved_after": after.reserved,
            }
            return self.last_release

    def idle(self) -> None:
        """The role went idle: release the cache when the placement asks for it. A release
        that fails is an economy lost, not the work's failure: it is logged and reported by
        ``status`` (``release_error``), and the work's own answer or error stands."""
        if not self.release_when_idle:
            return
        try:
            self.release()
        except Exception as exc:
            self.release_error = f"{type(exc).__name__}: {exc}"
            _log.warning(
                f"cache release of {self.device} failed ({self.release_error}); the work goes "
                "on with the cache held"
            )

    def working(self, fn: Callable[P, T]) -> Callable[P, T]:
        """``fn`` counted as a unit of work: when the last of the calls in progress returns
        (calls may overlap), the role is idle and ``idle`` releases the cache (not when another
        call began while an earlier release was running). For a worker thread
        (``ctx.offload``), as the release is slow-ish."""

        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> T:
            with self._lock:
                self._busy += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self._busy -= 1
                    last = self._busy == 0
                if last:
                    self._idle_unless_busy()

        return run

    def _idle_unless_busy(self) -> None:
        """``idle``, once the release in progress (if any) is over, unless work began
        meanwhile: that work's end releases, and the cache is not taken from under it."""
        with self._releasing:
            with self._lock:
                if self._busy:
                    return
            self.idle()

    def status(self) -> dict[str, Any]:
        """``device_status`` of the device, with the share: ``memory_fraction``,
        ``release_when_idle``, ``releases``, ``last_release`` (``release``'s answer) and
        ``release_error`` (why the last release that failed did; empty: none failed)."""
        return {
            "device": str(self.device),
            "memory": msgspec.to_builtins(self.memory()),
            "memory_fraction": self.fraction,
            "release_when_idle": self.release_when_idle,
            "releases": self.releases,
            "last_release": dict(self.last_release),
            "release_error": self.release_error,
        }
