"""Launch a run over several machines with torchrun: each torchrun worker is its node's agent.

    torchrun --nnodes=N --nproc-per-node=1 --node-rank=R --master-addr=HOST --master-port=PORT \\
        -m asyncrl.launch MANIFEST [--run-dir DIR] [--set KEY=VALUE]... [--resume] [--overwrite]

(the c10d rendezvous form, ``--rdzv-backend=c10d --rdzv-endpoint=HOST:PORT``, works too). The worker
of node R runs the replicas the manifest places on node R (``placement.node`` or
``placement.nodes``) under the same supervisor as ``asyncrl run`` (``agent``); node 0 also runs the
driver. docs/multinode.md is the guide; in short:

- Discovery: the agents meet in torchrun's store (``store_registry``). Each picks a tcp port per
  replica it runs, on the node's address (``network.address``), publishes them, and waits for
  every other node's before it starts anything. A replica binds its ipc endpoint for its own node
  and its tcp port for the others; each process's ``groups`` hold what its node sees.
- Status: each agent also publishes the tcp endpoint of its status server; ``asyncrl status``
  given any node's run directory asks that node's agent, which asks the others.
- Files: node 0 writes in RUN_DIR, node R in RUN_DIR/node-R, with its ``launch.json``; the secret
  never crosses the store: each node derives or reads it on its own (``launch_secret``).
- Hosts: each agent also publishes its host id; nodes that share a host share its weight store
  (node R's ``weights`` folder links to the host's first node's, ``hosts``), and a node that
  shares a host id but not the first node's folder is refused at start.
- Traces (``--trace``): every node records into its own ``trace`` folder; at the end node R
  sends its files to node 0 over tcp (Curve applies), which merges every node's into
  ``RUN_DIR/trace.json`` (``asyncrl.observe.trace_nodes``).
- The end: when the driver ends (or a node's supervisor gives up), its agent writes how the run
  ended under the attempt's ``stop`` key; every agent then stops its roles and exits with the
  run's status (0 completed, 1 failed, 130 interrupted).
- Failures: agents raise a heartbeat key (``NodeAttempt.heartbeat``). A node other than 0
  whose agent stops answering is lost for good: node 0 marks it so, and the run goes on
  without it: its replicas leave or move (``asyncrl.manifest.membership``), and every node's
  ``MembershipFollower`` (``asyncrl.supervision.membership_follower``) applies the change and
  records it in its ``membership.json``; a lost node started again joins the running attempt.
  An agent that sees node 0 stop answering, or another node's agent restart, or a lost node
  the run cannot do without, ends its attempt and exits 1: torchrun (``--max-restarts``) then
  starts the worker group again, and the new attempt resumes the run in the same
  directories, as ``asyncrl run --resume`` does. A run that ended for good
  (completed, or failed by its own decision) leaves a ``final`` key: a later attempt exits at
  once with the same status.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncrl.errors import ManifestError
from asyncrl.manifest.load import Manifest, load_manifest, resolve_run_dir
from asyncrl.manifest.membership import (
    MEMBERSHIP_FILE,
    Membership,
    grows_back,
    node_loss_warnings,
    plan,
    spans_nodes,
)
from asyncrl.observe.trace import merge_and_tell
from asyncrl.observe.trace_nodes import send_node_trace, start_node_trace
from asyncrl.supervision.agent import NodeView, install_secret, run_manifest, summary
from asyncrl.supervision.hosts import HostRecord, announce, share
from asyncrl.supervision.launch_secret import shared_secret
from asyncrl.supervision.membership_follower import MembershipFollower, lost_generation
from asyncrl.supervision.rundir import node_dir
from asyncrl.supervision.runreport import RunReport
from asyncrl.supervision.store_registry import (
    LaunchKeys,
    NodeRecord,
    StoreClient,
    StoreError,
    free_ports,
    node_address,
)
from asyncrl.supervision.supervisor import Supervisor

__all__ = ["LaunchEnv", "NodeAttempt", "main"]

HEARTBEAT_INTERVAL_S = 1.0
"""Seconds between two heartbeats of a node agent in the store (and checks of the others')."""
TORCHRUN_EXIT_BARRIER = "torchelastic/agent/terminal_state"
"""The key prefix of torchrun's exit barrier (``torch.distributed.elastic``'s agent)."""
EXIT_BARRIER_WAIT_S = 30.0
"""How long node 0's worker waits, as it exits, for the torchruns of the nodes that reported
their end to reach torchrun's exit barrier (their workers exit just after reporting)."""
EXIT_CODES = {"completed": 0, "failed": 1, "interrupted": 130}
EXIT_USAGE = 2


@dataclass(frozen=True)
class LaunchEnv:
    """What torchrun tells its worker, read from the environment.

    Attributes:
        node: this node's rank (``GROUP_RANK``).
        nodes: the number of nodes (``GROUP_WORLD_SIZE``).
        master_addr: the store's host.
        master_port: the store's port.
        run_id: ``TORCHELASTIC_RUN_ID``, or "" when torchrun left it at ``none``.
        agent_store: torchrun's agent hosts the store (else node 0's worker does).
    """

    node: int
    nodes: int
    master_addr: str
    master_port: int
    run_id: str
    agent_store: bool

    @classmethod
    def from_environ(cls, env: dict[str, str] | None = None) -> LaunchEnv:
        """Read it.

        Raises:
            ValueError: a variable is missing (not started by torchrun), or torchrun started
                more than one worker per node.
        """
        env = dict(os.environ if env is None else env)
        missing = [
            v
            for v in ("GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            if not env.get(v)
        ]
        if missing:
            raise ValueError(
                f"{', '.join(missing)} not set: asyncrl.launch runs under torchrun ('torchrun "
                "--nnodes=N --nproc-per-node=1 ... -m asyncrl.launch MANIFEST'); on one "
                "machine use 'asyncrl run MANIFEST'"
            )
        if env.get("LOCAL_WORLD_SIZE", "1") != "1":
            raise ValueError(
                f"torchrun started {env['LOCAL_WORLD_SIZE']} workers on this node; asyncrl.launch "
                "is the node's agent and needs exactly one: pass --nproc-per-node=1"
            )
        run_id = env.get("TORCHELASTIC_RUN_ID", "")
        return cls(
            node=int(env["GROUP_RANK"]),
            nodes=int(env["GROUP_WORLD_SIZE"]),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
            run_id="" if run_id == "none" else run_id,
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "False") == "True",
        )


def _by_role(endpoints: dict[tuple[str, int], str]) -> dict[str, dict[int, str]]:
    out: dict[str, dict[int, str]] = {}
    for (name, i), endpoint in endpoints.items():
        out.setdefault(name, {})[i] = endpoint
    return out


def _say(node: int, message: str) -> None:
    print(f"asyncrl.launch[node {node}]: {message}", file=sys.stderr, flush=True)


def _ended(status: str, reason: str, node: int) -> str:
    return json.dumps({"status": status, "reason": reason, "node": node})


class NodeAttempt:
    """One node's part in one attempt of the launch: it prepares the node's run directory,
    meets the other nodes in the store, runs the node's roles under its supervisor, and tells
    the others how the run ended.

    Attributes:
        env: what torchrun told this worker.
        store, keys: the launch's store and its keys.
        attempt: the attempt's number (each start of node 0 is a new one).
        manifest: the run's manifest.
        run_dir: the run's (node 0's) directory; ``dir`` is this node's.
        trace: ``--trace``: record, and gather every node's trace on node 0.
        ended_here: the run ended by this node's supervisor, not by the store.
        restart: why this node leaves for a new attempt (another node restarted, died); "".
        leave: why this node leaves the running attempt, which goes on without it (node 0
            took it as lost while it ran); "".
        sink: where node 0 takes the traces (bound there, sent to elsewhere).
        records: every node's ``NodeRecord``, by rank, once ``discover`` has them.
    """

    def __init__(
        self,
        env: LaunchEnv,
        store: StoreClient,
        keys: LaunchKeys,
        attempt: int,
        manifest: Manifest,
        run_dir: str,
        *,
        trace: bool = False,
    ) -> None:
        self.env, self.store, self.keys = env, store, keys
        self.attempt, self.manifest, self.run_dir, self.trace = attempt, manifest, run_dir, trace
        self.ended_here = True
        self.restart = ""
        self.leave = ""
        self.sink = ""
        self.records: dict[int, NodeRecord] = {}
        self.bind_host = self.host = ""
        self.view: NodeView | None = None
        self.rejoining = 0  # the generation of this node's loss that it comes back from; 0: none
        # Its replicas of data-parallel groups that went on without them when it was lost.
        self.shrunk_away: list[tuple[str, int]] = []

    @classmethod
    async def join(
        cls,
        env: LaunchEnv,
        store: StoreClient,
        keys: LaunchKeys,
        manifest: Manifest,
        run_dir: str,
        *,
        trace: bool,
        timeout_s: float,
    ) -> NodeAttempt:
        """This node's part in the attempt it takes part in.

        Node 0 starts a new attempt at each start. Another node joins node 0's current attempt,
        unless it already took part in it (it was restarted alone): then it says so
        (``rejoin``), node 0 ends that attempt, and it joins the next.

        Raises:
            StoreError: node 0 started no new attempt within ``timeout_s``.
        """
        if env.node == 0:
            attempt = await store.add(keys.attempts, 1) - 1
            await store.set_once(keys.joined(attempt, 0), str(os.getpid()))
            await store.set(keys.current, str(attempt))
            return cls(env, store, keys, attempt, manifest, run_dir, trace=trace)
        me = str(os.getpid())
        deadline = time.monotonic() + timeout_s
        await store.wait_for([keys.current], timeout_s, why="node 0 starts each attempt")
        while True:
            attempt = int(await store.get(keys.current))
            if await store.set_once(keys.joined(attempt, env.node), me) == me:
                return cls(env, store, keys, attempt, manifest, run_dir, trace=trace)
            generation = await lost_generation(store, keys, attempt, env.node)
            if generation:
                # Node 0 took this node as lost and the run went on: join it again.
                a = cls(env, store, keys, attempt, manifest, run_dir, trace=trace)
                a.rejoining = generation
                return a
            await store.set(keys.rejoin(attempt, env.node), me)
            while int(await store.get(keys.current)) == attempt:
                if time.monotonic() >= deadline:
                    raise StoreError(
                        f"node {env.node} restarted and waited {timeout_s:g} s for node 0 to "
                        f"start a new attempt after attempt {attempt}; is node 0's agent running?"
                    )
                await asyncio.sleep(HEARTBEAT_INTERVAL_S / 4)

    @property
    def node(self) -> int:
        return self.env.node

    @property
    def dir(self) -> str:
        return node_dir(self.run_dir, self.env.node)

    @property
    def hosts(self) -> dict[int, HostRecord]:
        """Every node's host record, by rank."""
        return {node: record.host for node, record in self.records.items()}

    async def prepare(self, args: argparse.Namespace, timeout_s: float) -> str:
        """Claim the run directory (node 0 first, then the others their own): "" or why not."""
        from asyncrl.supervision.rundir import save_manifest

        claimed = self.keys.claimed(self.attempt)
        if self.node == 0:
            problem = _claim(args, self.run_dir, self.attempt == 0)
            if not problem and args.resume:
                problem = _same_manifest(self.manifest, self.run_dir)
            if not problem and self.attempt == 0 and not args.resume:
                save_manifest(self.manifest, self.run_dir)
            await self.store.set(claimed, problem or "ok")
            return problem
        await self.store.wait_for([claimed], timeout_s, why="node 0 prepares the run directory")
        verdict = await self.store.get(claimed)
        if verdict != "ok":
            return f"node 0 could not use the run directory: {verdict}"
        return _claim(args, self.dir, self.attempt == 0 and not self.rejoining)

    async def discover(self, timeout_s: float) -> NodeView:
        """Publish this node's ``NodeRecord``, wait for every node's; return this node's view."""
        bind_host, host = node_address(self.manifest.network.address, self.env.master_addr)
        self.bind_host, self.host = bind_host, host
        mine = [
            (name, i)
            for name, role in self.manifest.roles.items()
            for i in range(role.replicas)
            if role.placement.node_of(i) == self.node
        ]
        elsewhere: dict[tuple[str, int], str] = {}
        if self.rejoining:  # what moved away while this node was lost stays where it went
            for name, i in mine:
                said = await self.store.peek(self.keys.moved(self.attempt, name, i))
                if said is not None:
                    elsewhere[(name, i)] = json.loads(said)["endpoint"]
            # Its ranks of a data-parallel group over several nodes departed, and the group went
            # on without them (the attempt would have ended otherwise): it stays at its smaller
            # size, so they do not start. The others reach them, unserved, where they were.
            before = await self.store.peek(self.keys.endpoints(self.attempt, self.node))
            was = msgspec.json.decode(before, type=NodeRecord) if before else None
            for name, i in mine:
                if spans_nodes(self.manifest, name):
                    self.shrunk_away.append((name, i))
                    # Its first record has it among its replicas; a record of an earlier
                    # return, among those it did not start.
                    known = (
                        {**was.unserved.get(name, {}), **was.replicas.get(name, {})} if was else {}
                    )
                    elsewhere[(name, i)] = known.get(i, "")
            mine = [key for key in mine if key not in elsewhere]
        # One port a replica, one for this agent's status server (which the other agents ask),
        # and on node 0 of a traced launch one where the others send their traces.
        sink = self.trace and self.node == 0
        # A port for each of those ranks whose group may grow back with it (node 0 decides,
        # ``asyncrl.manifest.membership.grow``), which it binds once it starts.
        regrowing = [key for key in self.shrunk_away if not grows_back(self.manifest, key[0])]
        ports = free_ports(bind_host, len(mine) + 1 + sink + len(regrowing))
        replicas: dict[str, dict[int, str]] = {}
        for (name, i), port in zip(mine, ports, strict=False):
            replicas.setdefault(name, {})[i] = f"tcp://{host}:{port}"
        regrow_at = {
            key: f"tcp://{host}:{port}"
            for key, port in zip(regrowing, ports[len(mine) + 1 + sink :], strict=True)
        }
        if sink:
            self.sink = f"tcp://{bind_host}:{ports[-1]}"
        record = NodeRecord(
            replicas=replicas,
            agent=f"tcp://{host}:{ports[len(mine)]}",
            host=announce(self.dir),
            trace_sink=f"tcp://{host}:{ports[-1]}" if sink else "",
            shrunk=shrunk_before(self.dir) if self.node == 0 else {},
            unserved=_by_role({key: elsewhere[key] for key in self.shrunk_away}),
            regrow=_by_role(regrow_at),
        )
        keys, store = self.keys, self.store
        published = msgspec.json.encode(record).decode()
        await store.set(keys.endpoints(self.attempt, self.node), published)
        every = [keys.endpoints(self.attempt, n) for n in range(self.env.nodes)]
        await store.wait_for(every, timeout_s, why="every node publishes its endpoints")
        for node, key in enumerate(every):
            self.records[node] = msgspec.json.decode(await store.get(key), type=NodeRecord)
        if self.node != 0:
            self.sink = self.records[0].trace_sink
        # A group that went on at a smaller size in an earlier attempt stays so: its replicas
        # left out hold state from before (docs/multinode.md), and do not start.
        shrunk = self.records[0].shrunk
        for name, i in mine:
            if name in shrunk and i not in shrunk[name]:
                self.shrunk_away.append((name, i))
                elsewhere[(name, i)] = replicas[name][i]
        tcp = {
            (name, i): endpoint
            for record in self.records.values()
            for name, by_index in record.replicas.items()
            for i, endpoint in by_index.items()
        }
        prefix = keys.prefix(self.attempt).removeprefix("asyncrl/")
        self.view = NodeView(
            node=self.node,
            tcp=tcp,
            span_env={
                "ASYNCRL_DIST_STORE": f"{self.env.master_addr}:{self.env.master_port}",
                "ASYNCRL_DIST_PREFIX": prefix,
            },
            curve_keys=self.manifest.security.curve_keys,
            bind_host=bind_host if bind_host != host else "",
            agents={node: record.agent for node, record in self.records.items()},
            elsewhere=elsewhere,
            members={name: list(members) for name, members in shrunk.items()},
        )
        return self.view

    async def heartbeat(self) -> None:
        """Raise this node's heartbeat key every ``HEARTBEAT_INTERVAL_S`` s until cancelled.

        It runs on its own from before discovery to the attempt's end, so that nothing else the
        agent does meanwhile (starting its supervisor and roles, adopting a moved replica,
        following the membership) delays a beat: node 0 takes a node whose beats stop for
        ``--agent-liveness`` s as lost. A store that stops answering ends the beats; the
        agent's watch meets the same failure and ends the attempt.
        """
        key, beats = self.keys.heartbeat(self.attempt, self.node), 0
        while True:
            try:
                await self.store.set(key, str(beats))
            except StoreError:
                return
            beats += 1
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def announce_end(self, report: RunReport) -> None:
        """Tell the other nodes that the run ended here, as ``report`` says (the first word
        wins: ``keys.stop``): each stops its processes when it reads it."""
        said = _ended(report.status, report.reason, self.node)
        await self.store.set_once(self.keys.stop(self.attempt), said)

    async def finish(
        self,
        report: RunReport,
        timeout_s: float,
        lost: Collection[int] = (),
        liveness_s: float | None = None,
    ) -> int:
        """Tell the other nodes how the run ended (when it ended here); return the exit
        status. ``lost``: the nodes lost for good, which node 0 neither waits for nor counts;
        ``liveness_s``: node 0 stops waiting for a node whose heartbeat stops for that long
        meanwhile (default ``timeout_s``)."""
        keys, store = self.keys, self.store
        if self.restart:
            _say(self.node, f"{self.restart}; exiting so that torchrun starts the group again")
            return 1
        if self.leave:
            _say(self.node, f"{self.leave}; exiting so that torchrun starts it again to rejoin")
            return 1
        if self.ended_here:
            await self.announce_end(report)
            if report.status != "interrupted":
                await store.set_once(keys.final, _ended(report.status, report.reason, self.node))
        counts: dict[str, Any] = {"restarts": report.restarts, "served": report.served}
        if self.node != 0 and self.trace:
            counts["trace"] = await send_node_trace(
                self.node,
                self.dir,
                self.sink,
                run=self.manifest.run.name,
                curve_keys=self.manifest.security.curve_keys,
                timeout_s=timeout_s,
                say=_say,
            )
        await store.set(keys.done(self.attempt, self.node), json.dumps(counts))
        if self.node == 0:
            reported = await self._gather_counts(report, timeout_s, lost, liveness_s or timeout_s)
            self._add_nodes()
            await self._check_in_last(reported)
        return EXIT_CODES[report.status]

    async def _check_in_last(self, reported: Collection[int]) -> None:
        """Leave node 0's torchrun the last to check in to torchrun's exit barrier, which every
        node's torchrun joins once its worker exits (``torchelastic/agent/terminal_state``,
        under the run id in the static rendezvous). Node 0's torchrun holds the store: once the
        barrier lets it go it exits, and a torchrun still on its way into the barrier then
        loses the store and prints a ``DistNetworkError`` traceback. So this worker waits (up
        to ``EXIT_BARRIER_WAIT_S``) for the torchruns of the nodes that ``reported`` their end
        to check in, then counts each other node that has not (a lost node's torchrun never
        will, and the others would wait out the barrier's 300 s)."""
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        key = f"{run_id}/{TORCHRUN_EXIT_BARRIER}/num_members"
        deadline = time.monotonic() + EXIT_BARRIER_WAIT_S
        try:
            count = await self.store.add(key, 0)
            while count < len(reported) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                count = await self.store.add(key, 0)
            if count < len(reported):
                _say(
                    self.node,
                    f"{len(reported) - count} of the other nodes' torchruns did not reach "
                    f"torchrun's exit barrier within {EXIT_BARRIER_WAIT_S:g} s of this node's "
                    "end; a DistNetworkError traceback theirs prints once this node's torchrun "
                    "(the store's host) exits is expected: the run ended as this node says",
                )
            if count < self.env.nodes - 1:
                await self.store.add(key, self.env.nodes - 1 - count)
        except StoreError as exc:
            _say(self.node, str(exc))

    async def _gather_counts(
        self, report: RunReport, timeout_s: float, lost: Collection[int], liveness_s: float
    ) -> list[int]:
        """Wait for the other nodes to stop their roles; add their restarts and served requests
        to node 0's report (and its report.json), so that it covers the whole run. Returns the
        nodes that reported."""
        others = [n for n in range(1, self.env.nodes) if n not in lost]
        try:
            await self._wait_for_others(others, timeout_s, liveness_s)
        except StoreError as exc:
            _say(self.node, str(exc))
        reported = []
        for node in others:
            key = self.keys.done(self.attempt, node)
            said = await self.store.peek(key)
            if said is None:
                continue
            reported.append(node)
            counts = json.loads(said)
            if self.trace:
                _say(self.node, f"trace of node {node}: {counts.get('trace', '-')}")
            for counted in ("restarts", "served"):
                mine = getattr(report, counted)
                for role, n in counts[counted].items():
                    mine[role] = mine.get(role, 0) + n
        with open(os.path.join(self.dir, "report.json"), "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(report)))
        return reported

    async def _wait_for_others(self, nodes: list[int], timeout_s: float, liveness_s: float) -> None:
        """Wait up to ``timeout_s`` for each of ``nodes`` to say it stopped its roles. A node
        whose heartbeat stops for ``liveness_s`` meanwhile (it was lost as the run ended, before
        the watch took it as lost) is not waited for, and is counted in torchrun's exit barrier
        as a lost node is (``_check_in_last``)."""
        deadline = time.monotonic() + timeout_s
        seen: dict[int, tuple[str | None, float]] = {n: (None, time.monotonic()) for n in nodes}
        pending = list(nodes)
        while pending:
            now = time.monotonic()
            for node in list(pending):
                if await self.store.check(self.keys.done(self.attempt, node)):
                    pending.remove(node)
                    continue
                beat = await self.store.peek(self.keys.heartbeat(self.attempt, node))
                last, since = seen[node]
                if beat != last:
                    seen[node] = (beat, now)
                elif now - since > liveness_s:
                    _say(
                        self.node,
                        f"the agent of node {node} sent no heartbeat for {now - since:.1f} s as "
                        f"the run ended: node {node} is lost; not waiting for it (its restarts "
                        "and served calls are left out of report.json)",
                    )
                    pending.remove(node)
            if not pending:
                return
            if now >= deadline:
                waited = ", ".join(self.keys.done(self.attempt, n) for n in pending)
                _say(
                    self.node,
                    f"waited {timeout_s:g} s for {waited} in the store: the other nodes stop "
                    f"their roles",
                )
                return
            await asyncio.sleep(min(0.2, HEARTBEAT_INTERVAL_S))

    def _add_nodes(self) -> None:
        """Add ``nodes`` (the number of nodes that ran roles) to the program's summary.json."""
        used = {
            role.placement.node_of(i)
            for role in self.manifest.roles.values()
            for i in range(role.replicas)
        }
        path = os.path.join(self.run_dir, "summary.json")
        try:
            with open(path) as f:
                summary = json.load(f)
        except (OSError, ValueError):
            return
        if isinstance(summary, dict):
            from asyncrl.safe_files import write_atomic

            summary["nodes"] = len(used)
            write_atomic(path, json.dumps(summary, indent=2).encode())

    def write_launch(self) -> None:
        """This node's ``launch.json``: its rank, the number of nodes, the attempt, its pid."""
        from asyncrl.safe_files import write_atomic

        record = {
            "node": self.node,
            "nodes": self.env.nodes,
            "attempt": self.attempt,
            "pid": os.getpid(),
        }
        write_atomic(os.path.join(self.dir, "launch.json"), json.dumps(record).encode())


def shrunk_before(directory: str) -> dict[str, list[int]]:
    """The data-parallel groups that went on at a smaller size in an earlier attempt or launch
    of the run in ``directory`` (node 0's), from its ``membership.json``; {} when none did."""
    try:
        with open(os.path.join(directory, MEMBERSHIP_FILE), "rb") as f:
            return msgspec.json.decode(f.read(), type=Membership).shrunk
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return {}


def _claim(args: argparse.Namespace, directory: str, fresh: bool) -> str:
    """Make ``directory`` ready (``prepare_run_dir``), or say why not (a later attempt finds it)."""
    from asyncrl.supervision.rundir import RunDirError, prepare_run_dir

    if not fresh:
        os.makedirs(directory, exist_ok=True)
        return ""
    try:
        prepare_run_dir(
            directory,
            overwrite=args.overwrite,
            resume=args.resume,
            continue_hint="add --resume to continue it, or ",
            allow_nonempty=args.allow_nonempty,
        )
    except (RunDirError, OSError) as exc:
        return str(exc)
    return ""


def _same_manifest(manifest: Manifest, run_dir: str) -> str:
    """ "" when ``manifest`` is the one the run in ``run_dir`` was started with, else why not."""
    from asyncrl.supervision.rundir import RunDirError, load_saved_manifest, manifest_differences

    try:
        saved = load_saved_manifest(run_dir)
    except (RunDirError, ManifestError) as exc:
        return str(exc)
    differences = manifest_differences(saved, manifest)
    if differences:
        return (
            f"--resume: the manifest (with --set) differs from the one {run_dir} was started "
            f"with, at {', '.join(differences)}; a resumed run keeps its manifest"
        )
    return ""


class _Watch:
    """Beside the supervisor: follow the run's membership (``MembershipFollower``), and end
    the attempt when the store says it ended, a newer attempt started, a node the run cannot
    go on without stopped answering, or node 0 took this node as lost while it ran.

    Node 0 (the store's host) decides when another node is lost for good: no heartbeat for
    ``liveness_s`` (each agent raises its own, ``NodeAttempt.heartbeat``). When the run can go
    on without it (``asyncrl.manifest.membership.plan``), node 0 marks it lost in the store,
    and every agent's follower applies the new membership. Otherwise the attempt ends, and
    torchrun starts every node's worker group again, as for node 0's own loss.
    """

    def __init__(self, a: NodeAttempt, follower: MembershipFollower, liveness_s: float) -> None:
        self.a = a
        self.follower = follower
        self.liveness_s = liveness_s
        # Per other node: the last heartbeat value seen, and since when (this node's clock).
        self.seen: dict[int, tuple[str | None, float]] = {}

    async def __call__(self, supervisor: Supervisor) -> None:
        supervisor.hold_group = self.hold_group
        try:
            await self._watch(supervisor)
        except StoreError as exc:
            self.a.restart = f"the launch's store stopped answering ({exc})"
            self.a.ended_here = False
            supervisor.end(RunReport("failed", self.a.restart))

    async def _watch(self, supervisor: Supervisor) -> None:
        a, keys, store = self.a, self.a.keys, self.a.store
        while True:
            if supervisor.ended is not None:
                # The run ended here (the watch returns once it ends the run itself): the
                # other nodes stop now, while this node stops its processes, not after. A
                # rank of a group that this node stops first waits for its lead's last word,
                # which a lead on another node sends only as its own node stops.
                await a.announce_end(supervisor.ended)
                return
            ended = await store.peek(keys.stop(a.attempt))
            if ended is not None:
                said = json.loads(ended)
                a.ended_here = False
                reason = f"node {said['node']} ended the run: {said['reason']}"
                supervisor.end(RunReport(said["status"], reason))
                return
            why = await self._restart_reason()
            if why:
                a.restart = why
                a.ended_here = False
                supervisor.end(RunReport("failed", why))
                return
            why = await self.follower.follow(supervisor)
            if why:
                a.leave = why
                a.ended_here = False
                supervisor.end(RunReport("failed", why))
                return
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def hold_group(self, name: str, failed: float) -> None:
        """Return once every other node holding a rank of role ``name``'s group raised its
        heartbeat after ``failed`` (a ``time.monotonic()``: a process of the group failed
        then), or once a node silent since then had time to be marked lost: ``liveness_s``
        and three heartbeats. The supervisor holds the group's failure restart meanwhile
        (``Supervisor.hold_group``).

        A beat counts only when its value differs from the one read here, after the failure:
        the watch's ``seen`` says when this node first *read* a beat, which can be a moment
        after a node raised its last one and died (and its rank's collective broke)."""
        a, role = self.a, self.a.manifest.roles[name]
        deadline = failed + self.liveness_s + 3 * HEARTBEAT_INTERVAL_S
        before: dict[int, str | None] = {}
        while time.monotonic() < deadline:
            members = self.follower.view.members.get(name) or range(role.replicas)
            # A node marked lost counts as silent until the group's members leave it out.
            peers = {role.placement.node_of(i) for i in members} - {a.node}
            beating = True
            for peer in sorted(peers):
                beat = await a.store.peek(a.keys.heartbeat(a.attempt, peer))
                if peer not in before:
                    before[peer] = beat
                if beat == before[peer]:
                    beating = False
            if beating:
                return
            await asyncio.sleep(0.1)

    async def _restart_reason(self) -> str:
        a, keys, store, lost = self.a, self.a.keys, self.a.store, self.follower.lost
        seen = self.seen
        current = int(await store.get(keys.current))
        if current != a.attempt:
            return f"node 0 started attempt {current}: its agent restarted"
        now = time.monotonic()
        for peer in range(a.env.nodes):
            if peer in lost:
                seen.pop(peer, None)  # once back, its liveness counts from its return
            if peer == a.node or peer in lost:
                continue
            if a.node == 0 and await store.check(keys.rejoin(a.attempt, peer)):
                return f"the agent of node {peer} restarted"
            beat = await store.peek(keys.heartbeat(a.attempt, peer))
            last, since = seen.get(peer, (None, now))
            if beat != last:
                seen[peer] = (beat, now)
                continue
            if now - since <= self.liveness_s:
                continue
            silent = f"the agent of node {peer} sent no heartbeat for {now - since:.0f} s"
            if peer != 0 and a.node != 0:
                continue  # node 0 decides whether the run goes on without it
            if peer == 0:
                return silent
            blocked = plan(a.manifest, {*lost, peer}, None, self.follower.membership.shrunk).blocked
            if blocked:
                return f"{silent}, and the run cannot go on without it: {'; '.join(blocked)}"
            _say(a.node, f"{silent}: node {peer} is lost; the run goes on without it")
            await self.follower.mark_lost(peer, silent)
        return ""


async def _launch(args: argparse.Namespace, env: LaunchEnv, manifest: Manifest) -> int:
    run_dir = os.path.abspath(args.run_dir) if args.run_dir else resolve_run_dir(manifest)
    keys = LaunchKeys(env.run_id or manifest.run.name)
    store = StoreClient(
        env.master_addr,
        env.master_port,
        is_master=env.node == 0 and not env.agent_store,
        timeout_s=args.join_timeout,
    )
    await store.connect()
    a = await NodeAttempt.join(
        env, store, keys, manifest, run_dir, trace=args.trace, timeout_s=args.join_timeout
    )
    final = await store.peek(keys.final)
    if final is not None:
        said = json.loads(final)
        _say(env.node, f"the run already ended ({said['status']}: {said['reason']})")
        return EXIT_CODES[said["status"]]
    problem = await a.prepare(args, args.join_timeout)
    if problem:
        _say(env.node, problem)
        if env.node == 0:
            await store.set_once(keys.final, _ended("failed", problem, 0))
        return EXIT_USAGE
    a.write_launch()
    # A task beside the attempt, not a TaskGroup: a group would wrap the attempt's StoreError
    # in an ExceptionGroup, and main says a store's failure in one line.
    beating = asyncio.create_task(a.heartbeat())
    try:
        return await _take_part(args, a)
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating


async def _take_part(args: argparse.Namespace, a: NodeAttempt) -> int:
    """Node ``a``'s part in its attempt, from discovery to the end of the run; its exit
    status."""
    env, store, keys, manifest, attempt = a.env, a.store, a.keys, a.manifest, a.attempt
    view = await a.discover(args.join_timeout)
    problem = share(a.node, a.dir, a.hosts)
    if not problem:
        curve, prefix = manifest.security.curve_keys, keys.prefix(attempt)
        secret, problem = await shared_secret(
            store, prefix, a.node, a.dir, curve, args.join_timeout
        )
        view = a.view = dataclasses.replace(view, secret=secret)
    if problem:
        _say(env.node, problem)
        said = _ended("failed", problem, env.node)
        await store.set_once(keys.stop(attempt), said)
        await store.set_once(keys.final, said)
        await store.set(keys.done(attempt, env.node), json.dumps({"restarts": {}, "served": {}}))
        return EXIT_USAGE
    if a.rejoining:
        _say(env.node, f"attempt {attempt} goes on without this node: joining it again")
        await store.set(keys.back(attempt, env.node), json.dumps({"generation": a.rejoining}))
    _say(env.node, f"attempt {attempt}: {len(view.tcp)} replicas over {env.nodes} nodes; starting")
    install_secret(a.dir, view.secret)  # the trace sink and sender below present it too
    sink = None
    if a.trace:
        sink = await start_node_trace(
            a.node,
            env.nodes,
            a.dir,
            a.sink,
            run=manifest.run.name,
            curve_keys=manifest.security.curve_keys,
            say=_say,
        )
    follower = MembershipFollower(
        store=store,
        keys=keys,
        attempt=attempt,
        node=a.node,
        nodes=env.nodes,
        manifest=manifest,
        run_dir=a.run_dir,
        view=view,
        bind_host=a.bind_host,
        host=a.host,
        say=_say,
    )
    follower.keep_shrunk(view.members, a.shrunk_away, a.rejoining)
    watch = _Watch(a, follower, args.agent_liveness)
    try:
        report = await run_manifest(manifest, a.dir, beside=watch, view=view, console=True)
        code = await a.finish(report, args.join_timeout, follower.lost, args.agent_liveness)
    finally:
        if sink is not None:
            await sink.close()
    if env.node == 0 and not a.restart:
        print(summary(report, manifest, a.dir), flush=True)
        if a.trace:
            merge_and_tell(a.run_dir)
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrun ... -m asyncrl.launch",
        description="Be the node agent of this node in a launch over several (docs/multinode.md).",
    )
    parser.add_argument("manifest", help="the role manifest (YAML); see docs/manifest.md")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a manifest value (give the same on every node)",
    )
    parser.add_argument("--run-dir", help="where the run writes (default: the manifest's run_dir)")
    parser.add_argument(
        "--overwrite", action="store_true", help="delete an earlier run there and start afresh"
    )
    parser.add_argument("--allow-nonempty", action="store_true", help="run beside other files")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in the run directory (the roles and the program resume)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="record every call between processes of every node into RUN_DIR/trace.json",
    )
    parser.add_argument(
        "--join-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds to wait for the other nodes at start (default: 300)",
    )
    parser.add_argument(
        "--agent-liveness",
        type=float,
        default=15.0,
        metavar="S",
        help="seconds without another node agent's heartbeat before it is taken as dead",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m asyncrl.launch`` under torchrun; returns the exit
    status."""
    from asyncrl.supervision.rundir import PRIVATE_UMASK
    from asyncrl.transport import run

    args = _parser().parse_args(argv)
    os.umask(PRIVATE_UMASK)  # whatever the run creates is private (docs/reliability.md)
    if args.resume and args.overwrite:
        print(
            "asyncrl.launch: error: give one of --resume and --overwrite",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        env = LaunchEnv.from_environ()
    except ValueError as exc:
        print(f"asyncrl.launch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        manifest = load_manifest(args.manifest, args.set, nodes=env.nodes)
    except ManifestError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    if env.node == 0:
        for warning in node_loss_warnings(manifest, env.nodes):
            _say(0, f"warning: {warning}")
    try:
        code: int = run(_launch(args, env, manifest))
    except StoreError as exc:
        _say(env.node, str(exc))
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
