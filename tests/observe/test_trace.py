"""Traces: the transport's recorder, the merge into one Chrome trace, its validation, and the
control-flow graph page (asyncrl.observe.trace, asyncrl.observe.trace_view,
asyncrl.transport.tracing)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from asyncrl.observe import trace, trace_view
from asyncrl.transport import ChannelOptions, Client, Server, run, tracing

SVG = "{http://www.w3.org/2000/svg}"


class Words(msgspec.Struct):
    text: str


def _split(payload: Words, call: Any) -> list[str]:
    return payload.text.split()


async def _fail(payload: Any, call: Any) -> None:
    raise ValueError("no")


@pytest.fixture
def recorder(tmp_path: Any) -> Iterator[tracing.Recorder]:
    rec = tracing.install(tracing.Recorder(str(tmp_path / "trace"), "test.0", 2))
    try:
        yield rec
    finally:
        tracing.uninstall()
        rec.close()


async def _traced_calls(directory: str) -> tuple[Client, Server]:
    server = Server(f"ipc://{directory}/s", name="splitter.0", options=ChannelOptions(run="t"))
    server.add("split", _split, Words)
    server.add("fail", _fail)
    async with server:
        client = Client(server.endpoint, name="driver", options=ChannelOptions(run="t"))
        async with client:
            assert await client.call("split", Words("a b c"), list[str]) == ["a", "b", "c"]
            assert await client.call("split", Words("d"), list[str]) == ["d"]
            with pytest.raises(Exception, match="no"):
                await client.call("fail")
    return client, server


def test_calls_are_recorded_at_both_ends_and_merged(
    tmp_path: Any, recorder: tracing.Recorder
) -> None:
    client, server = run(_traced_calls(str(tmp_path)))
    assert client._tracer is recorder and server._tracer is recorder
    recorder.flush()
    (proc,) = trace.load(str(tmp_path / "trace"))
    assert (proc.label, proc.incarnation, proc.pid) == ("test.0", 2, os.getpid())
    identity = client.identity.decode()
    # the handshake is id 1; calls are 2, 3, 4
    endpoint = f"ipc://{tmp_path}/s"
    assert [(c[1], c[2], c[3], c[4]) for c in proc.calls] == [
        ("split", endpoint, identity, 2),
        ("split", endpoint, identity, 3),
        ("fail", endpoint, identity, 4),
    ]
    assert [(s[1], s[2], s[3]) for s in proc.serves] == [
        ("split", identity, 2),
        ("split", identity, 3),
        ("fail", identity, 4),
    ]
    for call, serve in zip(proc.calls, proc.serves, strict=True):
        assert call[5] <= serve[4] <= serve[5] <= call[6]  # served inside the call
        assert call[7] == serve[6] > 0  # the same bytes left and arrived
    doc = trace.chrome_trace([proc])
    assert trace.validate(doc) == []
    flows = [e for e in doc["traceEvents"] if e["ph"] in ("s", "f")]
    assert [(e["ph"], e["id"]) for e in flows] == [
        ("s", 1),
        ("f", 1),
        ("s", 2),
        ("f", 2),
        ("s", 3),
        ("f", 3),
    ]
    assert doc["otherData"]["asyncrl"]["flows"] == 3


def test_tracing_off_records_nothing(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tracing.TRACE_DIR_ENV, raising=False)
    tracing.uninstall()
    client, server = run(_traced_calls(str(tmp_path)))
    assert client._tracer is None and server._tracer is None
    assert not os.path.exists(tmp_path / "trace")
    assert trace.traced("x", _split) is _split
    with trace.span("nothing") as args:
        assert args == {}


def test_spans_and_traced_functions(tmp_path: Any, recorder: tracing.Recorder) -> None:
    with trace.span("generation", samples=4) as args:
        args["tokens"] = 12
    assert trace.traced("scoring", lambda x: x + 1)(1) == 2
    recorder.flush()
    (proc,) = trace.load(str(tmp_path / "trace"))
    assert [(s[1], s[5]) for s in proc.spans] == [
        ("generation", {"samples": 4, "tokens": 12}),
        ("scoring", {}),
    ]
    assert all(s[3] <= s[4] for s in proc.spans)


def _proc(label: str, host: str, offset: int, **events: list[list[Any]]) -> trace.ProcessTrace:
    return trace.ProcessTrace(label, 0, 100, host, offset, **events)


def test_clocks_are_aligned_per_host_and_lanes_never_overlap() -> None:
    # host b's monotonic clock reads 5 ms less than host a's for the same wall time
    caller = _proc(
        "driver",
        "a",
        1_000_000_000_000,
        calls=[
            ["call", "gen", "rollout.0", "d:1:x", 2, 10_000, 50_000, 8],
            ["call", "gen", "rollout.0", "d:1:x", 3, 20_000, 60_000, 8],
        ],
    )
    callee = _proc(
        "rollout.0",
        "b",
        1_000_005_000_000,
        serves=[["serve", "gen", "d:1:x", 2, -4_990_000, -4_970_000, 8]],
    )
    doc = trace.chrome_trace([caller, callee])
    assert trace.validate(doc) == []
    xs = [(e["pid"], e["tid"], e["ts"], e["dur"]) for e in doc["traceEvents"] if e["ph"] == "X"]
    assert xs == [(1, 1001, 0.0, 40.0), (1, 1002, 10.0, 40.0), (2, 1, 0.0, 20.0)]
    rows = doc["otherData"]["asyncrl"]["processes"]
    assert [(r["label"], r["role"], r["replica"], r["host"]) for r in rows] == [
        ("driver", "driver", 0, "a"),
        ("rollout.0", "rollout", 0, "b"),
    ]
    assert trace._lanes([(0, 10), (5, 15), (10, 20), (12, 13)]) == [0, 1, 0, 2]


def test_validate_names_each_problem() -> None:
    doc = {
        "traceEvents": [
            {"ph": "X", "name": "a", "ts": 1, "pid": 1, "tid": 1},
            {"ph": "X", "name": "a", "ts": 1, "dur": -2, "pid": 1, "tid": 1},
            {"ph": "Q", "pid": 1},
            {"ph": "f", "name": "a", "cat": "c", "ts": 1, "pid": 1, "tid": "x", "id": 7},
            {"ph": "M", "name": "colour", "pid": 1, "args": {}},
        ]
    }
    assert trace.validate(doc) == [
        "traceEvents[0] (X): missing 'dur'",
        "traceEvents[1] (X): negative dur -2",
        "traceEvents[2]: unknown phase 'Q'",
        "traceEvents[3] (f): tid is not an integer: 'x'",
        "traceEvents[3] (f): flow id 7 ends before it starts",
        "traceEvents[4] (M): unknown metadata 'colour'",
    ]
    assert trace.validate([]) == ["the document is not an object with a 'traceEvents' list"]


def _sample_doc() -> dict[str, Any]:
    """A driver on host a calling two rollout replicas (one on host b) and itself."""
    driver = _proc(
        "driver",
        "a",
        0,
        calls=[
            ["call", "gen", "rollout.0", "d:1:x", 2, 0, 400_000, 1000],
            ["call", "gen", "rollout.1", "d:1:y", 2, 100_000, 300_000, 500],
            ["call", "tick", "driver", "d:1:z", 2, 500_000, 600_000, 10],
        ],
        serves=[["serve", "tick", "d:1:z", 2, 520_000, 580_000, 10]],
    )
    r0 = _proc("rollout.0", "a", 0, serves=[["serve", "gen", "d:1:x", 2, 50_000, 350_000, 1000]])
    r1 = _proc("rollout.1", "b", 0, serves=[["serve", "gen", "d:1:y", 2, 150_000, 250_000, 500]])
    r1.spans.append(["span", "generation", "compute", 160_000, 240_000, {}])
    return trace.chrome_trace([driver, r0, r1])


def test_analysis_of_the_graph_and_the_waits() -> None:
    a = trace_view.analyse(_sample_doc())
    assert a.span_us == 600.0
    assert a.edges == {
        ("driver", "rollout", "processes"): [1, 1000],
        ("driver", "rollout", "hosts"): [1, 500],
        ("driver", "driver", "process"): [1, 10],
    }
    usage = {p["label"]: p["usage"] for p in a.processes}
    assert (usage["driver"].busy, usage["driver"].waiting, usage["driver"].idle) == (
        60.0,
        440.0,
        100.0,
    )
    assert usage["driver"].waited_on == {"rollout.0": 400.0, "rollout.1": 200.0, "driver": 100.0}
    assert (usage["rollout.1"].busy, usage["rollout.1"].waiting) == (100.0, 0.0)
    assert list(a.roles) == ["driver", "rollout"]


def test_page_draws_graph_and_timeline(tmp_path: Any) -> None:
    with open(tmp_path / trace.TRACE_FILE, "w") as f:
        json.dump(_sample_doc(), f)
    path = trace_view.write_page(str(tmp_path))
    assert path == str(tmp_path / "trace.html")
    with open(path) as f:
        page = f.read()
    assert "http" not in page.replace("http://www.w3.org/", "")  # nothing fetched
    root = ET.fromstring(page.split("\n", 1)[1])  # well-formed (after the doctype)
    svgs = {s.get("id"): s for s in root.iter(f"{SVG}svg")}
    graph, timeline = svgs["graph"], svgs["timeline"]
    assert len(graph.findall(f".//{SVG}circle")) == 2  # driver, rollout
    edges = {g.get("class"): g for g in graph.iter(f"{SVG}g") if "edge" in (g.get("class") or "")}
    assert set(edges) == {"edge process", "edge processes", "edge hosts"}
    dashes = {k: g.find(f"{SVG}path").get("stroke-dasharray") for k, g in edges.items()}  # type: ignore[union-attr]
    assert dashes == {"edge process": "2 5", "edge processes": None, "edge hosts": "12 6"}
    waits = [r for r in timeline.iter(f"{SVG}rect") if r.get("class") == "wait"]
    assert [r.find(f"{SVG}title").text for r in waits] == [  # type: ignore[union-attr]
        "driver waited 0.4 ms on rollout.0 (gen)",
        "driver waited 0.2 ms on rollout.1 (gen)",
        "driver waited 0.1 ms on driver (tick)",
    ]
    busy = [r for r in timeline.iter(f"{SVG}rect") if r.get("class") == "busy"]
    assert len(busy) == 3  # the driver's tick, each rollout's request (rollout.1's span inside)


def test_page_without_a_trace_says_how_to_get_one(tmp_path: Any) -> None:
    with pytest.raises(
        trace_view.TraceViewError, match="run the manifest with 'asyncrl run --trace'"
    ):
        trace_view.write_page(str(tmp_path))


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(page: str, png: str) -> None:
    """Render ``page`` in headless Chromium into ``png`` (1280 x 1400)."""
    chromium = _chromium()
    assert chromium is not None
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1280,1400",
            f"--screenshot={png}",
            f"file://{page}",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )


def drawn_pixels(png: str, top: int, bottom: int) -> int:
    """Pixels between rows ``top`` and ``bottom`` that are not the page's white background."""
    from PIL import Image

    with Image.open(png) as img:
        band = img.convert("RGB").crop((0, top, img.width, bottom))
        return sum(count for count, rgb in band.getcolors(1 << 24) or [] if rgb != (255, 255, 255))


