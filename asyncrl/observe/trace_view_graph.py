"""The control-flow graph of ``asyncrl trace view``: where nodes, edges and labels go, as SVG.

The layout is computed here, in Python, so the page needs no script and a test can check it:

- roles sit on an ellipse, the one that makes the most calls at the top; each node's busy bar and
  caption sit on the node's outer side, away from the edges that run inward;
- the edges between two roles run in parallel lanes (both directions, or two kinds of link),
  each a curve bent away from the other nodes it would cross;
- arrowheads are drawn as polygons sized from the edge's width but growing far slower than it;
- each edge label gets a box (``rect.elabel-box``) placed where it overlaps no node, no arrowhead,
  no legend and no other label, and crosses as few other edges as the candidates allow.

Text widths are estimated from per-character widths a little wider than DejaVu Sans and
Liberation Sans, the fonts a Linux browser picks for ``sans-serif``.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Any

from asyncrl.observe.trace_analysis import Analysis

WIDTH = 1200
GRAPH_HEIGHT = 560
LINK_STYLE = {  # kind of link -> (colour, dash pattern, legend)
    "process": ("#6a1b9a", "2 5", "inside one process"),
    "processes": ("#1565c0", "", "across processes of one host"),
    "hosts": ("#d84315", "12 6", "across hosts"),
}
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
BUSY, WAITING, IDLE = "#2e7d32", "#ef6c00", "#cfd8dc"
RADIUS = 44  # of a node's circle
GAP = 4  # between a circle and the ends of its edges
LANE = 14  # between parallel edges of one pair of roles
LABEL_HEIGHT = 15
INFRASTRUCTURE = {"agent": "the node agent"}
"""Roles of the runtime itself, not of the program: the node agent's calls (``_stats`` at the end,
``status`` when asked) are bookkeeping, not the control flow. The page leaves them out of the
graph unless asked, and draws them lighter when asked; the timeline and the table keep them."""
LIGHTER = ' opacity="0.5"'
LEGEND_BOXES = [(10, 10, 250, 72), (WIDTH - 266, 10, WIDTH - 6, 32)]

Point = tuple[float, float]
Box = tuple[float, float, float, float]  # x0, y0, x1, y1


def esc(text: Any) -> str:
    """``text`` escaped for HTML and SVG, quotes included."""
    return html.escape(str(text), quote=True)


def fmt_bytes(n: float) -> str:
    """``1234`` -> ``1.2 kB``."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def fmt_us(us: float) -> str:
    """Microseconds as ``12.3 ms`` or ``4.56 s``."""
    return f"{us / 1e6:.2f} s" if us >= 1e6 else f"{us / 1e3:.1f} ms"


def colours(roles: list[str]) -> dict[str, str]:
    """One palette colour per role, in order."""
    return {r: PALETTE[i % len(PALETTE)] for i, r in enumerate(roles)}


def text_width(text: str, size: float = 11.0) -> float:
    """An upper estimate of ``text``'s width in pixels in a ``sans-serif`` font of ``size`` px."""
    em = 0.0
    for c in text:
        if c in " ,.:;·il|!'()[]":
            em += 0.36
        elif c in "mwMW%":
            em += 1.0
        elif c.isupper():
            em += 0.8
        else:
            em += 0.66
    return em * size


