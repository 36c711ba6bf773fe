"""``asyncrl run --trace`` on the hello example: one valid trace of every process, and the page."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter

import pytest

from asyncrl.observe import trace
from tests.conftest import ROOT
from tests.observe.test_trace import SVG, _chromium, drawn_pixels, screenshot


def _asyncrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_traced_hello_run_and_its_page(run_dir: str) -> None:
    out = _asyncrl("run", "examples/hello/manifest.yaml", "--trace", "--run-dir", run_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    path = os.path.join(run_dir, "trace.json")
    assert f"trace: {path} (open it in ui.perfetto.dev" in out.stdout
    with open(path) as f:
        doc = json.load(f)
    assert trace.validate(doc) == []
    table = {p["pid"]: p for p in doc["otherData"]["asyncrl"]["processes"]}
    labels = {p["label"] for p in table.values()}
    assert {"driver", "splitter.0", "splitter.1", "counter.0"} <= labels
    driver = next(pid for pid, p in table.items() if p["label"] == "driver")
    calls = [
        e
        for e in doc["traceEvents"]
        if e["ph"] == "X" and e["cat"] == "call" and e["pid"] == driver
    ]
    assert Counter(e["name"] for e in calls if not e["name"].startswith("_")) == {
        "split": 3,
        "add": 3,
        "top": 1,
    }
    # every call of the driver became a request served by the role it named, with an arrow
    serves = {
        (e["args"]["caller"], e["args"]["request_id"]): e["pid"]
        for e in doc["traceEvents"]
        if e["ph"] == "X" and e["cat"] == "serve"
    }
    for e in calls:
        callee = table[serves[(e["args"]["identity"], e["args"]["request_id"])]]
        assert callee["label"] == e["args"]["endpoint"].rsplit("/", 1)[-1]
    starts = [e for e in doc["traceEvents"] if e["ph"] == "s" and e["pid"] == driver]
    assert len(starts) == len(calls)

    out = _asyncrl("trace", "view", run_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    page = os.path.join(run_dir, "trace.html")
    assert out.stdout.strip() == page
    with open(page) as f:
        root = ET.fromstring(f.read().split("\n", 1)[1])
    graph = next(s for s in root.iter(f"{SVG}svg") if s.get("id") == "graph")
    names = {t.text for t in graph.iter(f"{SVG}text") if t.get("class") == "nname"}
    assert {"driver", "splitter", "counter"} <= names
    if _chromium() is not None and _pillow():
        png = os.path.join(run_dir, "trace.png")  # kept in the run directory, to look at
        screenshot(page, png)
        assert drawn_pixels(png, 130, 650) > 20_000
        assert drawn_pixels(png, 735, 840) > 2_000


def _pillow() -> bool:
    try:
        import PIL  # noqa: F401
    except ImportError:
        return False
    return True
