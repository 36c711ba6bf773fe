"""The trace page's graph reads cleanly (asyncrl.observe.trace_view,
asyncrl.observe.trace_view_graph): labels apart from each other and from the nodes, arrowheads of
one size, both directions of a pair on lanes of their own, and the node agent left out of the graph
but kept in the timeline."""

from __future__ import annotations

import html
import json
import math
import re
import subprocess
import xml.etree.ElementTree as ET
from typing import Any

import pytest

from asyncrl.observe import trace, trace_view, trace_view_graph
from tests.observe.test_trace import SVG, _chromium

Box = tuple[float, float, float, float]

CALLS = {  # (caller, callee, method): calls, as in a traced run of the arith main job
    ("driver", "rollout.0", "generate"): 530,
    ("driver", "rollout.1", "generate"): 480,
    ("driver", "reward.0", "score"): 237,
    ("driver", "learner.0", "train_step"): 221,
    ("driver", "prompts.0", "take"): 28,
    ("driver", "driver", "status"): 3,
    ("learner.0", "driver", "progress"): 2,
    ("rollout.0", "learner.0", "weights"): 12,
    ("learner.0", "rollout.0", "sync"): 9,
    ("agent.0", "driver", "_stats"): 1,
    ("agent.0", "rollout.0", "_stats"): 2,
    ("agent.0", "reward.0", "_stats"): 1,
    ("agent.0", "learner.0", "_stats"): 1,
    ("agent.0", "prompts.0", "_stats"): 1,
}
HOSTS = {"rollout.1": "b"}  # the rest on host a


def main_job_doc() -> dict[str, Any]:
    """A merged trace shaped like the arith main job's, with both directions between the
    learner and the rollout, a second rollout on another host, and the driver calling itself."""
    labels = ["agent.0", "driver", "prompts.0", "rollout.0", "rollout.1", "reward.0", "learner.0"]
    procs = {
        label: trace.ProcessTrace(label, 0, 100 + i, HOSTS.get(label, "a"), 0)
        for i, label in enumerate(labels)
    }
    clock = 0
    for (caller, callee, method), count in CALLS.items():
        for _ in range(count):
            start, end = clock, clock + 2_000
            clock += 3_000
            n = clock  # the request's id, one per call
            procs[caller].calls.append(["call", method, callee, caller, n, start, end, 400])
            served = ["serve", method, caller, n, start + 500, end - 500, 400]
            procs[callee].serves.append(served)
    return trace.chrome_trace(list(procs.values()))


def _page(tmp_path: Any, infrastructure: bool = False) -> str:
    with open(tmp_path / trace.TRACE_FILE, "w") as f:
        json.dump(main_job_doc(), f)
    return trace_view.write_page(str(tmp_path), infrastructure)


def _graph(page: str) -> ET.Element:
    with open(page) as f:
        root = ET.fromstring(f.read().split("\n", 1)[1])
    return next(s for s in root.iter(f"{SVG}svg") if s.get("id") == "graph")


def _box(rect: ET.Element) -> Box:
    x, y = float(rect.get("x", 0)), float(rect.get("y", 0))
    return (x, y, x + float(rect.get("width", 0)), y + float(rect.get("height", 0)))


def _overlaps(boxes: list[Box], others: list[Box] | None = None) -> list[tuple[Box, Box]]:
    pairs = [(a, b) for i, a in enumerate(boxes) for b in (others or boxes[i + 1 :])]
    return [(a, b) for a, b in pairs if trace_view_graph.overlap(a, b) > 0]


def _samples(d: str) -> list[tuple[float, float]]:
    """Points along an edge's path ``M s Q c e`` (or ``C c1 c2 e``)."""
    p = [tuple(map(float, xy.split(","))) for xy in re.findall(r"-?[\d.]+,-?[\d.]+", d)]
    if len(p) == 3:
        (s, c, e), n = p, 40
        return [
            tuple((1 - t) ** 2 * s[j] + 2 * (1 - t) * t * c[j] + t * t * e[j] for j in (0, 1))  # type: ignore[misc]
            for t in (k / n for k in range(n + 1))
        ]
    return p  # type: ignore[return-value]


def test_the_graph_leaves_the_node_agent_out_and_says_so(tmp_path: Any) -> None:
    page = _page(tmp_path)
    graph = _graph(page)
    names = [t.text for t in graph.iter(f"{SVG}text") if t.get("class") == "nname"]
    assert names == ["driver", "learner", "prompts", "reward", "rollout"]  # busiest caller on top
    with open(page) as f:
        text = f.read()
    assert (
        '<p class="note">Left out of the graph: agent (the node agent) and its 6 calls (status '
        "and _stats: the runtime&#x27;s bookkeeping, not the program&#x27;s control flow); the "
        "timeline and the table below keep them.</p>"
    ) in text
    assert ">agent.0 #0</text>" in text and "<td>agent.0 #0</td>" in text  # timeline, table
    drawn = _graph(_page(tmp_path, infrastructure=True))
    names = [t.text for t in drawn.iter(f"{SVG}text") if t.get("class") == "nname"]
    assert names == ["driver", "agent", "learner", "prompts", "reward", "rollout"]
    lighter = [
        g.findtext(f"{SVG}text[@class='nname']")
        for g in drawn.iter(f"{SVG}g")
        if g.get("class") == "node" and g.get("opacity") == "0.5"
    ]
    assert lighter == ["agent"]
    with open(tmp_path / "trace.html") as f:
        assert 'class="note"' not in f.read()