@pytest.mark.skipif(_chromium() is None, reason="Chromium is not installed (apt install chromium)")
def test_page_renders_in_chromium(tmp_path: Any) -> None:
    pytest.importorskip("PIL", reason="Pillow reads the screenshot")
    with open(tmp_path / trace.TRACE_FILE, "w") as f:
        json.dump(_sample_doc(), f)
    page = trace_view.write_page(str(tmp_path))
    png = str(tmp_path / "trace.png")
    screenshot(page, png)
    # h1, summary and heading take ~110 px; the graph is 560 px; the timeline follows it
    assert drawn_pixels(png, 130, 650) > 20_000  # nodes, edges, bars, labels
    assert drawn_pixels(png, 735, 840) > 2_000  # the process rows and their bars
    assert drawn_pixels(png, 1300, 1400) < 100  # and below the page, nothing


async def _bench_rounds(directory: str) -> dict[str, float]:
    from asyncrl.bench import transport as bench

    endpoint = f"ipc://{directory}/bench"
    options = ChannelOptions(run="t")
    plain = Server(endpoint, name="bench", options=options)
    tracing.install(tracing.Recorder(os.path.join(directory, "trace"), "bench-server"))
    traced = Server(endpoint + bench.TRACED, name="bench-traced", options=options)
    tracing.uninstall()
    for server in (plain, traced):
        server.add("echo", bench._echo, bench.Small)
    async with plain, traced, Client(endpoint, options=options) as client:
        figures = await bench._traced_and_not(client, endpoint, "t", 300)
    assert plain._tracer is None and client._tracer is None
    return figures


