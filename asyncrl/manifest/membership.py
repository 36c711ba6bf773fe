"""Which node runs which replica once nodes of a launch are lost for good: the run's membership.

A launch over several nodes (``asyncrl.supervision.multinode``) keeps running when a node other
than the store's host (node 0) is lost. ``plan`` says, from the manifest and from where the
replicas that moved at earlier losses run now, what becomes of each replica that runs on a lost
node, so every node reaches the same answer without asking:

- a role with one replica (a reward, a prompt source, a reference, a relay) *moves* to the first
  node of its ``placement.nodes`` that is not lost (the candidates, in order), and starts there
  again from its durable state, which lives in its home node's folder of the run directory. One
  that moved at an earlier loss runs where it went: when that node is lost in turn, it moves
  again, to the first candidate not lost then;
- a replica of a role with several (rollouts, environments) *departs*: it leaves its group, and
  the calls it held run again on the others under their delivery class;
- a role whose replicas span nodes as one ``one_for_all`` unit (a ``torch.distributed`` group:
  data-parallel learners or critics) *shrinks*: its ranks on the lost node depart, and the
  replicas left (``Plan.shrunk``) form the group again at the smaller size, each restarted
  where it runs, from its checkpoints and write-ahead log (a replicated rank holds the whole
  state). The first of them leads the group (``lead``): when the lead is lost, the lowest
  replica left leads from then on. A sharded one (``config.parallel: fsdp``) shrinks only with
  ``run.shared_storage``: each rank's checkpoint holds only its own shards, which the ranks left
  read from the lost node's folder. Two such groups *block* (the launch restarts every node's
  worker group, as for the store's host): a sharded one without ``run.shared_storage`` (the
  lost ranks' shards may be gone with their node), and one with no rank left.

When a node whose ranks a group went on without comes back, node 0 decides whether the group
*grows* back (``grow``): with the role's ``supervision.regrow`` (the default), a group re-forms
with its ranks on that node again, in rank order, each returning rank first taking the lead's
state (``Rejoin``: its checkpoints, write-ahead log and step ledger, read from the lead's folder
with ``run.shared_storage``, sent by the lead over the group's collectives without it; a
sharded group, which shrinks only with shared storage, reads them), and the lowest replica
leads it again (a returning replica 0 takes the lead back from the replica that led while it
was out); otherwise it stays at its smaller size, and ``grow`` says why.

``Membership`` is what each node's agent writes into its folder (``membership.json``) as the
run's membership changes; the driver follows it (``asyncrl.dispatch.Dispatcher.apply``), a role
that calls a group's lead finds it there (``lead``), and ``asyncrl status`` shows it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from asyncrl.manifest.load import Manifest

__all__ = [
    "MEMBERSHIP_FILE",
    "REJOIN_FILE",
    "Change",
    "Growth",
    "Membership",
    "Moved",
    "Plan",
    "Rejoin",
    "goes_on",
    "grow",
    "grows",
    "grows_back",
    "lead",
    "node_loss_warnings",
    "plan",
    "sharded",
    "spans_nodes",
]

MEMBERSHIP_FILE = "membership.json"
"""The file in each node's folder of the run directory that holds its ``Membership``."""

REJOIN_FILE = "rejoin.json"
"""The file in a returning rank's own folder (``RUN_DIR/node-R/roles/<role>.<replica>/``) that
its node's agent writes before it starts the rank into a group that grows back: a ``Rejoin``.
The rank takes the lead's state, then removes it."""


class Rejoin(msgspec.Struct, kw_only=True, frozen=True):
    """What a rank that rejoins its group takes its state from (``REJOIN_FILE``).

    Attributes:
        lead: the replica that led the group while the rank was out; its checkpoints,
            write-ahead log and step ledger are the group's state now.
        folder: the folder of the node the lead runs on, as the rank's node reaches it: the
            lead's files are under it where the run directory is on shared storage.
        shared: the run directory is on storage every node shares (``run.shared_storage``):
            the rank reads the lead's files under ``folder``. Otherwise the lead sends them
            to it over the group's collectives as the group forms
            (``asyncrl.roles.training.rejoin``).
    """

    lead: int
    folder: str
    shared: bool = True


