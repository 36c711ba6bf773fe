"""Discovery across nodes: the keys a launch keeps in torchrun's TCPStore, and an async client.

torchrun already runs a key-value store every node reaches (``MASTER_ADDR:MASTER_PORT``, or
the c10d rendezvous store). The node agents of a launch (``asyncrl.launch``) meet there:
each publishes the tcp endpoints of the replicas it runs, its heartbeat, and how the run ended.
Every key lives under ``asyncrl/<run id>/``, and everything that belongs to one attempt of the
launch under ``asyncrl/<run id>/<attempt>/``, so that nothing an earlier attempt wrote is read again
after torchrun restarts the worker group.

The attempt is agreed through the store (``LaunchKeys``), not read from
``TORCHELASTIC_RESTART_COUNT``: torchrun counts only a node's own failures, so after node 1
failed, node 1 is at restart 1 while node 0, restarted to rejoin it, may still be at 0.

``StoreClient`` wraps ``torch.distributed.TCPStore``: each blocking call runs in a thread
(``asyncio.to_thread``), one at a time, so an event loop never waits on the network. torch is
imported only when a client is made: the node agent of ``asyncrl run`` never imports it.
"""

from __future__ import annotations

import asyncio
import datetime
import fcntl
import ipaddress
import socket
import struct
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from asyncrl.errors import AsyncrlError
from asyncrl.supervision.hosts import HostRecord

__all__ = [
    "LaunchKeys",
    "NodeRecord",
    "StoreClient",
    "StoreError",
    "free_ports",
    "node_address",
]

T = TypeVar("T")


class StoreError(AsyncrlError):
    """The launch's store cannot be reached, or a key did not appear in time."""


class LaunchKeys:
    """The names of a launch's keys in the store.

    Args:
        run_id: the launch's id (``TORCHELASTIC_RUN_ID``, else the manifest's run name).
    """

    def __init__(self, run_id: str) -> None:
        self.base = f"asyncrl/{run_id}"

    # -- across attempts -------------------------------------------------------------------

    @property
    def attempts(self) -> str:
        """A counter node 0 adds one to at each start: its value less one is the attempt."""
        return f"{self.base}/attempts"

    @property
    def current(self) -> str:
        """The attempt node 0 runs now (a decimal string)."""
        return f"{self.base}/current"

    @property
    def final(self) -> str:
        """How the run ended (JSON ``{status, reason, node}``), once it ended for good: an
        attempt that starts after it exits with the same status at once."""
        return f"{self.base}/final"

    def prefix(self, attempt: int) -> str:
        """The prefix of one attempt's keys (``<run id>/<attempt>`` after ``asyncrl/``)."""
        return f"{self.base}/{attempt}"

    # -- one attempt -----------------------------------------------------------------------

    def joined(self, attempt: int, node: int) -> str:
        """Set (first writer wins) by the agent of ``node`` that takes part in ``attempt``."""
        return f"{self.prefix(attempt)}/joined/{node}"

    def rejoin(self, attempt: int, node: int) -> str:
        """Set by a restarted agent of ``node`` that found ``attempt`` already joined: node 0
        then ends the attempt, so that every node starts the next one together."""
        return f"{self.prefix(attempt)}/rejoin/{node}"

    def claimed(self, attempt: int) -> str:
        """Set by node 0 once the run directory is ready (``ok``), or why it is not."""
        return f"{self.prefix(attempt)}/claimed"

    def endpoints(self, attempt: int, node: int) -> str:
        """What ``node`` publishes before anything starts: its replicas' tcp endpoints, its
        agent's and its host (``NodeRecord``, JSON)."""
        return f"{self.prefix(attempt)}/endpoints/{node}"

    def heartbeat(self, attempt: int, node: int) -> str:
        """A counter the agent of ``node`` raises every heartbeat interval."""
        return f"{self.prefix(attempt)}/heartbeat/{node}"

    def lost(self, attempt: int, node: int) -> str:
        """Set by node 0 once ``node`` is lost for good (JSON ``{reason, generation}``, the
        generation one more each time the node is lost): every agent then applies the run's new
        membership (``asyncrl.manifest.membership``)."""
        return f"{self.prefix(attempt)}/lost/{node}"

    def back(self, attempt: int, node: int) -> str:
        """Set by the agent of a lost ``node`` that joined the running attempt again, once its
        endpoints are published (JSON ``{generation}``: the ``lost`` mark it answers)."""
        return f"{self.prefix(attempt)}/back/{node}"

    def grown(self, attempt: int, node: int, generation: int) -> str:
        """Set by node 0 once ``node`` is back from the loss of ``generation``: which groups
        that went on without its ranks grow back with them (JSON ``{grown: {role: members},
        lead: {role: replica}, endpoints: {role: {replica: tcp}}, stays: {role: members}}``,
        ``grown`` empty when none does); every agent applies it
        (``asyncrl.manifest.membership.grow``)."""
        return f"{self.prefix(attempt)}/grown/{node}/{generation}"

    def moved(self, attempt: int, role: str, replica: int) -> str:
        """Set by the node that started ``role``'s ``replica`` again after its node was lost:
        its tcp endpoint (JSON ``{node, endpoint}``)."""
        return f"{self.prefix(attempt)}/moved/{role}/{replica}"

    def stop(self, attempt: int) -> str:
        """How the attempt ended (JSON ``{status, reason, node}``), first writer wins: every
        agent stops its roles when it appears."""
        return f"{self.prefix(attempt)}/stop"

    def done(self, attempt: int, node: int) -> str:
        """Set by the agent of ``node`` once its roles have stopped."""
        return f"{self.prefix(attempt)}/done/{node}"


