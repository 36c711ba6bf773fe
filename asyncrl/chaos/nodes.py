"""``asyncrl chaos MANIFEST --nodes N --kill-node K --every D [--rejoin-after T]``: lose a whole
node of a launch over several, on a schedule, and account for it.

The manifest is launched as N torchrun "nodes" on this machine, as docs/multinode.md rehearses
several machines: N torchrun processes on 127.0.0.1 with ``--nnodes=N``, node R with
``ASYNCRL_HOST_ID=nodeR`` (R > 0, so that no shared memory crosses between nodes), each running
``-m asyncrl.launch`` on one run directory. Every ``every`` seconds (from the run's start, or
from where ``from_phase`` and ``after`` aim the schedule) node K is lost for good: its
torchrun, its agent and every process of its roles SIGKILLed at once. ``rejoin_after`` seconds
later, once node 0 has marked it lost, its torchrun is started again with the same command: it
joins the running attempt (docs/multinode.md, "A node lost for good"). The next loss waits
until the node is back and its replicas serve the driver again.

Node 0 holds torchrun's store and runs the driver: its loss ends the whole launch, which is not
a loss this campaign can take (``check_node_plan`` refuses it and says what happens instead).

Each run directory gets ``chaos.json``, as the one-machine campaign writes it, with
``node_events``: every loss (``lost``), restart of a torchrun (``restarted``) and return to
service (``serving``: every replica the node brought back connected to the driver's dispatcher
with credit), each with its Unix ``time``. ``asyncrl.chaos.accounting.node_figures`` reads them
back beside the membership changes and steps of ``metrics.jsonl``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from asyncrl.chaos.accounting import CHAOS_FILE
from asyncrl.safe_files import write_atomic

__all__ = [
    "NodeLaunch",
    "NodePlan",
    "check_node_plan",
    "kill_node",
    "node_tree",
    "run_node_campaign",
]

POLL_S = 0.2
"""How often the campaign looks at the run's files and processes while it waits."""
STATUS_TIMEOUT_S = 5.0
"""The deadline of one ``asyncrl status`` question while waiting for a node's replicas."""
JANITOR_MODULE = b"asyncrl.supervision.janitor"
"""How a node's janitor is started (``python -m asyncrl.supervision.janitor``)."""
EXIT_GRACE_S = 30.0
"""How long the other nodes may take to end once node 0 has ended before they are killed (a
node whose torchrun was started again as the run ended waits for a store that is gone)."""


@dataclass(frozen=True)
class NodePlan:
    """What to do to a launch over several nodes.

    Attributes:
        nodes: how many torchrun nodes to launch (``--nnodes``).
        kill_node: the node lost on the schedule (never 0).
        every: seconds between two losses.
        rejoin_after: seconds from a loss to starting the node's torchrun again; ``None``: the
            node stays lost (one loss).
        losses: lose the node at most this many times (``None``: until the run ends).
        from_phase: the first loss counts from the start of this phase of the program
            (``None``: from the run's start).
        after: seconds to add before the schedule starts.
        agent_liveness: the launch's ``--agent-liveness``: seconds without a heartbeat before
            node 0 takes a node as lost.
        join_timeout: the launch's ``--join-timeout``.
    """

    nodes: int
    kill_node: int
    every: float
    rejoin_after: float | None = None
    losses: int | None = None
    from_phase: str | None = None
    after: float = 0.0
    agent_liveness: float = 15.0
    join_timeout: float = 300.0


