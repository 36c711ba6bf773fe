"""``asyncrl trace view RUN_DIR``: the control-flow graph of a traced run, as one HTML page.

The page, ``RUN_DIR/trace.html``, is self-contained (inline CSS and SVG, no script, nothing
fetched), so it opens anywhere, offline. It shows:

- the graph (laid out by ``asyncrl.trace_view_graph``): one node per role, one edge per (caller
  role, callee role, kind of link), its width growing with the number of calls and its label, in
  a box of its own that covers no node and no other label, giving the count and the bytes sent.
  Edges inside one process are dotted, across processes of one host solid, across hosts (or
  nodes of a launch) dashed (and coloured apart); the edges between two roles run side by side.
  Beside each node, on its outer side, a bar of its processes' time: busy (serving a request or
  inside a span), waiting (on a call it made, and not busy) and idle (the rest of the run). The
  node agent (``INFRASTRUCTURE``) is left out, and a note under the graph says so, unless
  ``infrastructure`` asks for it, drawn lighter;
- the timeline: one row per process; grey where it was busy, and a bar coloured by the role it
  called wherever it waited on a call (hover for the callee, the method and the time);
- a table of the same, with whom each process waited on longest.

Everything is computed from ``RUN_DIR/trace.json`` (``asyncrl.trace``), which is merged first from
``RUN_DIR/trace/`` when missing.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from asyncrl.errors import AsyncrlError
from asyncrl.trace import TRACE_FILE, merge, trace_dir
from asyncrl.trace_view_graph import INFRASTRUCTURE, WIDTH, colours, esc, fmt_us, graph_svg

__all__ = ["PAGE_FILE", "TraceViewError", "Usage", "analyse", "render", "write_page"]

PAGE_FILE = "trace.html"
"""The page, in the run directory."""

ROW = 26


class TraceViewError(AsyncrlError):
    """The run directory holds no trace to draw."""


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


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
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


def _role_of(name: str) -> str:
    """``rollout.0`` or ``ipc:///run/sockets/rollout.0`` -> ``rollout``."""
    base = name.rsplit("/", 1)[-1]
    head, _, tail = base.rpartition(".")
    return head if head and tail.isdigit() else base


def _place(p: dict[str, Any]) -> tuple[int, str]:
    """Where a process of the trace's table ran: its node of a launch (0 on one machine) and
    its host; two nodes are two hosts even when simulated on one machine."""
    return int(p.get("node", 0)), str(p.get("host", ""))


def _where(p: dict[str, Any]) -> str:
    return f"{p['host']} (node {p['node']})" if p.get("node") else str(p["host"])


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
        edge = edges[(caller.get("role", "?"), callee.get("role") or _role_of(callee_label), kind)]
        edge[0] += 1
        edge[1] += args.get("bytes", 0)
        waits[pid].append((start, stop, callee_label, e["name"]))
    roles: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for pid, p in sorted(procs.items(), key=lambda kv: (kv[1]["role"], kv[1]["replica"], kv[0])):
        b = _union(busy[pid])
        w = _union([(s, e) for s, e, _, _ in waits[pid]])
        usage = Usage(busy=_length(b), waiting=_minus(w, b))
        usage.idle = max(0.0, end - usage.busy - usage.waiting)
        on: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for s, e, who, _ in waits[pid]:
            on[who].append((s, e))
        usage.waited_on = {who: _length(_union(spans)) for who, spans in on.items()}
        p["usage"] = usage
        roles[p["role"]].append(p)
    for _, callee_role, _ in list(edges):
        roles.setdefault(callee_role, [])
    ordered = sorted(roles.values(), key=lambda ps: ps[0]["pid"] if ps else 1 << 30)
    processes = [p for ps in ordered for p in ps]
    return Analysis(end, processes, dict(roles), dict(edges), busy, waits)


def timeline_svg(a: Analysis) -> str:
    """One row per process: busy in grey, waits coloured by the role waited on."""
    fills = colours(list(a.roles))
    left, right, top = 190, 20, 34
    span = max(a.span_us, 1e-9)
    scale = (WIDTH - left - right) / span
    height = top + ROW * len(a.processes) + 14
    out = []
    for i in range(6):  # time axis
        t = span * i / 5
        x = left + t * scale
        out.append(
            f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{height - 10}" stroke="#eceff1"/>'
            f'<text x="{x:.1f}" y="{top - 12}" class="tick">{esc(fmt_us(t))}</text>'
        )
    for row, p in enumerate(a.processes):
        y = top + ROW * row
        label = f"{p['label']} #{p['incarnation']}"
        out.append(f'<text x="{left - 8}" y="{y + 16}" class="rlabel">{esc(label)}</text>')
        out.append(
            f'<rect x="{left}" y="{y + 3}" width="{WIDTH - left - right}" height="{ROW - 6}" '
            f'fill="#fafafa" stroke="#eceff1"/>'
        )
        for s, e in _union(a.busy.get(p["pid"], [])):
            w = max(1.0, (e - s) * scale)
            out.append(
                f'<rect class="busy" x="{left + s * scale:.1f}" y="{y + 5}" width="{w:.1f}" '
                f'height="{ROW - 10}" fill="#90a4ae"><title>busy {esc(fmt_us(e - s))}</title>'
                "</rect>"
            )
        for s, e, callee, method in a.waits.get(p["pid"], []):
            w = max(1.0, (e - s) * scale)
            fill = fills.get(_role_of(callee), "#616161")
            tip = f"{p['label']} waited {fmt_us(e - s)} on {callee} ({method})"
            out.append(
                f'<rect class="wait" x="{left + s * scale:.1f}" y="{y + 8}" width="{w:.1f}" '
                f'height="{ROW - 16}" fill="{fill}" fill-opacity="0.8"><title>{esc(tip)}</title>'
                "</rect>"
            )
    return (
        f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" '
        f'height="{height}" viewBox="0 0 {WIDTH} {height}">{"".join(out)}</svg>'
    )


