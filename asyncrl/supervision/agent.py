"""The node agent: turns a manifest into supervised processes on this machine, and reports.

``asyncrl run`` is this agent with the embedded single-node default: no torchrun, no other
services. It imports neither torch nor user code (a test checks): user code runs only in the
role and driver processes it starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import msgspec

from asyncrl.manifest.load import Manifest, ManifestError, RoleSpec, node_problems, resolve_run_dir
from asyncrl.manifest.spec import (
    SPEC_FILE_ENV,
    GroupInfo,
    ProcessSpec,
    spec_path,
    write_private,
    write_spec,
)
from asyncrl.observe import logs
from asyncrl.observe.status import AgentStatus
from asyncrl.safe_files import write_atomic
from asyncrl.supervision.janitor import Janitor, sweep_run
from asyncrl.supervision.liveness import liveness_path
from asyncrl.supervision.runreport import summary_table
from asyncrl.supervision.supervisor import ChildSpec, RunReport, Supervisor, format_report
from asyncrl.transport import LocalRegistry, TransportError, load_keys, use_curve
from asyncrl.transport.control import (
    API_KEY_FILE,
    CONTROL_SECRET_ENV,
    SECRET_FILE,
    SECRET_FILE_ENV,
    api_key,
    new_secret,
    write_secret,
)
from asyncrl.transport.curve import current as curve_in_use

__all__ = [
    "CONFIG_ENV_MAX",
    "CURVE_KEYS_ENV",
    "NodeView",
    "adopted_child",
    "build_children",
    "install_secret",
    "run_manifest",
    "status_server",
    "summary",
]

CURVE_KEYS_ENV = "ASYNCRL_CURVE_KEYS"
"""The run's Curve key folder, given to an external command that binds a tcp endpoint (on a node
other than 0) in a run with ``security.curve_keys``: it serves with the folder's server key and
admits its client key (docs/protocol.md#security)."""

CONFIG_ENV_MAX = 16 * 1024
"""The largest ``config`` (as JSON, in bytes) a command role also gets in ``ASYNCRL_CONFIG``;
a larger one is only in the file named by ``ASYNCRL_CONFIG_FILE``. Linux refuses a single
environment string over 128 KiB, and the whole environment shares the argument space."""


def _thread_env(threads: int) -> dict[str, str]:
    return {
        var: str(threads) for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    }


@dataclass(frozen=True)
class NodeView:
    """This node's part of a launch over several nodes (``asyncrl.launch``).

    Attributes:
        node: this node's index (the torchrun node rank).
        tcp: the tcp endpoint of every role replica of the launch, by (role, replica); empty
            on one machine, where everything is ipc.
        span_env: environment of the replicas of roles that span several nodes (the store and
            key prefix a data-parallel group meets through).
        curve_keys: the folder of CurveZMQ keys of every tcp socket; empty: no Curve.
        bind_host: the host this node's replicas bind their tcp endpoints on, when it is not
            the one published (``0.0.0.0``: every interface); empty: the published one.
        agents: the tcp endpoint of every node agent's status server (``asyncrl status``),
            by node; empty on one machine.
        secret: the run's secret, the same on every node (node 0 makes it, the others read
            it from the launch's store); empty: the agent makes a fresh one.
    """

    node: int = 0
    tcp: dict[tuple[str, int], str] = field(default_factory=dict)
    span_env: dict[str, str] = field(default_factory=dict)
    curve_keys: str = ""
    bind_host: str = ""
    agents: dict[int, str] = field(default_factory=dict)
    secret: str = ""
    elsewhere: dict[tuple[str, int], str] = field(default_factory=dict)
    """Replicas placed on this node that run on another now (they moved while the node was
    lost, and stay there), with the endpoint this node reaches each at: not started here."""
    groups: dict[str, GroupInfo] = field(default_factory=dict)
    """Every group as this node's processes see it, filled by ``build_children``; a replica
    that moves (``asyncrl.manifest.membership``) is updated here, so that the incarnations
    started afterwards reach it at its new address."""
    members: dict[str, list[int]] = field(default_factory=dict)
    """Per data-parallel group that went on at a smaller size, the replicas that form it now
    (``asyncrl.manifest.membership``): the incarnations started afterwards are given it
    (``ProcessSpec.members``), and join the group at its new size."""
    formations: dict[str, int] = field(default_factory=dict)
    """Per data-parallel group over several nodes, the formation its incarnations started
    afterwards join (``ProcessSpec.formation``): the number node 0 gave the group's last change
    of members in the attempt, in the last of its words this node applied
    (``MembershipFollower``)."""

    def bind_endpoint(self, role: str, replica: int) -> str:
        """The tcp endpoint replica ``replica`` of ``role`` binds (of this node), or "";
        ``role`` "": the status server of node ``replica``'s agent."""
        published = self.tcp.get((role, replica), "") if role else self.agents.get(replica, "")
        if not published or not self.bind_host:
            return published
        return f"tcp://{self.bind_host}:{published.rsplit(':', 1)[1]}"


def build_children(
    manifest: Manifest, run_dir: str, *, parent_pid: int, view: NodeView | None = None
) -> list[ChildSpec]:
    """One ChildSpec per replica placed on this node, in manifest order, then (on node 0) the
    driver. ``view`` is this node's part of a launch over several nodes; None on one machine.

    Every process's ``groups`` hold each replica's endpoint as seen from this node: ipc for a
    replica of this node, tcp for one of another node. An external command binds one endpoint:
    on node 0 its ipc one (the driver's node reaches it), on another node its tcp one, and
    there it is given the run's Curve key folder (``ASYNCRL_CURVE_KEYS``) when the run has one:
    every tcp socket of the launch speaks Curve, its callers and its supervisor included.
    """
    view = view or NodeView()
    registry = LocalRegistry(run_dir)
    children: list[ChildSpec] = []
    groups = view.groups
    keys = view.curve_keys or manifest.security.curve_keys
    for name, role in manifest.roles.items():
        where = [role.placement.node_of(i) for i in range(role.replicas)]
        endpoints = [
            view.elsewhere[(name, i)]
            if (name, i) in view.elsewhere
            else registry.endpoint(name, i)
            if node == view.node and not (role.command and view.tcp and node != 0)
            else view.tcp[(name, i)]
            for i, node in enumerate(where)
        ]
        groups[name] = GroupInfo(
            endpoints,
            role.supervision.heartbeat_interval_s,
            role.supervision.liveness,
            delivery=dict(role.endpoints),
        )
        span = view.span_env if len(set(where)) > 1 else {}
        for replica, endpoint in enumerate(endpoints):
            if where[replica] != view.node or (name, replica) in view.elsewhere:
                continue
            local = _Local(endpoint, view.bind_endpoint(name, replica), keys, span)
            children.append(
                ChildSpec(
                    name,
                    replica,
                    "command" if role.command else "role",
                    endpoint,
                    role.supervision,
                    _role_launcher(
                        manifest,
                        role,
                        name,
                        replica,
                        local,
                        run_dir,
                        parent_pid,
                        groups,
                        view.members,
                        view.formations,
                    ),
                    "" if role.command else liveness_path(run_dir, name, replica),
                )
            )
    if view.node != 0:
        return children
    children.append(_driver_child(manifest, run_dir, parent_pid, groups, keys))
    return children


def adopted_child(
    manifest: Manifest,
    name: str,
    replica: int,
    home_dir: str,
    view: NodeView,
    tcp: str,
    here_dir: str,
) -> ChildSpec:
    """The ChildSpec of replica ``replica`` of ``name`` moved to this node from a lost one
    (``asyncrl.manifest.membership``), or of a rank of this node that rejoins its group as the
    group grows back (``home_dir`` and ``here_dir`` then this node's folder): it keeps its
    home node's folder of the run directory (``home_dir``: its durable state, logs and ipc
    endpoint are there, on the run's shared storage) and binds ``tcp`` for the other nodes.
    ``view.groups`` is what it is given as its groups; ``here_dir``, this node's folder, is
    its ``node_dir``: the membership it reads is this node's, which this node's agent keeps
    writing."""
    role = manifest.roles[name]
    endpoint = LocalRegistry(home_dir).endpoint(name, replica)
    keys = view.curve_keys or manifest.security.curve_keys
    # A rank of a group over several nodes (one that rejoins it) meets the group in the store.
    where = {role.placement.node_of(i) for i in range(role.replicas)}
    local = _Local(endpoint, tcp, keys, view.span_env if len(where) > 1 else {})
    return ChildSpec(
        name,
        replica,
        "command" if role.command else "role",
        endpoint,
        role.supervision,
        _role_launcher(
            manifest,
            role,
            name,
            replica,
            local,
            home_dir,
            os.getpid(),
            view.groups,
            view.members,
            view.formations,
            node_dir=here_dir,
        ),
        "" if role.command else liveness_path(home_dir, name, replica),
    )


def _driver_child(
    manifest: Manifest, run_dir: str, parent_pid: int, groups: dict[str, GroupInfo], keys: str
) -> ChildSpec:
    """The driver's ChildSpec (node 0 only)."""
    run, driver = manifest.run, manifest.driver
    endpoint = LocalRegistry(run_dir).endpoint("driver", 0)

    def driver_launcher(incarnation: int) -> tuple[list[str], dict[str, str]]:
        spec = ProcessSpec(
            kind="driver",
            name="driver",
            incarnation=incarnation,
            target=run.program,
            endpoint=endpoint,
            run=run.name,
            run_dir=run_dir,
            threads=driver.threads,
            heartbeat_interval_s=driver.supervision.heartbeat_interval_s,
            liveness=driver.supervision.liveness,
            warn_after_s=driver.supervision.warn_after_s,
            parent_pid=parent_pid,
            groups=groups,
            config=dict(run.config),
            pipeline=msgspec.to_builtins(manifest.pipeline),
            model=msgspec.to_builtins(manifest.model),
            roles={
                name: {"class": role.cls or "", "config": dict(role.config)}
                for name, role in manifest.roles.items()
            },
            curve_keys=keys,
        )
        env = {
            **run.env,
            **driver.env,
            **_thread_env(driver.threads),
            **_spec_env(spec),
            "PYTHONUNBUFFERED": "1",
        }
        return [sys.executable, "-m", "asyncrl.supervision.process"], env

    return ChildSpec(
        "driver",
        0,
        "driver",
        endpoint,
        driver.supervision,
        driver_launcher,
        liveness_path(run_dir, "driver", 0),
    )


@dataclass(frozen=True)
class _Local:
    """How one replica of this node is reached and what it is given beyond its role's spec."""

    endpoint: str  # what it binds and its supervisor calls: ipc, or tcp for a command role
    tcp: str  # the tcp endpoint it also binds for other nodes (a Python role), or ""
    curve_keys: str
    env: dict[str, str]


def _role_launcher(
    manifest: Manifest,
    role: RoleSpec,
    name: str,
    replica: int,
    local: _Local,
    run_dir: str,
    parent_pid: int,
    groups: dict[str, GroupInfo],
    members: dict[str, list[int]],
    formations: dict[str, int],
    *,
    node_dir: str = "",
) -> Any:
    """The launcher of one role replica. ``groups`` is filled as the manifest's roles are read,
    so by the first launch it holds every group; ``members`` (``NodeView.members``) is read at
    each launch, so an incarnation started after its group shrank joins it at its new size, as
    is ``formations`` (``NodeView.formations``). ``node_dir``: the folder of the node it runs
    on, where that is not ``run_dir`` (a replica moved off a lost node)."""
    run = manifest.run
    endpoint = local.endpoint

    def launch(incarnation: int) -> tuple[list[str], dict[str, str]]:
        env = {
            **run.env,
            **role.env,
            **local.env,
            **_thread_env(role.threads),
            "PYTHONUNBUFFERED": "1",
        }
        config = dict(role.config)
        if role.command:
            argv = list(role.command)
            config_json = json.dumps(config)
            config_file = spec_path(run_dir, name, replica, incarnation, ".config")
            write_private(config_file, config_json.encode())
            if incarnation > 0:
                _remove(spec_path(run_dir, name, replica, incarnation - 1, ".config"))
            env.update(
                {
                    "ASYNCRL_ENDPOINT": endpoint,
                    "ASYNCRL_ROLE": name,
                    "ASYNCRL_REPLICA": str(replica),
                    "ASYNCRL_INCARNATION": str(incarnation),
                    "ASYNCRL_RUN": run.name,
                    "ASYNCRL_RUN_DIR": run_dir,
                    "ASYNCRL_CONFIG_FILE": config_file,
                    "ASYNCRL_CAPACITY": str(role.capacity),
                    "ASYNCRL_PARENT_PID": str(parent_pid),
                }
            )
            if len(config_json.encode()) <= CONFIG_ENV_MAX:
                env["ASYNCRL_CONFIG"] = config_json
            if endpoint.startswith("tcp://") and local.curve_keys:
                env[CURVE_KEYS_ENV] = os.path.abspath(local.curve_keys)
            return argv, env
        spec = ProcessSpec(
            kind="role",
            name=name,
            replica=replica,
            incarnation=incarnation,
            target=role.cls or "",
            endpoint=endpoint,
            run=run.name,
            run_dir=run_dir,
            node_dir=node_dir,
            config=config,
            threads=role.threads,
            device=role.placement.device,
            memory_fraction=role.placement.memory_fraction or 0.0,
            release_when_idle=role.placement.release_when_idle,
            capacity=role.capacity,
            heartbeat_interval_s=role.supervision.heartbeat_interval_s,
            liveness=role.supervision.liveness,
            warn_after_s=role.supervision.warn_after_s,
            parent_pid=parent_pid,
            replicas=role.replicas,
            members=list(members.get(name, [])),
            formation=formations.get(name, 0),
            groups=groups,
            model=msgspec.to_builtins(manifest.model),
            tcp_endpoint="" if local.tcp == endpoint else local.tcp,
            curve_keys=local.curve_keys,
        )
        env.update(_spec_env(spec))
        return [sys.executable, "-m", "asyncrl.supervision.process"], env

    return launch


def _spec_env(spec: ProcessSpec) -> dict[str, str]:
    """The environment that hands ``spec`` to its process: the path of its file."""
    return {SPEC_FILE_ENV: write_spec(spec)}


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


async def run_manifest(
    manifest: Manifest,
    run_dir: str | None = None,
    *,
    observer: Callable[[str, str, int], None] | None = None,
    beside: Callable[[Supervisor], Coroutine[Any, Any, None]] | None = None,
    console: bool = True,
    view: NodeView | None = None,
) -> RunReport:
    """Run ``manifest`` on this machine until its program finishes or the run fails.

    On one machine (``view`` None) every role must be on node 0. In a launch over several
    nodes (``asyncrl.launch``), ``view`` says which node this is: the agent runs only
    the replicas placed there (and the driver on node 0), and ``beside`` ends the run when the
    launch does (``Supervisor.end``).

    Args:
        manifest: the validated manifest.
        run_dir: where the run writes (default: the manifest's).
        observer: also told of every process that exits or serves (``Supervisor``'s).
        beside: a coroutine run next to the supervisor (fault injection: ``asyncrl chaos``),
            cancelled when the run ends.
        console: readable log lines on the console too.
        view: this node's part of a launch over several nodes.

    Returns:
        How the run ended, also written to ``RUN_DIR/report.json``. A fault of the supervisor
        itself (one of its tasks raised: a bug) fails the run: every process is stopped and the
        report is ``failed``, its reason naming the error and where its traceback is.

    Raises:
        ManifestError: on one machine, a role is placed on another node than 0.
    """
    if view is None:
        problems = node_problems(manifest, 1)
        if problems:
            raise ManifestError(manifest.run.name, problems)
    started = time.monotonic()
    run_dir = os.path.abspath(run_dir) if run_dir else resolve_run_dir(manifest)
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    logs.configure(
        role="agent", json_path=os.path.join(run_dir, "logs", "agent.jsonl"), console=console
    )
    log = logs.get_logger("asyncrl.supervision.agent")
    run = manifest.run.name
    install_secret(run_dir, view.secret if view is not None else "")
    socket_dir = LocalRegistry(run_dir).socket_dir
    # Started before any other process, so that a SIGKILLed agent leaves nothing behind.
    janitor = Janitor.start(run, socket_dir, run_dir)
    loop = asyncio.get_running_loop()
    curve_before = curve_in_use()
    try:
        children = build_children(manifest, run_dir, parent_pid=os.getpid(), view=view)
        _supervise_over_curve(children, view or NodeView(), manifest, log)
        supervisor = _supervisor(children, run, run_dir, janitor, observer)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, supervisor.stop, f"{signal.Signals(sig).name} received")
        log.info("run started", run=run, run_dir=run_dir, processes=len(children))
        status = _serve_status(supervisor, manifest, run_dir, view, children, log)
        report = await _supervise(supervisor, beside, status, run_dir, log)
    finally:
        use_curve(curve_before)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        removed = sweep_run(run, socket_dir, run_dir=run_dir)
        if removed:
            log.info("swept", removed=removed)
        janitor.finish()
    report.wall_s = time.monotonic() - started
    _write_report(run_dir, report)
    return report


