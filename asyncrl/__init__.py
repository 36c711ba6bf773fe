"""asyncrl: an asynchronous actor-model runtime for RL post-training of language models.

What a user needs is importable from here::

    import asyncio

    import asyncrl
    from asyncrl import Delivery, Role, endpoint

    class Doubler(Role):                              # a role: a plain class with endpoints
        @endpoint(Delivery.IDEMPOTENT)
        async def double(self, x: int) -> int:
            return 2 * x

    async def main(ctx: asyncrl.Context) -> int:      # the control-flow program
        return await ctx.roles["doubler"].call("double", 21)

    manifest = asyncrl.load_manifest("manifest.yaml")   # raises ManifestError, every problem
    report = asyncio.run(asyncrl.run_manifest(manifest))

the ``Ledger`` a role that consumes results keeps so that it counts each one once, across its own
restarts (idempotent calls are delivered at least once), and every error asyncrl raises
(``asyncrl.errors`` draws their tree). The layers import as ``asyncrl.transport``,
``asyncrl.roles`` and ``asyncrl.plugins``.

Importing this package is cheap: it imports neither torch nor zmq. Each name is imported from
its module the first time it is used.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import typing

if typing.TYPE_CHECKING:
    from asyncrl.dispatch.handles import Context, Handle
    from asyncrl.errors import (
        AsyncrlError,
        BrokenError,
        ClosedError,
        ConfigError,
        ConfigProblem,
        DeadlineExceededError,
        DecodeError,
        DisconnectedError,
        ManifestError,
        MessageTooLargeError,
        NothingPublishedError,
        PeerDeadError,
        PeerUnreachableError,
        ProtocolError,
        ProtocolVersionError,
        RemoteError,
        RoleDeadError,
        StallError,
        TensorDescriptorError,
        TornReadError,
        TransportError,
        UnknownKindError,
        WeightsError,
        WeightsGoneError,
    )
    from asyncrl.ledger import Ledger
    from asyncrl.manifest.load import Manifest, load_manifest
    from asyncrl.role import Delivery, Role, RoleContext, endpoint
    from asyncrl.supervision.agent import run_manifest

__version__ = "0.1.0"

__all__ = [
    "AsyncrlError",
    "BrokenError",
    "ClosedError",
    "ConfigError",
    "ConfigProblem",
    "Context",
    "DeadlineExceededError",
    "DecodeError",
    "Delivery",
    "DisconnectedError",
    "Handle",
    "Ledger",
    "Manifest",
    "ManifestError",
    "MessageTooLargeError",
    "NothingPublishedError",
    "PeerDeadError",
    "PeerUnreachableError",
    "ProtocolError",
    "ProtocolVersionError",
    "RemoteError",
    "Role",
    "RoleContext",
    "RoleDeadError",
    "StallError",
    "TensorDescriptorError",
    "TornReadError",
    "TransportError",
    "UnknownKindError",
    "WeightsError",
    "WeightsGoneError",
    "__version__",
    "endpoint",
    "load_manifest",
    "run_manifest",
]

_HOMES = {
    "Context": "asyncrl.dispatch.handles",
    "Delivery": "asyncrl.role",
    "Handle": "asyncrl.dispatch.handles",
    "Ledger": "asyncrl.ledger",
    "Manifest": "asyncrl.manifest.load",
    "Role": "asyncrl.role",
    "RoleContext": "asyncrl.role",
    "endpoint": "asyncrl.role",
    "load_manifest": "asyncrl.manifest.load",
    "run_manifest": "asyncrl.supervision.agent",
}
"""Where each public name that is not an error lives; every error lives in ``asyncrl.errors``."""


def __getattr__(name: str) -> typing.Any:
    """Import a public name from its module on first use (PEP 562), and keep it here."""
    if name not in __all__ or name.startswith("__"):
        raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")
    module = importlib.import_module(_HOMES.get(name, "asyncrl.errors"))
    value = getattr(module, name)
    globals()[name] = value
    return value


class _SourceLayers(importlib.abc.MetaPathFinder):
    """Finds ``asyncrl.transport``, ``asyncrl.roles`` and ``asyncrl.plugins`` beside this package
    when it is imported from a source checkout (``transport/`` next to ``asyncrl/``, as the
    repository lays them out): a process started in the checkout (``python -m``, torchrun) puts
    the checkout first on ``sys.path`` and imports this package from there, even when a regular
    install of asyncrl holds the layers under ``asyncrl/``."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(
        self, name: str, path: typing.Any, target: typing.Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        parent, _, layer = name.partition(".")
        if parent != __name__ or layer not in ("transport", "roles", "plugins"):
            return None
        folder = os.path.join(self.root, layer)
        return importlib.util.spec_from_file_location(
            name, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )


def _find_source_layers() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    in_source = os.path.isfile(os.path.join(root, "transport", "__init__.py"))
    installed = os.path.isdir(os.path.join(here, "transport"))
    known = any(isinstance(f, _SourceLayers) for f in sys.meta_path)
    if in_source and not installed and not known:
        sys.meta_path.append(_SourceLayers(root))


_find_source_layers()


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
