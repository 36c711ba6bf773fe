"""A server and a client facing hostile peers: control messages, socket permissions, socket files,
shared memory, libraries a peer names, log volume, restarts that block, and counts a peer sets."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from asyncrl.transport import (
    ChannelOptions,
    Client,
    DecodeError,
    LocalRegistry,
    PeerEvent,
    RemoteError,
    Server,
    TensorDescriptorError,
    TransportError,
    run,
)
from asyncrl.transport.codec import Codec
from asyncrl.transport.control import CONTROL_SECRET_ENV
from asyncrl.transport.protocol import (
    MAX_RELEASE_SLOTS,
    MAX_TENSORS,
    PROTOCOL_VERSION,
    TENSOR_EXT,
    Envelope,
    ErrorCode,
    ErrorInfo,
    Hello,
    Kind,
    RawEnvelope,
    Release,
    TensorDesc,
    Where,
)
from asyncrl.transport.ratelog import RateLimitedLog
from asyncrl.transport.shm import ShmPool, ShmReader, host_id
from tests.conftest import ROOT, start_server_process

ANSWER_TIMEOUT_MS = 10_000
SECRET = "5ecret-of-the-run"


# -- a raw peer, run in a worker thread so that an in-process server keeps its loop ---------


Answer = tuple[RawEnvelope, Any]


def _exchange(
    endpoint: str,
    messages: list[list[bytes]],
    answers: int,
    identity: bytes = b"raw",
    timeout_ms: int = ANSWER_TIMEOUT_MS,
) -> list[Answer]:
    """Send ``messages`` from a DEALER and return the first ``answers`` answers, decoded."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.connect(endpoint)
    codec = Codec()
    out: list[Answer] = []
    try:
        for frames in messages:
            sock.send_multipart(frames)
        while len(out) < answers:
            if not sock.poll(timeout_ms):
                raise AssertionError(f"got {len(out)} of {answers} answers: {out}")
            frames = sock.recv_multipart()
            env = codec.decode_envelope(frames)
            if env.kind == Kind.ERROR:
                out.append((env, codec.decode_payload(env, frames, ErrorInfo)))
            elif env.kind in (Kind.REPLY, Kind.WELCOME):
                out.append((env, codec.decode_payload(env, frames)))
            elif env.kind != Kind.CREDIT:
                out.append((env, None))
    finally:
        sock.close(linger=0)
        ctx.term()
    return out


async def exchange(
    endpoint: str, messages: list[list[bytes]], answers: int, identity: bytes = b"raw"
) -> list[Answer]:
    return await asyncio.to_thread(_exchange, endpoint, messages, answers, identity)


def _env(kind: int, request_id: int = 0, method: str = "", payload: Any = None) -> list[bytes]:
    return [
        msgspec.msgpack.encode(
            Envelope(PROTOCOL_VERSION, kind, request_id, method, payload=payload)
        )
    ]


def _add(payload: list[int], call: Any) -> int:
    return payload[0] + payload[1]


def _server(endpoint: str, **kw: Any) -> Server:
    server = Server(endpoint, name="hard", options=ChannelOptions(run="hard", shm=False), **kw)
    server.add("add", _add, list[int])
    return server


# -- 1. control messages only from the holder of the run's secret ------------------------------
# (calls, from a holder of the secret only: tests/transport/test_authentication.py)