class Moved(msgspec.Struct, frozen=True):
    """Where a moved replica runs now.

    Attributes:
        node: the node that runs it.
        endpoint: its address as the reading node reaches it (ipc on that node, tcp elsewhere).
    """

    node: int
    endpoint: str


class Change(msgspec.Struct, kw_only=True, frozen=True):
    """One change of membership, as ``metrics.jsonl`` and ``asyncrl status`` record it.

    Attributes:
        time: when the node's agent applied it (seconds since the epoch).
        event: ``node_lost``, ``node_back`` (its torchrun started again, it joined the
            running attempt; ``moved`` then names its replicas, back on it), or
            ``group_grown`` (groups that went on without its ranks re-form with them: ``grown``).
        node: the node it concerns.
        reason: why (``no heartbeat for 6 s``).
        departed: the replicas that left the run with it (``rollout[2]``).
        moved: the replicas started again elsewhere, with the node that now runs each.
        shrunk: each group that went on at a smaller size, with the replicas that form it now.
        grown: each group that grew back, with the replicas that form it now.
    """

    time: float
    event: str
    node: int
    reason: str
    departed: list[str] = []
    moved: dict[str, int] = {}
    shrunk: dict[str, list[int]] = {}
    grown: dict[str, list[int]] = {}


class Membership(msgspec.Struct, kw_only=True):
    """The run's membership as one node sees it.

    Attributes:
        attempt: the launch's attempt.
        nodes: how many nodes the launch started with.
        lost: every node lost for good, with why.
        departed: per role, each replica that left the run, with the node it was on.
        moved: per role, each replica that runs at another address than at the start: on
            another node than its manifest's, or back on its node after it was lost.
        shrunk: per data-parallel group that went on at a smaller size, the replicas that
            form it now (in rank order: a replica's rank is its place in the list).
        changes: every change so far, oldest first.
    """

    attempt: int = 0
    nodes: int = 1
    lost: dict[int, str] = {}
    departed: dict[str, dict[int, int]] = {}
    moved: dict[str, dict[int, Moved]] = {}
    shrunk: dict[str, list[int]] = {}
    changes: list[Change] = []


@dataclass
class Plan:
    """What becomes of the replicas of the lost nodes (``plan``).

    Attributes:
        moved: (role, replica) -> the node that runs it now.
        departed: (role, replica) -> the lost node it was on.
        shrunk: role -> the replicas of its data-parallel group that remain, in rank order
            (its replicas on the lost nodes are in ``departed``).
        blocked: why the run cannot go on without the lost nodes (empty when it can).
    """

    moved: dict[tuple[str, int], int] = field(default_factory=dict)
    departed: dict[tuple[str, int], int] = field(default_factory=dict)
    shrunk: dict[str, list[int]] = field(default_factory=dict)
    blocked: list[str] = field(default_factory=list)


def spans_nodes(manifest: Manifest, name: str) -> bool:
    """Whether ``name``'s replicas form one ``one_for_all`` group over several nodes (a
    data-parallel learner's or critic's ``torch.distributed`` group)."""
    role = manifest.roles[name]
    where = {role.placement.node_of(i) for i in range(role.replicas)}
    return role.supervision.strategy == "one_for_all" and len(where) > 1


def sharded(manifest: Manifest, name: str) -> bool:
    """Whether ``name``'s ranks each hold only their shards of its state (``config.parallel:
    fsdp``): a group that goes on without one of them only where the others read its shards
    (``run.shared_storage``)."""
    return manifest.roles[name].config.get("parallel") == "fsdp"


