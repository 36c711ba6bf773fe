"""The process wrapper every role runs in: ``python -m asyncrl.supervision.process``, started by the
supervisor.

A restarted incarnation is usually not a new interpreter: the node's zygote
(``asyncrl.supervision.zygote``) forks it with torch and the role's modules already imported and
calls ``main`` in the child, which then goes on exactly as a cold start does (its own logging,
signals, zmq context, loop).

It owns what no role should write again: the event loop (uvloop when installed), the inbox
(a transport Server at the replica's stable endpoint, which answers its callers' PINGs from the
loop), the heartbeat thread its supervisor watches (``asyncrl.supervision.liveness``: it beats
whether or not the loop is blocked, and warns with the loop's stack when it is), logging, the
CPU thread count, and clean shutdown on STOP, SIGTERM or SIGINT.

Beside the role's endpoints the inbox answers three built-in methods: ``_describe`` (the
endpoints and their delivery classes), ``_stats`` (calls served and failed, for the run's
report) and ``_status`` (what ``asyncrl status`` shows of the replica: calls per method,
seconds busy in its handlers, calls in flight, since when it runs, and the role's own
``Role.status()`` under ``"role"``).

Start-up order matters: the process's ZeroMQ context is sized first, three sockets for each
replica of the run (``reserve_connections``), so a role may connect to every one; the inbox binds
next, so its callers hear it while the role restores
its state in ``setup()``; credit is advertised only after ``setup()`` returns, so no work
arrives before the role is ready, and only then does the process tell its supervisor it is
ready (until then its start-up deadline applies, not the rule for a blocked loop). An
``ImportError`` raised in ``setup()`` (a model library missing, or broken by companion packages
built for another torch) is a configuration error: the process exits with ``EXIT_CONFIG`` and is
not restarted (``asyncrl.imports`` says what to install or uninstall).
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import importlib.metadata
import inspect
import os
import signal
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import msgspec

from asyncrl.dispatch.dispatcher import reserve_connections
from asyncrl.errors import ConfigProblem
from asyncrl.imports import broken_companions, import_problem, uninstall_advice
from asyncrl.manifest.model_section import inherited_config
from asyncrl.manifest.spec import EXIT_CONFIG, ProcessSpec, load_spec_from_env
from asyncrl.observe import logs
from asyncrl.role import Role, RoleContext, endpoints_of
from asyncrl.supervision.faults import FaultPlan
from asyncrl.supervision.heap import hold_heap
from asyncrl.supervision.liveness import Heartbeat, liveness_path
from asyncrl.transport import (
    Call,
    ChannelOptions,
    Entry,
    LocalRegistry,
    Server,
    TransportError,
    load_keys,
    use_curve,
)
from asyncrl.transport import run as run_loop

__all__ = [
    "ConfigProblem",
    "Tally",
    "load_role_class",
    "main",
    "serve_role",
    "status_answer",
    "use_curve_keys",
    "wait_as_standby",
]

_PR_SET_PDEATHSIG = 1

T = TypeVar("T")


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux), and check that the
    parent is still the one that started it: it may have died before the request was made."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_pid and os.getppid() != parent_pid:
        os._exit(1)


def set_threads(threads: int) -> None:
    """Cap this process's compute threads (torch, OpenMP, BLAS) at ``threads``."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:
            pass  # only settable before the first parallel work; the OMP variable covers it


