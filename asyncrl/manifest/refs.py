"""Roles that name other roles in their ``config``: ``weights_from``.

A role that reads its weights from the shared-memory store another role publishes (a rollout
replica reading the learner's) names that role in ``config.weights_from``. The runtime knows
nothing of particular roles, so the convention is by key, as the ``model`` section's is
(``asyncrl.manifest.model_section``): whatever the role, a ``weights_from`` in its config must name
a role of the manifest, and following ``weights_from`` from role to role must end at one that names
none, the role that publishes. Otherwise the reader finds no weights: ``sync`` answered version
0 silently, and a program waited on it until its stall timeout blamed another role.

Importing this module imports nothing of asyncrl but ``asyncrl.manifest._schema``.
"""

from __future__ import annotations

import difflib
from typing import Any

from asyncrl.manifest._schema import join

__all__ = ["WEIGHTS_FROM", "weights_from_problems"]

WEIGHTS_FROM = "weights_from"
"""The config key of a role that names the role whose published weights it reads."""


def weights_from_problems(roles: Any) -> list[str]:
    """Each ``roles.<name>.config.weights_from`` that names no role of ``roles``, or that leads
    back to a role already on its way (a cycle), with its path and how to fix it.

    ``roles`` is the raw ``roles`` mapping; values of the wrong type are skipped (the schema
    reports them), and so is an empty ``weights_from`` (the role reads none).
    """
    if not isinstance(roles, dict):
        return []
    source = {
        name: role["config"][WEIGHTS_FROM]
        for name, role in roles.items()
        if isinstance(role, dict)
        and isinstance(role.get("config"), dict)
        and isinstance(role["config"].get(WEIGHTS_FROM), str)
        and role["config"][WEIGHTS_FROM]
    }
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
