"""The runtime end to end: ``asyncrl run`` with real processes over real sockets."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

FAST = {"backoff_initial_s": 0.05, "backoff_max_s": 0.5, "max_restarts": 10}


def _yaml(value: object, indent: int = 0) -> str:
    return (
        json.dumps(value)
        if not isinstance(value, dict)
        else "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    )


def write_manifest(run_dir: str, text: str) -> str:
    path = os.path.join(run_dir, "manifest.yaml")
    with open(path, "w") as f:
        f.write(textwrap.dedent(text))
    return path


@dataclass
class Run:
    proc: subprocess.Popen[str]
    run_dir: str
    lines: list[str]

    def wait_for(self, *needles: str) -> str:
        """Read the agent's console until a line holds every needle; return that line."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if all(n in line for n in needles):
                return line
        raise AssertionError(f"the run ended before a line with {needles}:\n{''.join(self.lines)}")

    def wait_for_each(self, *needle_sets: tuple[str, ...]) -> list[str]:
        """Read until every needle set has matched a line, in whatever order; return those lines."""
        assert self.proc.stdout is not None
        found: dict[int, str] = {}
        for line in self.proc.stdout:
            self.lines.append(line)
            for i, needles in enumerate(needle_sets):
                if i not in found and all(n in line for n in needles):
                    found[i] = line
                    break
            if len(found) == len(needle_sets):
                return [found[i] for i in range(len(needle_sets))]
        missing = [n for i, n in enumerate(needle_sets) if i not in found]
        raise AssertionError(f"the run ended before lines with {missing}:\n{''.join(self.lines)}")

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, "".join(self.lines) + out, err

    def json(self, name: str) -> dict:  # type: ignore[type-arg]
        with open(os.path.join(self.run_dir, name)) as f:
            return json.load(f)  # type: ignore[no-any-return]

    def pids(self) -> set[int]:
        """Every pid the supervisor started, from its JSON log."""
        pids = set()
        with open(os.path.join(self.run_dir, "logs", "agent.jsonl")) as f:
            for line in f:
                event = json.loads(line)
                if event.get("event") == "started" and "process" in event:
                    pids.add(int(event["pid"]))
        return pids


def start_run(manifest: str, run_dir: str, *args: str, env: dict[str, str] | None = None) -> Run:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "run",
            manifest,
            "--run-dir",
            run_dir,
            "--allow-nonempty",
            *args,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    return Run(proc, run_dir, [])


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    started: list[Run] = []
    yield started
    for run in started:
        if run.proc.poll() is None:
            run.proc.kill()
        run.proc.communicate()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes: it only waits for its parent to reap it.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _kill_before_reply(method: str, *, every: int, incarnations: int) -> str:
    plan = {"method": method, "every": every, "incarnations": incarnations}
    return json.dumps({"kill_before_reply": plan})


PIPELINE = """\
run:
  name: pipe
  program: tests.integration.pipeline:pipeline
roles:
  square:
    class: tests.integration.pipeline:Square
    replicas: 2
    capacity: 4
    env:
      ASYNCRL_FAULTS: '{square_faults}'
    supervision: {fast}
  offset:
    class: tests.integration.pipeline:Offset
    config: {{offset: 1}}
    env:
      ASYNCRL_FAULTS: '{offset_faults}'
    supervision: {fast}
  sink:
    class: tests.integration.pipeline:Sink
    env:
      ASYNCRL_FAULTS: '{sink_faults}'
    supervision: {fast}
"""


def test_exactly_once_effect_under_kills(run_dir: str, runs: list[Run]) -> None:
    """Replicas die after doing the work and before replying; every id is counted once."""
    manifest = write_manifest(
        run_dir,
        PIPELINE.format(
            fast=_yaml(FAST),
            square_faults=_kill_before_reply("work", every=150, incarnations=3),
            offset_faults=_kill_before_reply("work", every=300, incarnations=2),
            sink_faults=_kill_before_reply("record", every=400, incarnations=2),
        ),
    )
    run = start_run(manifest, run_dir)
    runs.append(run)
    code, out, err = run.finish()
    assert code == 0, out + err
    with open(os.path.join(run_dir, "roles", "sink.0", "ledger.jsonl")) as f:
        ids = [json.loads(line) for line in f]
    assert len(ids) == 1000
    assert sorted(ids) == list(range(1000))
    driver = run.json("driver.json")
    assert driver["finished"] is True
    assert driver["result"]["wrong"] == []
    assert driver["result"]["sink"]["ids"] == 1000
    retries = sum(g.get("retries", 0) for g in driver["dispatch"].values())
    assert retries >= 1, "no re-execution was observed"
    report = run.json("report.json")
    assert report["status"] == "completed"
    assert report["restarts"]["square"] >= 3
    assert report["restarts"]["offset"] >= 1
    assert report["restarts"]["sink"] >= 1
    assert "square: 2 replica(s), restarts" in out
    assert all(not _alive(pid) for pid in run.pids())