class Tally:
    """What the process wrapper measures of its role's handlers, answered by ``_status``.

    It counts every call of an endpoint from when its handler starts (after ``setup()``) to
    when it returns or raises, whoever called it: the driver, another role, a relay. So a role
    called only by other roles is seen busy too, which the driver's dispatcher cannot see.

    Args:
        clock: monotonic seconds (a test may pass a fake one).
        wall: wall-clock seconds since the epoch (``started_at``).
    """

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time
    ) -> None:
        self.clock = clock
        self.calls: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.handler_s: dict[str, float] = {}
        self.inflight = 0
        self.started_at = wall()
        self._start = clock()
        self._busy = 0.0
        self._since = 0.0

    def begin(self) -> float:
        """Count a call as started; returns its start time for ``end``."""
        now = self.clock()
        if self.inflight == 0:
            self._since = now
        self.inflight += 1
        return now

    def end(self, method: str, started: float, ok: bool) -> None:
        """Count the call of ``method`` started at ``started`` as ended (``ok``: it returned;
        otherwise it raised or was cancelled)."""
        now = self.clock()
        self.inflight -= 1
        if self.inflight == 0:
            self._busy += now - self._since
        self.handler_s[method] = self.handler_s.get(method, 0.0) + now - started
        (self.calls if ok else self.errors)[method] += 1

    def busy_s(self) -> float:
        """Seconds with at least one call in a handler so far, the current stretch included
        (overlapping calls count once)."""
        return self._busy + (self.clock() - self._since if self.inflight else 0.0)

    def snapshot(self) -> dict[str, Any]:
        """The counts as plain data: ``calls`` and ``errors`` (per method), ``handler_s`` (the
        seconds of each method's calls, summed: overlapping calls each count), ``busy_s``,
        ``inflight``, ``started_at`` (wall clock) and ``uptime_s``."""
        return {
            "calls": dict(self.calls),
            "errors": dict(self.errors),
            "handler_s": {m: round(s, 6) for m, s in self.handler_s.items()},
            "busy_s": round(self.busy_s(), 6),
            "inflight": self.inflight,
            "started_at": self.started_at,
            "uptime_s": round(self.clock() - self._start, 6),
        }


def status_answer(identity: dict[str, Any], tally: Tally, role: Role) -> dict[str, Any]:
    """The answer of the built-in ``_status`` method: ``identity`` (process, replica,
    incarnation, pid), the tally's counts, and under ``"role"`` what ``role.status()``
    reports. A ``status()`` that raises or answers something other than a mapping of plain
    data gives ``{"error": why}`` there; the rest of the answer stands."""
    try:
        if inspect.iscoroutinefunction(role.status):
            raise TypeError(
                "status is an async method (an endpoint?), not the Role.status() hook; give "
                "the endpoint another method name and keep its wire name with "
                "@endpoint(name='status')"
            )
        facts = msgspec.to_builtins(role.status())
        if not isinstance(facts, dict):
            raise TypeError(f"status() must return a dict, got {type(facts).__name__}")
    except Exception as exc:  # a role's bug must not hide the process's own counts
        facts = {"error": f"{type(role).__name__}.status() failed: {type(exc).__name__}: {exc}"}
    return {**identity, **tally.snapshot(), "role": facts}


def load_role_class(target: str) -> type[Role]:
    """The role class named by ``module:Class``, or by a name under the ``asyncrl.roles``
    entry-point group.

    Raises:
        ConfigProblem: nothing importable answers to that name, its module raised while it was
            imported (an ``ImportError`` or any other exception: importing it again would raise
            again, so the process exits with ``EXIT_CONFIG`` and is not restarted), or it is not
            a Role.
    """
    if ":" in target:
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            advice = uninstall_advice(broken_companions()) or (
                "check the module path and that it is importable from the run's working directory"
            )
            raise ConfigProblem(
                f"class {target!r}: cannot import module {module_name!r}: {exc}; {advice}"
            ) from exc
        except Exception as exc:  # the module's own code raised: importing again raises again
            traceback.print_exc()  # where in the module: the message below gives only the error
            raise ConfigProblem(
                f"class {target!r}: importing module {module_name!r} raised "
                f"{type(exc).__name__}: {exc}; fix the module (its traceback is above)"
            ) from exc
        cls = getattr(module, attr, None)
        if cls is None:
            raise ConfigProblem(f"class {target!r}: module {module_name!r} has no {attr!r}")
    else:
        found = [
            ep for ep in importlib.metadata.entry_points(group="asyncrl.roles") if ep.name == target
        ]
        if not found:
            known = sorted(ep.name for ep in importlib.metadata.entry_points(group="asyncrl.roles"))
            raise ConfigProblem(
                f"class {target!r}: no role of that name is registered under the entry-point "
                f"group 'asyncrl.roles' (registered: {', '.join(known) or 'none'}); use "
                f"'module:Class' or install the package that provides it"
            )
        cls = found[0].load()
    if not (isinstance(cls, type) and issubclass(cls, Role)):
        raise ConfigProblem(f"class {target!r} is not a subclass of asyncrl.Role")
    return cls


