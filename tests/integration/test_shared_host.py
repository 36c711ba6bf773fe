"""Two node ranks on one host, without ``ASYNCRL_HOST_ID``: the README's main job over two
nodes (``examples/arith/multinode.yaml``, shortened), both torchrun processes on 127.0.0.1.

Node 1 holds the rollout replicas and a relay; the learner that publishes is on node 0. Both
nodes have the same host id, so the relay copies nothing, and node 1's rollouts must read the
learner's own store: node 1's ``weights`` folder links to node 0's (``asyncrl.hosts``). Before
that, node 1's rollouts never found a handle, held version 0, and the program failed with
``StallError`` after 300 s at its first wait for a new version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from asyncrl.bench.multinode_runs import MANIFEST, SHORT, free_port
from asyncrl.transport.shm import HOST_ID_ENV
from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _launch(run_dir: str, logs: str) -> list[int]:
    """Both node ranks of the shortened manifest, neither with ``ASYNCRL_HOST_ID``; their exit
    codes. Every wait inside the run has its deadline (the program's 300 s for a version)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != HOST_ID_ENV}
    env["PYTHONPATH"] = ROOT
    procs = []
    for node in (0, 1):
        argv = [
            TORCHRUN,
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "-m",
            "asyncrl.launch",
            MANIFEST,
            "--run-dir",
            run_dir,
            *[arg for o in SHORT for arg in ("--set", o)],
        ]
        with open(os.path.join(logs, f"node{node}.log"), "wb") as out:
            procs.append(
                subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
            )
    try:
        return [p.wait(timeout=800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _tail(logs: str) -> str:
    out = []
    for node in (0, 1):
        with open(os.path.join(logs, f"node{node}.log"), errors="replace") as f:
            out.append(f"--- node {node} ---\n{f.read()[-4000:]}")
    return "\n".join(out)


def test_two_node_ranks_on_one_host_share_the_learners_weight_store(tmp_path: object) -> None:
    run_dir = os.path.join(str(tmp_path), "run")
    logs = str(tmp_path)
    assert _launch(run_dir, logs) == [0, 0], _tail(logs)
    # Node 1's folder links to node 0's: one handle, the learner's.
    shared = os.path.join(run_dir, "node-1", "weights")
    assert os.path.islink(shared)
    assert os.path.realpath(shared) == os.path.realpath(os.path.join(run_dir, "weights"))
    assert sorted(os.listdir(shared)) == [".host", "learner.json"]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["nodes"] == 2
    # Every RL step waited until node 1's rollouts held the learner's newest version (or the
    # program would have failed with StallError): they moved past version 0.
    assert summary["learner_steps"] == 46, summary
