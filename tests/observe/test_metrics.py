"""metrics.jsonl, its TensorBoard mirror and the restart count (asyncrl.observe.metrics)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import sys
from typing import Any

import pytest

from asyncrl.observe.metrics import (
    METRICS_FILE,
    TENSORBOARD_DIR,
    MetricsLog,
    Restarts,
    read_metrics,
    scalars,
)


def write_steps(run_dir: str, steps: range, *, done: int, tensorboard: bool = False) -> bool:
    """Write a record per step through a MetricsLog resumed after ``done``; whether it wrote
    TensorBoard."""

    async def main() -> bool:
        async with MetricsLog(run_dir, done=done, tensorboard=tensorboard) as log:
            for step in steps:
                log.write({"step": step, "wall_s": float(step), "reward": {"mean": step / 10}})
            return log.tensorboard

    return asyncio.run(main())


def test_records_are_appended_and_a_resumed_log_drops_later_steps(tmp_path: Any) -> None:
    run_dir = str(tmp_path)
    write_steps(run_dir, range(1, 4), done=0)
    with open(os.path.join(run_dir, METRICS_FILE), "a") as f:
        f.write('{"step": 4, "rew')  # cut short by a crash
    assert [r["step"] for r in read_metrics(os.path.join(run_dir, METRICS_FILE))] == [1, 2, 3]

    async def resume() -> tuple[float, int]:
        async with MetricsLog(run_dir, done=2, tensorboard=False) as log:
            return log.wall_s, log.last_step

    assert asyncio.run(resume()) == (2.0, 2)  # step 3 and the torn line are gone
    write_steps(run_dir, range(3, 5), done=2)
    got = read_metrics(os.path.join(run_dir, METRICS_FILE))
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    write_steps(run_dir, range(1, 2), done=0)  # a new run: afresh
    assert [r["step"] for r in read_metrics(os.path.join(run_dir, METRICS_FILE))] == [1]


def test_numbers_that_are_not_finite_are_written_as_null(tmp_path: Any) -> None:
    async def main() -> None:
        async with MetricsLog(str(tmp_path), done=0, tensorboard=False) as log:
            log.write({"step": 1, "reward": {"mean": math.nan, "p50": math.inf}, "loss": 1.5})

    asyncio.run(main())
    with open(os.path.join(tmp_path, METRICS_FILE)) as f:
        assert json.loads(f.read()) == {
            "step": 1,
            "reward": {"mean": None, "p50": None},
            "loss": 1.5,
        }


def test_scalars_are_the_numbers_by_tag() -> None:
    record = {
        "step": 3,
        "time": 1.7e9,
        "wall_s": 12.5,
        "reward": {"mean": 0.5, "p50": None},
        "learner": {"loss": 2, "skipped": math.nan},
        "recovered": True,
        "mode": "sync",
        "restarts": 1,
    }
    assert scalars(record) == {
        "wall_s": 12.5,
        "reward/mean": 0.5,
        "learner/loss": 2.0,
        "restarts": 1.0,
    }


def test_restarts_are_counted_from_the_lines_appended_since_the_last_look(tmp_path: Any) -> None:
    restarts = Restarts(str(tmp_path))
    assert restarts() == 0  # no log yet
    os.makedirs(tmp_path / "logs")
    path = tmp_path / "logs" / "agent.jsonl"
    line = json.dumps({"event": "restarting", "process": "rollout[0]"}) + "\n"
    other = json.dumps({"event": "started", "process": "rollout[0]"}) + "\n"
    path.write_text(line + other + line[:10])  # the last line is still being written
    assert restarts() == 1
    with open(path, "a") as f:
        f.write(line[10:] + "not json\n" + line)
    assert restarts() == 3
    assert restarts() == 3
    path.write_text(line)  # a new run in the directory: the file shrank
    assert restarts() == 1


def test_tensorboard_gets_every_number_as_a_scalar(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoard (the tensorboard extra) is missing")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = str(tmp_path)
    assert write_steps(run_dir, range(1, 4), done=0, tensorboard=True)
    assert write_steps(run_dir, range(3, 5), done=2, tensorboard=True)  # resumed after step 2
    events = EventAccumulator(os.path.join(run_dir, TENSORBOARD_DIR))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"wall_s", "reward/mean"}
    means = [(e.step, round(e.value, 6)) for e in events.Scalars("reward/mean")]
    assert means == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]  # step 3 once: purged, rewritten


def test_without_tensorboard_one_line_says_how_to_install_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    caplog.set_level(logging.INFO, logger="asyncrl.observe.metrics")
    run_dir = str(tmp_path)
    assert not write_steps(run_dir, range(1, 3), done=0, tensorboard=True)
    assert [r.getMessage() for r in caplog.records] == [
        f"TensorBoard is not installed, so {os.path.join(run_dir, TENSORBOARD_DIR)} is not "
        "written; install it with: pip install 'asyncrl[tensorboard]'"
    ]
    assert not os.path.exists(os.path.join(run_dir, TENSORBOARD_DIR))
    assert [r["step"] for r in read_metrics(os.path.join(run_dir, METRICS_FILE))] == [1, 2]


def test_a_resumed_log_keeps_the_changes_of_membership_and_its_last_step(tmp_path: Any) -> None:
    """A launch's node lost for good is a line of its own, without a step (node 0's agent
    appends it): a resumed loop keeps it, and its last step and wall time are its steps'."""
    run_dir = str(tmp_path)
    write_steps(run_dir, range(1, 4), done=0)
    change = {"time": 5.0, "membership": {"event": "node_lost", "node": 2}}
    with open(os.path.join(run_dir, METRICS_FILE), "a") as f:
        f.write(json.dumps(change) + "\n")

    async def resume() -> tuple[float, int]:
        async with MetricsLog(run_dir, done=3, tensorboard=False) as log:
            return log.wall_s, log.last_step

    assert asyncio.run(resume()) == (3.0, 3)
    got = read_metrics(os.path.join(run_dir, METRICS_FILE))
    assert got[-1] == change and [r.get("step") for r in got] == [1, 2, 3, None]