def overlap(a: Box, b: Box) -> float:
    """The area two boxes share (0 when apart or touching)."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return w * h if w > 0 and h > 0 else 0.0


def _inside(p: Point, b: Box) -> bool:
    return b[0] <= p[0] <= b[2] and b[1] <= p[1] <= b[3]


def _unit(dx: float, dy: float) -> Point:
    d = math.hypot(dx, dy) or 1.0
    return dx / d, dy / d


def _rotate(v: Point, degrees: float) -> Point:
    c, s = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
    return v[0] * c - v[1] * s, v[0] * s + v[1] * c


def _quad(s: Point, c: Point, e: Point, t: float) -> Point:
    u = 1 - t
    return (
        u * u * s[0] + 2 * u * t * c[0] + t * t * e[0],
        u * u * s[1] + 2 * u * t * c[1] + t * t * e[1],
    )


def _cubic(s: Point, c1: Point, c2: Point, e: Point, t: float) -> Point:
    u = 1 - t
    a, b, c, d = u * u * u, 3 * u * u * t, 3 * u * t * t, t * t * t
    return (
        a * s[0] + b * c1[0] + c * c2[0] + d * e[0],
        a * s[1] + b * c1[1] + c * c2[1] + d * e[1],
    )


@dataclass
class Node:
    """A role's place: its circle's centre, and its bar and caption above or below it."""

    role: str
    at: Point
    above: bool  # the bar and caption sit above the circle (a node in the upper half)
    caption: str

    @property
    def caption_box(self) -> Box:
        """The bar and the caption under (or over) the circle."""
        x, y = self.at
        half = max(70.0, text_width(self.caption) / 2) + 2
        if self.above:
            return (x - half, y - RADIUS - 40, x + half, y - RADIUS - 6)
        return (x - half, y + RADIUS + 6, x + half, y + RADIUS + 40)

    @property
    def box(self) -> Box:
        """Everything the node draws: circle, bar and caption."""
        x, y = self.at
        c = self.caption_box
        return (
            min(c[0], x - RADIUS),
            min(c[1], y - RADIUS),
            max(c[2], x + RADIUS),
            max(c[3], y + RADIUS),
        )


@dataclass
class Edge:
    """One drawn edge: its path, its arrowhead, and where its label went."""

    key: tuple[str, str, str]  # caller role, callee role, kind of link
    count: float
    size: float
    width: float
    path: str = ""
    arrow: list[Point] = field(default_factory=list)
    points: list[Point] = field(default_factory=list)  # samples along the path
    candidates: list[Point] = field(default_factory=list)  # label centres, best first
    label_box: Box = (0.0, 0.0, 0.0, 0.0)

    @property
    def label(self) -> str:
        return f"{self.count:.0f} call{'s' if self.count != 1 else ''}, {fmt_bytes(self.size)}"

    @property
    def arrow_box(self) -> Box:
        xs, ys = [p[0] for p in self.arrow], [p[1] for p in self.arrow]
        return (min(xs), min(ys), max(xs), max(ys))


def edge_width(count: float) -> float:
    """An edge's stroke width: 1.5 px for one call, about 8 px for ten thousand."""
    return 1.5 + 1.6 * math.log10(1 + count)


def arrow_size(width: float) -> tuple[float, float]:
    """An arrowhead's length and half-width for an edge of ``width``: 10 by 5 px at the thinnest,
    growing a fifth as fast as the stroke, so a thick edge keeps a head that points."""
    return 10.0 + 0.9 * width, 4.5 + 0.7 * width


def positions(roles: list[str]) -> dict[str, Point]:
    """Roles on an ellipse, the first at the top (two roles side by side, one in the middle)."""
    cx, cy, rx, ry = WIDTH / 2, 275.0, 460.0, 190.0
    n = len(roles)
    if n == 1:
        return {roles[0]: (cx, cy)}
    turn = math.pi / 2 if n == 2 else 0.0
    return {
        r: (
            cx + rx * math.sin(2 * math.pi * i / n + turn),
            cy - ry * math.cos(2 * math.pi * i / n + turn),
        )
        for i, r in enumerate(roles)
    }


def _arrow(tip: Point, towards: Point, width: float) -> tuple[list[Point], Point]:
    """The arrowhead whose tip is ``tip``, pointing from ``towards`` (a point behind it), and
    the point where its edge's stroke should end."""
    length, half = arrow_size(width)
    ux, uy = _unit(tip[0] - towards[0], tip[1] - towards[1])
    base = (tip[0] - ux * length, tip[1] - uy * length)
    return [
        tip,
        (base[0] - uy * half, base[1] + ux * half),
        (base[0] + uy * half, base[1] - ux * half),
    ], base


def _bend(a: Point, b: Point, others: list[Box]) -> float:
    """How far to bend the curve from ``a`` to ``b`` (along its left normal) so that it crosses
    as few of the ``others`` (node boxes) as can be: the least bend among the best."""
    ux, uy = _unit(b[0] - a[0], b[1] - a[1])
    mid = ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2)
    best: tuple[int, float] | None = None
    for bend in (0.0, 40.0, -40.0, 80.0, -80.0, 120.0, -120.0, 170.0, -170.0):
        c = (mid[0] - uy * bend, mid[1] + ux * bend)
        hits = sum(
            1
            for i in range(1, 24)
            for box in others
            if _inside(_quad(a, c, b, i / 24), (box[0] - 6, box[1] - 6, box[2] + 6, box[3] + 6))
        )
        if best is None or hits < best[0]:
            best = (hits, bend)
        if hits == 0:
            break
    assert best is not None
    return best[1]


