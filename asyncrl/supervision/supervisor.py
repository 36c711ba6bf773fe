"""The supervisor: starts every process of the run, watches it, restarts it, stops it.

Erlang/OTP semantics, per role:

- ``one_for_one``: a replica that fails is restarted alone;
- ``one_for_all``: all replicas of the role restart together (learners sharing a process group);
- ``rest_for_one``: the failed replica and every process started after it restart.

A crash is seen the moment the process exits. A hang is told from a busy process by the
process's own heartbeat thread, whose liveness file the supervisor reads every heartbeat
interval (``asyncrl.supervision.liveness``: frozen, loop blocked past ``hang_after_s``, not
ready at ``startup_timeout_s``); an external command is taken as hung when it misses
``liveness`` x ``heartbeat_interval_s`` of PONGs. A hung process is killed and restarted.
Restarts back off exponentially within a budget of ``max_restarts`` in ``period_s``; past it
the run stops with a report naming the role and replica, the exit code or signal, the
restarts, and the tail of its stderr.

A replica that is alive but no good is restarted when the program asks (``restart``, with an
``asyncrl.restart_request.RestartRequest`` the node agent hands over): it is stopped (STOP,
SIGKILL after ``shutdown_timeout_s``) and its next incarnation started at once. Such a restart
is not a crash: it spends none of the budget and has no backoff (the one asking backs off);
its reason is logged and shown per process (``restart_requests``, ``restart_reason``). Only the
exit the request causes counts so (code 0 or SIGKILL, not killed as hung): a crash or a hang
of the incarnation before it stops is a failure as any other.

Beside a launch over several nodes (``hold_group``), a ``one_for_all`` group's failure restart
waits while a node holding a rank of the group is silent: a rank whose collective broke with
a rank on a node about to be marked lost is then started once, by the group's restart at its
smaller size (``restart_role``, outside the budget), not first at its old size as well.

Every process is spawned from this event loop's thread (the parent-death signal that kills it
with the agent is tied to that thread) in a session and process group of its own, so its own
children die with it.

A restart is forked, when it can be, by the node's zygote (``asyncrl.supervision.zygote``: one
process that imported torch and this node's roles once), which reports each fork's exit status;
otherwise (no zygote ready yet, ``command:`` roles, ``ASYNCRL_ZYGOTE=0``) a process starts cold.

With ``supervision.standby``, each replica of a role has a standby process: the next incarnation,
started ahead (``python -m asyncrl.supervision.process --standby``), which imports the role's
modules and waits on its stdin. A restart then writes ``go`` to it instead of starting an
interpreter, and a new standby is started behind it.

Every task of the supervisor (watching each process, holding its client, reading its liveness
file, starting a standby) belongs to one ``asyncio.TaskGroup``. A task that raises is a bug of
the supervisor itself: it is logged with its traceback, the other tasks are cancelled, every
process is stopped as at the end of a run, and ``run()`` raises it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import os
import signal
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

from asyncrl.exits import EXIT_PROGRAM
from asyncrl.manifest.load import Supervision
from asyncrl.manifest.spec import EXIT_CONFIG
from asyncrl.observe import logs
from asyncrl.restart_request import RestartAnswer, RestartRequest
from asyncrl.supervision import standby
from asyncrl.supervision.liveness import Watch
from asyncrl.supervision.runreport import (
    ExitInfo,
    ProcessInfo,
    RunReport,
    exit_reason,
    format_report,
    stderr_tail,
)
from asyncrl.supervision.zygote import AnyProcess, ForkedProcess, Launcher
from asyncrl.transport import ChannelOptions, Client, PeerEvent, TransportError, sweep

__all__ = ["ChildSpec", "ExitInfo", "ProcessInfo", "RunReport", "Supervisor", "format_report"]


@dataclass
class ChildSpec:
    """One process to supervise: how to start incarnation ``n`` of it, and under which policy.

    ``argv_env(n)`` returns the command line and the extra environment of incarnation ``n``.
    ``liveness_path`` is the liveness file its heartbeat thread writes
    (``asyncrl.supervision.liveness``); empty for an external command, which has none.
    """

    name: str
    replica: int
    kind: Literal["role", "driver", "command"]
    endpoint: str
    policy: Supervision
    argv_env: Callable[[int], tuple[list[str], dict[str, str]]]
    liveness_path: str = ""


def _set_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


@dataclass(eq=False)
class _Child:
    spec: ChildSpec
    log_path: str
    incarnation: int = -1
    proc: AnyProcess | None = None
    client: Client | None = None
    serving: bool = False
    hung: str = ""  # why it was killed as hung; empty: it was not
    watch: Watch | None = None  # this incarnation's liveness file, when it has one
    expected_exit: bool = False
    restarting: bool = False
    restart_times: collections.deque[float] = field(default_factory=collections.deque)
    restarts: int = 0
    spare: asyncio.subprocess.Process | None = None  # the standby: the next incarnation
    streak: int = 0  # restarts in a row: the backoff's exponent
    served_at: float | None = None  # when this incarnation was first heard
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    # Clear while ``_spawn`` starts an incarnation (``proc`` is still the one before it).
    spawned: asyncio.Event = field(default_factory=_set_event)
    requested: str = ""  # why a restart of this incarnation was asked for; empty: none was
    restart_requests: int = 0  # restarts asked for and made
    restart_reason: str = ""  # the reason of the latest of them

    @property
    def label(self) -> str:
        return f"{self.spec.name}[{self.spec.replica}]"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def cut_short(self) -> bool:
        """Whether the run ending now cuts this process's restart short: it waits out its
        backoff, or was started again and has not served yet (not one that just died)."""
        return self.restarting or (self.alive and self.incarnation > 0 and not self.serving)


class Supervisor:
    """Runs the children until the driver finishes, a child exhausts its budget, or ``stop()``.

    Args:
        children: in start order (roles in manifest order, then the driver).
        run: the run's name (shared-memory segments of dead processes are swept by it).
        log_dir: where each process's stderr goes (``<name>.<replica>.stderr``).
        observer: called with (``"started"``, ``"serving"`` or ``"exited"``, process label,
            incarnation) the moment the supervisor learns it: benchmarks time recovery with it,
            and the agent's janitor learns each pid as soon as it exists.
        zygote: fork restarts from a pre-imported zygote (``asyncrl.supervision.zygote``); False
            starts every process cold.
    """

    def __init__(
        self,
        children: list[ChildSpec],
        *,
        run: str,
        log_dir: str,
        observer: Callable[[str, str, int], None] | None = None,
        zygote: bool = True,
    ) -> None:
        self.run_name = run
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)
        self._children = [
            _Child(c, os.path.join(log_dir, f"{c.name}.{c.replica}.stderr")) for c in children
        ]
        self._log = logs.get_logger("asyncrl.supervision.supervisor")
        self._tasks: asyncio.TaskGroup | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._served: dict[str, int] | None = None  # set once every process is stopped
        self._done = asyncio.Event()
        self._report: RunReport | None = None
        self._exits: list[ExitInfo] = []
        self._stopping = False
        self._observer = observer
        self.launcher = Launcher(log_dir, enabled=zygote)
        self.hold_group: Callable[[str, float], Awaitable[None]] | None = None
        """Set beside a launch over several nodes (``asyncrl.supervision.multinode``): given a
        ``one_for_all`` role and when a process of its group failed (``time.monotonic()``), it
        returns once every other node holding a rank of the group is heard from after that
        (the failure was the process's own), or once the node that went silent had time to be
        marked lost; meanwhile the group's failure restart waits, so that a group that goes on
        at a smaller size restarts once (``restart_role``), not first at its old size."""
        self._held: dict[str, asyncio.Event] = {}  # per role: its failure restart waits

    # -- the run --------------------------------------------------------------------------

    async def run(self) -> RunReport:
        """Start everything, supervise until the end, stop everything; return the report.

        Raises:
            ExceptionGroup: a task of the supervisor raised (a bug of the supervisor, logged
                with its traceback as ``supervisor task failed``); the group holds its
                exception. Every process was stopped first.
        """
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                for child in self._children:
                    await self._spawn(child)
                self._own(self.launcher.run())  # after the first starts: they go first
                await self._done.wait()
                await self._wind_down()
        finally:
            # After a task failed, or a cancellation: the tasks are gone, not the processes.
            await self._wind_down()
        assert self._report is not None and self._served is not None
        self._report.exits = list(self._exits)
        self._report.restarts = self._restart_counts()
        self._report.served = self._served
        return self._report

    async def _wind_down(self) -> None:
        """Count what the roles served, stop every process, cancel the tasks left; once."""
        if self._served is not None:
            return
        served = await self._collect_served()
        await self._stop_all()
        for task in list(self._background):
            task.cancel()
        self._served = served

    def processes(self) -> list[ProcessInfo]:
        """Every supervised process, in start order, with its current incarnation and pid."""
        return [
            ProcessInfo(
                c.spec.name,
                c.spec.replica,
                c.spec.kind,
                c.incarnation,
                c.proc.pid if c.proc is not None else None,
                c.alive,
                c.serving,
                c.spare.pid if c.spare is not None and c.spare.returncode is None else None,
            )
            for c in self._children
        ]

    def status(self) -> list[dict[str, Any]]:
        """Every process now, in start order (``asyncrl status``): its ``ProcessInfo`` fields,
        ``restarts``, and ``heartbeat_age_s``: seconds since its supervisor's client last heard
        it (any message resets the client's liveness clock); None while it does not serve."""
        now, rows = time.monotonic(), list[dict[str, Any]]()
        for info, c in zip(self.processes(), self._children, strict=True):
            heard = c.client.last_heard if c.client is not None and c.serving else None
            age = None if heard is None else round(now - heard, 3)
            row = {f: getattr(info, f) for f in info.__struct_fields__}
            forked = isinstance(c.proc, ForkedProcess)
            rows.append(
                row
                | {
                    "restarts": c.restarts,
                    "heartbeat_age_s": age,
                    "forked": forked,
                    "restart_requests": c.restart_requests,
                    "restart_reason": c.restart_reason,
                }
            )
        return rows

    def restart(self, request: RestartRequest) -> RestartAnswer:
        """Restart a replica that is alive but no good, as ``request`` asks (see the module):
        stop its incarnation now and start the next one as soon as it has exited.

        Returns:
            ``restarted`` True with the incarnation being stopped and its pid; or a refusal
            saying why: no such replica here (``found`` False), a bad request, the driver, a
            role that restarts as a group, the run ending, the incarnation asked about gone
            already, or the replica restarting already.
        """
        child = next(
            (
                c
                for c in self._children
                if c.spec.name == request.role and c.spec.replica == request.replica
            ),
            None,
        )
        label = f"{request.role}[{request.replica}]"
        if child is None:
            return RestartAnswer(
                restarted=False, found=False, why=f"{label} is not supervised on this node"
            )
        pid = child.proc.pid if child.proc is not None else None

        def refused(why: str) -> RestartAnswer:
            self._log.info(
                "restart refused", process=label, reason=request.reason, refused=why, pid=pid
            )
            return RestartAnswer(restarted=False, incarnation=child.incarnation, pid=pid, why=why)

        problem = request.problem()
        if problem:
            return refused(f"a bad restart request: {problem}")
        if child.spec.kind == "driver":
            return refused("the driver is not restarted on request; it restarts when it crashes")
        if child.spec.policy.strategy != "one_for_one":
            return refused(
                f"{request.role} restarts as a group (strategy {child.spec.policy.strategy}): "
                "one replica alone is not restarted on request"
            )
        if self._stopping:
            return refused("the run is ending")
        if request.incarnation >= 0 and request.incarnation != child.incarnation:
            return refused(
                f"incarnation {request.incarnation} is gone already; incarnation "
                f"{child.incarnation} runs now"
            )
        if child.requested or child.restarting or not child.alive or child.proc is None:
            return refused(f"{label} is restarting already")
        child.requested = request.reason
        self._log.warning(
            "restart requested", process=label, **self._identity(child), reason=request.reason
        )
        self._own(self._stop_to_restart(child, child.proc))
        return RestartAnswer(restarted=True, incarnation=child.incarnation, pid=pid)

    async def _stop_to_restart(self, child: _Child, proc: AnyProcess) -> None:
        """Ask the incarnation to stop (STOP); kill it if it has not exited within its
        ``shutdown_timeout_s``. Its watcher restarts it (``_restart_requested``)."""
        exited = child.exited
        if child.serving and child.client is not None:
            with contextlib.suppress(TransportError):
                child.client.send_stop()
            try:
                await asyncio.wait_for(exited.wait(), child.spec.policy.shutdown_timeout_s)
                return
            except TimeoutError:
                self._log.warning("did not stop in time", process=child.label, sending="SIGKILL")
        if child.proc is proc:
            self._kill(child, signal.SIGKILL)

    async def adopt(self, spec: ChildSpec) -> None:
        """Supervise one more process from now on (a replica moved here from a lost node),
        started at once, under its own policy; ignored once the run is ending."""
        if self._stopping or self._tasks is None:
            return
        child = _Child(spec, os.path.join(self.log_dir, f"{spec.name}.{spec.replica}.stderr"))
        self._children.append(child)
        await self._spawn(child)

    async def restart_role(self, name: str, reason: str) -> list[str]:
        """Start every process of role ``name`` on this node again at once (its data-parallel
        group went on at a smaller size): each is killed (SIGKILL: one blocked in a collective
        with a lost rank answers nothing else) and started again, its standby discarded (it
        was made for the group as it was), outside its restart budget. A process that a
        failure is already restarting is left to that restart, which starts it as the group
        is now. Returns the labels of the processes restarted; none once the run is ending."""
        if self._stopping or self._tasks is None:
            return []
        mine = [c for c in self._children if c.spec.name == name]
        held = self._held.get(name)
        if held is not None:
            # Its failure restart waits for this: it starts the group now, as it is now,
            # outside the budget.
            held.set()
            return [c.label for c in mine if c.restarting]
        # A process being started (a failure's restart: it was made for the group as it was)
        # is killed and started again below, once its start has gone far enough to be killed.
        await asyncio.gather(*(c.spawned.wait() for c in mine))
        spares = [s for s in map(self._discard_spare, mine) if s is not None]
        await asyncio.gather(*(spare.wait() for spare in spares))
        return await self._restart_group([c for c in mine if not c.restarting], reason)

    async def _restart_group(self, group: list[_Child], reason: str) -> list[str]:
        """Kill ``group``'s processes and start each again (``restart_role``)."""
        for child in group:
            child.restarting = True
        for child in group:
            if child.alive:
                child.expected_exit = True
                self._kill(child, signal.SIGKILL)
                await child.exited.wait()
        restarted: list[str] = []
        for child in group:
            if self._stopping:
                return restarted
            child.restarting = False
            child.restarts += 1
            self._log.info(
                "restarting", process=child.label, **self._identity(child), reason=reason
            )
            # A standby that finished starting meanwhile was made for the group as it was.
            stale = self._discard_spare(child)
            await self._spawn(child)
            restarted.append(child.label)
            if stale is not None:
                await stale.wait()
        return restarted

    @property
    def ended(self) -> RunReport | None:
        """How the run ended (the first report: the program finished, a budget ran out,
        ``stop`` or ``end``), from the moment it did, while the processes are still being
        stopped; None while it runs."""
        return self._report

    def stop(self, reason: str = "interrupted") -> None:
        """End the run (a signal arrived): every process is stopped in order."""
        self._finish(RunReport("interrupted", reason))

    def end(self, report: RunReport) -> None:
        """End the run as ``report`` says, decided elsewhere (another node of the launch ended
        it, or stopped answering): every process is stopped in order. Ignored once ended."""
        self._finish(report)

    def _finish(self, report: RunReport) -> None:
        """End the run as ``report`` says (the first report wins), noting the processes whose
        restart this cuts short."""
        if self._report is None:
            report.restarting = [c.label for c in self._children if c.cut_short]
            self._report = report
            self._stopping = True
            self._done.set()

    def _restart_counts(self) -> dict[str, int]:
        counts: collections.Counter[str] = collections.Counter()
        for child in self._children:
            counts[child.spec.name] += child.restarts
        return dict(counts)

    # -- starting -------------------------------------------------------------------------

    async def _spawn(self, child: _Child) -> None:
        child.incarnation += 1
        child.serving = False
        child.served_at = None
        child.hung = ""
        child.watch = None
        child.expected_exit = False
        child.requested = ""
        child.exited = asyncio.Event()
        child.spawned.clear()
        try:
            spare, child.spare = child.spare, None
            if spare is not None and await standby.activate(spare):
                child.proc = spare
            else:
                argv, env = child.spec.argv_env(child.incarnation)
                child.proc = await self.launcher.start(
                    argv, env, child.log_path, child.spec.kind, child.incarnation
                )
        finally:
            child.spawned.set()
        how = {"standby": child.proc is spare, "forked": isinstance(child.proc, ForkedProcess)}
        self._log.info("started", process=child.label, **self._identity(child), **how)
        if self._observer is not None:
            self._observer("started", child.label, child.incarnation)
        self._own(self._watch(child, child.proc))
        if child.spec.liveness_path:
            child.watch = Watch.of(child.spec, child.proc.pid, child.incarnation)
            self._own(self._liveness(child, child.proc, child.watch))
        if child.client is None:
            self._own(self._heartbeats(child))
        loop = asyncio.get_running_loop()
        incarnation = child.incarnation
        loop.call_later(
            child.spec.policy.startup_timeout_s, self._check_started, child, incarnation
        )

    async def _start_spare(self, child: _Child) -> None:
        """Start the next incarnation as a standby (it imports, then waits for ``go``), once the
        current one serves, so that the two do not compete for the CPU while it starts."""
        incarnation = child.incarnation + 1
        argv, env = child.spec.argv_env(incarnation)
        spare = await standby.start(argv, env, child.log_path)
        if self._stopping or child.spare is not None or child.incarnation + 1 != incarnation:
            # The replica restarted (or the run ended) while this one started: not the next.
            standby.kill(spare)
            await spare.wait()
            return
        child.spare = spare
        self._log.info(
            "standby started", process=child.label, incarnation=incarnation, standby_pid=spare.pid
        )
        if self._observer is not None:
            self._observer("standby", child.label, incarnation)

    def _discard_spare(self, child: _Child) -> asyncio.subprocess.Process | None:
        """Kill the child's standby, if it has one; return it, to be waited for."""
        spare, child.spare = child.spare, None
        return standby.kill(spare) if spare is not None else None

    def _own(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task of the supervisor's task group, unless the group is closing
        (the run ended, or one of its tasks failed): then it does not run."""
        if self._tasks is None:
            coro.close()
            return
        try:
            task = self._tasks.create_task(coro)
        except RuntimeError:  # the group is shutting down or finished
            coro.close()
            return
        self._background.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        assert exc is not None
        # The task group cancels the others and raises it from run(); say so at once.
        self._log.error(
            "supervisor task failed",
            task=getattr(task.get_coro(), "__qualname__", task.get_name()),
            error=repr(exc),
            traceback="".join(traceback.format_exception(exc)),
        )
        self._finish(RunReport("failed", f"the supervisor failed: {exc!r}"))

    def _check_started(self, child: _Child, incarnation: int) -> None:
        """At the start-up deadline: kill the incarnation unless it answered, and is ready
        when it has a liveness file."""
        if child.incarnation != incarnation or not child.alive or self._stopping:
            return
        watch = child.watch
        if child.serving and (watch is None or watch.ready or not watch.beating):
            return
        timeout_s = child.spec.policy.startup_timeout_s
        self._log.error("startup timeout", process=child.label, timeout_s=timeout_s)
        child.hung = "not ready within startup_timeout_s"
        self._kill(child, signal.SIGKILL)

    # -- watching -------------------------------------------------------------------------

    async def _liveness(self, child: _Child, proc: AnyProcess, watch: Watch) -> None:
        """Read the incarnation's liveness file every heartbeat interval until it exits; kill
        it when it is hung (``liveness.judge``)."""
        while child.proc is proc and proc.returncode is None and not self._stopping:
            await asyncio.sleep(child.spec.policy.heartbeat_interval_s)
            verdict = watch.check(time.monotonic_ns())
            if verdict is None or child.proc is not proc or not child.alive or self._stopping:
                continue
            self._log.error(f"hung: {verdict.kind}", process=child.label, detail=verdict.detail)
            child.hung = verdict.reason
            self._kill(child, signal.SIGKILL)
            return

    async def _heartbeats(self, child: _Child) -> None:
        """Keep one client on the child's stable endpoint across its incarnations."""
        policy = child.spec.policy
        options = ChannelOptions(
            run=self.run_name,
            heartbeat_interval_s=policy.heartbeat_interval_s,
            liveness=policy.liveness,
        )
        while not self._stopping:
            client = Client(
                child.spec.endpoint,
                name=f"supervisor->{child.label}",
                options=options,
                on_event=functools.partial(self._on_peer, child),
                control=True,  # only the supervisor may stop its processes
            )
            child.client = client
            try:
                await client.connect(timeout=policy.startup_timeout_s)
                return
            except TransportError:
                await client.close()

    def _on_peer(self, child: _Child, event: PeerEvent) -> None:
        if event.kind in ("connected", "restarted"):
            if event.incarnation == child.incarnation and not child.serving:
                child.serving = True
                child.served_at = time.monotonic()
                policy = child.spec.policy
                if policy.standby and child.spec.kind == "role" and child.spare is None:
                    self._own(self._start_spare(child))
                if self._observer is not None:
                    self._observer("serving", child.label, child.incarnation)
                self._log.info("serving", process=child.label, **self._identity(child))
        elif event.kind == "dead" and child.serving and child.alive and not self._stopping:
            if child.watch is not None and child.watch.beating:
                return  # its loop does not answer, its heartbeat thread does: busy, not hung
            self._log.error("hung: missed heartbeats", process=child.label, detail=event.detail)
            child.hung = "missed heartbeats"
            self._kill(child, signal.SIGKILL)

    async def _watch(self, child: _Child, proc: AnyProcess) -> None:
        code = await proc.wait()
        if self._observer is not None:
            self._observer("exited", child.label, child.incarnation)
        self._reap(proc)
        child.exited.set()
        if child.proc is not proc:
            return
        info = self._exit_info(child, proc.pid, code)
        if self._exit_requested(child, code) and not (
            child.expected_exit or child.restarting or self._stopping
        ):
            await self._restart_requested(child, info)
            return
        if child.expected_exit or child.restarting or self._stopping:
            return
        if child.spec.kind == "driver" and code == 0:
            self._log.info("program finished", process=child.label)
            self._finish(RunReport("completed", "the control-flow program finished"))
            return
        self._exits.append(info)
        self._log.error(
            "process failed",
            process=child.label,
            **self._identity(child, proc.pid),
            reason=info.reason,
            code=info.code,
            signal=info.signal,
        )
        if child.spec.kind == "driver" and code == EXIT_PROGRAM:
            # The program raised (or stalled): running it again would fail the same way.
            self._finish(
                RunReport(
                    "failed",
                    "the control-flow program raised (or the run stalled); see the tail of its "
                    "stderr below",
                    info,
                )
            )
            return
        await self._recover(child, info)

    def _reap(self, proc: AnyProcess) -> None:
        """Clean up after a process that exited: its shared memory, what it left in its group."""
        sweep(self.run_name, pid=proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def _identity(self, child: _Child, pid: int | None = None) -> dict[str, Any]:
        """Log fields naming the child (not the agent that writes the line)."""
        return {
            "role": child.spec.name,
            "replica": child.spec.replica,
            "incarnation": child.incarnation,
            "pid": pid if pid is not None else (child.proc.pid if child.proc else None),
            "agent_pid": os.getpid(),
        }

    def _exit_info(self, child: _Child, pid: int, code: int) -> ExitInfo:
        sig = signal.Signals(-code).name if code < 0 else None
        return ExitInfo(
            child.spec.name,
            child.spec.replica,
            child.incarnation,
            pid,
            None if sig else code,
            sig,
            exit_reason(code, hung=child.hung, driver=child.spec.kind == "driver"),
            stderr_tail(child.log_path, child.incarnation),
        )

    # -- restarting -----------------------------------------------------------------------

    async def _recover(self, child: _Child, info: ExitInfo) -> None:
        policy = child.spec.policy
        if info.code == EXIT_CONFIG:
            self._finish(RunReport("failed", f"{child.label} has a configuration error", info))
            return
        if policy.strategy == "one_for_all" and await self._restarted_smaller(child):
            return
        now = time.monotonic()
        while child.restart_times and now - child.restart_times[0] > policy.period_s:
            child.restart_times.popleft()
        if len(child.restart_times) >= policy.max_restarts:
            self._finish(
                RunReport(
                    "failed",
                    f"{child.label} failed {len(child.restart_times) + 1} times within "
                    f"{policy.period_s:g} s, past its budget of {policy.max_restarts} restarts",
                    info,
                )
            )
            return
        # Doubles with each restart in a row; an incarnation that served for backoff_max_s or
        # longer ends the row, so its successor starts again from backoff_initial_s.
        if child.served_at is not None and now - child.served_at >= policy.backoff_max_s:
            child.streak = 0
        backoff = min(policy.backoff_initial_s * 2**child.streak, policy.backoff_max_s)
        child.streak += 1
        child.restart_times.append(now)
        # Members another failure is already restarting are left to that restart.
        group = [c for c in self._restart_set(child) if c is child or not c.restarting]
        for member in group:
            member.restarting = True
        for other in group:
            if other is not child and other.alive:
                other.expected_exit = True
                self._kill(other, signal.SIGKILL)
                await other.exited.wait()
        if backoff:
            await asyncio.sleep(backoff)
        for member in group:
            if self._stopping:  # the run ended during the backoff or an earlier member's start
                return
            member.restarting = False
            member.restarts += 1
            self._log.info(
                "restarting",
                process=member.label,
                **self._identity(member),
                after_s=backoff,
                restarts=member.restarts,
            )
            await self._spawn(member)

    async def _restarted_smaller(self, child: _Child) -> bool:
        """Before a ``one_for_all`` group's failure restart, beside a launch (``hold_group``):
        stop the group's other processes and wait while a node holding a rank of it is
        silent. When the node is marked lost meanwhile and the group goes on at a smaller size
        (``restart_role``), start the group's processes once, at the new size, outside the
        budget and its backoff, and return True; otherwise return False and the failure
        restart goes on as usual."""
        name = child.spec.name
        if self.hold_group is None or name in self._held:
            return False
        failed = time.monotonic()
        group = [c for c in self._restart_set(child) if c is child or not c.restarting]
        for member in group:
            member.restarting = True
        shrunk = self._held[name] = asyncio.Event()
        try:
            for other in group:
                if other is not child and other.alive:
                    other.expected_exit = True
                    self._kill(other, signal.SIGKILL)
                    await other.exited.wait()
            hold = asyncio.ensure_future(self.hold_group(name, failed))
            told = asyncio.ensure_future(shrunk.wait())
            ended = asyncio.ensure_future(self._done.wait())  # the run ended: no restart
            waits = (hold, told, ended)
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in waits:
                    task.cancel()
                await asyncio.gather(*waits, return_exceptions=True)
        finally:
            del self._held[name]
            for member in group:
                member.restarting = False
        if not shrunk.is_set():
            return self._stopping  # the run ended meanwhile: nothing to restart
        for member in group:
            if self._stopping:  # the run ended during the hold or an earlier member's start
                return True
            member.restarts += 1
            self._log.info(
                "restarting",
                process=member.label,
                **self._identity(member),
                reason="its group goes on at a smaller size",
                restarts=member.restarts,
            )
            stale = self._discard_spare(member)  # made for the group as it was
            await self._spawn(member)
            if stale is not None:
                await stale.wait()
        return True

    @staticmethod
    def _exit_requested(child: _Child, code: int) -> bool:
        """Whether the incarnation's exit (``code``) is the one its restart request caused: a
        restart was asked for, and it exited with code 0 (it stopped on the STOP) or by SIGKILL
        (the request's, after ``shutdown_timeout_s``, or at once for one not yet serving), and
        the liveness watch did not kill it as hung. Any other exit (a crash before the STOP
        landed, or a hang) is the failure it is: logged, reported and restarted within the
        budget, as without a request."""
        return bool(child.requested) and not child.hung and code in (0, -signal.SIGKILL)

    async def _restart_requested(self, child: _Child, info: ExitInfo) -> None:
        """Start the next incarnation of a replica stopped because a restart was asked for:
        at once, outside its budget and backoff (see the module)."""
        reason = child.requested
        child.restarts += 1
        child.restart_requests += 1
        child.restart_reason = reason
        self._log.warning(
            "restarting on request",
            process=child.label,
            **self._identity(child, info.pid),
            reason=reason,
            exit=info.reason,
            restarts=child.restarts,
            restart_requests=child.restart_requests,
        )
        await self._spawn(child)

    def _restart_set(self, child: _Child) -> list[_Child]:
        strategy = child.spec.policy.strategy
        if strategy == "one_for_all":
            return [c for c in self._children if c.spec.name == child.spec.name]
        if strategy == "rest_for_one":
            return self._children[self._children.index(child) :]
        return [child]

    # -- stopping -------------------------------------------------------------------------

    def _kill(self, child: _Child, sig: int) -> None:
        if child.proc is not None and child.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, sig)

    async def _collect_served(self) -> dict[str, int]:
        served: collections.Counter[str] = collections.Counter()

        async def ask(child: _Child) -> None:
            if child.client is None or child.spec.kind != "role" or not child.alive:
                return
            with contextlib.suppress(TransportError):
                stats = await child.client.call("_stats", None, timeout=1.0)
                served[child.spec.name] += int(stats.get("served", 0))

        await asyncio.gather(*(ask(c) for c in self._children))
        return dict(served)

    async def _stop_all(self) -> None:
        """STOP, then SIGTERM after the shutdown timeout, then SIGKILL: driver first, then the
        roles in reverse start order, each group of replicas together."""
        self._stopping = True
        spares = [s for s in map(self._discard_spare, self._children) if s is not None]
        order: list[list[_Child]] = []
        for child in reversed(self._children):
            if order and order[-1][0].spec.name == child.spec.name:
                order[-1].append(child)
            else:
                order.append([child])
        for group in order:
            await asyncio.gather(*(self._stop_one(c) for c in group))
        await asyncio.gather(*(spare.wait() for spare in spares))
        for child in self._children:
            if child.client is not None:
                await child.client.close()

    async def _stop_one(self, child: _Child) -> None:
        """Stop the child; wait for its process itself (its watcher may be gone: a bug)."""
        proc = child.proc
        if proc is None or proc.returncode is not None:
            return
        exited = child.exited
        child.expected_exit = True
        timeout = child.spec.policy.shutdown_timeout_s
        signals = [signal.SIGTERM, signal.SIGKILL]
        if child.serving and child.client is not None:
            with contextlib.suppress(TransportError):
                child.client.send_stop()
        else:
            # Still starting (a restart the end of the run caught): it answers no STOP yet, so
            # waiting for one would only add a timeout. SIGTERM it at once.
            self._kill(child, signals.pop(0))
        for sig in signals:
            try:
                await asyncio.wait_for(proc.wait(), timeout)
                break
            except TimeoutError:
                self._log.warning(
                    "did not stop in time", process=child.label, sending=signal.Signals(sig).name
                )
                self._kill(child, sig)
        else:
            await proc.wait()
        if not exited.is_set():  # its watcher did not see the exit
            self._reap(proc)
