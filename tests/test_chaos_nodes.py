"""``asyncrl chaos --nodes``: its argument checks, the figures of node losses over recorded
events, the step logs of node folders, and ``NodeLaunch.lose`` on a real process tree."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from asyncrl import cli
from asyncrl.chaos.accounting import format_node_summary, node_figures, read_steps, run_figures
from asyncrl.chaos.nodes import NodeLaunch, NodePlan, check_node_plan, node_tree
from tests.conftest import ROOT
from tests.helpers.waiting import wait_until

MULTINODE3 = os.path.join(ROOT, "examples", "arith", "multinode3.yaml")


def chaos(tmp_path: Any, *args: str, manifest: str = MULTINODE3) -> int:
    return cli.main(["chaos", manifest, "--run-dir", os.path.join(tmp_path, "run"), *args])


def error(capsys: pytest.CaptureFixture[str]) -> str:
    return capsys.readouterr().err.splitlines()[-1]


# -- the arguments -------------------------------------------------------------------------


def test_losing_node_0_is_refused_and_says_what_its_loss_does(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert chaos(tmp_path, "--nodes", "3", "--kill-node", "0", "--every", "60s") == 2
    assert error(capsys) == (
        "asyncrl: error: --kill-node 0: node 0 hosts torchrun's store and runs the driver, so "
        "its loss is not a node lost for good: every agent ends its attempt, the launch exits "
        "1, and the run goes on only when it is started again on every node with 'torchrun ... "
        "-m asyncrl.launch MANIFEST --resume', from its checkpoints (docs/multinode.md, "
        "Failures); choose a node from 1 to 2"
    )
    assert not os.path.exists(os.path.join(tmp_path, "run"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--nodes", "3", "--kill-node", "3", "--every", "60s"],
            "--kill-node 3: the launch has nodes 0 to 2 (--nodes 3); choose a node from 1 to 2",
        ),
        (
            ["--nodes", "1", "--kill-node", "1", "--every", "60s"],
            "--nodes 1: losing a node needs a launch of at least 2 nodes; give --nodes 2 or "
            "more, or leave out --nodes to kill processes on one machine",
        ),
        (
            ["--nodes", "3", "--kill-node", "2", "--every", "30s", "--rejoin-after", "30s"],
            "--rejoin-after 30s is not shorter than --every 30s: node 2 must be back before its "
            "next loss; shorten --rejoin-after or lengthen --every",
        ),
        (
            ["--nodes", "3", "--kill-node", "2", "--every", "30s", "--losses", "0"],
            "--losses 0: give at least 1, or leave --losses out to lose the node until the run "
            "ends",
        ),
        (
            ["--nodes", "3", "--kill-node", "2", "--every", "30s", "--losses", "2"],
            "--losses 2: a node that is never started again is lost once; give --rejoin-after D "
            "to lose it again after it comes back, or --losses 1",
        ),
        (
            ["--nodes", "3", "--every", "30s"],
            "--nodes needs --kill-node R, the node to lose (1 to N-1)",
        ),
        (
            ["--nodes", "3", "--kill-node", "2"],
            "--nodes needs --every D, how often to lose it (e.g. 60s)",
        ),
        (
            ["--nodes", "3", "--kill-node", "2", "--every", "30s", "--roles", "reward"],
            "--roles kills processes on one machine; with --nodes the campaign loses whole nodes "
            "(--kill-node R --every D [--rejoin-after T]): leave out --roles, or --nodes",
        ),
        (
            [
                "--nodes",
                "3",
                "--kill-node",
                "2",
                "--every",
                "30s",
                "--kill-every",
                "5s",
                "--seed",
                "1",
            ],
            "--kill-every kills processes on one machine; with --nodes the campaign loses whole "
            "nodes (--kill-node R --every D [--rejoin-after T]): leave out --kill-every, --seed, "
            "or --nodes",
        ),
        (
            ["--kill-node", "2", "--every", "30s"],
            "--kill-node loses a node of a launch over several: give --nodes N with it (and "
            "--kill-node R --every D), or leave it out to kill processes on one machine",
        ),
        (
            ["--rejoin-after", "30s"],
            "--rejoin-after loses a node of a launch over several: give --nodes N with it (and "
            "--kill-node R --every D), or leave it out to kill processes on one machine",
        ),
    ],
)
def test_bad_node_arguments_name_the_flag_and_the_fix(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert chaos(tmp_path, *args) == 2
    assert error(capsys) == f"asyncrl: error: {message}"
    assert not os.path.exists(os.path.join(tmp_path, "run"))


def test_a_bad_duration_names_its_flag(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        chaos(tmp_path, "--nodes", "3", "--kill-node", "2", "--every", "60")
    assert exc.value.code == 2
    assert (
        "argument --every: not a duration: '60'; write a number with a unit (ms, s, m or h)"
        in capsys.readouterr().err
    )


def test_a_manifest_placed_on_more_nodes_than_the_launch_is_refused(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert chaos(tmp_path, "--nodes", "2", "--kill-node", "1", "--every", "60s") == 2
    err = capsys.readouterr().err
    assert "roles.rollout.placement.nodes[2]: node 2 but the launch has 2 nodes" in err


def test_a_group_over_the_lost_node_is_warned_of_and_the_plan_said(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """examples/arith/multinode.yaml's data-parallel learners span nodes 0 and 1: replicated,
    they go on with replica 0 when node 1 is lost and grow back when it returns, and nothing is
    warned of or noted; sharded
    (``parallel: fsdp``), losing node 1 restarts the group, and the command says so before it
    launches (here it stops at the used run directory), unless the run directory is shared
    (``run.shared_storage``)."""
    os.makedirs(os.path.join(tmp_path, "run", "chaos"))
    with open(os.path.join(tmp_path, "run", "chaos", "report.json"), "w") as f:
        f.write("{}")
    manifest = os.path.join(ROOT, "examples", "arith", "multinode.yaml")
    args = ["--nodes", "2", "--kill-node", "1", "--every", "60s", "--rejoin-after", "30s"]
    args += ["--no-baseline", "--agent-liveness", "4s"]
    said = (
        "chaos: 2 nodes; node 1 lost every 60 s, started again 30 s after each loss "
        "(agent liveness 4 s)"
    )
    used = "already holds a run (report.json); add --overwrite to delete it and start afresh"
    assert chaos(tmp_path, *args, manifest=manifest) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == said and err[1].endswith(used) and len(err) == 2
    sharded = ["--set", "roles.learner.config.parallel=fsdp"]
    assert chaos(tmp_path, *args, *sharded, manifest=manifest) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(
        "asyncrl: warning: roles.learner: its 2 replicas form one group over nodes [0, 1]"
    )
    assert err[1] == said and err[2].endswith(used)
    # With the run directory shared, a sharded group goes on too, and grows back when the
    # node comes back: nothing to warn of or note.
    shared = [*sharded, "--set", "run.shared_storage=true"]
    assert chaos(tmp_path, *args, *shared, manifest=manifest) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == said and err[1].endswith(used) and len(err) == 2


def test_check_node_plan_accepts_a_plan_that_can_run() -> None:
    check_node_plan(NodePlan(nodes=3, kill_node=1, every=60.0, rejoin_after=30.0, losses=2))
    check_node_plan(NodePlan(nodes=2, kill_node=1, every=5.0))


# -- the figures ---------------------------------------------------------------------------

T = 1_800_000_000.0
"""A Unix time the recorded events count from."""


def lost(t: float, node: int = 2) -> dict[str, Any]:
    return {"event": "lost", "node": node, "time": T + t}


def restarted(t: float, node: int = 2) -> dict[str, Any]:
    return {"event": "restarted", "node": node, "time": T + t}


def serving(t: float, node: int = 2) -> dict[str, Any]:
    return {"event": "serving", "node": node, "time": T + t, "replicas": ["rollout[2]"]}


def change(t: float, event: str, node: int = 2) -> dict[str, Any]:
    return {"time": T + t, "membership": {"time": T + t, "event": event, "node": node}}


def steps(*ts: float) -> list[dict[str, Any]]:
    return [{"step": n, "time": T + t} for n, t in enumerate(ts, 1)]


def test_node_figures_time_each_loss_to_the_next_step_after_its_mark() -> None:
    """Two losses: each kill, node 0's mark of it (4.5 s and 6 s later), and the first step
    after the mark; each restart to the node serving again, and rejoins counted by node 0's
    ``node_back``."""
    events = [lost(10), restarted(16), serving(31), lost(40), restarted(47), serving(59)]
    metrics = [
        *steps(1, 5, 9, 14, 14.4, 20, 30, 45, 46.5, 60),
        change(14.5, "node_lost"),
        change(25, "node_back"),
        change(46, "node_lost"),
        change(55, "node_back"),
        change(12, "node_lost", node=1),  # another node's: not ours
    ]
    figures = node_figures({"node_events": events}, metrics)
    assert figures == {
        "node_losses": 2,
        "node_losses_unmarked": 0,
        "node_rejoins": 2,
        "node_loss_to_step_s": [10.0, 6.5],  # 20 - 10 (14 and 14.4 were before the mark)
        "node_loss_to_step_s_p50": 6.5,
        "rejoin_to_serving_s": [15.0, 12.0],
        "rejoin_to_serving_s_p50": 12.0,
    }
    acc = {
        **figures,
        "node_plan": {"nodes": 3, "kill_node": 2},
        "exit_codes": {"0": 0, "1": 0, "2": 0},
        "completed": True,
        "samples_lost": 0,
        "duplicates_consumed": 0,
        "steps_repeated": 0,
        "steps_skipped": 0,
        "learner_steps": 450,
        "consistent": True,
        "accuracy_undisturbed": 0.563,
        "accuracy_chaos": 0.55,
        "program_s_undisturbed": 218.8,
        "program_s_chaos": 230.1,
        "slowdown": 1.0517,
        "unknown": {"samples_scored": "summary.json's pipeline has no scored_samples"},
    }
    assert format_node_summary(acc).splitlines() == [
        "launch over 3 nodes completed   yes",
        "  exit statuses                 node 0 0, node 1 0, node 2 0",
        "node 2 lost                     2",
        "  never marked lost             0",
        "node 2 back                     2",
        "loss to next step p50 (s)       6.500 (each 10.0, 6.5)",
        "rejoin to serving p50 (s)       12.0 (each 15.0, 12.0)",
        "samples lost                    0",
        "samples consumed twice          0",
        "learner steps repeated/skipped  0 / 0",
        "learner steps                   450",
        "  pipeline and log agree        yes",
        "accuracy undisturbed/chaos      0.563 / 0.550",
        "program time undisturbed/chaos  218.8 / 230.1",
        "slowdown (program time)         1.052",
        "unknown figures, and why:",
        "  samples_scored: summary.json's pipeline has no scored_samples",
    ]


def test_node_figures_leave_out_what_never_happened() -> None:
    """A loss the run ended before node 0 marked, a restart that never came back or served, and
    a loss marked with no step after it: counted where they count, timed nowhere."""
    events = [lost(10), restarted(16), lost(30), restarted(35), serving(50)]
    metrics = [*steps(1, 12, 20), change(14, "node_lost"), change(33, "node_lost")]
    figures = node_figures({"node_events": events}, metrics)
    assert figures == {
        "node_losses": 2,
        "node_losses_unmarked": 0,
        "node_rejoins": 0,  # node 0 recorded no node_back
        "node_loss_to_step_s": [10.0],  # the second loss had no step after its mark
        "node_loss_to_step_s_p50": 10.0,
        "rejoin_to_serving_s": [15.0],  # the first restart was lost again before serving
        "rejoin_to_serving_s_p50": 15.0,
    }
    none = node_figures({"node_events": [lost(10)]}, steps(1, 20))
    assert none["node_losses_unmarked"] == 1
    assert none["node_loss_to_step_s"] == [] and none["node_loss_to_step_s_p50"] is None
    assert none["rejoin_to_serving_s_p50"] is None
    assert node_figures({}, [])["node_losses"] == 0


def test_the_step_logs_of_node_folders_are_read(tmp_path: Any) -> None:
    """Node R's learners keep their step logs in ``RUN_DIR/node-R/ledger``: the accounting reads
    them beside node 0's, each under its own key, and a sample trained on two nodes counts as
    consumed twice."""
    run_dir = str(tmp_path)
    record = {"step": 1, "version": 1, "ids": [["p", 0]], "phase": "rl", "incarnation": 0}
    for folder, name in (("ledger", "learner.0"), ("node-1/ledger", "critic.0")):
        os.makedirs(os.path.join(run_dir, folder))
        with open(os.path.join(run_dir, folder, f"{name}.steps.jsonl"), "w") as f:
            f.write(json.dumps(record) + "\n")
    with open(os.path.join(run_dir, "node-1", "ledger", "critic.0.steps.jsonl"), "a") as f:
        f.write('{"step": 2, "ids"\n')  # cut short
    os.makedirs(os.path.join(run_dir, "node-x", "ledger"))  # no node's folder
    found = read_steps(run_dir)
    assert found == {
        "learner.0": [record],
        "node-1/critic.0": [record],
        "": [{"bad_line": 2, "file": "node-1/critic.0.steps.jsonl"}],
    }
    figures = run_figures(run_dir)
    assert (figures["duplicates_consumed"], figures["ledger_bad_lines"]) == (1, 1)
    os.rename(os.path.join(run_dir, "ledger"), os.path.join(run_dir, "old"))
    assert sorted(read_steps(run_dir) or {}) == ["", "node-1/critic.0"]


# -- losing a node's processes -------------------------------------------------------------


def test_node_tree_follows_the_parents() -> None:
    parents = {10: 1, 11: 10, 12: 11, 13: 10, 20: 1, 21: 20}
    assert node_tree(10, parents) == {10, 11, 12, 13}
    assert node_tree(21, parents) == {21}


TREE = """\
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)
janitor = subprocess.Popen(  # as a node's janitor shows in its command line
    [sys.executable, "-c", "import time; time.sleep(600)", "asyncrl.supervision.janitor"],
    start_new_session=True,
)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{child.pid} {janitor.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


def test_lose_kills_the_node_tree_and_nothing_else(tmp_path: Any) -> None:
    """``lose`` SIGKILLs the node's torchrun (here a stand-in), the agent its launch.json names
    and its roles (a child in a session of its own, as the zygote forks them), but neither a
    registry entry that is no process of the node (a stale one, a replica that moved) nor the
    node's janitor."""
    run_dir = os.path.join(tmp_path, "run")
    launch = NodeLaunch("m.yaml", [], run_dir, 2)
    pids_file = os.path.join(tmp_path, "pids")
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    node = subprocess.Popen([sys.executable, "-c", TREE, pids_file], start_new_session=True)
    launch.procs[1] = node
    try:
        wait_until(lambda: os.path.exists(pids_file), timeout=60, what="the stand-in's tree")
        with open(pids_file) as f:
            child, janitor = map(int, f.read().split())
        os.makedirs(launch.folder(1, "registry"))
        with open(launch.folder(1, "launch.json"), "w") as f:
            json.dump({"node": 1, "pid": node.pid}, f)
        for name, pid in (("role.0", child), ("moved.0", stranger.pid)):
            with open(launch.folder(1, "registry", f"{name}.json"), "w") as f:
                json.dump({"name": name, "pid": pid}, f)
        assert sorted(launch.lose(1)) == sorted([node.pid, child])
        assert node.returncode == -signal.SIGKILL
        wait_until(lambda: not _alive(child), timeout=30, what="the role killed")
        assert stranger.poll() is None
        assert _alive(janitor)
    finally:
        stranger.kill()
        stranger.wait()
        for pid in _read_pids(pids_file):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if node.poll() is None:
            node.kill()
            node.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read_pids(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def test_launch_logs_and_folders(tmp_path: Any) -> None:
    launch = NodeLaunch("m.yaml", ["a=1"], os.path.join(tmp_path, "run", "chaos"), 3)
    assert launch.folder(0, "membership.json") == os.path.join(
        tmp_path, "run", "chaos", "membership.json"
    )
    assert launch.folder(2, "launch.json") == os.path.join(
        tmp_path, "run", "chaos", "node-2", "launch.json"
    )
    assert launch.log(2) == os.path.join(tmp_path, "run", "logs", "chaos-node2.log")
    launch.starts[2] = 2
    assert launch.log(2) == os.path.join(tmp_path, "run", "logs", "chaos-node2-back-1.log")
    assert 0 < launch.port < 65536