def test_stop_is_obeyed_only_from_a_client_that_presented_the_secret(run_dir: str) -> None:
    async def main() -> None:
        stopped = asyncio.Event()
        server = _server(f"ipc://{run_dir}/s", on_stop=stopped.set, secret=SECRET)
        await server.start()
        # An ordinary client of the run: its calls are served, its STOP is not obeyed.
        async with Client(server.endpoint, options=ChannelOptions(shm=False), secret=SECRET) as c:
            c.send_stop()
            assert await c.call("add", [2, 3], int) == 5  # FIFO: the STOP was read
            assert c.stats["orphan_errors"] == 1
        hello = Hello(PROTOCOL_VERSION, secret=SECRET)
        answers = await exchange(
            server.endpoint, [_env(Kind.HANDSHAKE, 1, payload=hello), _env(Kind.STOP, 2)], 2
        )
        assert [(env.kind, env.id) for env, _ in answers] == [(Kind.WELCOME, 1), (Kind.ERROR, 2)]
        info = answers[1][1]
        assert info.code == ErrorCode.UNAUTHORIZED
        assert info.message == (
            "STOP refused: control messages are accepted only from a client that presented the "
            "run's secret under Hello.control in its HANDSHAKE (the supervisor's); create the "
            "client with control=True in a process that has the run's secret "
            "(ASYNCRL_SECRET_FILE)"
        )
        # A client with the wrong secret is refused at the handshake, loudly.
        wrong = Client(server.endpoint, control=True, secret="guess")
        with pytest.raises(RemoteError) as err:
            await wrong.connect(timeout=5)
        await wrong.close()
        assert err.value.code == ErrorCode.UNAUTHORIZED
        assert "control secret presented by client is not hard's" in str(err.value)
        assert not stopped.is_set()
        assert server.stats["control_refused"] == 3
        assert server.stats["stops"] == 0
        # The supervisor's client holds the secret: its STOP is obeyed.
        async with Client(server.endpoint, control=True, secret=SECRET) as boss:
            assert await boss.call("add", [1, 1], int) == 2
            boss.send_stop()
            await asyncio.wait_for(stopped.wait(), 5)
        assert server.stats["stops"] == 1
        assert server.stats["control_handshakes"] == 1
        await server.close()

    run(main())


def test_the_secret_may_still_come_from_the_environment_itself(
    run_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CONTROL_SECRET_ENV, SECRET)

    async def main() -> None:
        stopped = asyncio.Event()
        server = _server(f"ipc://{run_dir}/s", on_stop=stopped.set)
        await server.start()
        # A peer that knows the secret but not the ``secret`` key: its ``control`` admits it.
        hello = _env(Kind.HANDSHAKE, 1, payload={"version": 1, "control": SECRET})
        answers = await exchange(server.endpoint, [hello, _env(Kind.REQUEST, 2, "add", [4, 5])], 2)
        assert [(env.kind, env.id, value) for env, value in answers][1] == (Kind.REPLY, 2, 9)
        assert answers[0][0].kind == Kind.WELCOME and "control" not in answers[0][1]
        async with Client(server.endpoint, control=True) as boss:
            boss.send_stop()
            await asyncio.wait_for(stopped.wait(), 5)
        await server.close()

    run(main())


def test_without_a_secret_stop_is_refused_on_tcp_and_obeyed_on_ipc(run_dir: str) -> None:
    async def main() -> None:
        stopped = asyncio.Event()
        tcp = _server("tcp://127.0.0.1:0", on_stop=stopped.set)
        await tcp.start()
        answers = await exchange(tcp.endpoint, [_env(Kind.STOP, 4), _env(Kind.PING, 5)], 2)
        info = answers[0][1]
        assert (answers[0][0].id, info.code) == (4, ErrorCode.UNAUTHORIZED)
        assert info.message.startswith(
            "STOP refused: hard has no secret (neither ASYNCRL_SECRET_FILE nor "
            "ASYNCRL_CONTROL_SECRET is set) and "
            f"listens on {tcp.endpoint}, where any local user can connect"
        )
        assert not stopped.is_set()
        await tcp.close()
        ipc = _server(f"ipc://{run_dir}/s", on_stop=stopped.set)
        await ipc.start()
        async with Client(ipc.endpoint) as client:
            client.send_stop()
            await asyncio.wait_for(stopped.wait(), 5)
        await ipc.close()

    run(main())


@pytest.mark.slow
def test_a_role_process_ignores_a_stop_without_the_secret(
    run_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CONTROL_SECRET_ENV, SECRET)
    server = start_server_process(f"ipc://{run_dir}/echo.sock", "--no-shm")
    try:
        hello = _env(Kind.HANDSHAKE, 1, payload={"version": 1, "secret": SECRET})
        request = _env(Kind.REQUEST, 9, "add", {"a": 1, "b": 2})
        answers = _exchange(server.endpoint, [hello, [b"\x92\x01\x09"], request], 3)
        kinds = [(env.kind, env.id) for env, _ in answers]
        assert kinds == [(Kind.WELCOME, 1), (Kind.ERROR, 0), (Kind.REPLY, 9)]
        assert server.proc.poll() is None

        async def stop() -> None:
            async with Client(server.endpoint, control=True) as boss:
                boss.send_stop()
                await asyncio.to_thread(server.proc.wait, 10)

        run(stop())
        out = server.stop()
        assert server.proc.returncode == 0
        assert "'stops': 1" in out and "'control_refused': 1" in out
    finally:
        if server.proc.poll() is None:
            server.stop(signal.SIGKILL)


