"""The driver process: runs the control-flow program, ``async def main(ctx)``, under supervision.

The program runs in its own process, never in the node agent, so a program that blocks or crashes
cannot stall the supervisor. The driver binds an inbox like every role (heartbeats, STOP), holds
one dispatcher for all role groups, and when the program returns it writes ``driver.json`` in the
run directory (the result, if it is JSON, and the dispatcher's counts) and exits with status 0,
which ends the run.

An exception raised by the program is not a crash: the driver exits with ``EXIT_PROGRAM`` and the
supervisor fails the run once, with the traceback. A crash of the driver process (SIGKILL, OOM)
is restarted, and the program resumes from what the run checkpointed (``ctx.incarnation`` > 0).
A program that makes no progress for ``pipeline.stall_timeout_s`` fails the run the same way,
with what it waited for (``asyncrl.dispatch.watchdog``).

Two settings let one driver carry a thousand replicas and more (docs/scaling.md): its ZeroMQ
context holds three sockets for each replica it calls (libzmq's default allows 341 replicas),
and once it has started, what it made so far is frozen out of the cyclic garbage collector's
sight (``freeze_start_up``).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import importlib
import importlib.util
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from asyncrl.dispatch.dispatcher import Dispatcher, reserve_connections
from asyncrl.dispatch.handles import Context
from asyncrl.dispatch.restarts import Restarts
from asyncrl.dispatch.watchdog import Watchdog
from asyncrl.errors import ConfigProblem
from asyncrl.exits import EXIT_PROGRAM, EXIT_STOPPED
from asyncrl.manifest.membership import MEMBERSHIP_FILE, Membership
from asyncrl.manifest.pipeline_section import PipelineSpec
from asyncrl.manifest.spec import ProcessSpec
from asyncrl.observe import logs, metrics
from asyncrl.safe_files import write_atomic
from asyncrl.transport import ChannelOptions, Server

__all__ = [
    "Program",
    "follow_membership",
    "followed",
    "freeze_start_up",
    "load_program",
    "serve_driver",
]

Program = Callable[[Context], Coroutine[Any, Any, Any]]

_GC_DEFAULTS = gc.get_threshold()


def load_program(target: str) -> Program:
    """The control-flow program named by ``module:function`` or ``path/file.py:function``
    (``:function`` defaults to ``main``).

    Raises:
        ConfigProblem: it cannot be imported, its module raised while it was imported (any
            exception: importing it again would raise again), or it is not an async function.
    """
    where, _, name = target.rpartition(":") if ":" in target else (target, "", "main")
    name = name or "main"
    try:
        if where.endswith(".py") or os.sep in where:
            path = os.path.abspath(where)
            spec = importlib.util.spec_from_file_location("asyncrl_program", path)
            if spec is None or spec.loader is None:
                raise ConfigProblem(f"program {target!r}: {path} is not a Python file")
            module = importlib.util.module_from_spec(spec)
            sys.modules["asyncrl_program"] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except (ImportError, FileNotFoundError) as exc:
        raise ConfigProblem(f"run.program {target!r}: cannot import {where!r}: {exc}") from exc
    except ConfigProblem:
        raise
    except Exception as exc:  # the module's own code raised: importing again raises again
        traceback.print_exc()  # where in the module: the message below gives only the error
        raise ConfigProblem(
            f"run.program {target!r}: importing {where!r} raised {type(exc).__name__}: {exc}; "
            f"fix the module (its traceback is above)"
        ) from exc
    fn = getattr(module, name, None)
    if fn is None or not asyncio.iscoroutinefunction(fn):
        raise ConfigProblem(
            f"run.program {target!r}: {where} has no async function {name!r}; the program is "
            f"'async def {name}(ctx)'"
        )
    return fn  # type: ignore[no-any-return]


async def serve_driver(spec: ProcessSpec, *, on_ready: Callable[[], None] = lambda: None) -> int:
    """Run the program; return the process's exit status (see ``asyncrl.exits``). ``on_ready``
    is called once the program starts.

    0: the program finished. ``EXIT_STOPPED``: stopped before it finished (never success).
    ``EXIT_PROGRAM``: the program raised, or stalled; the run fails once, with the traceback
    written to stderr and ``driver.json``.
    """
    log = logs.get_logger("asyncrl.dispatch.driver")
    program = load_program(spec.target)
    if spec.incarnation > 0 and _finished(spec.run_dir):  # see _finished
        log.info("program already finished; its result stands", incarnation=spec.incarnation)
        return 0
    stop = asyncio.Event()
    server = _inbox(spec, stop)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    pipeline = msgspec.convert(spec.pipeline, PipelineSpec)
    watchdog = Watchdog(pipeline.stall_timeout_s)
    dispatcher = Dispatcher(spec.groups, run=spec.run)
    dispatcher.start()
    server.add("status", _status(spec, dispatcher))
    restarts = Restarts(spec.run_dir, run=spec.run)
    ctx = Context(
        dispatcher,
        run=spec.run,
        run_dir=spec.run_dir,
        log=log,
        config=spec.config,
        pipeline=pipeline,
        watchdog=watchdog,
        incarnation=spec.incarnation,
        model=spec.model,
        roles=spec.roles,
        restarts=restarts,
    )
    freeze_start_up()
    on_ready()
    log.info("program started", program=spec.target, resumed=spec.incarnation > 0)
    program_task = loop.create_task(program(ctx))
    stop_task = loop.create_task(stop.wait())
    watch_task = loop.create_task(watchdog.run())
    follow_task = loop.create_task(follow_membership(spec.run_dir, dispatcher, log))
    follow_task.add_done_callback(functools.partial(followed, log))
    try:
        await asyncio.wait(
            {program_task, stop_task, watch_task}, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        for task in (stop_task, watch_task, follow_task):
            task.cancel()
        if not program_task.done():
            program_task.cancel()
        await asyncio.gather(
            program_task, stop_task, watch_task, follow_task, return_exceptions=True
        )
        summary = dispatcher.summary()
        await restarts.close()
        await dispatcher.close()
        await server.close()
        gc.unfreeze()  # the process ends now; a test that called this goes on as before
        gc.set_threshold(*_GC_DEFAULTS)
    stalled = watch_task.exception() if watch_task.done() and not watch_task.cancelled() else None
    if stalled is not None:
        await _record(spec.run_dir, finished=False, error=str(stalled), dispatch=summary)
        print(f"the run stalled: {stalled}", file=sys.stderr, flush=True)
        log.error("stalled", error=str(stalled))
        return EXIT_PROGRAM
    if program_task.cancelled():
        log.info("program stopped before it finished")
        await _record(spec.run_dir, finished=False, stopped=True, dispatch=summary)
        return EXIT_STOPPED
    exc = program_task.exception()
    if exc is not None:
        text = "".join(traceback.format_exception(exc))
        await _record(spec.run_dir, finished=False, error=text, dispatch=summary)
        print(f"the control-flow program raised:\n{text}", file=sys.stderr, flush=True)
        log.error("program raised", error=repr(exc))
        return EXIT_PROGRAM
    result = program_task.result()
    await _record(spec.run_dir, finished=True, result=_jsonable(result), dispatch=summary)
    log.info("program finished")
    return 0


MEMBERSHIP_POLL_S = 0.5
"""Seconds between two looks of the driver at its node's ``membership.json``."""


