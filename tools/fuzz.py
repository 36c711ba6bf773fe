"""Fuzz every kind of asyncrl endpoint with random and mutated frames, and report what survived.

    .venv/bin/python tools/fuzz.py [--inputs 100000] [--seed 1] [--batch 500]

Targets, each in its own process so that its memory is measured alone:

- ``server``: a role's server (``tests/helpers/echo_server.py``), with the run's secret in its
  environment. The fuzzer presents it in a HANDSHAKE before each check, never as a controller,
  and fuzzes the handshake itself: no secret, the right one, a wrong one, oversized ones and
  ones of other types, and calls after a refused handshake. A bystander that handshook once at
  the start must be served after every batch as well;
- ``external``: the external role of ``examples/external_role/echo_role.py``, started without a
  run's secret (STOP is left out: on ipc and without a secret it obeys STOP from any peer, as
  asyncrl's own servers do);
- ``client``: a client's inbound path. A fake server (a raw ROUTER here) answers a ``Client`` in
  another process with the same garbage, the way a supervisor's or driver's client would hear it.

Inputs go in batches. After each batch the target must be alive and answer a valid call
correctly. The resident set size (``VmRSS`` of ``/proc/PID/status``) is read after the first
batch and at the end. The script prints the counts per target and exits 1 when a target died,
answered a check wrongly, or grew by more than ``--rss-limit-mib``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from asyncrl.transport import ChannelOptions, Client, run  # noqa: E402
from asyncrl.transport.codec import Codec  # noqa: E402
from asyncrl.transport.protocol import (  # noqa: E402
    PROTOCOL_VERSION,
    TENSOR_EXT,
    Envelope,
    ErrorInfo,
    Hello,
    Kind,
    TensorDesc,
)

CHECK_TIMEOUT_MS = 30_000
CHECK_IDS = 0x5EED << 32  # ids of checking requests; fuzzed ids are moved off them
SECRET_ENV = "ASYNCRL_CONTROL_SECRET"
SECRET = "the fuzzed server's run secret"
SECRETS: list[Any] = ["", SECRET, SECRET[:-1], "x" * 257, "x" * 70_000, 7, [SECRET], b"\x00"]
"""What fuzzed handshakes present: nothing, the secret, a wrong, oversized or garbage one."""

# -- inputs -------------------------------------------------------------------------------------

SEGMENTS = ["../../etc/passwd", "/etc/passwd", "..", "asyncrl.fuzz.1.0.1", "asyncrl.x.99999.0.1"]
LIBS = ["torch", "numpy", "jax", ""]
DTYPES = ["float32", "bfloat16", "<f4", ">f8", "|O", "V0", "(2,)<f4", "qint8", "float33", ""]
ODD_INTS = [0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]


def _ext(index: int) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(TENSOR_EXT, index.to_bytes(4, "little"))


class Generator:
    """Seeded random and mutated messages (lists of frames)."""

    def __init__(self, seed: int, *, stop: bool = True) -> None:
        self.rng = random.Random(seed)
        self.stop = stop
        self.codec = Codec()

    def value(self, depth: int = 0) -> Any:
        r = self.rng
        choice = r.randrange(9 if depth < 3 else 6)
        if choice == 0:
            return None
        if choice == 1:
            return r.random() < 0.5
        if choice == 2:
            return r.choice(ODD_INTS) if r.random() < 0.3 else r.randrange(-1000, 1000)
        if choice == 3:
            return r.choice([0.5, math.inf, -math.inf, math.nan, 1e308])
        if choice == 4:
            return "".join(r.choice("ab\u00e9\u4e2d") for _ in range(r.randrange(8)))
        if choice == 5:
            return r.randbytes(r.randrange(12))
        if choice in (6, 7):
            return [self.value(depth + 1) for _ in range(r.randrange(4))]
        return {str(r.randrange(5)): self.value(depth + 1) for _ in range(r.randrange(4))}

    def descriptor(self) -> TensorDesc:
        r = self.rng
        shape = [r.choice([0, 1, 3, 2**63, 2**64 - 1, -2]) for _ in range(r.randrange(4))]
        if r.random() < 0.05:
            shape = [1] * r.randrange(60, 80)
        return TensorDesc(
            r.choice(LIBS),
            r.choice(DTYPES),
            shape,
            r.choice([0, 4, 12, -1, 2**64 - 1]),
            r.choice([0, 1, 2, 3, -1]),
            data=r.randbytes(r.choice([0, 4, 12])),
            frame=r.choice([0, 1, 2, 99]),
            segment=r.choice(SEGMENTS),
            offset=r.choice([0, -1, 2**63]),
            slot=r.choice(ODD_INTS),
        )

    def valid(self) -> list[bytes]:
        r = self.rng
        kinds = [k for k in Kind if self.stop or k != Kind.STOP]
        kind = r.choice(kinds)
        payload: Any = self.value()
        tensors: list[TensorDesc] = []
        if kind == Kind.HANDSHAKE:
            payload = {"version": r.choice([1, 1, 1, 2]), "name": "fuzz", "shm": r.random() < 0.5}
            payload["secret"] = r.choice(SECRETS)
            if r.random() < 0.2:
                payload["control"] = r.choice(SECRETS)
        elif kind == Kind.RELEASE:
            payload = {"slots": [r.choice(ODD_INTS) for _ in range(r.randrange(4))]}
        elif kind == Kind.CREDIT:
            payload = {"slots": r.choice(ODD_INTS)}
        elif r.random() < 0.3:
            tensors = [self.descriptor() for _ in range(r.randrange(1, 3))]
            payload = [_ext(i) for i in range(len(tensors))]
        method = r.choice(["echo", "add", "upper", "whoami", "sum", "nope", "", "sleep", "block"])
        if method in ("sleep", "block"):
            method = "echo"  # they stall a server on purpose
        env = Envelope(
            PROTOCOL_VERSION,
            kind,
            r.choice(ODD_INTS) if r.random() < 0.2 else r.randrange(1, 1 << 20),
            method,
            r.choice([0.0, 0.0, 1.0, 1e12, math.nan]),
            r.randrange(3),
            r.randrange(3),
            "",
            payload,
        )
        try:
            frames = [bytes(f) for f in self.codec.encode(env)]
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
            return [b"\x92\x01\x07"]
        if tensors:
            raw = msgspec.msgpack.decode(frames[0])
            raw[9] = [list(msgspec.structs.astuple(d)) for d in tensors]
            frames = [msgspec.msgpack.encode(raw), *(r.randbytes(12) for _ in range(2))]
        return frames

    def mutate(self, frames: list[bytes]) -> list[bytes]:
        r = self.rng
        head = bytearray(frames[0])
        op = r.randrange(8)
        if op == 0 and head:
            for _ in range(r.randrange(1, 5)):
                head[r.randrange(len(head))] ^= r.randrange(1, 256)
        elif op == 1:
            head = head[: r.randrange(len(head) + 1)]
        elif op == 2:
            head += r.randbytes(r.randrange(1, 40))
        elif op == 3:  # a header that claims a huge length
            head = bytearray(
                b"\x9a\x01\x03\x01" + r.choice([b"\xdd\xff\xff\xff\xff", b"\xdb\x7f\xff\xff\xff"])
            )
        elif op == 4:  # deep nesting
            depth = r.choice([100, 1000, 5000])
            head = bytearray(b"\x99\x01\x03\x01\xa3add\x00\x00\x00\xa0" + b"\x91" * depth + b"\xc0")
        elif op == 5:
            return [bytes(head), *frames[1:], *(r.randbytes(r.randrange(64)) for _ in range(2))]
        elif op == 6:
            return [bytes(head)]
        else:
            try:
                raw = msgspec.msgpack.decode(bytes(head))
            except (msgspec.DecodeError, RecursionError):
                return [bytes(head), *frames[1:]]
            if isinstance(raw, list) and raw:
                raw[r.randrange(len(raw))] = self.value()
                head = bytearray(msgspec.msgpack.encode(raw))
        return [bytes(head), *frames[1:]]

    def message(self) -> list[bytes]:
        r = self.rng
        pick = r.random()
        if pick < 0.15:
            return [r.randbytes(r.randrange(200)) for _ in range(r.randrange(1, 4))]
        frames = self.valid()
        if pick < 0.35:
            return frames
        for _ in range(r.randrange(1, 3)):
            frames = self.mutate(frames)
        if not self.stop:
            frames = self._no_stop(frames)
        return frames

    def _no_stop(self, frames: list[bytes]) -> list[bytes]:
        """Replace a message that would decode as STOP (kind 9 at position 1) by a PING."""
        try:
            raw = msgspec.msgpack.decode(frames[0])
        except (msgspec.DecodeError, RecursionError):
            return frames
        if isinstance(raw, list) and len(raw) > 1 and raw[1] == Kind.STOP:
            return [b"\x92\x01\x07"]
        return frames


# -- measuring a process ------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


@dataclass
class Result:
    target: str
    inputs: int = 0
    checks: int = 0
    crashes: int = 0
    wrong: int = 0
    rss_before_kib: int = 0
    rss_after_kib: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"{self.target:9s} inputs {self.inputs:7d}  checks {self.checks:4d}  "
            f"crashes {self.crashes}  wrong answers {self.wrong}  "
            f"RSS {self.rss_before_kib / 1024:.1f} -> {self.rss_after_kib / 1024:.1f} MiB  "
            f"({self.seconds:.1f} s)"
        )


# -- targets that are servers -------------------------------------------------------------------


class RawDealer:
    """A DEALER that sends fuzz, then checks the server with one valid call."""

    def __init__(
        self,
        endpoint: str,
        check: Callable[[int], tuple[str, Any, Any]],
        *,
        secret: str = "",
        identity: bytes = b"fuzzer",
    ) -> None:
        self.secret = secret  # presented in a HANDSHAKE before each check
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(endpoint)
        self.codec = Codec()
        self.make_check = check
        self.checks = 0

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def check(self) -> bool:
        """Call the check method; True when the answer is right. Raises on silence."""
        self.checks += 1
        request_id = CHECK_IDS + self.checks
        method, payload, expected = self.make_check(self.checks)
        if self.secret:
            hello = Hello(PROTOCOL_VERSION, name="checker", secret=self.secret)
            env = Envelope(PROTOCOL_VERSION, Kind.HANDSHAKE, request_id + (1 << 23), payload=hello)
            self.sock.send_multipart(self.codec.encode(env))
        env = Envelope(PROTOCOL_VERSION, Kind.REQUEST, request_id, method, payload=payload)
        self.sock.send_multipart(self.codec.encode(env))
        while True:
            if not self.sock.poll(CHECK_TIMEOUT_MS):
                raise TimeoutError(f"no answer to check {self.checks}")
            frames = self.sock.recv_multipart()
            try:
                got = self.codec.decode_envelope(frames)
            except Exception:
                return False  # a server must never send what does not decode
            if got.id == request_id and got.kind in (Kind.REPLY, Kind.ERROR):
                if got.kind == Kind.ERROR:
                    info = self.codec.decode_payload(got, frames, ErrorInfo)
                    print(f"  check {self.checks} failed: {info}", file=sys.stderr)
                    return False
                return bool(self.codec.decode_payload(got, frames) == expected)


def fuzz_server_process(
    target: str,
    proc: subprocess.Popen[str],
    endpoint: str,
    check: Callable[[int], tuple[str, Any, Any]],
    gen: Generator,
    inputs: int,
    batch: int,
) -> Result:
    result = Result(target)
    t0 = time.monotonic()
    secret = SECRET if target == "server" else ""
    peer = RawDealer(endpoint, check, secret=secret)
    bystander = RawDealer(endpoint, check, secret=secret, identity=b"bystander")
    try:
        if not (peer.check() and bystander.check()):
            result.wrong += 1
        bystander.secret = ""  # admitted once: it is served without handshaking again
        while result.inputs < inputs:
            for _ in range(min(batch, inputs - result.inputs)):
                frames = gen.message()
                _move_off_check_ids(frames)
                peer.sock.send_multipart(frames)
                result.inputs += 1
            try:
                if not (peer.check() and bystander.check()):
                    result.wrong += 1
            except TimeoutError as exc:
                result.notes.append(str(exc))
                result.crashes += 1
                break
            if proc.poll() is not None:
                result.crashes += 1
                result.notes.append(f"exited with {proc.returncode}")
                break
            if result.rss_before_kib == 0:
                result.rss_before_kib = rss_kib(proc.pid)
        if proc.poll() is None:
            result.rss_after_kib = rss_kib(proc.pid)
        result.checks = peer.checks + bystander.checks
    finally:
        peer.close()
        bystander.close()
    result.seconds = time.monotonic() - t0
    return result


def _move_off_check_ids(frames: list[bytes]) -> None:
    try:
        raw = msgspec.msgpack.decode(frames[0])
    except (msgspec.DecodeError, RecursionError):
        return
    ids = range(CHECK_IDS, CHECK_IDS + (1 << 24))
    if isinstance(raw, list) and len(raw) > 2 and isinstance(raw[2], int) and raw[2] in ids:
        raw[2] = 1
        frames[0] = msgspec.msgpack.encode(raw)


def start_echo_server(run_dir: str) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, SECRET_ENV: SECRET}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.helpers.echo_server",
            f"ipc://{run_dir}/echo.sock",
            "--run",
            os.path.basename(run_dir),
            "--max-message-bytes",
            str(1 << 20),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"the echo server did not start: {line!r}")
    return proc, line.split()[1]


def start_external_role(run_dir: str) -> tuple[subprocess.Popen[str], str]:
    endpoint = f"ipc://{run_dir}/sockets/echo.0"
    env = {
        **os.environ,
        "ASYNCRL_ENDPOINT": endpoint,
        "ASYNCRL_RUN": os.path.basename(run_dir),
        "ASYNCRL_RUN_DIR": run_dir,
        "ASYNCRL_CONFIG": json.dumps({"suffix": "!"}),
    }
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "examples", "external_role", "echo_role.py")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line != "READY\n":
        proc.kill()
        raise RuntimeError(f"the external role did not start: {line!r}")
    return proc, endpoint


def stop_process(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.terminate()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out or ""


# -- a client's inbound path --------------------------------------------------------------------


async def _client_main(endpoint: str) -> None:
    """The client side of the ``client`` target: call ``check(n)`` until told to stop.

    Prints ``OK n`` after each correct answer and ``BAD n <what>`` after a wrong one, so the
    fuzzer (the fake server) sees both its progress and the client's verdicts.
    """
    options = ChannelOptions(shm=False, max_message_bytes=1 << 20)
    async with Client(endpoint, name="fuzzed", options=options) as client:
        print(f"READY {os.getpid()}", flush=True)
        n = 0
        while True:
            n += 1
            try:
                value = await client.call("check", n, timeout=60)
            except Exception as exc:
                print(f"BAD {n} {type(exc).__name__}: {exc}", flush=True)
                continue
            if value == "stop":
                print(f"STATS {dict(client.stats)}", flush=True)
                return
            print(f"OK {n}" if value == n + 1 else f"BAD {n} {value!r}", flush=True)


def fuzz_client(run_dir: str, gen: Generator, inputs: int, batch: int) -> Result:
    """Be a fake server: answer each ``check`` with a batch of garbage, then the right reply."""
    result = Result("client")
    t0 = time.monotonic()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 0)
    endpoint = f"ipc://{run_dir}/fake.sock"
    router.bind(endpoint)
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "_client", endpoint],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    codec = Codec()
    welcome = Hello(PROTOCOL_VERSION, name="fake", pid=os.getpid(), host="elsewhere")
    try:
        while True:
            if not router.poll(CHECK_TIMEOUT_MS):
                result.crashes += 1
                result.notes.append("the client stopped calling")
                break
            identity, *frames = router.recv_multipart()
            env = codec.decode_envelope(frames)
            if env.kind == Kind.HANDSHAKE:
                reply = Envelope(PROTOCOL_VERSION, Kind.WELCOME, env.id, payload=welcome)
                router.send_multipart([identity, *codec.encode(reply)])
                line = proc.stdout.readline()
                assert line.startswith("READY "), line
                continue
            if env.kind == Kind.PING:
                router.send_multipart([identity, *codec.encode(Envelope(1, Kind.PONG, env.id))])
                continue
            if env.kind != Kind.REQUEST:
                continue
            n = codec.decode_payload(env, frames)
            if n > 1:  # the verdict on the previous check
                line = proc.stdout.readline()
                if not line.startswith("OK "):
                    result.wrong += 1
                    result.notes.append(line.strip())
                result.checks += 1
            if result.inputs >= inputs:
                stop = Envelope(PROTOCOL_VERSION, Kind.REPLY, env.id, payload="stop")
                router.send_multipart([identity, *codec.encode(stop)])
                break
            for _ in range(min(batch, inputs - result.inputs)):
                garbage = gen.message()
                _avoid_id(garbage, env.id)
                router.send_multipart([identity, *garbage])
                result.inputs += 1
            answer = Envelope(PROTOCOL_VERSION, Kind.REPLY, env.id, payload=n + 1)
            router.send_multipart([identity, *codec.encode(answer)])
            if result.rss_before_kib == 0 and n > 1:
                result.rss_before_kib = rss_kib(proc.pid)
        if proc.poll() is None:
            result.rss_after_kib = rss_kib(proc.pid)
        try:
            # Told to stop, it prints its stats and exits by itself: wait for that rather than
            # terminate it while the "stop" reply is still on its way (a busy machine).
            out = proc.communicate(timeout=30)[0] or ""
        except subprocess.TimeoutExpired:
            out = stop_process(proc)
        if "STATS " not in out:
            result.crashes += 1
            result.notes.append(f"the client did not finish cleanly: exit {proc.returncode}")
        else:
            result.notes.append(out[out.index("STATS ") :].strip())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        router.close(linger=0)
        ctx.term()
    result.seconds = time.monotonic() - t0
    return result


def _avoid_id(frames: list[bytes], pending: int) -> None:
    """Garbage must not answer the pending check: a reply with its id would be a real answer."""
    try:
        raw = msgspec.msgpack.decode(frames[0])
    except (msgspec.DecodeError, RecursionError):
        return
    if isinstance(raw, list) and len(raw) > 2 and raw[2] == pending:
        raw[2] = pending + 1_000_000
        frames[0] = msgspec.msgpack.encode(raw)


# -- main ---------------------------------------------------------------------------------------


def _add_check(n: int) -> tuple[str, Any, Any]:
    return "add", {"a": n, "b": 1_000_000}, n + 1_000_000


def _upper_check(n: int) -> tuple[str, Any, Any]:
    return "upper", f"hi{n}", f"HI{n}!"


def fuzz_all(inputs: int, seed: int, batch: int, targets: list[str]) -> list[Result]:
    """Fuzz each of ``targets`` with ``inputs`` inputs; one Result per target."""
    per_target = inputs // len(targets) + (inputs % len(targets) > 0)
    results = []
    run_dir = tempfile.mkdtemp(prefix="arl-fz-")
    try:
        for i, target in enumerate(targets):
            if target == "client":
                results.append(fuzz_client(run_dir, Generator(seed + i), per_target, batch))
                continue
            if target == "server":
                proc, endpoint = start_echo_server(run_dir)
                check, gen = _add_check, Generator(seed + i)
            else:
                proc, endpoint = start_external_role(run_dir)
                check, gen = _upper_check, Generator(seed + i, stop=False)
            result = Result(target)
            try:
                result = fuzz_server_process(target, proc, endpoint, check, gen, per_target, batch)
            finally:
                results.append(result)
                out = stop_process(proc)
                if proc.returncode not in (0, None):
                    result.crashes += 1
                    result.notes.append(f"exit {proc.returncode}")
                result.notes.extend(line for line in out.splitlines() if line.startswith("STATS "))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return results


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "_client":
        run(_client_main(sys.argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=100_000, help="inputs in all, over targets")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--batch", type=int, default=500, help="inputs between two checks")
    parser.add_argument("--targets", default="server,external,client")
    parser.add_argument("--rss-limit-mib", type=float, default=64.0)
    args = parser.parse_args()
    results = fuzz_all(args.inputs, args.seed, args.batch, args.targets.split(","))
    failed = False
    for result in results:
        print(result.line())
        for note in result.notes:
            print(f"    {note}")
        grew = (result.rss_after_kib - result.rss_before_kib) / 1024
        if result.crashes or result.wrong or grew > args.rss_limit_mib:
            failed = True
    total = sum(r.inputs for r in results)
    print(f"total inputs {total}; {'FAILED' if failed else 'every target survived'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