# -- 2 and 3. ipc sockets are private, and their files go with their server --------------------


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_ipc_sockets_are_private_whatever_the_umask(run_dir: str) -> None:
    async def main() -> None:
        with umask(0):
            server = _server(f"ipc://{run_dir}/a/b/s")
            await server.start()
            registry = LocalRegistry(os.path.join(run_dir, "run"))
        assert _mode(os.path.join(run_dir, "a")) == 0o700
        assert _mode(os.path.join(run_dir, "a", "b")) == 0o700
        assert _mode(os.path.join(run_dir, "a", "b", "s")) & 0o077 == 0
        assert _mode(registry.socket_dir) == 0o700
        await server.close()

    run(main())


def test_an_existing_socket_directory_is_made_private(run_dir: str) -> None:
    sockets = os.path.join(run_dir, "run", "sockets")
    with umask(0):
        os.makedirs(sockets, mode=0o777)
    assert _mode(sockets) == 0o777
    LocalRegistry(os.path.join(run_dir, "run"))
    assert _mode(sockets) == 0o700


def test_a_socket_directory_planted_as_a_symlink_is_refused(run_dir: str) -> None:
    os.makedirs(os.path.join(run_dir, "elsewhere"))
    os.makedirs(os.path.join(run_dir, "run"))
    os.symlink(os.path.join(run_dir, "elsewhere"), os.path.join(run_dir, "run", "sockets"))
    with pytest.raises(TransportError, match="is a symlink or not a directory"):
        LocalRegistry(os.path.join(run_dir, "run"))


def test_a_closed_server_unlinks_its_socket_file_unless_rebound(run_dir: str) -> None:
    async def main() -> None:
        path = os.path.join(run_dir, "s")
        first = _server(f"ipc://{path}")
        await first.start()
        assert os.path.exists(path)
        await first.close()
        assert not os.path.exists(path)

        old = _server(f"ipc://{path}")
        await old.start()
        new = _server(f"ipc://{path}")  # a restarted incarnation rebinds the same path
        await new.start()
        await old.close()
        assert os.path.exists(path)  # the new incarnation's file stays
        async with Client(new.endpoint) as client:
            assert await client.call("add", [1, 2], int) == 3
        await new.close()
        assert not os.path.exists(path)

    run(main())


# -- 4. shared memory: no links followed, nothing from peers that did not handshake ------------


def test_the_reader_does_not_follow_a_symlink_or_map_a_fifo(tmp_path: Any) -> None:
    shm_dir = str(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"private key material")
    os.symlink(secret, os.path.join(shm_dir, "asyncrl.r.1.0.1"))
    os.mkfifo(os.path.join(shm_dir, "asyncrl.r.1.0.2"))
    reader = ShmReader(shm_dir)
    with pytest.raises(OSError) as err:
        reader.view("asyncrl.r.1.0.1", 0, 4)
    assert err.value.errno == 40  # ELOOP: a symlink, not followed
    with pytest.raises(ValueError, match=r"asyncrl\.r\.1\.0\.2 is not a regular file"):
        reader.view("asyncrl.r.1.0.2", 0, 4)
    reader.close()


def _shm_request(segment: str, slot: int, request_id: int) -> list[bytes]:
    desc = TensorDesc("numpy", "|u1", [4], 4, Where.SHM, segment=segment, slot=slot)
    env = Envelope(
        PROTOCOL_VERSION,
        Kind.REQUEST,
        request_id,
        "sum",
        payload=msgspec.msgpack.Ext(TENSOR_EXT, bytes(4)),
        tensors=[desc],
    )
    return [msgspec.msgpack.encode(env)]