def followed(log: Any, task: asyncio.Task[None]) -> None:
    """Log why following the membership stopped, unless it was cancelled at the end: from then
    on the dispatcher no longer learns of lost or moved replicas."""
    if not task.cancelled() and task.exception() is not None:
        log.error("following the run's membership failed", error=repr(task.exception()))


async def follow_membership(
    run_dir: str,
    dispatcher: Dispatcher,
    log: Any,
    view: Callable[[Membership], Membership] | None = None,
) -> None:
    """Apply the run's membership (``asyncrl.manifest.membership``), as node 0's agent writes
    it into ``RUN_DIR/membership.json``, to ``dispatcher`` until cancelled: at start (a driver
    restarted after a node was lost) and each time the file changes. Each change is logged;
    a file that does not decode is logged and looked at again when it changes.

    ``view``, when given, turns the membership into the one ``dispatcher`` knows (a dispatcher
    over some of a role's replicas, numbered from 0: a dispatch shard's) before it applies it.
    """
    path = os.path.join(run_dir, MEMBERSHIP_FILE)
    seen: tuple[int, int] | None = None
    while True:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        stamp = None if st is None else (st.st_mtime_ns, st.st_size)
        if stamp is not None and stamp != seen:
            seen = stamp
            try:
                with open(path, "rb") as f:
                    membership = msgspec.json.decode(f.read(), type=Membership)
            except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
                log.error("membership.json cannot be read", path=path, error=str(exc))
            else:
                if view is not None:
                    membership = view(membership)
                for line in await dispatcher.apply(membership):
                    log.warning("membership changed", change=line)
        await asyncio.sleep(MEMBERSHIP_POLL_S)


