"""Traces of a run: spans inside roles, and the merge of every process's calls into one file.

``asyncrl run --trace`` sets ``ASYNCRL_TRACE_DIR`` to ``RUN_DIR/trace/`` for every process; each
records the calls it makes and serves (``asyncrl.transport.tracing``) and the spans its role
marks with ``span``. At the end of the run ``merge`` writes ``RUN_DIR/trace.json``, Chrome's
trace-event format, which Perfetto (ui.perfetto.dev) and ``chrome://tracing`` open:

- one track (a trace-event process) per process and incarnation, named ``rollout.0 #1`` with its
  role, replica, incarnation, pid and host in its labels; inside it one thread per lane, since
  calls that overlap (a pipelined window) cannot nest on one thread: ``serve``, ``call`` and the
  span threads;
- a complete event (``"ph": "X"``) per call, per request served and per span, with the method,
  request id, peers and bytes in its args;
- a flow arrow (``"ph": "s"`` then ``"f"``) from each call to the request it became on the
  server, matched on the client's routing id and the request id.

Clocks: the processes of one host share ``CLOCK_MONOTONIC``, so their events are placed on it,
shifted by one wall-clock offset per host (the median of its processes'); hosts are aligned on
their wall clocks, as well as NTP keeps them.

Several nodes (``asyncrl.launch --trace``): node R records under its own directory
(``RUN_DIR/node-R/trace``), and at the end sends its files to node 0 over the launch's tcp
transport (Curve applies): ``send_traces`` to node 0's ``TraceSink``, which writes them under
``RUN_DIR/trace/node-R/``. ``merge`` reads those beside node 0's own, so ``trace.json`` holds
every node's processes, each with its node; a flow between two nodes or hosts has the category
``rpc,cross_host``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import msgspec

from asyncrl.safe_files import open_append, write_atomic
from asyncrl.transport import ChannelOptions, Client, Server, tracing
from asyncrl.transport.tracing import TRACE_DIR_ENV

__all__ = [
    "TRACE_DIR_ENV",
    "TRACE_FILE",
    "ProcessTrace",
    "TraceChunk",
    "TraceSink",
    "enable",
    "load",
    "merge",
    "merge_and_tell",
    "send_traces",
    "span",
    "trace_dir",
    "traced",
    "validate",
]

P = ParamSpec("P")
R = TypeVar("R")

TRACE_FILE = "trace.json"
"""The merged trace, in the run directory."""

_NULL_SPAN: contextlib.nullcontext[dict[str, Any]] = contextlib.nullcontext({})


def trace_dir(run_dir: str) -> str:
    """Where the processes of the run in ``run_dir`` write their trace files."""
    return os.path.join(run_dir, "trace")


def span(name: str, **args: Any) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """Record the ``with`` block as ``name`` (generation, scoring, ...) when tracing is on.

    The block gets a dict of the span's args, to which it may add what it learns (token
    counts); with tracing off it is a shared empty dict, and nothing is recorded.
    """
    recorder = tracing.current()
    if recorder is None:
        return _NULL_SPAN
    return recorder.span(name, **args)


@dataclass
class ProcessTrace:
    """What one process recorded: who it is, and its events (monotonic ns)."""

    label: str
    incarnation: int
    pid: int
    host: str
    offset_ns: int
    node: int = 0  # the launch's node it ran on (0 on one machine)
    calls: list[list[Any]] = field(default_factory=list)
    serves: list[list[Any]] = field(default_factory=list)
    spans: list[list[Any]] = field(default_factory=list)

    @property
    def role(self) -> str:
        """The role's name: the label without its replica (``rollout.0`` -> ``rollout``)."""
        base, _, replica = self.label.rpartition(".")
        return base if base and replica.isdigit() else self.label

    @property
    def replica(self) -> int:
        base, _, replica = self.label.rpartition(".")
        return int(replica) if base and replica.isdigit() else 0


def load(directory: str) -> list[ProcessTrace]:
    """The per-process files in ``directory`` and, for a launch over several nodes, in its
    ``node-R`` folders (node R's files, sent to node 0), read, each call and request served
    matched with its end; files with no events are left out.

    A call with no answer ends when it was served, or else at its start (``no_answer``). A line
    cut short (a process killed while it wrote) is skipped.
    """
    out = _load_dir(directory, 0)
    for entry in sorted(os.listdir(directory)):
        node = _node_folder(entry)
        if node and os.path.isdir(os.path.join(directory, entry)):
            out += _load_dir(os.path.join(directory, entry), node)
    served_end = {(e[2], e[3]): e[5] for p in out for e in p.serves}
    for p in out:
        for e in p.calls:
            if e[6] is None:
                e[6] = max(e[5], served_end.get((e[3], e[4]), e[5]))
                e.append("no_answer")
    return out


