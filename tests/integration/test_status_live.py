"""``asyncrl status`` asks a real run while it runs: one machine, and two simulated nodes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.integration.test_multinode import TwoNodes
from tests.integration.test_runtime import Run

pytestmark = pytest.mark.slow

PROGRAM = """\
import asyncio
from asyncrl.observe.metrics import MetricsLog
from examples.hello.roles import Line

async def main(ctx):
    await ctx.roles["splitter"].call("split", Line(1, "A b"))
    async with MetricsLog(ctx.run_dir, done=0, tensorboard=False) as metrics:
        metrics.write({"step": 3, "version": 2})
    ctx.log.info("status test ready")
    await asyncio.Event().wait()
"""

MANIFEST = """\
run:
  name: status
  program: {program}:main
roles:
  splitter:
    class: examples.hello.roles:Splitter
    replicas: 2
    supervision: {{backoff_initial_s: 0.05}}
  counter:
    class: examples.hello.roles:Counter
"""


SERVING = ("splitter[0]", "splitter[1]", "counter[0]", "driver[0]")


def status(run_dir: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.observe.status", run_dir, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def answer(run_dir: str) -> dict[str, Any]:
    out = status(run_dir, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def processes(found: dict[str, Any]) -> list[tuple[int, str, int, int, bool, int]]:
    return [
        (n["node"], p["role"], p["replica"], p["incarnation"], p["serving"], p["restarts"])
        for n in found["nodes"]
        for p in n["processes"]
    ]


def own_calls(found: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per role, the calls its replicas answered by method, as each replica counted them."""
    calls: dict[str, dict[str, int]] = {}
    for node in found["nodes"]:
        for p in node["processes"]:
            if "status" in p:
                per_role = calls.setdefault(p["role"], {})
                for method, n in p["status"]["calls"].items():
                    per_role[method] = per_role.get(method, 0) + n
    return calls


def documented_answer() -> dict[str, Any]:
    """The ``--json`` example of docs/status.md."""
    with open(os.path.join(ROOT, "docs", "status.md")) as f:
        (block,) = re.findall(r"```json\n(.*?)```", f.read(), re.S)
    return json.loads(block)  # type: ignore[no-any-return]


def keys_by_place(answer: dict[str, Any]) -> dict[str, set[str]]:
    """The keys of each kind of object in a status answer, by where it sits."""
    node = answer["nodes"][0]
    rows = {p["kind"]: p for p in node["processes"]}
    driver = node["driver"]
    role = next(iter(driver["roles"].values()))
    return {
        "answer": set(answer),
        "node": set(node),
        "role process": set(rows["role"]),
        "its status": set(rows["role"]["status"]),
        "driver process": set(rows["driver"]),
        "driver": set(driver),
        "driver role": set(role),
        "driver replica": set(role["replicas"][0]),
    }


def test_status_of_a_running_run_a_restart_and_the_end(run_dir: str) -> None:
    program = os.path.join(run_dir, "program.py")
    with open(program, "w") as f:
        f.write(PROGRAM)
    manifest = os.path.join(run_dir, "manifest.yaml")
    with open(manifest, "w") as f:
        f.write(textwrap.dedent(MANIFEST.format(program=program)))
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
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run = Run(proc, run_dir, [])
    try:
        run.wait_for_each(
            ("status test ready",),
            *(("serving", "[asyncrl.supervision.supervisor]", f"process={p}") for p in SERVING),
        )
        found = answer(run_dir)
        assert keys_by_place(found) == keys_by_place(documented_answer())
        assert [p["state"] for p in found["nodes"][0]["processes"]] == ["serving"] * 4
        assert processes(found) == [
            (0, "splitter", 0, 0, True, 0),
            (0, "splitter", 1, 0, True, 0),
            (0, "counter", 0, 0, True, 0),
            (0, "driver", 0, 0, True, 0),
        ]
        driver = found["nodes"][0]["driver"]
        assert (driver["step"], driver["version"], driver["incarnation"]) == (3, 2, 0)
        splitters = driver["roles"]["splitter"]["replicas"]
        assert [(r["credit"], r["inflight"], r["queued"]) for r in splitters] == [(1, 0, 0)] * 2
        assert sum(r["served"] for r in splitters) == 1
        assert driver["roles"]["splitter"]["queued"] == 0
        # Each replica's own count, asked by the agent: the one split, and no call yet to the
        # counter; the driver is no role and is not asked.
        assert own_calls(found) == {"splitter": {"split": 1}, "counter": {}}
        assert "status" not in found["nodes"][0]["processes"][3]
        ages = [p["heartbeat_age_s"] for p in found["nodes"][0]["processes"]]
        assert all(0 <= age < 10 for age in ages), ages
        text = status(run_dir)
        assert text.returncode == 0, text.stderr
        assert "step 3, version 2" in text.stdout
        assert "heartbeat s ago" in text.stdout.splitlines()[2]

        pid = found["nodes"][0]["processes"][1]["pid"]
        os.kill(pid, signal.SIGKILL)
        run.wait_for(
            "serving", "[asyncrl.supervision.supervisor]", "process=splitter[1]", "incarnation=1"
        )
        after = answer(run_dir)
        assert processes(after)[1] == (0, "splitter", 1, 1, True, 1)
        assert after["nodes"][0]["processes"][1]["pid"] != pid
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    ended = status(run_dir)
    assert ended.returncode == 1
    assert ended.stderr == (
        f"no agent answers at ipc://{run_dir}/sockets/agent.sock; the run is not running; "
        f"its last report is {run_dir}/report.json\n"
    )


def test_status_from_node_1_shows_both_nodes_over_curve(tmp_path: Any) -> None:
    from asyncrl.keys import generate

    generate(str(tmp_path / "keys"))
    nodes = TwoNodes(str(tmp_path), extra="security: {curve_keys: keys}\n")
    try:
        nodes.start()
        nodes.wait("the program at its gate", lambda: os.path.exists(nodes.path(0, "progress")))
        nodes.wait(
            "every process serving", lambda: all(p[4] for p in processes(answer(nodes.path(1))))
        )
        for where in (nodes.path(1), nodes.path(0)):
            found = answer(where)
            assert [(n["node"], "error" in n) for n in found["nodes"]] == [(0, False), (1, False)]
            assert processes(found) == [
                (0, "counter", 0, 0, True, 0),
                (0, "driver", 0, 0, True, 0),
                (1, "splitter", 0, 0, True, 0),
                (1, "splitter", 1, 0, True, 0),
            ]
            roles = found["nodes"][0]["driver"]["roles"]
            assert sum(r["served"] for r in roles["splitter"]["replicas"]) == 15
            assert own_calls(found) == {"counter": {"add": 15}, "splitter": {"split": 15}}
        with open(nodes.gate, "w"):
            pass
        assert nodes.finish() == [0, 0], nodes.logs()
    finally:
        nodes.kill()
