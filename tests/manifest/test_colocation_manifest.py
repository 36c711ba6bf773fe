"""Roles sharing a device in the manifest: memory shares, and the refusal of shares over 1."""

from __future__ import annotations

import pytest

from asyncrl.errors import ManifestError
from asyncrl.manifest.load import Placement, parse_manifest
from asyncrl.manifest.placement import same_device, sharing_problems

HEAD = "run: {name: shared, program: flow}\nroles:\n"


def _role(name: str, placement: str, replicas: int = 1) -> str:
    return f"  {name}:\n    class: m:C\n    replicas: {replicas}\n    placement: {placement}\n"


def test_a_placement_reads_its_memory_share_and_release() -> None:
    text = HEAD + _role(
        "learner", "{device: cuda:0, memory_fraction: 0.6, release_when_idle: true}"
    )
    text += _role("reference", "{device: cuda, memory_fraction: 0.4}")
    m = parse_manifest(text)
    assert m.roles["learner"].placement == Placement(
        device="cuda:0", memory_fraction=0.6, release_when_idle=True
    )
    assert m.roles["reference"].placement.memory_fraction == 0.4
    assert m.roles["reference"].placement.release_when_idle is False
    assert parse_manifest(HEAD + _role("a", "{}")).roles["a"].placement.memory_fraction is None


def test_shares_over_1_on_one_device_are_refused_naming_device_roles_and_sum() -> None:
    text = HEAD + _role("learner", "{device: cuda:0, memory_fraction: 0.6}")
    text += _role("reference", "{device: cuda, memory_fraction: 0.3}")
    text += _role("critic", "{device: 'cuda:0', memory_fraction: 0.25}")
    text += _role("rollout", "{device: cuda:1, memory_fraction: 0.9}")
    with pytest.raises(ManifestError) as err:
        parse_manifest(text, "shared.yaml")
    assert str(err.value) == (
        "manifest shared.yaml has 1 problem:\n"
        "  roles.learner.placement.memory_fraction: learner (1 replica x 0.6), reference "
        "(1 replica x 0.3), critic (1 replica x 0.25) share device cuda:0 on node 0 with "
        "memory fractions summing to 1.15, over 1; lower their memory_fraction so that the "
        "shares on cuda:0 sum to at most 1, or place a role on another device"
    )


def test_replicas_count_once_each_and_nodes_are_separate_devices() -> None:
    # Two replicas on one device take two shares.
    two = HEAD + _role("rollout", "{device: cpu, memory_fraction: 0.6}", replicas=2)
    with pytest.raises(ManifestError) as err:
        parse_manifest(two, "two.yaml")
    assert str(err.value) == (
        "manifest two.yaml has 1 problem:\n"
        "  roles.rollout.placement.memory_fraction: rollout (2 replicas x 0.6) share device "
        "cpu:0 on node 0 with memory fractions summing to 1.2, over 1; lower their "
        "memory_fraction so that the shares on cpu:0 sum to at most 1, or place a role on "
        "another device"
    )
    # Spread over two nodes, each node's device holds one share.
    spread = HEAD + _role("rollout", "{nodes: [0, 1], memory_fraction: 0.6}", replicas=2)
    assert parse_manifest(spread).roles["rollout"].replicas == 2
    # Exactly 1 is allowed; a role without a share is not counted.
    full = HEAD + _role("a", "{memory_fraction: 0.5}") + _role("b", "{memory_fraction: 0.5}")
    full += _role("c", "{device: cpu}")
    assert parse_manifest(full).roles["c"].placement.memory_fraction is None


def test_a_share_outside_0_1_is_reported_with_the_other_problems() -> None:
    text = HEAD + _role("a", "{memory_fraction: 0}") + _role("b", "{memory_fraction: 1.5}")
    text += _role("c", "{memory_fraction: 0.7, nodes: [0, 0]}")
    text += _role("d", "{memory_fraction: 0.7}")
    with pytest.raises(ManifestError) as err:
        parse_manifest(text, "bad.yaml")
    assert str(err.value).splitlines() == [
        "manifest bad.yaml has 4 problems:",
        "  roles.a.placement.memory_fraction: expected a share of the device's memory in "
        "(0, 1], got 0",
        "  roles.b.placement.memory_fraction: expected a share of the device's memory in "
        "(0, 1], got 1.5",
        "  roles.c.placement.nodes[1]: node 0 is listed twice; list each node once (the "
        "replicas go round-robin over the list)",
        "  roles.c.placement.memory_fraction: c (1 replica x 0.7), d (1 replica x 0.7) share "
        "device cpu:0 on node 0 with memory fractions summing to 1.4, over 1; lower their "
        "memory_fraction so that the shares on cpu:0 sum to at most 1, or place a role on "
        "another device",
    ]


def test_sharing_problems_skip_malformed_values() -> None:
    roles = {
        "a": {"placement": {"memory_fraction": "half"}},
        "b": {"placement": {"memory_fraction": 0.9, "device": 3}},
        "c": {"replicas": "2", "placement": {"memory_fraction": 0.9}},
        "d": "not a mapping",
        "e": {"placement": {"memory_fraction": 0.9}},
    }
    assert sharing_problems(roles) == []
    assert sharing_problems(["not", "a", "mapping"]) == []
    assert same_device("cuda") == "cuda:0" and same_device("cuda:3") == "cuda:3"