def check_node_plan(plan: NodePlan) -> None:
    """Check the arguments of ``plan``.

    Raises:
        ValueError: a bad argument, naming its flag and the fix.
    """
    if plan.nodes < 2:
        raise ValueError(
            f"--nodes {plan.nodes}: losing a node needs a launch of at least 2 nodes; give "
            "--nodes 2 or more, or leave out --nodes to kill processes on one machine"
        )
    if plan.kill_node == 0:
        raise ValueError(
            "--kill-node 0: node 0 hosts torchrun's store and runs the driver, so its loss is "
            "not a node lost for good: every agent ends its attempt, the launch exits 1, and "
            "the run goes on only when it is started again on every node with "
            "'torchrun ... -m asyncrl.launch MANIFEST --resume', from its checkpoints "
            f"(docs/multinode.md, Failures); choose a node from 1 to {plan.nodes - 1}"
        )
    if not 0 < plan.kill_node < plan.nodes:
        raise ValueError(
            f"--kill-node {plan.kill_node}: the launch has nodes 0 to {plan.nodes - 1} "
            f"(--nodes {plan.nodes}); choose a node from 1 to {plan.nodes - 1}"
        )
    if plan.rejoin_after is not None and plan.rejoin_after >= plan.every:
        raise ValueError(
            f"--rejoin-after {plan.rejoin_after:g}s is not shorter than --every "
            f"{plan.every:g}s: node {plan.kill_node} must be back before its next loss; "
            "shorten --rejoin-after or lengthen --every"
        )
    if plan.losses is not None and plan.losses < 1:
        raise ValueError(
            f"--losses {plan.losses}: give at least 1, or leave --losses out to lose the node "
            "until the run ends"
        )
    if plan.losses is not None and plan.losses > 1 and plan.rejoin_after is None:
        raise ValueError(
            f"--losses {plan.losses}: a node that is never started again is lost once; give "
            "--rejoin-after D to lose it again after it comes back, or --losses 1"
        )


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _parents() -> dict[int, int]:
    """Every process's parent, from ``/proc``."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # it ended meanwhile
        # pid (comm) state ppid ...: comm may hold spaces and parentheses; it ends at the last ')'
        fields = stat[stat.rfind(b")") + 2 :].split()
        out[int(name)] = int(fields[1])
    return out


def node_tree(root: int, parents: dict[int, int] | None = None) -> set[int]:
    """``root`` and every process descended from it (``parents``: from ``/proc`` when
    ``None``)."""
    parents = _parents() if parents is None else parents
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in tree:
            continue
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


def _is_janitor(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return JANITOR_MODULE in f.read().split(b"\0")
    except OSError:
        return False


def kill_node(torchrun: subprocess.Popen[bytes], folder: str) -> list[int]:
    """SIGKILL a node's ``torchrun``, its agent and every process of its roles at once; return
    the pids killed. ``folder``: the node's folder of the run directory.

    The agent's pid comes from the node's ``launch.json`` and its roles' from its
    ``registry/``; every one of them must descend from the node's torchrun (a registry entry of
    an earlier incarnation, or of a replica that moved to another node, is left alone), and so
    must the processes they started. Each process group led by one of them is killed whole. The
    node's janitor (``asyncrl.supervision.janitor``) is spared, as a signal to the node's
    process groups spares it: it sweeps the shared memory and sockets of the processes killed,
    which on a machine really lost go with it."""
    tree = {pid for pid in node_tree(torchrun.pid) if not _is_janitor(pid)}
    named = [torchrun.pid, (_read_json(os.path.join(folder, "launch.json")) or {}).get("pid")]
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(os.path.join(folder, "registry"))):
            named.append((_read_json(os.path.join(folder, "registry", name)) or {}).get("pid"))
    pids = sorted(tree | {p for p in named if isinstance(p, int) and p in tree})
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(pid)
            if group in tree:
                os.killpg(group, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
    torchrun.wait()
    return pids


@dataclass
class NodeLaunch:
    """``count`` torchrun processes on 127.0.0.1 running ``asyncrl.launch`` on one manifest, node
    R with ``ASYNCRL_HOST_ID=nodeR`` (R > 0), all on ``run_dir``; their output goes to
    ``logs/nodeR.log`` beside it (``nodeR-back-N.log`` for its N-th restart)."""

    manifest: str
    overrides: list[str]
    run_dir: str
    count: int
    options: list[str] = field(default_factory=list)
    log_dir: str = ""
    port: int = 0
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    starts: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.log_dir = self.log_dir or os.path.join(os.path.dirname(self.run_dir), "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        if not self.port:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = int(s.getsockname()[1])

    def folder(self, node: int, *parts: str) -> str:
        """Node ``node``'s folder of the run directory (node 0: the run directory itself)."""
        base = self.run_dir if node == 0 else os.path.join(self.run_dir, f"node-{node}")
        return os.path.join(base, *parts)

    def log(self, node: int) -> str:
        """The file node ``node``'s torchrun writes into now."""
        base = os.path.basename(self.run_dir)
        n = self.starts.get(node, 1) - 1
        suffix = f"-back-{n}" if n else ""
        return os.path.join(self.log_dir, f"{base}-node{node}{suffix}.log")

    def start(self, node: int) -> None:
        """Start node ``node``'s torchrun (again, after a loss: the same command)."""
        self.starts[node] = self.starts.get(node, 0) + 1
        env = dict(os.environ)
        env.pop("ASYNCRL_HOST_ID", None)
        if node:
            env["ASYNCRL_HOST_ID"] = f"node{node}"
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        command = [
            torchrun if os.path.exists(torchrun) else "torchrun",
            f"--nnodes={self.count}",
            "--nproc-per-node=1",
            f"--node-rank={node}",
            "--master-addr=127.0.0.1",
            f"--master-port={self.port}",
            "--max-restarts=0",
            "--monitor-interval=0.1",
            "-m",
            "asyncrl.launch",
            self.manifest,
            "--run-dir",
            self.run_dir,
            *(a for o in self.overrides for a in ("--set", o)),
            *self.options,
        ]
        out: IO[bytes]
        with open(self.log(node), "wb") as out:
            self.procs[node] = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def lose(self, node: int) -> list[int]:
        """SIGKILL node ``node``'s torchrun, its agent and every process of its roles at once
        (``kill_node``); return the pids killed."""
        return kill_node(self.procs[node], self.folder(node))

    def alive(self, node: int) -> bool:
        return node in self.procs and self.procs[node].poll() is None

    def kill_all(self) -> None:
        """SIGKILL every torchrun still running, with everything under it."""
        for node in list(self.procs):
            if self.alive(node):
                self.lose(node)


