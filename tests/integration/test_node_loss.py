"""A node lost for good, and the run goes on: three torchrun "nodes" on 127.0.0.1.

Each node is its own torchrun with ``--nnodes=3`` and its own ``ASYNCRL_HOST_ID`` (nodes 1 and
2), so no shared memory crosses between them and every call between nodes goes over tcp, as
between machines. Node 2 is lost for good: its torchrun, its agent and every role under it are
SIGKILLed at once. Nodes 0 and 1 go on: node 2's replicas of a role with several leave the
dispatcher, its singleton moves to the next node its ``placement.nodes`` lists and starts there
from its durable state (its home node's folder of the run directory), and the run completes with
nothing lost and nothing counted twice.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.helpers.nodes import lose_node
from tests.helpers.records import complete_lines, records
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

PROGRAM = """\
import asyncio, json, os

from examples.hello.roles import Line, Words

TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "the dog sleeps and the fox runs",
    "a fox is quick and a dog is lazy",
]


async def main(ctx):
    lines = [Line(i, TEXT[i % 3]) for i in range(60)]
    for start in range(0, 60, 6):
        async for _, words in ctx.roles["splitter"].map("split", lines[start:start + 6], Words):
            await ctx.roles["counter"].call("add", words)
        if start + 6 in (18, 42):
            with open(os.path.join(ctx.run_dir, f"progress{start + 6}"), "w") as f:
                f.write(str(ctx.incarnation))
            while not os.path.exists(ctx.config["gate"] + str(start + 6)):
                await asyncio.sleep(0.05)
    top = await ctx.roles["counter"].call("top", 3)
    members = ctx.roles["splitter"].members
    with open(os.path.join(ctx.run_dir, "summary.json"), "w") as f:
        json.dump({"top": top, "splitters": members}, f)
    return top
"""

MANIFEST = """\
run:
  name: nodeloss
  program: {program}:main
  config: {{gate: {gate}}}
roles:
  splitter:
    class: examples.hello.roles:Splitter
    replicas: 3
    placement: {{nodes: [0, 1, 2]}}
    supervision: {{backoff_initial_s: 0.05}}
  counter:
    class: examples.hello.roles:Counter
    placement: {{nodes: [2, 0]}}
"""

EXPECTED = [["the", 80], ["dog", 60], ["fox", 60]]
"""The hello example's top three words, for its three lines sent twenty times each."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