async def serve_role(spec: ProcessSpec, *, on_ready: Callable[[], None] = lambda: None) -> None:
    """Run one replica of a role until STOP, SIGTERM or SIGINT; ``on_ready()`` once it serves."""
    log = logs.get_logger("asyncrl.supervision.process")
    # libzmq sizes a context when its first socket is made (1,023 sockets: 341 connections, a
    # limit it never raises): size it first for a connection to every replica of the run, as
    # the driver does, so that a role calling hundreds of replicas (a dispatch shard) can.
    who = f"roles.{spec.name} replica {spec.replica} (pid {os.getpid()})"
    reserve_connections(spec.groups, who)
    cls = load_role_class(spec.target)
    ctx = RoleContext(
        name=spec.name,
        replica=spec.replica,
        incarnation=spec.incarnation,
        run=spec.run,
        run_dir=spec.run_dir,
        node_dir=spec.node_dir,
        config=inherited_config(spec.config, cls.Config, spec.model),
        threads=spec.threads,
        device=spec.device,
        capacity=spec.capacity,
        replicas=spec.replicas,
        members=list(spec.members),
        formation=spec.formation,
        groups=dict(spec.groups),
        log=log,
    )
    try:
        role = cls(ctx)
    except msgspec.ValidationError as exc:
        raise ConfigProblem(f"roles.{spec.name}.config: {exc}") from exc
    set_threads(spec.threads)
    stop = asyncio.Event()
    stats: Counter[str] = Counter()
    options = ChannelOptions(
        run=spec.run, heartbeat_interval_s=spec.heartbeat_interval_s, liveness=spec.liveness
    )
    servers = _servers(spec, options, stop.set)
    ready = asyncio.Event()
    faults = FaultPlan.from_env(spec.incarnation)
    endpoints = endpoints_of(cls)
    describe = {
        "role": spec.name,
        "replica": spec.replica,
        "incarnation": spec.incarnation,
        "pid": os.getpid(),
        "endpoints": {n: e.delivery.value for n, e in endpoints.items()},
    }
    tally = Tally()
    identity = {
        "process": f"{spec.name}.{spec.replica}",
        "replica": spec.replica,
        "incarnation": spec.incarnation,
        "pid": os.getpid(),
    }
    for server in servers:
        for ep in endpoints.values():
            handler = _handler(role, ep.attr, ep.name, ready, stats, tally, faults)
            server.add(ep.name, handler, ep.request_type)
        server.add("_describe", lambda payload, call: describe)
        server.add("_stats", lambda payload, call: dict(stats))
        server.add("_status", lambda payload, call: status_answer(identity, tally, role))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        for server in servers:
            await server.start()
        LocalRegistry(spec.run_dir).register(
            Entry(spec.name, spec.replica, spec.endpoint, os.getpid(), spec.incarnation)
        )
        log.info("started", endpoint=spec.endpoint, tcp=spec.tcp_endpoint, cls=spec.target)
        try:
            await role.setup()
        except ImportError as exc:  # a module missing or broken here: restarting cannot help
            where = f"roles.{spec.name}[{spec.replica}] (pid {os.getpid()}) setup"
            raise ConfigProblem(import_problem(exc, where)) from exc
        ready.set()
        for server in servers:
            server.set_credit(spec.capacity)
        on_ready()
        log.info("serving", capacity=spec.capacity)
        await stop.wait()
        log.info("stopping", served=stats["served"])
        await role.teardown()
    finally:
        for server in servers:
            await server.close()
        ctx.close()


def _servers(spec: ProcessSpec, options: ChannelOptions, on_stop: Any) -> list[Server]:
    """The replica's inboxes: its stable endpoint, and in a launch over several nodes its tcp
    endpoint for callers on other nodes (without shared memory: none is shared across hosts;
    the same port for every incarnation)."""
    name = f"{spec.name}.{spec.replica}"
    servers = [
        Server(
            spec.endpoint,
            name=name,
            incarnation=spec.incarnation,
            options=options,
            on_stop=on_stop,
        )
    ]
    if spec.tcp_endpoint:
        remote = msgspec.structs.replace(options, shm=False)
        servers.append(
            Server(
                spec.tcp_endpoint,
                name=name,
                incarnation=spec.incarnation,
                options=remote,
                on_stop=on_stop,
            )
        )
    return servers


def _handler(
    role: Role,
    attr: str,
    name: str,
    ready: asyncio.Event,
    stats: Counter[str],
    tally: Tally,
    faults: FaultPlan,
) -> Any:
    method = getattr(role, attr)

    async def handle(payload: Any, call: Call) -> Any:
        if not ready.is_set():
            await ready.wait()
        started, ok = tally.begin(), False
        try:
            result = await method(payload)
            ok = True
        except Exception:
            stats["errors"] += 1
            raise
        finally:
            tally.end(name, started, ok)
        stats["served"] += 1
        faults.after_work(name)
        return result

    return handle


