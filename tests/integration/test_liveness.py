"""Liveness with real processes: a busy process is warned about and kept, a frozen one killed.

The supervisor reads each process's liveness file, written by a heartbeat thread of its own
(``asyncrl.supervision.liveness``), so a role whose event loop is blocked goes on beating.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from tests.integration.test_runtime import FAST, Run, _yaml, start_run, write_manifest

pytestmark = pytest.mark.slow


def _events(run_dir: str, process: str, event: str) -> list[dict]:  # type: ignore[type-arg]
    with open(os.path.join(run_dir, "logs", f"{process}.jsonl")) as f:
        return [e for e in map(json.loads, f) if e.get("event") == event]


def test_a_loop_blocked_for_10_s_is_warned_about_with_its_stack_and_not_killed(
    run_dir: str, runs: list[Run]
) -> None:
    # The default liveness thresholds: a warning after 5 s, a kill after 300 s.
    manifest = write_manifest(
        run_dir,
        f"""\
        run:
          name: busy
          program: tests.integration.pipeline:block_then_finish
        roles:
          sleeper:
            class: tests.integration.pipeline:Sleeper
            supervision: {_yaml(FAST)}
        """,
    )
    run = start_run(manifest, run_dir)
    runs.append(run)
    code, out, err = run.finish()
    assert code == 0, out + err
    result = run.json("driver.json")["result"]
    assert result["after_block"] == result["first"], "a busy process was killed"
    report = run.json("report.json")
    assert report["restarts"] == {"sleeper": 0, "driver": 0}
    assert report["exits"] == []
    assert "hung" not in out
    # One warning, from the blocked process itself, with the stack of its loop's thread.
    (warning,) = _events(run_dir, "sleeper.0", "event loop blocked")
    assert warning["level"] == "warning"
    assert warning["warn_after_s"] == 5.0
    assert 5.0 <= warning["blocked_s"] < 10.0
    assert warning["site"].endswith("in block_loop")
    assert "tests/integration/pipeline.py" in warning["site"]
    assert "time.sleep(seconds)" in warning["stack"]
    assert "in handle" in warning["stack"]  # the process wrapper's call of the endpoint
    assert warning["pid"] == result["first"]


def test_a_driver_slow_to_exit_after_its_program_finished_is_not_killed(
    run_dir: str, runs: list[Run]
) -> None:
    manifest = write_manifest(
        run_dir,
        f"""\
        run:
          name: linger
          program: tests.integration.pipeline:finish_then_linger
        roles:
          sleeper:
            class: tests.integration.pipeline:Sleeper
            supervision: {_yaml(FAST)}
        """,
    )
    run = start_run(manifest, run_dir)
    runs.append(run)
    code, out, err = run.finish()
    assert code == 0, out + err
    assert run.json("driver.json")["finished"] is True
    report = run.json("report.json")
    assert report["restarts"] == {"sleeper": 0, "driver": 0}
    assert report["exits"] == []
    with open(os.path.join(run_dir, "logs", "agent.jsonl")) as f:
        events = [e["event"] for e in map(json.loads, f) if e.get("process") == "driver[0]"]
    assert events[-1] == "program finished", events
    assert not [e for e in events if e.startswith("hung") or e == "process failed"], events


def test_a_replica_not_ready_at_its_start_up_deadline_is_killed_though_it_answers(
    run_dir: str, runs: list[Run]
) -> None:
    manifest = write_manifest(
        run_dir,
        """\
        run:
          name: slowstart
          program: tests.integration.pipeline:wait_forever
        roles:
          sleeper:
            class: tests.integration.pipeline:SlowSetup
            env: {SETUP_S: "3600"}
            supervision: {startup_timeout_s: 4, max_restarts: 0}
        """,
    )
    run = start_run(manifest, run_dir)
    runs.append(run)
    code, out, err = run.finish()
    assert code == 1, out + err
    report = run.json("report.json")
    assert report["status"] == "failed"
    assert report["failure"]["reason"] == "hung (not ready within startup_timeout_s) and was killed"
    assert report["failure"]["signal"] == "SIGKILL"
    # Its inbox answered the supervisor before the deadline: ready is what was missing.
    heard = [e["process"] for e in _events(run_dir, "agent", "serving")]
    assert "sleeper[0]" in heard, heard


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    started: list[Run] = []
    yield started
    for run in started:
        if run.proc.poll() is None:
            run.proc.kill()
        run.proc.communicate()
