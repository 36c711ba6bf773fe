"""A traced launch over two simulated nodes: node 0's ``trace.json`` holds node 1's processes too.

Two torchrun processes on 127.0.0.1 (``tests.integration.test_multinode.TwoNodes``; node 1 has
``ASYNCRL_HOST_ID=node1``, so it acts as another host) run the hello roles with the splitters
on node 1, with Curve keys, and ``--trace``. Node 1 records into ``RUN_DIR/node-1/trace`` and
sends its files to node 0 at the end, over tcp with Curve; the test then removes node 1's
folder before asking for the page, so what is drawn can only come from what node 0 received.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from typing import Any

import pytest

from asyncrl.observe import trace
from tests.conftest import ROOT
from tests.integration.test_multinode import EXPECTED, TwoNodes
from tests.observe.test_trace import SVG

pytestmark = pytest.mark.slow


def test_node_0_trace_holds_every_node_with_flows_across_hosts(tmp_path: Any) -> None:
    from asyncrl.keys import generate

    generate(str(tmp_path / "keys"))
    nodes = TwoNodes(
        str(tmp_path),
        extra="security: {curve_keys: keys}\n",
        options=("--agent-liveness=10", "--join-timeout=60", "--trace"),
    )
    try:
        nodes.start()
        nodes.wait("the program at its gate", lambda: os.path.exists(nodes.path(0, "progress")))
        with open(nodes.gate, "w"):
            pass
        assert nodes.finish() == [0, 0], nodes.logs()
    finally:
        nodes.kill()
    with open(nodes.path(0, "driver.json")) as f:
        assert json.load(f)["result"] == EXPECTED
    logs = nodes.logs()
    assert "asyncrl.launch[node 0]: trace of node 1: sent " in logs, logs
    path = nodes.path(0, "trace.json")
    assert f"trace: {path} (open it in ui.perfetto.dev" in logs
    received = os.listdir(nodes.path(0, "trace", "node-1"))
    assert sorted(received) == sorted(os.listdir(nodes.path(1, "trace")))
    shutil.rmtree(nodes.path(1, "trace"))  # what follows comes from node 0's copy alone

    with open(path) as f:
        doc = json.load(f)
    assert trace.validate(doc) == []
    table = {p["pid"]: p for p in doc["otherData"]["asyncrl"]["processes"]}
    where = {(p["label"], p["node"]) for p in table.values()}
    assert {("driver", 0), ("counter.0", 0), ("splitter.0", 1), ("splitter.1", 1)} <= where
    driver = next(pid for pid, p in table.items() if p["label"] == "driver")
    # Every split the driver sent went to node 1 and became a request served there, joined by
    # an arrow marked as crossing hosts; its calls to the counter stay on node 0.
    serves = {
        (e["args"]["caller"], e["args"]["request_id"]): e["pid"]
        for e in doc["traceEvents"]
        if e["ph"] == "X" and e["cat"] == "serve"
    }
    calls = [
        e
        for e in doc["traceEvents"]
        if e["ph"] == "X" and e["cat"] == "call" and e["pid"] == driver
    ]
    served_by = Counter(
        (e["name"], table[serves[(e["args"]["identity"], e["args"]["request_id"])]]["node"])
        for e in calls
        if not e["name"].startswith("_")
    )
    assert served_by == {("split", 1): 30, ("add", 0): 30, ("top", 0): 1}
    flows = [e for e in doc["traceEvents"] if e["ph"] in ("s", "f")]
    crossing = Counter(
        (e["ph"], e["name"], table[e["pid"]]["node"]) for e in flows if e["cat"] == "rpc,cross_host"
    )
    assert crossing[("s", "split", 0)] == 30
    assert crossing[("f", "split", 1)] == 30
    assert not any(e["cat"] == "rpc,cross_host" for e in flows if e["name"] in ("add", "top"))
    assert doc["otherData"]["asyncrl"]["cross_host_flows"] == sum(
        1 for e in flows if e["ph"] == "s" and e["cat"] == "rpc,cross_host"
    )

    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "trace", "view", nodes.path(0)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    page = nodes.path(0, "trace.html")
    assert out.stdout.strip() == page
    with open(page) as f:
        root = ET.fromstring(f.read().split("\n", 1)[1])
    graph = next(s for s in root.iter(f"{SVG}svg") if s.get("id") == "graph")
    edges = {g.get("class") for g in graph.iter(f"{SVG}g") if "edge" in (g.get("class") or "")}
    assert "edge hosts" in edges  # driver -> splitter, drawn dashed
    cells = [td.text for td in root.iter() if td.tag.rpartition("}")[2] == "td"]
    assert any(c and c.endswith("(node 1)") for c in cells), cells