def plan(
    manifest: Manifest,
    lost: set[int],
    runs_on: Mapping[tuple[str, int], int] | None = None,
    members: Mapping[str, Sequence[int]] | None = None,
) -> Plan:
    """What becomes of every replica that runs on a node of ``lost`` (see the module's
    docstring).

    Args:
        manifest: the run's manifest; a replica runs where its placement puts it unless
            ``runs_on`` says otherwise.
        lost: the nodes lost for good and not back.
        runs_on: (role, replica) -> the node it runs on now, for each replica that runs
            elsewhere than its placement (it moved at an earlier loss: the run's current
            membership); None: every replica runs where its placement puts it.
        members: role -> the replicas that form its data-parallel group now, for each group
            that went on at a smaller size at an earlier loss (``Membership.shrunk``); its
            other replicas are out of it already, whether their node is lost or back.

    Node 0 runs the driver and the store: with node 0 in ``lost`` the plan is blocked.
    """
    out = Plan()
    if 0 in lost:
        out.blocked.append("node 0 (the store's host, which runs the driver) was lost")
        return out
    now, groups = runs_on or {}, members or {}
    for name, role in manifest.roles.items():
        where = [now.get((name, i), role.placement.node_of(i)) for i in range(role.replicas)]
        live = list(groups.get(name, range(role.replicas)))
        gone = [i for i in live if where[i] in lost]
        if not gone:
            continue
        if role.supervision.strategy == "one_for_all" and len(set(where)) > 1:
            group = f"roles.{name}: its {role.replicas} replicas form one group over nodes "
            group += f"{sorted(set(where))}"
            if len(gone) == len(live):
                out.blocked.append(f"{group}, and no rank of it is left")
            elif sharded(manifest, name) and not manifest.run.shared_storage:
                out.blocked.append(
                    f"{group}, sharded (parallel: fsdp) without run.shared_storage: the lost "
                    f"ranks' shards of its state may be gone with them"
                )
            else:
                out.shrunk[name] = [i for i in live if i not in gone]
                out.departed |= {(name, i): where[i] for i in gone}
            continue
        for i in gone:
            candidates = [n for n in role.placement.nodes if n not in lost]
            if role.replicas == 1 and candidates:
                out.moved[(name, i)] = candidates[0]
            else:
                out.departed[(name, i)] = where[i]
    return out


@dataclass
class Growth:
    """What becomes of the groups that went on without a node's ranks when the node comes
    back (``grow``).

    Attributes:
        grown: role -> the replicas that form its group again, in rank order (its ranks on the
            returning node among them).
        lead: role -> the replica that led the group while they were out (the returning ranks
            take its state: ``Rejoin``).
        stays: role -> why its group stays at its smaller size.
    """

    grown: dict[str, list[int]] = field(default_factory=dict)
    lead: dict[str, int] = field(default_factory=dict)
    stays: dict[str, str] = field(default_factory=dict)


def grows_back(manifest: Manifest, name: str) -> str:
    """ "" when role ``name``'s group, gone on at a smaller size, grows back when the node of
    its ranks comes back; else why it stays at its smaller size."""
    role = manifest.roles[name]
    if not role.supervision.regrow:
        return f"roles.{name}.supervision.regrow is false"
    if sharded(manifest, name) and not manifest.run.shared_storage:
        return (
            "it is sharded (parallel: fsdp) and the run directory is not on shared storage "
            "(run.shared_storage: false), so a returning rank cannot read the lead's shards"
        )
    return ""


def grow(manifest: Manifest, shrunk: Mapping[str, Sequence[int]], node: int) -> Growth:
    """What becomes of each group in ``shrunk`` (role -> the replicas that form it now,
    ``Membership.shrunk``) now that ``node`` is back: a group with ranks on ``node`` grows back
    to its members and those ranks, in rank order, where ``grows_back`` allows it; otherwise it
    stays, with why. The returning ranks take the state of the replica that leads the group now
    (``Growth.lead``); the grown group is led by its lowest replica, as any group is, which is a
    returning one when a returning rank is below every member (its replica 0 came back)."""
    out = Growth()
    for name, members in shrunk.items():
        role = manifest.roles[name]
        where = [role.placement.node_of(i) for i in range(role.replicas)]
        back = [i for i in range(role.replicas) if where[i] == node and i not in members]
        if not back:
            continue
        why = grows_back(manifest, name)
        grown = sorted({*members, *back})
        if why:
            out.stays[name] = why
            continue
        out.grown[name] = grown
        out.lead[name] = members[0]
    return out


