"""A client that knows only docs/protocol.md, ZeroMQ and MessagePack calls an asyncrl server.

The client's source is kept here as a string and runs in its own interpreter (``python -I -c``),
so nothing of asyncrl or msgspec can reach it: the test checks its imports with ``ast``, and the
client reports which of those modules it ended up with. It prints one JSON line of what it saw;
the tests compare that with exact values.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncrl.transport.control import SECRET_FILE_ENV, write_secret
from tests.conftest import ServerProcess, start_server_process

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

# The worked example of docs/protocol.md: request ``add`` {"a": 2, "b": 3} with id 7, and its reply.
EXAMPLE_REQUEST_HEX = "9a010307a3616464cb00000000000000000000a082a16102a1620390"
EXAMPLE_REPLY_HEX = "9a010407a0cb00000000000000000000a00590"

FOREIGN_CLIENT = r'''
import json
import os
import struct
import sys

import msgpack
import zmq

VERSION = 1
HANDSHAKE, WELCOME, REQUEST, REPLY, ERROR, CREDIT, PING, PONG = 1, 2, 3, 4, 5, 6, 7, 8
ANSWERS = (WELCOME, REPLY, ERROR, PONG)
TENSOR_EXT = 1
INLINE, FRAME = 0, 1
# Envelope positions: version, kind, id, method, deadline, attempt, incarnation, trace,
# payload, tensors. Trailing positions may be missing; these are their values then.
DEFAULTS = [None, None, 0, "", 0.0, 0, 0, "", None, []]
# TensorDesc positions: lib, dtype, shape, nbytes, where, data, frame, segment, offset, slot.
DESC_DEFAULTS = [None, None, None, None, None, b"", 0, "", 0, 0]
TIMEOUT_MS = 10_000


class Peer:
    def __init__(self, endpoint):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, b"foreign:1")
        self.sock.connect(endpoint)

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()

    def send(self, envelope, *frames):
        self.sock.send_multipart([msgpack.packb(envelope), *frames])

    def recv(self):
        if not self.sock.poll(TIMEOUT_MS):
            raise TimeoutError(f"no message from the server within {TIMEOUT_MS} ms")
        frames = self.sock.recv_multipart()
        env = msgpack.unpackb(frames[0], strict_map_key=False)
        return list(env) + DEFAULTS[len(env):], frames

    def answer(self, request_id):
        """The answer to ``request_id``; CREDIT, RELEASE and other answers are skipped."""
        while True:
            env, frames = self.recv()
            if env[1] in ANSWERS and env[2] == request_id:
                return env, frames

    def request(self, request_id, method, payload, tensors=(), frames=()):
        self.send([VERSION, REQUEST, request_id, method, 0.0, 0, 0, "", payload,
                   list(tensors)], *frames)
        return self.answer(request_id)


def ext(index):
    return msgpack.ExtType(TENSOR_EXT, index.to_bytes(4, "little"))


def float32_desc(values, where, frame=0):
    data = struct.pack(f"<{len(values)}f", *values)
    if where == INLINE:
        return ["torch", "float32", [len(values)], len(data), INLINE, data], data
    # Trailing descriptor fields (segment, offset, slot) left out: they take their defaults.
    return ["torch", "float32", [len(values)], len(data), FRAME, b"", frame], data


def rebuild(value, env, frames):
    """Replace each tensor reference in a payload with [lib, dtype, shape, where, values]."""
    if isinstance(value, msgpack.ExtType) and value.code == TENSOR_EXT:
        desc = env[9][int.from_bytes(value.data, "little")]
        desc = desc + DESC_DEFAULTS[len(desc):]
        lib, dtype, shape, nbytes, where, data, frame = desc[:7]
        raw = data if where == INLINE else frames[frame]
        assert dtype in ("float32", "<f4") and len(raw) == nbytes, (dtype, nbytes, len(raw))
        return [lib, dtype, shape, where, list(struct.unpack(f"<{nbytes // 4}f", raw))]
    if isinstance(value, list):
        return [rebuild(v, env, frames) for v in value]
    if isinstance(value, dict):
        return {k: rebuild(v, env, frames) for k, v in value.items()}
    return value


def error(env):
    return {"kind": env[1], "id": env[2], "payload": env[8]}


def hello(**keys):
    """A Hello; inside a run, with the run's secret from the file ASYNCRL_SECRET_FILE names."""
    path = os.environ.get("ASYNCRL_SECRET_FILE")
    if path:
        with open(path) as f:
            keys["secret"] = f.read().strip()
    return {"version": VERSION, **keys}


