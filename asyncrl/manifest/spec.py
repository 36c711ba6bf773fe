"""What the supervisor tells a process it starts: one ProcessSpec, as JSON in a private file.

The node agent writes each incarnation's spec to ``<run_dir>/specs/<name>.<replica>.<n>.json``
(``write_spec``) and passes its path in ``ASYNCRL_SPEC_FILE``; the process reads it back with
``load_spec_from_env``. A file, not the environment itself: Linux refuses a single environment
string over 128 KiB (``E2BIG``, "Argument list too long"), and a run's ``config`` may be larger.

Importing this module imports neither torch nor user code: the node agent builds specs.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

__all__ = [
    "EXIT_CONFIG",
    "SPEC_DIR",
    "SPEC_FILE_ENV",
    "GroupInfo",
    "ProcessSpec",
    "load_spec_from_env",
    "spec_path",
    "write_private",
    "write_spec",
]

SPEC_FILE_ENV = "ASYNCRL_SPEC_FILE"
"""The path of the spec file, written by the node agent."""

SPEC_DIR = "specs"
"""The folder of the run directory that holds the spec files (private: 0700)."""

EXIT_CONFIG = 78
"""Exit status of a process whose configuration is wrong (EX_CONFIG): restarting cannot help, so
the supervisor stops the run with a report instead of spending restarts."""

DeliveryName = Literal["idempotent", "once", "latest"]


class GroupInfo(msgspec.Struct, frozen=True):
    """A role group as the driver sees it.

    Attributes:
        endpoints: the address of each replica.
        heartbeat_interval_s: seconds between pings.
        liveness: missed pings after which a replica is dead.
        delivery: the delivery class of each method as the manifest declares it
            (``roles.<name>.endpoints``); what a replica's ``_describe`` answers wins over it.
    """

    endpoints: list[str]
    heartbeat_interval_s: float = 1.0
    liveness: int = 3
    delivery: dict[str, DeliveryName] = {}


class ProcessSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a supervised process needs to start.

    Attributes:
        kind: ``role`` (a Role class), ``driver`` (the control-flow program) or ``command`` (an
            external executable; it gets the ``ASYNCRL_*`` variables instead of this spec).
        name: the role's name (``driver`` for the driver).
        replica: the replica index.
        incarnation: the restart count of this replica.
        target: ``module:Class`` or an entry-point name for a role; ``module:function`` or
            ``file.py:function`` for the driver.
        endpoint: the stable endpoint to bind.
        run: the run's name.
        run_dir: the run directory.
        node_dir: the folder of the node the process runs on now, where that is not
            ``run_dir``: a replica moved off a lost node keeps its home node's folder as
            ``run_dir`` (its durable state is there) and reads the membership of the node it
            runs on from here. Empty: ``run_dir``.
        config: the role's config mapping from the manifest.
        threads: CPU threads for compute.
        device: the placement's device.
        memory_fraction: the placement's share of the device's memory (0: no limit), which
            the role applies through its plugin (``Device.limit_memory``).
        release_when_idle: the placement's ``release_when_idle``: the role gives its cached
            device memory back when it goes idle.
        capacity: requests one replica works on at once.
        heartbeat_interval_s: seconds between pings, and between two beats of the process's
            heartbeat thread.
        liveness: missed pings after which a peer is dead.
        warn_after_s: seconds of a blocked event loop after which the process logs a warning
            with the loop's stack.
        parent_pid: the node agent's pid; the process exits if its parent is not this one.
        replicas: how many replicas the role has (a data-parallel group's world size).
        members: the replicas of its data-parallel group that run now, in rank order, once the
            group went on at a smaller size (a node holding some of its ranks was lost:
            ``asyncrl.manifest.membership``); empty: all ``replicas``.
        formation: which formation of its data-parallel group over several nodes it joins: the
            number node 0 gave the group's last change of members in this attempt (a loss that
            took ranks out, a growth back), the same on every node once each applied node 0's
            words (``NodeView.formations``); 0: none.
        groups: every role group, by name, with endpoints as seen from this process's node (the
            driver calls them; a role may call another, e.g. a relay its publisher).
        pipeline: for the driver: the manifest's ``pipeline`` section.
        model: the manifest's ``model`` section: for a role, it fills the fields of the
            role's Config that its config leaves unset (``asyncrl.manifest.model_section``);
            the driver's program reads it as ``ctx.model``.
        roles: for the driver: each role's ``class`` and ``config`` as the manifest gives
            them, which the program reads typed through ``ctx.role_config(name)``.
        tcp_endpoint: in a launch over several nodes, the tcp endpoint the replica also binds,
            for callers on other nodes (the same port for every incarnation); empty otherwise.
        curve_keys: the folder of CurveZMQ keys every tcp socket of the process uses; empty:
            no Curve.
    """

    kind: Literal["role", "driver", "command"]
    name: str
    replica: int = 0
    incarnation: int = 0
    target: str = ""
    endpoint: str
    run: str
    run_dir: str
    node_dir: str = ""
    config: dict[str, Any] = {}
    threads: int = 1
    device: str = "cpu"
    memory_fraction: float = 0.0
    release_when_idle: bool = False
    capacity: int = 1
    heartbeat_interval_s: float = 1.0
    liveness: int = 3
    warn_after_s: float = 5.0
    parent_pid: int = 0
    replicas: int = 1
    members: list[int] = []
    formation: int = 0
    groups: dict[str, GroupInfo] = {}
    pipeline: dict[str, Any] = {}
    model: dict[str, Any] = {}
    roles: dict[str, dict[str, Any]] = {}
    tcp_endpoint: str = ""
    curve_keys: str = ""


