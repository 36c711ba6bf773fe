"""The limits of a manifest: the largest counts, durations and sizes it may ask for, the names it
may not use, and the checks of what the runtime derives from it.

Without limits a slip is accepted and fails far from its cause: ``replicas: 1000000000`` ran out
of memory after 20 s, ``capacity: 1e30`` overflowed in a log a minute later, a 240-character run
name made shared-memory names the system refuses, a 200 KB environment value made the supervisor
fail to start a process. Each limit below is far above what a run needs and far below what breaks;
docs/manifest.md (Limits) lists them with their reasons. The counts and durations are bounds of
the schema's types (``asyncrl.manifest.load``, ``asyncrl.manifest.pipeline_section``,
``asyncrl.manifest.placement``); the names and environments are checked here, on the raw manifest,
by ``name_problems`` and ``environment_problems``. The size and depth of the YAML itself are checked
while it is read (``asyncrl.manifest.yaml_reader``).

Importing this module imports nothing of asyncrl but ``asyncrl.manifest._schema``.
"""

from __future__ import annotations

from typing import Any

from asyncrl.manifest._schema import join

__all__ = [
    "MAX_CAPACITY",
    "MAX_COUNT",
    "MAX_DEPTH",
    "MAX_ENV_STRING",
    "MAX_ENV_TOTAL",
    "MAX_LIVENESS",
    "MAX_MANIFEST_BYTES",
    "MAX_NODES",
    "MAX_RATIO",
    "MAX_REPLICAS",
    "MAX_RESTARTS",
    "MAX_ROLE_NAME",
    "MAX_RUN_NAME",
    "MAX_SECONDS",
    "MAX_THREADS",
    "MAX_VALUES",
    "RESERVED_ROLE_NAMES",
    "environment_problems",
    "name_problems",
    "run_name_problem",
]

MAX_REPLICAS = 4096
"""The most replicas of one role: each is a process (and a socket, a log file, a spec file)."""

MAX_CAPACITY = 65536
"""The most requests one replica works on at once (the credit it advertises)."""

MAX_THREADS = 1024
"""The most CPU threads of one process."""

MAX_NODES = 4096
"""The most nodes of a launch: a placement's node index is below it."""

MAX_RESTARTS = 10_000
"""The largest restart budget (``supervision.max_restarts``) within one period."""

MAX_LIVENESS = 1000
"""The most heartbeats a replica may miss before it is taken as hung."""

MAX_SECONDS = 604_800
"""The longest duration of the manifest, in seconds: 7 days. Also what refuses ``.inf``."""

MAX_COUNT = 1_000_000
"""The largest other count of the manifest (``pipeline.eta``, ``overprovision``, ``k_min``)."""

MAX_RATIO = 1_000_000
"""The largest factor of the manifest (``pipeline.importance_cap``)."""

MAX_RUN_NAME = 64
"""The longest run name. It is part of the name of every shared-memory segment of the run,
``asyncrl.<run>.<pid>.<incarnation>.<seq>``, which may have at most 255 bytes (``NAME_MAX``): 64
leaves room for the three numbers whatever they grow to."""

MAX_ROLE_NAME = 32
"""The longest role name. It is part of each replica's socket path,
``<sockets>/<role>.<replica>``, which may have at most 107 bytes (``sun_path``): the socket
folder is used inside the run directory while its path has at most 67 bytes (otherwise a short
folder under the system's temporary directory), which leaves 32 for the role's name with up to
four digits of replica index."""

RESERVED_ROLE_NAMES: dict[str, str] = {
    "agent": "the node agent's own log (logs/agent.jsonl), socket and status entry",
    "driver": "the driver process that runs the program (its socket driver.0, its spec and log "
    "files)",
    "janitor": "the process that sweeps the run's sockets and segments (logs/janitor.log)",
    "zygote": "the process that forks new incarnations (logs/zygote.stderr)",
}
"""Role names the runtime's own processes use, with what would clash. They are compared without
regard to case: ``Driver`` names the same files as ``driver`` on a file system that ignores case
(macOS, Windows shares), and reads as the same process in a log."""

MAX_ENV_STRING = 128 * 1024
"""Linux's ``MAX_ARG_STRLEN``: the most bytes of one environment string (``NAME=value`` and its
final NUL) or one argument of a command; a longer one fails the process's start with E2BIG
("Argument list too long")."""

MAX_ENV_TOTAL = 1024 * 1024
"""The most bytes of the environment variables and command arguments the manifest gives one
process. Linux bounds a process's arguments and environment together by a quarter of the stack
limit (2 MiB by default), and the process inherits the agent's environment too."""

MAX_MANIFEST_BYTES = 4 * 1024 * 1024
"""The largest manifest in bytes, as written and as expanded: each YAML alias counts as a full
copy of what it names (a 569-byte file of nested aliases expanded to a 346 MB
``manifest.json``). Large data belongs in files the roles read."""

MAX_VALUES = 1_000_000
"""The most values (scalars, lists and mappings) of a manifest, expanded as above."""

