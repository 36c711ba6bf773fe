"""An external ``command:`` role on node 1 of a launch with Curve keys: the agent gives it the
run's key folder (``ASYNCRL_CURVE_KEYS``), it serves its tcp endpoint with CurveZMQ, and the
driver on node 0 and its supervisor on node 1 reach it with the run's keys, while a client
without them is refused. Before, it was given no keys: with Curve on, node 0's calls to it were
refused (the mechanisms differ). Node 1 acts as another host (``ASYNCRL_HOST_ID=node1``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from typing import Any

import pytest

from asyncrl.keys import generate
from asyncrl.transport import ChannelOptions, Client, RemoteError, TransportError, load_keys
from asyncrl.transport.control import read_secret
from tests.conftest import ROOT
from tests.helpers.waiting import wait_until
from tests.integration.test_multinode import TORCHRUN, _free_port, _json

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROGRAM = """\
import asyncio, os


async def main(ctx):
    said = await ctx.roles["echo"].call("upper", "hi")
    with open(os.path.join(ctx.run_dir, "progress"), "w") as f:
        f.write(said)
    while not os.path.exists(ctx.config["gate"]):
        await asyncio.sleep(0.05)
    return said
"""

MANIFEST = """\
run:
  name: curvecmd
  program: {program}:main
  config: {{gate: {gate}}}
roles:
  echo:
    command: [{python}, {script}]
    placement: {{node: 1}}
    config: {{suffix: "!"}}
security: {{curve_keys: keys}}
"""


async def _upper(endpoint: str, curve: Any, secret: str | None = None) -> Any:
    client = Client(endpoint, options=ChannelOptions(run="curvecmd"), curve=curve, secret=secret)
    try:
        await client.connect(timeout=5.0)
        return await client.call("upper", "hey", timeout=5.0)
    finally:
        await client.close()


def test_an_external_role_on_node_1_serves_with_the_runs_curve_keys(tmp_path: Any) -> None:
    tmp = str(tmp_path)
    generate(os.path.join(tmp, "keys"))
    program, gate = os.path.join(tmp, "program.py"), os.path.join(tmp, "gate")
    with open(program, "w") as f:
        f.write(PROGRAM)
    manifest = os.path.join(tmp, "manifest.yaml")
    script = os.path.join(ROOT, "examples", "external_role", "echo_role.py")
    with open(manifest, "w") as f:
        f.write(MANIFEST.format(program=program, gate=gate, python=sys.executable, script=script))
    run_dir, port = os.path.join(tmp, "run"), _free_port()
    procs = []
    for node in (0, 1):
        env = {**os.environ, "PYTHONPATH": ROOT}
        if node == 1:
            env["ASYNCRL_HOST_ID"] = "node1"
        with open(os.path.join(tmp, f"node{node}.log"), "wb") as out:
            argv = [TORCHRUN, "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}"]
            argv += ["--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0"]
            argv += [
                "-m",
                "asyncrl.launch",
                manifest,
                "--run-dir",
                run_dir,
                "--join-timeout=60",
            ]
            procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=out))

    def logs() -> str:
        text = []
        for node in (0, 1):
            with open(os.path.join(tmp, f"node{node}.log"), errors="replace") as f:
                text.append(f"--- node {node} ---\n{f.read()[-5000:]}")
        return "\n".join(text)

    try:
        progress = os.path.join(run_dir, "progress")
        wait_until(
            lambda: os.path.exists(progress),
            timeout=120,
            what="the driver's call to echo",
            output=logs,
        )
        with open(progress) as f:
            assert f.read() == "HI!"
        [endpoint] = _json(os.path.join(run_dir, "specs", "driver.0.0.json"))["groups"]["echo"][
            "endpoints"
        ]
        assert endpoint.startswith("tcp://127.0.0.1:")
        # Node 0 made the run's secret; node 1 got the same one, which its external role requires.
        secret = read_secret(os.path.join(run_dir, "secret"))
        assert read_secret(os.path.join(run_dir, "node-1", "secret")) == secret
        keys = load_keys(os.path.join(tmp, "keys"))
        assert asyncio.run(_upper(endpoint, keys, secret)) == "HEY!"
        with pytest.raises(RemoteError, match=r"\[unauthorized\].*presented no secret"):
            asyncio.run(_upper(endpoint, keys))  # the run's keys, but not its secret
        with pytest.raises(TransportError):  # no keys: refused in the ZeroMQ handshake
            asyncio.run(_upper(endpoint, False, secret))
        with open(gate, "w"):
            pass
        codes = [p.wait(120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0], logs()
    assert _json(os.path.join(run_dir, "driver.json"))["result"] == "HI!"
    report = _json(os.path.join(run_dir, "report.json"))
    assert (report["status"], report["restarts"]["echo"]) == ("completed", 0)
