"""Over several nodes, each node whose replicas read ``weights_from: X`` runs X's lead or a relay
of X (``asyncrl.manifest.refs.weight_host_problems``): refused at load otherwise, naming the node
and the fix, instead of a run that waits on version 0 until its stall timeout."""

from __future__ import annotations

import os

import pytest

from asyncrl.manifest.load import ManifestError, load_manifest, parse_manifest
from asyncrl.manifest.refs import RELAY_CLASS
from tests.conftest import ROOT
from tests.integration.test_node_loss import _learner_over_nodes_0_and_1

MULTINODE3 = os.path.join(ROOT, "examples", "arith", "multinode3.yaml")


def _problems(path: str, overrides: list[str]) -> list[str]:
    with pytest.raises(ManifestError) as info:
        load_manifest(path, overrides, check_files=False)
    return info.value.problems


def _parsed_problems(text: str) -> list[str]:
    with pytest.raises(ManifestError) as info:
        parse_manifest(text)
    return info.value.problems


def test_the_learners_lead_moved_off_node_0_without_a_relay_there_is_refused() -> None:
    problems = _problems(MULTINODE3, ["roles.learner.placement.node=1"])
    assert problems == [
        "roles.rollout.placement: node 0 runs rollout[0] (weights_from: learner) but neither "
        "learner's replica 0, which publishes its weights into its own host's shared memory "
        "(on node 1), nor a relay of learner, so they never get its weights; place a relay "
        "there (roles.relay0: {class: asyncrl.roles.services.relay:Relay, placement: {node: 0}, "
        "config: {source: learner}}), or move them to a node that has one (node 1: learner[0], "
        "relay1; node 2: relay2)"
    ]


def test_the_fix_the_problem_names_is_accepted() -> None:
    fix = (
        f"roles.relay0={{class: '{RELAY_CLASS}', placement: {{node: 0}}, "
        "config: {source: learner}}"
    )
    manifest = load_manifest(MULTINODE3, ["roles.learner.placement.node=1", fix], check_files=False)
    assert manifest.roles["relay0"].placement.node == 0


def test_multinode3_and_the_regrow_layouts_are_accepted(tmp_path: object) -> None:
    assert load_manifest(MULTINODE3, check_files=False).roles["rollout"].placement.nodes == [
        0,
        1,
        2,
    ]
    # With the lead (replica 0) on node 1, the layout has a relay on node 0 (relay0).
    for nodes, placed in (("[0, 1]", [0, 1]), ("[1, 0]", [1, 0])):
        path = _learner_over_nodes_0_and_1(str(tmp_path), nodes)
        assert load_manifest(path, check_files=False).roles["learner"].placement.nodes == placed


def test_each_node_is_named_once_with_every_replica_there() -> None:
    text = (
        "run: {name: demo, program: flow}\nroles:\n"
        "  learner: {class: a:B, placement: {node: 2}}\n"
        "  rollout: {class: a:B, replicas: 4, placement: {nodes: [0, 1]}, "
        "config: {weights_from: learner}}\n"
        "  judge: {class: a:B, placement: {node: 1}, config: {weights_from: learner}}\n"
        f"  relay: {{class: '{RELAY_CLASS}', placement: {{nodes: [0, 1]}}}}\n"
    )
    # The relay's one replica (source: learner by default) covers node 0 only: node 1 is its
    # fallback after a loss.
    (problem,) = _parsed_problems(text)
    assert problem.startswith(
        "roles.rollout.placement: node 1 runs rollout[1], rollout[3], judge[0] "
        "(weights_from: learner) but neither learner's replica 0"
    )
    assert problem.endswith("(node 0: relay; node 2: learner[0])")


def test_a_single_replicas_fallback_nodes_and_other_relays_sources_do_not_count() -> None:
    text = (
        "run: {name: demo, program: flow}\nroles:\n"
        "  learner: {class: a:B, placement: {nodes: [0, 1]}}\n"
        "  critic: {class: a:B}\n"
        "  rollout: {class: a:B, placement: {nodes: [1, 0]}, config: {weights_from: learner}}\n"
        f"  relay: {{class: '{RELAY_CLASS}', placement: {{node: 1}}, config: {{source: critic}}}}\n"
    )
    (problem,) = _parsed_problems(text)
    assert problem.startswith("roles.rollout.placement: node 1 runs rollout[0] (weights_from:")


def test_one_machine_and_chains_of_readers_are_unaffected() -> None:
    one_machine = (
        "run: {name: demo, program: flow}\nroles:\n  learner: {class: a:B}\n"
        "  rollout: {class: a:B, replicas: 3, config: {weights_from: learner}}\n"
    )
    assert parse_manifest(one_machine).roles["rollout"].replicas == 3
    # Only a reader of the chain's end is checked: mirror reads rollout, which reads learner.
    chain = (
        "run: {name: demo, program: flow}\nroles:\n  learner: {class: a:B}\n"
        "  rollout: {class: a:B, config: {weights_from: learner}}\n"
        "  mirror: {class: a:B, placement: {node: 1}, config: {weights_from: rollout}}\n"
    )
    assert parse_manifest(chain).roles["mirror"].placement.node == 1
