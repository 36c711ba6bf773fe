"""Two node ranks on one host, without ``ASYNCRL_HOST_ID``: the README's main job over two
nodes (``examples/arith/multinode.yaml``, shortened), both torchrun processes on 127.0.0.1.

Node 1 holds the rollout replicas and a relay; the learner that publishes is on node 0. Both
nodes have the same host id, so the relay copies nothing, and node 1's rollouts must read the
learner's own store: node 1's ``weights`` folder links to node 0's (``asyncrl.supervision.hosts``).
Before that, node 1's rollouts never found a handle, held version 0, and the program failed with
``StallError`` after 300 s at its first wait for a new version.
"""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.multinode_runs import two_nodes
from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1000)]  # two_nodes waits up to 900 s


def test_two_node_ranks_on_one_host_share_the_learners_weight_store(tmp_path: object) -> None:
    # Neither node has ASYNCRL_HOST_ID; a node that fails raises with the end of its log.
    two_nodes(ROOT, str(tmp_path), one_host=True)
    run_dir = os.path.join(str(tmp_path), "two")
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
