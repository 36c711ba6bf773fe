"""The supervisor's own tasks: a bug in one of them fails the run loudly, and nothing outlives it.

The children are tiny Python processes: one that exits at once and one that waits for a signal.
No endpoint is bound, so no child ever serves; the supervisor's heartbeat clients keep trying
until the run ends. Nothing here sleeps: each test waits on ``run()`` itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import msgspec
import pytest
import structlog

from asyncrl.manifest.load import Supervision
from asyncrl.restart_request import RestartAnswer, RestartRequest
from asyncrl.supervision.runreport import ExitInfo
from asyncrl.supervision.supervisor import ChildSpec, Supervisor
from tests.conftest import ROOT

WAIT_S = 30.0  # the bound on a run that should end at once
EXITS_AT_ONCE = "pass"
WAITS_FOR_A_SIGNAL = "import signal; signal.pause()"


def child(
    run_dir: str, name: str, code: str, kind: Any = "command", args: list[str] | None = None
) -> ChildSpec:
    def argv_env(incarnation: int) -> tuple[list[str], dict[str, str]]:
        return [sys.executable, "-c", code, *(args or [])], {}

    policy = Supervision(startup_timeout_s=WAIT_S, shutdown_timeout_s=WAIT_S)
    return ChildSpec(name, 0, kind, f"ipc://{run_dir}/{name}", policy, argv_env)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_fault_in_the_watch_task_fails_the_run_with_that_error(
    run_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the task group, the error was only printed when the task was garbage collected
    ("Task exception was never retrieved"), and ``run()`` waited for ever."""
    fault = RuntimeError("injected fault in the watch task")
    exit_info = Supervisor._exit_info

    def faulty(self: Supervisor, spec: Any, pid: int, code: int) -> ExitInfo:
        if spec.spec.name == "crasher":
            raise fault
        return exit_info(self, spec, pid, code)

    monkeypatch.setattr(Supervisor, "_exit_info", faulty)
    children = [
        child(run_dir, "waiter", WAITS_FOR_A_SIGNAL),
        child(run_dir, "crasher", EXITS_AT_ONCE),
    ]
    supervisor = Supervisor(children, run="sup-test", log_dir=os.path.join(run_dir, "logs"))

    async def main() -> None:
        await asyncio.wait_for(supervisor.run(), WAIT_S)

    with structlog.testing.capture_logs() as logged, pytest.raises(ExceptionGroup) as info:
        asyncio.run(main())

    assert info.value.exceptions == (fault,)
    failures = [e for e in logged if e["event"] == "supervisor task failed"]
    assert [(e["task"], e["error"]) for e in failures] == [
        ("Supervisor._watch", "RuntimeError('injected fault in the watch task')")
    ]
    assert failures[0]["traceback"].endswith("RuntimeError: injected fault in the watch task\n")
    assert "in _watch" in failures[0]["traceback"]
    # The waiter was still running when the fault came: it was stopped before run() raised.
    processes = supervisor.processes()
    assert [(p.label, p.alive) for p in processes] == [("waiter[0]", False), ("crasher[0]", False)]
    assert all(p.pid is not None and gone(p.pid) for p in processes)


def test_a_finished_program_completes_the_run_and_stops_every_process(run_dir: str) -> None:
    children = [
        child(run_dir, "waiter", WAITS_FOR_A_SIGNAL),
        child(run_dir, "driver", EXITS_AT_ONCE, kind="driver"),
    ]
    supervisor = Supervisor(children, run="sup-test", log_dir=os.path.join(run_dir, "logs"))

    async def main() -> None:
        report = await asyncio.wait_for(supervisor.run(), WAIT_S)
        assert (report.status, report.reason) == (
            "completed",
            "the control-flow program finished",
        )
        assert (report.exits, report.restarts, report.served) == (
            [],
            {"waiter": 0, "driver": 0},
            {},
        )

    asyncio.run(main())
    processes = supervisor.processes()
    assert [(p.label, p.incarnation, p.alive) for p in processes] == [
        ("waiter[0]", 0, False),
        ("driver[0]", 0, False),
    ]
    assert all(p.pid is not None and gone(p.pid) for p in processes)


