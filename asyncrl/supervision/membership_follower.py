"""What one node's agent does as the membership of a launch over several nodes changes.

A launch (``asyncrl.supervision.multinode``) goes on when a node other than node 0 is lost for
good. Node 0 decides it and marks the node lost in the launch's store (``lost/<node>``, with a
generation that counts its losses); a lost node whose torchrun starts again joins the running
attempt and marks itself back (``back/<node>``, with the generation it answers). Every node's
agent runs one ``MembershipFollower``, which looks at the store once a heartbeat (``follow``)
and applies what changed:

- **a node lost:** the replicas that run on it now depart or move as
  ``asyncrl.manifest.membership.plan`` says, given where the replicas that moved run now. A
  replica that moves to this node is started here, from its home node's folder of the run
  directory, on a fresh tcp port that it publishes (``moved/<role>/<replica>``, with the loss it
  answers); a replica that moved away from the node at an earlier loss, and stayed when the node
  came back, is not started a second time; one that moved onto the node moves again. A
  data-parallel group that had ranks there goes on with the replicas left: this node's replicas
  of it are started again at once (``Supervisor.restart_role``), given the group's new
  membership (``NodeView.members``), so that they leave the broken collective and form the
  group at its smaller size, from their checkpoints and write-ahead logs. The first of the
  members leads the group (``asyncrl.manifest.membership.lead``): when the lost node held the
  lead, the lowest replica left leads from then on;
- **a node back:** its replicas that departed are back in their groups, at the endpoints it
  published anew; what moved away while it was lost stays where it went. Node 0 decides which
  data-parallel groups that went on without its ranks grow back with them
  (``asyncrl.manifest.membership.grow``) and says so in the store (``LaunchKeys.grown``); every
  node applies it: its ranks of such a group start again at the larger size
  (``Supervisor.restart_role``), and the returning node starts its ranks, each told to take the
  lead's state first (``asyncrl.manifest.membership.Rejoin``);
- **this node taken as lost while it runs** (its heartbeats reached node 0 too late): ``follow``
  says why it must leave. What moved away from it runs elsewhere now, and its replicas left the
  groups, so it stops its roles rather than run on unseen; torchrun starting it again brings it
  back as any lost node comes back.

Each change goes into this node's ``membership.json``, which its driver follows
(``asyncrl.dispatch.driver.follow_membership``) and ``asyncrl status`` shows; node 0 also
appends it to the run's ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from asyncrl.manifest.load import Manifest
from asyncrl.manifest.membership import (
    MEMBERSHIP_FILE,
    REJOIN_FILE,
    Change,
    Membership,
    Moved,
    Rejoin,
    goes_on,
    grow,
    grows,
    plan,
    spans_nodes,
)
from asyncrl.supervision.agent import NodeView, adopted_child
from asyncrl.supervision.rundir import node_dir
from asyncrl.supervision.store_registry import LaunchKeys, NodeRecord, StoreClient, free_ports
from asyncrl.supervision.supervisor import Supervisor

__all__ = ["MembershipFollower", "lost_generation", "record_change", "write_rejoin"]


class MembershipFollower:
    """One node's view of the run's membership, kept up to date from the launch's store.

    Args:
        store, keys: the launch's store and its keys.
        attempt: the attempt this node takes part in.
        node: this node's rank.
        nodes: how many nodes the launch has.
        manifest: the run's manifest.
        run_dir: the run's (node 0's) directory.
        view: this node's view of the launch (``NodeView``); the endpoints of moved and returned
            replicas are written into its ``groups``, so that processes started later reach them.
        bind_host, host: where this node binds tcp, and the address the others reach it at.
        say: prints one line for a person, ``say(node, message)``.

    Attributes:
        lost: every node lost for good and not back, with why.
        membership: what this node writes into its ``membership.json``.
    """

    def __init__(
        self,
        *,
        store: StoreClient,
        keys: LaunchKeys,
        attempt: int,
        node: int,
        nodes: int,
        manifest: Manifest,
        run_dir: str,
        view: NodeView,
        bind_host: str,
        host: str,
        say: Callable[[int, str], None],
    ) -> None:
        self.store, self.keys, self.attempt, self.node = store, keys, attempt, node
        self.manifest, self.run_dir, self.view = manifest, run_dir, view
        self.bind_host, self.host, self.say = bind_host, host, say
        self.lost: dict[int, str] = {}
        # The generation of each loss in ``lost`` this node applied: node 0's word on a group
        # that grows back names those it had applied, so that a node that applied a later
        # one leaves that node's ranks out of the group as node 0 does.
        self.losses: dict[int, int] = {}
        # Node 0: per data-parallel group over several nodes, the number of its last formation
        # (each loss that takes ranks out of it, each growth back); every word of node 0 that
        # changes a group's members carries the group's new number (``formations``), and each
        # node's ``NodeView.formations`` follows the words it applies.
        self.numbered: dict[str, int] = {}
        self.membership = Membership(attempt=attempt, nodes=nodes)
        # Moved, its endpoint not yet known here: the node it moves to, and the loss (node,
        # generation) that moved it; None for a loss from before this agent started.
        self.moving: dict[tuple[str, int], tuple[int, tuple[int, int]]] = {}
        self.synced = False  # the losses before this agent started are known
        # The returns (node, generation of the loss it answers) whose groups node 0 has not
        # yet said whether they grow back (``LaunchKeys.grown``).
        self.growing: set[tuple[int, int]] = set()
        # Node 0: the returns it has decided on in this attempt, in the order it decided them;
        # each word names those before it (``before``), which every node applies first.
        self.decided: list[tuple[int, int]] = []
        # The returns of other nodes that came before this rejoining node's first look: their
        # words count here only when node 0 decided them after this node's own.
        self.early: set[tuple[int, int]] = set()

    @property
    def dir(self) -> str:
        """This node's folder of the run directory, where its ``membership.json`` is."""
        return node_dir(self.run_dir, self.node)

    def keep_shrunk(
        self,
        shrunk: Mapping[str, Sequence[int]],
        away: Sequence[tuple[str, int]] = (),
        rejoining: int = 0,
    ) -> None:
        """At the attempt's start: the data-parallel groups that went on at a smaller size in an
        earlier attempt (``shrunk``, node 0's record) stay so, their other replicas out of the
        run; ``away``: this node's replicas that departed with its loss in this attempt, which it
        joins again, from the loss of generation ``rejoining`` (0: none): node 0 says which of
        their groups grow back with them. Written into ``membership.json`` when there is any."""
        if rejoining and away:
            self.growing.add((self.node, rejoining))
        for name, members in shrunk.items():
            self.membership.shrunk[name] = list(members)
            role = self.manifest.roles[name]
            for i in range(role.replicas):
                if i not in members:
                    self.membership.departed.setdefault(name, {})[i] = role.placement.node_of(i)
        for name, replica in away:
            self.membership.departed.setdefault(name, {})[replica] = self.node
        if shrunk or away:
            self._write()

    async def mark_lost(self, node: int, reason: str) -> None:
        """Node 0: mark ``node`` lost for good in the store, with ``reason``, at the next
        generation of its losses; every node (this one included) applies it at its next
        ``follow``."""
        key = self.keys.lost(self.attempt, node)
        earlier = await self.store.peek(key)
        generation = 1 + (int(json.loads(earlier)["generation"]) if earlier else 0)
        # The nodes lost with it, as node 0 sees them now: every node plans this loss with
        # them, so that a node that joins again meanwhile moves a singleton where the others do.
        with_ = sorted({*self.lost, node})
        # The groups it takes ranks out of form again under their next number.
        formations = self._number(self._shrinks(node))
        said = {"reason": reason, "generation": generation, "with": with_, "formations": formations}
        await self.store.set(key, json.dumps(said))

    async def follow(self, supervisor: Supervisor) -> str:
        """Apply what node 0 marked lost since the last look, the nodes back, and the endpoints
        of replicas that moved; write ``membership.json`` when anything changed.

        Returns:
            Why this node must leave the attempt (node 0 took it as lost while it ran), or "".

        Raises:
            StoreError: the store stopped answering.
        """
        store, keys, attempt = self.store, self.keys, self.attempt
        if self.node != 0 and await lost_generation(store, keys, attempt, self.node):
            said = json.loads(await store.get(keys.lost(attempt, self.node)))
            return (
                f"node 0 took this node as lost while it ran ({said['reason']}), and the run "
                "went on without it: its roles stop, so that none runs twice"
            )
        changed = False
        if not self.synced:
            changed = await self._learn_moves()
        returned: list[tuple[int, int, NodeRecord]] = []
        for peer in range(1, self.membership.nodes):
            if peer == self.node:
                continue
            lost = await lost_generation(store, keys, attempt, peer)
            if lost and peer not in self.lost:
                said = json.loads(await store.get(keys.lost(attempt, peer)))
                planned = {int(n) for n in said.get("with", ())} | {peer}
                self._form(said)
                await self._lose(supervisor, peer, said["reason"], (peer, lost), planned)
                changed = True
            elif lost and peer in self.lost and self.losses.get(peer) != lost:
                said = json.loads(await store.get(keys.lost(attempt, peer)))
                self._form(said)
                self._lost_again(peer, lost, said["reason"])
                changed = True
            elif not lost and peer in self.lost:
                returned.extend(await self._back(peer))
                changed = True
            elif not lost and not self.synced:  # lost and back before this agent started
                back = await store.peek(keys.back(attempt, peer))
                if back is not None:
                    generation = int(json.loads(back)["generation"])
                    if any(n == self.node for n, _ in self.growing):
                        # This node rejoins too: node 0 may decide that return after this
                        # node's own, from the members this node's ranks grew the group to.
                        self.growing.add((peer, generation))
                        self.early.add((peer, generation))
        self.synced = True
        # Node 0 decides what grows only once every loss it sees in this pass is applied: a
        # group decided from its members before a loss would grow over the lost node's ranks.
        # Each decision goes into a working copy of the groups that are smaller, so that the
        # next return in the same pass is decided from the members the first one grew to.
        shrunk = {name: list(members) for name, members in self.membership.shrunk.items()}
        for node, generation, record in returned:
            await self._decide_growth(node, generation, record, shrunk)
        if await self._apply_growth(supervisor):
            changed = True
        for (name, replica), (node, loss) in list(self.moving.items()):
            said = await store.peek(keys.moved(attempt, name, replica))
            if said is None:
                continue
            published = json.loads(said)
            if published.get("lost") != list(loss):
                continue  # where it ran before this loss moved it again
            node = int(published["node"])
            endpoint = published["endpoint"]
            if node == self.node:
                endpoint = self.view.groups[name].endpoints[replica]
            self._reach(name, replica, endpoint)
            self.membership.moved.setdefault(name, {})[replica] = Moved(node, endpoint)
            del self.moving[(name, replica)]
            changed = True
        if changed:
            self._write()
        return ""

    async def _apply_growth(self, supervisor: Supervisor) -> bool:
        """Apply node 0's words on the returns this node waits on (``growing``), in the order
        node 0 decided them (``sequence``): each word's members are complete, so one applied
        out of order would undo the growth decided after it. A word waits while one decided
        before it (``before``) answers a return this node has not seen yet (the node is still
        lost here at that generation). On a rejoining node, the word on a return that came
        before its first look waits for its own word: decided before it, it is already in its
        own word's members, and only its returning ranks' endpoints are taken from it. Returns
        whether any word was applied."""
        store, keys, attempt = self.store, self.keys, self.attempt
        words = []
        for node, generation in self.growing:
            said = await store.peek(keys.grown(attempt, node, generation))
            if said is not None:
                words.append((node, generation, json.loads(said)))
        words.sort(key=lambda word: int(word[2].get("sequence", 0)))
        own = [int(said.get("sequence", 0)) for n, _, said in words if n == self.node]
        applied = False
        for node, generation, said in words:
            if (node, generation) in self.early:
                if not own:
                    continue
                if int(said.get("sequence", 0)) < own[0]:
                    self.growing.discard((node, generation))
                    self.early.discard((node, generation))
                    self._form(said)
                    for name, ranks in said["endpoints"].items():
                        for i, tcp in ranks.items():
                            self._reach(name, int(i), tcp)
                            self.membership.moved.setdefault(name, {})[int(i)] = Moved(node, tcp)
                    applied = True
                    continue
            unseen = [
                (int(n), int(g))
                for n, g in said.get("before", ())
                if self.losses.get(int(n)) == int(g) and int(n) in self.lost
            ]
            if unseen:
                break  # applied once this node has seen those returns, and their words
            self.growing.discard((node, generation))
            self.early.discard((node, generation))
            await self._grow(supervisor, node, said)
            applied = True
        return applied

    def _lost_again(self, node: int, generation: int, reason: str) -> None:
        """Lost ``node`` came back and was lost again (``generation``) between two looks of
        this node: its replicas are still out of the run here, so only the loss's generation
        changes (and the formations of the groups that grew back and shrank again meanwhile,
        which the loss's word carries), and node 0's word on the return in between (if any) no
        longer applies: node 0 left the node's ranks out again at the later loss."""
        self.lost[node] = self.membership.lost[node] = reason
        self.losses[node] = generation
        self.growing = {(n, g) for n, g in self.growing if n != node}
        said = f"node {node} came back and is lost again (loss {generation}: {reason})"
        self.say(self.node, said)

    async def _learn_moves(self) -> bool:
        """A node that joins the running attempt again learns where the replicas that moved
        run now (``moved/<role>/<replica>``), so that a later loss of their node moves them on;
        one published on this node ran here before it was lost, and runs here no more. Returns
        whether any was learned."""
        learned = False
        for name, role in self.manifest.roles.items():
            if role.replicas != 1:
                continue  # only a role with one replica moves
            said = await self.store.peek(self.keys.moved(self.attempt, name, 0))
            if said is None or int(json.loads(said)["node"]) == self.node:
                continue
            published = json.loads(said)
            moved = Moved(int(published["node"]), published["endpoint"])
            self.membership.moved.setdefault(name, {})[0] = moved
            learned = True
        return learned

    async def _back(self, node: int) -> list[tuple[int, int, NodeRecord]]:
        """Lost node ``node`` joined the run again: its replicas that departed are back, at
        the endpoints it published anew (those that moved away stay where they went). Returns,
        on node 0 for a node with ranks of groups that went on without them, (``node``, the
        generation of the loss it answers, its record): node 0 decides what grows once the
        pass's losses are applied."""
        raw = await self.store.get(self.keys.endpoints(self.attempt, node))
        record = msgspec.json.decode(raw, type=NodeRecord)
        self.view.agents[node] = record.agent
        del self.lost[node]
        self.losses.pop(node, None)
        said = json.loads(await self.store.get(self.keys.back(self.attempt, node)))
        generation = int(said["generation"])
        self.membership.lost.pop(node, None)
        back = []
        for name, by_index in record.replicas.items():
            for replica, endpoint in by_index.items():
                self.membership.departed.get(name, {}).pop(replica, None)
                if not self.membership.departed.get(name, True):
                    del self.membership.departed[name]
                self.membership.moved.setdefault(name, {})[replica] = Moved(node, endpoint)
                self._reach(name, replica, endpoint)
                back.append(f"{name}[{replica}]")
        change = Change(
            time=time.time(),
            event="node_back",
            node=node,
            reason="it joined the run again",
            moved={b: node for b in back},
        )
        self.membership.changes.append(change)
        if self.node == 0:
            record_change(self.run_dir, change, self.say)
        what = ", ".join(back) or "no replica"
        self.say(self.node, f"node {node} is back: {what} back in the run")
        if not record.unserved:
            return []
        # Groups that went on without its ranks: node 0 says what grows.
        self.growing.add((node, generation))
        return [(node, generation, record)] if self.node == 0 else []

    async def _decide_growth(
        self,
        node: int,
        generation: int,
        record: NodeRecord,
        shrunk: dict[str, list[int]],
    ) -> None:
        """Node 0: say in the store which groups that went on without the ranks of ``node``,
        back from the loss of ``generation``, grow back with them (``grow``), with the tcp
        endpoint each returning rank binds (``record.regrow``); every node applies it.

        With ``run.shared_storage``, each returning rank's ``REJOIN_FILE`` is written first,
        durably, in its folder, before the word and node 0's ``membership.json`` say the group
        grew: an attempt that ends between them (a restart of every node, a ``--resume``)
        starts the rank at the larger size, and the file makes it take the lead's state rather
        than its own from before the loss. A file that cannot be written (the shared storage
        failing) is said, and its group stays at its smaller size. Without shared storage the
        rank's folder is on its own node, whose agent writes the file as it applies the word
        (``_rejoin``).

        ``shrunk`` is node 0's working copy of the groups that are smaller, this pass's earlier
        decisions in it; this decision goes into it too. The word carries its place in the
        order of node 0's decisions (``sequence``) and the decisions before it (``before``),
        which every node applies first."""
        growth = grow(self.manifest, shrunk, node)
        endpoints = {
            name: {i: record.regrow[name][i] for i in members if i in record.regrow.get(name, {})}
            for name, members in growth.grown.items()
        }
        for name, ranks in list(endpoints.items() if self.manifest.run.shared_storage else ()):
            for i in ranks:
                try:
                    write_rejoin(self.manifest, self.run_dir, name, i, growth.lead[name])
                except OSError as exc:
                    path = _rejoin_path(self.manifest, self.run_dir, name, i)
                    growth.stays[name] = f"{path} cannot be written ({exc})"
                    del growth.grown[name], growth.lead[name], endpoints[name]
                    break
        formations = self._number(growth.grown)
        for name, why in growth.stays.items():
            members = shrunk[name]
            self.say(self.node, f"{name} stays at replicas {members} with node {node} back: {why}")
        stays = {name: shrunk[name] for name in growth.stays}
        for name, members in growth.grown.items():
            if members == list(range(self.manifest.roles[name].replicas)):
                shrunk.pop(name, None)
            else:
                shrunk[name] = list(members)
        said = {
            "grown": growth.grown,
            "lead": growth.lead,
            "endpoints": endpoints,
            "stays": stays,
            "lost": {str(n): g for n, g in sorted(self.losses.items())},
            "sequence": len(self.decided) + 1,
            "before": [list(d) for d in self.decided],
            "formations": formations,
        }
        self.decided.append((node, generation))
        await self.store.set(self.keys.grown(self.attempt, node, generation), json.dumps(said))

    async def _grow(self, supervisor: Supervisor, node: int, said: dict[str, Any]) -> None:
        """Apply node 0's word on the groups that grow back with the ranks of ``node``: each
        starts again at its larger size on this node; on ``node`` itself, the returning ranks
        start, each first told (``REJOIN_FILE``) to take the state of the replica that led the
        group while it was out. The groups that stay at their smaller size are recorded with
        their members (``node`` itself knew them only as groups its ranks left).

        A node this node has seen lost since node 0 decided (a loss node 0 had not applied,
        ``said["lost"]``) is out of each group: its ranks are left out of the members as
        ``plan`` leaves them out, so every node ends on the same members whichever it applied
        first, the loss or the growth. When that loss took the replica node 0 named as the
        lead, the returning ranks take the state of the lowest replica that stayed in the group
        (none stayed: the named lead's, from its folder of the shared run directory)."""
        for name, members in said["stays"].items():  # the returning node learns them here
            self.membership.shrunk[name] = [int(i) for i in members]
        self._form(said)
        decided = {int(n): int(g) for n, g in said.get("lost", {}).items()}
        since = {n for n, g in self.losses.items() if decided.get(n) != g}
        grown: dict[str, list[int]] = {}
        moved: dict[str, int] = {}
        for name, members in said["grown"].items():
            role = self.manifest.roles[name]
            members = [int(i) for i in members]
            if since:
                left = plan(self.manifest, since, members={name: members}).shrunk
                members = left.get(name, members)
            lead = int(said["lead"][name])
            returning = {
                int(i): tcp
                for i, tcp in said["endpoints"].get(name, {}).items()
                if int(i) in members
            }
            stayed = [i for i in members if str(i) not in said["endpoints"].get(name, {})]
            if lead not in members and stayed:
                # The lead's node was lost since node 0 decided: the returning ranks take the
                # state of the lowest replica that stayed in the group instead.
                lead = stayed[0]
            grown[name] = members
            if members == list(range(role.replicas)):
                self.membership.shrunk.pop(name, None)
            else:
                self.membership.shrunk[name] = members
            self.view.members[name] = members
            why = f"its group grows back to replicas {members} with node {node}'s ranks"
            restarted = await supervisor.restart_role(name, why)
            for i, tcp in sorted(returning.items()):
                departed = self.membership.departed.get(name, {})
                departed.pop(i, None)
                if not departed:
                    self.membership.departed.pop(name, None)
                if node == self.node:
                    endpoint = await self._rejoin(supervisor, name, i, lead, tcp)
                    restarted.append(f"{name}[{i}]")
                else:
                    endpoint = tcp
                    self._reach(name, i, endpoint)
                self.membership.moved.setdefault(name, {})[i] = Moved(node, endpoint)
                moved[f"{name}[{i}]"] = node
            if restarted:
                self.say(self.node, f"{', '.join(restarted)} start again: {why}")
        if not grown:
            return
        change = Change(
            time=time.time(),
            event="group_grown",
            node=node,
            reason=f"node {node} is back",
            moved=moved,
            grown=grown,
        )
        self.membership.changes.append(change)
        if self.node == 0:
            record_change(self.run_dir, change, self.say)
        self.say(self.node, ", ".join(grows(n, m, node) for n, m in grown.items()))

    async def _rejoin(
        self, supervisor: Supervisor, name: str, replica: int, lead: int, tcp: str
    ) -> str:
        """Start this node's ``replica`` of ``name`` into its group as it grows back, binding
        ``tcp`` (published) for the other nodes, once told to take ``lead``'s state first
        (``REJOIN_FILE`` in its own folder, which node 0 wrote as it decided; written again
        here, the same but for the lead's folder as this node reaches it). Returns its endpoint
        as this node reaches it."""
        write_rejoin(self.manifest, self.run_dir, name, replica, lead)
        port = tcp.rsplit(":", 1)[1]
        child = adopted_child(
            self.manifest,
            name,
            replica,
            self.dir,
            self.view,
            f"tcp://{self.bind_host}:{port}",
            self.dir,
        )
        self._reach(name, replica, child.endpoint)
        await supervisor.adopt(child)
        return child.endpoint

    async def _lose(
        self,
        supervisor: Supervisor,
        node: int,
        reason: str,
        loss: tuple[int, int],
        planned: set[int],
    ) -> None:
        """Node ``node`` is lost for good: the replicas that run on it now depart or move as
        ``plan`` says for the nodes ``planned`` lost with it (node 0's view when it marked the
        loss, the same on every node); those that move here are started now. ``loss`` is
        (``node``, the generation of its loss), which the moved replica's new endpoint names
        when it is published."""
        self.lost[node] = reason
        self.losses[node] = loss[1]
        # Where the replicas that moved run now: one that moved away from a node and stayed
        # there when the node came back is out of this loss; one that moved onto it moves on.
        runs_on = {
            (name, i): where.node
            for name, by_index in self.membership.moved.items()
            for i, where in by_index.items()
        }
        runs_on |= {key: there for key, (there, _) in self.moving.items()}
        roles = self.manifest.roles
        now = plan(self.manifest, planned, runs_on, self.membership.shrunk)

        def on_it(name: str, i: int) -> bool:
            return runs_on.get((name, i), roles[name].placement.node_of(i)) == node

        departed = {
            (name, i): n
            for (name, i), n in now.departed.items()
            if n == node and i not in self.membership.departed.get(name, {})
        }
        moved = {key: there for key, there in now.moved.items() if on_it(*key)}
        shrunk = {
            name: members
            for name, members in now.shrunk.items()
            if any(n == name for n, _ in departed)
        }
        for (name, replica), lost_on in departed.items():
            self.membership.departed.setdefault(name, {})[replica] = lost_on
            self.membership.moved.get(name, {}).pop(replica, None)
            if not self.membership.moved.get(name, True):
                del self.membership.moved[name]
        for (name, replica), there in moved.items():
            self.moving[(name, replica)] = (there, loss)
            if there == self.node:
                await self._adopt(supervisor, name, replica, loss)
        for name, members in shrunk.items():
            self.membership.shrunk[name] = members
            self.view.members[name] = members
            why = f"its group goes on with replicas {members} after node {node}'s loss"
            restarted = await supervisor.restart_role(name, why)
            if restarted:
                self.say(self.node, f"{', '.join(restarted)} start again: {why}")
        self.membership.lost[node] = reason
        change = Change(
            time=time.time(),
            event="node_lost",
            node=node,
            reason=reason,
            departed=[f"{name}[{i}]" for name, i in departed],
            moved={f"{name}[{i}]": n for (name, i), n in moved.items()},
            shrunk=shrunk,
        )
        self.membership.changes.append(change)
        if self.node == 0:
            record_change(self.run_dir, change, self.say)
        self.say(
            self.node,
            f"node {node} lost ({reason}): "
            + ", ".join(
                [f"{n}[{i}] left the run" for n, i in departed]
                + [f"{n}[{i}] moves to node {there}" for (n, i), there in moved.items()]
                + [goes_on(n, members) for n, members in shrunk.items()]
            ),
        )

    async def _adopt(
        self, supervisor: Supervisor, name: str, replica: int, loss: tuple[int, int]
    ) -> None:
        """Start ``name``'s ``replica`` on this node, from its home node's folder, on a fresh
        tcp port, which it publishes for the other nodes with the ``loss`` that moved it (so
        that none takes the address it had before for the new one)."""
        (port,) = free_ports(self.bind_host, 1)
        published = f"tcp://{self.host}:{port}"
        home = node_dir(self.run_dir, self.manifest.roles[name].placement.node_of(replica))
        child = adopted_child(
            self.manifest,
            name,
            replica,
            home,
            self.view,
            f"tcp://{self.bind_host}:{port}",
            self.dir,
        )
        self._reach(name, replica, child.endpoint)
        await supervisor.adopt(child)
        said = json.dumps({"node": self.node, "endpoint": published, "lost": list(loss)})
        await self.store.set(self.keys.moved(self.attempt, name, replica), said)

    def _shrinks(self, node: int) -> list[str]:
        """Node 0: the data-parallel groups over several nodes that a loss of ``node`` takes
        ranks out of: those with a member (as node 0 has applied its words) placed on it."""
        shrinks = []
        for name, role in self.manifest.roles.items():
            if spans_nodes(self.manifest, name):
                members = self.membership.shrunk.get(name, range(role.replicas))
                if any(role.placement.node_of(i) == node for i in members):
                    shrinks.append(name)
        return shrinks

    def _number(self, groups: Iterable[str]) -> dict[str, int]:
        """Node 0: the next formation of each of ``groups``, whose members change with the
        word it is about to write."""
        changed = list(groups)
        for name in changed:
            self.numbered[name] = self.numbered.get(name, 0) + 1
        return {name: self.numbered[name] for name in changed}

    def _form(self, said: Mapping[str, Any]) -> None:
        """Take the formations of node 0's word ``said`` (a loss or a growth): the groups whose
        members it changes start their next rendezvous under the number node 0 gave it. A word
        applied after a later one (a growth read after the next loss) lowers none. Only a change
        of a group's members changes its formation, so every node restarting a rank of the group
        at any moment joins under the same one as soon as it applied the same words."""
        for name, number in said.get("formations", {}).items():
            self.view.formations[name] = max(self.view.formations.get(name, 0), int(number))

    def _reach(self, name: str, replica: int, endpoint: str) -> None:
        """The processes this node starts from now on reach ``name``'s ``replica`` at
        ``endpoint``."""
        groups = self.view.groups
        info = groups[name]
        endpoints = list(info.endpoints)
        endpoints[replica] = endpoint
        groups[name] = msgspec.structs.replace(info, endpoints=endpoints)

    def _write(self) -> None:
        from asyncrl.safe_files import write_atomic

        path = os.path.join(self.dir, MEMBERSHIP_FILE)
        write_atomic(path, msgspec.json.format(msgspec.json.encode(self.membership)))


