"""What a traced run's page draws, computed from a merged trace (``asyncrl.observe.trace``):
the time of each process (busy, waiting on a call, idle), who waited on whom, and the edges of
the control-flow graph between roles. ``asyncrl.observe.trace_view`` draws the page from it, and
``asyncrl.observe.trace_view_graph`` lays out its graph."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Analysis", "Usage", "analyse", "role_of", "union"]


@dataclass
class Usage:
    """One process's time over the run, in microseconds."""

    busy: float = 0.0
    waiting: float = 0.0
    idle: float = 0.0
    waited_on: dict[str, float] = field(default_factory=dict)  # callee -> time with a call open


@dataclass
class Analysis:
    """What the page draws, computed from a merged trace."""

    span_us: float
    processes: list[dict[str, Any]]  # the trace's process table, plus "usage": Usage
    roles: dict[str, list[dict[str, Any]]]  # role -> its processes
    edges: dict[tuple[str, str, str], list[float]]  # (caller, callee, kind) -> [count, bytes]
    busy: dict[int, list[tuple[float, float]]]  # pid -> busy intervals (us)
    waits: dict[int, list[tuple[float, float, str, str]]]  # pid -> (start, end, callee, method)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The length of the union ``a`` outside the union ``b`` (both sorted, disjoint)."""
    total = _length(a)
    for s1, e1 in a:
        for s2, e2 in b:
            total -= max(0.0, min(e1, e2) - max(s1, s2))
    return total


def role_of(name: str) -> str:
    """``rollout.0`` or ``ipc:///run/sockets/rollout.0`` -> ``rollout``."""
    base = name.rsplit("/", 1)[-1]
    head, _, tail = base.rpartition(".")
    return head if head and tail.isdigit() else base


def _place(p: dict[str, Any]) -> tuple[int, str]:
    """Where a process of the trace's table ran: its node of a launch (0 on one machine) and
    its host; two nodes are two hosts even when simulated on one machine."""
    return int(p.get("node", 0)), str(p.get("host", ""))


def analyse(doc: dict[str, Any]) -> Analysis:
    """The graph, the time of each process, and who waited on whom, from a merged trace."""
    table = doc.get("otherData", {}).get("asyncrl", {}).get("processes", [])
    procs = {p["pid"]: dict(p) for p in table}
    xs = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    end = max((e["ts"] + e["dur"] for e in xs), default=0.0)
    served = {
        (e["args"]["caller"], e["args"]["request_id"]): e["pid"] for e in xs if e["cat"] == "serve"
    }
    busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
    waits: dict[int, list[tuple[float, float, str, str]]] = defaultdict(list)
    edges: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0])
    for e in xs:
        pid, start, stop = e["pid"], e["ts"], e["ts"] + e["dur"]
        if e["cat"] != "call":
            busy[pid].append((start, stop))
            continue
        args = e["args"]
        callee_pid = served.get((args["identity"], args["request_id"]))
        callee = procs.get(callee_pid, {}) if callee_pid is not None else {}
        caller = procs.get(pid, {})
        callee_label = callee.get("label") or args["endpoint"].rsplit("/", 1)[-1]
        if callee_pid == pid:
            kind = "process"
        elif callee and _place(callee) != _place(caller):
            kind = "hosts"
        else:
            kind = "processes"
        edge = edges[(caller.get("role", "?"), callee.get("role") or role_of(callee_label), kind)]
        edge[0] += 1
        edge[1] += args.get("bytes", 0)
        waits[pid].append((start, stop, callee_label, e["name"]))
    roles: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for pid, p in sorted(procs.items(), key=lambda kv: (kv[1]["role"], kv[1]["replica"], kv[0])):
        b = union(busy[pid])
        w = union([(s, e) for s, e, _, _ in waits[pid]])
        usage = Usage(busy=_length(b), waiting=_minus(w, b))
        usage.idle = max(0.0, end - usage.busy - usage.waiting)
        on: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for s, e, who, _ in waits[pid]:
            on[who].append((s, e))
        usage.waited_on = {who: _length(union(spans)) for who, spans in on.items()}
        p["usage"] = usage
        roles[p["role"]].append(p)
    for _, callee_role, _ in list(edges):
        roles.setdefault(callee_role, [])
    ordered = sorted(roles.values(), key=lambda ps: ps[0]["pid"] if ps else 1 << 30)
    processes = [p for ps in ordered for p in ps]
    return Analysis(end, processes, dict(roles), dict(edges), busy, waits)