# The driver, once it can take SIGUSR1 (which ends it with 0), opens a FIFO the crasher waits
# on: the crasher fails only when the driver is ready to be ended.
DRIVER = (
    "import signal, sys; signal.signal(signal.SIGUSR1, lambda *_: sys.exit(0)); "
    "open(sys.argv[1], 'w').close(); signal.pause()"
)
CRASHER = "import sys; open(sys.argv[1]).read(); sys.exit(3)"


def test_a_failure_whose_restart_the_end_cuts_short_is_reported_as_restarting(
    run_dir: str,
) -> None:
    """A process fails, and the program finishes during its backoff: the report lists the
    failure, no restart, and the process under ``restarting`` (``asyncrl chaos`` counts it
    apart from a failure never recovered)."""
    fifo = os.path.join(run_dir, "ready")
    os.mkfifo(fifo)
    crasher = child(run_dir, "crasher", CRASHER, args=[fifo])
    crasher.policy = msgspec.structs.replace(
        crasher.policy, backoff_initial_s=WAIT_S, backoff_max_s=WAIT_S
    )
    children = [
        child(run_dir, "waiter", WAITS_FOR_A_SIGNAL),
        crasher,
        child(run_dir, "driver", DRIVER, kind="driver", args=[fifo]),
    ]

    def observe(kind: str, label: str, incarnation: int) -> None:
        if (kind, label) == ("exited", "crasher[0]"):  # it is in its backoff from here on
            (driver,) = [p for p in supervisor.processes() if p.role == "driver"]
            assert driver.pid is not None
            os.kill(driver.pid, signal.SIGUSR1)

    log_dir = os.path.join(run_dir, "logs")
    supervisor = Supervisor(children, run="sup-test", log_dir=log_dir, observer=observe)

    async def main() -> None:
        report = await asyncio.wait_for(supervisor.run(), WAIT_S)
        assert report.status == "completed"
        assert [(e.role, e.incarnation, e.code) for e in report.exits] == [("crasher", 0, 3)]
        assert report.restarts == {"waiter": 0, "crasher": 0, "driver": 0}
        assert report.restarting == ["crasher[0]"]

    asyncio.run(main())


def test_a_process_that_fails_the_run_is_not_reported_as_restarting(run_dir: str) -> None:
    """A restarted process that dies before it serves, past its budget, ends the run: its
    failure is the run's, not a restart the end cut short."""
    crasher = child(run_dir, "crasher", "import sys; sys.exit(3)")
    crasher.policy = msgspec.structs.replace(
        crasher.policy, max_restarts=1, backoff_initial_s=0.0, backoff_max_s=0.0
    )
    children = [crasher, child(run_dir, "driver", WAITS_FOR_A_SIGNAL, kind="driver")]
    supervisor = Supervisor(children, run="sup-test", log_dir=os.path.join(run_dir, "logs"))

    async def main() -> None:
        report = await asyncio.wait_for(supervisor.run(), WAIT_S)
        assert report.status == "failed" and report.failure is not None
        assert (report.failure.role, report.failure.incarnation) == ("crasher", 1)
        assert [(e.role, e.incarnation) for e in report.exits] == [("crasher", 0), ("crasher", 1)]
        assert report.restarting == []

    asyncio.run(main())