def _node_folder(name: str) -> int:
    """R for a folder named ``node-R`` (R >= 1), else 0."""
    head, _, tail = name.partition("-")
    return int(tail) if head == "node" and tail.isdigit() and int(tail) > 0 else 0


def _load_dir(directory: str, node: int) -> list[ProcessTrace]:
    out = []
    for entry in sorted(os.listdir(directory)):
        if entry.endswith(".trace"):
            proc = _load_file(os.path.join(directory, entry))
            if proc is not None and (proc.calls or proc.serves or proc.spans):
                proc.node = node
                out.append(proc)
    return out


def _load_file(path: str) -> ProcessTrace | None:
    """One process's file: calls as ``[call, method, endpoint, identity, id, start, end, bytes]``,
    serves as ``[serve, method, identity, id, start, end, bytes]``, spans as written."""
    proc: ProcessTrace | None = None
    calls: dict[tuple[str, int], list[Any]] = {}
    serves: dict[tuple[str, int], list[Any]] = {}
    for event in _events(path):
        kind = event[0]
        if kind == "process":
            label, incarnation, pid, host, offset = event[1:6]
            if proc is None:
                proc = ProcessTrace(label, incarnation, pid, host, offset)
            else:
                proc.label, proc.incarnation = label, incarnation
        elif proc is None:
            continue
        elif kind == "call":
            _, method, endpoint, identity, rid, start, size = event
            call = ["call", method, endpoint, _text(identity), rid, start, None, size]
            calls[(identity, rid)] = call
            proc.calls.append(call)
        elif kind == "reply" and (event[1], event[2]) in calls:
            calls.pop((event[1], event[2]))[6] = event[3]
        elif kind == "serve":
            _, method, identity, rid, start, size = event
            serve = ["serve", method, _text(identity), rid, start, None, size]
            serves[(identity, rid)] = serve
        elif kind == "served" and (event[1], event[2]) in serves:
            serve = serves.pop((event[1], event[2]))
            serve[5] = event[3]
            proc.serves.append(serve)
        elif kind == "span":
            proc.spans.append(event)
    return proc


def _events(path: str) -> Iterator[list[Any]]:
    """The events of one file, chunk by chunk, each as an array opened by its kind's name (as
    files of earlier versions hold them; see ``asyncrl.transport.tracing``); a chunk cut short
    (a process killed while it wrote) or undecodable ends the file."""
    with open(path, "rb") as f:
        data = f.read()
    channels: dict[int, tuple[str, bytes]] = {}  # a client's number -> endpoint, identity
    at = 0
    while at + 4 <= len(data):
        size = int.from_bytes(data[at : at + 4], "little")
        if at + 4 + size > len(data):
            return
        try:
            chunk = _decode(data[at + 4 : at + 4 + size])
        except msgspec.DecodeError:
            return
        at += 4 + size
        if chunk and isinstance(chunk[0], list):
            yield from chunk  # an array of arrays: a file of an earlier version
        else:
            try:
                yield from tracing.named_events(chunk, channels)
            except (KeyError, ValueError, TypeError):
                return  # a kind or a channel this version does not know


_decode = msgspec.msgpack.Decoder(list[Any]).decode


def _text(identity: bytes) -> str:
    """A routing id as written (``name:pid:hex``), as text."""
    return identity.decode(errors="replace")


def _lanes(intervals: list[tuple[int, int]]) -> list[int]:
    """A lane per interval such that intervals on one lane never overlap (greedy, by start)."""
    order = sorted(range(len(intervals)), key=lambda i: intervals[i])
    ends: list[int] = []
    lanes = [0] * len(intervals)
    for i in order:
        start, end = intervals[i]
        for lane, last in enumerate(ends):
            if last <= start:
                ends[lane] = end
                lanes[i] = lane
                break
        else:
            lanes[i] = len(ends)
            ends.append(end)
    return lanes


_LANE_BASE = {"serve": 1, "call": 1001, "span": 2001}
"""Thread ids of each kind of lane: serve 1.., call 1001.., spans 2001.."""


def _place(p: ProcessTrace) -> tuple[int, str]:
    """Where a process ran: its node and host. Processes of one place share a monotonic
    clock; two nodes are two places even on one machine (a simulated launch)."""
    return p.node, p.host