async def _supervise(
    supervisor: Supervisor,
    beside: Callable[[Supervisor], Coroutine[Any, Any, None]] | None,
    status: Coroutine[Any, Any, None],
    run_dir: str,
    log: Any,
) -> RunReport:
    """Run ``supervisor`` until the run ends, with ``beside`` (when given) and ``status`` (the
    agent's status server) as tasks next to it, both cancelled when it ends.

    Returns:
        The supervisor's report; when the supervisor itself fails (one of its tasks raised: a
        bug), a ``failed`` report naming the error (``_supervisor_failed``).
    """
    async with asyncio.TaskGroup() as tasks:
        side = tasks.create_task(beside(supervisor)) if beside is not None else None
        served = tasks.create_task(status)
        try:
            report = await supervisor.run()
        except Exception as exc:  # an ExceptionGroup: the supervisor's own task failed
            report = _supervisor_failed(exc, run_dir)
            log.error("run failed", reason=report.reason)
        finally:
            served.cancel()
            if side is not None:
                side.cancel()
    return report


def install_secret(run_dir: str, secret: str = "") -> str:
    """Give this process and every process it starts the run's secret; return its file.

    The secret (``secret``, or a fresh one) goes into ``RUN_DIR/secret`` (0600), which
    ``ASYNCRL_SECRET_FILE`` names in this process's environment, so that every server and
    client of the run, in this process and its children, requires and presents it
    (``asyncrl.transport.control``); a tool pointed at the run directory reads it there. The
    secret itself is not put in the environment, and an ``ASYNCRL_CONTROL_SECRET`` inherited
    from the shell is dropped. The file stays after the run (a tool of this process, such as
    a launch's trace sender, still presents it); the next run replaces it. Beside it,
    ``RUN_DIR/api_key`` (0600) holds the run's API key (``asyncrl.transport.control.api_key``),
    which the program's HTTP endpoints require.

    Raises:
        OSError: the file cannot be written.
    """
    path = os.path.join(os.path.abspath(run_dir), SECRET_FILE)
    secret = secret or new_secret()
    write_secret(path, secret)
    write_private(os.path.join(os.path.abspath(run_dir), API_KEY_FILE), api_key(secret).encode())
    os.environ[SECRET_FILE_ENV] = path
    os.environ.pop(CONTROL_SECRET_ENV, None)
    return path


