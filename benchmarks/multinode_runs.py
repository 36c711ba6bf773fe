"""Whole runs for ``asyncrl bench multinode``: one manifest on one node against two nodes.

The manifest is ``examples/arith/multinode.yaml`` shortened by ``SHORT`` (a few BC steps, a few
RL steps): the README's main job with its rollouts and a relay on node 1 and two data-parallel
learners, one per node. On one node (``asyncrl run``) ``ONE_NODE`` moves everything to node 0
(the relay then copies nothing: its source shares its host); on two nodes, two torchrun processes
on 127.0.0.1 run ``asyncrl.launch``, node 1 with ``ASYNCRL_HOST_ID=node1`` so it shares
no memory with node 0 and weights cross between them over tcp. Rounds alternate which comes first;
each time is the command's wall time, start-up included, and each run must exit 0.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from asyncrl.transport.shm import HOST_ID_ENV

__all__ = ["MANIFEST", "ONE_NODE", "SHORT", "free_port", "wall_times"]

MANIFEST = os.path.join("examples", "arith", "multinode.yaml")
SHORT = (
    "run.config.bc_min_steps=40",
    "run.config.bc_max_steps=40",
    "run.config.bc_eval_every=40",
    "run.config.rl_steps=6",
    "run.config.rl_eval_every=6",
)
"""Overrides that shorten the main job to 40 BC and 6 RL steps."""
ONE_NODE = (
    "roles.rollout.placement.node=0",
    "roles.relay.placement.node=0",
    "roles.learner.placement.nodes=[0]",
)
"""Overrides that place every replica of the two-node manifest on node 0."""

TIMEOUT_S = 900.0


def free_port() -> int:
    """A tcp port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _sets(overrides: tuple[str, ...]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def _check(code: int | None, what: str, log: str) -> None:
    if code != 0:
        with open(log, errors="replace") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{what} exited with {code}; the end of its output:\n{tail}")


def one_node(root: str, tmp: str) -> float:
    """Seconds for the shortened manifest on one node (``asyncrl run``)."""
    run_dir = os.path.join(tmp, "one")
    log = os.path.join(tmp, "one.log")
    argv = [os.path.join(os.path.dirname(sys.executable), "asyncrl"), "run", MANIFEST]
    argv += ["--run-dir", run_dir, "--overwrite", *_sets(SHORT + ONE_NODE)]
    start = time.perf_counter()
    with open(log, "wb") as out:
        code = subprocess.run(
            argv, cwd=root, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S
        ).returncode
    _check(code, "the one-node run", log)
    return time.perf_counter() - start


def two_nodes(
    root: str, tmp: str, overrides: tuple[str, ...] = SHORT, *, one_host: bool = False
) -> float:
    """Seconds for the manifest with ``overrides`` (the shortened one by default) on two
    simulated nodes (torchrun, 127.0.0.1); the run directory is ``tmp/two``. Node 1 is a host
    of its own (``ASYNCRL_HOST_ID``) unless ``one_host``: then both nodes share this host.

    Raises:
        RuntimeError: a node exited with an error (the end of its log is in the message).
    """
    run_dir = os.path.join(tmp, "two")
    shutil.rmtree(run_dir, ignore_errors=True)
    port = free_port()
    procs, logs = [], []
    start = time.perf_counter()
    for node in (0, 1):
        env = {k: v for k, v in os.environ.items() if k != HOST_ID_ENV}
        env["PYTHONPATH"] = root
        if node == 1 and not one_host:
            env[HOST_ID_ENV] = "node1"
        argv = [
            os.path.join(os.path.dirname(sys.executable), "torchrun"),
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
            *_sets(overrides),
        ]
        logs.append(os.path.join(tmp, f"node{node}.log"))
        with open(logs[-1], "wb") as out:
            procs.append(
                subprocess.Popen(argv, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
            )
    try:
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for node, (code, log) in enumerate(zip(codes, logs, strict=True)):
        _check(code, f"node {node} of the two-node run", log)
    return time.perf_counter() - start


def wall_times(root: str, rounds: int = 1) -> dict[str, float]:
    """Median wall seconds of the shortened manifest on one node and on two, ``rounds`` each,
    alternating which goes first."""
    one: list[float] = []
    two: list[float] = []
    tmp = tempfile.mkdtemp(prefix="arl-mn-")
    try:
        for k in range(rounds):
            order = (one_node, two_nodes) if k % 2 == 0 else (two_nodes, one_node)
            for fn in order:
                (one if fn is one_node else two).append(fn(root, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "one_node_wall_s": statistics.median(one),
        "two_node_wall_s": statistics.median(two),
        "two_node_ratio": statistics.median(two) / statistics.median(one),
        "wall_rounds": rounds,
    }