class Ended(Exception):
    """Node 0's torchrun ended, or the program finished: the schedule stops."""


@dataclass
class NodeCampaign:
    """Runs one launch and the losses of ``plan`` against it, recording ``node_events``."""

    launch: NodeLaunch
    plan: NodePlan | None
    say: Callable[[str], None]
    t0: float = field(default_factory=time.time)
    node_events: list[dict[str, Any]] = field(default_factory=list)
    aimed_at_s: float | None = None
    program_s: float | None = None

    def now(self) -> float:
        return time.time() - self.t0

    def _ending(self) -> bool:
        if self.program_s is None:
            driver = _read_json(os.path.join(self.launch.run_dir, "driver.json"))
            if isinstance(driver, dict) and driver.get("finished"):
                self.program_s = self.now()
        return self.program_s is not None or not self.launch.alive(0)

    async def _until(self, ready: Callable[[], object]) -> Any:
        """``ready()``'s first true value, asked every ``POLL_S``; raises ``Ended`` once the
        run ends first."""
        while True:
            value = ready()
            if value:
                return value
            if self._ending():
                raise Ended
            await asyncio.sleep(POLL_S)

    async def _sleep_until(self, moment: float) -> None:
        await self._until(lambda: time.time() >= moment)

    def _record(self, event: str, node: int, **more: Any) -> dict[str, Any]:
        entry = {"event": event, "node": node, "time": time.time(), "t": self.now(), **more}
        self.node_events.append(entry)
        return entry

    async def run(self) -> None:
        for node in range(self.launch.count):
            self.launch.start(node)
        if self.plan is not None:
            with contextlib.suppress(Ended):
                await self._disrupt(self.plan)
        await self._finish()

    async def _disrupt(self, plan: NodePlan) -> None:
        from asyncrl.chaos.campaign import HISTORY_FILE

        node = plan.kill_node
        if plan.from_phase is not None:
            history = os.path.join(self.launch.run_dir, HISTORY_FILE)
            await self._until(functools.partial(_has_phase, history, plan.from_phase))
            self.say(f"chaos: phase {plan.from_phase} began at {self.now():.1f} s")
        await self._sleep_until(time.time() + plan.after)
        self.aimed_at_s = self.now()
        last = time.time()
        launch_file = self.launch.folder(node, "launch.json")
        while plan.losses is None or len(self._losses()) < plan.losses:
            await self._sleep_until(last + plan.every)
            # the node's agent has started (its pid is known) before it can be lost
            await self._until(lambda: os.path.exists(launch_file) and self.launch.alive(node))
            pids = self.launch.lose(node)
            loss = self._record("lost", node, pids=len(pids))
            last = loss["time"]
            self.say(
                f"chaos: node {node} lost (SIGKILL of {len(pids)} processes) at {loss['t']:.1f} s"
            )
            if plan.rejoin_after is None:
                return  # lost for good: nothing more to do to it
            marked = await self._until(functools.partial(self._change, "node_lost", node, last))
            self.say(f"chaos: node 0 marked node {node} lost at {marked['time'] - self.t0:.1f} s")
            await self._sleep_until(last + plan.rejoin_after)
            self.launch.start(node)
            restart = self._record("restarted", node)
            self.say(f"chaos: node {node}'s torchrun started again at {restart['t']:.1f} s")
            back = await self._until(
                functools.partial(self._change, "node_back", node, restart["time"])
            )
            replicas = sorted(back.get("moved") or {})
            while not await _driver_serves(self.launch.run_dir, replicas):
                if self._ending():
                    raise Ended
                await asyncio.sleep(POLL_S)
            serving = self._record("serving", node, replicas=replicas)
            self.say(
                f"chaos: node {node}'s replicas ({', '.join(replicas) or 'none'}) serve the "
                f"driver again at {serving['t']:.1f} s"
            )

    def _losses(self) -> list[dict[str, Any]]:
        return [e for e in self.node_events if e["event"] == "lost"]

    def _membership_changes(self) -> list[dict[str, Any]]:
        seen = _read_json(os.path.join(self.launch.run_dir, "membership.json"))
        changes = seen.get("changes") if isinstance(seen, dict) else None
        return [c for c in changes or [] if isinstance(c, dict)]

    def _change(self, kind: str, node: int, since: float) -> dict[str, Any] | None:
        """Node 0's first membership change ``kind`` of ``node`` at or after ``since`` (Unix
        time), or ``None``."""
        for change in self._membership_changes():
            at = change.get("time")
            mine = change.get("event") == kind and change.get("node") == node
            if mine and isinstance(at, int | float) and at >= since:
                return change
        return None

    async def _finish(self) -> None:
        """Wait for node 0's torchrun to end, then for the others (node 0 waits for the nodes
        of its attempt to report before it exits), killing those still running after
        ``EXIT_GRACE_S``."""
        while self.launch.alive(0):
            self._ending()
            await asyncio.sleep(POLL_S)
        self._ending()
        deadline = time.time() + EXIT_GRACE_S
        while time.time() < deadline:
            if not any(self.launch.alive(n) for n in self.launch.procs):
                break
            await asyncio.sleep(POLL_S)
        for node in list(self.launch.procs):
            if self.launch.alive(node):
                self.say(f"chaos: node {node} still ran after node 0 ended: killed")
                self.launch.lose(node)