async def lost_generation(store: StoreClient, keys: LaunchKeys, attempt: int, node: int) -> int:
    """The generation of ``node``'s loss in ``attempt`` that it has not come back from yet;
    0 when it is not lost."""
    lost = await store.peek(keys.lost(attempt, node))
    if lost is None:
        return 0
    generation = int(json.loads(lost)["generation"])
    back = await store.peek(keys.back(attempt, node))
    answered = back is not None and int(json.loads(back)["generation"]) >= generation
    return 0 if answered else generation


def write_rejoin(manifest: Manifest, run_dir: str, name: str, replica: int, lead: int) -> str:
    """Tell ``name``'s ``replica``, rejoining its group, to take ``lead``'s state first: its
    ``REJOIN_FILE`` (``Rejoin``: the lead's node folder under ``run_dir``, and whether the run
    directory is shared, so the rank reads the lead's files there, or takes them from the lead
    over the group), in the replica's folder of its node under ``run_dir``, written whole and
    durably (the file, then its folder, reach the disk). Returns the file's path.

    Raises:
        OSError: the folder cannot be written.
    """
    from asyncrl.safe_files import write_atomic

    placement = manifest.roles[name].placement
    rejoin = Rejoin(
        lead=lead,
        folder=node_dir(run_dir, placement.node_of(lead)),
        shared=manifest.run.shared_storage,
    )
    folder = os.path.dirname(_rejoin_path(manifest, run_dir, name, replica))
    os.makedirs(folder, exist_ok=True)
    path = write_atomic(os.path.join(folder, REJOIN_FILE), msgspec.json.encode(rejoin), fsync=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def _rejoin_path(manifest: Manifest, run_dir: str, name: str, replica: int) -> str:
    """Where ``name``'s ``replica`` finds its ``REJOIN_FILE``: in the replica's folder of its
    node under ``run_dir``."""
    home = node_dir(run_dir, manifest.roles[name].placement.node_of(replica))
    return os.path.join(home, "roles", f"{name}.{replica}", REJOIN_FILE)


def record_change(run_dir: str, change: Change, say: Callable[[int, str], None]) -> None:
    """Append ``change`` to the run's ``metrics.jsonl`` as one line, ``{"time", "membership"}``
    (no ``step``: the readers of the steps pass it by). A file that cannot be written is said,
    and the run goes on."""
    from asyncrl.safe_files import open_append

    line = {"time": change.time, "membership": msgspec.to_builtins(change)}
    try:
        with open_append(os.path.join(run_dir, "metrics.jsonl")) as f:
            f.write((json.dumps(line) + "\n").encode())
    except OSError as exc:
        say(0, f"the change of membership is not in metrics.jsonl: {exc}")