def calls(peer):
    out = {}
    peer.send([VERSION, HANDSHAKE, 1, "", 0.0, 0, 0, "", hello(name="foreign")])
    env, _ = peer.answer(1)
    out["welcome"] = {"kind": env[1], "id": env[2], "payload": env[8]}

    example = msgpack.packb([VERSION, REQUEST, 7, "add", 0.0, 0, 0, "", {"a": 2, "b": 3}, []])
    peer.sock.send(example)
    env, frames = peer.answer(7)
    out["add"] = {"kind": env[1], "id": env[2], "payload": env[8],
                  "sent": example.hex(), "received": frames[0].hex()}

    nested = {"s": "text", "n": [1, -2, 3.5, None, True], "m": {"k": [[], {}]}, "b": b"\x00\xff"}
    env, _ = peer.request(8, "echo", nested)
    out["echo"] = {"kind": env[1], "id": env[2], "same": env[8] == nested}

    values = [0.25 * i for i in range(1000)]
    desc, data = float32_desc(values, FRAME, frame=1)
    env, _ = peer.request(9, "sum", ext(0), [desc], [data])
    out["sum_frame"] = {"kind": env[1], "id": env[2], "payload": env[8]}

    desc, _ = float32_desc([1.5, 2.5, -1.0], INLINE)
    env, _ = peer.request(10, "sum", ext(0), [desc])
    out["sum_inline"] = {"kind": env[1], "id": env[2], "payload": env[8]}

    small, _ = float32_desc([1.0, 2.0], INLINE)
    big, data = float32_desc([0.5] * 300, FRAME, frame=1)
    env, frames = peer.request(11, "echo", {"small": ext(0), "big": [ext(1)]}, [small, big],
                               [data])
    out["echo_tensors"] = {"kind": env[1], "id": env[2], "frames": len(frames),
                           "payload": rebuild(env[8], env, frames)}

    env, _ = peer.request(12, "nope", None)
    out["unknown_method"] = error(env)

    peer.send([VERSION, PING, 13])  # a short envelope: the other positions take defaults
    env, _ = peer.answer(13)
    out["ping"] = {"kind": env[1], "id": env[2]}

    peer.send([VERSION, HANDSHAKE, 14, "", 0.0, 0, 0, "", {"version": 99, "name": "foreign"}])
    out["hello_99"] = error(peer.answer(14)[0])

    peer.send([99, HANDSHAKE, 15, "", 0.0, 0, 0, "", {"version": 99, "name": "foreign"}])
    out["envelope_99"] = error(peer.answer(15)[0])
    return out


def stranger(peer):
    """Without the run's secret: a call, then a handshake, then the call again."""
    out = {}
    peer.send([VERSION, REQUEST, 1, "add", 0.0, 0, 0, "", {"a": 2, "b": 3}, []])
    out["call"] = error(peer.answer(1)[0])
    peer.send([VERSION, HANDSHAKE, 2, "", 0.0, 0, 0, "", hello(name="stranger")])
    out["handshake"] = error(peer.answer(2)[0])
    peer.send([VERSION, REQUEST, 3, "add", 0.0, 0, 0, "", {"a": 2, "b": 3}, []])
    out["call_again"] = error(peer.answer(3)[0])
    return out


def pipeline(peer, count):
    peer.send([VERSION, HANDSHAKE, 1, "", 0.0, 0, 0, "", hello()])
    welcome, _ = peer.answer(1)
    ids = list(range(100, 100 + count))
    for i in ids:  # every request goes out before any answer is read
        peer.send([VERSION, REQUEST, i, "add", 0.0, 0, 0, "", {"a": i, "b": 2 * i}, []])
    answers = {}
    while len(answers) < count:
        env, _ = peer.recv()
        if env[1] in (REPLY, ERROR):
            assert env[2] not in answers, f"two answers to request {env[2]}"
            answers[env[2]] = [env[1], env[8]]
    return {"welcome_kind": welcome[1], "answers": answers}


def main():
    endpoint, scenario = sys.argv[1], sys.argv[2]
    peer = Peer(endpoint)
    try:
        if scenario == "calls":
            out = calls(peer)
        elif scenario == "stranger":
            out = stranger(peer)
        else:
            out = pipeline(peer, int(scenario))
    finally:
        peer.close()
    out["modules"] = sorted(m for m in sys.modules
                            if m.partition(".")[0] in ("asyncrl", "msgspec", "torch"))
    print(json.dumps(out))