def _has_phase(history: str, phase: str) -> bool:
    try:
        with open(history, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("phase") == phase:
            return True
    return False


async def _driver_serves(run_dir: str, replicas: list[str]) -> bool:
    """Whether the driver's dispatcher holds each of ``replicas`` (``role[i]``) of a role it
    dispatches to connected and with credit (``asyncrl status``)."""
    from asyncrl.errors import AsyncrlError
    from asyncrl.observe.status import ask

    try:
        status = await ask(run_dir, STATUS_TIMEOUT_S)
    except (AsyncrlError, OSError):  # not running (yet, or any more), or no answer in time
        return False
    driver = next((n["driver"] for n in status.get("nodes", []) if "driver" in n), None)
    if not isinstance(driver, dict):
        return False
    roles = driver.get("roles") or {}
    for label in replicas:
        role, _, index = label.rstrip("]").partition("[")
        if role not in roles:
            continue  # the driver does not dispatch to it
        rows = roles[role].get("replicas") or []
        if not any(
            r.get("replica") == int(index) and r.get("connected") and (r.get("credit") or 0) > 0
            for r in rows
        ):
            return False
    return True


def _write_json(path: str, data: Any) -> None:
    write_atomic(path, (json.dumps(data, indent=2) + "\n").encode())


def run_node_campaign(
    manifest_path: str,
    overrides: list[str],
    run_dir: str,
    plan: NodePlan | None,
    count: int,
    say: Callable[[str], None],
    options: list[str],
) -> int:
    """Launch ``manifest_path`` (with ``overrides``) over ``count`` nodes in ``run_dir``,
    losing nodes as ``plan`` says (``None``: undisturbed); write ``chaos.json`` there and
    return node 0's exit status (the run's)."""
    from asyncrl.transport import run

    launch = NodeLaunch(manifest_path, overrides, run_dir, count, options)
    campaign = NodeCampaign(launch, plan, say)
    interrupted = False
    try:
        run(campaign.run())
    except KeyboardInterrupt:
        interrupted = True
        say("chaos: interrupted: every node's torchrun is killed")
    finally:
        launch.kill_all()
    code = 130 if interrupted else launch.procs[0].returncode
    record = {
        "wall_s": campaign.now(),
        "program_s": campaign.program_s,
        "plan": None if plan is None else dict(plan.__dict__),
        "aimed_at_s": campaign.aimed_at_s if plan is not None else None,
        "kills": [],
        "stops": [],
        "events": [],
        "nodes": count,
        "node_events": campaign.node_events,
        "exit_codes": {str(n): p.returncode for n, p in sorted(launch.procs.items())},
        "logs": launch.log_dir,
    }
    _write_json(os.path.join(run_dir, CHAOS_FILE), record)
    return int(code) if code is not None else 1


def launch_options(plan: NodePlan) -> list[str]:
    """The options every node's ``asyncrl.launch`` gets from ``plan``."""
    return [f"--agent-liveness={plan.agent_liveness:g}", f"--join-timeout={plan.join_timeout:g}"]


def run_node_chaos(
    manifest_path: str,
    overrides: list[str],
    run_dir: str,
    plan: NodePlan,
    *,
    baseline: bool,
    as_json: bool,
) -> int:
    """Launch the manifest undisturbed over ``plan.nodes`` nodes (unless ``baseline`` is
    false), then again losing node ``plan.kill_node`` on ``plan``'s schedule, then print the
    accounting (the one-machine campaign's and ``node_figures``); return the exit status (0:
    the chaos launch completed). ``--json`` prints the whole accounting, and a person gets
    ``format_node_summary``; both are in ``RUN_DIR/accounting.json``."""
    from asyncrl.chaos.accounting import account, format_node_summary, node_figures
    from asyncrl.chaos.campaign import aim_figures, format_aim
    from asyncrl.observe.metrics import read_metrics

    undisturbed = os.path.join(run_dir, "undisturbed")
    disturbed = os.path.join(run_dir, "chaos")
    options = launch_options(plan)

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def launch(where: str, disrupt: NodePlan | None) -> int:
        return run_node_campaign(manifest_path, overrides, where, disrupt, plan.nodes, say, options)

    first: int | None = None
    if baseline:
        say(f"chaos: undisturbed launch over {plan.nodes} nodes in {undisturbed}")
        first = launch(undisturbed, None)
        say(f"chaos: undisturbed launch ended with status {first}")
        if first not in (0, 130):
            reason = (
                f"the undisturbed launch ended with status {first}, so there is nothing to "
                f"compare with and no chaos launch was made; see {undisturbed} and its node "
                f"logs in {os.path.join(run_dir, 'logs')}"
            )
            if as_json:
                print(json.dumps({"completed": None, "status": None, "reason": reason}))
            else:
                say(f"chaos: {reason}")
            return 1
    if first == 130:
        return 130
    say(f"chaos: chaos launch over {plan.nodes} nodes in {disturbed}")
    code = launch(disturbed, plan)
    if code == 130:
        return 130
    say(f"chaos: chaos launch ended with status {code}")
    accounting = account(disturbed, undisturbed if baseline else None)
    accounting.update(aim_figures(disturbed))
    chaos = _read_json(os.path.join(disturbed, CHAOS_FILE)) or {}
    try:
        metrics = read_metrics(os.path.join(disturbed, "metrics.jsonl"))
    except OSError:
        metrics = []
    accounting.update(node_figures(chaos, metrics))
    accounting["node_plan"] = dict(plan.__dict__)
    accounting["exit_codes"] = chaos.get("exit_codes")
    accounting["run_dir"] = run_dir
    _write_json(os.path.join(run_dir, "accounting.json"), accounting)
    if as_json:
        print(json.dumps(accounting), flush=True)
    else:
        print(format_node_summary(accounting), flush=True)
        print(format_aim(accounting), flush=True)
        print(f"accounting: {os.path.join(run_dir, 'accounting.json')}", flush=True)
    return {0: 0, 130: 130}.get(code, 1)
