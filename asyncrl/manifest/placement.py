"""Where a role's replicas run: the ``placement`` section of a role in the manifest.

A placement names the node of each replica and the device it computes on, as the hardware
plugin names it (``cpu``, ``cuda:1``). Roles may share a device (colocation): each may then
take a share of the device's memory (``memory_fraction``, applied in the role's process through
the plugin's ``Device.limit_memory``) and give its cached memory back when it goes idle
(``release_when_idle``). The shares of the replicas on one device of one node may not sum over
1; ``sharing_problems`` says where they do. docs/manifest.md is the reference.

Importing this module imports neither torch nor user code (the node agent loads manifests).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeGuard

import msgspec

from asyncrl.manifest._schema import join
from asyncrl.manifest.limits import MAX_NODES

__all__ = [
    "Device",
    "Fraction",
    "NodeIndex",
    "Placement",
    "check_placement",
    "same_device",
    "sharing_problems",
]

NodeIndex = Annotated[int, msgspec.Meta(ge=0, lt=MAX_NODES)]
Device = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^[A-Za-z][A-Za-z0-9_]*(:[0-9]+)?$",
        extra={"expected": "'cpu', 'cuda', 'cuda:N' or another plugin's device string"},
    ),
]
Fraction = Annotated[
    float,
    msgspec.Meta(gt=0, le=1, extra={"expected": "a share of the device's memory in (0, 1]"}),
]


class Placement(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Where each replica of a role runs, and how it shares its device.

    Attributes:
        node: the index of the node (the torchrun node rank) of every replica; 0 on one machine.
        nodes: the nodes the replicas are spread over, round-robin (replica ``i`` runs on
            ``nodes[i % len(nodes)]``); given instead of ``node``.
        device: the device the replica computes on, as the hardware plugin names it.
        memory_fraction: the share of the device's memory each replica may use, in (0, 1];
            unset: no limit. On cuda the caching allocator refuses allocations past it; on
            the host it is a budget reported against (``asyncrl status``), not enforced.
        release_when_idle: give the device's cached memory back each time the role finishes
            a unit of work (the learner: after each step), for a role sharing its device.
    """

    node: NodeIndex = 0
    nodes: list[NodeIndex] = []
    device: Device = "cpu"
    memory_fraction: Fraction | None = None
    release_when_idle: bool = False

    def node_of(self, replica: int) -> int:
        """The node that runs replica ``replica``."""
        return self.nodes[replica % len(self.nodes)] if self.nodes else self.node


def check_placement(value: dict[Any, Any], path: str, problems: list[str]) -> None:
    """The checks across a placement's keys (a ``StructCheck`` of ``asyncrl.manifest._schema``)."""
    nodes = value.get("nodes")
    # node 0 is the default, which a saved manifest (manifest.json) writes out beside nodes.
    if value.get("node", 0) != 0 and nodes:
        problems.append(
            f"{join(path, 'nodes')}: both 'node' and 'nodes' are given; keep 'node' for one "
            "node or 'nodes' to spread the replicas over several"
        )
    if isinstance(nodes, list):
        seen: set[Any] = set()
        for i, node in enumerate(nodes):
            if node in seen and isinstance(node, int):
                problems.append(
                    f"{join(path, 'nodes')}[{i}]: node {node} is listed twice; list each node "
                    "once (the replicas go round-robin over the list)"
                )
            seen.add(node)


def same_device(device: str) -> str:
    """``device`` in the form that compares equal for one device: ``cuda`` is ``cuda:0``."""
    return device if ":" in device else f"{device}:0"


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _shares(roles: dict[Any, Any]) -> dict[tuple[int, str], dict[str, tuple[int, float]]]:
    """For each (node, device): the roles with a memory share there, as (replicas, share).

    Reads the raw mapping of the manifest's ``roles``; values of the wrong type are skipped
    (the schema walk reports them)."""
    out: dict[tuple[int, str], dict[str, tuple[int, float]]] = {}
    for name, role in roles.items():
        placement = role.get("placement") if isinstance(role, dict) else None
        if not isinstance(placement, dict):
            continue
        share, replicas = placement.get("memory_fraction"), role.get("replicas", 1)
        device, node = placement.get("device", "cpu"), placement.get("node", 0)
        nodes = placement.get("nodes") or [node]
        if not (_number(share) and 0 < share <= 1 and isinstance(replicas, int)):
            continue
        if not (isinstance(device, str) and isinstance(nodes, list)):
            continue
        for replica in range(max(replicas, 0)):
            where = nodes[replica % len(nodes)]
            if isinstance(where, int):
                row = out.setdefault((where, same_device(device)), {})
                count, _ = row.get(str(name), (0, share))
                row[str(name)] = (count + 1, float(share))
    return out


def sharing_problems(roles: Any, path: str = "roles") -> list[str]:
    """Each device whose replicas' memory shares sum over 1, with the roles and the sum.

    Args:
        roles: the manifest's raw ``roles`` mapping (as YAML loaded it).
        path: where ``roles`` is in the manifest, for the problems' paths.

    Returns:
        One problem per over-committed device, at the ``memory_fraction`` of its first role.
    """
    if not isinstance(roles, dict):
        return []
    problems = []
    for (node, device), row in sorted(_shares(roles).items()):
        total = sum(count * share for count, share in row.values())
        if total <= 1 + 1e-9:
            continue
        parts = [
            f"{name} ({count} replica{'s' if count > 1 else ''} x {share:g})"
            for name, (count, share) in row.items()
        ]
        first = join(join(join(path, next(iter(row))), "placement"), "memory_fraction")
        problems.append(
            f"{first}: {', '.join(parts)} share device {device} on node {node} with memory "
            f"fractions summing to {total:g}, over 1; lower their memory_fraction so that "
            f"the shares on {device} sum to at most 1, or place a role on another device"
        )
    return problems