def _pair_edges(edge: list[Edge], nodes: dict[str, Node], bend: float) -> None:
    """Draw the edges between one pair of roles as parallel lanes (both directions)."""
    p, q = sorted((edge[0].key[0], edge[0].key[1]))
    ux, uy = _unit(nodes[q].at[0] - nodes[p].at[0], nodes[q].at[1] - nodes[p].at[1])
    nx, ny = -uy, ux
    reach = RADIUS + GAP
    for i, e in enumerate(edge):
        o = (i - (len(edge) - 1) / 2) * LANE
        a, b = nodes[e.key[0]].at, nodes[e.key[1]].at
        sign = 1.0 if e.key[0] == p else -1.0
        along = math.sqrt(max(0.0, reach * reach - o * o))
        s = (a[0] + nx * o + sign * ux * along, a[1] + ny * o + sign * uy * along)
        tip = (b[0] + nx * o - sign * ux * along, b[1] + ny * o - sign * uy * along)
        c = ((s[0] + tip[0]) / 2 + nx * bend, (s[1] + tip[1]) / 2 + ny * bend)
        e.arrow, end = _arrow(tip, c, e.width)
        e.path = f"M{s[0]:.1f},{s[1]:.1f} Q{c[0]:.1f},{c[1]:.1f} {end[0]:.1f},{end[1]:.1f}"
        e.points = [_quad(s, c, end, k / 20) for k in range(21)]
        side = 1.0 if o > 0 else -1.0
        half = text_width(e.label) / 2 + 4
        for t in (0.5, 0.4, 0.6, 0.3, 0.7, 0.22, 0.78):
            x, y = _quad(s, c, end, t)
            after = _quad(s, c, end, t + 0.01)
            tx, ty = _unit(after[0] - x, after[1] - y)
            # far enough along the normal (-ty, tx) that the box clears the stroke
            off = half * abs(ty) + LABEL_HEIGHT / 2 * abs(tx) + e.width / 2 + 3
            for k in (0.0, side, -side) if o == 0 else (side, 0.0, -side):
                e.candidates.append((x - ty * off * k, y + tx * off * k))


def _loop_edges(loops: list[Edge], node: Node, obstacles: list[Box]) -> None:
    """Draw a role's calls to itself as loops on a side of its node that is free."""
    x, y = node.at
    outward = _unit(x - WIDTH / 2, y - 275.0) if (x, y) != (WIDTH / 2, 275.0) else (0.0, -1.0)
    reach = RADIUS + GAP
    for j, e in enumerate(loops):
        size = 64.0 + 26 * j
        for turn in (0, 45, -45, 90, -90, 135, -135, 180):
            v = _rotate(outward, turn)
            s = (x + _rotate(v, -28)[0] * reach, y + _rotate(v, -28)[1] * reach)
            tip = (x + _rotate(v, 28)[0] * reach, y + _rotate(v, 28)[1] * reach)
            c1 = (x + _rotate(v, -34)[0] * (reach + size), y + _rotate(v, -34)[1] * (reach + size))
            c2 = (x + _rotate(v, 34)[0] * (reach + size), y + _rotate(v, 34)[1] * (reach + size))
            pts = [_cubic(s, c1, c2, tip, k / 20) for k in range(21)]
            inner = pts[3:18]
            fits = all(6 <= px <= WIDTH - 6 and 6 <= py <= GRAPH_HEIGHT - 6 for px, py in pts)
            if fits and not any(_inside(p, b) for p in inner for b in obstacles):
                break
        e.arrow, end = _arrow(tip, c2, e.width)
        e.path = (
            f"M{s[0]:.1f},{s[1]:.1f} C{c1[0]:.1f},{c1[1]:.1f} {c2[0]:.1f},{c2[1]:.1f} "
            f"{end[0]:.1f},{end[1]:.1f}"
        )
        e.points = pts
        apex = _cubic(s, c1, c2, tip, 0.5)
        # just beyond the loop's apex, then further out, then beside it
        clear = (text_width(e.label) / 2 + 4) * abs(v[0]) + LABEL_HEIGHT / 2 * abs(v[1]) + 4
        for k, side in ((clear, 0.0), (clear + 12, 0.0), (clear, 30.0), (clear, -30.0)):
            e.candidates.append(
                (apex[0] + v[0] * k - v[1] * side, apex[1] + v[1] * k + v[0] * side)
            )