def _table(a: Analysis) -> str:
    rows = []
    for p in a.processes:
        u: Usage = p["usage"]
        top = sorted(u.waited_on.items(), key=lambda kv: -kv[1])[:3]
        on = ", ".join(f"{esc(k)} {esc(fmt_us(v))}" for k, v in top) or "nobody"
        rows.append(
            f"<tr><td>{esc(p['label'])} #{p['incarnation']}</td><td>{esc(_where(p))}</td>"
            f"<td>{p['os_pid']}</td><td>{fmt_us(u.busy)}</td><td>{fmt_us(u.waiting)}</td>"
            f"<td>{fmt_us(u.idle)}</td><td>{on}</td></tr>"
        )
    head = "<tr><th>process</th><th>host</th><th>pid</th><th>busy</th><th>waiting</th>"
    return f"<table>{head}<th>idle</th><th>waited longest on</th></tr>{''.join(rows)}</table>"


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 18px; color: #263238; background: #fff; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 18px 0 6px; }
.nname { font: bold 14px sans-serif; text-anchor: middle; fill: #fff; }
.nsub { font: 11px sans-serif; text-anchor: middle; fill: #fff; }
.nuse, .elabel, .tick { font: 11px sans-serif; text-anchor: middle; fill: #37474f; }
.nuse { paint-order: stroke; stroke: #fff; stroke-width: 3px; }
.note { color: #546e7a; font-size: 13px; margin: 2px 0 0; }
.legend { font: 12px sans-serif; fill: #37474f; }
.rlabel { font: 12px sans-serif; text-anchor: end; fill: #263238; }
table { border-collapse: collapse; } td, th { border: 1px solid #cfd8dc; padding: 2px 8px; }
"""


def _left_out(a: Analysis) -> str:
    """The note under the graph's heading naming the infrastructure roles it leaves out."""
    out = [r for r in a.roles if r in INFRASTRUCTURE]
    if not out:
        return ""
    calls = sum(int(v[0]) for k, v in a.edges.items() if k[0] in out or k[1] in out)
    names = ", ".join(f"{r} ({INFRASTRUCTURE[r]})" for r in out)
    return (
        f"Left out of the graph: {names} and its {calls} call{'s' if calls != 1 else ''} "
        "(status and _stats: the runtime's bookkeeping, not the program's control flow); "
        "the timeline and the table below keep them."
    )


def render(doc: dict[str, Any], title: str, infrastructure: bool = False) -> str:
    """The page (a string) for the merged trace ``doc``; ``infrastructure`` draws the runtime's
    own roles (``INFRASTRUCTURE``) in the graph too, instead of naming them in a note."""
    a = analyse(doc)
    calls = sum(int(v[0]) for v in a.edges.values())
    summary = (
        f"{len(a.processes)} processes, {len(a.roles)} roles, {calls} calls over "
        f"{fmt_us(a.span_us)}. Hover over an edge, a node or a bar for its figures."
    )
    note = "" if infrastructure else _left_out(a)
    drawn = [r for r in a.roles if infrastructure or r not in INFRASTRUCTURE]
    return (
        '<!DOCTYPE html>\n<html xmlns="http://www.w3.org/1999/xhtml"><head><meta charset="utf-8"/>'
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{esc(title)}</h1><p>{esc(summary)}</p>"
        f"<h2>Control-flow graph</h2>{graph_svg(a, drawn)}"
        + (f'<p class="note">{esc(note)}</p>' if note else "")
        + f"<h2>Timeline: where each process waited, and on whom</h2>{timeline_svg(a)}"
        f"<h2>Time per process</h2>{_table(a)}</body></html>\n"
    )


def write_page(run_dir: str, infrastructure: bool = False) -> str:
    """Write ``RUN_DIR/trace.html`` and return its path; merges the trace first if needed.
    ``infrastructure`` draws the node agent in the graph too (see ``render``).

    Raises:
        TraceViewError: ``run_dir`` holds no trace (it was not run with ``--trace``).
    """
    path = os.path.join(run_dir, TRACE_FILE)
    if not os.path.exists(path) and merge(run_dir) is None:
        raise TraceViewError(
            f"{run_dir} holds no trace: neither {path} nor any file in {trace_dir(run_dir)}; "
            "run the manifest with 'asyncrl run --trace' first"
        )
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    name = os.path.basename(os.path.abspath(run_dir))
    page = render(doc, f"asyncrl trace of {name}", infrastructure)
    out = os.path.join(run_dir, PAGE_FILE)
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    return out