def grows(name: str, members: Sequence[int], node: int) -> str:
    """How a group that grows back is said in the agents' logs and ``asyncrl status``:
    ``learner grows back to replicas [0, 1] (node 1 is back)``."""
    return f"{name} grows back to replicas {list(members)} (node {node} is back)"


def node_loss_warnings(manifest: Manifest, nodes: int) -> list[str]:
    """What a launch of ``manifest`` over ``nodes`` nodes cannot carry through the loss of one
    node other than 0, one warning per role, each with the fix: a ``one_for_all`` group over
    several nodes (data-parallel learners or critics) that does not go on at a smaller size
    (``plan`` blocks): a sharded one without ``run.shared_storage``. Losing one of its nodes
    restarts every node, and the run resumes from its checkpoints once the node is back."""
    warnings = []
    for name, role in manifest.roles.items():
        where = sorted({role.placement.node_of(i) for i in range(role.replicas)})
        others = [n for n in where if 0 < n < nodes]
        if not spans_nodes(manifest, name) or not others:
            continue
        if not sharded(manifest, name) or manifest.run.shared_storage:
            continue
        folders = ", ".join(f"RUN_DIR/node-{n}" for n in others)
        warnings.append(
            f"roles.{name}: its {role.replicas} replicas form one group over nodes {where}, "
            f"sharded (parallel: fsdp), which does not go on at a smaller size without "
            f"run.shared_storage: each rank's checkpoint holds only its own shards: losing "
            f"node {others[0]} restarts every node, and the run resumes once the node is back "
            f"(after --join-timeout it fails). Its write-ahead log and checkpoints, which the "
            f"resume replays, are in {folders}: keep the run directory on storage every node "
            f"shares. To keep training through a node's loss, set run.shared_storage: true "
            f"with the run directory on storage every node shares (the ranks left then read "
            f"the lost ranks' shards), use parallel: replicate, or place the group on node 0"
        )
    return warnings


def goes_on(name: str, members: Sequence[int]) -> str:
    """How a group that went on at a smaller size is said in the agents' logs (``asyncrl
    status`` says it the same way): ``learner goes on with replicas [0]``, and ``, led by
    replica 1`` when its lead is no longer replica 0."""
    said = f"{name} goes on with replicas {list(members)}"
    return said + (f", led by replica {members[0]}" if members and members[0] != 0 else "")


def lead(directory: str, name: str, endpoints: Sequence[str]) -> tuple[int, str]:
    """The replica of role ``name`` that leads its group now, and its address: the first of
    the replicas that form the group (``Membership.shrunk``) as the ``membership.json`` in
    ``directory`` (a node's folder of the run directory) says, replica 0 while the group has
    its full size or the file is not there. A group's lead is the replica its callers reach
    (a learner's ``train_step``, a relay's weight pulls) and the one that publishes its
    weights.

    Args:
        directory: the folder of the node the caller runs on (a role's ``ctx.run_dir``).
        name: the role.
        endpoints: the address of each replica as this node reaches it
            (``GroupInfo.endpoints``); a replica back on its node after a loss is reached at
            the address ``membership.json`` records for it (``Membership.moved``).

    Raises:
        ValueError: the file is there but is not a membership (the agent writes it whole, by
            a rename, so this is damage, not a write in progress).
        OSError: the file is there but cannot be read.
    """
    path = os.path.join(directory, MEMBERSHIP_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return 0, endpoints[0]
    try:
        membership = msgspec.json.decode(data, type=Membership)
    except msgspec.DecodeError as exc:
        raise ValueError(
            f"{path}: not a membership file ({exc}); the node's agent writes it whole as the "
            f"run's membership changes, so it was damaged: stop the run and resume it "
            f"(asyncrl run --resume), whose agents write it again"
        ) from exc
    members = membership.shrunk.get(name) or [0]
    first = members[0]
    moved = membership.moved.get(name, {}).get(first)
    return first, moved.endpoint if moved is not None else endpoints[first]
