"""Every peer presents the run's secret in its handshake before any call is served, on ipc as on
tcp; the secret comes from a 0600 file named by ASYNCRL_SECRET_FILE."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from typing import Any

import pytest
import torch

from asyncrl.transport import ChannelOptions, Client, PeerEvent, RemoteError, Server, run
from asyncrl.transport.control import (
    CONTROL_SECRET_ENV,
    SECRET_FILE_ENV,
    read_secret,
    run_secret,
    write_secret,
)
from asyncrl.transport.errors import TransportError
from asyncrl.transport.protocol import PROTOCOL_VERSION, ErrorCode, ErrorInfo, Hello, Kind
from tests.transport.test_hardening import _env, exchange, umask

SECRET = "5ecret-of-the-run"
HOW = (
    "run it inside the run (every process the node agent starts has ASYNCRL_SECRET_FILE), or "
    "point it at the run's secret file: ASYNCRL_SECRET_FILE=RUN_DIR/secret"
)


def _server(endpoint: str, calls: list[Any], **kw: Any) -> Server:
    def add(payload: list[int], call: Any) -> int:
        calls.append(payload)
        return payload[0] + payload[1]

    server = Server(endpoint, name="guarded", options=ChannelOptions(shm=False), **kw)
    server.add("add", add, list[int])
    return server


def _unadmitted(kind: str) -> str:
    return (
        f"{kind} refused: guarded serves only the processes of its run, and this client has not "
        f"presented the run's secret in a HANDSHAKE (Hello.secret) on this connection; {HOW}"
    )


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_nothing_is_served_to_a_peer_whose_handshake_did_not_present_the_secret(
    run_dir: str, transport: str
) -> None:
    endpoint = f"ipc://{run_dir}/s" if transport == "ipc" else "tcp://127.0.0.1:0"

    async def main() -> None:
        calls: list[Any] = []
        stopped = asyncio.Event()
        server = _server(endpoint, calls, secret=SECRET, curve=False, on_stop=stopped.set)
        await server.start()
        bare = Hello(PROTOCOL_VERSION, name="stranger")
        answers = await exchange(
            server.endpoint,
            [
                _env(Kind.REQUEST, 1, "add", [2, 3]),  # before any handshake
                _env(Kind.PING, 2),  # dropped: no PONG
                _env(Kind.STOP, 3),
                _env(Kind.HANDSHAKE, 4, payload=bare),  # a handshake without the secret
                _env(Kind.REQUEST, 5, "add", [2, 3]),
            ],
            4,
        )
        got = [(env.kind, env.id, info.code, info.message) for env, info in answers]
        assert got == [
            (Kind.ERROR, 1, ErrorCode.UNAUTHORIZED, _unadmitted("REQUEST")),
            (Kind.ERROR, 3, ErrorCode.UNAUTHORIZED, _unadmitted("STOP")),
            (
                Kind.ERROR,
                4,
                ErrorCode.UNAUTHORIZED,
                "guarded serves only the processes of its run, and the HANDSHAKE of stranger "
                f"presented no secret (Hello.secret); {HOW}",
            ),
            (Kind.ERROR, 5, ErrorCode.UNAUTHORIZED, _unadmitted("REQUEST")),
        ]
        assert calls == [] and not stopped.is_set()
        assert server.stats["unauthenticated"] == 5  # 3 messages refused, 1 PING dropped, 1 Hello
        assert server.stats["handshakes"] == 0
        # A client of the run presents the secret and is served.
        async with Client(server.endpoint, secret=SECRET, curve=False) as member:
            assert await member.call("add", [2, 3], int) == 5
        assert calls == [[2, 3]]
        await server.close()

    run(main())


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_an_admitted_routing_id_is_forgotten_when_its_connection_closes(
    run_dir: str, transport: str
) -> None:
    endpoint = f"ipc://{run_dir}/s" if transport == "ipc" else "tcp://127.0.0.1:0"
    hello = Hello(PROTOCOL_VERSION, name="member", secret=SECRET)

    async def main() -> None:
        calls: list[Any] = []
        events: list[PeerEvent] = []
        gone = asyncio.Event()

        def on_event(event: PeerEvent) -> None:
            events.append(event)
            if event.kind == "disconnected":
                gone.set()

        server = _server(endpoint, calls, secret=SECRET, curve=False, on_event=on_event)
        await server.start()
        async with Client(server.endpoint, secret=SECRET, curve=False) as other:
            # A peer of the run handshakes under a routing id, is served, and disconnects.
            answers = await exchange(
                server.endpoint,
                [_env(Kind.HANDSHAKE, 1, payload=hello), _env(Kind.REQUEST, 2, "add", [2, 3])],
                2,
                identity=b"admitted-id",
            )
            got = [(env.kind, env.id, payload) for env, payload in answers]
            assert got[1:] == [(Kind.REPLY, 2, 5)] and got[0][:2] == (Kind.WELCOME, 1)
            async with asyncio.timeout(30):
                await gone.wait()
            assert [(e.peer, e.kind) for e in events] == [
                (other.identity.decode(), "connected"),
                ("admitted-id", "connected"),
                ("admitted-id", "disconnected"),
            ]
            assert server.stats["admissions_ended"] == 1
            # A new connection under the same routing id, without a handshake, is refused; once
            # it presents the secret itself, it is served.
            answers = await exchange(
                server.endpoint,
                [
                    _env(Kind.REQUEST, 3, "add", [4, 5]),
                    _env(Kind.STOP, 4),
                    _env(Kind.HANDSHAKE, 5, payload=hello),
                    _env(Kind.REQUEST, 6, "add", [6, 7]),
                ],
                4,
                identity=b"admitted-id",
            )
            got = [(env.kind, env.id, payload) for env, payload in answers]
            assert got[:2] == [
                (Kind.ERROR, 3, ErrorInfo(ErrorCode.UNAUTHORIZED, _unadmitted("REQUEST"))),
                (Kind.ERROR, 4, ErrorInfo(ErrorCode.UNAUTHORIZED, _unadmitted("STOP"))),
            ]
            assert got[2][:2] == (Kind.WELCOME, 5) and got[3] == (Kind.REPLY, 6, 13)
            # The peer still connected stayed admitted all along.
            assert await other.call("add", [1, 1], int) == 2
            assert calls == [[2, 3], [6, 7], [1, 1]]
            assert server.stats["handshakes"] == 3
        await server.close()

    run(main())


def test_a_wrong_missing_or_oversized_secret_fails_the_connect_and_others_are_served(
    run_dir: str,
) -> None:
    async def main() -> None:
        calls: list[Any] = []
        server = _server(f"ipc://{run_dir}/s", calls, secret=SECRET)
        await server.start()
        async with Client(server.endpoint, secret=SECRET) as member:
            for secret, counter, message in [
                (
                    "guess",
                    "secret_refused",
                    "the secret presented by intruder is not the one of guarded's run (a client "
                    "of another run, or of an earlier run of the same directory?); point "
                    "ASYNCRL_SECRET_FILE at RUN_DIR/secret of the run that serves this endpoint",
                ),
                (
                    None,
                    "unauthenticated",
                    "guarded serves only the processes of its run, and the HANDSHAKE of intruder "
                    f"presented no secret (Hello.secret); {HOW}",
                ),
            ]:
                intruder = Client(server.endpoint, name="intruder", secret=secret)
                with pytest.raises(RemoteError) as err:
                    await intruder.connect(timeout=5)
                await intruder.close()
                assert err.value.code == ErrorCode.UNAUTHORIZED
                assert (
                    str(err.value)
                    == f"error reply from {server.endpoint} [unauthorized]: {message}"
                )
                assert server.stats[counter] == 1
            huge = _env(Kind.HANDSHAKE, 1, payload={"version": 1, "secret": "x" * 257})
            garbage = _env(Kind.HANDSHAKE, 2, payload={"version": 1, "secret": [SECRET]})
            answers = await exchange(server.endpoint, [huge, garbage], 2)
            assert [(env.id, info.code) for env, info in answers] == [
                (1, ErrorCode.DECODE),
                (2, ErrorCode.DECODE),
            ]
            assert await member.call("add", [1, 2], int) == 3
        assert calls == [[1, 2]]
        await server.close()

    run(main())


def test_a_refusal_is_logged_with_what_was_wrong_and_how_to_fix_it(run_dir: str) -> None:
    lines: list[str] = []

    class Sink(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("asyncrl.transport.server")
    sink = Sink(logging.WARNING)
    logger.addHandler(sink)

    async def main() -> None:
        server = _server(f"ipc://{run_dir}/s", [], secret=SECRET)
        await server.start()
        intruder = Client(server.endpoint, name="intruder", identity=b"intruder", secret="guess")
        with pytest.raises(RemoteError) as err:
            await intruder.connect(timeout=5)
        await intruder.close()
        await server.close()
        told = str(err.value).removeprefix(f"error reply from {server.endpoint} [unauthorized]: ")
        assert told.startswith("the secret presented by intruder is not the one of guarded's run")
        assert lines == [
            f"server guarded refused HANDSHAKE from 'intruder' (secret_refused): {told}"
        ]

    try:
        run(main())
    finally:
        logger.removeHandler(sink)


def test_the_secret_comes_from_a_private_file_the_environment_names(
    run_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = os.path.join(run_dir, "secret")
    with umask(0):
        write_secret(path, SECRET)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_secret(path) == SECRET
    monkeypatch.setenv(CONTROL_SECRET_ENV, "the environment's, read only without a file")
    monkeypatch.setenv(SECRET_FILE_ENV, path)
    assert run_secret() == SECRET

    async def main() -> None:
        calls: list[Any] = []
        server = _server(f"ipc://{run_dir}/s", calls)  # both read the file by default
        await server.start()
        async with Client(server.endpoint) as member:
            assert await member.call("add", [20, 22], int) == 42
        stranger = Client(server.endpoint, secret="the environment's, read only without a file")
        with pytest.raises(RemoteError, match="is not the one of guarded"):
            await stranger.connect(timeout=5)
        await stranger.close()
        await server.close()

    run(main())
    missing = os.path.join(run_dir, "gone")
    monkeypatch.setenv(SECRET_FILE_ENV, missing)
    with pytest.raises(TransportError) as err:
        Server("ipc:///nowhere")  # never a server that silently serves everyone
    assert str(err.value).startswith(f"cannot read the run's secret from {missing} (")
    assert str(err.value).endswith(
        "); ASYNCRL_SECRET_FILE must name the secret file of a running run (RUN_DIR/secret)"
    )


def test_a_process_left_over_from_an_earlier_run_is_refused_when_the_directory_is_reused(
    run_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process reads the secret file once: a leftover of the earlier run keeps presenting the
    earlier secret, even in a client it makes after the next run replaced the file."""
    path = os.path.join(run_dir, "secret")
    with open(path, "w", encoding="utf-8") as f:
        f.write("secret-of-the-earlier-run")  # written by the earlier run's agent
    monkeypatch.setenv(SECRET_FILE_ENV, path)
    assert run_secret() == "secret-of-the-earlier-run"
    with open(f"{path}.next", "w", encoding="utf-8") as f:
        f.write(SECRET)  # the next run's agent, another process, replaces the file
    os.replace(f"{path}.next", path)
    assert run_secret() == "secret-of-the-earlier-run"

    async def main() -> None:
        calls: list[Any] = []
        server = _server(f"ipc://{run_dir}/s", calls, secret=SECRET)
        await server.start()
        leftover = Client(server.endpoint, name="leftover")
        with pytest.raises(RemoteError, match="the secret presented by leftover is not the one"):
            await leftover.connect(timeout=5)
        await leftover.close()
        assert server.stats["secret_refused"] == 1 and calls == []
        await server.close()

    run(main())
    write_secret(path, "secret-of-a-run-this-process-starts")  # as the node agent does
    assert run_secret() == "secret-of-a-run-this-process-starts"