def test_a_role_that_crashes_at_every_start_ends_the_run(run_dir: str, runs: list[Run]) -> None:
    manifest = write_manifest(
        run_dir,
        """\
        run:
          name: crash
          program: tests.integration.pipeline:wait_forever
        roles:
          sleeper:
            class: tests.integration.pipeline:Sleeper
          broken:
            class: tests.integration.pipeline:CrashAtStart
            supervision: {max_restarts: 2, backoff_initial_s: 0.01, period_s: 60}
        """,
    )
    run = start_run(manifest, run_dir)
    runs.append(run)
    code, out, _ = run.finish()
    assert code == 1
    assert "run failed: broken[0] failed 3 times within 60 s, past its budget of 2 restarts" in out
    assert "failed process: broken[0] incarnation 2" in out
    assert "reason: exited with code 1" in out
    assert "restarts of broken: 2" in out
    assert "| RuntimeError: cannot start: the weights file is missing (on purpose)" in out
    report = run.json("report.json")
    assert report["failure"]["role"] == "broken"
    assert report["failure"]["code"] == 1
    assert all(not _alive(pid) for pid in run.pids())


def test_a_configuration_error_is_not_restarted(run_dir: str, runs: list[Run]) -> None:
    manifest = write_manifest(
        run_dir,
        """\
        run:
          name: badconfig
          program: tests.integration.pipeline:wait_forever
        roles:
          sleeper:
            class: tests.integration.pipeline:Sleeper
          offset:
            class: tests.integration.pipeline:Offset
            config: {offset: "not a number"}
        """,
    )
    run = start_run(manifest, run_dir)
    runs.append(run)
    code, out, _ = run.finish()
    assert code == 1
    assert "run failed: offset[0] has a configuration error" in out
    assert (
        "| configuration error: roles.offset.config: Expected `int`, got `str` - at `$.offset`"
        in out
    )
    assert "restarts of offset: 0" in out


def test_hangs_are_detected_and_long_compute_is_not(run_dir: str, runs: list[Run]) -> None:
    manifest = write_manifest(
        run_dir,
        f"""\
        run:
          name: hangs
          program: tests.integration.pipeline:hang_then_finish
        roles:
          sleeper:
            class: tests.integration.pipeline:Sleeper
            supervision:
              {{heartbeat_interval_s: 0.2, liveness: 3, hang_after_s: 2, warn_after_s: 1,
                {_yaml(FAST)[1:-1]}}}
        """,
    )
    run = start_run(manifest, run_dir)
    runs.append(run)
    code, out, err = run.finish()
    assert code == 0, out + err
    result = run.json("driver.json")["result"]
    assert result["first"] == result["after_compute"], "a busy worker thread was taken as a hang"
    # The once call fails with the connection (or, first, the peer's silence): either way the
    # caller learns that its replica broke, and nothing retries it.
    assert result["blocked"] in ("DisconnectedError", "PeerDeadError"), result["blocked"]
    assert result["after_block"] != result["first"]
    report = run.json("report.json")
    assert report["restarts"]["sleeper"] == 1
    assert (
        report["exits"][0]["reason"] == "hung (event loop blocked past hang_after_s) and was killed"
    )
    assert "hung: blocked" in out and "past hang_after_s (2 s)" in out


