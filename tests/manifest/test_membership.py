"""What becomes of each replica of a node lost for good (``asyncrl.manifest.membership.plan``)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from asyncrl.manifest.load import ManifestError, parse_manifest
from asyncrl.manifest.membership import MEMBERSHIP_FILE, Membership, Moved, goes_on, lead, plan

MANIFEST = """\
run: {name: elastic, program: "examples.hello.program:main"}
roles:
  rollout:
    class: examples.hello.roles:Splitter
    replicas: 3
    placement: {nodes: [0, 1, 2]}
  reward:
    class: examples.hello.roles:Counter
    placement: {nodes: [2, 1, 0]}
  relay:
    class: examples.hello.roles:Counter
    placement: {node: 2}
  learner:
    class: examples.hello.roles:Counter
    replicas: 2
    placement: {nodes: [0, 1]}
    supervision: {strategy: one_for_all}
"""


def test_a_lost_node_s_singletons_move_to_the_next_candidate_and_its_replicas_depart() -> None:
    manifest = parse_manifest(MANIFEST, nodes=3)
    two = plan(manifest, {2})
    assert two.moved == {("reward", 0): 1}  # the first candidate after node 2 that is not lost
    assert two.departed == {("rollout", 2): 2, ("relay", 0): 2}  # no candidate: it departs
    assert two.blocked == []
    both = plan(manifest, {1, 2})
    assert both.moved == {("reward", 0): 0}
    assert both.departed == {
        ("rollout", 1): 1,
        ("rollout", 2): 2,
        ("relay", 0): 2,
        ("learner", 1): 1,
    }


def test_a_group_over_a_lost_node_shrinks_to_the_replicas_left() -> None:
    """The learner's rank on node 1 departs and the group goes on with replica 0 alone; with a
    third rank on node 2, losing node 1 leaves replicas 0 and 2 (ranks 0 and 1 now)."""
    manifest = parse_manifest(MANIFEST, nodes=3)
    one = plan(manifest, {1})
    assert one.blocked == []
    assert one.shrunk == {"learner": [0]}
    assert one.departed == {("learner", 1): 1, ("rollout", 1): 1}
    three = parse_manifest(
        MANIFEST.replace(
            "replicas: 2\n    placement: {nodes: [0, 1]}",
            "replicas: 3\n    placement: {nodes: [0, 1, 2]}",
        ),
        nodes=3,
    )
    assert plan(three, {1}).shrunk == {"learner": [0, 2]}
    assert plan(three, {1, 2}).shrunk == {"learner": [0]}
    assert plan(manifest, {2}).shrunk == {}  # no rank of it was there
    # Node 1 came back (its rank stays out of the group), then node 2 is lost: replica 0 is
    # left; node 1 lost again takes no rank of the group with it.
    assert plan(three, {2}, members={"learner": [0, 2]}).shrunk == {"learner": [0]}
    again = plan(three, {1}, members={"learner": [0, 2]})
    assert (again.shrunk, again.departed) == ({}, {("rollout", 1): 1})


def test_a_group_whose_lead_is_lost_goes_on_led_by_the_lowest_replica_left() -> None:
    """Replica 0 (the group's lead) on node 1: losing node 1 leaves replica 1, which leads the
    group from then on; with three ranks, replicas 1 and 2 (ranks 0 and 1 now). Losing the node
    of the new lead in turn moves the lead again."""
    led_by_1 = parse_manifest(MANIFEST.replace("nodes: [0, 1]}", "nodes: [1, 0]}"), nodes=3)
    one = plan(led_by_1, {1})
    assert (one.blocked, one.shrunk) == ([], {"learner": [1]})
    assert one.departed == {("learner", 0): 1, ("rollout", 1): 1}
    three = parse_manifest(
        MANIFEST.replace(
            "replicas: 2\n    placement: {nodes: [0, 1]}",
            "replicas: 3\n    placement: {nodes: [1, 2, 0]}",
        ),
        nodes=3,
    )
    assert plan(three, {1}).shrunk == {"learner": [1, 2]}
    again = plan(three, {2}, members={"learner": [1, 2]})
    assert (again.blocked, again.shrunk) == ([], {"learner": [2]})
    assert again.departed == {("learner", 1): 2, ("rollout", 2): 2, ("relay", 0): 2}


def test_a_group_with_no_rank_left_or_sharded_or_node_0_blocks_the_plan() -> None:
    manifest = parse_manifest(MANIFEST, nodes=3)
    assert plan(manifest, {0}).blocked == [
        "node 0 (the store's host, which runs the driver) was lost"
    ]
    on_1_and_2 = parse_manifest(MANIFEST.replace("nodes: [0, 1]}", "nodes: [1, 2]}"), nodes=3)
    assert plan(on_1_and_2, {1, 2}).blocked == [
        "roles.learner: its 2 replicas form one group over nodes [1, 2], and no rank of it is left"
    ]
    assert plan(on_1_and_2, {2}, members={"learner": [1]}).blocked == [
        "roles.learner: its 2 replicas form one group over nodes [1, 2], and no rank of it is left"
    ]
    fsdp = MANIFEST + "    config: {parallel: fsdp}\n"
    assert plan(parse_manifest(fsdp, nodes=3), {1}).blocked == [
        "roles.learner: its 2 replicas form one group over nodes [0, 1], sharded (parallel: "
        "fsdp) without run.shared_storage: the lost ranks' shards of its state may be gone "
        "with them"
    ]


def test_a_sharded_group_shrinks_when_the_run_directory_is_shared() -> None:
    """With ``run.shared_storage`` the ranks left read the lost ranks' shards: an FSDP group
    goes on at the smaller size as a replicated one does, and one led from node 1 goes on led
    by replica 1."""
    shared = MANIFEST.replace("{name: elastic,", "{name: elastic, shared_storage: true,")
    fsdp = parse_manifest(shared + "    config: {parallel: fsdp}\n", nodes=3)
    assert fsdp.run.shared_storage is True
    with pytest.raises(ManifestError) as refused:
        parse_manifest(MANIFEST.replace("{name: elastic,", "{name: elastic, shared_storage: 1,"))
    assert refused.value.problems == ["run.shared_storage: expected true or false, got 1"]
    one = plan(fsdp, {1})
    assert (one.blocked, one.shrunk) == ([], {"learner": [0]})
    assert one.departed == {("learner", 1): 1, ("rollout", 1): 1}
    led_by_1 = parse_manifest(
        shared.replace("nodes: [0, 1]}", "nodes: [1, 0]}") + "    config: {parallel: fsdp}\n",
        nodes=3,
    )
    again = plan(led_by_1, {1})
    assert (again.blocked, again.shrunk) == ([], {"learner": [1]})


def test_a_group_s_lead_is_the_first_of_its_members_in_the_node_s_membership(
    tmp_path: Path,
) -> None:
    """``lead`` reads the node's ``membership.json``: replica 0 without one, the first of the
    group's members once it went on smaller, at the address a replica back on its node
    published."""
    endpoints = ["tcp://a:1", "tcp://b:2", "tcp://c:3"]
    assert lead(str(tmp_path), "learner", endpoints) == (0, "tcp://a:1")
    membership = Membership(shrunk={"learner": [1, 2]}, departed={"learner": {0: 1}})
    path = tmp_path / MEMBERSHIP_FILE
    path.write_bytes(msgspec.json.encode(membership))
    assert lead(str(tmp_path), "learner", endpoints) == (1, "tcp://b:2")
    assert lead(str(tmp_path), "critic", endpoints) == (0, "tcp://a:1")
    membership.moved = {"learner": {1: Moved(node=2, endpoint="tcp://d:4")}}
    path.write_bytes(msgspec.json.encode(membership))
    assert lead(str(tmp_path), "learner", endpoints) == (1, "tcp://d:4")
    assert goes_on("learner", [1, 2]) == "learner goes on with replicas [1, 2], led by replica 1"
    # A damaged file says so: never replica 0 in silence, which may be on a lost node.
    path.write_bytes(b'{"shrunk": {"learner": [1')
    with pytest.raises(ValueError) as caught:
        lead(str(tmp_path), "learner", endpoints)
    assert str(caught.value) == (
        f"{path}: not a membership file (Input data was truncated); the node's agent writes "
        f"it whole as the run's membership changes, so it was damaged: stop the run and resume "
        f"it (asyncrl run --resume), whose agents write it again"
    )
    assert goes_on("learner", [0]) == "learner goes on with replicas [0]"


def test_a_group_that_cannot_survive_a_node_is_warned_of_at_load_with_the_fix() -> None:
    from asyncrl.manifest.membership import node_loss_warnings

    manifest = parse_manifest(MANIFEST, nodes=3)
    assert node_loss_warnings(manifest, 3) == []  # it shrinks
    fsdp = parse_manifest(MANIFEST + "    config: {parallel: fsdp}\n", nodes=3)
    assert node_loss_warnings(fsdp, 3) == [
        "roles.learner: its 2 replicas form one group over nodes [0, 1], sharded (parallel: "
        "fsdp), which does not go on at a smaller size without run.shared_storage: each rank's "
        "checkpoint holds only its own shards: losing node 1 restarts every node, and the run "
        "resumes once the node is back (after --join-timeout it fails). Its write-ahead log and "
        "checkpoints, which the resume replays, are in RUN_DIR/node-1: keep the run directory "
        "on storage every node shares. To keep training through a node's loss, set "
        "run.shared_storage: true with the run directory on storage every node shares (the "
        "ranks left then read the lost ranks' shards), use parallel: replicate, or place the "
        "group on node 0"
    ]
    shared = MANIFEST.replace("{name: elastic,", "{name: elastic, shared_storage: true,")
    fsdp_shared = parse_manifest(shared + "    config: {parallel: fsdp}\n", nodes=3)
    assert node_loss_warnings(fsdp_shared, 3) == []  # it shrinks
    led_by_1 = parse_manifest(MANIFEST.replace("nodes: [0, 1]}", "nodes: [1, 0]}"), nodes=3)
    assert node_loss_warnings(led_by_1, 3) == []  # it goes on, led by replica 1


def test_a_singleton_goes_by_where_it_runs_now_not_by_its_placement() -> None:
    """The reward moved to node 1 at node 2's loss, and node 2 came back: losing node 1 moves
    it again, to its first candidate not lost (node 2, then node 0 with both lost); losing
    node 2 again leaves it where it runs."""
    without_group = MANIFEST.split("  learner:")[0]
    manifest = parse_manifest(without_group, nodes=3)
    on_1 = {("reward", 0): 1}
    one = plan(manifest, {1}, on_1)
    assert one.moved == {("reward", 0): 2}
    assert one.departed == {("rollout", 1): 1}
    assert plan(manifest, {1, 2}, on_1).moved == {("reward", 0): 0}
    two = plan(manifest, {2}, on_1)
    assert two.moved == {}
    assert two.departed == {("rollout", 2): 2, ("relay", 0): 2}
    assert plan(manifest, {1}).moved == {}  # by its placement alone it is on node 2


SHARED = MANIFEST.replace("{name: elastic,", "{name: elastic, shared_storage: true,")
"""The manifest with the run directory on shared storage: a returning rank reads the lead's
state."""


def test_a_group_grows_back_to_its_ranks_on_a_returning_node() -> None:
    """The learner went on with replica 0 after node 1's loss; node 1 back, it grows back to
    [0, 1] with replica 0's state; a node without a rank of it changes nothing. With three
    ranks and two nodes out, node 2's return brings replica 2 back alone."""
    from asyncrl.manifest.membership import grow

    manifest = parse_manifest(SHARED, nodes=3)
    back = grow(manifest, {"learner": [0]}, 1)
    assert (back.grown, back.lead, back.stays) == ({"learner": [0, 1]}, {"learner": 0}, {})
    nothing = grow(manifest, {"learner": [0]}, 2)
    assert (nothing.grown, nothing.stays) == ({}, {})
    three = parse_manifest(
        SHARED.replace(
            "replicas: 2\n    placement: {nodes: [0, 1]}",
            "replicas: 3\n    placement: {nodes: [0, 1, 2]}",
        ),
        nodes=3,
    )
    assert grow(three, {"learner": [0]}, 2).grown == {"learner": [0, 2]}
    assert grow(three, {"learner": [0, 2]}, 1).grown == {"learner": [0, 1, 2]}


def test_a_replicated_group_grows_back_without_shared_storage() -> None:
    """Without run.shared_storage a replicated group grows back as with it (the lead sends
    its state over the group: ``asyncrl.roles.training.rejoin``)."""
    from asyncrl.manifest.membership import grow

    for text in (MANIFEST, SHARED):
        growth = grow(parse_manifest(text, nodes=3), {"learner": [0]}, 1)
        assert (growth.grown, growth.lead, growth.stays) == (
            {"learner": [0, 1]},
            {"learner": 0},
            {},
        )


def test_a_group_stays_smaller_when_sharded_without_shared_storage_or_when_told() -> None:
    """Each reason a group stays at its smaller size when its node comes back, said."""
    from asyncrl.manifest.membership import grow

    def stays(text: str, members: list[int]) -> str:
        growth = grow(parse_manifest(text, nodes=3), {"learner": members}, 1)
        assert growth.grown == {}
        return growth.stays["learner"]

    assert stays(MANIFEST + "    config: {parallel: fsdp}\n", [0]) == (
        "it is sharded (parallel: fsdp) and the run directory is not on shared storage "
        "(run.shared_storage: false), so a returning rank cannot read the lead's shards"
    )
    no_regrow = SHARED.replace(
        "supervision: {strategy: one_for_all}",
        "supervision: {strategy: one_for_all, regrow: false}",
    )
    assert stays(no_regrow, [0]) == "roles.learner.supervision.regrow is false"


def test_a_group_led_from_a_node_other_than_0_grows_back_led_by_its_replica_0_again() -> None:
    """Replica 0 placed on node 1: after node 1's loss the group goes on led by replica 1; when
    node 1 returns the group grows back to [0, 1], replica 0 taking replica 1's state and then
    leading it again."""
    from asyncrl.manifest.membership import grow

    led_from_1 = SHARED.replace("nodes: [0, 1]}", "nodes: [1, 0]}")
    manifest = parse_manifest(led_from_1, nodes=3)
    growth = grow(manifest, {"learner": [1]}, 1)
    assert (growth.grown, growth.lead, growth.stays) == ({"learner": [0, 1]}, {"learner": 1}, {})


def test_a_sharded_group_on_shared_storage_grows_back_and_is_not_warned_of() -> None:
    """A sharded group over nodes 0 and 1 with run.shared_storage goes on smaller after node
    1's loss and grows back when node 1 returns, as a replicated one does, whichever node
    holds replica 0: nothing is warned of as the launch loads. Without shared storage it does
    not go on smaller at all, which the node-loss warning says (every node restarts)."""
    from asyncrl.manifest.membership import grow, node_loss_warnings

    fsdp = SHARED + "    config: {parallel: fsdp}\n"
    manifest = parse_manifest(fsdp, nodes=3)
    growth = grow(manifest, {"learner": [0]}, 1)
    assert (growth.grown, growth.lead, growth.stays) == ({"learner": [0, 1]}, {"learner": 0}, {})
    assert node_loss_warnings(manifest, 3) == []
    led_from_1 = parse_manifest(fsdp.replace("nodes: [0, 1]}", "nodes: [1, 0]}"), nodes=3)
    assert node_loss_warnings(led_from_1, 3) == []
    assert grow(led_from_1, {"learner": [1]}, 1).grown == {"learner": [0, 1]}
    unshared = parse_manifest(MANIFEST + "    config: {parallel: fsdp}\n", nodes=3)
    assert len(node_loss_warnings(unshared, 3)) == 1


def test_a_regrow_that_is_not_a_boolean_is_refused_with_its_path() -> None:
    bad = MANIFEST.replace(
        "supervision: {strategy: one_for_all}", "supervision: {strategy: one_for_all, regrow: 2}"
    )
    with pytest.raises(ManifestError) as raised:
        parse_manifest(bad, nodes=3)
    assert str(raised.value) == (
        "manifest <string> has 1 problem:\n"
        "  roles.learner.supervision.regrow: expected true or false, got 2"
    )
