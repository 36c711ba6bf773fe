"""A role's process sizes its ZeroMQ context for every replica of the run before its first
socket, as the driver does: libzmq fixes a context's size (1,023 sockets, 341 connections) when
its first socket is made, and a role that calls hundreds of replicas (a dispatch shard owning
them) could otherwise connect to no more than about 330. Where the process's hard limit on open
files is too low for connections to every replica, the process warns as it starts, naming the
limit and the fix, and goes on."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest
import zmq

from asyncrl.role import Role
from asyncrl.transport.sockets import CLIENT_SOCKETS
from tests.conftest import ROOT

REPLICAS = 400
OPENED = 3 * REPLICAS
NEEDED = 2 * (CLIENT_SOCKETS * REPLICAS + 64) + 256  # reserve_sockets: two files a socket, +256


class Connecting(Role):
    """Opens three sockets for every replica of its run's groups in ``setup`` (what a transport
    ``Client`` a replica holds), records how many it opened and why it stopped, then stops its
    process."""

    opened = 0
    refused = ""

    async def setup(self) -> None:
        context = zmq.Context.instance()
        count = 3 * sum(len(group.endpoints) for group in self.ctx.groups.values())
        sockets = []
        try:
            for _ in range(count):
                sockets.append(context.socket(zmq.DEALER))
        except zmq.ZMQError as exc:
            Connecting.refused = exc.strerror
        Connecting.opened = len(sockets)
        for s in sockets:
            s.close(linger=0)
        raise SystemExit(0)


def _script(patch: str = "") -> str:
    return f"""
import asyncio, os, shutil, tempfile
import asyncrl.supervision.process
from asyncrl.manifest.spec import GroupInfo, ProcessSpec
from asyncrl.supervision.process import serve_role
from tests.supervision.test_role_sockets import Connecting
{patch}
print("pid", os.getpid(), flush=True)
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
print("opened", Connecting.opened, Connecting.refused)
"""


def _run(script: str, files: int | None = None) -> subprocess.CompletedProcess[str]:
    def limit() -> None:  # this child's open-files limits, soft and hard, lowered to ``files``
        if files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_a_role_process_can_open_a_connection_to_every_replica_of_its_run() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < NEEDED:
        pytest.skip(f"the hard limit on open files ({hard}) is below the {NEEDED} this needs")
    out = _run(_script())
    assert out.stdout.split("\n")[-2] == f"opened {OPENED} ", out.stdout + out.stderr


def test_the_check_needs_the_process_wrapper_to_size_the_context() -> None:
    """Without the wrapper's sizing, the same sockets are refused: what the test above measures
    is the process wrapper's doing."""
    patch = "asyncrl.supervision.process.reserve_connections = lambda groups, who: None"
    out = _run(_script(patch))
    opened, refused = out.stdout.split("\n")[-2].removeprefix("opened ").split(" ", 1)
    assert 0 < int(opened) < OPENED, out.stdout + out.stderr
    assert refused == "Too many open files", out.stdout + out.stderr


def test_a_hard_limit_too_low_for_the_connections_is_warned_of_and_the_process_goes_on() -> None:
    """A hard limit of 1,024 open files is too low for connections to 400 replicas: the process
    says so as it starts, naming itself, the limit and the fix, and serves (a process that
    connects to a few of the replicas never meets the limit); one that connects to them all is
    refused by libzmq once past what the limit allows."""
    out = _run(_script(), files=1024)
    pid = out.stdout.split("\n")[0].removeprefix("pid ")
    assert (
        f"roles.connecting replica 0 (pid {pid}) may connect to 400 replicas, which needs about "
        f"{NEEDED} open files, but the process's hard limit on open files is 1024: past about "
        f"128 connections it fails with `Too many open files`. Raise it (`ulimit -Hn {NEEDED}` "
        "as root before the run starts, or LimitNOFILE in its systemd unit), or run fewer "
        "replicas per process (more dispatch shards, pipeline.shards, each owning fewer rollout "
        "replicas)"
    ) in out.stderr, out.stderr[-3000:]
    opened, refused = out.stdout.split("\n")[-2].removeprefix("opened ").split(" ", 1)
    assert 0 < int(opened) < OPENED, out.stdout + out.stderr
    assert refused == "Too many open files", out.stdout + out.stderr
