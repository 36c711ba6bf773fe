"""Discovery: where each (role, replica) listens.

``Registry`` is the interface; ``LocalRegistry`` is the implementation for one machine. Every
(name, replica) has a stable ipc endpoint under the run directory, so a restarted incarnation
rebinds the same address and its callers reconnect by themselves. Registering an entry records who
serves there now (pid, incarnation), written atomically, so a reader never sees half a file.

A TCPStore implementation for several machines lives in the runtime.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from typing import Protocol

import msgspec

from .sockets import IPC_PATH_MAX, make_private_dir

__all__ = ["Entry", "LocalRegistry", "Registry"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+\Z")


class Entry(msgspec.Struct, frozen=True):
    """Who serves (name, replica), where, and in which incarnation."""

    name: str
    replica: int
    endpoint: str
    pid: int = 0
    incarnation: int = 0


class Registry(Protocol):
    """Where roles find each other."""

    def endpoint(self, name: str, replica: int) -> str:
        """The stable endpoint of (name, replica); the same for every incarnation."""
        ...

    def register(self, entry: Entry) -> None:
        """Record that ``entry`` now serves at its endpoint."""
        ...

    def lookup(self, name: str, replica: int) -> Entry | None:
        """The latest registration of (name, replica), or None."""
        ...

    def entries(self) -> list[Entry]:
        """Every registration, sorted by name and replica."""
        ...


def _check_name(name: str, replica: int) -> None:
    if not _NAME_RE.match(name):
        raise ValueError(f"role name {name!r} may hold only letters, digits, '_', '.' and '-'")
    if replica < 0:
        raise ValueError(f"replica of {name!r} must be >= 0, got {replica}")


class LocalRegistry:
    """A registry for one machine, kept in files under ``run_dir``.

    Sockets live in ``<run_dir>/sockets``. When that path is too long for an ipc socket, they live
    in a short directory under the system temp dir, named by a hash of ``run_dir``, so the
    endpoints stay stable for the whole run. Either directory is made private (0700) whatever
    the umask.

    Raises:
        TransportError: the socket directory is a symlink or belongs to another user (someone
            created it first under the system temp dir).
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = os.path.abspath(run_dir)
        self._entries_dir = os.path.join(self.run_dir, "registry")
        socket_dir = os.path.join(self.run_dir, "sockets")
        if len(socket_dir) + 40 > IPC_PATH_MAX:
            digest = hashlib.sha1(self.run_dir.encode()).hexdigest()[:12]
            socket_dir = os.path.join(tempfile.gettempdir(), f"asyncrl-{digest}")
        self.socket_dir = socket_dir
        os.makedirs(self._entries_dir, exist_ok=True)
        make_private_dir(self.socket_dir)
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(Entry)

    def endpoint(self, name: str, replica: int) -> str:
        _check_name(name, replica)
        path = os.path.join(self.socket_dir, f"{name}.{replica}")
        if len(path) > IPC_PATH_MAX:
            raise ValueError(
                f"ipc path {path!r} is {len(path)} characters, over {IPC_PATH_MAX}; "
                f"use a shorter role name"
            )
        return f"ipc://{path}"

    def register(self, entry: Entry) -> None:
        _check_name(entry.name, entry.replica)
        final = os.path.join(self._entries_dir, f"{entry.name}.{entry.replica}.json")
        fd, tmp = tempfile.mkstemp(dir=self._entries_dir, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self._encoder.encode(entry))
            os.replace(tmp, final)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def lookup(self, name: str, replica: int) -> Entry | None:
        _check_name(name, replica)
        path = os.path.join(self._entries_dir, f"{name}.{replica}.json")
        try:
            with open(path, "rb") as f:
                return self._decoder.decode(f.read())
        except FileNotFoundError:
            return None

    def entries(self) -> list[Entry]:
        out = []
        for file in os.listdir(self._entries_dir):
            if file.endswith(".json") and not file.startswith("."):
                with open(os.path.join(self._entries_dir, file), "rb") as f:
                    out.append(self._decoder.decode(f.read()))
        return sorted(out, key=lambda e: (e.name, e.replica))
