"""Roles that name other roles in their ``config``: ``weights_from``, and where they read it.

A role that reads its weights from the shared-memory store another role publishes (a rollout
replica reading the learner's) names that role in ``config.weights_from``. The runtime knows
nothing of particular roles, so the convention is by key, as the ``model`` section's is
(``asyncrl.manifest.model_section``): whatever the role, a ``weights_from`` in its config must name
a role of the manifest, and following ``weights_from`` from role to role must end at one that names
none, the role that publishes. Otherwise the reader finds no weights: ``sync`` answered version
0 silently, and a program waited on it until its stall timeout blamed another role.

The store is shared memory, which only processes on the publisher's host map. Over several
nodes (docs/multinode.md), a node whose replicas read ``weights_from: X`` therefore runs X's
replica 0 (the lead of X's group, which publishes) or a weight relay of X (a role of class
``RELAY_CLASS`` with ``config.source: X``), which republishes each version there;
``weight_host_problems`` says which nodes run neither. Otherwise those replicas wait on
version 0 until the run's stall timeout.

Importing this module imports nothing of asyncrl but ``asyncrl.manifest._schema`` and
``asyncrl.manifest.limits``.
"""

from __future__ import annotations

import difflib
from typing import Any

from asyncrl.manifest._schema import join
from asyncrl.manifest.limits import MAX_REPLICAS

__all__ = [
    "RELAY_CLASS",
    "RELAY_SOURCE",
    "WEIGHTS_FROM",
    "weight_host_problems",
    "weights_from_problems",
]

WEIGHTS_FROM = "weights_from"
"""The config key of a role that names the role whose published weights it reads."""


RELAY_CLASS = "asyncrl.roles.services.relay:Relay"
"""The class of the weight relay (``asyncrl.roles.services.relay``), named as a manifest names
it: the manifest imports no role."""

RELAY_SOURCE = "learner"
"""The role a relay copies when its ``config.source`` is not given (the relay's default)."""


def _sources(roles: dict[Any, Any]) -> dict[Any, str]:
    """Each role whose ``config.weights_from`` is a non-empty string, and what it names."""
    return {
        name: role["config"][WEIGHTS_FROM]
        for name, role in roles.items()
        if isinstance(role, dict)
        and isinstance(role.get("config"), dict)
        and isinstance(role["config"].get(WEIGHTS_FROM), str)
        and role["config"][WEIGHTS_FROM]
    }


def weights_from_problems(roles: Any) -> list[str]:
    """Each ``roles.<name>.config.weights_from`` that names no role of ``roles``, or that leads
    back to a role already on its way (a cycle), with its path and how to fix it.

    ``roles`` is the raw ``roles`` mapping; values of the wrong type are skipped (the schema
    reports them), and so is an empty ``weights_from`` (the role reads none).
    """
    if not isinstance(roles, dict):
        return []
    source = _sources(roles)
    problems = []
    reported: set[str] = set()
    for name, target in source.items():
        where = join(join(join("roles", name), "config"), WEIGHTS_FROM)
        if target not in roles:
            close = difflib.get_close_matches(target, [str(r) for r in roles], n=1)
            fix = f"did you mean {close[0]!r}?" if close else "name the role that publishes them"
            known = ", ".join(str(r) for r in roles)
            problems.append(f"{where}: no role {target!r} in this manifest ({known}); {fix}")
            continue
        chain = [name]
        while chain[-1] in source and source[chain[-1]] in roles:
            following = source[chain[-1]]
            if following in chain:
                cycle = chain[chain.index(following) :]
                if following == name and not reported & set(cycle):
                    reported.update(cycle)
                    problems.append(_cycle_problem(where, [*cycle, following]))
                break
            chain.append(following)
    return problems


def _cycle_problem(where: str, cycle: list[str]) -> str:
    if len(cycle) == 2:
        return (
            f"{where}: the role names itself, so no role publishes the weights it reads; "
            "name the role that publishes them (the learner), or remove the key"
        )
    path = " -> ".join(cycle)
    return (
        f"{where}: a cycle ({path}), so no role of it publishes the weights the others read; "
        "point one of them at the role that publishes them (the learner)"
    )


