"""``asyncrl trace view RUN_DIR``: the control-flow graph of a traced run, as one HTML page.

The page, ``RUN_DIR/trace.html``, is self-contained (inline CSS and SVG, no script, nothing
fetched), so it opens anywhere, offline. It shows:

- the graph (laid out by ``asyncrl.observe.trace_view_graph``): one node per role, one edge per
  (caller role, callee role, kind of link), its width growing with the number of calls and its
  label, in a box of its own that covers no node and no other label, giving the count and the bytes
  sent. Edges inside one process are dotted, across processes of one host solid, across hosts (or
  nodes of a launch) dashed (and coloured apart); the edges between two roles run side by side.
  Beside each node, on its outer side, a bar of its processes' time: busy (serving a request or
  inside a span), waiting (on a call it made, and not busy) and idle (the rest of the run). The
  node agent (``INFRASTRUCTURE``) is left out, and a note under the graph says so, unless
  ``infrastructure`` asks for it, drawn lighter;
- the timeline: one row per process; grey where it was busy, and a bar coloured by the role it
  called wherever it waited on a call (hover for the callee, the method and the time);
- a table of the same, with whom each process waited on longest.

Everything is computed from ``RUN_DIR/trace.json`` (``asyncrl.observe.trace``), which is merged
first from ``RUN_DIR/trace/`` when missing.
"""

from __future__ import annotations

import json
import os
from typing import Any

from asyncrl.errors import AsyncrlError
from asyncrl.observe.trace import TRACE_FILE, merge, trace_dir
from asyncrl.observe.trace_analysis import Analysis, Usage, analyse, role_of, union
from asyncrl.observe.trace_view_graph import INFRASTRUCTURE, WIDTH, colours, esc, fmt_us, graph_svg

__all__ = ["PAGE_FILE", "TraceViewError", "Usage", "analyse", "render", "write_page"]

PAGE_FILE = "trace.html"
"""The page, in the run directory."""

ROW = 26


class TraceViewError(AsyncrlError):
    """The run directory holds no trace to draw."""


def _where(p: dict[str, Any]) -> str:
    return f"{p['host']} (node {p['node']})" if p.get("node") else str(p["host"])


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
        for s, e in union(a.busy.get(p["pid"], [])):
            w = max(1.0, (e - s) * scale)
            out.append(
                f'<rect class="busy" x="{left + s * scale:.1f}" y="{y + 5}" width="{w:.1f}" '
                f'height="{ROW - 10}" fill="#90a4ae"><title>busy {esc(fmt_us(e - s))}</title>'
                "</rect>"
            )
        for s, e, callee, method in a.waits.get(p["pid"], []):
            w = max(1.0, (e - s) * scale)
            fill = fills.get(role_of(callee), "#616161")
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
