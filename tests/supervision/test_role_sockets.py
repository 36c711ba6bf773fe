"""A role's process sizes its ZeroMQ context for every replica of the run before its first
socket, as the driver does: libzmq fixes a context's size (1,023 sockets, 341 connections) when
its first socket is made, and a role that calls hundreds of replicas (a dispatch shard owning
them) could otherwise connect to no more than about 330."""

from __future__ import annotations

import subprocess
import sys

import zmq

from asyncrl.role import Role
from tests.conftest import ROOT

REPLICAS = 400


class Connecting(Role):
    """Opens three sockets for every replica of its run's groups in ``setup`` (what a transport
    ``Client`` a replica holds), then stops its process."""

    opened = 0

    async def setup(self) -> None:
        context = zmq.Context.instance()
        count = 3 * sum(len(group.endpoints) for group in self.ctx.groups.values())
        sockets = [context.socket(zmq.DEALER) for _ in range(count)]
        Connecting.opened = len(sockets)
        for s in sockets:
            s.close(linger=0)
        raise SystemExit(0)


SCRIPT = f"""
import asyncio, shutil, tempfile
from asyncrl.manifest.spec import GroupInfo, ProcessSpec
from asyncrl.supervision.process import serve_role
from tests.supervision.test_role_sockets import Connecting

run_dir = tempfile.mkdtemp(prefix="arl-")
spec = ProcessSpec(
    kind="role",
    name="connecting",
    target="tests.supervision.test_role_sockets:Connecting",
    endpoint=f"ipc://{{run_dir}}/connecting.0",
    run="sockets",
    run_dir=run_dir,
    groups={{"rollout": GroupInfo([f"ipc://{{run_dir}}/r{{i}}" for i in range({REPLICAS})])}},
)
try:
    asyncio.run(serve_role(spec))
except SystemExit:
    pass
finally:
    shutil.rmtree(run_dir, ignore_errors=True)
print("opened", Connecting.opened)
"""


def test_a_role_process_can_open_a_connection_to_every_replica_of_its_run() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["opened", str(3 * REPLICAS)], out.stdout + out.stderr


def test_the_check_needs_a_context_sized_first() -> None:
    """Without the sizing, the same sockets are refused past libzmq's default: what the test
    above measures is the process wrapper's doing."""
    script = (
        "import zmq\nc = zmq.Context.instance()\ns = []\n"
        f"try:\n    for _ in range({3 * REPLICAS}):\n        s.append(c.socket(zmq.DEALER))\n"
        "except zmq.ZMQError as e:\n    print('refused at', len(s), e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("refused at 1023"), out.stdout + out.stderr