def test_a_call_made_while_the_server_restarts_waits_for_the_new_handshake(run_dir: str) -> None:
    """The restarted server has not seen this client's handshake: a request sent before the new
    handshake would be refused. The client holds it and sends it once the handshake succeeded."""

    async def main() -> None:
        calls: list[Any] = []
        endpoint = f"ipc://{run_dir}/s"
        first = _server(endpoint, calls, secret=SECRET, incarnation=0)
        await first.start()
        events: asyncio.Queue[PeerEvent] = asyncio.Queue()
        client = Client(endpoint, secret=SECRET, on_event=events.put_nowait)
        await client.connect()
        assert (await events.get()).kind == "connected"
        await first.close()
        assert (await events.get()).kind == "disconnected"
        pending = client.call_future("add", [3, 4], int, timeout=30)
        second = _server(endpoint, calls, secret=SECRET, incarnation=1)
        await second.start()
        assert await pending == 7
        assert (await events.get()).kind == "restarted"
        assert second.stats["unauthenticated"] == 0
        assert calls == [[3, 4]]
        await client.close()
        await second.close()

    run(main())


def test_a_tensor_held_across_a_restart_keeps_its_slot_until_the_new_server_releases_it(
    run_dir: str,
) -> None:
    """The dead incarnation's slots are taken back, but not the slot of a request held during the
    restart: the new server reads it once the request is sent, until it releases it."""

    async def main() -> None:
        endpoint = f"ipc://{run_dir}/s"
        options = ChannelOptions(run="held")
        kept: list[torch.Tensor] = []

        def keep(tensor: torch.Tensor, call: Any) -> int:
            kept.append(tensor)  # a view of the client's slot: not released while kept
            return len(kept)

        def server(incarnation: int) -> Server:
            s = Server(endpoint, options=options, secret=SECRET, incarnation=incarnation)
            s.add("keep", keep, torch.Tensor)
            return s

        first = server(0)
        await first.start()
        events: asyncio.Queue[PeerEvent] = asyncio.Queue()
        client = Client(endpoint, options=options, secret=SECRET, on_event=events.put_nowait)
        await client.connect()
        assert (await events.get()).kind == "connected"
        await first.close()
        assert (await events.get()).kind == "disconnected"
        ones = torch.ones(512, 1024)  # 2 MiB: over the shared-memory threshold
        pending = client.call_future("keep", ones, int, timeout=30)
        second = server(1)
        await second.start()
        assert await pending == 1
        assert (await events.get()).kind == "restarted"
        assert client._pool is not None and client._pool.lent == 1
        # A freed slot would be reused here and its bytes overwritten under the new server.
        assert await client.call("keep", torch.full((512, 1024), 2.0), int) == 2
        assert client._pool.lent == 2
        assert torch.equal(kept[0], ones)
        kept.clear()  # the new server's last views go: it releases both slots
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        # One connection is FIFO: once this call is answered, the RELEASE before it was read.
        assert await client.call("keep", torch.zeros(1), int) == 1
        assert client._pool.lent == 0
        await client.close()
        await second.close()

    run(main())
