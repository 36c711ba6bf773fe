"""The README's main job over two simulated nodes (``examples/arith/multinode.yaml``), shortened
as ``test_arith`` shortens it: the rollouts and a weight relay on node 1 (another host: no shared
memory with node 0), two data-parallel learners, one per node. It must learn as the one-node run
does, and every sample be consumed once."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.multinode_runs import two_nodes
from tests.conftest import ROOT
from tests.integration.test_arith import SHORT, reward_rises

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_main_job_learns_across_two_nodes(run_dir: str) -> None:
    two_nodes(ROOT, run_dir, tuple(SHORT))
    run = os.path.join(run_dir, "two")
    with open(os.path.join(run, "history.jsonl")) as f:
        history = [json.loads(line) for line in f]
    assert reward_rises(history)
    with open(os.path.join(run, "summary.json")) as f:
        summary = json.load(f)
    assert summary["nodes"] == 2
    assert summary["learner_steps"] == 360
    assert summary["samples_consumed"] == 60 * 32 * 8
    # Node 1's rollouts read the weights its relay pulled: the relay's handle is in node 1's
    # directory, under the learner's name.
    assert os.path.exists(os.path.join(run, "node-1", "weights", "learner.json"))
