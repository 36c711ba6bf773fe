"""A data-parallel learner group that went on without a lost node's rank grows back when the node
comes back: three torchrun "nodes" on 127.0.0.1 (``tests/integration/test_node_loss.py`` says
how), the learner's two replicated ranks on nodes 0 and 1.

Node 1 is lost after a few RL steps and its torchrun started again: node 0 decides that the
group grows back to both ranks, the returning rank takes the checkpoints, write-ahead log and
step ledger of the rank that led meanwhile, and the group trains on at two ranks to the end,
with nothing lost, nothing counted twice and no step repeated or skipped. Replicated, with
replica 0 (the group's lead) on node 1 and without ``run.shared_storage``: replica 1 leads while
node 1 is out, sends its state to the returning replica 0 over the group, and replica 0 leads
again. Sharded (``parallel: fsdp``, replica 0 on node 0, the run directory shared:
``run.shared_storage``, as one directory on one machine is), replica 1 reads replica 0's
checkpoints from its folder and both ranks load them resharded to two. With
``supervision.regrow: false`` the group stays at replica 0 alone.
"""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

import pytest
import torch

from tests.helpers.records import complete_lines, records
from tests.integration.test_node_loss import (
    Nodes,
    _finish_with_nothing_lost,
    _json,
    _learner_over_nodes_0_and_1,
    _steps,
    nodes,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

__all__ = ["nodes"]  # the fixture, used by name

RL_STEPS = 30

SHORT = [
    "run.config.bc_max_steps=5",
    "run.config.bc_eval_every=100",
    f"run.config.rl_steps={RL_STEPS}",
    f"run.config.rl_eval_every={RL_STEPS}",
    "run.config.prompts_per_step=32",
    "run.shared_storage=true",
]


def _changes(nodes: Nodes) -> list[dict[str, object]]:
    return list((_json(nodes.path(0, "membership.json")) or {}).get("changes") or [])


def _launch_and_bring_back(nodes: Nodes, *more: str, placement: str = "[0, 1]") -> float:
    """Launch the learner's two ranks on nodes 0 and 1 (``_learner_over_nodes_0_and_1``, the
    nodes of replicas 0 and 1 as ``placement`` says), shortened (``SHORT``, then the options
    ``more``); lose node 1 after 3 RL steps and, once node 0 marked it lost, start its torchrun
    again. Returns when it was started again (``time.monotonic()``)."""
    nodes.manifest = _learner_over_nodes_0_and_1(nodes.tmp, placement)
    nodes.options = (*nodes.options, *(a for o in (*SHORT, *more) for a in ("--set", o)))
    nodes.start()
    nodes.wait("3 RL steps", lambda: _steps(nodes) >= 3, timeout=300)
    nodes.lose(1)
    membership = nodes.path(0, "membership.json")
    nodes.wait("node 1 marked lost", lambda: "1" in ((_json(membership) or {}).get("lost") or {}))
    nodes.restart(1)
    return time.monotonic()


def _figures(nodes: Nodes) -> dict[str, Any]:
    """The three nodes end the run, with its exact counts (``_finish_with_nothing_lost``: 0
    samples lost, 0 consumed twice, 0 steps repeated or skipped) and every RL step in node 0's
    metrics. Returns the run's figures."""
    figures = _finish_with_nothing_lost(nodes, [0, 1, 2])
    assert _steps(nodes) == RL_STEPS
    return figures


class Growth(NamedTuple):
    """What a run showed as its learner's group grew back: seconds from node 1's torchrun
    started again to node 0's ``group_grown``, the RL steps node 0's metrics held then, the
    replica on node 0 (which led the group while node 1 was out) and the one on node 1, their
    checkpoints folders, the lead's newest complete checkpoint then (the returning replica
    takes it, or older ones), the run's figures, and when the test began
    (``time.monotonic()``)."""

    grown_after: float
    at_growth: int
    stayed: int
    returned: int
    lead: str
    rejoined: str
    copied: int
    figures: dict[str, Any]
    started: float


def _grow_back_and_finish(nodes: Nodes, *more: str, lead_on_node_1: bool = False) -> Growth:
    """Launch with the options ``more`` (``lead_on_node_1``: replica 0, which leads the group
    at its full size, on node 1 and replica 1 on node 0), lose node 1 and bring it back
    (``_launch_and_bring_back``), wait for node 0 to record the learner's group grown back,
    note what ``Growth`` holds, and let the run end (``_figures``): the group grew back before
    the run's last step."""
    started = time.monotonic()
    stayed, returned = (1, 0) if lead_on_node_1 else (0, 1)
    placement = "[1, 0]" if lead_on_node_1 else "[0, 1]"
    back = _launch_and_bring_back(nodes, *more, placement=placement)
    nodes.wait(
        "the learner's group grown back",
        lambda: any(c.get("event") == "group_grown" for c in _changes(nodes)),
        timeout=180,
    )
    grown_after = time.monotonic() - back
    at_growth = _steps(nodes)
    lead = nodes.path(0, "roles", f"learner.{stayed}", "checkpoints")
    rejoined = nodes.path(1, "roles", f"learner.{returned}", "checkpoints")
    copied = max(_checkpoints(lead))
    figures = _figures(nodes)
    assert at_growth < RL_STEPS, "the run ended before the group grew back"
    return Growth(
        grown_after, at_growth, stayed, returned, lead, rejoined, copied, figures, started
    )


def _last_ledger_step(nodes: Nodes, node: int, replica: int) -> int:
    return int(records(nodes.path(node, "ledger", f"learner.{replica}.steps.jsonl"))[-1]["step"])


def _check_both_trained_to_the_end(nodes: Nodes, grown: Growth, newest: int) -> None:
    """The returning replica trained every step to the end after the group grew back, as the
    other did, the last steps trained on samples of fresh weights (every host's rollouts
    followed the lead), and no node's log holds a traceback. Prints the run's timings
    (``newest``: the newest checkpoint both ranks wrote) and figures."""
    figures = grown.figures
    stale = [r["staleness"]["max"] for r in records(nodes.path(0, "metrics.jsonl")) if "step" in r][
        -5:
    ]
    assert max(stale) <= 3, f"the last steps' samples were {stale} versions old"
    back = _last_ledger_step(nodes, 1, grown.returned)
    assert figures["learner_steps"] == back == _last_ledger_step(nodes, 0, grown.stayed)
    assert nodes.tracebacks() == [], nodes.logs()
    print(
        f"grown back {grown.grown_after:.1f} s after node 1's torchrun started again, at step "
        f"{grown.at_growth}; newest common checkpoint step {newest}; "
        f"{time.monotonic() - grown.started:.0f} s in all; {figures}"
    )


def _tensors(saved: object, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's state, by its path in it."""
    if isinstance(saved, torch.Tensor):
        return {prefix: saved}
    if isinstance(saved, dict):
        out: dict[str, torch.Tensor] = {}
        for key, value in saved.items():
            out |= _tensors(value, f"{prefix}/{key}")
        return out
    return {}


def _weights(folder: str, step: int) -> dict[str, torch.Tensor]:
    from asyncrl.roles.training.checkpoints import CheckpointDir

    return _tensors(CheckpointDir.load(os.path.join(folder, f"step-{step:08d}")))


def _checkpoints(folder: str) -> set[int]:
    """The steps of the complete checkpoints in ``folder``."""
    from asyncrl.roles.training.checkpoints import problem

    return {
        int(n[len("step-") :])
        for n in os.listdir(folder)
        if n.startswith("step-") and problem(os.path.join(folder, n)) is None
    }


def test_a_learner_group_grows_back_when_its_lost_node_returns(nodes: Nodes) -> None:
    """Replica 0, the group's lead, runs on node 1 and replica 1 on node 0. The group goes on
    with replica 1 after node 1's loss, led by it, and grows back to [0, 1] once node 1 is
    back: membership.json and metrics.jsonl record it, replica 0 restores replica 1's state and
    leads the group again, and at their newest common checkpoint after it the two ranks hold
    the same parameters, bit for bit. The run directory is not taken as shared here
    (``run.shared_storage: false``): replica 1 sends its state to replica 0 over the group.
    (The sharded test below reads it from the shared run directory, and grows a group whose
    lead stays on node 0.)"""
    grown = _grow_back_and_finish(nodes, "run.shared_storage=false", lead_on_node_1=True)
    lead, rejoined, figures = grown.lead, grown.rejoined, grown.figures
    seen = _json(nodes.path(0, "membership.json"))
    assert (seen["shrunk"], seen["departed"]) == ({}, {})
    assert [(c["event"], c["shrunk"], c["grown"]) for c in seen["changes"]] == [
        ("node_lost", {"learner": [1]}, {}),
        ("node_back", {}, {}),
        ("group_grown", {}, {"learner": [0, 1]}),
    ]
    assert seen["moved"]["learner"]["0"]["node"] == 1
    changes = [
        line for line in complete_lines(nodes.path(0, "metrics.jsonl")) if '"membership"' in line
    ]
    assert '"event": "group_grown"' in changes[-1] and '"grown": {"learner": [0, 1]}' in changes[-1]
    assert (_json(nodes.path(1, "membership.json")) or {})["shrunk"] == {}
    # Replica 1 restarted once as the group shrank and once as it grew back, outside the budget.
    assert figures["restarts"]["learner"] == 2, nodes.logs()
    with open(os.path.join(nodes.tmp, "node0.log")) as f:
        log = f.read()
    assert "learner goes on with replicas [1], led by replica 1" in log
    assert "learner grows back to replicas [0, 1] (node 1 is back)" in log
    assert "learner[1] start again: its group grows back to replicas [0, 1]" in log
    assert not os.path.exists(nodes.path(1, "roles", "learner.0", "rejoin.json"))
    with open(nodes.path(1, "logs", "learner.0.jsonl")) as f:
        assert "rejoining its group, took the state of learner.1, its lead, over the group" in (
            f.read()
        )
    # A checkpoint each rank wrote itself after the group grew back: the same parameters
    # (and AdamW moments), bit for bit.
    newest = max(_checkpoints(lead) & _checkpoints(rejoined))
    assert newest > grown.copied
    mine, theirs = _weights(lead, newest), _weights(rejoined, newest)
    assert mine.keys() == theirs.keys() and len(mine) > 4
    assert [k for k in mine if not torch.equal(mine[k], theirs[k])] == []
    _check_both_trained_to_the_end(nodes, grown, newest)


def test_a_sharded_learner_group_grows_back_when_its_lost_node_returns(nodes: Nodes) -> None:
    """As above with the learner's two ranks sharded (``parallel: fsdp``): replica 0 trains on
    whole after node 1's loss; once node 1 is back the group grows to [0, 1], replica 1 takes
    replica 0's state (links of its whole checkpoints, each naming replica 0's folder), both
    ranks load replica 0's checkpoint resharded to two, and the run completes with nothing
    lost, counted twice, repeated or skipped; each rank's checkpoints after the growth hold
    its shards of a group of two, naming both ranks' folders."""
    from asyncrl.roles.training.checkpoints import read_values

    grown = _grow_back_and_finish(nodes, "roles.learner.config.parallel=fsdp")
    lead, rejoined, figures = grown.lead, grown.rejoined, grown.figures
    seen = _json(nodes.path(0, "membership.json"))
    assert [(c["event"], c["grown"]) for c in seen["changes"]] == [
        ("node_lost", {}),
        ("node_back", {}),
        ("group_grown", {"learner": [0, 1]}),
    ]
    assert figures["restarts"]["learner"] == 2, nodes.logs()
    with open(nodes.path(1, "logs", "learner.1.jsonl")) as f:
        said = f.read()
    assert "rejoining its group, took the state of learner.0, its lead" in said
    assert "was written by a group of 1 rank(s); loading their shards at a group of 2" in said
    newest = max(_checkpoints(lead) & _checkpoints(rejoined))
    assert newest > grown.copied
    for folder, group in (
        (lead, [".", "../../../node-1/roles/learner.1/checkpoints"]),
        (rejoined, ["../../../../roles/learner.0/checkpoints", "."]),
    ):
        values = read_values(os.path.join(folder, f"step-{newest:08d}"))
        assert (values["world"], values["group"]) == (2, group)
    _check_both_trained_to_the_end(nodes, grown, newest)


def test_a_learner_group_told_to_stay_smaller_stays_so_when_its_node_returns(
    nodes: Nodes,
) -> None:
    """As above with ``roles.learner.supervision.regrow: false``: node 1 comes back, node 0
    says the group stays at replica 0, nothing restarts, and the run completes at one rank."""
    started = time.monotonic()
    back = _launch_and_bring_back(nodes, "roles.learner.supervision.regrow=false")
    said = (
        "learner stays at replicas [0] with node 1 back: roles.learner.supervision.regrow is false"
    )

    def stays() -> bool:
        with open(os.path.join(nodes.tmp, "node0.log"), errors="replace") as f:
            return said in f.read()

    nodes.wait("node 0 to say the group stays", stays, timeout=180)
    decided_after = time.monotonic() - back
    at_decision = _steps(nodes)
    figures = _figures(nodes)
    assert at_decision < RL_STEPS, "the run ended before node 1 was back"
    seen = _json(nodes.path(0, "membership.json"))
    assert seen["shrunk"] == {"learner": [0]}
    assert seen["departed"] == {"learner": {"1": 1}}
    assert [c["event"] for c in seen["changes"]] == ["node_lost", "node_back"]
    assert (_json(nodes.path(1, "membership.json")) or {})["shrunk"] == {"learner": [0]}
    assert figures["restarts"]["learner"] == 1, nodes.logs()  # the shrink's restart alone
    assert not os.path.exists(nodes.path(1, "roles", "learner.1", "rejoin.json"))
    assert nodes.tracebacks() == [], nodes.logs()
    print(
        f"node 0 said the group stays {decided_after:.1f} s after node 1's torchrun started "
        f"again, at step {at_decision}; {time.monotonic() - started:.0f} s in all; {figures}"
    )
