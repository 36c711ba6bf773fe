"""CurveZMQ on tcp endpoints: keyed peers are served, peers without the right keys are refused,
what travels is encrypted, and ipc stays as it was."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from asyncrl.keys import generate
from asyncrl.transport import (
    ChannelOptions,
    Client,
    CurveKeys,
    DeadlineExceededError,
    DisconnectedError,
    Publisher,
    Server,
    StreamReceiver,
    StreamSender,
    Subscriber,
    TransportError,
    load_keys,
    run,
    use_curve,
)
from asyncrl.transport.curve import active_handlers, current, resolve
from tests.conftest import ROOT

OPTIONS = ChannelOptions(run="curve", heartbeat_interval_s=0.2)
TCP = "tcp://127.0.0.1:0"
REFUSED_HINT = (
    "Use the run's key directory on every node (make them with 'asyncrl keys generate DIR' and "
    "copy DIR to every node; the manifest names it in security.curve_keys)"
)


@pytest.fixture
def keys(tmp_path: Any) -> CurveKeys:
    directory = str(tmp_path / "keys")
    generate(directory)
    return load_keys(directory)


@pytest.fixture
def stranger(tmp_path: Any) -> CurveKeys:
    """Another run's keys: a valid key pair that this run does not authorize."""
    directory = str(tmp_path / "other")
    generate(directory)
    return load_keys(directory)


@pytest.fixture(autouse=True)
def no_default() -> Iterator[None]:
    use_curve(None)
    yield
    use_curve(None)
    assert active_handlers() == 0


def _echo(payload: Any, call: Any) -> Any:
    return payload


async def _server(endpoint: str = TCP, **kw: Any) -> Server:
    server = Server(endpoint, name="echo", options=OPTIONS, **kw)
    server.add("echo", _echo)
    await server.start()
    return server


def _mechanism(obj: Server | Client) -> int:
    pump = obj._pump
    assert pump is not None
    return int(pump.sock.getsockopt(zmq.MECHANISM))


def test_a_keyed_client_is_served_and_peers_without_the_right_keys_are_refused(
    keys: CurveKeys, stranger: CurveKeys, caplog: pytest.LogCaptureFixture
) -> None:
    wrong_pair = CurveKeys(
        server_public=keys.server_public,  # it knows the server, but its own pair is foreign
        server_secret=b"",
        client_public=stranger.client_public,
        client_secret=stranger.client_secret,
    )

    async def main() -> None:
        server = await _server(curve=keys)
        endpoint = server.endpoint
        async with Client(endpoint, options=OPTIONS, curve=keys) as good:
            assert await good.call("echo", "hello", timeout=5) == "hello"
            assert _mechanism(server) == _mechanism(good) == zmq.CURVE
            for curve, cause in [
                (
                    False,
                    "the security mechanisms differ: the server requires Curve and this side "
                    "has no keys",
                ),
                (
                    wrong_pair,
                    "Curve authentication failed (ZAP status 400): the client's public key is "
                    "not one the server authorizes",
                ),
            ]:
                bad = Client(endpoint, name="bad", options=OPTIONS, curve=curve)
                with pytest.raises(TransportError) as refused:
                    await bad.connect(timeout=10)
                assert type(refused.value) is TransportError
                assert str(refused.value) == (
                    f"{endpoint} refused this connection: {cause}. {REFUSED_HINT}"
                )
                assert bad.stats["refused"] >= 1
                await bad.close()
                # The server keeps serving the client that has the keys.
                assert await good.call("echo", [1, 2], timeout=5) == [1, 2]
            # Neither stranger got a message through: one handshake, the good client's.
            assert server.stats["handshakes"] == 1
            assert list(server.peers) == [good.identity]
            assert server.stats["requests"] == 3
            assert server.stats["curve_refused"] >= 2
            assert server.stats["curve_refused_key"] >= 1
        # A client holding another server key is dropped by the server in the handshake: to it,
        # the connection broke (it cannot tell from a restart), or its calls time out.
        other = CurveKeys(stranger.server_public, b"", keys.client_public, keys.client_secret)
        lost = Client(endpoint, name="lost", options=OPTIONS, curve=other)
        with pytest.raises((DisconnectedError, DeadlineExceededError)):
            await lost.connect(timeout=0.5)
        await lost.close()
        assert server.stats["handshakes"] == 1
        async with Client(endpoint, options=OPTIONS, curve=keys) as again:
            assert await again.call("echo", "still", timeout=5) == "still"
        await server.close()

    with caplog.at_level(logging.WARNING, logger="asyncrl.transport"):
        run(main())
    lines = [r.getMessage() for r in caplog.records]
    mismatch = [line for line in lines if "refused a peer: the security mechanisms differ" in line]
    assert mismatch and mismatch[0].startswith("echo on tcp://127.0.0.1:")
    assert any(
        line.endswith(
            "refused a peer: the Curve handshake does not decrypt: the peer holds another server "
            "public key"
        )
        for line in lines
    )
    key = stranger.client_public.decode()
    assert (
        f"echo refused a Curve client from 127.0.0.1: its public key {key} is not an authorized "
        "client key; the peer needs the run's key directory (asyncrl keys generate)"
    ) in lines