def _label_box(centre: Point, text: str) -> Box:
    half = text_width(text) / 2 + 4
    return (
        centre[0] - half,
        centre[1] - LABEL_HEIGHT / 2,
        centre[0] + half,
        centre[1] + LABEL_HEIGHT / 2,
    )


def _place_labels(edges: list[Edge], nodes: list[Node]) -> None:
    """Give each edge's label the first candidate box that overlaps no node, legend, arrowhead or
    other label (busiest edges first), crossing the fewest other edges; else the least overlap."""
    hard = [n.box for n in nodes] + list(LEGEND_BOXES) + [e.arrow_box for e in edges]
    for e in sorted(edges, key=lambda e: (-e.count, e.key)):
        best: tuple[float, int, int, Box] | None = None
        for i, centre in enumerate(e.candidates):
            box = _label_box(centre, e.label)
            outside = box[0] < 2 or box[1] < 2 or box[2] > WIDTH - 2 or box[3] > GRAPH_HEIGHT - 2
            area = sum(overlap(box, h) for h in hard) + (1e6 if outside else 0.0)
            crossed = sum(
                1 for other in edges if other is not e for p in other.points if _inside(p, box)
            )
            score = (area, crossed, i, box)
            if best is None or score[:3] < best[:3]:
                best = score
        assert best is not None
        e.label_box = best[3]
        hard.append((best[3][0] - 2, best[3][1] - 2, best[3][2] + 2, best[3][3] + 2))


def layout(a: Analysis, roles: list[str]) -> tuple[list[Node], list[Edge]]:
    """Where ``roles`` (of ``a``) and the edges among them go on the graph."""
    outgoing = {r: sum(v[0] for k, v in a.edges.items() if k[0] == r) for r in roles}
    top = max(roles, key=lambda r: (outgoing[r], -roles.index(r))) if roles else ""
    ordered = [top] + [r for r in roles if r != top] if roles else []
    at = positions(ordered)
    nodes = {
        r: Node(r, at[r], at[r][1] < 275.0 - 1, _caption(a.roles[r], a.span_us)) for r in ordered
    }
    if nodes:  # centre the drawing in the height (an odd ring leaves room below)
        highest = min(n.box[1] for n in nodes.values())
        shift = max(0.0, (GRAPH_HEIGHT - 4 - max(n.box[3] for n in nodes.values()) - highest) / 2)
        for n in nodes.values():
            n.at = (n.at[0], n.at[1] + shift)
    edges = [
        Edge(k, v[0], v[1], edge_width(v[0]))
        for k, v in sorted(a.edges.items())
        if k[0] in nodes and k[1] in nodes
    ]
    pairs: dict[tuple[str, str], list[Edge]] = {}
    for e in edges:
        pairs.setdefault(tuple(sorted(e.key[:2])), []).append(e)  # type: ignore[arg-type]
    for (p, q), group in pairs.items():
        group.sort(key=lambda e: (e.key[0] != p, e.key[2]))
        if p == q:
            continue
        others = [n.box for r, n in nodes.items() if r not in (p, q)]
        _pair_edges(group, nodes, _bend(nodes[p].at, nodes[q].at, others))
    for (p, q), group in pairs.items():
        if p == q:
            _loop_edges(group, nodes[p], [n.caption_box for n in nodes.values()])
    _place_labels(edges, list(nodes.values()))
    return list(nodes.values()), edges


def _caption(procs: list[dict[str, Any]], span_us: float) -> str:
    if not procs:
        return "not traced"
    busy, waiting, idle = _shares(procs, span_us)
    total = max(1e-9, span_us * len(procs))
    b, w, i = (100 * v / total for v in (busy, waiting, idle))
    return f"busy {b:.0f}% · waiting {w:.0f}% · idle {i:.0f}%"


def _shares(procs: list[dict[str, Any]], span_us: float) -> tuple[float, float, float]:
    busy = sum(p["usage"].busy for p in procs)
    waiting = sum(p["usage"].waiting for p in procs)
    idle = max(0.0, span_us * max(1, len(procs)) - busy - waiting) if procs else 0.0
    return busy, waiting, idle


def _lighter(*roles: str) -> str:
    return LIGHTER if any(r in INFRASTRUCTURE for r in roles) else ""


def _edge_svg(e: Edge) -> str:
    caller, callee, kind = e.key
    colour, dash, legend = LINK_STYLE[kind]
    dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
    arrow = " ".join(f"{x:.1f},{y:.1f}" for x, y in e.arrow)
    title = f"{caller} -> {callee}: {e.label} ({legend})"
    return (
        f'<g class="edge {kind}"{_lighter(caller, callee)}><title>{esc(title)}</title>'
        f'<path d="{e.path}" fill="none" stroke="{colour}" stroke-width="{e.width:.1f}"'
        f"{dash_attr}/>"
        f'<polygon class="arrow" points="{arrow}" fill="{colour}"/></g>'
    )


