"""Request/reply: in one process, and against a server in its own process."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import msgspec
import pytest
import torch
import zmq

from asyncrl.transport import (
    PROTOCOL_VERSION,
    ChannelOptions,
    Client,
    ClosedError,
    DeadlineExceededError,
    DisconnectedError,
    PeerDeadError,
    PeerEvent,
    PeerUnreachableError,
    ProtocolVersionError,
    RemoteError,
    Server,
    TransportError,
    run,
)
from asyncrl.transport.sockets import check_endpoint, dealer
from tests.conftest import ServerProcess, start_server_process


class Point(msgspec.Struct):
    x: int
    y: int


def _double(p: Point, call: Any) -> Point:
    return Point(p.x * 2, p.y * 2)


async def _serve(run_dir: str, **kw: Any) -> Server:
    server = Server(f"ipc://{run_dir}/s", options=ChannelOptions(run="t"), **kw)
    server.add("double", _double, Point)
    server.add("fail", _fail)
    server.add("wait", _wait, float)
    await server.start()
    return server


def _fail(payload: Any, call: Any) -> Any:
    raise ValueError(f"no good: {payload}")


async def _wait(seconds: float, call: Any) -> float:
    await asyncio.sleep(seconds)
    return seconds


def test_typed_call_and_reply(run_dir: str) -> None:
    async def main() -> None:
        server = await _serve(run_dir)
        async with Client(server.endpoint) as client:
            assert client.server is not None and client.server.pid == os.getpid()
            assert await client.call("double", Point(2, 3), Point) == Point(4, 6)
            results = await asyncio.gather(
                *(client.call("double", Point(i, -i), Point) for i in range(50))
            )
            assert results == [Point(2 * i, -2 * i) for i in range(50)]
        await server.close()
        assert server.stats["requests"] == 51

    run(main())


def test_errors_name_what_went_wrong(run_dir: str) -> None:
    async def main() -> None:
        server = await _serve(run_dir)
        async with Client(server.endpoint) as client:
            with pytest.raises(RemoteError) as err:
                await client.call("fail", "x")
            assert err.value.code == "handler_error"
            assert err.value.remote_type == "ValueError"
            assert str(err.value) == (
                f"error reply from {server.endpoint} [handler_error] (ValueError): no good: x"
            )
            with pytest.raises(RemoteError) as err:
                await client.call("nope", 1)
            assert err.value.code == "unknown_method"
            assert "has no method 'nope'; it serves: double, fail, wait" in str(err.value)
            with pytest.raises(RemoteError) as err:
                await client.call("double", {"x": "not an int"}, Point)
            assert err.value.code == "decode_error"
            assert "Expected `int`, got `str` - at `$.x`" in str(err.value)
            with pytest.raises(DeadlineExceededError) as deadline:
                await client.call("wait", 5.0, timeout=0.05)
            assert deadline.value.method == "wait"
            assert deadline.value.peer == server.endpoint
            assert (deadline.value.pid, deadline.value.incarnation) == (os.getpid(), 0)
            assert str(deadline.value) == (
                f"request 'wait' to {server.endpoint} got no answer within its deadline of "
                f"0.050 s; the peer (pid {os.getpid()}, incarnation 0) is slow, hung or gone. "
                f"Raise the timeout if the work is legitimately long."
            )
            # The server keeps serving after all of that.
            assert await client.call("double", Point(1, 1), Point) == Point(2, 2)
        await server.close()

    run(main())


def test_closed_is_not_broken(run_dir: str) -> None:
    async def main() -> None:
        server = await _serve(run_dir)
        client = Client(server.endpoint)
        await client.connect()
        pending = client.call_future("wait", 5.0)
        await client.close()
        with pytest.raises(ClosedError, match="was closed with request 'wait'"):
            await pending
        with pytest.raises(ClosedError):
            await client.call("double", Point(1, 1), Point)
        assert not isinstance(ClosedError("x"), DisconnectedError)
        await server.close()

    run(main())


def test_credit_reaches_the_client_and_unknown_peers_are_refused(run_dir: str) -> None:
    async def main() -> None:
        server = await _serve(run_dir)
        got: asyncio.Queue[int] = asyncio.Queue()
        async with Client(server.endpoint, on_credit=got.put_nowait) as client:
            server.send_credit(client.identity, 7)
            assert await asyncio.wait_for(got.get(), 5) == 7
            with pytest.raises(PeerUnreachableError):
                server.send_credit(b"nobody", 1)
        await server.close()

    run(main())


def test_shared_memory_both_ways_and_released(run_dir: str) -> None:
    async def main() -> None:
        server = Server(f"ipc://{run_dir}/s", options=ChannelOptions(run="shmtest"))
        server.add("echo", lambda t, call: t, torch.Tensor)
        await server.start()
        async with Client(server.endpoint, options=ChannelOptions(run="shmtest")) as client:
            big = torch.randn(512, 1024)  # 2 MiB: over the shared-memory threshold
            back = await client.call("echo", big, torch.Tensor)
            assert torch.equal(back, big)
            assert server.shm_pool is not None and server.shm_pool.lent == 1
            del back  # the last view goes: a RELEASE is queued for the next loop turns
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            # One connection is FIFO: once this call is answered, the RELEASE before it was read.
            assert await client.call("echo", torch.zeros(1), torch.Tensor) == torch.zeros(1)
            assert server.shm_pool.lent == 0
            assert client._pool is not None and client._pool.lent == 0
        await server.close()

    run(main())


def test_endpoints_are_local_by_default() -> None:
    with pytest.raises(TransportError, match="not on the loopback interface"):
        check_endpoint("tcp://0.0.0.0:5555")
    with pytest.raises(TransportError, match="over the limit of 107"):
        check_endpoint("ipc:///" + "x" * 120)
    with pytest.raises(TransportError, match="is malformed"):
        check_endpoint("localhost:5555")
    check_endpoint("tcp://127.0.0.1:0")
    check_endpoint("tcp://0.0.0.0:5555", allow_remote=True)

    async def main() -> None:
        server = Server("tcp://127.0.0.1:0")
        server.add("double", _double, Point)
        bound = await server.start()
        assert bound.startswith("tcp://127.0.0.1:") and not bound.endswith(":0")
        async with Client(bound) as client:
            assert await client.call("double", Point(1, 2), Point) == Point(2, 4)
        await server.close()

    run(main())


def test_a_server_of_another_version_is_refused(run_dir: str) -> None:
    """The client refuses a server whose envelopes carry another protocol version."""

    async def main() -> None:
        ctx = zmq.Context.instance()
        router = ctx.socket(zmq.ROUTER)
        router.bind(f"ipc://{run_dir}/old")
        client = Client(f"ipc://{run_dir}/old")
        connecting = asyncio.ensure_future(client.connect(timeout=10))
        loop = asyncio.get_running_loop()
        identity, frame = await loop.run_in_executor(None, router.recv_multipart)
        request_id = msgspec.msgpack.decode(frame)[2]
        router.send_multipart([identity, msgspec.msgpack.encode([2, 2, request_id])])
        with pytest.raises(ProtocolVersionError) as err:
            await connecting
        assert str(err.value) == (
            f"protocol version mismatch: this side speaks version {PROTOCOL_VERSION}, the peer "
            f"ipc://{run_dir}/old speaks version 2; run the same asyncrl protocol version on "
            f"both ends"
        )
        await client.close()
        router.close(linger=0)

    run(main())


@pytest.mark.slow
def test_restart_on_the_same_endpoint(server_process: ServerProcess, run_dir: str) -> None:
    """A killed server fails requests in flight; its restart is found without any reconnect."""

    async def main() -> None:
        events: asyncio.Queue[PeerEvent] = asyncio.Queue()
        async with Client(server_process.endpoint, on_event=events.put_nowait) as client:
            assert (await events.get()).kind == "connected"
            assert await client.call("add", {"a": 2, "b": 3}) == 5
            in_flight = client.call_future("sleep", 30.0)
            os.kill(server_process.pid, signal.SIGKILL)
            server_process.proc.wait()
            with pytest.raises(DisconnectedError, match="may or may not have run"):
                await in_flight
            assert (await events.get()).kind == "disconnected"
            restarted = start_server_process(
                server_process.endpoint, "--run", os.path.basename(run_dir), "--incarnation", "1"
            )
            try:
                # start_server_process blocks this loop while the server starts: under load the
                # client may hear nothing for liveness x interval and report it dead first.
                event = await asyncio.wait_for(events.get(), 10)
                while event.kind in ("dead", "alive"):
                    event = await asyncio.wait_for(events.get(), 10)
                assert (event.kind, event.incarnation) == ("restarted", 1)
                assert await client.call("add", {"a": 4, "b": 5}) == 9
                # A deadline names the process that took the request: the new incarnation.
                with pytest.raises(DeadlineExceededError) as deadline:
                    await client.call("sleep", 30.0, timeout=0.05)
                assert (deadline.value.pid, deadline.value.incarnation) == (restarted.pid, 1)
                assert f"the peer (pid {restarted.pid}, incarnation 1) is slow" in str(
                    deadline.value
                )
            finally:
                restarted.stop()

    run(main())


@pytest.mark.slow
def test_a_stopped_server_is_reported_dead_then_alive(run_dir: str) -> None:
    """SIGSTOP: heartbeats stop, pending requests fail after liveness x interval."""
    server = start_server_process(f"ipc://{run_dir}/hb", "--interval", "0.1")
    options = ChannelOptions(heartbeat_interval_s=0.1, liveness=3)

    async def main() -> None:
        events: asyncio.Queue[PeerEvent] = asyncio.Queue()
        async with Client(server.endpoint, options=options, on_event=events.put_nowait) as client:
            assert (await events.get()).kind == "connected"
            os.kill(server.pid, signal.SIGSTOP)
            try:
                with pytest.raises(PeerDeadError) as err:
                    await client.call("add", {"a": 1, "b": 1}, timeout=30)
                assert err.value.peer == server.endpoint
                assert err.value.limit_s == pytest.approx(0.3)
                assert err.value.silent_s > 0.3
                assert (await events.get()).kind == "dead"
                assert not client.alive
            finally:
                os.kill(server.pid, signal.SIGCONT)
            assert (await asyncio.wait_for(events.get(), 10)).kind == "alive"
            assert await client.call("add", {"a": 1, "b": 1}) == 2

    try:
        run(main())
    finally:
        server.stop()


@pytest.mark.slow
def test_stop_message_ends_the_server(server_process: ServerProcess) -> None:
    async def main() -> None:
        async with Client(server_process.endpoint) as client:
            assert await client.call("add", {"a": 1, "b": 2}) == 3
            client.send_stop()

    run(main())
    assert server_process.proc.wait(timeout=10) == 0
    out = server_process.stop()
    assert "'stops': 1" in out


def test_the_server_reports_clients_that_go_silent(run_dir: str) -> None:
    options = ChannelOptions(run="t", heartbeat_interval_s=0.05, liveness=3)

    async def main() -> None:
        events: asyncio.Queue[PeerEvent] = asyncio.Queue()
        server = Server(f"ipc://{run_dir}/s", options=options, on_event=events.put_nowait)
        server.add("double", _double, Point)
        await server.start()
        client = Client(server.endpoint, name="quiet", options=options)
        await client.connect()
        connected = await events.get()
        assert (connected.kind, connected.peer) == ("connected", client.identity.decode())
        assert connected.detail == f"quiet, pid {os.getpid()}"
        assert await client.call("double", Point(1, 1), Point) == Point(2, 2)
        await client.close()  # no more pings from here on
        dead = await asyncio.wait_for(events.get(), 10)
        assert (dead.kind, dead.peer) == ("dead", client.identity.decode())
        assert client.identity not in server.peers
        await server.close()

    run(main())


def test_connecting_to_nobody_times_out_and_closes_at_once(run_dir: str) -> None:
    async def main() -> None:
        client = Client(f"ipc://{run_dir}/nobody")
        with pytest.raises(DeadlineExceededError) as deadline:
            await client.connect(timeout=0.1)
        # Nobody answered a handshake, so no pid or incarnation is known to name.
        assert (deadline.value.pid, deadline.value.incarnation) == (None, None)
        assert str(deadline.value) == (
            f"request 'handshake' to {client.endpoint} got no answer within its deadline of "
            f"0.100 s; the peer is slow, hung or gone. Raise the timeout if the work is "
            f"legitimately long."
        )
        await client.close()

    run(main())


def test_a_client_socket_closes_at_once_and_keeps_its_limits() -> None:
    options = ChannelOptions(send_hwm=7, recv_hwm=9, max_message_bytes=1 << 20)
    sock = dealer(zmq.Context.instance(), b"me", options)
    try:
        got = [
            sock.getsockopt(opt)
            for opt in (zmq.ROUTING_ID, zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER, zmq.MAXMSGSIZE)
        ]
        assert got == [b"me", 7, 9, 0, 1 << 20]
        assert (sock.getsockopt(zmq.RECONNECT_IVL), sock.getsockopt(zmq.RECONNECT_IVL_MAX)) == (
            10,
            200,
        )
    finally:
        sock.close(linger=0)
