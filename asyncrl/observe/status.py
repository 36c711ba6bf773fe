"""Live status of a running run: ``asyncrl status RUN_DIR [--json]``.

It asks the running processes; it never guesses from logs. Each node agent serves a small
status endpoint (``AgentStatus``), a transport ``Server`` on ``SOCKETS/agent.sock`` in its
run directory (``RUN_DIR/sockets``, private to the user who runs it). Asked ``status``, the
agent answers with:

- every process its supervisor runs: role, replica, kind, incarnation, pid, whether it serves,
  its restarts and the seconds since its supervisor last heard it (``Supervisor.status``);
- on node 0, the driver's own answer to ``status`` (a plain call, never control): the program,
  its incarnation, the current step and version (from the last per-step metrics record), and,
  per role group, the calls queued for any replica and per replica its credit, calls in flight
  and queued, calls served and seconds busy (``Dispatcher.status``); and for a run on
  multi-turn episodes, the episodes played, restarted and replayed, the environment's
  timeouts and errors, the episodes it failed (never trained) and the times an environment
  replica was quarantined, let back, and restarted by its supervisor, so far;
- each serving Python role replica of the node, asked by the agent: its own ``_status``
  (``asyncrl.supervision.process``): calls answered per method and seconds busy in its handlers,
  whoever called it (the driver, another role, a relay), and what the role reports of itself
  (``Role.status()``, e.g. its device memory). A replica that does not answer within
  ``REPLICA_TIMEOUT_S`` is shown with the reason; it never holds up the answer;
- in a launch over several nodes (``asyncrl.launch``), the same of every other node.
  Each agent also binds its status endpoint on a tcp port, published in the launch's store next to
  the replicas' endpoints (Curve applies as to every tcp socket of the launch), and asks the others
  over it; so ``asyncrl status`` on any node, given RUN_DIR or RUN_DIR/node-R, shows the whole
  run. A node that does not answer is listed with the error. The agent reads the other
  agents' endpoints anew at each question (``peers`` is the node's live map, which its
  membership follower updates): a lost node whose torchrun started again is asked at its new
  agent's endpoint, and shown back.

The same endpoint takes the program's requests to restart a replica (``restart``, an
``asyncrl.restart_request.RestartRequest``): the agent hands one for a replica of its node to
its supervisor, and asks the other nodes' agents about any other (the first whose supervisor
runs the replica answers).

When no agent answers, the run is not running: the command says so, names the endpoint it
tried and the run's last report (``RUN_DIR/report.json``), and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import io
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from asyncrl.errors import AsyncrlError
from asyncrl.restart_request import RESTART_METHOD, RestartAnswer, RestartRequest
from asyncrl.transport import ChannelOptions, Client, LocalRegistry, Server, TransportError
from asyncrl.transport.control import SECRET_FILE, read_secret

__all__ = [
    "AGENT_SOCKET",
    "AgentStatus",
    "NotRunningError",
    "agent_endpoint",
    "ask",
    "format_status",
    "main",
    "process_state",
]

AGENT_SOCKET = "agent.sock"
"""The file name of a node agent's status endpoint in its run directory's socket folder (no
role replica's endpoint, ``<role>.<replica>``, can have this name)."""
ASK_TIMEOUT_S = 3.0
"""Seconds the driver has to answer its agent; another node's agent has twice that (it may wait
on its own driver), and the agent asked by ``asyncrl status`` three times."""

REPLICA_TIMEOUT_S = 1.0
"""Seconds each role replica has to answer the agent's ``_status`` (it answers from its event
loop, which compute never holds)."""

Rows = Callable[[], list[dict[str, Any]]]
Restart = Callable[[RestartRequest], RestartAnswer | Awaitable[RestartAnswer]]
"""What restarts a replica of this node on request (``Supervisor.restart``)."""


MEMBERSHIP_FILE = "membership.json"
"""The file of a node's folder where its agent writes the run's membership (the name
``asyncrl.manifest.membership`` gives it; the observe layer imports no manifest module)."""


def agent_endpoint(run_dir: str) -> str:
    """The ipc endpoint of the status server of the agent that writes in ``run_dir``."""
    return f"ipc://{os.path.join(LocalRegistry(run_dir).socket_dir, AGENT_SOCKET)}"


class AgentStatus:
    """The status endpoint of one node agent, served from ``start()`` to ``close()``.

    Args:
        processes: what the supervisor knows of its processes (``Supervisor.status``).
        run: the run's name.
        run_dir: this node's run directory (its socket folder holds the endpoint).
        node: this node's index (0 on one machine).
        driver: the driver's endpoint, on node 0; "" elsewhere.
        tcp: the tcp endpoint this agent also binds (a launch over several nodes), or "".
        peers: the tcp status endpoint of every node's agent, by node (this node's own entry
            is passed by). It is read at each question, never copied: the launch updates it
            (``asyncrl.supervision.membership_follower``) when a lost node comes back with a
            new agent, and the question after asks that agent.
        timeout_s: seconds the driver and each other agent have to answer.
        curve: the Curve keys of the tcp endpoint and of the clients to the other agents
            (``asyncrl.transport.CurveKeys``), or None: the process's default.
        replicas: the inbox endpoint of every Python role replica of this node, by (role,
            replica): each serving one is asked its own ``_status``
            (``asyncrl.supervision.process``).
        replica_timeout_s: seconds each replica has to answer its ``_status``.
        restart: what restarts a replica of this node on request (``Supervisor.restart``);
            None: ``restart`` is refused (every request answers ``found`` False).
    """

    def __init__(
        self,
        processes: Rows,
        *,
        run: str,
        run_dir: str,
        node: int = 0,
        driver: str = "",
        tcp: str = "",
        peers: Mapping[int, str] | None = None,
        timeout_s: float = ASK_TIMEOUT_S,
        curve: Any = None,
        replicas: dict[tuple[str, int], str] | None = None,
        replica_timeout_s: float = REPLICA_TIMEOUT_S,
        restart: Restart | None = None,
    ) -> None:
        self.processes = processes
        self.run = run
        self.run_dir = run_dir
        self.node = node
        self.driver = driver
        self.tcp = tcp
        self.peers: Mapping[int, str] = peers if peers is not None else {}
        self.timeout_s = timeout_s
        self.curve = curve
        self.replicas = dict(replicas or {})
        self.replica_timeout_s = replica_timeout_s
        self.restart = restart
        self.endpoint = agent_endpoint(run_dir)
        self._servers: list[Server] = []
        self._clients: dict[str, Client] = {}
        self._asked: dict[int, str] = {}  # the endpoint each other agent was last asked at

    async def start(self) -> None:
        """Bind the ipc endpoint (and the tcp one, if any) and answer ``status``, the whole
        run, ``node_status``, this node alone, and ``restart`` (a ``RestartRequest``).

        Raises:
            TransportError: an endpoint cannot be bound.
        """
        for endpoint in (self.endpoint, self.tcp):
            if not endpoint:
                continue
            server = Server(
                endpoint, name=f"agent.{self.node}", options=self._options(), curve=self.curve
            )
            server.add("status", self._status)
            server.add("node_status", self._node_status)
            server.add(RESTART_METHOD, self._restart, RestartRequest)
            server.add("node_restart", self._node_restart, RestartRequest)
            await server.start()
            self._servers.append(server)

    async def close(self) -> None:
        """Stop answering; close every server and client (idempotent)."""
        servers, self._servers = self._servers, []
        clients, self._clients = list(self._clients.values()), {}
        for server in servers:
            await server.close()
        for client in clients:
            await client.close()

    def _options(self) -> ChannelOptions:
        return ChannelOptions(run=self.run, shm=False)

    async def _status(self, _payload: Any, _call: Any) -> dict[str, Any]:
        membership = self.membership()
        lost = {int(n): why for n, why in membership.get("lost", {}).items()}
        peers = {n: ep for n, ep in self.peers.items() if n != self.node and n not in lost}
        await self._forget(peers)
        nodes = await asyncio.gather(
            self.node_status(),
            # Another node's agent may itself wait timeout_s for its driver.
            *(self._ask(ep, "node_status", 2 * self.timeout_s) for ep in peers.values()),
        )
        for node, answer in zip(peers, nodes[1:], strict=True):
            answer.setdefault("node", node)
        nodes.extend({"node": n, "lost": why} for n, why in lost.items())
        answer = {"run": self.run, "run_dir": self.run_dir, "nodes": sorted(nodes, key=_node)}
        if membership:
            answer["membership"] = membership
        return answer

    async def _restart(self, request: RestartRequest, _call: Any) -> RestartAnswer:
        """Restart the replica ``request`` names: this node's supervisor's answer, or, when
        it does not run the replica, the answer of the other node's agent that does. The
        other nodes' agents are asked all at once, each with twice ``timeout_s``, the nodes
        lost for good left out (as in ``status``), so that the answer comes within the
        driver's ``RESTART_TIMEOUT_S``; when none runs the replica, the answer says so."""
        answer = await self.node_restart(request)
        if answer.found:
            return answer
        lost = {int(n) for n in self.membership().get("lost", {})}
        peers = {n: ep for n, ep in self.peers.items() if n != self.node and n not in lost}
        answers = await asyncio.gather(
            *(self._call(ep, "node_restart", request, 2 * self.timeout_s) for ep in peers.values())
        )
        found = [a for a in answers if isinstance(a, RestartAnswer) and a.found]
        if found:
            return found[0]
        why = f"{request.role}[{request.replica}] is not supervised on any node of the run"
        unanswered = [answer.why] if self.restart is None else []
        unanswered += [a for a in answers if isinstance(a, str)]
        unanswered += [f"node {n} is lost" for n in sorted(lost) if n != self.node]
        if unanswered:
            why += f" that answered ({'; '.join(unanswered)})"
        return RestartAnswer(restarted=False, found=False, why=why)

    async def _node_restart(self, request: RestartRequest, _call: Any) -> RestartAnswer:
        return await self.node_restart(request)

    async def node_restart(self, request: RestartRequest) -> RestartAnswer:
        """This node's supervisor's answer to ``request``."""
        if self.restart is None:
            return RestartAnswer(
                restarted=False,
                found=False,
                why=f"the agent of node {self.node} restarts nothing on request",
            )
        answer = self.restart(request)
        return await answer if inspect.isawaitable(answer) else answer

    async def _forget(self, peers: dict[int, str]) -> None:
        """Close the client of every agent endpoint that ``peers`` replaced (the agent of a
        node that came back listens elsewhere now); the ones asked now are remembered."""
        for node, endpoint in list(self._asked.items()):
            if peers.get(node, endpoint) != endpoint:
                client = self._clients.pop(endpoint, None)
                if client is not None:
                    await client.close()
        self._asked.update(peers)

    def membership(self) -> dict[str, Any]:
        """The run's membership as this node's agent last wrote it (``membership.json``: lost
        nodes, replicas that left or moved, each change); ``{}`` while no node was lost."""
        try:
            with open(os.path.join(self.run_dir, MEMBERSHIP_FILE)) as f:
                found = json.load(f)
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    async def _node_status(self, _payload: Any, _call: Any) -> dict[str, Any]:
        return await self.node_status()

    async def node_status(self) -> dict[str, Any]:
        """This node: its index, agent pid, processes (each row with its ``state``:
        ``process_state``), and (node 0) the driver's answer.

        Each serving Python role replica of the node is asked its own ``_status`` at the same
        time (``replica_timeout_s``); its answer, or ``{"error": why}``, is the process row's
        ``status``. A replica that does not answer delays the answer by that timeout at most.
        """
        processes = [row | {"state": process_state(row)} for row in self.processes()]
        answer: dict[str, Any] = {
            "node": self.node,
            "agent_pid": os.getpid(),
            "processes": processes,
        }
        asks = [self._replica_status(row) for row in processes]
        if self.driver:
            driver, *_ = await asyncio.gather(
                self._ask(self.driver, "status", self.timeout_s), *asks
            )
            answer["driver"] = driver
        else:
            await asyncio.gather(*asks)
        return answer

    async def _replica_status(self, row: dict[str, Any]) -> None:
        """Set ``row["status"]`` to the replica's own ``_status`` answer, if it is a serving
        Python role of this node."""
        endpoint = self.replicas.get((row["role"], row["replica"]))
        if endpoint is None or row["kind"] != "role" or not row["serving"]:
            return
        row["status"] = await self._ask(endpoint, "_status", self.replica_timeout_s)

    async def _ask(self, endpoint: str, method: str, timeout_s: float) -> dict[str, Any]:
        """``method``'s answer from the server at ``endpoint``, or ``{"error": why}``. One
        client per endpoint is kept: it reconnects by itself across restarts."""
        answer = await self._call(endpoint, method, None, timeout_s)
        if isinstance(answer, str):
            return {"error": answer}
        return dict(answer)

    async def _call(self, endpoint: str, method: str, payload: Any, timeout_s: float) -> Any:
        """``method``'s answer to ``payload`` from the server at ``endpoint`` (a
        ``RestartAnswer`` for the restart methods), or a string saying why there is none."""
        client = self._clients.get(endpoint)
        try:
            if client is None:
                name = f"status.{self.node}"
                client = Client(endpoint, name=name, options=self._options(), curve=self.curve)
                await client.connect(timeout=timeout_s)
                # Questions at once each connect one; the first kept serves, the others close.
                kept = self._clients.setdefault(endpoint, client)
                if kept is not client:
                    await client.close()
                    client = kept
            reply = RestartAnswer if "restart" in method else Any
            return await client.call(method, payload, reply, timeout=timeout_s)
        except TransportError as exc:
            if client is not None and self._clients.get(endpoint) is not client:
                await client.close()  # never connected: the next question starts afresh
            return f"{endpoint} did not answer {method!r}: {exc}"


def _node(answer: dict[str, Any]) -> int:
    return int(answer.get("node", 0))


class NotRunningError(AsyncrlError):
    """No agent answers for the run directory: the run is not running (the message says
    where it asked and where the run's last report is)."""


def _candidates(run_dir: str) -> list[str]:
    """The run directories whose agent may answer: RUN_DIR (node 0, or the node given as
    RUN_DIR/node-R), then each RUN_DIR/node-R present (the other nodes of a launch)."""
    found = [run_dir]
    with contextlib.suppress(OSError):
        found += [
            os.path.join(run_dir, name)
            for name in sorted(os.listdir(run_dir))
            if name.startswith("node-") and name[5:].isdigit()
        ]
    return found


async def ask(run_dir: str, timeout_s: float = ASK_TIMEOUT_S) -> dict[str, Any]:
    """The whole run's status from the first agent that answers for ``run_dir``.

    Raises:
        NotRunningError: ``run_dir`` is no directory, or no agent answers for it.
    """
    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        raise NotRunningError(f"{run_dir} is not a directory; give the run directory of a run")
    tried: list[str] = []
    for directory in _candidates(run_dir):
        endpoint = agent_endpoint(directory)
        tried.append(endpoint)
        if not os.path.exists(endpoint.removeprefix("ipc://")):
            continue
        secret = os.path.join(directory, SECRET_FILE)  # the agent serves only holders of it
        client = Client(
            endpoint,
            name="asyncrl-status",
            options=ChannelOptions(shm=False),
            secret=read_secret(secret) if os.path.exists(secret) else None,
        )
        try:
            await client.connect(timeout=timeout_s)
            # The agent waits up to timeout_s for its driver, and twice that for other nodes.
            return dict(await client.call("status", None, timeout=3 * timeout_s))
        except TransportError:
            continue  # a socket left by an agent that was killed
        finally:
            await client.close()
    report = os.path.join(run_dir, "report.json")
    last = (
        f"its last report is {report}"
        if os.path.exists(report)
        else f"it left no report ({report} does not exist)"
    )
    raise NotRunningError(f"no agent answers at {', '.join(tried)}; the run is not running; {last}")


def rows(status: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per process of the run (every node): the agent's view, the driver's view of the
    replica (credit, calls in flight and queued, served, ``driver_busy_s``) and the replica's
    own count (``calls``, ``busy_s``, ``memory``: what its ``_status`` answered)."""
    driver: dict[str, Any] = next((n["driver"] for n in status["nodes"] if "driver" in n), {})
    replicas = {
        (role, r["replica"]): r
        for role, group in driver.get("roles", {}).items()
        for r in group.get("replicas", [])
    }
    out: list[dict[str, Any]] = []
    for node in status["nodes"]:
        for p in node.get("processes", []):
            seen = replicas.get((p["role"], p["replica"]), {}) if p["kind"] != "driver" else {}
            own = _own(p.get("status", {}))
            out.append({"node": node.get("node", 0), **p, **_seen(seen), **own})
    return out


def _seen(replica: dict[str, Any]) -> dict[str, Any]:
    keys = ("credit", "inflight", "queued", "served")
    found = {k: replica[k] for k in keys if k in replica}
    if "busy_s" in replica:
        found["driver_busy_s"] = replica["busy_s"]
    return found


def _own(answer: dict[str, Any]) -> dict[str, Any]:
    """What a replica's ``_status`` answer puts in its row: calls answered (every method),
    seconds busy in its handlers, and its device memory (``allocated/total``) if it reports
    one."""
    if not answer or "error" in answer:
        return {}
    own: dict[str, Any] = {"calls": sum(answer["calls"].values()), "busy_s": answer["busy_s"]}
    memory = answer.get("role", {}).get("memory")
    if isinstance(memory, dict) and "allocated" in memory:
        total = memory.get("total") or 0
        used = _bytes(memory["allocated"])
        own["memory"] = f"{used}/{_bytes(total)}" if total else used
    return own


def _bytes(n: int) -> str:
    """``n`` bytes for a person: 512B, 3.0K, 1.5M, 80.0G."""
    if n < 1024:
        return f"{n}B"
    value = n / 1024
    for unit in ("K", "M"):
        if value < 1024:
            return f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}G"


def process_state(row: dict[str, Any]) -> str:
    """A process row's ``state``: ``serving`` (its supervisor has heard it), ``starting``
    (running, not heard yet) or ``down`` (between a crash and its restart)."""
    if row["serving"]:
        return "serving"
    return "starting" if row["alive"] else "down"


def _cell(value: Any, fmt: str = "") -> str:
    return "-" if value is None else format(value, fmt)


def _heading(status: dict[str, Any]) -> list[str]:
    """The lines above the table: the run, the driver's step and version, node errors."""
    lines = [f"run {status['run']} in {status['run_dir']}"]
    for change in status.get("membership", {}).get("changes", []):
        when = time.strftime("%H:%M:%S", time.localtime(change["time"]))
        moved = [f"{label} moved to node {n}" for label, n in change.get("moved", {}).items()]
        left = [f"{label} left the run" for label in change.get("departed", [])]
        shrunk = [
            f"{name} goes on with replicas {members}"
            + (f", led by replica {members[0]}" if members and members[0] != 0 else "")
            for name, members in change.get("shrunk", {}).items()
        ]
        grown = [
            f"{name} grows back to replicas {members}"
            for name, members in change.get("grown", {}).items()
        ]
        what = "lost" if change.get("event") == "node_lost" else "back"
        if grown:
            moved = []  # the ranks that rejoin are in the group's members
        said = left + moved + shrunk + grown
        lines.append(
            f"node {change['node']} {what} at {when} ({change['reason']})"
            + (": " + ", ".join(said) if said else "")
        )
    for node in status["nodes"]:
        if "error" in node:
            lines.append(f"node {node.get('node')}: {node['error']}")
        for p in node.get("processes", []):
            error = p.get("status", {}).get("error")
            if error:
                lines.append(f"{p['role']}[{p['replica']}] on node {_node(node)}: {error}")
        driver = node.get("driver")
        if driver is None:
            continue
        if "error" in driver:
            lines.append(f"driver: {driver['error']}")
            continue
        queued = ", ".join(f"{r} {g['queued']}" for r, g in driver["roles"].items())
        lines.append(
            f"driver incarnation {driver['incarnation']} running {driver['program']}: "
            f"step {_cell(driver['step'])}, version {_cell(driver['version'])}; "
            f"calls waiting for any replica: {queued or 'none'}"
        )
        episodes = driver.get("episodes")
        if episodes:
            lines.append(
                f"episodes played {episodes['episodes']}: restarted {episodes['episode_restarts']}"
                f", replayed {episodes['episode_replays']}; environment timeouts "
                f"{episodes['env_timeouts']}, errors {episodes['env_errors']}; "
                f"infra-failed {episodes.get('infra_failed', 0)} (never trained); replicas "
                f"quarantined {episodes.get('quarantined', 0)}, let back "
                f"{episodes.get('quarantine_released', 0)}, restarted "
                f"{episodes.get('quarantine_restarts', 0)}"
            )
    return lines


COLUMNS = (
    ("node", "node", ""),
    ("role", "role", ""),
    ("replica", "replica", ""),
    ("incarnation", "inc", ""),
    ("pid", "pid", ""),
    ("state", "state", ""),
    ("restarts", "restarts", ""),
    ("heartbeat_age_s", "heartbeat s ago", ".2f"),
    ("credit", "credit", ""),
    ("inflight", "in flight", ""),
    ("queued", "queued", ""),
    ("served", "served", ""),
    ("calls", "calls", ""),
    ("busy_s", "busy s", ".1f"),
    ("memory", "memory", ""),
)
"""The table's columns: the row's key, the header, the number format."""


def format_status(status: dict[str, Any], width: int | None = None) -> str:
    """The status as a person reads it: the heading lines, then a ``rich`` table with one row
    per process (every node). ``width``: the table's width (default: the terminal's)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False)
    for _, header, _ in COLUMNS:
        table.add_column(header, justify="left" if header in ("role", "state") else "right")
    for row in rows(status):
        table.add_row(*(_cell(row.get(key), fmt) for key, _, fmt in COLUMNS))
    out = io.StringIO()
    Console(width=width or 160, file=out, color_system=None).print(table)
    return "\n".join(_heading(status)) + "\n" + out.getvalue().rstrip() + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl status",
        description="Ask a running run what it is doing: every role with its replicas, "
        "incarnations, restarts, queue depth, credit, last heartbeat; the step and version.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (or RUN_DIR/node-R)")
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    parser.add_argument(
        "--timeout",
        type=float,
        default=ASK_TIMEOUT_S,
        help=f"seconds the driver has to answer (other nodes twice that; {ASK_TIMEOUT_S:g})",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """``asyncrl status RUN_DIR [--json] [--timeout S]``: 0 when the run answered, 1 when it
    is not running (the reason on stderr)."""
    args = _parser().parse_args(argv)
    try:
        status = asyncio.run(ask(args.run_dir, args.timeout))
    except NotRunningError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        width = os.get_terminal_size().columns if sys.stdout.isatty() else 160
        print(format_status(status, width), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