def test_shared_memory_is_refused_from_a_peer_that_did_not_handshake(run_dir: str) -> None:
    async def main() -> None:
        server = Server(f"ipc://{run_dir}/s", options=ChannelOptions(run="hardshm"))
        server.add("sum", lambda a, call: int(a.sum()), np.ndarray)
        await server.start()
        pool = ShmPool("hardshm-peer")
        slot = pool.acquire(4)
        assert slot is not None
        slot.array[:4] = [1, 2, 3, 4]
        try:
            answers = await exchange(server.endpoint, [_shm_request(slot.segment, slot.id, 6)], 1)
            [(env, info)] = answers
            assert (env.kind, env.id, info.code) == (Kind.ERROR, 6, ErrorCode.BAD_TENSOR)
            assert info.message == (
                "tensor 0 (numpy |u1 [4]): sent through shared memory by a peer that has not "
                "handshaken from this host; send HANDSHAKE (with shm and this host's id) first, "
                "or send the bytes inline or as a frame"
            )
            assert (server.stats["shm_refused"], server.stats["bad_tensor"]) == (1, 1)
            # After a handshake from this host the same descriptor is read.
            hello = _env(Kind.HANDSHAKE, 1, payload=Hello(1, host=host_id(), shm=True))
            answers = await exchange(
                server.endpoint, [hello, _shm_request(slot.segment, slot.id, 7)], 2, b"peer2"
            )
            assert [(env.kind, value) for env, value in answers][1] == (Kind.REPLY, 10)
        finally:
            pool.close()
            await server.close()

    run(main())


# -- 5. no library is imported because a peer asked ---------------------------------------------

NO_TORCH_SCRIPT = r"""
import asyncio, json, sys, time
import msgspec, zmq
from asyncrl.transport import ChannelOptions, Server, run
from asyncrl.transport.codec import Codec
from asyncrl.transport.protocol import *

async def main():
    server = Server("ipc://" + sys.argv[1] + "/nt", options=ChannelOptions(shm=False))
    server.add("echo", lambda p, call: p)
    await server.start()
    desc = TensorDesc("torch", "float32", [1], 4, Where.INLINE, data=bytes(4))
    env = Envelope(PROTOCOL_VERSION, Kind.REQUEST, 3, "echo",
                   payload=msgspec.msgpack.Ext(TENSOR_EXT, bytes(4)), tensors=[desc])

    def ask():
        ctx = zmq.Context(); sock = ctx.socket(zmq.DEALER); sock.connect(server.endpoint)
        t0 = time.perf_counter()
        sock.send(msgspec.msgpack.encode(env))
        assert sock.poll(10000)
        frames = sock.recv_multipart()
        elapsed = time.perf_counter() - t0
        sock.close(linger=0); ctx.term()
        codec = Codec()
        got = codec.decode_envelope(frames)
        return elapsed, msgspec.to_builtins(codec.decode_payload(got, frames, ErrorInfo))

    elapsed, info = await asyncio.to_thread(ask)
    await server.close()
    print(json.dumps({"elapsed": elapsed, "info": info, "stats": dict(server.stats),
                      "torch": "torch" in sys.modules}))

run(main())
"""


