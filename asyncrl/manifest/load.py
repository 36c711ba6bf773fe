"""The role manifest: the YAML file that says which roles a run has and how to run them.

A manifest names the control-flow program (``run``), sets up the driver process (``driver``),
says once which model and tokenizer the roles load (``model``, ``asyncrl.manifest.model_section``)
and lists the roles (``roles``): for each, its class or external command, replicas, capacity, CPU
threads, placement (``asyncrl.manifest.placement``: node, device, a share of the device's memory),
environment, free-form config and restart policy. docs/manifest.md is the reference. Reading
the YAML and applying overrides is ``asyncrl.manifest.yaml_reader``.

``load_manifest`` reads one, applies ``--set key=value`` overrides and validates it. Validation
walks the raw YAML against the Structs below (``asyncrl.manifest._schema``, through
``msgspec.inspect``), collects every problem and raises one ``ManifestError`` that lists them all,
each as ``<path>: <what is wrong>; <how to fix>``. Only a manifest without problems becomes a
``Manifest``. Every count, duration and size has an upper bound, and names and environments are
checked against what the runtime derives from them (``asyncrl.manifest.limits``), so that a manifest
that would fail at run time fails here, at once, naming the key.
It imports neither torch nor user code (the node agent loads it); a role validates its own
``config`` in its own process."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec

from asyncrl.errors import ManifestError
from asyncrl.manifest._schema import TOP, StructCheck, at, join, validate
from asyncrl.manifest.files import check_files
from asyncrl.manifest.limits import (
    MAX_CAPACITY,
    MAX_LIVENESS,
    MAX_REPLICAS,
    MAX_RESTARTS,
    MAX_SECONDS,
    MAX_THREADS,
    environment_problems,
    name_problems,
    run_name_problem,
)
from asyncrl.manifest.metrics_section import MetricsSpec, WandbSpec, check_wandb
from asyncrl.manifest.model_section import ModelSpec, model_problem
from asyncrl.manifest.pipeline_section import (
    PipelineSpec,
    StragglerSpec,
    schedule_problem,
    shard_role,
    shards_problems,
    straggler_problem,
)
from asyncrl.manifest.placement import Placement, check_placement, sharing_problems
from asyncrl.manifest.refs import weight_host_problems, weights_from_problems
from asyncrl.manifest.yaml_reader import apply_override, credit, load_yaml, merged_problem
from asyncrl.transport.options import HEARTBEAT_INTERVAL_S

__all__ = [
    "DriverSpec",
    "Manifest",
    "ManifestError",
    "ModelSpec",
    "NetworkSpec",
    "Placement",
    "RoleSpec",
    "RunSpec",
    "SecuritySpec",
    "Supervision",
    "load_manifest",
    "node_problems",
    "parse_manifest",
    "resolve_run_dir",
]


_IDENT = r"[A-Za-z_]\w*"
_DOTTED = rf"{_IDENT}(?:\.{_IDENT})*"
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_-]*"
_NAME_FORM = "a name of letters, digits, '_' and '-' that does not start with '-'"
_PROGRAM = re.compile(rf"(?P<module>{_DOTTED}|[^:]+\.py)(?::(?P<function>{_IDENT}))?")
_CLASS = re.compile(rf"{_DOTTED}:{_DOTTED}|[A-Za-z0-9_-]+")
_PROGRAM_FORM = "'module:function' or 'path/to/file.py:function'"


def _check_program(value: str) -> str | None:
    if _PROGRAM.fullmatch(value):
        return None
    fix = "; a file path must end in '.py'" if "/" in value else ""
    return f"expected {_PROGRAM_FORM}, got {value!r}{fix}"


def _check_class(value: str) -> str | None:
    if _CLASS.fullmatch(value):
        return None
    module, dot, name = value.rpartition(".")
    fix = f"; did you mean '{module}:{name}'?" if dot and ":" not in value else ""
    return f"expected 'module:Class' or a registered role name, got {value!r}{fix}"


def _split_command(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return shlex.split(value)
    except ValueError as exc:
        raise ValueError(
            f"cannot split {value!r} into arguments ({exc}); close the quote or give a list"
        ) from None


Name = Annotated[
    str,
    msgspec.Meta(pattern=f"^{_NAME}$", extra={"expected": _NAME_FORM}),
]
"""A role's name: it names the role's log, spec and socket files (``logs/<role>.<replica>.jsonl``),
so a name starting with '-' would read as an option to any command given one of them."""
Method = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^[A-Za-z][A-Za-z0-9_.-]*$",
        extra={
            "expected": "a method name of letters, digits, '_', '.' and '-' that starts with a "
            "letter (names starting with '_' belong to the runtime)"
        },
    ),
]
RunName = Annotated[
    str,
    msgspec.Meta(
        pattern=f"^{_NAME}$",
        extra={
            "expected": _NAME_FORM,
            "check": run_name_problem,
        },
    ),
]
DeliveryClass = Literal["idempotent", "once", "latest"]
Replicas = Annotated[int, msgspec.Meta(ge=1, le=MAX_REPLICAS)]
Capacity = Annotated[int, msgspec.Meta(ge=1, le=MAX_CAPACITY)]
Threads = Annotated[int, msgspec.Meta(ge=1, le=MAX_THREADS)]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_SECONDS)]
Delay = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]
EnvName = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^[^=\x00]+$",
        extra={"expected": "a variable name without '=' or NUL characters"},
    ),
]


def _check_env_value(value: str) -> str | None:
    if "\x00" in value:
        return "a NUL character, which no environment value can hold; remove it"
    return None


EnvValue = Annotated[str, msgspec.Meta(extra={"check": _check_env_value})]
Env = dict[EnvName, EnvValue]
Program = Annotated[str, msgspec.Meta(extra={"expected": _PROGRAM_FORM, "check": _check_program})]
ClassRef = Annotated[str, msgspec.Meta(extra={"check": _check_class})]
Command = Annotated[
    tuple[str, ...],
    msgspec.Meta(
        min_length=1,
        extra={"expected": "a non-empty list of strings, or one string", "coerce": _split_command},
    ),
]


LIVENESS = 10
"""Missed heartbeats (of ``heartbeat_interval_s``) after which a replica is taken as frozen:
10 s by default. A heartbeat thread misses beats only while the process is stopped,
deadlocked, or held by one C call that keeps the GIL (a full garbage collection of a large
heap took 1.4 s on a loaded 2-core machine); see docs/reliability.md, Liveness."""

HANG_AFTER_S = 300.0
"""Seconds of a blocked event loop after which a replica is taken as hung: far above any normal
pause of a Python process, and above what the reference systems allow a stuck worker before
they replace it (docs/reliability.md, Liveness)."""

WARN_AFTER_S = 5.0
"""Seconds of a blocked event loop after which the replica logs a warning with the stack."""


class Supervision(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How the supervisor restarts a role's replicas and decides they are alive.

    Attributes:
        strategy: what restarts when a replica fails: that replica (one_for_one), that one and
            every process started after it (rest_for_one), or all replicas of the role
            (one_for_all).
        max_restarts: restarts allowed within period_s; one more stops the run with a report.
        period_s: the window of the restart budget, in seconds.
        backoff_initial_s: delay before a restart; it doubles with each restart in a row.
        backoff_max_s: the longest delay before a restart.
        heartbeat_interval_s: seconds between two heartbeats of a replica.
        liveness: missed heartbeats after which a replica is taken as frozen (stopped or
            deadlocked) and killed. A Python replica's heartbeats come from a thread of its
            own, so a busy event loop does not miss them; an external command's are its
            answers to PINGs. Its callers take it as dead after the same silence.
        hang_after_s: seconds a replica's event loop may stay blocked (the replica still
            beating) before it is taken as hung and killed; also how long a process whose loop
            ended has to exit.
        warn_after_s: seconds a replica's event loop may stay blocked before the replica logs a
            warning with the stack that blocks it (once per blocking site).
        startup_timeout_s: seconds a replica has from spawn until it is ready (its ``setup()``
            returned; for the driver, its program started).
        shutdown_timeout_s: seconds between asking a replica to stop and killing it.
        standby: keep a standby process per replica, started ahead with the role's modules
            imported (``Role.preload``), that takes over the moment the replica fails: a
            restart then costs no interpreter start and no imports. Roles given by ``class``
            only.
        regrow: a ``one_for_all`` group over several nodes (data-parallel learners or critics)
            that went on at a smaller size after a node's loss grows back to its ranks on that
            node when the node comes back (the returning ranks take the lead's checkpoints and
            log: from its folder with ``run.shared_storage``, from the lead over the group
            without it); false: it stays at its smaller size for the rest of the run
            (docs/multinode.md).
    """

    strategy: Literal["one_for_one", "rest_for_one", "one_for_all"] = "one_for_one"
    max_restarts: Annotated[int, msgspec.Meta(ge=0, le=MAX_RESTARTS)] = 5
    period_s: Seconds = 60.0
    backoff_initial_s: Delay = 0.1
    backoff_max_s: Delay = 5.0
    heartbeat_interval_s: Seconds = HEARTBEAT_INTERVAL_S
    liveness: Annotated[int, msgspec.Meta(ge=1, le=MAX_LIVENESS)] = LIVENESS
    hang_after_s: Seconds = HANG_AFTER_S
    warn_after_s: Seconds = WARN_AFTER_S
    startup_timeout_s: Seconds = 120.0
    shutdown_timeout_s: Seconds = 5.0
    standby: bool = False
    regrow: bool = True


class RoleSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One role of the run: what runs, how many copies, where, and with which settings.

    Attributes:
        cls: the role class, ``module:Class`` or a name registered under the entry-point group
            ``asyncrl.roles``; the YAML key is ``class``.
        command: an external command that speaks the wire protocol, as arguments (a string in
            the YAML is split with shlex); exactly one of ``cls`` and ``command`` is given.
        replicas: how many processes run this role.
        capacity: requests one replica works on at once: the credit it advertises.
        threads: torch and OMP threads of each replica.
        placement: the node and device of each replica.
        env: environment variables of each replica, on top of ``run.env``.
        config: free-form settings given to the role, which validates them against its own
            Config type in its own process.
        supervision: the restart policy and liveness timing of the replicas.
        endpoints: the delivery class of each method (``idempotent``, ``once`` or ``latest``),
            for a role that does not describe itself (an external command that does not answer
            ``_describe``); what ``_describe`` answers wins over it.
    """

    cls: ClassRef | None = msgspec.field(default=None, name="class")
    command: Command | None = None
    replicas: Replicas = 1
    capacity: Capacity = 1
    threads: Threads = 1
    placement: Placement = msgspec.field(default_factory=Placement)
    env: Env = {}
    config: dict[str, Any] = {}
    supervision: Supervision = msgspec.field(default_factory=Supervision)
    endpoints: dict[Method, DeliveryClass] = {}


class DriverSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The driver process, which runs the control-flow program on node 0.

    Attributes:
        threads: torch and OMP threads of the driver.
        env: environment variables of the driver, on top of ``run.env``.
        supervision: the restart policy and liveness timing of the driver.
    """

    threads: Threads = 1
    env: Env = {}
    supervision: Supervision = msgspec.field(default_factory=Supervision)


class NetworkSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How the replicas of a launch over several nodes are reached from other nodes.

    Attributes:
        address: the address (``10.0.0.5``) or network interface (``eth0``) the replicas of each
            node bind tcp on, for the other nodes; empty: the address of the node that routes to
            ``MASTER_ADDR``. ``0.0.0.0`` binds every interface (only when asked for: it exposes
            the replicas to every network the node is on). On one machine nothing binds tcp.
    """

    address: str = ""


class SecuritySpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Authentication and encryption of the tcp endpoints between nodes.

    Attributes:
        curve_keys: the folder of CurveZMQ key files (``asyncrl keys generate DIR``), relative
            to the manifest file's folder or absolute; every tcp endpoint then uses CurveZMQ.
            Empty: no Curve (ipc on one machine needs none).
    """

    curve_keys: str = ""


class RunSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The run as a whole.

    Attributes:
        name: the run's name; names the run directory and shared resources (at most
            ``MAX_RUN_NAME`` characters, so that their names fit).
        run_dir: where the run writes logs, traces and checkpoints; ``runs/<name>`` when not
            given. A relative path is relative to the current directory.
        program: the control-flow program, ``module:function`` or ``path/to/file.py:function``;
            a missing ``:function`` is filled in as ``:main``.
        env: environment variables of every process of the run.
        config: free-form settings of the control-flow program, which reads them as
            ``ctx.config``.
        plugin: the hardware plugin of every process (``ASYNCRL_PLUGIN``); empty: detected.
        metrics: where per-step metrics go besides ``metrics.jsonl``
            (``asyncrl.manifest.metrics_section``: a Weights & Biases run).
        shared_storage: the run directory is on storage every node of a launch reads and
            writes (a cluster's shared filesystem): a sharded learner or critic group over
            several nodes then goes on at a smaller size when a node is lost, its ranks left
            reading the lost ranks' shards from the lost node's folder (docs/multinode.md).
    """

    name: RunName
    run_dir: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    program: Program
    env: Env = {}
    config: dict[str, Any] = {}
    plugin: str = ""
    metrics: MetricsSpec = MetricsSpec()
    shared_storage: bool = False

    def __post_init__(self) -> None:
        if self.plugin:
            msgspec.structs.force_setattr(self, "env", {"ASYNCRL_PLUGIN": self.plugin, **self.env})
        if not self.run_dir:
            msgspec.structs.force_setattr(self, "run_dir", f"runs/{self.name}")
        match = _PROGRAM.fullmatch(self.program)
        if match is not None and match["function"] is None:
            msgspec.structs.force_setattr(self, "program", f"{self.program}:main")


class Manifest(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A validated manifest: the run, its driver and its roles, in the order of the file.

    Attributes:
        run: the run's name, directory, control-flow program and environment.
        driver: the driver process that runs the control-flow program.
        roles: the roles by name, in the order of the file.
        model: the model and tokenizer every role inherits (``asyncrl.manifest.model_section``):
            each value fills ``model_path``, ``model_config`` or ``tokenizer_path`` of a role whose
            Config declares that field and whose config does not set it.
        pipeline: how samples flow from rollout to the learner: sync or async mode, the
            staleness bound and the straggler policy
            (``asyncrl.manifest.pipeline_section.PipelineSpec``); the control-flow program reads it
            as ``ctx.pipeline``.
        network: where the replicas bind tcp for the other nodes of a launch over several.
        security: the CurveZMQ keys of the tcp endpoints.
    """

    run: RunSpec
    driver: DriverSpec = msgspec.field(default_factory=DriverSpec)
    model: Annotated[
        ModelSpec,
        msgspec.Meta(
            extra={
                "expected": "a mapping with the keys 'path', 'config' and 'tokenizer', such as "
                "{path: checkpoints/base, tokenizer: checkpoints/base}"
            }
        ),
    ] = msgspec.field(default_factory=ModelSpec)
    pipeline: PipelineSpec = msgspec.field(default_factory=PipelineSpec)
    network: NetworkSpec = msgspec.field(default_factory=NetworkSpec)
    security: SecuritySpec = msgspec.field(default_factory=SecuritySpec)
    roles: Annotated[
        dict[Name, RoleSpec],
        msgspec.Meta(
            min_length=1, extra={"expected": "a mapping of role names to roles, at least one"}
        ),
    ]

    def role_names(self) -> list[str]:
        """The role names, in the order of the manifest."""
        return list(self.roles)


def resolve_run_dir(manifest: Manifest) -> str:
    """The run directory as an absolute path (a relative one is taken from the current one)."""
    return os.path.abspath(os.path.expanduser(manifest.run.run_dir))


_SECTIONS = (
    "a mapping with the sections 'run', 'roles' and, optionally, 'driver', 'model' and 'pipeline'"
)


def _check_role(value: dict[Any, Any], path: str, problems: list[str]) -> None:
    given = [key for key in ("class", "command") if value.get(key) is not None]
    if len(given) == 2:
        problems.append(f"{at(path)}: both 'class' and 'command' are given; keep exactly one")
    elif not given:
        problems.append(
            f"{at(path)}: neither 'class' nor 'command' is given; add 'class: module:Class' "
            "for a Python role or 'command: [program, args...]' for an external one"
        )
    supervision = value.get("supervision")
    if given == ["command"] and isinstance(supervision, dict) and supervision.get("standby"):
        problems.append(
            f"{join(join(path, 'supervision'), 'standby')}: a standby process is kept only for "
            "roles given by 'class' (it imports the role's modules ahead); remove it for a "
            "'command' role"
        )
    # Only ``false`` is refused: ``true`` is the default, and a saved manifest (run.json)
    # spells every default out, on every role.
    if isinstance(supervision, dict) and supervision.get("regrow") is False:
        strategy = supervision.get("strategy", "one_for_one")
        replicas = value.get("replicas", 1)
        if strategy in ("one_for_one", "rest_for_one"):
            what = f"a {strategy} role"
        elif strategy == "one_for_all" and isinstance(replicas, int) and replicas < 2:
            what = "a single replica"
        else:
            what = ""
        if what:
            problems.append(
                f"{join(join(path, 'supervision'), 'regrow')}: applies only to a data-parallel "
                f"group (supervision.strategy: one_for_all and replicas >= 2, as a learner's or "
                f"critic's), saying whether it grows back after a node's loss; {at(path)} is "
                f"{what}, on which it does nothing: remove it"
            )


def _check_supervision(value: dict[Any, Any], path: str, problems: list[str]) -> None:
    _check_order(value, path, problems, "backoff_initial_s", "backoff_max_s", positive=False)
    _check_order(value, path, problems, "warn_after_s", "hang_after_s", positive=True)


def _check_order(
    value: dict[Any, Any], path: str, problems: list[str], low: str, high: str, *, positive: bool
) -> None:
    """``value[high]`` (or its default) must be at least ``value[low]`` (or its default). A
    value out of its own range (negative; or zero, when ``positive``) has its own problem in
    the report and is not compared."""
    lower = value.get(low, getattr(_DEFAULT_SUPERVISION, low))
    upper = value.get(high, getattr(_DEFAULT_SUPERVISION, high))
    numbers = all(
        isinstance(x, int | float) and not isinstance(x, bool) and (x > 0 if positive else x >= 0)
        for x in (lower, upper)
    )
    if numbers and upper < lower:
        default = "" if high in value else " (the default)"
        problems.append(
            f"{join(path, high)}: expected a number >= {low} ({lower!r}), got {upper!r}"
            f"{default}; raise it or lower {low}"
        )


_DEFAULT_SUPERVISION = Supervision()


def _check_straggler(value: dict[Any, Any], path: str, problems: list[str]) -> None:
    problem = straggler_problem(value.get("policy", "wait"), value.get("deadline_s", 0.0))
    if problem:
        problems.append(f"{join(path, 'deadline_s')}: {problem}")


def _check_pipeline(value: dict[Any, Any], path: str, problems: list[str]) -> None:
    schedule = value.get("schedule")
    if isinstance(schedule, dict):
        scheduled = schedule.get("skip_uniform") or schedule.get("probe")
        problem = schedule_problem(scheduled, value.get("drop_uniform", False))
        if problem:
            problems.append(f"{join(path, 'schedule')}: {problem}")


def _check_model(value: dict[Any, Any], path: str, problems: list[str]) -> None:
    problem = model_problem(value, at(path))
    if problem:
        problems.append(problem)


def _check_manifest(value: dict[Any, Any], path: str, problems: list[str]) -> None:
    """What involves several sections or roles: shared devices, role names, the environment of
    each process, which role each ``weights_from`` names, and that each node with replicas that
    read it has its publisher or a relay of it."""
    problems += sharing_problems(value.get("roles"), join(path, "roles"))
    problems += name_problems(value.get("roles"))
    problems += environment_problems(value)
    problems += weights_from_problems(value.get("roles"))
    problems += weight_host_problems(value.get("roles"))
    problems += shards_problems(value)


_STRUCT_CHECKS: dict[type, StructCheck] = {
    Manifest: _check_manifest,
    ModelSpec: _check_model,
    Placement: check_placement,
    RoleSpec: _check_role,
    Supervision: _check_supervision,
    StragglerSpec: _check_straggler,
    PipelineSpec: _check_pipeline,
    WandbSpec: check_wandb,
}


def parse_manifest(
    text: str,
    source: str = "<string>",
    overrides: Sequence[str] = (),
    *,
    cwd: str | None = None,
    nodes: int | None = None,
) -> Manifest:
    """Validate manifest ``text`` after applying ``overrides`` (``key=value`` strings).

    ``source`` names the text in the error message. With ``cwd``, what the node agent will start
    from ``cwd`` must be there: the first argument of each role's ``command`` must name an
    executable, a path (it has a '/') relative to ``cwd`` or a bare name looked up on the
    role's ``PATH`` (the agent's, or the one ``run.env`` or the role's ``env`` set); and a
    program given as ``path/to/file.py`` must be a file. Without ``cwd``, neither is looked up.
    With ``nodes`` (the number of nodes of the launch: 1 for ``asyncrl run``), every replica
    must be placed on one of them (``node_problems``).

    Raises ``ManifestError`` listing every problem, and ``TypeError`` when ``overrides`` is one
    string instead of a list of them.
    """
    if isinstance(overrides, str):
        raise TypeError(f"overrides is a list of 'key=value' strings, got one: {overrides!r}")
    problems: list[str] = []
    parsed, raw = load_yaml(text, problems)
    if parsed and raw is None:
        problems.append(f"{TOP}: the manifest is empty; expected {_SECTIONS}")
    usable = parsed and raw is not None
    created: list[tuple[str, str]] = []
    sizes = [
        (override, apply_override(raw if usable else {}, override, problems, created))
        for override in overrides
    ]
    if usable and overrides:
        # Each override was measured alone; together they may be over (twelve 1 MB values).
        too_large = merged_problem(raw, sizes)
        if too_large is not None:
            problems.append(too_large)
            usable = False
    if usable:
        shard_role(raw)  # pipeline.shards: K adds the dispatch shards' role
        clean, found = validate(raw, Manifest, _SECTIONS, _STRUCT_CHECKS)
        if cwd is not None:
            check_files(clean, cwd, found, _PROGRAM)
        problems += [credit(problem, overrides, created) for problem in found]
    if problems:
        raise ManifestError(source, problems)
    try:
        manifest = msgspec.convert(clean, Manifest)
    except msgspec.ValidationError as exc:  # the walk above should have caught it
        raise ManifestError(source, [f"{TOP}: {exc}"]) from exc
    if nodes is not None:
        found = node_problems(manifest, nodes)
        if found:
            raise ManifestError(source, [credit(p, overrides, created) for p in found])
    return manifest


def node_problems(manifest: Manifest, nodes: int) -> list[str]:
    """Each role placed on a node that a launch of ``nodes`` nodes does not have, with its path.

    ``nodes`` is 1 for ``asyncrl run`` (one machine, node 0), whose problems say to launch with
    torchrun and ``asyncrl.launch`` instead.
    """
    problems = []
    for name, role in manifest.roles.items():
        path = join(join("roles", name), "placement")
        wanted = [(f"{join(path, 'nodes')}[{i}]", n) for i, n in enumerate(role.placement.nodes)]
        for where, node in wanted or [(join(path, "node"), role.placement.node)]:
            if node < nodes:
                continue
            if nodes == 1:
                problems.append(
                    f"{where}: node {node}, but 'asyncrl run' runs on one machine (node 0); "
                    "launch on several nodes with 'torchrun --nnodes=N ... -m asyncrl.launch "
                    "MANIFEST' (docs/multinode.md), or place the role on node 0"
                )
            else:
                problems.append(
                    f"{where}: node {node} but the launch has {nodes} nodes (--nnodes); place "
                    f"the role on nodes 0 to {nodes - 1}, or launch with --nnodes={node + 1}"
                )
    return problems


def load_manifest(
    path: str,
    overrides: Sequence[str] = (),
    *,
    check_files: bool = True,
    nodes: int | None = None,
) -> Manifest:
    """Read and validate the manifest at ``path``; see ``parse_manifest`` (and its ``nodes``).

    With ``check_files`` (the default), each ``command`` role's executable and a program given
    as a file must exist as the node agent resolves them: from the current directory, where
    the agent starts its processes. A relative ``security.curve_keys`` is taken from the
    manifest file's folder, and made absolute.

    Raises ``ManifestError`` listing every problem, or naming why the file cannot be read.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ManifestError(
            path, [f"{TOP}: cannot read the file ({reason}); check the path"]
        ) from exc
    manifest = parse_manifest(
        text, path, overrides, cwd=os.getcwd() if check_files else None, nodes=nodes
    )
    keys = manifest.security.curve_keys
    if keys and not os.path.isabs(keys):
        keys = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), keys))
        security = msgspec.structs.replace(manifest.security, curve_keys=keys)
        manifest = msgspec.structs.replace(manifest, security=security)
    return manifest