def use_curve_keys(folder: str) -> None:
    """Make every tcp socket of this process use CurveZMQ with the keys in ``folder``
    (``asyncrl.transport.curve``); nothing when ``folder`` is empty.

    Raises:
        ConfigProblem: the keys cannot be loaded (the message names the file).
    """
    if not folder:
        return
    try:
        use_curve(load_keys(folder))
    except TransportError as exc:
        raise ConfigProblem(f"security.curve_keys: {exc}") from exc


def wait_as_standby(spec: ProcessSpec) -> bool:
    """Be the standby of the next incarnation: import the role's modules now, then wait on
    stdin for the supervisor's ``go``. True when told to take over; False when stdin closed
    without it (the run ended).

    Problems importing are not raised here: the real start meets them again and reports them
    as it always does.
    """
    try:
        cls = load_role_class(spec.target)
        cls.preload(inherited_config(spec.config, cls.Config, spec.model))
    except Exception:  # reported by the real start, with the process's own error handling
        pass
    line = sys.stdin.readline()
    if line.strip() != "go":
        return False
    # Marks where this incarnation's stderr starts, for the supervisor's failure report.
    print(f"--- incarnation {spec.incarnation} ---", file=sys.stderr, flush=True)
    return True


def main(parent_pid: int | None = None) -> None:
    """Entry point: read the spec the supervisor wrote
    (``asyncrl.manifest.spec.load_spec_from_env``) and serve. ``parent_pid``: the process this one
    dies with, when it is not the spec's (the zygote, for a process it forked:
    ``asyncrl.supervision.zygote``)."""
    spec = load_spec_from_env()
    die_with_parent(spec.parent_pid if parent_pid is None else parent_pid)
    set_threads(spec.threads)
    hold_heap()
    if "--standby" in sys.argv[1:] and not wait_as_standby(spec):
        sys.exit(0)
    logs.configure(
        role=spec.name,
        replica=spec.replica,
        incarnation=spec.incarnation,
        json_path=os.path.join(spec.run_dir, "logs", f"{spec.name}.{spec.replica}.jsonl"),
        console=logs.console_wanted(),
    )
    heartbeat = start_heartbeat(spec)
    ready = heartbeat.ready if heartbeat is not None else lambda: None
    try:
        use_curve_keys(spec.curve_keys)
        if spec.kind == "driver":
            from asyncrl.dispatch.driver import serve_driver

            code = run_loop(_beating(serve_driver(spec, on_ready=ready), heartbeat))
        else:
            run_loop(_beating(serve_role(spec, on_ready=ready), heartbeat))
            code = 0
    except ConfigProblem as exc:
        print(f"configuration error: {exc}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)
    finally:
        if heartbeat is not None:
            heartbeat.exiting()
    sys.exit(code)


def start_heartbeat(spec: ProcessSpec) -> Heartbeat | None:
    """Start the process's heartbeat thread (``asyncrl.supervision.liveness``); None, with a
    warning, when its liveness file cannot be written: its supervisor then goes by the
    transport's heartbeats, answered from the loop."""
    heartbeat = Heartbeat(
        liveness_path(spec.run_dir, spec.name, spec.replica),
        incarnation=spec.incarnation,
        interval_s=spec.heartbeat_interval_s,
        warn_after_s=spec.warn_after_s,
        log=logs.get_logger("asyncrl.supervision.liveness"),
    )
    try:
        heartbeat.start()
    except OSError as exc:
        logs.get_logger("asyncrl.supervision.process").warning(
            "no heartbeat thread: its liveness file cannot be written; a blocked event loop "
            "will be taken as a hang",
            path=heartbeat.path,
            error=str(exc),
        )
        return None
    return heartbeat


async def _beating(main: Coroutine[Any, Any, T], heartbeat: Heartbeat | None) -> T:
    """Run ``main`` with the heartbeat's timer on this loop."""
    if heartbeat is not None:
        heartbeat.attach(asyncio.get_running_loop())
    return await main


if __name__ == "__main__":
    # ``python -m asyncrl.supervision.process`` runs this file as ``__main__``: call the canonical
    # module's main, so that every class (ConfigProblem among them) is the one the rest of asyncrl
    # imports, and ``except`` clauses match what the driver and roles raise.
    from asyncrl.supervision.process import main as _main

    _main()
