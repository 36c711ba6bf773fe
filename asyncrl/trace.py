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

from asyncrl.transport import tracing
from asyncrl.transport.tracing import TRACE_DIR_ENV

__all__ = [
    "TRACE_DIR_ENV",
    "TRACE_FILE",
    "ProcessTrace",
    "enable",
    "load",
    "merge",
    "merge_and_tell",
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
    """The per-process files in ``directory``, read, each call and request served matched with
    its end; files with no events are left out.

    A call with no answer ends when it was served, or else at its start (``no_answer``). A line
    cut short (a process killed while it wrote) is skipped.
    """
    out = []
    for entry in sorted(os.listdir(directory)):
        if entry.endswith(".trace"):
            proc = _load_file(os.path.join(directory, entry))
            if proc is not None and (proc.calls or proc.serves or proc.spans):
                out.append(proc)
    served_end = {(e[2], e[3]): e[5] for p in out for e in p.serves}
    for p in out:
        for e in p.calls:
            if e[6] is None:
                e[6] = max(e[5], served_end.get((e[3], e[4]), e[5]))
                e.append("no_answer")
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
    """The events of one file, chunk by chunk; a chunk cut short (a process killed while it
    wrote) ends the file."""
    with open(path, "rb") as f:
        data = f.read()
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
        yield from chunk


_decode = msgspec.msgpack.Decoder(list[list[Any]]).decode


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


def _host_offsets(procs: list[ProcessTrace]) -> dict[str, int]:
    hosts: dict[str, list[int]] = {}
    for p in procs:
        hosts.setdefault(p.host, []).append(p.offset_ns)
    return {h: int(statistics.median_low(offsets)) for h, offsets in hosts.items()}


def chrome_trace(procs: list[ProcessTrace]) -> dict[str, Any]:
    """The processes' events as one Chrome trace (see the module docstring)."""
    offsets = _host_offsets(procs)
    starts = [
        _bounds(e)[0] + offsets[p.host] for p in procs for e in (*p.calls, *p.serves, *p.spans)
    ]
    t0 = min(starts) if starts else 0
    events: list[dict[str, Any]] = []
    serving: dict[tuple[str, int], tuple[int, int, float]] = {}  # (identity, id) -> pid, tid, ts
    placed: list[tuple[int, int, float, list[Any]]] = []  # calls: pid, tid, ts, event
    table = []
    for index, p in enumerate(procs):
        pid = index + 1
        shift = offsets[p.host] - t0
        name = f"{p.label or 'pid ' + str(p.pid)} #{p.incarnation}"
        table.append(_process_row(pid, p))
        events.append(_meta("process_name", pid, 0, name))
        events.append(_meta("process_labels", pid, 0, f"pid {p.pid} on {p.host}", "labels"))
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
    flows = 0
    for pid, tid, ts, e in placed:
        served = serving.get((e[3], e[4]))
        if served is None:
            continue
        flows += 1
        common = {"name": e[1], "cat": "rpc", "id": flows}
        events.append({**common, "ph": "s", "pid": pid, "tid": tid, "ts": ts})
        s_pid, s_tid, s_ts = served
        events.append({**common, "ph": "f", "bp": "e", "pid": s_pid, "tid": s_tid, "ts": s_ts})
    other = {"asyncrl": {"processes": table, "t0_wall_ns": t0, "flows": flows}}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


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
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(procs), f, separators=(",", ":"))
    os.replace(tmp, path)
    return path


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