class Nodes:
    """``count`` torchrun processes running ``asyncrl.launch`` on one manifest, node R with
    ``ASYNCRL_HOST_ID=nodeR`` (R > 0)."""

    def __init__(self, tmp: str, count: int, options: tuple[str, ...]) -> None:
        self.tmp, self.count, self.options = tmp, count, options
        self.run_dir = os.path.join(tmp, "run")
        self.gate = os.path.join(tmp, "gate")
        program = os.path.join(tmp, "program.py")
        with open(program, "w") as f:
            f.write(PROGRAM)
        self.manifest = os.path.join(tmp, "manifest.yaml")
        with open(self.manifest, "w") as f:
            f.write(MANIFEST.format(program=program, gate=self.gate))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.port = _free_port()

    def use(self, manifest: str, *options: str) -> None:
        """Launch ``manifest`` (a path from the repository's root) with ``options`` instead."""
        self.manifest = os.path.join(ROOT, manifest)
        self.options = (*self.options, *options)

    def start(self) -> None:
        for node in range(self.count):
            self.procs.append(self._torchrun(node, f"node{node}.log"))

    def restart(self, node: int) -> None:
        """Start node ``node``'s torchrun again (it was lost), logging to ``nodeR-back.log``."""
        self.procs[node] = self._torchrun(node, f"node{node}-back.log")

    def _torchrun(self, node: int, log: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": ROOT}
        if node:
            env["ASYNCRL_HOST_ID"] = f"node{node}"
        with open(os.path.join(self.tmp, log), "wb") as out:
            return subprocess.Popen(
                [
                    TORCHRUN,
                    f"--nnodes={self.count}",
                    "--nproc-per-node=1",
                    f"--node-rank={node}",
                    "--master-addr=127.0.0.1",
                    f"--master-port={self.port}",
                    "--max-restarts=0",
                    "--monitor-interval=0.1",
                    "-m",
                    "asyncrl.launch",
                    self.manifest,
                    "--run-dir",
                    self.run_dir,
                    *self.options,
                ],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def logs(self) -> str:
        text = []
        for log in sorted(os.listdir(self.tmp)):
            if log.startswith("node") and log.endswith(".log"):
                with open(os.path.join(self.tmp, log), errors="replace") as f:
                    text.append(f"--- {log} ---\n" + f.read()[-5000:])
        return "\n".join(text)

    def tracebacks(self) -> list[str]:
        """The node logs (each whole: torchrun's own output included) that hold a traceback."""
        found = []
        for log in sorted(os.listdir(self.tmp)):
            if log.startswith("node") and log.endswith(".log"):
                with open(os.path.join(self.tmp, log), errors="replace") as f:
                    if "Traceback" in f.read():
                        found.append(log)
        return found

    def path(self, node: int, *parts: str) -> str:
        base = self.run_dir if node == 0 else os.path.join(self.run_dir, f"node-{node}")
        return os.path.join(base, *parts)

    def wait(self, what: str, ready: Callable[[], object], timeout: float = 120.0) -> None:
        wait_until(ready, timeout=timeout, what=what, output=self.logs)

    def lose(self, node: int) -> None:
        """SIGKILL node ``node``'s torchrun, its agent and every process of its roles at once."""
        lose_node(self.procs[node], self.path(node))

    def finish(self, nodes: list[int], timeout: float = 180.0) -> list[int]:
        codes = []
        for node in nodes:
            try:
                codes.append(self.procs[node].wait(timeout))
            except subprocess.TimeoutExpired:
                pytest.fail(f"node {node} did not end within {timeout:g} s\n{self.logs()}")
        return codes

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def nodes(tmp_path: Any) -> Iterator[Nodes]:
    launch = Nodes(str(tmp_path), 3, ("--agent-liveness=4", "--join-timeout=90"))
    try:
        yield launch
    finally:
        launch.kill()


def test_a_node_lost_for_good_leaves_the_run_and_its_singleton_moves(nodes: Nodes) -> None:
    """Node 2 (a splitter and the counter) SIGKILLed mid-run: node 0 marks it lost after the
    agent liveness, the counter starts again on node 0 from node 2's folder (its ledger), the
    splitter leaves the dispatcher, and the count is exact: no line lost or counted twice."""
    nodes.start()
    nodes.wait("the program at its gate", lambda: os.path.exists(nodes.path(0, "progress18")))
    counter = nodes.path(2, "registry", "counter.0.json")
    nodes.wait("the counter registered on node 2", lambda: _json(counter) is not None)
    killed = time.monotonic()
    nodes.lose(2)
    with open(nodes.gate + "18", "w"):
        pass  # the program goes on at once: its calls meet the lost node
    membership = nodes.path(0, "membership.json")
    nodes.wait("node 2 marked lost", lambda: "2" in ((_json(membership) or {}).get("lost") or {}))
    marked = time.monotonic() - killed
    nodes.wait(
        "the program at its second gate", lambda: os.path.exists(nodes.path(0, "progress42"))
    )
    # Node 1's agent answers status from its own membership, which follows node 0's mark at
    # its next look at the store.
    on_node_1 = nodes.path(1, "membership.json")
    nodes.wait(
        "node 1 saw node 2 lost", lambda: "2" in ((_json(on_node_1) or {}).get("lost") or {})
    )
    _check_status(nodes)
    with open(nodes.gate + "42", "w"):
        pass
    assert nodes.finish([0, 1]) == [0, 0], nodes.logs()
    # The run completed: it ends quietly, torchrun's exit barrier included (node 0's torchrun,
    # the store's host, checks in last, once node 1's is in).
    assert nodes.tracebacks() == [], nodes.logs()
    driver = _json(nodes.path(0, "driver.json"))
    assert driver["result"] == EXPECTED, nodes.logs()
    assert _json(nodes.path(0, "summary.json"))["splitters"] == [0, 1]
    seen = _json(membership)
    assert seen["lost"] == {"2": seen["lost"]["2"]}
    assert seen["lost"]["2"].startswith("the agent of node 2 sent no heartbeat for ")
    assert seen["departed"] == {"splitter": {"2": 2}}
    assert list(seen["moved"]) == ["counter"]
    assert seen["moved"]["counter"]["0"]["node"] == 0
    assert seen["moved"]["counter"]["0"]["endpoint"].startswith("ipc://")
    (change,) = seen["changes"]
    assert (change["event"], change["node"], change["departed"], change["moved"]) == (
        "node_lost",
        2,
        ["splitter[2]"],
        {"counter[0]": 0},
    )
    on_1 = _json(nodes.path(1, "membership.json"))
    assert on_1["moved"]["counter"]["0"]["endpoint"].startswith("tcp://127.0.0.1:")
    assert _json(nodes.path(0, "report.json"))["status"] == "completed"
    assert driver["dispatch"]["splitter"]["replicas_departed"] == 1
    assert driver["dispatch"]["counter"]["replicas_rebound"] == 1
    with open(os.path.join(nodes.tmp, "node0.log")) as f:
        assert "node 2 lost (the agent of node 2 sent no heartbeat for " in f.read()
    (line,) = [r for r in records(nodes.path(0, "metrics.jsonl")) if "membership" in r]
    assert line["membership"] == change
    print(f"node 2 marked lost {marked:.1f} s after the kill")


def _check_status(nodes: Nodes) -> None:
    """``asyncrl status`` asked on node 1 while the run goes on: node 2 is listed lost, the
    counter runs on node 0, and the heading says what moved where."""
    from asyncrl.observe.status import format_status

    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "status", nodes.path(1), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    status = json.loads(out.stdout)
    lost = [n for n in status["nodes"] if "lost" in n]
    assert [(n["node"], n["lost"].startswith("the agent of node 2 sent no")) for n in lost] == [
        (2, True)
    ]
    where = {
        (p["role"], p["replica"]): n["node"]
        for n in status["nodes"]
        for p in n.get("processes", [])
    }
    assert where == {("splitter", 0): 0, ("counter", 0): 0, ("driver", 0): 0, ("splitter", 1): 1}
    heading = format_status(status).splitlines()[1]
    assert heading.startswith("node 2 lost at ")
    assert heading.endswith(": splitter[2] left the run, counter[0] moved to node 0")


def _driver_sees(nodes: Nodes, role: str, replica: int) -> bool:
    """Whether the driver's dispatcher holds a connected replica with credit (``asyncrl
    status``)."""
    import asyncio

    from asyncrl.observe.status import NotRunningError, ask

    try:
        status = asyncio.run(ask(nodes.run_dir, 10.0))
    except (NotRunningError, OSError):
        return False
    driver = next((n["driver"] for n in status["nodes"] if "driver" in n), {})
    rows = driver.get("roles", {}).get(role, {}).get("replicas", [])
    return any(r["replica"] == replica and r["connected"] and r["credit"] > 0 for r in rows)


def test_a_lost_node_started_again_joins_the_running_attempt(nodes: Nodes) -> None:
    """Node 2 lost mid-run, then its torchrun started again: it joins the attempt that went on
    (no restart of the others), its splitter is back in the dispatcher and takes work, the
    counter stays on node 0 where it moved, and the count is exact."""
    nodes.start()
    nodes.wait("the program at its gate", lambda: os.path.exists(nodes.path(0, "progress18")))
    counter = nodes.path(2, "registry", "counter.0.json")
    nodes.wait("the counter registered on node 2", lambda: _json(counter) is not None)
    nodes.lose(2)
    with open(nodes.gate + "18", "w"):
        pass
    membership = nodes.path(0, "membership.json")
    nodes.wait("node 2 marked lost", lambda: "2" in ((_json(membership) or {}).get("lost") or {}))
    nodes.wait(
        "the program at its second gate", lambda: os.path.exists(nodes.path(0, "progress42"))
    )
    started = time.monotonic()
    nodes.restart(2)
    nodes.wait("node 2 back", lambda: not (_json(membership) or {}).get("lost"), timeout=180)
    nodes.wait("splitter[2] serving the driver", lambda: _driver_sees(nodes, "splitter", 2))
    serving = time.monotonic() - started
    with open(nodes.gate + "42", "w"):
        pass
    assert nodes.finish([0, 1, 2]) == [0, 0, 0], nodes.logs()
    assert _json(nodes.path(0, "driver.json"))["result"] == EXPECTED, nodes.logs()
    assert _json(nodes.path(0, "summary.json"))["splitters"] == [0, 1, 2]
    seen = _json(membership)
    assert (seen["lost"], seen["departed"]) == ({}, {})
    assert {n: {i: m["node"] for i, m in by.items()} for n, by in seen["moved"].items()} == {
        "counter": {"0": 0},
        "splitter": {"2": 2},
    }
    assert [(c["event"], c["node"], c["moved"]) for c in seen["changes"]] == [
        ("node_lost", 2, {"counter[0]": 0}),
        ("node_back", 2, {"splitter[2]": 2}),
    ]
    back = _json(nodes.path(2, "report.json"))
    assert back["status"] == "completed" and back["served"]["splitter"] > 0
    assert "counter" not in back["served"]  # it stayed on node 0
    assert _json(nodes.path(1, "launch.json"))["attempt"] == 0  # nobody restarted
    with open(os.path.join(nodes.tmp, "node2-back.log")) as f:
        assert "attempt 0 goes on without this node: joining it again" in f.read()
    print(f"node 2's splitter served the driver {serving:.1f} s after its torchrun started")


RL_STEPS = 16


def _steps(nodes: Nodes) -> int:
    """The RL steps node 0's metrics.jsonl holds complete."""
    return sum(1 for line in complete_lines(nodes.path(0, "metrics.jsonl")) if '"step"' in line)


@pytest.mark.timeout(900)
def test_a_node_lost_mid_rl_costs_nothing_acknowledged(nodes: Nodes) -> None:
    """examples/arith/multinode3.yaml, shortened: node 2 (a rollout replica, its host's relay
    and the reward) is lost for good after a few RL steps. The reward starts again on node 0,
    the rollout replica and relay leave, and the run completes every step: no sample lost, none
    consumed twice, no step repeated or skipped."""
    from asyncrl.chaos.accounting import run_figures

    short = [
        "run.config.bc_max_steps=100",
        "run.config.bc_eval_every=100",
        f"run.config.rl_steps={RL_STEPS}",
        f"run.config.rl_eval_every={RL_STEPS}",
        "run.config.prompts_per_step=8",
    ]
    nodes.use("examples/arith/multinode3.yaml", *(a for o in short for a in ("--set", o)))
    nodes.start()
    nodes.wait("4 RL steps", lambda: _steps(nodes) >= 4, timeout=300)
    killed = time.monotonic()
    nodes.lose(2)
    membership = nodes.path(0, "membership.json")
    nodes.wait("node 2 marked lost", lambda: "2" in ((_json(membership) or {}).get("lost") or {}))
    marked = time.monotonic() - killed
    at_loss = _steps(nodes)
    assert nodes.finish([0, 1], timeout=360) == [0, 0], nodes.logs()
    figures = run_figures(nodes.run_dir)
    assert (
        figures["samples_lost"],
        figures["duplicate_consumptions"],
        figures["steps_repeated"],
    ) == (0, 0, 0), figures
    assert _steps(nodes) == RL_STEPS > at_loss
    seen = _json(membership)
    assert seen["departed"] == {"rollout": {"2": 2}, "relay2": {"0": 2}}
    assert seen["moved"]["reward"]["0"]["node"] == 0
    print(f"node 2 marked lost {marked:.1f} s after the kill, at step {at_loss}; {figures}")


def _learner_over_nodes_0_and_1(tmp: str, nodes: str = "[0, 1]", *, sharded: bool = False) -> str:
    """examples/arith/multinode3.yaml with its learner as two data-parallel ranks, on nodes 0
    and 1 (``placement.nodes``: ``nodes``), checkpointing every 4 steps; written into ``tmp``.
    With replica 0 (the group's lead, which publishes the weights) on node 1, node 0 gets a
    relay of its own (``relay0``) while the lead runs elsewhere. ``sharded``: the ranks shard
    the model (``parallel: fsdp``) and the run directory is shared (``run.shared_storage``)."""
    with open(os.path.join(ROOT, "examples/arith/multinode3.yaml")) as f:
        text = f.read()
    single = "  learner:\n    class: asyncrl.roles.training.learner:Learner\n    threads: 1\n"
    assert single in text
    text = text.replace(
        single,
        single + f"    replicas: 2\n    placement: {{nodes: {nodes}}}\n"
        "    supervision: {strategy: one_for_all, backoff_initial_s: 0.05}\n",
    )
    if nodes != "[0, 1]":
        relay = "  relay1:\n    class: asyncrl.roles.services.relay:Relay\n"
        assert relay in text and "relays: [relay1, relay2]" in text
        text = text.replace(
            relay,
            relay.replace("relay1", "relay0")
            + "    placement: {node: 0}\n    config:\n      source: learner\n\n"
            + relay,
        )
        text = text.replace("relays: [relay1, relay2]", "relays: [relay0, relay1, relay2]")
    checkpoints = "checkpoint_every: 4\n      dist_timeout_s: 60"
    if sharded:
        name = "  name: arith-multinode3\n"
        assert name in text
        text = text.replace(name, name + "  shared_storage: true\n")
        checkpoints += "\n      parallel: fsdp"
    assert "checkpoint_every: 10" in text
    text = text.replace("checkpoint_every: 10", checkpoints)
    text = text.replace(
        "tokenizer: examples/arith/tokenizer",
        "tokenizer: " + os.path.join(ROOT, "examples/arith/tokenizer"),
    )
    path = os.path.join(tmp, "learners.yaml")
    with open(path, "w") as f:
        f.write(text)
    return path


def _finish_with_nothing_lost(nodes: Nodes, finishing: list[int]) -> dict[str, Any]:
    """Wait for the nodes ``finishing`` to end the run, each with exit code 0, and check its
    exact counts (``asyncrl.chaos.accounting.run_figures``): 0 samples lost, 0 consumed twice,
    0 steps repeated or skipped. Return the run's figures, for what the caller checks beyond."""
    from asyncrl.chaos.accounting import run_figures

    assert nodes.finish(finishing, timeout=360) == [0] * len(finishing), nodes.logs()
    figures = run_figures(nodes.run_dir)
    assert (
        figures["samples_lost"],
        figures["duplicate_consumptions"],
        figures["steps_repeated"],
        figures["steps_skipped"],
    ) == (0, 0, 0, 0), figures
    return figures


def _complete_steps(folder: str) -> set[str]:
    """The checkpoints (``step-N``) a learner replica's folder holds complete."""
    try:
        names = os.listdir(folder)
    except OSError:
        return set()
    return {n for n in names if os.path.exists(os.path.join(folder, n, "COMPLETE"))}


def _lose_node_1_mid_rl(nodes: Nodes, *, lead_on_node_1: bool, sharded: bool) -> str:
    """Run the main job, shortened, with its learner as two ranks on nodes 0 and 1
    (``_learner_over_nodes_0_and_1``: replica 0, the group's lead, on node 1 with
    ``lead_on_node_1``), lose node 1 for good after six RL steps (``sharded``: once both ranks
    hold a checkpoint complete), and check what such a loss must cost: nothing but a restart.
    The run completes every step (0 samples lost, 0 consumed twice, 0 steps repeated or
    skipped); the rank on node 0 goes on alone, started again once at the new size, and trains
    past the lost rank's last step; node 1's rollout replica, relay and rank leave the run,
    and every node records the one change; no node's log holds a traceback. Return node 0's
    log, for what the caller checks beyond."""
    lost, left = (0, 1) if lead_on_node_1 else (1, 0)
    short = [
        "run.config.bc_max_steps=20",
        "run.config.bc_eval_every=100",
        f"run.config.rl_steps={RL_STEPS}",
        f"run.config.rl_eval_every={RL_STEPS}",
        "run.config.prompts_per_step=8",
    ]
    placement = "[1, 0]" if lead_on_node_1 else "[0, 1]"
    nodes.manifest = _learner_over_nodes_0_and_1(nodes.tmp, placement, sharded=sharded)
    nodes.options = (*nodes.options, *(a for o in short for a in ("--set", o)))
    started = time.monotonic()
    nodes.start()
    nodes.wait("6 RL steps", lambda: _steps(nodes) >= 6, timeout=300)
    if sharded:
        # The ranks left load the lost rank's shards: one checkpoint complete in both folders.
        mine = nodes.path(0, "roles", f"learner.{left}", "checkpoints")
        theirs = nodes.path(1, "roles", f"learner.{lost}", "checkpoints")
        nodes.wait(
            "a checkpoint complete in both ranks' folders",
            lambda: _complete_steps(mine) & _complete_steps(theirs),
        )
    killed = time.monotonic()
    nodes.lose(1)
    membership = nodes.path(0, "membership.json")
    nodes.wait("node 1 marked lost", lambda: "1" in ((_json(membership) or {}).get("lost") or {}))
    marked = time.monotonic() - killed
    at_loss = _steps(nodes)
    nodes.wait("a step trained after the loss", lambda: _steps(nodes) > at_loss, timeout=300)
    first_step = time.monotonic() - killed
    figures = _finish_with_nothing_lost(nodes, [0, 2])
    assert _steps(nodes) == RL_STEPS > at_loss
    seen = _json(membership)
    assert seen["shrunk"] == {"learner": [left]}
    assert seen["departed"] == {
        "rollout": {"1": 1},
        "relay1": {"0": 1},
        "learner": {str(lost): 1},
    }
    (change,) = seen["changes"]
    assert change["shrunk"] == {"learner": [left]}
    assert _json(nodes.path(2, "membership.json"))["shrunk"] == {"learner": [left]}
    with open(os.path.join(nodes.tmp, "node0.log")) as f:
        log = f.read()
    assert (
        f"learner[{left}] start again: its group goes on with replicas [{left}] after node "
        f"1's loss" in log
    )
    # The rank left failed its collective with the lost one: its restart waited for the
    # plan, so the group restarted once, at its new size, outside the restart budget.
    assert figures["restarts"]["learner"] == 1, nodes.logs()
    assert nodes.tracebacks() == [], nodes.logs()
    # The rank left trained on alone after the lost one's last step.
    assert _last_step(nodes.path(0, "ledger", f"learner.{left}.steps.jsonl")) > _last_step(
        nodes.path(1, "ledger", f"learner.{lost}.steps.jsonl")
    )
    print(
        f"node 1 marked lost {marked:.1f} s after the kill, at step {at_loss}; the first step "
        f"led by replica {left} {first_step:.1f} s after it; "
        f"{time.monotonic() - started:.0f} s in all; {figures}"
    )
    return log


def _last_step(path: str) -> int:
    """The last step a learner replica's step log holds."""
    return int(records(path)[-1]["step"])


def _check_led_by_replica_1(nodes: Nodes, log: str) -> None:
    """Replica 1 leads the group after node 1's loss took replica 0: it publishes the weights
    on node 0, so node 0's relay stops copying, and node 2's relay pulls from it."""
    assert "learner goes on with replicas [1], led by replica 1" in log
    assert "relay relay0: learner's group is led by replica 1 now (ipc://" in log
    with open(os.path.join(nodes.tmp, "node2.log")) as f:
        assert "relay relay2: learner's group is led by replica 1 now (tcp://" in f.read()


def _check_resharded(nodes: Nodes, replica: int) -> None:
    """Replica ``replica`` (on node 0) alone took both ranks' shards of a checkpoint the group
    of 2 wrote."""
    folder = nodes.path(0, "logs")
    learner = ""
    for name in sorted(os.listdir(folder)):
        if name.startswith(f"learner.{replica}"):
            with open(os.path.join(folder, name), errors="replace") as f:
                learner += f.read()
    assert "was written by a group of 2 rank(s); loading their shards at a group of 1" in learner


@pytest.mark.timeout(900)
def test_a_learner_group_over_a_lost_node_goes_on_at_a_smaller_size(nodes: Nodes) -> None:
    """The main job with its learner as two data-parallel ranks on nodes 0 and 1: node 1 (a
    learner rank, a rollout replica and its host's relay) is lost for good mid-RL. The learner's
    group goes on with replica 0 alone, from its checkpoint and write-ahead log, and the run
    completes every step: no sample lost, none consumed twice, no step repeated or skipped."""
    _lose_node_1_mid_rl(nodes, lead_on_node_1=False, sharded=False)


@pytest.mark.timeout(900)
def test_a_learner_group_whose_lead_is_lost_goes_on_led_by_the_rank_left(nodes: Nodes) -> None:
    """The learner as two data-parallel ranks with replica 0, the group's lead, on node 1 and
    replica 1 on node 0: node 1 is lost for good mid-RL. Replica 1 leads the group from then on
    (the program's calls go to it, it publishes the weights on node 0, and node 2's relay pulls
    from it), resumed from its own checkpoint and write-ahead log, and the run completes every
    step: no sample lost, none consumed twice, no step repeated or skipped."""
    log = _lose_node_1_mid_rl(nodes, lead_on_node_1=True, sharded=False)
    _check_led_by_replica_1(nodes, log)


@pytest.mark.timeout(900)
def test_a_sharded_learner_group_over_a_lost_node_goes_on_at_a_smaller_size(
    nodes: Nodes,
) -> None:
    """As above with the learner's two ranks sharded (``parallel: fsdp``) and the run directory
    shared (``run.shared_storage``): node 1's rank is lost with its half of the weights and
    AdamW's moments, and replica 0 goes on alone from both ranks' shards of their newest
    checkpoint (node 1's read from its folder) and its own write-ahead log."""
    _lose_node_1_mid_rl(nodes, lead_on_node_1=False, sharded=True)
    _check_resharded(nodes, 0)


@pytest.mark.timeout(900)
def test_a_sharded_learner_group_whose_lead_is_lost_goes_on_led_by_the_rank_left(
    nodes: Nodes,
) -> None:
    """The two sharded ranks with replica 0, the group's lead and the one rank that holds the
    weight store, on node 1 (``run.shared_storage``): node 1 is lost for good mid-RL with the
    lead's half of the weights and AdamW's moments. Replica 1 leads from then on: it loads
    both ranks' shards of their newest checkpoint (the lead's read from node 1's folder) at a
    group of one, replays its own write-ahead log, publishes the weights on node 0 (node 0's
    relay stops copying, node 2's pulls from it), and the run completes every step."""
    log = _lose_node_1_mid_rl(nodes, lead_on_node_1=True, sharded=True)
    _check_led_by_replica_1(nodes, log)
    _check_resharded(nodes, 1)