def _inbox(spec: ProcessSpec, stop: asyncio.Event) -> Server:
    """The driver's inbox (heartbeats, ``status``, STOP sets ``stop``). Its ZeroMQ context is
    sized first, three sockets for each replica the driver calls: libzmq sizes a context when
    its first socket is made, and by default holds 1,023 (341 replicas)."""
    reserve_connections(spec.groups, f"the driver (pid {os.getpid()})")
    options = ChannelOptions(
        run=spec.run, heartbeat_interval_s=spec.heartbeat_interval_s, liveness=spec.liveness
    )
    return Server(
        spec.endpoint,
        name="driver",
        incarnation=spec.incarnation,
        options=options,
        on_stop=stop.set,
    )


GC_THRESHOLDS = (200_000, 20, 20)
"""The driver's collector thresholds (Python's are 700, 10, 10): a young collection once the
objects alive have grown by 200,000 rather than 700. The samples, tasks and futures of the calls
in flight live a sample's time; at 50,000 a batch of thousands admitted at once set off young
collections that walked and promoted them all, and took a fifth of the loop (docs/scaling.md)."""


def freeze_start_up() -> None:
    """Collect once, move every object alive (modules, classes, the dispatcher and its
    connections) where the cyclic garbage collector no longer walks it (``gc.freeze``), and
    collect young objects less often (``GC_THRESHOLDS``).

    With thousands of samples in flight the collector took a third of the driver's loop; with
    both, about a tenth of that (docs/scaling.md). Cyclic garbage is still collected, up to
    200,000 objects later.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


EPISODE_COUNTERS = (
    "episodes",
    "episode_restarts",
    "episode_replays",
    "env_timeouts",
    "env_errors",
    "infra_failed",
    "quarantined",
    "quarantine_released",
    "quarantine_restarts",
)
"""The sample pipeline's episode counters that ``asyncrl status`` shows (docs/agents.md): the
episodes played, restarted and replayed, the environment's timeouts and errors, the episodes it
failed (``infra_failed``, never trained) and the times a replica was quarantined, let back, and
restarted by its supervisor on the quarantine's request."""


def _status(spec: ProcessSpec, dispatcher: Dispatcher) -> Callable[[Any, Any], dict[str, Any]]:
    """The handler of ``status`` (``asyncrl status``; a plain call, not control): the program,
    this incarnation, the step and version of the last metrics record written (``step`` and
    ``version`` are None before the first), each role group's ``Group.status``, and, for a run
    on multi-turn episodes, the episode counters of that record (``EPISODE_COUNTERS``)."""

    def status(_payload: Any, _call: Any) -> dict[str, Any]:
        last = metrics.latest()
        pipeline = last.get("pipeline") or {}
        return {
            "program": spec.target,
            "incarnation": spec.incarnation,
            "step": last.get("step"),
            "version": last.get("version"),
            "roles": dispatcher.status(),
            **(
                {"episodes": {k: int(pipeline.get(k, 0)) for k in EPISODE_COUNTERS}}
                if "episodes" in pipeline
                else {}
            ),
        }

    return status


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def _finished(run_dir: str) -> bool:
    """Whether ``driver.json`` in ``run_dir`` records a program that finished.

    A driver can be killed after its program finished: its inbox (which answers heartbeats)
    closes before the process exits, and on a loaded machine the exit can take longer than the
    liveness. Its next incarnation keeps that result rather than run the program again, which
    would replay nothing and overwrite the result with an empty one."""
    try:
        with open(os.path.join(run_dir, "driver.json")) as f:
            return bool(json.load(f).get("finished"))
    except (OSError, ValueError, AttributeError):
        return False


async def _record(run_dir: str, **data: Any) -> None:
    """Write ``driver.json`` from a worker thread: the loop stays free for the inbox."""
    path = os.path.join(run_dir, "driver.json")
    await asyncio.to_thread(write_atomic, path, json.dumps(data, indent=2, default=repr).encode())