def _label_svg(e: Edge) -> str:
    """An edge's label in its box; drawn after every edge and node, so nothing covers it."""
    caller, callee, kind = e.key
    x0, y0, x1, y1 = e.label_box
    return (
        f'<g class="elabel-of {kind}"><title>{esc(f"{caller} -> {callee}")}</title>'
        f'<rect class="elabel-box" x="{x0:.1f}" y="{y0:.1f}" width="{x1 - x0:.1f}" '
        f'height="{y1 - y0:.1f}" rx="3" fill="#fff" fill-opacity="0.92" '
        f'stroke="{LINK_STYLE[kind][0]}" stroke-opacity="0.45"/>'
        f'<text x="{(x0 + x1) / 2:.1f}" y="{y1 - 4:.1f}" class="elabel">{esc(e.label)}</text></g>'
    )


def _node_svg(n: Node, procs: list[dict[str, Any]], span_us: float, colour: str) -> str:
    x, y = n.at
    busy, waiting, idle = _shares(procs, span_us)
    total = max(1e-9, span_us * max(1, len(procs)))
    bar_y = y - RADIUS - 26 if n.above else y + RADIUS + 8
    text_y = y - RADIUS - 32 if n.above else y + RADIUS + 34
    bar, left = [], x - 70
    for value, fill in ((busy, BUSY), (waiting, WAITING), (idle, IDLE)):
        w = 140 * value / total if procs else 0
        bar.append(
            f'<rect x="{left:.1f}" y="{bar_y:.1f}" width="{w:.1f}" height="12" fill="{fill}"/>'
        )
        left += w
    replicas = f"{len(procs)} process{'es' if len(procs) != 1 else ''}"
    title = (
        f"{n.role}: {replicas}; busy {fmt_us(busy)}, waiting {fmt_us(waiting)}, idle {fmt_us(idle)}"
    )
    return (
        f'<g class="node"{_lighter(n.role)}><title>{esc(title)}</title>'
        f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{RADIUS}" fill="{colour}" fill-opacity="0.85" '
        'stroke="#263238" stroke-width="2"/>'
        f'<text x="{x:.1f}" y="{y - 2:.1f}" class="nname">{esc(n.role)}</text>'
        f'<text x="{x:.1f}" y="{y + 15:.1f}" class="nsub">{esc(replicas)}</text>'
        f'<rect x="{x - 70:.1f}" y="{bar_y:.1f}" width="140" height="12" fill="#eceff1"/>'
        f"{''.join(bar)}"
        f'<text x="{x:.1f}" y="{text_y:.1f}" class="nuse">{esc(n.caption)}</text></g>'
    )


def _legend() -> str:
    out = []
    for i, (colour, dash, text) in enumerate(LINK_STYLE.values()):
        y = 22 + 20 * i
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(
            f'<line x1="14" y1="{y}" x2="64" y2="{y}" stroke="{colour}" stroke-width="3"'
            f"{dash_attr}/>"
            f'<text x="72" y="{y + 4}" class="legend">{esc(text)}</text>'
        )
    for i, (text, fill) in enumerate((("busy", BUSY), ("waiting", WAITING), ("idle", IDLE))):
        x = WIDTH - 260 + 80 * i
        out.append(
            f'<rect x="{x}" y="14" width="14" height="12" fill="{fill}"/>'
            f'<text x="{x + 20}" y="25" class="legend">{text}</text>'
        )
    return "".join(out)


def graph_svg(a: Analysis, roles: list[str]) -> str:
    """The graph of ``roles`` (of ``a``) and the calls among them, as an SVG element."""
    nodes, edges = layout(a, roles)
    fills = colours(list(a.roles))
    shapes = [_node_svg(n, a.roles[n.role], a.span_us, fills[n.role]) for n in nodes]
    labels = [_label_svg(e) for e in edges]
    return (
        f'<svg id="graph" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" '
        f'height="{GRAPH_HEIGHT}" viewBox="0 0 {WIDTH} {GRAPH_HEIGHT}">'
        f"{_legend()}{''.join(_edge_svg(e) for e in edges)}{''.join(shapes)}{''.join(labels)}</svg>"
    )