def _replica_nodes(role: Any) -> list[int] | None:
    """The node each replica of a raw role starts on (replica ``i`` at ``[i]``), as
    ``Placement.node_of`` places it; None where its replicas or placement are of the wrong type
    (the schema reports them). A single replica's fallback nodes (``nodes[1:]``) are not in it."""
    if not isinstance(role, dict):
        return None
    replicas, placement = role.get("replicas", 1), role.get("placement", {})
    if not (isinstance(replicas, int) and not isinstance(replicas, bool)):
        return None
    if not (1 <= replicas <= MAX_REPLICAS and isinstance(placement, dict)):
        return None
    nodes = placement.get("nodes") or [placement.get("node", 0)]
    if not (isinstance(nodes, list) and all(_is_node(n) for n in nodes)):
        return None
    return [nodes[i % len(nodes)] for i in range(replicas)]


def _is_node(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _relay_nodes(roles: dict[Any, Any], source: str) -> dict[int, list[str]]:
    """The nodes the relays of ``source`` start on, each with the relays there."""
    out: dict[int, list[str]] = {}
    for name, role in roles.items():
        if not isinstance(role, dict) or role.get("class") != RELAY_CLASS:
            continue
        config = role.get("config")
        config = config if isinstance(config, dict) else {}
        if config.get("source", RELAY_SOURCE) != source:
            continue
        for node in _replica_nodes(role) or []:
            out.setdefault(node, []).append(str(name))
    return out


def weight_host_problems(roles: Any) -> list[str]:
    """Each node that runs replicas reading ``weights_from: X`` but neither X's replica 0 (its
    lead, which publishes into its host's shared memory) nor a relay of X (class
    ``RELAY_CLASS``, ``config.source: X``), with the replicas there and how to fix it.

    Only where X publishes: it names no ``weights_from`` itself (``weights_from_problems``
    reports unknown roles and cycles). Each replica is checked on the node it starts on; a
    single replica's fallback nodes (``placement.nodes[1:]``) are not, since what runs there
    after a loss depends on which node was lost (the lead and the relays move too). One
    machine (every replica on node 0, with X's lead) has none. ``roles`` is the raw ``roles``
    mapping; values of the wrong type are skipped (the schema reports them).
    """
    if not isinstance(roles, dict):
        return []
    sources = _sources(roles)
    uncovered: dict[tuple[str, int], list[tuple[Any, int]]] = {}
    lead_node: dict[str, int] = {}
    relays: dict[str, dict[int, list[str]]] = {}
    for name, source in sources.items():
        if source not in roles or source in sources:
            continue
        nodes, lead = _replica_nodes(roles[name]), _replica_nodes(roles[source])
        if nodes is None or lead is None:
            continue
        lead_node[source] = lead[0]
        relays.setdefault(source, _relay_nodes(roles, source))
        for replica, node in enumerate(nodes):
            if node != lead[0] and node not in relays[source]:
                uncovered.setdefault((source, node), []).append((name, replica))
    return [
        _uncovered_problem(roles, source, node, readers, lead_node[source], relays[source])
        for (source, node), readers in uncovered.items()
    ]


def _uncovered_problem(
    roles: dict[Any, Any],
    source: str,
    node: int,
    readers: list[tuple[Any, int]],
    lead: int,
    relays: dict[int, list[str]],
) -> str:
    """The problem of ``node``, whose ``readers`` (role, replica) read ``source``'s weights, at
    the first reader's placement: the lead's node, the relay to add, the nodes that have one."""
    where = join(join("roles", readers[0][0]), "placement")
    names = ", ".join(f"{name}[{replica}]" for name, replica in readers)
    relay = f"relay{node}" if f"relay{node}" not in roles else f"{source}_relay{node}"
    covered = {lead: [f"{source}[0]"]}
    for at_node, names_there in relays.items():
        covered.setdefault(at_node, []).extend(names_there)
    others = "; ".join(f"node {n}: {', '.join(covered[n])}" for n in sorted(covered))
    return (
        f"{where}: node {node} runs {names} ({WEIGHTS_FROM}: {source}) but neither {source}'s "
        f"replica 0, which publishes its weights into its own host's shared memory (on node "
        f"{lead}), nor a relay of {source}, so they never get its weights; place a relay there "
        f"(roles.{relay}: {{class: {RELAY_CLASS}, placement: {{node: {node}}}, config: "
        f"{{source: {source}}}}}), or move them to a node that has one ({others})"
    )
