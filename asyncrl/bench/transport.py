"""``asyncrl bench transport``: the transport's figures, side by side, measured in one run.

Every figure comes from two processes over ipc, on the public API at both ends:

- round trip: sequential ``Client.call`` of a small payload; p50 and p99;
- pipelined request/reply: calls/s with ``WINDOW`` requests in flight; and the same with tracing
  on at both ends (``rpc_calls_per_s_traced``), the two interleaved round by round against one
  server process; ``trace_overhead`` is the median over rounds of 1 - traced / untraced;
- stream: msgs/s of a small typed message, timed at the receiver after decoding;
- raw: the same envelope bytes over synchronous pyzmq PUSH/PULL (and DEALER/ROUTER for the round
  trip) with no asyncrl layer, timed the same way: the baselines the stream and the round trip are
  compared against. The stream and raw PUSH/PULL alternate round by round (the order flipped each
  round); each figure is the median of its rounds, and ``stream_over_raw`` their ratio;
- tensors: a 64 MiB float32 tensor from client to server, as zero-copy frames and through shared
  memory. The source is an ordinary tensor written anew before each iteration (not timed); the
  server checks a checksum over every element and returns it; the time runs from the call to its
  reply. A plain memcpy of the same tensor, in the same run, is the baseline.

Each process uses one torch thread, so that the copy baseline and the transfers copy alike.

``--curve`` measures instead what CurveZMQ costs over tcp on the loopback interface: one peer
process serves the same methods on two tcp endpoints, one plain and one with Curve, and the
measuring process alternates between them round by round (the order flipped each round), for the
round trip p50, pipelined calls/s and a 64 MiB tensor as frames; each figure is the median of its
rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import torch
import zmq

from asyncrl.transport import (
    ChannelOptions,
    Client,
    CurveKeys,
    Envelope,
    Kind,
    Server,
    StreamReceiver,
    StreamSender,
    load_keys,
    run,
    tracing,
)
from asyncrl.transport.codec import Codec
from asyncrl.transport.event_loop import loop_name
from asyncrl.transport.protocol import PROTOCOL_VERSION

__all__ = ["main", "measure", "measure_curve"]

WINDOW = 256
ROUNDS = 40
"""Rounds of the pipelined figure, traced and not, interleaved, so that a machine whose load
drifts weighs on both alike. A round's cost of tracing varies by several percent on a shared
2-core machine: the median of 10 rounds still moved from run to run by about as much as the 5%
it is held to (±5%), the median of 40 by about half that."""
STREAM_ROUNDS = {True: 3, False: 7}
"""Rounds of the stream and raw PUSH/PULL figures, by ``--quick``: interleaved, medians."""
TRACED = "-traced"
"""The suffix of the endpoint the peer serves with tracing on."""
TENSOR_BYTES = 64 << 20


class Small(msgspec.Struct, array_like=True):
    """The small typed message of the round-trip, pipelined and stream figures."""

    step: int
    value: float
    tag: str


class Checksum(msgspec.Struct):
    sum: float
    numel: int


# Targets of the transport issue on a 2-core machine: (figure, target, direction).
TARGETS: dict[str, tuple[float, str]] = {
    "rtt_p50_us": (150.0, "<="),
    "rpc_calls_per_s": (25_000.0, ">="),
    "trace_overhead": (0.05, "<="),
    "stream_msgs_per_s": (200_000.0, ">="),
    "stream_over_raw": (0.4, ">="),
    "shm_over_memcpy": (0.4, ">="),
}


def _checksum(t: torch.Tensor, call: Any) -> Checksum:
    return Checksum(float(t.sum()), t.numel())


def _echo(payload: Any, call: Any) -> Any:
    return payload


# -- the peer process ---------------------------------------------------------------------


async def _peer_server(endpoint: str, run_id: str) -> None:
    """Serves on ``endpoint``, and with tracing on (into ``endpoint``'s folder) on
    ``endpoint + TRACED``."""
    stopped = asyncio.Event()
    options = ChannelOptions(run=run_id)
    server = Server(endpoint, name="bench", options=options, on_stop=stopped.set)
    server.add("echo", _echo, Small)
    server.add("checksum", _checksum, torch.Tensor)
    tracing.install(tracing.Recorder(_trace_dir(endpoint), "bench-server"))
    traced = Server(endpoint + TRACED, name="bench-traced", options=options)
    tracing.uninstall()
    traced.add("echo", _echo, Small)
    async with server, traced:
        print("READY", flush=True)
        await stopped.wait()


def _trace_dir(endpoint: str) -> str:
    return os.path.join(os.path.dirname(endpoint.removeprefix("ipc://")), "trace")


async def _peer_stream(endpoint: str, count: int) -> None:
    async with StreamSender(endpoint) as sender:
        msg = Small(0, 0.5, "x")
        for i in range(count):
            msg.step = i
            if not sender.send_nowait(msg):
                await sender.drained()
        await sender.drained()
        # The receiver closes the connection when it has everything; until then, stay.
        sys.stdin.readline()


async def _peer_tcp_servers(keys_dir: str, run_id: str) -> None:
    """A plain and a Curve server of the same methods on tcp; they stop when stdin closes."""
    options = ChannelOptions(run=run_id, shm=False)
    servers = []
    for curve in (False, load_keys(keys_dir)):
        server = Server("tcp://127.0.0.1:0", name="bench", options=options, curve=curve)
        server.add("echo", _echo, Small)
        server.add("checksum", _checksum, torch.Tensor)
        await server.start()
        servers.append(server)
    print("READY", *(server.endpoint for server in servers), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    for server in servers:
        await server.close()


def _peer_raw(endpoint: str, count: int, frame: bytes) -> None:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.connect(endpoint)
    for _ in range(count):
        sock.send(frame)
    sys.stdin.readline()
    sock.close(linger=0)


def _peer_raw_echo(endpoint: str) -> None:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    print("READY", flush=True)
    while True:
        frames = sock.recv_multipart()
        if frames[1] == b"":
            break
        sock.send_multipart(frames)
    sock.close(linger=0)


def _peer_main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    kind, endpoint, *rest = argv
    if kind == "server":
        run(_peer_server(endpoint, rest[0]))
    elif kind == "stream":
        run(_peer_stream(endpoint, int(rest[0])))
    elif kind == "raw":
        _peer_raw(endpoint, int(rest[0]), bytes.fromhex(rest[1]))
    elif kind == "raw-echo":
        _peer_raw_echo(endpoint)
    elif kind == "tcp":
        run(_peer_tcp_servers(endpoint, rest[0]))
    else:
        raise SystemExit(f"unknown peer kind {kind!r}")


@contextmanager
def _peer(*args: str) -> Iterator[subprocess.Popen[str]]:
    cmd = [sys.executable, "-m", "asyncrl.bench.transport", "--peer", *args]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the measuring process ----------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _rpc_figures(endpoint: str, run_id: str, calls: int, tensor_iters: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    msg = Small(1, 0.5, "x")
    async with Client(endpoint, options=ChannelOptions(run=run_id)) as client:
        for _ in range(500):
            await client.call("echo", msg, Small)
        times = await _round_trips(client, calls)
        out["rtt_p50_us"] = _pct(times, 0.50) * 1e6
        out["rtt_p99_us"] = _pct(times, 0.99) * 1e6
        out.update(await _traced_and_not(client, endpoint, run_id, calls * 2))

        out["tensor_shm_gbps"] = await _tensor_rate(client, tensor_iters)
        out["shm_used"] = client._use_shm
    # control=True: it stops the peer, as a supervisor would (a run's servers obey no other).
    stopper = Client(endpoint, options=ChannelOptions(run=run_id, shm=False), control=True)
    async with stopper as client:
        out["tensor_frames_gbps"] = await _tensor_rate(client, tensor_iters)
        client.send_stop()
    return out


async def _traced_and_not(
    client: Client, endpoint: str, run_id: str, total: int
) -> dict[str, float]:
    """Pipelined calls/s without tracing (``client``) and with it at both ends (a traced
    client of the traced server), round by round, the order flipped each round: the medians of
    each, and the cost of tracing as the median over rounds of 1 - the round's ratio (the two
    rates of a round ran back to back, under the same load on the machine, which the medians
    of a machine whose load drifts do not share). Also the CPU time this process spends per
    call, traced and not, which another load on the machine disturbs less."""
    tracing.install(tracing.Recorder(_trace_dir(endpoint), "bench-client"))
    traced = Client(endpoint + TRACED, options=ChannelOptions(run=run_id))
    tracing.uninstall()
    plain: list[float] = []
    with_trace: list[float] = []
    cpu: dict[bool, list[float]] = {False: [], True: []}  # this process's CPU us per call
    async with traced:
        for _ in range(50):
            await traced.call("echo", Small(1, 0.5, "x"), Small)
        for i in range(ROUNDS):
            pair = [(client, plain), (traced, with_trace)]
            for who, rates in pair if i % 2 == 0 else pair[::-1]:
                started = time.process_time()
                rates.append(await _pipelined_rate(who, total))
                cpu[who is traced].append((time.process_time() - started) / total * 1e6)
    costs = [1 - t / p for p, t in zip(plain, with_trace, strict=True)]
    return {
        "rpc_calls_per_s": statistics.median(plain),
        "rpc_calls_per_s_traced": statistics.median(with_trace),
        "trace_overhead": statistics.median(costs),
        "client_cpu_us_per_call": statistics.median(cpu[False]),
        "client_cpu_us_per_call_traced": statistics.median(cpu[True]),
    }


async def _round_trips(client: Client, calls: int) -> list[float]:
    """Seconds of each of ``calls`` sequential calls of ``echo``."""
    msg = Small(1, 0.5, "x")
    times = []
    clock = time.perf_counter
    for _ in range(calls):
        t0 = clock()
        await client.call("echo", msg, Small)
        times.append(clock() - t0)
    return times


async def _pipelined_rate(client: Client, total: int) -> float:
    """Calls/s of ``total`` calls of ``echo`` with ``WINDOW`` in flight."""
    msg = Small(1, 0.5, "x")
    t0 = time.perf_counter()
    window: set[asyncio.Future[Any]] = set()
    sent = 0
    while sent < total or window:
        while sent < total and len(window) < WINDOW:
            window.add(client.call_future("echo", msg, Small))
            sent += 1
        done, window = await asyncio.wait(window, return_when=asyncio.FIRST_COMPLETED)
        for fut in done:
            fut.result()
    return total / (time.perf_counter() - t0)


async def _curve_figures(
    endpoints: list[str], keys: CurveKeys, rounds: int, calls: int, tensor_iters: int
) -> dict[str, Any]:
    samples: dict[str, list[float]] = {}
    options = ChannelOptions(run="bench-curve", shm=False)
    async with (
        Client(endpoints[0], options=options, curve=False) as plain,
        Client(endpoints[1], options=options, curve=keys) as curve,
    ):
        clients = {"tcp": plain, "curve": curve}
        for client in clients.values():
            await _round_trips(client, 500)  # warm-up
        for i in range(rounds):
            for name in list(clients)[:: 1 if i % 2 == 0 else -1]:
                client = clients[name]
                rtt = _pct(await _round_trips(client, calls), 0.5) * 1e6
                samples.setdefault(f"{name}_rtt_p50_us", []).append(rtt)
                rate = await _pipelined_rate(client, calls * 4)
                samples.setdefault(f"{name}_calls_per_s", []).append(rate)
                gbps = await _tensor_rate(client, tensor_iters)
                samples.setdefault(f"{name}_tensor_gbps", []).append(gbps)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in samples.items()}
    out["curve_rtt_over_tcp"] = out["curve_rtt_p50_us"] / out["tcp_rtt_p50_us"]
    out["curve_rate_over_tcp"] = out["curve_calls_per_s"] / out["tcp_calls_per_s"]
    out["curve_tensor_over_tcp"] = out["curve_tensor_gbps"] / out["tcp_tensor_gbps"]
    out["rounds"] = rounds
    return out


def measure_curve(*, quick: bool = False) -> dict[str, Any]:
    """Plain tcp against tcp with Curve, interleaved round by round (see the module docstring).

    Returns medians over the rounds of ``{tcp,curve}_rtt_p50_us``, ``{tcp,curve}_calls_per_s``,
    ``{tcp,curve}_tensor_gbps``, and the ratios ``curve_*_over_tcp``.
    """
    from asyncrl.keys import generate

    torch.set_num_threads(1)
    rounds, calls, tensor_iters = (3, 500, 2) if quick else (7, 3000, 3)
    tmp = tempfile.mkdtemp(prefix="arl-bench-")
    try:
        generate(os.path.join(tmp, "keys"))
        with _peer("tcp", os.path.join(tmp, "keys"), f"bench{os.getpid()}") as proc:
            assert proc.stdout is not None
            ready, *endpoints = proc.stdout.readline().split()
            if ready != "READY":
                raise RuntimeError("the benchmark's server process did not start")
            keys = load_keys(os.path.join(tmp, "keys"))
            figures = run(_curve_figures(endpoints, keys, rounds, calls, tensor_iters))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    figures["loop"] = run(_loop_name())
    figures["cpus"] = os.cpu_count()
    return figures


def format_curve_table(f: dict[str, Any]) -> str:
    """The Curve figures beside plain tcp's, with the ratios."""
    lines = [
        f"asyncrl transport over tcp, plain and with Curve ({f['cpus']} CPUs, {f['loop']}, "
        f"medians of {f['rounds']} interleaved rounds)",
        "",
        f"{'figure':<28}{'tcp':>16}{'tcp + Curve':>16}{'ratio':>10}",
    ]
    for label, key, unit, ratio in [
        ("round trip p50", "rtt_p50_us", "us", "curve_rtt_over_tcp"),
        ("pipelined request/reply", "calls_per_s", "calls/s", "curve_rate_over_tcp"),
        ("64 MiB tensor, frames", "tensor_gbps", "GB/s", "curve_tensor_over_tcp"),
    ]:
        plain, curve = f[f"tcp_{key}"], f[f"curve_{key}"]
        fmt = "{:,.2f} " if unit == "GB/s" else "{:,.0f} "
        lines.append(
            f"{label:<28}{fmt.format(plain) + unit:>16}{fmt.format(curve) + unit:>16}"
            f"{f[ratio]:>9.2f}x"
        )
    return "\n".join(lines)