def test_a_stopped_process_is_killed_and_restarted(run_dir: str, runs: list[Run]) -> None:
    manifest = write_manifest(
        run_dir,
        f"""\
        run:
          name: sigstop
          program: tests.integration.pipeline:wait_forever
        roles:
          sleeper:
            class: tests.integration.pipeline:Sleeper
            supervision: {{heartbeat_interval_s: 0.2, liveness: 3, {_yaml(FAST)[1:-1]}}}
        """,
    )
    run = start_run(manifest, run_dir)
    runs.append(run)
    line = run.wait_for("serving", "role=sleeper")
    pid = int(line.split("pid=")[1].split()[0])
    # Once the supervisor has heard the replica, a stop is a hang, not a slow start.
    run.wait_for("serving", "[asyncrl.supervision.supervisor]", "process=sleeper[0]")
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    line = run.wait_for("hung: frozen", "process=sleeper[0]")
    # Killed within its deadline (liveness x interval: 0.6 s), give or take the supervisor's
    # check every interval and a loaded machine's scheduling.
    assert time.monotonic() - stopped < 10, line
    assert "over liveness x heartbeat_interval_s (0.6 s): it is stopped or deadlocked" in line
    run.wait_for(
        "serving", "[asyncrl.supervision.supervisor]", "process=sleeper[0]", "incarnation=1"
    )
    assert not _alive(pid)
    run.proc.send_signal(signal.SIGINT)
    code, out, _ = run.finish()
    assert code == 130, out
    assert "run interrupted: SIGINT received" in out
    assert all(not _alive(p) for p in run.pids())


def test_no_orphans_when_the_agent_is_killed(run_dir: str, runs: list[Run]) -> None:
    manifest = write_manifest(
        run_dir,
        """\
        run:
          name: orphans
          program: tests.integration.pipeline:wait_forever
        roles:
          sleeper:
            class: tests.integration.pipeline:Sleeper
            replicas: 2
        """,
    )
    run = start_run(manifest, run_dir)
    runs.append(run)
    run.wait_for("program started")
    pids = run.pids()
    assert len(pids) == 3
    assert all(_alive(p) for p in pids)
    fds = {pid: os.pidfd_open(pid) for pid in pids}
    run.proc.kill()
    run.proc.wait()
    for pid, fd in fds.items():
        # A pidfd becomes readable when its process exits: wait for that, not for time.
        assert select.select([fd], [], [], 30)[0] == [fd], f"pid {pid} outlived the agent"
        os.close(fd)
    assert not any(_alive(p) for p in pids)


def test_sigterm_stops_every_role_in_order(run_dir: str, runs: list[Run]) -> None:
    manifest = write_manifest(
        run_dir,
        """\
        run:
          name: sigterm
          program: tests.integration.pipeline:wait_forever
        roles:
          sleeper:
            class: tests.integration.pipeline:Sleeper
          sink:
            class: tests.integration.pipeline:Sink
        """,
    )
    run = start_run(manifest, run_dir)
    runs.append(run)
    run.wait_for("program started")
    run.proc.send_signal(signal.SIGTERM)
    code, out, _ = run.finish()
    assert code == 130
    assert "run interrupted: SIGTERM received" in out
    stops = [line for line in out.splitlines() if "[info     ] stopping" in line]
    assert [("role=sink" in s, "role=sleeper" in s) for s in stops] == [
        (True, False),
        (False, True),
    ]
    assert all(not _alive(p) for p in run.pids())


def test_a_bad_manifest_lists_every_problem(run_dir: str) -> None:
    manifest = write_manifest(
        run_dir,
        """\
        run:
          name: bad
        roles:
          rollout:
            class: tests.integration.pipeline:Square
            replicas: -2
            replcas: 3
        """,
    )
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", manifest],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert "has 3 problems" in out.stderr
    assert "roles.rollout.replicas: expected an integer >= 1, got -2" in out.stderr
    assert "roles.rollout.replcas: unknown key; did you mean 'replicas'?" in out.stderr
    assert "run.program" in out.stderr


def test_one_for_all_restarts_the_whole_group(run_dir: str, runs: list[Run]) -> None:
    manifest = write_manifest(
        run_dir,
        f"""\
        run:
          name: ofa
          program: tests.integration.pipeline:wait_forever
        roles:
          sleeper:
            class: tests.integration.pipeline:Sleeper
            replicas: 2
            supervision: {{strategy: one_for_all, {_yaml(FAST)[1:-1]}}}
        """,
    )
    run = start_run(manifest, run_dir)
    runs.append(run)
    # The replicas start together; either may be heard first.
    _, line = run.wait_for_each(
        ("serving", "[asyncrl.supervision.supervisor]", "process=sleeper[0]"),
        ("serving", "[asyncrl.supervision.supervisor]", "process=sleeper[1]"),
    )
    with open(os.path.join(run_dir, "logs", "agent.jsonl")) as f:
        started = [json.loads(x) for x in f]
    pid1 = next(
        e["pid"]
        for e in started
        if e.get("process") == "sleeper[1]" and e.get("event") == "started"
    )
    assert "incarnation=0" in line
    os.kill(pid1, signal.SIGKILL)
    run.wait_for("serving", "[asyncrl.supervision.supervisor]", "incarnation=1")
    run.wait_for("serving", "[asyncrl.supervision.supervisor]", "incarnation=1")
    run.proc.send_signal(signal.SIGINT)
    code, _, _ = run.finish()
    assert code == 130
    report = run.json("report.json")
    assert report["restarts"]["sleeper"] == 2  # both replicas, for one failure
    assert [e["replica"] for e in report["exits"]] == [1]
    assert all(not _alive(p) for p in run.pids())