def _supervise_over_curve(
    children: list[ChildSpec], view: NodeView, manifest: Manifest, log: Any
) -> None:
    """With Curve keys, the supervisor reaches an external command that binds tcp (on a node
    other than 0) with them: the command serves only Curve clients. Keys that do not load are
    logged; the processes then stop with the error that names the file."""
    keys = view.curve_keys or manifest.security.curve_keys
    if not keys or not any(c.endpoint.startswith("tcp://") for c in children):
        return
    try:
        use_curve(load_keys(keys))
    except TransportError as exc:
        log.error("the supervisor cannot use the Curve keys", error=str(exc))


def _write_report(run_dir: str, report: RunReport) -> None:
    path = os.path.join(run_dir, "report.json")
    write_atomic(path, msgspec.json.format(msgspec.json.encode(report)))


def _supervisor(
    children: list[ChildSpec],
    run: str,
    run_dir: str,
    janitor: Janitor,
    observer: Callable[[str, str, int], None] | None,
) -> Supervisor:
    """The run's supervisor, which tells the janitor every pid it starts, then ``observer``."""
    supervisor: Supervisor | None = None

    def observe(event: str, label: str, incarnation: int) -> None:
        if supervisor is not None:
            processes = supervisor.processes()
            janitor.watch(
                pid for p in processes for pid in (p.pid, p.standby_pid) if pid is not None
            )
        if observer is not None:
            observer(event, label, incarnation)

    supervisor = Supervisor(
        children, run=run, log_dir=os.path.join(run_dir, "logs"), observer=observe
    )
    return supervisor


