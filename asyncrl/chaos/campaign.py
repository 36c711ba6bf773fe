"""``asyncrl chaos``: run a manifest while killing and freezing its processes, and account for it.

The supervisor runs in this process, as ``asyncrl run`` runs it (``build_children`` and
``Supervisor``), with two more tasks beside it:

- the killer: every ``kill_every`` seconds, SIGKILL one process drawn (seeded) from the live,
  serving replicas of the targeted roles;
- the freezer (optional): every ``stop_every`` seconds, SIGSTOP one such process for
  ``stop_for`` seconds, then SIGCONT (the supervisor may take it as hung and kill it first).

Both start at the run's start, or where the plan aims them: ``after`` seconds later, and with
``from_phase`` once the program has begun that phase (its first entry in ``RUN_DIR/history.jsonl``,
which ``asyncrl.roles.program.run.Run`` writes at each step and evaluation of a phase), then
``after`` seconds past that. ``chaos.json`` keeps when they started (``aimed_at_s``: None
when the phase never began, and nothing was disrupted).

The supervisor's ``observer`` records when each process exited and served again, which times
recovery. Unless told otherwise the same manifest first runs undisturbed, for the comparison.
Each run's directory gets ``chaos.json`` (wall time, kills, stops, events) beside the files the
run writes itself; ``asyncrl.chaos.accounting`` reads them all back.

The default restart budget (5 in 60 s) cannot absorb a kill every few seconds, so the targeted
roles get budgets sized to the schedule, set through the same overrides as ``--set`` (which
come after them and win).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from asyncrl.chaos.accounting import CHAOS_FILE, account, format_accounting
from asyncrl.manifest.load import Manifest, Supervision
from asyncrl.safe_files import write_atomic

__all__ = [
    "ChaosPlan",
    "Disruptor",
    "aim_figures",
    "budget_overrides",
    "check_roles",
    "format_aim",
    "parse_duration",
    "phase_began",
    "run_chaos",
    "supervise",
]

DRIVER = "driver"
"""The driver's role name, as ``--roles`` and the supervisor give it."""

BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 1.0
BUDGET_SLACK = 5
"""Restarts allowed in a period beyond those the schedule itself causes: a role that crashes by
itself as often as the default budget allows still fails the run."""

HISTORY_FILE = "history.jsonl"
"""Where a program built on ``Run`` records each (phase, step): how ``from_phase`` sees a phase
begin (the runtime knows no roles, so the name is kept here too)."""
PHASE_POLL_S = 0.2
"""How often the history file is read while waiting for a phase to begin."""