main()
'''


def _run_foreign(
    endpoint: str, scenario: str, cwd: Path, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run the foreign client in a fresh interpreter; return what it printed."""
    proc = subprocess.run(
        [sys.executable, "-I", "-c", FOREIGN_CLIENT, endpoint, scenario],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"foreign client failed:\n{proc.stderr}"
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.pop("modules") == []
    return out


def test_foreign_client_imports_only_zmq_msgpack_and_stdlib() -> None:
    imported = set()
    for node in ast.walk(ast.parse(FOREIGN_CLIENT)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").partition(".")[0])
    assert imported == {"json", "os", "struct", "sys", "msgpack", "zmq"}
    assert "__import__" not in FOREIGN_CLIENT and "importlib" not in FOREIGN_CLIENT


def test_worked_example_is_the_one_in_the_protocol_doc() -> None:
    doc = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    assert EXAMPLE_REQUEST_HEX in doc
    assert EXAMPLE_REPLY_HEX in doc


def test_foreign_client_calls_an_asyncrl_server(
    server_process: ServerProcess,
    run_dir: str,
    tmp_path: Path,
) -> None:
    out = _run_foreign(server_process.endpoint, "calls", tmp_path)

    welcome = out["welcome"]
    assert (welcome["kind"], welcome["id"]) == (2, 1)
    hello = welcome["payload"]
    # incarnation 0 is the default, so the server leaves it out (omit_defaults).
    assert set(hello) == {"version", "name", "pid", "host", "shm", "run"}
    assert hello["version"] == 1
    assert hello["name"] == "echo"
    assert hello["pid"] == server_process.pid
    assert hello["run"] == os.path.basename(run_dir)
    assert hello["shm"] is True
    assert isinstance(hello["host"], str) and hello["host"]

    add = out["add"]
    assert (add["kind"], add["id"], add["payload"]) == (4, 7, 5)
    assert add["sent"] == EXAMPLE_REQUEST_HEX
    assert add["received"] == EXAMPLE_REPLY_HEX

    assert out["echo"] == {"kind": 4, "id": 8, "same": True}
    assert out["sum_frame"] == {"kind": 4, "id": 9, "payload": 0.25 * sum(range(1000))}
    assert out["sum_inline"] == {"kind": 4, "id": 10, "payload": 3.0}

    echoed = out["echo_tensors"]
    assert (echoed["kind"], echoed["id"], echoed["frames"]) == (4, 11, 2)
    assert echoed["payload"] == {
        "small": ["torch", "float32", [2], 0, [1.0, 2.0]],
        "big": [["torch", "float32", [300], 1, [0.5] * 300]],
    }

    assert out["unknown_method"] == {
        "kind": 5,
        "id": 12,
        "payload": {
            "code": "unknown_method",
            "message": "echo has no method 'nope'; it serves: add, block, echo, fail, sleep, sum",
        },
    }
    assert out["ping"] == {"kind": 8, "id": 13}

    assert out["hello_99"] == {
        "kind": 5,
        "id": 14,
        "payload": {
            "code": "protocol_version",
            "message": "protocol version mismatch: this side speaks version 1, the peer foreign "
            "speaks version 99; run the same asyncrl protocol version on both ends",
        },
    }
    assert out["envelope_99"] == {
        "kind": 5,
        "id": 15,
        "payload": {
            "code": "protocol_version",
            "message": "protocol version mismatch: this side speaks version 1, the peer speaks "
            "version 99; run the same asyncrl protocol version on both ends",
        },
    }


def test_foreign_client_pipelines_requests_and_matches_replies_by_id(
    server_process: ServerProcess,
    tmp_path: Path,
) -> None:
    count = 200
    out = _run_foreign(server_process.endpoint, str(count), tmp_path)
    assert out["welcome_kind"] == 2
    expected = {str(i): [4, 3 * i] for i in range(100, 100 + count)}  # JSON keys are strings
    assert out["answers"] == expected


def test_a_foreign_client_of_a_run_presents_the_secret_from_its_file(
    run_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside a run the server serves only a peer that presented the run's secret: the foreign
    client reads it from the file ASYNCRL_SECRET_FILE names and is served; without it, its call
    and its handshake are refused and nothing is served."""
    secret = os.path.join(run_dir, "secret")
    write_secret(secret, "0123456789abcdef0123456789abcdef")
    monkeypatch.setenv(SECRET_FILE_ENV, secret)
    server = start_server_process(f"ipc://{run_dir}/echo.sock", "--run", "r")
    try:
        out = _run_foreign(server.endpoint, "calls", tmp_path, dict(os.environ))
        assert (out["welcome"]["kind"], out["welcome"]["id"]) == (2, 1)
        assert "secret" not in out["welcome"]["payload"]
        assert out["add"]["payload"] == 5 and out["echo"]["same"] is True
        assert out["ping"] == {"kind": 8, "id": 13}
        outside = {k: v for k, v in os.environ.items() if k != SECRET_FILE_ENV}
        refused = _run_foreign(server.endpoint, "stranger", tmp_path, outside)
    finally:
        server.stop()
    how = (
        "run it inside the run (every process the node agent starts has ASYNCRL_SECRET_FILE), "
        "or point it at the run's secret file: ASYNCRL_SECRET_FILE=RUN_DIR/secret"
    )
    unadmitted = (
        "REQUEST refused: echo serves only the processes of its run, and this client has not "
        f"presented the run's secret in a HANDSHAKE (Hello.secret) on this connection; {how}"
    )
    code = "unauthorized"
    assert refused == {
        "call": {"kind": 5, "id": 1, "payload": {"code": code, "message": unadmitted}},
        "handshake": {
            "kind": 5,
            "id": 2,
            "payload": {
                "code": code,
                "message": "echo serves only the processes of its run, and the HANDSHAKE of "
                f"stranger presented no secret (Hello.secret); {how}",
            },
        },
        "call_again": {"kind": 5, "id": 3, "payload": {"code": code, "message": unadmitted}},
    }