class _Tap:
    """A one-connection TCP relay, on its own thread, that keeps every byte it forwards."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream[len("tcp://") :].rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(10)
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.seen = bytearray()
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        with self._listener:
            conn, _ = self._listener.accept()
        with conn, socket.create_connection(self._upstream, timeout=10) as up:
            ends = {conn: up, up: conn}
            while True:
                ready, _, _ = select.select(list(ends), [], [], 10)
                for end in ready:
                    try:
                        data = end.recv(65536)
                    except ConnectionError:
                        data = b""
                    if not data:
                        return  # one side closed: the relay ends
                    self.seen.extend(data)
                    ends[end].sendall(data)
                if not ready:
                    return

    def join(self) -> bytes:
        self._thread.join(10)
        assert not self._thread.is_alive()
        return bytes(self.seen)


def test_what_travels_is_encrypted(keys: CurveKeys) -> None:
    """A relay between client and server records the bytes: the payload shows only without
    Curve."""
    marker = "plain-text-marker-0123456789"

    async def through_tap(curve: CurveKeys | bool) -> bytes:
        setting: Any = curve if curve else False
        server = await _server(curve=setting)
        tap = _Tap(server.endpoint)
        async with Client(tap.endpoint, options=OPTIONS, curve=setting) as client:
            assert await client.call("echo", marker, timeout=5) == marker
        seen = await asyncio.to_thread(tap.join)
        await server.close()
        return seen

    async def main() -> None:
        plain = await through_tap(False)
        secret = await through_tap(keys)
        assert marker.encode() in plain
        assert b"echo" in plain
        assert marker.encode() not in secret
        assert b"echo" not in secret
        assert b"CURVE" in secret  # the mechanism named in the ZeroMQ greeting

    run(main())


def test_the_process_default_reaches_tcp_and_never_ipc(keys: CurveKeys, run_dir: str) -> None:
    assert resolve("tcp://127.0.0.1:1", None) is None
    use_curve(keys)
    assert current() is keys
    assert resolve("tcp://127.0.0.1:1", None) is keys
    assert resolve("tcp://127.0.0.1:1", False) is None
    assert resolve(f"ipc://{run_dir}/s", keys) is None
    assert resolve("inproc://x", None) is None

    async def main() -> None:
        tcp = await _server()
        ipc = await _server(f"ipc://{run_dir}/s")
        assert active_handlers() == 1
        async with (
            Client(tcp.endpoint, options=OPTIONS) as over_tcp,
            Client(ipc.endpoint, options=OPTIONS) as over_ipc,
        ):
            assert await over_tcp.call("echo", 1, timeout=5) == 1
            assert await over_ipc.call("echo", 2, timeout=5) == 2
            assert _mechanism(tcp) == _mechanism(over_tcp) == zmq.CURVE
            assert _mechanism(ipc) == _mechanism(over_ipc) == zmq.NULL
            # ipc takes shared memory as before; the tcp peer handshook from this host too.
            assert over_ipc.server is not None and over_ipc.server.shm
        await ipc.close()
        assert active_handlers() == 1
        await tcp.close()
        assert active_handlers() == 0

    run(main())


def test_off_the_loopback_only_with_curve(keys: CurveKeys) -> None:
    async def main() -> None:
        with pytest.raises(TransportError) as exposed:
            await _server("tcp://0.0.0.0:0", curve=False)
        assert str(exposed.value) == (
            "endpoint 'tcp://0.0.0.0:0' is not on the loopback interface; asyncrl binds ipc or "
            "127.0.0.1 by default. Pass allow_remote=True to expose it to the network"
        )
        assert active_handlers() == 0
        server = await _server("tcp://0.0.0.0:0", curve=keys)
        port = server.endpoint.rsplit(":", 1)[1]
        async with Client(f"tcp://127.0.0.1:{port}", options=OPTIONS, curve=keys) as client:
            assert await client.call("echo", "remote", timeout=5) == "remote"
        await server.close()

    run(main())


def test_broadcast_and_streams_use_curve(keys: CurveKeys) -> None:
    async def main() -> None:
        use_curve(keys)
        async with (
            StreamReceiver(TCP, int, options=OPTIONS) as receiver,
            StreamSender(receiver.endpoint, options=OPTIONS) as sender,
        ):
            await sender.send(7)
            assert await receiver.recv() == 7
            assert receiver._pump is not None
            assert receiver._pump.sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
        async with Publisher(TCP, options=OPTIONS) as publisher:
            async with Subscriber(publisher.endpoint, {"v": int}, options=OPTIONS) as subscriber:
                # A subscriber gets what is published after it joined: publish until it arrives.
                task = asyncio.create_task(subscriber.wait_for("v"))
                async with asyncio.timeout(10):
                    while not task.done():
                        publisher.publish("v", 3)
                        await asyncio.wait({task}, timeout=0.01)
                assert task.result() == 3
        assert active_handlers() == 0

    run(main())


def test_the_zap_handler_leaks_nothing(keys: CurveKeys) -> None:
    """Server and client on a private context: after both close, the context terminates."""
    context: zmq.Context[Any] = zmq.Context()

    async def main() -> None:
        server = await _server(curve=keys, context=context)
        assert active_handlers() == 1
        client = Client(server.endpoint, options=OPTIONS, context=context, curve=keys)
        await client.connect(timeout=5)
        assert await client.call("echo", 1, timeout=5) == 1
        await client.close()
        await server.close()
        assert active_handlers() == 0

    run(main())
    done = threading.Event()
    threading.Thread(target=lambda: (context.term(), done.set()), daemon=True).start()
    assert done.wait(10), "the zmq context did not terminate: a socket was left open"


def _write(path: str, text: str, mode: int = 0o600) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def test_bad_key_files_are_named(tmp_path: Any) -> None:
    directory = str(tmp_path / "keys")
    hint = "make them with 'asyncrl keys generate DIR' and copy DIR to every node"

    def problem() -> str:
        with pytest.raises(TransportError) as info:
            load_keys(directory)
        return str(info.value)

    assert problem() == f"Curve key directory {directory} does not exist; {hint}"
    generate(directory)
    secret = os.path.join(directory, "client.key_secret")
    os.chmod(secret, 0o644)
    assert problem() == (
        f"Curve secret key file {secret} is readable by other users (mode 0644); "
        f"run 'chmod 600 {secret}'"
    )
    _write(secret, 'curve\n    secret-key = "short"\n')
    assert problem() == (
        f"Curve key file {secret} cannot be read (No public key found in {secret}); {hint} "
        f"(add --force to replace bad files)"
    )
    _write(secret, 'curve\n    public-key = "short"\n    secret-key = "short"\n')
    assert problem() == (
        f"Curve key file {secret} holds no valid public key (40 Z85 characters); {hint} "
        f"(add --force to replace bad files)"
    )
    os.unlink(secret)
    assert problem() == f"Curve key file {secret} is missing; {hint}"
    generate(directory, force=True)
    other = str(tmp_path / "other")
    generate(other)
    os.replace(os.path.join(other, "server.key"), os.path.join(directory, "server.key"))
    assert problem() == (
        f"Curve key files server.key and server.key_secret in {directory} are not one pair; "
        f"{hint} (with --force)"
    )


def test_authorized_keys_and_secrets_kept_out_of_repr(tmp_path: Any) -> None:
    directory = str(tmp_path / "keys")
    generate(directory)
    extra = str(tmp_path / "extra")
    generate(extra)
    os.makedirs(os.path.join(directory, "authorized"))
    shutil.copy(os.path.join(extra, "client.key"), os.path.join(directory, "authorized", "p.key"))
    keys = load_keys(directory)
    assert load_keys(extra).client_public in keys.authorized_clients
    assert keys.client_public in keys.authorized_clients
    assert len(keys.authorized_clients) == 2
    assert keys.directory == directory
    text = repr(keys)
    assert keys.server_secret.decode() not in text
    assert keys.client_secret.decode() not in text
    assert text == (
        f"CurveKeys(directory={directory!r}, server_public={keys.server_public!r}, "
        f"client_public={keys.client_public!r}, authorized_clients=2)"
    )


def test_a_handler_left_behind_by_a_finished_loop_is_replaced(keys: CurveKeys) -> None:
    """A server never closed, its loop gone: the next loop's Curve server still gets answers."""
    left: list[Server] = []

    async def leave() -> None:
        left.append(await _server(curve=keys))

    async def serve() -> None:
        server = await _server(curve=keys)
        async with Client(server.endpoint, options=OPTIONS, curve=keys) as client:
            assert await client.call("echo", "answered", timeout=5) == "answered"
        await server.close()

    run(leave())
    assert active_handlers() == 1
    run(serve())
    assert active_handlers() == 1  # the leaked server still holds the new handler
    left[0]._closed = True  # its loop is gone: close its socket and release it by hand
    assert left[0]._pump is not None and left[0]._guard is not None
    left[0]._pump.sock.close(linger=0)
    left[0]._guard.close()
    assert active_handlers() == 0


@pytest.mark.slow
def test_the_curve_benchmark_measures_both(tmp_path: Any) -> None:
    """``asyncrl bench transport --curve --quick --json``: both rows, and the ratios they give."""
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "bench", "transport", "--curve", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=True,
    )
    figures = json.loads(out.stdout)
    for name in ("tcp", "curve"):
        for key in ("rtt_p50_us", "calls_per_s", "tensor_gbps"):
            assert figures[f"{name}_{key}"] > 0, (name, key)
    assert figures["curve_rate_over_tcp"] == pytest.approx(
        figures["curve_calls_per_s"] / figures["tcp_calls_per_s"]
    )
    assert figures["rounds"] == 3