def spec_path(run_dir: str, name: str, replica: int, incarnation: int, suffix: str = "") -> str:
    """Where incarnation ``incarnation`` of ``name``.``replica`` finds its spec file."""
    file = f"{name}.{replica}.{incarnation}{suffix}.json"
    return os.path.join(run_dir, SPEC_DIR, file)


def write_private(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, readable by this user only.

    The folder is created private (0700) whatever the umask; the file appears complete or not
    at all (written to a temporary file beside it, then renamed). Raises ``OSError``.
    """
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_spec(spec: ProcessSpec) -> str:
    """Write ``spec`` to its file in the run directory; return the path.

    The previous incarnation's file is removed: that process has exited, and a restart loop
    must not fill the folder.
    """
    path = spec_path(spec.run_dir, spec.name, spec.replica, spec.incarnation)
    write_private(path, msgspec.json.encode(spec))
    if spec.incarnation > 0:
        old = spec_path(spec.run_dir, spec.name, spec.replica, spec.incarnation - 1)
        try:
            os.unlink(old)
        except FileNotFoundError:
            pass
    return path


def load_spec_from_env(environ: Mapping[str, str] | None = None) -> ProcessSpec:
    """The spec of this process, read from the file named by ``ASYNCRL_SPEC_FILE``.

    Raises:
        SystemExit: with a message, when the variable is not set, the file cannot be read, or
            its content is not a spec; the process cannot start without one.
    """
    env = os.environ if environ is None else environ
    path = env.get(SPEC_FILE_ENV)
    if not path:
        raise SystemExit(
            f"asyncrl.supervision.process is started by the supervisor, with {SPEC_FILE_ENV} set"
        )
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise SystemExit(
            f"asyncrl.supervision.process: cannot read the spec file {path!r} named by "
            f"{SPEC_FILE_ENV} "
            f"({exc.strerror}); it is written by the node agent, which must still be running"
        ) from exc
    try:
        return msgspec.json.decode(raw, type=ProcessSpec)
    except msgspec.DecodeError as exc:
        raise SystemExit(
            f"asyncrl.supervision.process: the spec file {path!r} is not a valid spec: {exc}"
        ) from exc