FAULTY_AGENT = """
import sys

from asyncrl import cli
from asyncrl.supervision.supervisor import Supervisor

exit_info = Supervisor._exit_info


def faulty(self, spec, pid, code):
    if spec.spec.name == "crasher":
        raise RuntimeError("injected fault in the watch task")
    return exit_info(self, spec, pid, code)


Supervisor._exit_info = faulty
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_asyncrl_run_reports_a_fault_in_the_supervisor_and_exits_non_zero(run_dir: str) -> None:
    """``asyncrl run`` with the fault of the first test injected: the run still ends with a
    report (status failed, the error named) and exit status 1, not a bare traceback."""
    manifest = os.path.join(run_dir, "manifest.yaml")
    run = os.path.join(run_dir, "run")
    with open(manifest, "w") as f:
        f.write(
            textwrap.dedent(
                f"""\
                run:
                  name: sup-fault
                  program: tests.integration.pipeline:wait_forever
                roles:
                  sleeper:
                    class: tests.integration.pipeline:Sleeper
                  crasher:
                    command: [{json.dumps(sys.executable)}, -c, pass]
                """
            )
        )
    out = subprocess.run(
        [sys.executable, "-c", FAULTY_AGENT, "run", manifest, "--run-dir", run],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    reason = (
        "the supervisor itself failed (RuntimeError: injected fault in the watch task); every "
        "process was stopped. This is a bug of asyncrl, not of the run: the traceback is in "
        f"{run}/logs/agent.jsonl ('supervisor task failed'); please report it with that "
        "traceback"
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"run failed: {reason}\n" in out.stdout
    assert "Traceback" not in out.stderr
    with open(os.path.join(run, "report.json")) as f:
        report = json.load(f)
    assert (report["status"], report["reason"]) == ("failed", reason)
    with open(os.path.join(run, "logs", "agent.jsonl")) as f:
        events = [json.loads(line) for line in f]
    (failure,) = [e for e in events if e["event"] == "supervisor task failed"]
    assert failure["traceback"].endswith("RuntimeError: injected fault in the watch task\n")


def test_a_restart_asked_for_starts_a_fresh_process_outside_the_budget_and_says_why(
    run_dir: str,
) -> None:
    """``Supervisor.restart``: the replica's process is replaced at once, its reason logged and
    shown in its status row; three requested restarts with a budget of one crash do not fail
    the run. A request for a replica it does not run, for an incarnation gone already, for the
    driver, or while a restart is under way is refused, saying why."""
    children = [
        child(run_dir, "env", WAITS_FOR_A_SIGNAL),
        child(run_dir, "driver", WAITS_FOR_A_SIGNAL, kind="driver"),
    ]
    children[0].policy = Supervision(
        startup_timeout_s=WAIT_S, shutdown_timeout_s=WAIT_S, max_restarts=1
    )
    started: dict[int, asyncio.Event] = {}

    def observe(event: str, label: str, incarnation: int) -> None:
        if event == "started" and label == "env[0]":
            started.setdefault(incarnation, asyncio.Event()).set()

    supervisor = Supervisor(
        children, run="sup-test", log_dir=os.path.join(run_dir, "logs"), observer=observe
    )
    reason = "quarantined: it failed 20 of its last 20 steps (1 quarantine in a row)"

    async def until_started(incarnation: int) -> None:
        event = started.setdefault(incarnation, asyncio.Event())
        await asyncio.wait_for(event.wait(), WAIT_S)

    async def main() -> None:
        running = asyncio.create_task(supervisor.run())
        await until_started(0)
        first = supervisor.processes()[0].pid
        assert first is not None
        answer = supervisor.restart(RestartRequest(role="env", replica=0, reason=reason))
        assert answer == RestartAnswer(restarted=True, incarnation=0, pid=first)
        again = supervisor.restart(RestartRequest(role="env", replica=0, reason=reason))
        assert (again.restarted, again.why) == (False, "env[0] is restarting already")
        await until_started(1)
        now = supervisor.processes()[0]
        assert (now.incarnation, now.alive) == (1, True) and now.pid != first and gone(first)
        stale = supervisor.restart(
            RestartRequest(role="env", replica=0, reason=reason, incarnation=0)
        )
        assert (stale.restarted, stale.incarnation, stale.why) == (
            False,
            1,
            "incarnation 0 is gone already; incarnation 1 runs now",
        )
        for incarnation in (1, 2):  # past its budget of one restart: requested ones are apart
            request = RestartRequest(role="env", replica=0, reason=reason, incarnation=incarnation)
            assert supervisor.restart(request).restarted
            await until_started(incarnation + 1)
        row = supervisor.status()[0]
        assert (row["incarnation"], row["restarts"], row["restart_requests"]) == (3, 3, 3)
        assert row["restart_reason"] == reason
        unknown = supervisor.restart(RestartRequest(role="env", replica=4, reason=reason))
        assert unknown == RestartAnswer(
            restarted=False, found=False, why="env[4] is not supervised on this node"
        )
        driver = supervisor.restart(RestartRequest(role="driver", replica=0, reason=reason))
        assert driver.why == "the driver is not restarted on request; it restarts when it crashes"
        blank = supervisor.restart(RestartRequest(role="env", replica=0, reason=" "))
        assert blank.why == (
            "a bad restart request: reason: expected why the replica should restart, got ''"
        )
        assert not running.done()  # the run goes on
        supervisor.stop("test over")
        report = await asyncio.wait_for(running, WAIT_S)
        assert (report.status, report.exits, report.restarts["env"]) == ("interrupted", [], 3)

    with structlog.testing.capture_logs() as logged:
        asyncio.run(main())
    asked = [e for e in logged if e["event"] == "restart requested"]
    made = [e for e in logged if e["event"] == "restarting on request"]
    assert [(e["reason"], e["incarnation"]) for e in asked] == [
        (reason, 0),
        (reason, 1),
        (reason, 2),
    ]
    assert [(e["reason"], e["restart_requests"], e["exit"]) for e in made] == [
        (reason, 1, "killed by SIGKILL"),
        (reason, 2, "killed by SIGKILL"),
        (reason, 3, "killed by SIGKILL"),
    ]


def test_a_group_restart_waits_for_a_start_under_way_and_leaves_one_process(
    run_dir: str,
) -> None:
    """``restart_role`` (a data-parallel group going on at a smaller size) arrives while a
    failure's restart is starting the replica's next incarnation (its old process dead, the new
    one not yet there): it waits for that start, kills what it started (made for the group as
    it was) and starts the replica once more. One process runs the replica at the end, none is
    left behind; without the wait, both restarts started a process and the first ran on,
    unwatched."""

    def argv_env(incarnation: int) -> tuple[list[str], dict[str, str]]:
        code = "import sys; sys.exit(3)" if incarnation == 0 else WAITS_FOR_A_SIGNAL
        return [sys.executable, "-c", code], {}

    policy = Supervision(startup_timeout_s=WAIT_S, shutdown_timeout_s=WAIT_S, backoff_initial_s=0)
    spec = ChildSpec("learner", 0, "command", f"ipc://{run_dir}/learner", policy, argv_env)
    supervisor = Supervisor([spec], run="sup-test", log_dir=os.path.join(run_dir, "logs"))
    start = supervisor.launcher.start
    starting, go = asyncio.Event(), asyncio.Event()
    pids: dict[int, int] = {}

    async def held_start(*args: Any) -> Any:
        incarnation = args[-1]
        if incarnation == 1:  # the failure's restart, held while the group restart arrives
            starting.set()
            await go.wait()
        proc = await start(*args)
        pids[incarnation] = proc.pid
        return proc

    supervisor.launcher.start = held_start  # type: ignore[method-assign]

    async def main() -> None:
        running = asyncio.create_task(supervisor.run())
        await asyncio.wait_for(starting.wait(), WAIT_S)
        group = asyncio.create_task(supervisor.restart_role("learner", "its group went on"))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not group.done()  # it waits for the start under way
        go.set()
        assert await asyncio.wait_for(group, WAIT_S) == ["learner[0]"]
        (now,) = supervisor.processes()
        assert (now.incarnation, now.alive, now.pid) == (2, True, pids[2])
        assert sorted(pids) == [0, 1, 2]
        assert gone(pids[1])  # killed, and reaped before the group restart went on
        supervisor.stop("test over")
        await asyncio.wait_for(running, WAIT_S)

    asyncio.run(main())
    assert all(gone(pid) for pid in pids.values())


def test_a_group_failure_held_for_a_silent_node_restarts_once_at_the_smaller_size(
    run_dir: str,
) -> None:
    """A ``one_for_all`` replica fails (its collective broke with a rank on a node gone
    silent) beside a launch (``hold_group``): its restart waits, and the group restart that the
    node's loss brings (``restart_role``) starts it once, outside its budget (here none: a
    failure restart would fail the run) and without a second restart."""

    def argv_env(incarnation: int) -> tuple[list[str], dict[str, str]]:
        code = "import sys; sys.exit(3)" if incarnation == 0 else WAITS_FOR_A_SIGNAL
        return [sys.executable, "-c", code], {}

    policy = Supervision(
        strategy="one_for_all",
        max_restarts=0,
        startup_timeout_s=WAIT_S,
        shutdown_timeout_s=WAIT_S,
        backoff_initial_s=0,
    )
    spec = ChildSpec("learner", 0, "command", f"ipc://{run_dir}/learner", policy, argv_env)
    started: list[int] = []
    again = asyncio.Event()

    def observe(what: str, label: str, incarnation: int) -> None:
        if what == "started":
            started.append(incarnation)
            if incarnation == 1:
                again.set()

    supervisor = Supervisor(
        [spec], run="sup-test", log_dir=os.path.join(run_dir, "logs"), observer=observe
    )
    held: list[tuple[str, float]] = []
    holding = asyncio.Event()

    async def silent_node(name: str, failed: float) -> None:
        held.append((name, failed))
        holding.set()
        await asyncio.Event().wait()  # the node stays silent: only the loss ends the hold

    supervisor.hold_group = silent_node

    async def main() -> None:
        running = asyncio.create_task(supervisor.run())
        await asyncio.wait_for(holding.wait(), WAIT_S)
        (failed,) = supervisor.processes()
        assert (failed.incarnation, failed.alive) == (0, False)  # held, not restarted
        restarted = await supervisor.restart_role("learner", "its group went on")
        assert restarted == ["learner[0]"]
        await asyncio.wait_for(again.wait(), WAIT_S)
        (now,) = supervisor.processes()
        assert (now.incarnation, now.alive) == (1, True)
        assert [s["restarts"] for s in supervisor.status()] == [1]
        assert not running.done()  # no budget spent: a failure restart would end the run
        supervisor.stop("test over")
        report = await asyncio.wait_for(running, WAIT_S)
        assert (report.status, report.restarts) == ("interrupted", {"learner": 1})

    asyncio.run(main())
    assert [name for name, _ in held] == ["learner"]
    assert started == [0, 1]


def test_a_crash_or_a_hang_before_a_requested_restart_stops_the_process_is_a_failure(
    run_dir: str,
) -> None:
    """Only the exit a restart request causes is a requested restart. Here the request's stop
    has not landed yet when incarnation 0 is killed by another hand (SIGTERM: a crash) and,
    after its restart, incarnation 1 is killed as hung: each is a failure, logged and
    reported, and the second is past the budget of one restart, so the run fails."""
    children = [child(run_dir, "env", WAITS_FOR_A_SIGNAL)]
    children[0].policy = Supervision(
        startup_timeout_s=WAIT_S, shutdown_timeout_s=WAIT_S, max_restarts=1
    )
    started: dict[int, asyncio.Event] = {}

    def observe(event: str, label: str, incarnation: int) -> None:
        if event == "started":
            started.setdefault(incarnation, asyncio.Event()).set()

    supervisor = Supervisor(
        children, run="sup-test", log_dir=os.path.join(run_dir, "logs"), observer=observe
    )

    async def not_stopped_yet(_child: Any, _proc: Any) -> None:
        """The request's STOP (and its SIGKILL) that has not landed when the process ends."""

    supervisor._stop_to_restart = not_stopped_yet  # type: ignore[method-assign]
    reason = "quarantined: it failed its probe (2 quarantines in a row)"

    async def main() -> Any:
        running = asyncio.create_task(supervisor.run())
        await asyncio.wait_for(started.setdefault(0, asyncio.Event()).wait(), WAIT_S)
        first = supervisor.processes()[0].pid
        assert first is not None
        assert supervisor.restart(RestartRequest(role="env", replica=0, reason=reason)).restarted
        os.kill(first, signal.SIGTERM)
        await asyncio.wait_for(started.setdefault(1, asyncio.Event()).wait(), WAIT_S)
        second = supervisor.processes()[0].pid
        assert second is not None and second != first
        request = RestartRequest(role="env", replica=0, reason=reason, incarnation=1)
        assert supervisor.restart(request).restarted
        watched = supervisor._children[0]
        watched.hung = "missed heartbeats"  # as the liveness watch kills a hung process
        supervisor._kill(watched, signal.SIGKILL)
        return await asyncio.wait_for(running, WAIT_S)

    with structlog.testing.capture_logs() as logged:
        report = asyncio.run(main())
    assert report.status == "failed"
    assert report.reason == "env[0] failed 2 times within 60 s, past its budget of 1 restarts"
    assert [(e.incarnation, e.signal, e.reason) for e in report.exits] == [
        (0, "SIGTERM", "killed by SIGTERM"),
        (1, "SIGKILL", "hung (missed heartbeats) and was killed"),
    ]
    failed = [(e["incarnation"], e["reason"]) for e in logged if e["event"] == "process failed"]
    assert failed == [(0, "killed by SIGTERM"), (1, "hung (missed heartbeats) and was killed")]
    assert not [e for e in logged if e["event"] == "restarting on request"]