async def _tensor_rate(client: Client, iters: int) -> float:
    numel = TENSOR_BYTES // 4
    base = torch.arange(numel, dtype=torch.float32) % 1024
    src = torch.empty_like(base)
    rates = []
    for i in range(iters + 1):
        torch.add(base, float(i), out=src)  # written anew each iteration; not timed
        expected = float(src.sum())
        t0 = time.perf_counter()
        reply = await client.call("checksum", src, Checksum, timeout=60.0)
        elapsed = time.perf_counter() - t0
        if reply.numel != numel or abs(reply.sum - expected) > 1e-5 * abs(expected):
            raise RuntimeError(f"checksum mismatch: got {reply}, expected {expected}")
        if i > 0:  # the first iteration maps new segments and warms caches
            rates.append(TENSOR_BYTES / elapsed / 1e9)
    return statistics.median(rates)


def _memcpy_gbps(iters: int) -> float:
    src = torch.rand(TENSOR_BYTES // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    rates = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        rates.append(TENSOR_BYTES / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)


async def _stream_rate(endpoint: str, count: int) -> float:
    async with StreamReceiver(endpoint, Small, capacity=1 << 16) as receiver:
        with _peer("stream", receiver.endpoint, str(count)):
            got = 0
            first = await receiver.recv()
            got = 1
            t0 = time.perf_counter()
            last = first
            while got < count:
                batch = await receiver.recv_batch()
                got += len(batch)
                last = batch[-1]
            elapsed = time.perf_counter() - t0
            if last.step != count - 1:
                raise RuntimeError(f"stream lost messages: last step {last.step}")
    return (count - 1) / elapsed


def _raw_rate(endpoint: str, count: int, frame: bytes) -> float:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    sock.bind(endpoint)
    try:
        with _peer("raw", endpoint, str(count), frame.hex()):
            sock.recv()
            t0 = time.perf_counter()
            for _ in range(count - 1):
                sock.recv()
            elapsed = time.perf_counter() - t0
    finally:
        sock.close(linger=0)
    return (count - 1) / elapsed


def _stream_and_raw(tmp: str, messages: int, rounds: int, frame: bytes) -> dict[str, Any]:
    """The stream's and raw PUSH/PULL's msgs/s, round by round, the order flipped each round,
    so that a machine whose load drifts weighs on both alike: the median of each, and
    ``stream_over_raw``, the ratio of the two medians."""
    stream: list[float] = []
    raw: list[float] = []
    for i in range(rounds):
        pair = [("stream", stream), ("raw", raw)]
        for name, rates in pair if i % 2 == 0 else pair[::-1]:
            endpoint = f"ipc://{tmp}/{name}{i}"
            if name == "stream":
                rates.append(run(_stream_rate(endpoint, messages)))
            else:
                rates.append(_raw_rate(endpoint, messages, frame))
    ratio = statistics.median(stream) / statistics.median(raw)
    out = {"stream_msgs_per_s": statistics.median(stream), "stream_over_raw": ratio}
    return {**out, "raw_zmq_msgs_per_s": statistics.median(raw), "stream_rounds": rounds}


def _raw_rtt_us(endpoint: str, calls: int, frame: bytes) -> float:
    """Round trip of the same bytes over synchronous pyzmq DEALER/ROUTER, no asyncrl layer."""
    with _peer("raw-echo", endpoint) as proc:
        assert proc.stdout is not None
        proc.stdout.readline()
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(endpoint)
        try:
            for _ in range(500):
                sock.send(frame)
                sock.recv()
            times = []
            clock = time.perf_counter
            for _ in range(calls):
                t0 = clock()
                sock.send(frame)
                sock.recv()
                times.append(clock() - t0)
            sock.send(b"")
        finally:
            sock.close(linger=0)
    return _pct(times, 0.5) * 1e6


def measure(*, quick: bool = False) -> dict[str, Any]:
    """Run every measurement and return the figures (see the module docstring)."""
    torch.set_num_threads(1)
    calls = 2000 if quick else 10_000
    messages = 50_000 if quick else 200_000
    tensor_iters = 3 if quick else 10
    tmp = tempfile.mkdtemp(prefix="arl-bench-")
    run_id = f"bench{os.getpid()}"
    figures: dict[str, Any] = {}
    try:
        endpoint = f"ipc://{tmp}/server"
        with _peer("server", endpoint, run_id) as proc:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "READY":
                raise RuntimeError("the benchmark's server process did not start")
            figures.update(run(_rpc_figures(endpoint, run_id, calls, tensor_iters)))
        frame = Codec().encode(
            Envelope(PROTOCOL_VERSION, Kind.MESSAGE, 1, "", payload=Small(1, 0.5, "x"))
        )[0]
        figures.update(_stream_and_raw(tmp, messages, STREAM_ROUNDS[quick], frame))
        figures["raw_rtt_p50_us"] = _raw_rtt_us(f"ipc://{tmp}/rawrtt", calls, frame)
        figures["memcpy_gbps"] = _memcpy_gbps(max(tensor_iters, 10))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    figures["rtt_over_raw"] = figures["rtt_p50_us"] / figures["raw_rtt_p50_us"]
    figures["shm_over_memcpy"] = figures["tensor_shm_gbps"] / figures["memcpy_gbps"]
    figures["frames_over_memcpy"] = figures["tensor_frames_gbps"] / figures["memcpy_gbps"]
    figures["loop"] = run(_loop_name())
    figures["cpus"] = os.cpu_count()
    return figures


async def _loop_name() -> str:
    return loop_name()


def _meets(value: float, target: float, direction: str) -> bool:
    return value <= target if direction == "<=" else value >= target


def format_table(f: dict[str, Any]) -> str:
    """The figures as a table, with each baseline and ratio beside them."""
    rows = [
        ("round trip p50", f"{f['rtt_p50_us']:.0f} us", "rtt_p50_us"),
        ("round trip p99", f"{f['rtt_p99_us']:.0f} us", None),
        ("raw pyzmq DEALER/ROUTER p50", f"{f['raw_rtt_p50_us']:.0f} us", None),
        ("  round trip / raw", f"{f['rtt_over_raw']:.2f}x", None),
        ("pipelined request/reply", f"{f['rpc_calls_per_s']:,.0f} calls/s", "rpc_calls_per_s"),
        ("  the same, traced", f"{f['rpc_calls_per_s_traced']:,.0f} calls/s", None),
        ("  cost of tracing", f"{100 * f['trace_overhead']:.1f}%", "trace_overhead"),
        ("  client CPU per call", f"{f['client_cpu_us_per_call']:.1f} us", None),
        ("  the same, traced", f"{f['client_cpu_us_per_call_traced']:.1f} us", None),
        ("stream (after decode)", f"{f['stream_msgs_per_s']:,.0f} msgs/s", "stream_msgs_per_s"),
        ("raw pyzmq PUSH/PULL", f"{f['raw_zmq_msgs_per_s']:,.0f} msgs/s", None),
        ("  stream / raw", f"{f['stream_over_raw']:.2f}x", "stream_over_raw"),
        ("64 MiB tensor, frames", f"{f['tensor_frames_gbps']:.2f} GB/s", None),
        ("64 MiB tensor, shared memory", f"{f['tensor_shm_gbps']:.2f} GB/s", None),
        ("memcpy of the same tensor", f"{f['memcpy_gbps']:.2f} GB/s", None),
        ("  frames / memcpy", f"{f['frames_over_memcpy']:.2f}x", None),
        ("  shared memory / memcpy", f"{f['shm_over_memcpy']:.2f}x", "shm_over_memcpy"),
    ]
    lines = [f"asyncrl transport benchmark ({f['cpus']} CPUs, {f['loop']})", ""]
    lines.append(f"{'figure':<32}{'measured':>20}   target")
    for label, value, key in rows:
        target = ""
        if key is not None:
            bound, direction = TARGETS[key]
            verdict = "met" if _meets(f[key], bound, direction) else "MISSED"
            target = f"{direction} {bound:,.10g}  {verdict}"
        lines.append(f"{label:<32}{value:>20}   {target}")
    if not f.get("shm_used", True):
        lines.append("note: shared memory was refused at the handshake; the shm row used frames")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="asyncrl bench transport",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke test)")
    parser.add_argument(
        "--curve", action="store_true", help="plain tcp against tcp with Curve, interleaved"
    )
    args = parser.parse_args(argv)
    if args.curve:
        figures = measure_curve(quick=args.quick)
        print(json.dumps(figures) if args.json else format_curve_table(figures))
        return 0
    figures = measure(quick=args.quick)
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        _peer_main(sys.argv[2:])
    else:
        raise SystemExit(main())