MAX_DEPTH = 64
"""The deepest nesting of lists and mappings in a manifest, expanded as above."""


def run_name_problem(name: str) -> str | None:
    """Why ``name`` (a well-formed run name) is too long to name the run's resources, or None."""
    if len(name) <= MAX_RUN_NAME:
        return None
    return (
        f"{len(name)} characters, over the {MAX_RUN_NAME} a run's name may have: it is part of "
        "the names of the run's shared-memory segments (asyncrl.<run>.<pid>.<incarnation>."
        "<seq>), which the system limits to 255 bytes; shorten it"
    )


def name_problems(roles: Any) -> list[str]:
    """The role names of a raw ``roles`` mapping that are too long or reserved (in any case), with
    their paths."""
    if not isinstance(roles, dict):
        return []
    problems = []
    for name in roles:
        if not isinstance(name, str):
            continue  # an invalid key, reported by the schema
        where = join("roles", name)
        reserved = name.lower()
        if reserved in RESERVED_ROLE_NAMES:
            spelt = "" if reserved == name else f" (as {reserved!r}: case does not matter)"
            problems.append(
                f"{where}: the role name {name!r} is reserved{spelt} for "
                f"{RESERVED_ROLE_NAMES[reserved]}; rename the role (reserved, in any case: "
                f"{', '.join(sorted(RESERVED_ROLE_NAMES))})"
            )
        elif len(name) > MAX_ROLE_NAME:
            problems.append(
                f"{where}: the role name has {len(name)} characters, over the {MAX_ROLE_NAME} a "
                "role's name may have: it is part of the path of each replica's socket "
                "(<sockets>/<role>.<replica>), which the system limits to 107 bytes; shorten it"
            )
    return problems


def environment_problems(raw: dict[Any, Any]) -> list[str]:
    """Each environment string or command argument a process could not be started with, and
    each process whose environment and arguments from the manifest are too large together.

    ``raw`` is the whole manifest as YAML loaded it (values of the wrong type are skipped:
    the schema reports them).
    """
    run = raw.get("run")
    run_env = _strings(run.get("env") if isinstance(run, dict) else None)
    problems = _string_problems(join("run", "env"), run_env)
    processes: list[tuple[str, str, dict[str, str], list[str]]] = []
    driver = raw.get("driver")
    driver_env = driver.get("env") if isinstance(driver, dict) else None
    processes.append(("driver", "driver.env", _strings(driver_env), []))
    roles = raw.get("roles")
    for name, role in (roles if isinstance(roles, dict) else {}).items():
        if not isinstance(role, dict):
            continue
        where = join("roles", name)
        command = role.get("command")
        args = [a for a in command if isinstance(a, str)] if isinstance(command, list) else []
        processes.append((where, join(where, "env"), _strings(role.get("env")), args))
        for i, arg in enumerate(args):
            if len(arg.encode()) + 1 > MAX_ENV_STRING:
                problems.append(
                    f"{join(where, 'command')}[{i}]: the argument has {len(arg.encode()):,} "
                    f"bytes, over the {MAX_ENV_STRING - 1:,} Linux allows one argument "
                    "(MAX_ARG_STRLEN, 128 KiB); pass a value this large by file"
                )
    for where, env_path, env, args in processes:
        problems += _string_problems(env_path, env)
        # A string over its own limit is reported once, above, not again in every total.
        fits = {k: v for k, v in {**run_env, **env}.items() if _env_bytes({k: v}) <= MAX_ENV_STRING}
        sizes = [len(a.encode()) + 1 for a in args]
        total = _env_bytes(fits) + sum(s for s in sizes if s <= MAX_ENV_STRING)
        if total > MAX_ENV_TOTAL:
            parts = "run.env, " + env_path + (" and the command's arguments" if args else "")
            problems.append(
                f"{where}: the environment and arguments the manifest gives the process "
                f"({parts}) have {total:,} bytes together, over the {MAX_ENV_TOTAL:,} allowed "
                "(Linux bounds a process's environment and arguments together, and it also "
                "inherits the agent's environment); pass large values by file"
            )
    return problems


def _strings(env: Any) -> dict[str, str]:
    if not isinstance(env, dict):
        return {}
    return {k: v for k, v in env.items() if isinstance(k, str) and isinstance(v, str)}


def _env_bytes(env: dict[str, str]) -> int:
    return sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items())  # '=' and NUL


def _string_problems(path: str, env: dict[str, str]) -> list[str]:
    problems = []
    for key, value in env.items():
        size = _env_bytes({key: value})
        if size > MAX_ENV_STRING:
            problems.append(
                f"{join(path, key)}: the variable has {size - 1:,} bytes ({key}=value), over "
                f"the {MAX_ENV_STRING - 1:,} Linux allows one environment string "
                "(MAX_ARG_STRLEN, 128 KiB); pass a value this large by file: write it to a "
                "file and give its path, or put it in the role's config, which reaches the "
                "role by file"
            )
    return problems