async def _serve_status(
    supervisor: Supervisor,
    manifest: Manifest,
    run_dir: str,
    view: NodeView | None,
    children: list[ChildSpec],
    log: Any,
) -> None:
    """Serve the agent's status endpoint (``asyncrl status``) until cancelled; the inbox of
    every Python role replica among ``children`` is asked its own ``_status``, and the
    program's restart requests go to ``supervisor`` (``Supervisor.restart``). One that cannot
    be bound is logged, and the run goes on without it."""
    status = status_server(supervisor.status, manifest, run_dir, view or NodeView(), log)
    status.replicas = {(c.name, c.replica): c.endpoint for c in children if c.kind == "role"}
    status.restart = supervisor.restart
    try:
        await status.start()
        await asyncio.Event().wait()
    except TransportError as exc:
        log.error("asyncrl status cannot reach this agent", error=str(exc))
    finally:
        await status.close()


def status_server(
    processes: Callable[[], list[dict[str, Any]]],
    manifest: Manifest,
    run_dir: str,
    view: NodeView,
    log: Any,
) -> AgentStatus:
    """The agent's status endpoint (not started), answering with ``processes`` (its
    supervisor's ``status``): ipc in its run directory; in a launch over several nodes, also
    tcp, asking the other nodes' agents (with the launch's Curve keys; keys that do not load
    leave only the ipc endpoint, answering for this node). It asks them at ``view.agents``
    itself, not a copy, so that a lost node that comes back is asked at its new agent's
    endpoint, which the membership follower writes there."""
    tcp, curve = view.bind_endpoint("", view.node), None
    keys = view.curve_keys or manifest.security.curve_keys
    if tcp and keys:
        try:
            curve = load_keys(keys)
        except TransportError as exc:
            log.error("status over tcp is off: the Curve keys do not load", error=str(exc))
            tcp = ""
    return AgentStatus(
        processes,
        run=manifest.run.name,
        run_dir=run_dir,
        node=view.node,
        driver=LocalRegistry(run_dir).endpoint("driver", 0) if view.node == 0 else "",
        tcp=tcp,
        peers=view.agents if tcp else {},
        curve=curve,
    )