_DURATION = re.compile(r"(?P<n>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>ms|s|m|h)")
_UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``5s``, ``500ms``, ``2m``, ``1.5h`` (a unit is required).

    Raises ``ValueError`` naming the bad text and the accepted forms.
    """
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"not a duration: {text!r}; write a number with a unit (ms, s, m or h), "
            "e.g. 500ms, 5s, 2m"
        )
    seconds = float(match["n"]) * _UNITS[match["unit"]]
    if seconds <= 0:
        raise ValueError(f"not a duration: {text!r}; it must be longer than 0")
    return seconds


def check_roles(manifest: Manifest, roles: list[str]) -> list[str]:
    """``roles`` deduplicated in order, each a role of ``manifest`` or ``driver``.

    Raises ``ValueError`` naming the unknown ones and listing the manifest's roles.
    """
    known = [*manifest.roles, DRIVER]
    wanted = list(dict.fromkeys(r.strip() for r in roles if r.strip()))
    if not wanted:
        raise ValueError(f"--roles names no role; choose among {', '.join(known)}")
    unknown = [r for r in wanted if r not in known]
    if unknown:
        raise ValueError(
            f"--roles names {', '.join(map(repr, unknown))}, not in the manifest; "
            f"choose among {', '.join(known)}"
        )
    return wanted


@dataclass(frozen=True)
class ChaosPlan:
    """What to do to a run.

    Attributes:
        roles: the roles whose replicas may be disrupted (``driver`` for the driver).
        kill_every: seconds between two SIGKILLs; ``None`` kills nothing.
        stop_every: seconds between two freezes; ``None`` freezes nothing.
        stop_for: seconds a frozen process stays stopped before SIGCONT.
        seed: seeds the draw of which process is hit.
        from_phase: disrupt only once the program has begun this phase (``None``: from the
            run's start).
        after: seconds to wait, from the run's start or the phase's, before the schedule
            starts.
    """

    roles: tuple[str, ...]
    kill_every: float | None = 5.0
    stop_every: float | None = None
    stop_for: float = 5.0
    seed: int = 0
    from_phase: str | None = None
    after: float = 0.0


def budget_overrides(manifest: Manifest, plan: ChaosPlan) -> list[str]:
    """``--set`` overrides that give each targeted role a restart budget for the schedule.

    Within its ``period_s`` a role can be hit by every kill and every freeze of the plan; it
    gets that many restarts plus ``BUDGET_SLACK``, and a short backoff (``BACKOFF_INITIAL_S``
    doubling to at most ``BACKOFF_MAX_S``) so that recovery time measures the runtime rather
    than the backoff.
    """
    out: list[str] = []
    for role in plan.roles:
        policy = manifest.driver.supervision if role == DRIVER else manifest.roles[role].supervision
        prefix = f"{DRIVER}.supervision" if role == DRIVER else f"roles.{role}.supervision"
        hits = 0
        if plan.kill_every:
            hits += math.ceil(policy.period_s / plan.kill_every)
        if plan.stop_every:
            hits += math.ceil(policy.period_s / plan.stop_every)
        out += [
            f"{prefix}.max_restarts={max(policy.max_restarts, hits + BUDGET_SLACK)}",
            f"{prefix}.backoff_initial_s={min(policy.backoff_initial_s, BACKOFF_INITIAL_S)}",
            f"{prefix}.backoff_max_s={min(policy.backoff_max_s, BACKOFF_MAX_S)}",
        ]
    return out


def budgets(manifest: Manifest, roles: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """The restart budgets in effect for ``roles`` in ``manifest``."""
    out: dict[str, dict[str, float]] = {}
    for role in roles:
        policy: Supervision = (
            manifest.driver.supervision if role == DRIVER else manifest.roles[role].supervision
        )
        out[role] = {
            "max_restarts": policy.max_restarts,
            "period_s": policy.period_s,
            "backoff_initial_s": policy.backoff_initial_s,
            "backoff_max_s": policy.backoff_max_s,
        }
    return out


@dataclass
class Disruptor:
    """Kills and freezes the supervisor's processes on ``plan``'s schedule, and records it all.

    ``processes`` lists the supervisor's processes (``Supervisor.processes``); ``observe`` is
    the supervisor's observer. ``events``, ``kills`` and ``stops`` are what ``chaos.json`` keeps;
    times are seconds from ``t0``.
    """

    plan: ChaosPlan
    processes: Any
    say: Any = None
    run_dir: str = ""
    t0: float = field(default_factory=time.monotonic)
    events: list[dict[str, Any]] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    stops: list[dict[str, Any]] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _frozen: set[int] = field(default_factory=set)
    _killed: set[int] = field(default_factory=set)
    _caused: set[tuple[str, int]] = field(default_factory=set)
    _ending: bool = False
    aimed_at_s: float | None = None

    def __post_init__(self) -> None:
        self._rng = random.Random(self.plan.seed)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def observe(self, kind: str, label: str, incarnation: int) -> None:
        """The supervisor's observer: record the event and wake a waiting draw."""
        self.events.append(
            {"t": self.now(), "kind": kind, "label": label, "incarnation": incarnation}
        )
        if label == f"{DRIVER}[0]":
            # The driver exiting by itself means the run is ending: disrupt no more, or the
            # shutdown would be counted as damage. A restarted driver resumes the schedule.
            if kind == "exited" and (label, incarnation) not in self._caused:
                self._ending = True
            elif kind == "serving":
                self._ending = False
        self._changed.set()

    async def run(self) -> None:
        """Wait for where the plan aims, then kill and freeze until cancelled; a frozen process
        is always continued on the way out."""
        if self.plan.from_phase is not None:
            await phase_began(self.run_dir, self.plan.from_phase)
            if self.say is not None:
                self.say(f"chaos: phase {self.plan.from_phase} began at {self.now():.1f} s")
        await asyncio.sleep(self.plan.after)
        self.aimed_at_s = self.now()
        try:
            async with asyncio.TaskGroup() as tasks:
                if self.plan.kill_every:
                    tasks.create_task(self._every(self.plan.kill_every, self._kill))
                if self.plan.stop_every:
                    tasks.create_task(self._every(self.plan.stop_every, self._freeze))
        finally:
            for pid in list(self._frozen):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGCONT)
            self._frozen.clear()

    async def _every(self, period: float, act: Any) -> None:
        while True:
            await asyncio.sleep(period)
            target = await self._draw()
            await act(target)

    async def _draw(self) -> Any:
        """A live, serving, unfrozen process of the targeted roles, drawn with the plan's seed;
        waits for one while there is none (all restarting) or while the run is ending."""
        while True:
            self._changed.clear()
            if not self._ending:
                candidates = [
                    p
                    for p in self.processes()
                    if p.role in self.plan.roles
                    and p.alive
                    and p.serving
                    and p.pid is not None
                    and p.pid not in self._frozen
                    and p.pid not in self._killed
                ]
                if candidates:
                    return self._rng.choice(candidates)
            await self._changed.wait()

    def _record(self, what: str, target: Any) -> dict[str, Any]:
        entry = {
            "t": self.now(),
            "role": target.role,
            "replica": target.replica,
            "label": target.label,
            "incarnation": target.incarnation,
            "pid": target.pid,
        }
        self._caused.add((target.label, target.incarnation))
        if self.say is not None:
            self.say(
                f"chaos: {what} {target.label} (pid {target.pid}, incarnation "
                f"{target.incarnation}) at {entry['t']:.1f} s"
            )
        return entry

    async def _kill(self, target: Any) -> None:
        try:
            os.kill(target.pid, signal.SIGKILL)
        except ProcessLookupError:
            return  # it died on its own between the draw and the kill
        self._killed.add(target.pid)  # until the supervisor reaps it, it still looks alive
        self.kills.append(self._record("SIGKILL", target))

    async def _freeze(self, target: Any) -> None:
        try:
            os.kill(target.pid, signal.SIGSTOP)
        except ProcessLookupError:
            return
        self._frozen.add(target.pid)
        entry = self._record(f"SIGSTOP for {self.plan.stop_for:g} s", target)
        self.stops.append(entry)
        try:
            await asyncio.sleep(self.plan.stop_for)
        finally:
            self._frozen.discard(target.pid)
            still = any(
                p.pid == target.pid and p.alive and p.incarnation == target.incarnation
                for p in self.processes()
            )
            entry["continued"] = still  # False: the supervisor killed it as hung first
            if still:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(target.pid, signal.SIGCONT)