def test_a_standby_takes_over_and_nothing_outlives_the_run(run_dir: str, runs: list[Run]) -> None:
    """supervision.standby: the next incarnation waits, imported; a killed replica is replaced
    by it (no new interpreter), a new standby starts behind it, and the end of the run stops
    the standbys too."""
    manifest = write_manifest(
        run_dir,
        f"""\
        run:
          name: standby
          program: tests.integration.pipeline:wait_forever
        roles:
          sleeper:
            class: tests.integration.pipeline:Sleeper
            supervision: {{standby: true, {_yaml(FAST)[1:-1]}}}
        """,
    )
    run = start_run(manifest, run_dir)
    runs.append(run)
    serving = run.wait_for("serving", "role=sleeper")
    pid = int(serving.split("pid=")[1].split()[0])
    ready = run.wait_for("standby started", "process=sleeper[0]", "incarnation=1")
    standby = int(ready.split("standby_pid=")[1].split()[0])
    os.kill(pid, signal.SIGKILL)
    started = run.wait_for(
        "started", "[asyncrl.supervision.supervisor]", "process=sleeper[0]", "incarnation=1"
    )
    assert "standby=True" in started and f"pid={standby}" in started
    run.wait_for(
        "serving", "[asyncrl.supervision.supervisor]", "process=sleeper[0]", "incarnation=1"
    )
    behind = run.wait_for("standby started", "process=sleeper[0]", "incarnation=2")
    second = int(behind.split("standby_pid=")[1].split()[0])
    assert _alive(standby) and _alive(second)
    run.proc.send_signal(signal.SIGINT)
    code, out, _ = run.finish()
    assert code == 130, out
    assert not _alive(standby) and not _alive(second)
    assert all(not _alive(p) for p in run.pids())


def test_a_restart_is_forked_by_the_zygote_and_nothing_outlives_the_agent(
    run_dir: str, runs: list[Run]
) -> None:
    """Under the default supervision a killed replica comes back forked by the node's zygote
    (its parent), and a SIGKILLed agent takes the zygote and its forks with it."""
    manifest = write_manifest(
        run_dir,
        f"""\
        run:
          name: zygote
          program: tests.integration.pipeline:wait_forever
        roles:
          sleeper:
            class: tests.integration.pipeline:Sleeper
            supervision: {_yaml(FAST)}
        """,
    )
    run = start_run(manifest, run_dir)
    runs.append(run)
    first, ready = run.wait_for_each(
        ("serving", "[asyncrl.supervision.supervisor]", "process=sleeper[0]", "incarnation=0"),
        ("zygote ready",),
    )
    zygote = int(re.findall(r"\bpid=(\d+)", ready)[0])
    [cold] = [int(p) for p in re.findall(r"\bpid=(\d+)", first)]
    os.kill(cold, signal.SIGKILL)
    started = run.wait_for(
        "started", "[asyncrl.supervision.supervisor]", "process=sleeper[0]", "incarnation=1"
    )
    assert "forked=True" in started, started
    [forked] = [int(p) for p in re.findall(r"\bpid=(\d+)", started)]
    with open(f"/proc/{forked}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[1]) == zygote
    run.wait_for(
        "serving", "[asyncrl.supervision.supervisor]", "process=sleeper[0]", "incarnation=1"
    )
    pids = run.pids() | {zygote}
    fds = {pid: os.pidfd_open(pid) for pid in pids if _alive(pid)}
    assert set(fds) >= {forked, zygote}
    run.proc.kill()
    run.proc.wait()
    for pid, fd in fds.items():
        assert select.select([fd], [], [], 30)[0] == [fd], f"pid {pid} outlived the agent"
        os.close(fd)