def test_edge_labels_overlap_neither_each_other_nor_nodes(tmp_path: Any) -> None:
    for infrastructure in (False, True):
        graph = _graph(_page(tmp_path, infrastructure))
        labels = [_box(r) for r in graph.iter(f"{SVG}rect") if r.get("class") == "elabel-box"]
        assert len(labels) == (14 if infrastructure else 9)
        assert _overlaps(labels) == []
        circles = [
            (
                float(c.get("cx", 0)) - r,
                float(c.get("cy", 0)) - r,
                float(c.get("cx", 0)) + r,
                float(c.get("cy", 0)) + r,
            )
            for c in graph.iter(f"{SVG}circle")
            for r in [float(c.get("r", 0))]
        ]
        bars = [
            _box(r)
            for g in graph.iter(f"{SVG}g")
            if g.get("class") == "node"
            for r in g.iter(f"{SVG}rect")
        ]
        assert _overlaps(labels, circles + bars) == []
        assert all(x0 >= 0 and x1 <= 1200 and y0 >= 0 and y1 <= 560 for x0, y0, x1, y1 in labels)


def test_arrowheads_keep_one_size_and_directions_run_apart(tmp_path: Any) -> None:
    graph = _graph(_page(tmp_path))
    edges = {
        f"{g.findtext(f'{SVG}title', '').split(':')[0]} ({g.get('class', '')[5:]})": g
        for g in graph.iter(f"{SVG}g")
        if (g.get("class") or "").startswith("edge ")
    }
    widths = {k: float(g.find(f"{SVG}path").get("stroke-width", 0)) for k, g in edges.items()}  # type: ignore[union-attr]
    assert widths["driver -> rollout (hosts)"] == pytest.approx(
        1.5 + 1.6 * math.log10(481), abs=0.05
    )
    for key, g in edges.items():
        pts = [
            tuple(map(float, p.split(",")))
            for p in g.find(f"{SVG}polygon").get("points", "").split()
        ]  # type: ignore[union-attr]
        length = math.dist(pts[0], ((pts[1][0] + pts[2][0]) / 2, (pts[1][1] + pts[2][1]) / 2))
        assert length == pytest.approx(10 + 0.9 * widths[key], abs=0.2), key  # not x the width
        assert length <= 18
    there = _samples(edges["learner -> rollout (processes)"].find(f"{SVG}path").get("d", ""))  # type: ignore[union-attr]
    back = _samples(edges["rollout -> learner (processes)"].find(f"{SVG}path").get("d", ""))  # type: ignore[union-attr]
    gap = min(math.dist(p, q) for p in there for q in back)
    assert gap >= trace_view_graph.LANE - 1  # two lanes, not one stroke drawn twice


_MEASURE = """<script>
const out = [];
for (const el of document.querySelectorAll("#graph text, #graph circle, #graph rect.elabel-box")) {
  const b = el.getBBox();
  out.push([el.getAttribute("class") || el.tagName, b.x, b.y, b.x + b.width, b.y + b.height]);
}
const pre = document.createElement("pre");
pre.id = "boxes";
pre.textContent = JSON.stringify(out);
document.body.appendChild(pre);
</script></body>"""


def _rendered_boxes(page: str) -> dict[str, list[Box]]:
    """The boxes Chromium gives the graph's texts, circles and label boxes, by class."""
    measured = page.replace(".html", "-measured.html")
    with open(page) as f, open(measured, "w") as g:
        g.write(f.read().replace("</body>", _MEASURE))
    chromium = _chromium()
    assert chromium is not None
    dom = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--dump-dom",
            f"file://{measured}",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    found = re.search(r'<pre id="boxes">(.*?)</pre>', dom, re.S)
    assert found is not None, dom[-2000:]
    boxes: dict[str, list[Box]] = {}
    for kind, *box in json.loads(html.unescape(found.group(1))):
        boxes.setdefault(kind, []).append(tuple(box))  # type: ignore[arg-type]
    return boxes


@pytest.mark.skipif(_chromium() is None, reason="Chromium is not installed (apt install chromium)")
def test_rendered_labels_fit_their_boxes_and_cover_no_node(tmp_path: Any) -> None:
    boxes = _rendered_boxes(_page(tmp_path, infrastructure=True))
    texts, frames = boxes["elabel"], boxes["elabel-box"]
    assert len(texts) == len(frames) == 14
    for text, frame in zip(texts, frames, strict=True):  # the estimate of widths holds
        assert frame[0] <= text[0] and text[2] <= frame[2], (text, frame)
    assert _overlaps(texts) == []
    covered = boxes["circle"] + boxes["nuse"] + boxes["nname"] + boxes["legend"]
    assert len(boxes["circle"]) == 6
    assert _overlaps(frames, covered) == []


def test_the_command_draws_the_agent_when_asked(tmp_path: Any) -> None:
    from asyncrl.cli import main

    _page(tmp_path)
    assert main(["trace", "view", str(tmp_path)]) == 0
    names = [t.text for t in _graph(str(tmp_path / "trace.html")).iter(f"{SVG}text")]
    assert "agent" not in names
    assert main(["trace", "view", "--infrastructure", str(tmp_path)]) == 0
    names = [t.text for t in _graph(str(tmp_path / "trace.html")).iter(f"{SVG}text")]
    assert "agent" in names