def test_bench_measures_traced_and_untraced_calls(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[tracing.Recorder] = []
    install = tracing.install
    monkeypatch.setattr(tracing, "install", lambda r: install(made.append(r) or r))
    figures = run(_bench_rounds(str(tmp_path)))
    assert set(figures) == {
        "rpc_calls_per_s",
        "rpc_calls_per_s_traced",
        "trace_overhead",
        "client_cpu_us_per_call",
        "client_cpu_us_per_call_traced",
    }
    assert figures["rpc_calls_per_s"] > 0 and figures["rpc_calls_per_s_traced"] > 0
    for recorder in made:
        recorder.close()
    # only the traced pair recorded (the server's and the client's recorders, one file each):
    # 50 warm-up calls and ROUNDS rounds of 300
    procs = {p.label: p for p in trace.load(str(tmp_path / "trace"))}
    assert set(procs) == {"bench-server", "bench-client"}
    server, client = procs["bench-server"], procs["bench-client"]
    from asyncrl.bench.transport import ROUNDS

    assert len(server.serves) == len(client.calls) == 50 + ROUNDS * 300
    assert server.calls == client.serves == []


def _write_trace(path: str, *events: list[Any]) -> None:
    """A per-process trace file as the recorder writes it: one length-prefixed chunk."""
    chunk = msgspec.msgpack.encode(list(events))
    with open(path, "wb") as f:
        f.write(len(chunk).to_bytes(4, "little") + chunk)


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_node_1_sends_its_trace_to_node_0_which_merges_both_with_cross_host_flows(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir, node1 = str(tmp_path / "run"), str(tmp_path / "run" / "node-1" / "trace")
    os.makedirs(trace.trace_dir(run_dir))
    os.makedirs(node1)
    caller = b"driver:7:ab"
    # The same machine, the same clock: node 1's serve lies inside node 0's call.
    _write_trace(
        os.path.join(trace.trace_dir(run_dir), "h-7-0.trace"),
        ["process", "driver.0", 0, 7, "h", 1000],
        ["call", "split", "tcp://127.0.0.1:1/splitter.0", caller, 2, 10_000, 40],
        ["reply", caller, 2, 90_000],
    )
    _write_trace(
        os.path.join(node1, "h-8-0.trace"),
        ["process", "splitter.0", 0, 8, "h", 1000],
        ["serve", "split", caller, 2, 20_000, 40],
        ["served", caller, 2, 80_000],
    )
    _write_trace(os.path.join(node1, "h-9-0.trace"))  # a process that recorded nothing
    monkeypatch.setattr(trace, "SEND_CHUNK_BYTES", 16)  # several pieces per file
    endpoint = f"tcp://127.0.0.1:{_port()}"

    async def gather() -> list[str]:
        sink = trace.TraceSink(run_dir, 2, endpoint, run="t")
        await sink.start()
        try:
            return await trace.send_traces(node1, 1, endpoint, run="t", timeout_s=10.0)
        finally:
            await sink.close()

    assert run(gather()) == ["h-8-0.trace", "h-9-0.trace"]
    for name in ("h-8-0.trace", "h-9-0.trace"):
        with open(os.path.join(node1, name), "rb") as sent:
            with open(os.path.join(trace.trace_dir(run_dir), "node-1", name), "rb") as got:
                assert got.read() == sent.read()
    with open(trace.merge(run_dir) or "") as f:
        doc = json.load(f)
    assert trace.validate(doc) == []
    rows = doc["otherData"]["asyncrl"]["processes"]
    assert [(r["label"], r["node"], r["host"]) for r in rows] == [
        ("driver.0", 0, "h"),
        ("splitter.0", 1, "h"),
    ]
    flows = [(e["ph"], e["pid"], e["cat"]) for e in doc["traceEvents"] if e["ph"] in "sf"]
    assert flows == [("s", 1, "rpc,cross_host"), ("f", 2, "rpc,cross_host")]
    assert doc["otherData"]["asyncrl"]["cross_host_flows"] == 1
    labels = [e["args"]["labels"] for e in doc["traceEvents"] if e["name"] == "process_labels"]
    assert labels == ["pid 7 on h (node 0)", "pid 8 on h (node 1)"]
    assert trace_view.analyse(doc).edges == {("driver", "splitter", "hosts"): [1, 40]}


def test_the_sink_writes_only_trace_files_of_other_nodes_in_order(tmp_path: Any) -> None:
    sink = trace.TraceSink(str(tmp_path), 3, "tcp://127.0.0.1:1", run="t")
    assert sink.path(2, "h-1-0.trace") == str(tmp_path / "trace" / "node-2" / "h-1-0.trace")
    with pytest.raises(ValueError) as bad:
        sink.path(3, "h-1-0.trace")
    assert str(bad.value) == "trace chunk from node 3: other nodes are 1 to 2"
    for name in ("../h-1-0.trace", "notes.txt", ".trace"):
        with pytest.raises(ValueError) as bad:
            sink.path(1, name)
        assert str(bad.value) == f"trace chunk from node 1: {name!r} is no HOST-PID-N.trace"
    assert sink._put(trace.TraceChunk(1, "h-1-0.trace", 0, b"abc"), None) == 3
    with pytest.raises(ValueError) as bad:
        sink._put(trace.TraceChunk(1, "h-1-0.trace", 5, b"de"), None)
    assert str(bad.value) == (
        "trace chunk from node 1: h-1-0.trace has 3 bytes here, the chunk starts at 5; send "
        "the file again from offset 0"
    )
    assert sink._put(trace.TraceChunk(1, "h-1-0.trace", 3, b"de"), None) == 5
    assert sink._put(trace.TraceChunk(1, "h-1-0.trace", 0, b"x"), None) == 1  # afresh