def _host_offsets(procs: list[ProcessTrace]) -> dict[tuple[int, str], int]:
    places: dict[tuple[int, str], list[int]] = {}
    for p in procs:
        places.setdefault(_place(p), []).append(p.offset_ns)
    return {h: int(statistics.median_low(offsets)) for h, offsets in places.items()}


def chrome_trace(procs: list[ProcessTrace]) -> dict[str, Any]:
    """The processes' events as one Chrome trace (see the module docstring)."""
    offsets = _host_offsets(procs)
    starts = [
        _bounds(e)[0] + offsets[_place(p)] for p in procs for e in (*p.calls, *p.serves, *p.spans)
    ]
    t0 = min(starts) if starts else 0
    events: list[dict[str, Any]] = []
    serving: dict[tuple[str, int], tuple[int, int, float]] = {}  # (identity, id) -> pid, tid, ts
    placed: list[tuple[int, int, float, list[Any]]] = []  # calls: pid, tid, ts, event
    table = []
    several = any(p.node for p in procs)
    for index, p in enumerate(procs):
        pid = index + 1
        shift = offsets[_place(p)] - t0
        name = f"{p.label or 'pid ' + str(p.pid)} #{p.incarnation}"
        where = f"pid {p.pid} on {p.host}" + (f" (node {p.node})" if several else "")
        table.append(_process_row(pid, p))
        events.append(_meta("process_name", pid, 0, name))
        events.append(_meta("process_labels", pid, 0, where, "labels"))
        for kind, items in (("serve", p.serves), ("call", p.calls), ("span", p.spans)):
            bounds = [_bounds(e) for e in items]
            lanes = _lanes(bounds)
            for lane in sorted(set(lanes)):
                tid = _LANE_BASE[kind] + lane
                events.append(_meta("thread_name", pid, tid, f"{kind} {lane}"))
            for e, lane, (start, end) in zip(items, lanes, bounds, strict=True):
                tid = _LANE_BASE[kind] + lane
                ts = (start + shift) / 1000
                events.append(_complete(kind, e, pid, tid, ts, (end - start) / 1000))
                if kind == "serve":
                    serving[(e[2], e[3])] = (pid, tid, ts)
                elif kind == "call":
                    placed.append((pid, tid, ts, e))
    flows, crossing = _flows(placed, serving, [_place(p) for p in procs])
    events += flows
    other = {
        "asyncrl": {
            "processes": table,
            "t0_wall_ns": t0,
            "flows": len(flows) // 2,
            "cross_host_flows": crossing,
        }
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _flows(
    placed: list[tuple[int, int, float, list[Any]]],
    serving: dict[tuple[str, int], tuple[int, int, float]],
    places: list[tuple[int, str]],
) -> tuple[list[dict[str, Any]], int]:
    """A flow (start and end event) from each placed call to the request it became, and how
    many of them cross from one node or host to another (category ``rpc,cross_host``)."""
    events: list[dict[str, Any]] = []
    crossing = 0
    for pid, tid, ts, e in placed:
        served = serving.get((e[3], e[4]))
        if served is None:
            continue
        s_pid, s_tid, s_ts = served
        across = places[pid - 1] != places[s_pid - 1]
        crossing += across
        cat = "rpc,cross_host" if across else "rpc"
        common = {"name": e[1], "cat": cat, "id": len(events) // 2 + 1}
        events.append({**common, "ph": "s", "pid": pid, "tid": tid, "ts": ts})
        events.append({**common, "ph": "f", "bp": "e", "pid": s_pid, "tid": s_tid, "ts": s_ts})
    return events, crossing


def _bounds(e: list[Any]) -> tuple[int, int]:
    """The start and end (monotonic ns) of a call, a request served or a span."""
    at = {"call": 5, "serve": 4, "span": 3}[e[0]]
    return e[at], e[at + 1]


def _process_row(pid: int, p: ProcessTrace) -> dict[str, Any]:
    return {
        "pid": pid,
        "label": p.label,
        "role": p.role,
        "replica": p.replica,
        "incarnation": p.incarnation,
        "os_pid": p.pid,
        "host": p.host,
        "node": p.node,
    }


def _meta(name: str, pid: int, tid: int, value: str, key: str = "name") -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": {key: value}}


def _complete(kind: str, e: list[Any], pid: int, tid: int, ts: float, dur: float) -> dict[str, Any]:
    if kind == "call":
        args = {"endpoint": e[2], "identity": e[3], "request_id": e[4], "bytes": e[7]}
        if len(e) > 8:
            args["outcome"] = e[8]
    elif kind == "serve":
        args = {"caller": e[2], "request_id": e[3], "bytes": e[6]}
    else:
        args = {"thread": e[2], **e[5]}
    return {
        "ph": "X",
        "cat": kind,
        "name": e[1],
        "pid": pid,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "args": args,
    }


def merge(run_dir: str) -> str | None:
    """Merge ``RUN_DIR/trace/*.trace`` into ``RUN_DIR/trace.json``; returns its path, or None
    when the run recorded no trace."""
    directory = trace_dir(run_dir)
    if not os.path.isdir(directory):
        return None
    procs = load(directory)
    if not procs:
        return None
    path = os.path.join(run_dir, TRACE_FILE)
    return write_atomic(path, json.dumps(chrome_trace(procs), separators=(",", ":")).encode())


_REQUIRED: dict[str, tuple[str, ...]] = {
    "X": ("name", "ph", "ts", "dur", "pid", "tid"),
    "B": ("name", "ph", "ts", "pid", "tid"),
    "E": ("ph", "ts", "pid", "tid"),
    "i": ("name", "ph", "ts", "pid", "tid"),
    "s": ("name", "cat", "ph", "ts", "pid", "tid", "id"),
    "t": ("name", "cat", "ph", "ts", "pid", "tid", "id"),
    "f": ("name", "cat", "ph", "ts", "pid", "tid", "id"),
    "M": ("name", "ph", "pid", "args"),
}
"""The fields each phase needs, after the Trace Event Format document (Google, 2016)."""


def validate(doc: Any) -> list[str]:
    """Problems of ``doc`` as a Chrome trace in the JSON-object form; empty when it is valid.

    Checks: ``traceEvents`` is a list of objects; each phase used is known and has its
    required fields, of the right types (``ts``/``dur`` numbers, ``dur`` >= 0, ``pid``/``tid``
    integers); metadata names are known; every flow id has a start before or at its end.
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["the document is not an object with a 'traceEvents' list"]
    problems: list[str] = []
    flow_starts: dict[Any, float] = {}
    for i, e in enumerate(doc["traceEvents"]):
        problems.extend(_event_problems(i, e, flow_starts))
    return problems


def _event_problems(i: int, e: Any, flow_starts: dict[Any, float]) -> Iterator[str]:
    if not isinstance(e, dict):
        yield f"traceEvents[{i}]: not an object"
        return
    ph = e.get("ph")
    if ph not in _REQUIRED:
        yield f"traceEvents[{i}]: unknown phase {ph!r}"
        return
    for key in _REQUIRED[ph]:
        if key not in e:
            yield f"traceEvents[{i}] ({ph}): missing {key!r}"
    for key in ("ts", "dur"):
        if key in e and not isinstance(e[key], int | float):
            yield f"traceEvents[{i}] ({ph}): {key} is not a number: {e[key]!r}"
    if isinstance(e.get("dur"), int | float) and e["dur"] < 0:
        yield f"traceEvents[{i}] ({ph}): negative dur {e['dur']}"
    for key in ("pid", "tid"):
        if key in e and not isinstance(e[key], int):
            yield f"traceEvents[{i}] ({ph}): {key} is not an integer: {e[key]!r}"
    if ph == "M" and e.get("name") not in _METADATA:
        yield f"traceEvents[{i}] (M): unknown metadata {e.get('name')!r}"
    if ph == "s":
        flow_starts[e.get("id")] = e.get("ts", 0)
    elif ph == "f" and e.get("id") not in flow_starts:
        yield f"traceEvents[{i}] (f): flow id {e.get('id')!r} ends before it starts"


_METADATA = frozenset(
    {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}
)


def enable(run_dir: str) -> None:
    """Turn tracing on for the processes of the run in ``run_dir`` started from now on (they
    inherit ``ASYNCRL_TRACE_DIR``)."""
    os.environ[TRACE_DIR_ENV] = trace_dir(run_dir)


def merge_and_tell(run_dir: str) -> str | None:
    """``merge``, then say on stdout where the trace is and how to look at it."""
    path = merge(run_dir)
    if path is None:
        print(f"trace: nothing was recorded in {trace_dir(run_dir)}", flush=True)
    else:
        print(
            f"trace: {path} (open it in ui.perfetto.dev; 'asyncrl trace view {run_dir}' "
            "draws its control-flow graph)",
            flush=True,
        )
    return path


SEND_CHUNK_BYTES = 1 << 20
"""The most bytes of a trace file one message from node R to node 0 carries."""


class TraceChunk(msgspec.Struct, frozen=True):
    """A piece of one of node ``node``'s trace files: ``data`` goes at ``offset`` of ``name``
    (offset 0 starts the file afresh)."""

    node: int
    name: str
    offset: int
    data: bytes


class TraceSink:
    """Node 0's receiver of the other nodes' trace files in a traced launch, served from
    ``start()`` to ``close()``: method ``trace_chunk`` (a ``TraceChunk``) writes into
    ``RUN_DIR/trace/node-R/NAME`` and answers the file's size.

    Args:
        run_dir: the run's directory (node 0's).
        nodes: the launch's number of nodes; chunks come from nodes 1 to ``nodes - 1``.
        endpoint: the tcp endpoint to bind.
        run: the run's name (the transport's handshake checks it).
        curve: the Curve keys of the socket (``asyncrl.transport.CurveKeys``), or None.
    """

    def __init__(
        self, run_dir: str, nodes: int, endpoint: str, *, run: str, curve: Any = None
    ) -> None:
        self.run_dir = run_dir
        self.nodes = nodes
        self.endpoint = endpoint
        self.run = run
        self.curve = curve
        self._server: Any = None

    async def start(self) -> None:
        """Bind the endpoint and take chunks.

        Raises:
            TransportError: the endpoint cannot be bound.
        """
        options = ChannelOptions(run=self.run, shm=False)
        self._server = Server(self.endpoint, name="traces.0", options=options, curve=self.curve)
        self._server.add("trace_chunk", self._put, TraceChunk)
        await self._server.start()

    async def close(self) -> None:
        """Stop taking chunks (idempotent)."""
        if self._server is not None:
            await self._server.close()

    def path(self, node: int, name: str) -> str:
        """Where node ``node``'s file ``name`` goes. Raises ValueError: ``node`` is not another
        node of the launch, or ``name`` is not a trace file's bare name (nothing is written
        outside the folder)."""
        if not 1 <= node < self.nodes:
            raise ValueError(f"trace chunk from node {node}: other nodes are 1 to {self.nodes - 1}")
        if os.path.basename(name) != name or not name.endswith(".trace") or name[0] == ".":
            raise ValueError(f"trace chunk from node {node}: {name!r} is no HOST-PID-N.trace")
        return os.path.join(trace_dir(self.run_dir), f"node-{node}", name)

    def _put(self, chunk: TraceChunk, _call: Any) -> int:
        path = self.path(chunk.node, chunk.name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        size = os.path.getsize(path) if chunk.offset and os.path.exists(path) else 0
        if chunk.offset != size:
            raise ValueError(
                f"trace chunk from node {chunk.node}: {chunk.name} has {size} bytes here, "
                f"the chunk starts at {chunk.offset}; send the file again from offset 0"
            )
        with open_append(path, truncate=not chunk.offset) as f:
            f.write(chunk.data)
        return size + len(chunk.data)


async def send_traces(
    directory: str,
    node: int,
    endpoint: str,
    *,
    run: str,
    curve: Any = None,
    timeout_s: float = 60.0,
) -> list[str]:
    """Send every trace file in ``directory`` (node ``node``'s) to node 0's ``TraceSink`` at
    ``endpoint``, in pieces of ``SEND_CHUNK_BYTES``; returns the files sent.

    Raises:
        TransportError: node 0 did not take a piece within ``timeout_s`` (``RemoteError``: it
            refused it, saying why).
    """
    names = sorted(n for n in os.listdir(directory) if n.endswith(".trace"))
    options = ChannelOptions(run=run, shm=False)
    client = Client(endpoint, name=f"traces.{node}", options=options, curve=curve)
    try:
        await client.connect(timeout=timeout_s)
        for name in names:
            with open(os.path.join(directory, name), "rb") as f:
                offset = 0
                while True:
                    data = f.read(SEND_CHUNK_BYTES)
                    chunk = TraceChunk(node, name, offset, data)
                    await client.call("trace_chunk", chunk, timeout=timeout_s)
                    offset += len(data)
                    if len(data) < SEND_CHUNK_BYTES:
                        break
    finally:
        await client.close()
    return names


def traced(name: str, fn: Callable[P, R]) -> Callable[P, R]:
    """``fn``, recorded as the span ``name`` each time it runs when tracing is on; ``fn``
    itself when it is off. For work handed to a compute thread:
    ``await ctx.offload(traced("generation", engine.generate), requests)``."""
    recorder = tracing.current()
    if recorder is None:
        return fn

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with recorder.span(name):
            return fn(*args, **kwargs)

    return run