def _supervisor_failed(exc: Exception, run_dir: str) -> RunReport:
    """The report of a run whose supervisor raised ``exc``, after it stopped every process."""
    errors = "; ".join(f"{type(e).__name__}: {e}" for e in _leaves(exc))
    where = os.path.join(run_dir, "logs", "agent.jsonl")
    return RunReport(
        status="failed",
        reason=(
            f"the supervisor itself failed ({errors}); every process was stopped. This is a bug "
            f"of asyncrl, not of the run: the traceback is in {where} ('supervisor task "
            f"failed'); please report it with that traceback"
        ),
    )


def _leaves(exc: BaseException) -> list[BaseException]:
    """The errors inside ``exc``, its nested exception groups flattened."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def summary(report: RunReport, manifest: Manifest, run_dir: str) -> str:
    """What a person reads when the run ends: how it ended, roles, restarts, work done."""
    lines = [format_report(report), "", summary_table(report, run_dir), "", "roles:"]
    driver: dict[str, Any] = {}
    try:
        with open(os.path.join(run_dir, "driver.json")) as f:
            driver = json.load(f)
    except (OSError, ValueError):
        pass
    dispatch = driver.get("dispatch", {})
    for name, role in manifest.roles.items():
        counts = dispatch.get(name, {})
        # Answers counted by the caller cover every incarnation; a killed replica's own count
        # dies with it.
        answered = sum(counts.get("served", {}).values()) if counts else report.served.get(name, 0)
        lines.append(
            f"  {name}: {role.replicas} replica(s), restarts {report.restarts.get(name, 0)}, "
            f"requests served {answered}, re-executions {counts.get('retries', 0)}, "
            f"errors {counts.get('failures', 0)}"
        )
    lines.append(f"  driver: restarts {report.restarts.get('driver', 0)}")
    if "result" in driver:
        lines.append(f"result: {json.dumps(driver['result'])}")
    lines.append(f"run directory: {run_dir}")
    return "\n".join(lines)