async def phase_began(
    run_dir: str,
    phase: str,
    poll_s: float = PHASE_POLL_S,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Return once ``RUN_DIR/history.jsonl`` holds an entry of ``phase`` (read every ``poll_s``
    seconds, ``sleep`` waiting between reads; only complete lines, each once)."""
    path = os.path.join(run_dir, HISTORY_FILE)
    offset = 0
    while True:
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size < offset:  # cut short on a resume: read again
                    offset = 0
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            data = b""
        end = data.rfind(b"\n") + 1
        offset += end
        for line in data[:end].splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("phase") == phase:
                return
        await sleep(poll_s)


async def supervise(manifest: Manifest, run_dir: str, plan: ChaosPlan | None, say: Any) -> Any:
    """Run ``manifest`` in ``run_dir`` under a supervisor in this process, disrupted by ``plan``
    (``None``: undisturbed); write ``report.json`` and ``chaos.json``; return the RunReport."""
    from asyncrl.supervision.agent import run_manifest

    disruptor = Disruptor(plan or ChaosPlan(roles=(), kill_every=None), _never, say, run_dir)

    async def disrupt(supervisor: Any) -> None:
        disruptor.processes = supervisor.processes
        if plan is not None:
            await disruptor.run()

    started = disruptor.t0 = time.monotonic()
    report = await run_manifest(
        manifest, run_dir, observer=disruptor.observe, beside=disrupt, console=False
    )
    wall = time.monotonic() - started
    driver_exits = [
        e["t"] for e in disruptor.events if e["kind"] == "exited" and e["label"] == f"{DRIVER}[0]"
    ]
    record = {
        "wall_s": wall,
        # until the driver's last exit: without the shutdown, whose length depends on which
        # processes were restarting when the program finished
        "program_s": max(driver_exits, default=None),
        "plan": None if plan is None else msgspec.to_builtins(plan.__dict__),
        # when the schedule started; None when it never did (its phase never began)
        "aimed_at_s": disruptor.aimed_at_s if plan is not None else None,
        "kills": disruptor.kills,
        "stops": disruptor.stops,
        "events": disruptor.events,
    }
    _write_json(os.path.join(run_dir, CHAOS_FILE), record)
    return report


def _never() -> list[Any]:
    return []


def _write_json(path: str, data: Any) -> None:
    write_atomic(path, (json.dumps(data, indent=2) + "\n").encode())


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send file descriptor 1 (ours and the children's) to stderr, so that ``--json`` leaves
    stdout to the one JSON object."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_chaos(
    manifest: Manifest, run_dir: str, plan: ChaosPlan, *, baseline: bool, as_json: bool
) -> int:
    """Run the undisturbed baseline (unless ``baseline`` is false), then the chaos run, then
    print the accounting; return the exit status (0: the chaos run completed)."""
    from asyncrl.supervision.rundir import save_manifest
    from asyncrl.transport import run

    undisturbed = os.path.join(run_dir, "undisturbed")
    disturbed = os.path.join(run_dir, "chaos")

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    first: Any = None  # the undisturbed run's report
    redirect = _stdout_to_stderr() if as_json else contextlib.nullcontext()
    with redirect:
        if baseline:
            save_manifest(manifest, undisturbed)
            say(f"chaos: undisturbed run in {undisturbed}")
            first = run(supervise(manifest, undisturbed, None, say))
            say(f"chaos: undisturbed run {first.status}: {first.reason}")
        if not baseline or first.status == "completed":
            save_manifest(manifest, disturbed)
            say(f"chaos: chaos run in {disturbed}")
            report = run(supervise(manifest, disturbed, plan, say))
            say(f"chaos: chaos run {report.status}: {report.reason}")
    if first is not None and first.status != "completed":
        reason = f"the undisturbed run {first.status} ({first.reason}), so there is nothing to "
        reason += f"compare with and no chaos run was made; see {undisturbed}/logs"
        if as_json:
            print(json.dumps({"completed": None, "status": None, "reason": reason}), flush=True)
        else:
            say(f"chaos: {reason}")
        return {"failed": 1, "interrupted": 130}.get(first.status, 1)
    accounting = account(disturbed, undisturbed if baseline else None)
    accounting.update(aim_figures(disturbed))
    accounting["budgets"] = budgets(manifest, plan.roles)
    accounting["plan"] = msgspec.to_builtins(plan.__dict__)
    accounting["run_dir"] = run_dir
    _write_json(os.path.join(run_dir, "accounting.json"), accounting)
    if as_json:
        print(json.dumps(accounting), flush=True)
    else:
        print(format_accounting(accounting), flush=True)
        print(format_aim(accounting), flush=True)
        print(f"accounting: {os.path.join(run_dir, 'accounting.json')}", flush=True)
    return {"completed": 0, "failed": 1, "interrupted": 130}[report.status]


def aim_figures(run_dir: str) -> dict[str, Any]:
    """Where the disruption of the run in ``run_dir`` was aimed, from its ``chaos.json``:
    ``from_phase`` (None: the run's start), ``after_s``, and ``disrupted_from_s``, the time the
    schedule started (None when it never did; ``not_disrupted`` then says why)."""
    try:
        with open(os.path.join(run_dir, CHAOS_FILE)) as f:
            chaos = json.load(f)
    except (OSError, ValueError) as exc:
        chaos = {"not_disrupted": f"no readable {CHAOS_FILE}: {exc}"}
    plan = chaos.get("plan") or {}
    out = {
        "from_phase": plan.get("from_phase"),
        "after_s": plan.get("after"),
        "disrupted_from_s": chaos.get("aimed_at_s"),
    }
    if out["disrupted_from_s"] is None:
        began = f"phase {out['from_phase']} never began" if out["from_phase"] else "it ended"
        why = f"{began} before the schedule started: nothing was disrupted"
        out["not_disrupted"] = chaos.get("not_disrupted", why)
    return out


def format_aim(figures: dict[str, Any]) -> str:
    """``aim_figures`` as a person reads them, one line."""
    aim = f"phase {figures['from_phase']}" if figures.get("from_phase") else "the run's start"
    if figures.get("after_s"):
        aim = f"{figures['after_s']:g} s after {aim}"
    if figures.get("disrupted_from_s") is None:
        return f"disruption aimed at {aim}: {figures.get('not_disrupted')}"
    return f"disruption aimed at {aim}: began at {figures['disrupted_from_s']:.1f} s"


ONE_MACHINE_ONLY = ("--kill-every", "--roles", "--stop-every", "--stop-for", "--seed")
"""The options of the one-machine campaign, which kills processes; a campaign over nodes
(``--nodes``) loses whole nodes and takes none of them."""
NODES_ONLY = (
    "--kill-node",
    "--every",
    "--rejoin-after",
    "--losses",
    "--agent-liveness",
    "--join-timeout",
)
"""The options of a campaign over nodes, which need ``--nodes``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``asyncrl chaos`` (besides the shared ``--set``, ``--run-dir``,
    ``--overwrite``). Each option left out is ``None``, so that the command line can tell the
    one-machine campaign's options from those of a campaign over nodes."""
    parser.add_argument(
        "--kill-every",
        type=_duration_or_off,
        metavar="DURATION",
        help="SIGKILL one live replica of the named roles this often (default 5s; 'off' "
        "kills nothing, to only freeze)",
    )
    parser.add_argument(
        "--roles",
        help="comma-separated roles whose replicas are hit, 'driver' for the driver "
        "(default: every role of the manifest and the driver)",
    )
    parser.add_argument(
        "--stop-every",
        type=_duration_arg,
        metavar="DURATION",
        help="also SIGSTOP one live replica this often (default: never)",
    )
    parser.add_argument(
        "--stop-for",
        type=_duration_arg,
        metavar="DURATION",
        help="how long a stopped replica stays stopped before SIGCONT (default 5s)",
    )
    parser.add_argument("--seed", type=int, help="seeds which replica is hit (default 0)")
    parser.add_argument(
        "--from-phase",
        metavar="NAME",
        help="disrupt only once the program has begun phase NAME (its first entry in "
        "RUN_DIR/history.jsonl), e.g. rl; default: from the run's start",
    )
    parser.add_argument(
        "--after",
        type=_duration_arg,
        default=0.0,
        metavar="DURATION",
        help="start the schedule this long after the run's start, or after the phase's "
        "with --from-phase (default: at once)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the accounting as one JSON object"
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the undisturbed run (its figures are then unknown)",
    )
    nodes = parser.add_argument_group(
        "losing nodes (docs/multinode.md)",
        "launch the manifest as N torchrun nodes on this machine and lose one of them whole",
    )
    nodes.add_argument(
        "--nodes",
        type=int,
        metavar="N",
        help="launch over N local torchrun nodes (node R with ASYNCRL_HOST_ID=nodeR) and lose "
        "--kill-node on the schedule, instead of killing processes on one machine",
    )
    nodes.add_argument(
        "--kill-node",
        type=int,
        metavar="R",
        help="the node lost (1 to N-1; node 0 holds the store)",
    )
    nodes.add_argument(
        "--every",
        type=_duration_arg,
        metavar="DURATION",
        help="lose the node this often: SIGKILL its torchrun, agent and roles at once",
    )
    nodes.add_argument(
        "--rejoin-after",
        type=_duration_arg,
        metavar="DURATION",
        help="start the lost node's torchrun again this long after each loss (shorter than "
        "--every; default: it stays lost)",
    )
    nodes.add_argument(
        "--losses",
        type=int,
        metavar="N",
        help="lose the node at most N times (default: until the run ends)",
    )
    nodes.add_argument(
        "--agent-liveness",
        type=_duration_arg,
        metavar="DURATION",
        help="the launch's --agent-liveness: how long node 0 waits for a silent node's "
        "heartbeat before it takes it as lost (default 15s)",
    )
    nodes.add_argument(
        "--join-timeout",
        type=_duration_arg,
        metavar="DURATION",
        help="the launch's --join-timeout (default 300s)",
    )


def _duration_or_off(text: str) -> float:
    """A duration, or 0 for ``off``."""
    return 0.0 if text.strip() == "off" else _duration_arg(text)


def _duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