def test_a_torch_descriptor_does_not_import_torch(run_dir: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", NO_TORCH_SCRIPT, run_dir],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result = json.loads(out.stdout)
    assert result["torch"] is False
    assert result["info"] == {
        "code": "bad_tensor",
        "message": "tensor 0 (torch float32 [1]): library 'torch' is not imported in this "
        "process, and a receiver does not import a library because a peer asked; send a numpy "
        "array, or import torch in the receiving process before it serves",
    }
    assert result["stats"]["library_not_imported"] == 1
    assert result["elapsed"] < 0.5  # importing torch takes a second or more


# -- 6. bad input is counted exactly and logged sparingly ---------------------------------------


def test_rate_limited_log_keeps_the_first_then_summarises() -> None:
    now = [0.0]
    records: list[str] = []

    class Sink(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("tests.ratelog")
    logger.propagate = False
    sink = Sink()
    logger.addHandler(sink)
    try:
        limited = RateLimitedLog(logger, "server x", first=2, interval_s=10, clock=lambda: now[0])
        for i in range(50):
            limited.warning("decode_error", "peer-a" if i % 2 else "peer-b", "bad %d", i)
        now[0] = 10.5
        limited.warning("decode_error", "peer-a", "bad %d", 50)
        limited.warning("decode_error", "peer-a", "bad %d", 51)  # within the next interval
        limited.flush(force=True)
    finally:
        logger.removeHandler(sink)
    assert records == [
        "bad 0",
        "bad 1",
        "server x: further decode_error problems are summarised at most once every 10 s",
        "server x: suppressed 49 more decode_error problems in the last 10.5 s, from "
        "peer-a (25), peer-b (24)",
        "server x: suppressed 1 more decode_error problems in the last 0.0 s, from peer-a (1)",
    ]


def test_a_flood_of_garbage_is_counted_exactly_and_logged_briefly(
    run_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        server = _server(f"ipc://{run_dir}/s")
        await server.start()
        garbage = [[b"\xc1garbage %d" % i] for i in range(500)]
        answers = await exchange(server.endpoint, [*garbage, _env(Kind.PING, 1)], 501)
        assert answers[-1][0].kind == Kind.PONG
        await server.close()
        assert server.stats["decode_error"] == 500

    with caplog.at_level(logging.WARNING, logger="asyncrl.transport.server"):
        run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "asyncrl.transport.server"]
    assert len(lines) == 7, lines  # five in full, a note, a summary at close
    assert lines[-1].startswith("server hard: suppressed 495 more decode_error problems in ")
    assert lines[-1].endswith("from raw (495)")


# -- 7. a restarted server that blocks at start is still seen restarted -------------------------


def _slow_server(endpoint: str, incarnation: int, block_s: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.transport.slow_start_server",
            endpoint,
            str(incarnation),
            str(block_s),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY "), line
    return proc


@pytest.mark.slow
def test_a_restart_whose_start_blocks_longer_than_liveness_is_seen(run_dir: str) -> None:
    endpoint = f"ipc://{run_dir}/slow"
    procs = [_slow_server(endpoint, 0, 0)]

    async def main() -> None:
        events: asyncio.Queue[PeerEvent] = asyncio.Queue()
        options = ChannelOptions(shm=False)
        async with Client(endpoint, options=options, on_event=events.put_nowait) as client:
            assert (await events.get()).kind == "connected"
            procs[0].kill()
            await asyncio.to_thread(procs[0].wait)
            # The new incarnation blocks its loop for 5 s, over liveness x interval (3 s).
            procs.append(await asyncio.to_thread(_slow_server, endpoint, 1, 5.0))
            async with asyncio.timeout(30):
                while (event := await events.get()).kind != "restarted":
                    pass
            assert event.incarnation == 1
            assert await client.call("add", [20, 22], int) == 42
            assert client.stats["rehandshake_failures"] >= 1

    try:
        run(main())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


# -- 8. counts a peer sets are bounded --------------------------------------------------------


def test_counts_a_peer_sets_are_bounded() -> None:
    codec = Codec()
    desc = TensorDesc("numpy", "|u1", [0], 0, Where.INLINE)
    too_many = Envelope(PROTOCOL_VERSION, Kind.REQUEST, 1, "m", tensors=[desc] * (MAX_TENSORS + 1))
    with pytest.raises(DecodeError) as err:
        codec.decode_envelope([msgspec.msgpack.encode(too_many)])
    assert f"Expected `array` of length <= {MAX_TENSORS}" in str(err.value)

    release = _env(Kind.RELEASE, 2, payload={"slots": [0] * (MAX_RELEASE_SLOTS + 1)})
    env = codec.decode_envelope(release)
    with pytest.raises(DecodeError, match=f"length <= {MAX_RELEASE_SLOTS}"):
        codec.decode_payload(env, release, Release)

    huge = TensorDesc("torch", "float32", [0, 2**64 - 1], 0, Where.INLINE)
    frames = [
        msgspec.msgpack.encode(
            Envelope(
                PROTOCOL_VERSION,
                Kind.REQUEST,
                3,
                "m",
                payload=msgspec.msgpack.Ext(TENSOR_EXT, bytes(4)),
                tensors=[huge],
            )
        )
    ]
    with pytest.raises(TensorDescriptorError) as err:
        codec.decode_payload(codec.decode_envelope(frames), frames)
    assert str(err.value) == (
        "tensor 0 (torch float32 [0, 18446744073709551615]): a dimension is over the limit of "
        "2**63 - 1"
    )


def test_a_frame_over_the_limit_is_never_buffered(run_dir: str) -> None:
    async def main() -> None:
        server = Server(
            f"ipc://{run_dir}/s", options=ChannelOptions(shm=False, max_message_bytes=1 << 16)
        )
        server.add("add", _add, list[int])
        await server.start()
        # zmq drops the connection of a peer whose frame exceeds the limit before the frame is
        # buffered; the DEALER reconnects, and only its PING is read.
        answers = await exchange(server.endpoint, [[bytes(1 << 20)], _env(Kind.PING, 1)], 1, b"big")
        assert [(env.kind, env.id) for env, _ in answers] == [(Kind.PONG, 1)]
        answers = await exchange(server.endpoint, [_env(Kind.REQUEST, 2, "add", [1, 2])], 1)
        assert answers[0][1] == 3
        assert server.stats["message_too_large"] == 0  # never received, so never counted
        await server.close()

    run(main())
