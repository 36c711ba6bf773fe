"""What the supervisor tells a process it starts: one ProcessSpec, as JSON in ``ASYNCRL_SPEC``.

Importing this module imports neither torch nor user code: the node agent builds specs.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = ["EXIT_CONFIG", "SPEC_ENV", "GroupInfo", "ProcessSpec"]

SPEC_ENV = "ASYNCRL_SPEC"

EXIT_CONFIG = 78
"""Exit status of a process whose configuration is wrong (EX_CONFIG): restarting cannot help, so
the supervisor stops the run with a report instead of spending restarts."""


class GroupInfo(msgspec.Struct, frozen=True):
    """A role group as the driver sees it: the endpoint of each replica, and its timing."""

    endpoints: list[str]
    heartbeat_interval_s: float = 1.0
    liveness: int = 3


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
        config: the role's config mapping from the manifest.
        threads: CPU threads for compute.
        device: the placement's device.
        capacity: requests one replica works on at once.
        heartbeat_interval_s: seconds between pings.
        liveness: missed pings after which a peer is dead.
        parent_pid: the node agent's pid; the process exits if its parent is not this one.
        groups: for the driver: every role group, by name.
        pipeline: for the driver: the manifest's ``pipeline`` section.
    """

    kind: Literal["role", "driver", "command"]
    name: str
    replica: int = 0
    incarnation: int = 0
    target: str = ""
    endpoint: str
    run: str
    run_dir: str
    config: dict[str, Any] = {}
    threads: int = 1
    device: str = "cpu"
    capacity: int = 1
    heartbeat_interval_s: float = 1.0
    liveness: int = 3
    parent_pid: int = 0
    groups: dict[str, GroupInfo] = {}
    pipeline: dict[str, Any] = {}
