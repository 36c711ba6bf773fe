"""The driver process's logic that needs no run around it."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from asyncrl.dispatch.driver import serve_driver
from asyncrl.manifest.spec import ProcessSpec

PROGRAM = "async def main(ctx):\n    raise RuntimeError('the program ran again')\n"


def driver_spec(run_dir: str, incarnation: int) -> ProcessSpec:
    program = os.path.join(run_dir, "program.py")
    with open(program, "w") as f:
        f.write(PROGRAM)
    return ProcessSpec(
        kind="driver",
        name="driver",
        incarnation=incarnation,
        target=f"{program}:main",
        endpoint=f"ipc://{run_dir}/driver.sock",
        run="t",
        run_dir=run_dir,
    )


def test_a_driver_restarted_after_its_program_finished_keeps_the_result(tmp_path: Path) -> None:
    run_dir = str(tmp_path)
    saved = {"finished": True, "result": {"accuracy": 0.9}, "dispatch": {}}
    with open(os.path.join(run_dir, "driver.json"), "w") as f:
        json.dump(saved, f)
    assert asyncio.run(serve_driver(driver_spec(run_dir, incarnation=1))) == 0
    with open(os.path.join(run_dir, "driver.json")) as f:
        assert json.load(f) == saved


def test_a_driver_restarted_before_its_program_finished_runs_it(tmp_path: Path) -> None:
    run_dir = str(tmp_path)
    with open(os.path.join(run_dir, "driver.json"), "w") as f:
        json.dump({"finished": False, "stopped": True}, f)
    assert asyncio.run(serve_driver(driver_spec(run_dir, incarnation=1))) != 0
    with open(os.path.join(run_dir, "driver.json")) as f:
        assert "the program ran again" in json.load(f)["error"]