class NodeRecord(msgspec.Struct, kw_only=True, frozen=True):
    """What one node publishes in the store for an attempt, before anything starts.

    Attributes:
        replicas: the tcp endpoint of each replica the node runs, by role and replica index.
        agent: the tcp endpoint of its agent's status server (``asyncrl.observe.status``).
        host: its host's record (``asyncrl.supervision.hosts``).
        trace_sink: node 0 of a traced launch: where the other nodes send their traces.
        shrunk: node 0: each data-parallel group that went on at a smaller size in an earlier
            attempt of the run, with the replicas that form it (``Membership.shrunk``); it
            stays so (docs/multinode.md).
        unserved: a node that joined the running attempt again: its ranks of a data-parallel
            group that went on without them, at the endpoints the group knows them by, which
            it does not start (kept for its next return).
        regrow: a node that joined the running attempt again: the tcp endpoint each of its
            ranks in ``unserved`` binds once its group grows back (``LaunchKeys.grown``).
    """

    replicas: dict[str, dict[int, str]]
    agent: str
    host: HostRecord
    trace_sink: str = ""
    shrunk: dict[str, list[int]] = {}
    unserved: dict[str, dict[int, str]] = {}
    regrow: dict[str, dict[int, str]] = {}


class StoreClient:
    """An asyncio client of a TCPStore; blocking calls run in a thread, one at a time.

    Args:
        host: the store's host (``MASTER_ADDR``).
        port: the store's port (``MASTER_PORT``).
        is_master: host the store in this process (when torchrun's agent does not).
        timeout_s: how long connecting, and a ``get`` of a missing key, may take.
    """

    def __init__(self, host: str, port: int, *, is_master: bool = False, timeout_s: float = 300.0):
        self.host = host
        self.port = port
        self._is_master = is_master
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._store: Any = None
        self._lock = asyncio.Lock()

    async def connect(self) -> None:
        """Connect to the store (or start it, as master).

        Raises:
            StoreError: it cannot be reached within the timeout.
        """

        def make() -> Any:
            from torch.distributed import TCPStore  # type: ignore[attr-defined]

            return TCPStore(
                self.host,
                self.port,
                is_master=self._is_master,
                timeout=self._timeout,
                wait_for_workers=False,
                multi_tenant=True,
            )

        try:
            self._store = await asyncio.to_thread(make)
        except Exception as exc:  # torch raises RuntimeError / DistNetworkError
            raise StoreError(
                f"cannot reach torchrun's store at {self.host}:{self.port} ({exc}); check "
                "--master-addr/--master-port (or --rdzv-endpoint) and that node 0 is up"
            ) from exc

    async def _call(self, what: str, fn: Callable[[], T]) -> T:
        if self._store is None:
            raise StoreError(f"store {self.host}:{self.port}: {what} before connect()")
        async with self._lock:
            try:
                return await asyncio.to_thread(fn)
            except Exception as exc:
                raise StoreError(
                    f"store {self.host}:{self.port}: {what} failed ({exc}); the store lives in "
                    "torchrun's agent on node 0 (or the rendezvous host): is it still running?"
                ) from exc

    async def set(self, key: str, value: str) -> None:
        """Set ``key`` to ``value``."""
        await self._call(f"set {key}", lambda: self._store.set(key, value))

    async def get(self, key: str) -> str:
        """The value of ``key``, waiting for it up to the client's timeout."""
        raw = await self._call(f"get {key}", lambda: self._store.get(key))
        return bytes(raw).decode()

    async def check(self, key: str) -> bool:
        """Whether ``key`` exists (never waits)."""
        found = await self._call(f"check {key}", lambda: self._store.check([key]))
        return bool(found)

    async def peek(self, key: str) -> str | None:
        """The value of ``key``, or None when it does not exist (never waits)."""

        def read() -> str | None:
            if not self._store.check([key]):
                return None
            return bytes(self._store.get(key)).decode()

        return await self._call(f"read {key}", read)

    async def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (0 when missing); return the new value."""
        value = await self._call(f"add {key}", lambda: self._store.add(key, amount))
        return int(value)

    async def set_once(self, key: str, value: str) -> str:
        """Set ``key`` to ``value`` unless it is set; return the value it holds now."""
        raw = await self._call(f"set {key}", lambda: self._store.compare_set(key, "", value))
        return bytes(raw).decode()

    async def wait_for(
        self, keys: list[str], timeout_s: float, *, interval_s: float = 0.2, why: str = ""
    ) -> None:
        """Wait until every key in ``keys`` exists.

        Polls with ``check`` (a blocking ``wait`` cannot be cancelled from the loop).

        Raises:
            StoreError: some are still missing after ``timeout_s``; the message names them and
                ``why`` they are awaited.
        """
        deadline = time.monotonic() + timeout_s
        missing = list(keys)
        while True:
            missing = [k for k in missing if not await self.check(k)]
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise StoreError(
                    f"waited {timeout_s:g} s for {', '.join(missing)} in the store at "
                    f"{self.host}:{self.port}{': ' + why if why else ''}"
                )
            await asyncio.sleep(interval_s)


_SIOCGIFADDR = 0x8915


def node_address(setting: str, master_addr: str) -> tuple[str, str]:
    """Where this node's replicas bind tcp, and the address the other nodes reach them at.

    Args:
        setting: the manifest's ``network.address``: an IP address, a network interface name,
            ``0.0.0.0`` (bind every interface, publish the one that routes to the master), or
            empty (the address that routes to ``master_addr``).
        master_addr: torchrun's ``MASTER_ADDR``.

    Returns:
        (bind host, published host).

    Raises:
        ValueError: ``setting`` is neither an address nor an interface of this machine, or
            ``master_addr`` cannot be resolved.
    """
    if setting in ("", "0.0.0.0"):
        route = _route_to(master_addr)
        return (setting or route), route
    try:
        ipaddress.ip_address(setting)
    except ValueError:
        address = _interface_address(setting)
        return address, address
    return setting, setting


def _route_to(host: str) -> str:
    """The local address this machine uses to reach ``host`` (no packet is sent)."""
    try:
        target = socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"cannot resolve MASTER_ADDR {host!r}: {exc}") from exc
    if ipaddress.ip_address(target).is_loopback:
        return target
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((target, 9))
        return str(probe.getsockname()[0])


def _interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux)."""
    known = [n for _, n in socket.if_nameindex()]
    if name not in known:
        raise ValueError(
            f"network.address: {name!r} is neither an IP address nor a network interface of "
            f"this machine (interfaces: {', '.join(known)}); give one of them, or an address"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(
                probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
            )
        except OSError as exc:
            raise ValueError(
                f"network.address: interface {name!r} has no IPv4 address ({exc.strerror})"
            ) from exc
    return socket.inet_ntoa(packed[20:24])


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct tcp ports free on ``host`` now, chosen by the kernel.

    Each replica binds its port again at every restart (zmq sets SO_REUSEADDR), so its callers
    reconnect by themselves. All are held open until every one is chosen, so none repeats.
    """
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()
