"""The external role of examples/external_role: a server written with only zmq and msgpack.

Each test starts ``echo_role.py`` the way the supervisor does (a command with the ``ASYNCRL_*``
environment variables), waits for its READY line, and talks to it with asyncrl's own client, or
with a bare DEALER for the malformed messages the client never sends.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from asyncrl.transport import Client, Hello, PeerEvent, RemoteError, run
from asyncrl.transport.control import write_secret

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ROLE = "examples/external_role/echo_role.py"
CAPACITY = 3
REPLICA = 2
TIMEOUT = 10.0


class Roles:
    """Starts echo_role.py processes on one endpoint; reaps them all at teardown."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.run = os.path.basename(run_dir)
        # A sockets directory that does not exist yet: the role creates it.
        self.endpoint = f"ipc://{run_dir}/sockets/echo.{REPLICA}"
        assert len(self.endpoint) - len("ipc://") <= 107
        self.procs: list[subprocess.Popen[str]] = []

    def env(self, incarnation: int, config: dict[str, Any]) -> dict[str, str]:
        return {
            "ASYNCRL_ENDPOINT": self.endpoint,
            "ASYNCRL_ROLE": "echo",
            "ASYNCRL_REPLICA": str(REPLICA),
            "ASYNCRL_INCARNATION": str(incarnation),
            "ASYNCRL_RUN": self.run,
            "ASYNCRL_RUN_DIR": self.run_dir,
            "ASYNCRL_CONFIG": json.dumps(config),
            "ASYNCRL_CAPACITY": str(CAPACITY),
        }

    def spawn(
        self, incarnation: int = 0, config: Any = None, extra: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        config = {"suffix": "!"} if config is None else config
        proc = subprocess.Popen(
            [sys.executable, ROLE],
            cwd=ROOT,
            env={**self.env(incarnation, config), **(extra or {})},
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        return proc

    def start(
        self, incarnation: int = 0, extra: dict[str, str] | None = None, config: Any = None
    ) -> subprocess.Popen[str]:
        """Start a role and wait for its READY line (it has bound its endpoint then)."""
        proc = self.spawn(incarnation, config, extra)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == "READY\n", f"the role did not start: {line!r}, exit {proc.poll()}"
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def roles(run_dir: str) -> Iterator[Roles]:
    roles = Roles(run_dir)
    yield roles
    roles.close()


async def next_event(events: asyncio.Queue[PeerEvent], kind: str) -> PeerEvent:
    """The next PeerEvent of ``kind``; events of other kinds before it are skipped."""

    async def find() -> PeerEvent:
        while True:
            event = await events.get()
            if event.kind == kind:
                return event

    return await asyncio.wait_for(find(), TIMEOUT)


def test_the_role_imports_only_the_standard_library_zmq_and_msgpack() -> None:
    source = (ROOT / ROLE).read_text(encoding="utf-8")
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import"
            imported.add((node.module or "").partition(".")[0])
    assert {"zmq", "msgpack"} <= imported
    assert imported - {"zmq", "msgpack"} <= sys.stdlib_module_names
    assert "__import__" not in source and "importlib" not in source


def test_handshake_credit_methods_errors_and_stop(roles: Roles) -> None:
    proc = roles.start()
    small = np.arange(6, dtype=np.float32).reshape(2, 3)  # inline in the envelope
    big = np.linspace(0.0, 1.0, 1000)  # 8000 bytes: a frame of its own
    payload = {"s": "text", "n": [1, -2, 3.5, None, True], "b": b"\x00\xff", 7: {"k": []}}

    async def main() -> dict[str, Any]:
        credits: asyncio.Queue[int] = asyncio.Queue()
        events: asyncio.Queue[PeerEvent] = asyncio.Queue()
        client = Client(
            roles.endpoint,
            name="tester",
            on_credit=credits.put_nowait,
            on_event=events.put_nowait,
        )
        out: dict[str, Any] = {}
        try:
            out["hello"] = await client.connect(timeout=TIMEOUT)
            out["credit"] = await asyncio.wait_for(credits.get(), TIMEOUT)
            out["connected"] = await next_event(events, "connected")
            out["echo"] = await client.call("echo", payload)
            out["tensors"] = await client.call("echo", {"small": small, "big": [big]})
            out["upper"] = await client.call("upper", "hi", str)
            out["whoami"] = await client.call("whoami", None, dict[str, int | str])
            with pytest.raises(RemoteError) as unknown:
                await client.call("nope", 1)
            out["unknown"] = unknown.value
            with pytest.raises(RemoteError) as undecodable:
                await client.call("upper", 42)
            out["undecodable"] = undecodable.value
            client.send_stop()
            # The role closes its socket on STOP, which the client sees as a disconnect. The
            # client stays open until then: its linger 0 would drop a STOP still queued.
            out["disconnected"] = await next_event(events, "disconnected")
        finally:
            await client.close()
        return out

    out = run(main())
    assert proc.wait(timeout=TIMEOUT) == 0

    hello = out["hello"]
    assert isinstance(hello, Hello)
    assert hello == Hello(
        version=1, name="echo", pid=proc.pid, incarnation=0, host="", shm=False, run=roles.run
    )
    assert out["credit"] == CAPACITY
    assert out["connected"].incarnation == 0

    assert out["echo"] == payload
    tensors = out["tensors"]
    np.testing.assert_array_equal(tensors["small"], small)
    assert tensors["small"].dtype == np.float32
    np.testing.assert_array_equal(tensors["big"][0], big)

    assert out["upper"] == "HI!"
    assert out["whoami"] == {"role": "echo", "replica": REPLICA, "incarnation": 0, "pid": proc.pid}

    unknown = out["unknown"]
    assert unknown.code == "unknown_method"
    assert "echo has no method 'nope'; it serves: echo, upper, whoami" in str(unknown)
    assert out["undecodable"].code == "decode_error"


def test_sigterm_exits_cleanly(roles: Roles) -> None:
    proc = roles.start()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=TIMEOUT) == 0


def test_a_restart_on_the_same_endpoint_reaches_the_same_client(roles: Roles) -> None:
    first = roles.start(incarnation=0)
    second: list[subprocess.Popen[str]] = []

    def crash_and_restart() -> None:
        first.kill()
        first.wait()
        second.append(roles.start(incarnation=1))

    async def main() -> dict[str, Any]:
        credits: asyncio.Queue[int] = asyncio.Queue()
        events: asyncio.Queue[PeerEvent] = asyncio.Queue()
        client = Client(
            roles.endpoint, name="tester", on_credit=credits.put_nowait, on_event=events.put_nowait
        )
        out: dict[str, Any] = {}
        try:
            out["hello"] = await client.connect(timeout=TIMEOUT)
            out["credit"] = await asyncio.wait_for(credits.get(), TIMEOUT)
            out["before"] = await client.call("whoami")
            # In a thread, so that the loop keeps serving the client meanwhile.
            await asyncio.to_thread(crash_and_restart)
            out["disconnected"] = await next_event(events, "disconnected")
            out["restarted"] = await next_event(events, "restarted")
            out["credit_after"] = await asyncio.wait_for(credits.get(), TIMEOUT)
            out["after"] = await client.call("whoami")
            out["server"] = client.server
        finally:
            await client.close()
        return out

    out = run(main())
    assert first.returncode == -signal.SIGKILL
    (restarted,) = second

    assert out["hello"].incarnation == 0
    assert out["before"] == {"role": "echo", "replica": REPLICA, "incarnation": 0, "pid": first.pid}
    event = out["restarted"]
    assert (event.peer, event.kind, event.incarnation) == (roles.endpoint, "restarted", 1)
    assert out["credit_after"] == CAPACITY
    assert out["after"] == {
        "role": "echo",
        "replica": REPLICA,
        "incarnation": 1,
        "pid": restarted.pid,
    }
    assert out["server"].incarnation == 1
    assert out["server"].pid == restarted.pid

    restarted.send_signal(signal.SIGTERM)
    assert restarted.wait(timeout=TIMEOUT) == 0


class Dealer:
    """A bare DEALER: for the messages asyncrl's client never sends."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def send(self, envelope: Any) -> None:
        self.sock.send(envelope if isinstance(envelope, bytes) else msgpack.packb(envelope))

    def recv(self) -> list[Any]:
        assert self.sock.poll(int(TIMEOUT * 1000)), "no answer from the role"
        frames = self.sock.recv_multipart()
        assert len(frames) == 1
        env: list[Any] = msgpack.unpackb(frames[0], strict_map_key=False)
        assert len(env) == 10
        return env


def test_every_answer_carries_the_incarnation_and_bad_input_is_answered(
    roles: Roles,
) -> None:
    proc = roles.start(incarnation=3)
    dealer = Dealer(roles.endpoint)
    try:
        dealer.send([1, 1, 1, "", 0.0, 0, 0, "", {"version": 1}])  # a foreign client's Hello
        welcome = dealer.recv()
        credit = dealer.recv()
        dealer.send([1, 7, 5])  # a short PING: the other positions take their defaults
        pong = dealer.recv()
        dealer.send([1, 3, 6, "upper", 0.0, 0, 0, "", "abc", []])
        reply = dealer.recv()
        dealer.send(b"\xc1 not msgpack")
        garbage = dealer.recv()
        dealer.send([1, 3, 8, 42])  # method is not a string
        bad_method = dealer.recv()
        dealer.send([2, 3, 9, "echo"])
        version = dealer.recv()
        dealer.send([1, 3, 10, "echo", 1.0])  # a deadline long past
        late = dealer.recv()
        dealer.send([1, 4, 11])
        unexpected = dealer.recv()
        dealer.send([1, 42, 12])
        unknown_kind = dealer.recv()
        dealer.send([1, 3, 13, "echo", 0.0, 0, 0, "", msgpack.ExtType(1, b"\x00" * 4), []])
        dangling = dealer.recv()
        dealer.send([1, 9])
    finally:
        dealer.close()
    assert proc.wait(timeout=TIMEOUT) == 0

    assert welcome[:3] == [1, 2, 1]
    assert welcome[8] == {
        "version": 1,
        "name": "echo",
        "pid": proc.pid,
        "incarnation": 3,
        "host": "",
        "shm": False,
        "run": roles.run,
    }
    assert credit[:3] == [1, 6, 0] and credit[8] == {"slots": CAPACITY}
    assert pong[:3] == [1, 8, 5] and pong[8] is None
    assert reply[:3] == [1, 4, 6] and reply[8] == "ABC!"
    answers = [welcome, credit, pong, reply, garbage, bad_method, version, late]
    answers += [unexpected, unknown_kind, dangling]
    assert {env[6] for env in answers} == {3}

    def error(env: list[Any]) -> tuple[int, str, str]:
        assert env[1] == 5
        return env[2], env[8]["code"], env[8]["message"]

    assert error(garbage)[:2] == (0, "decode_error")
    assert error(bad_method)[:2] == (8, "decode_error")
    assert error(version) == (
        9,
        "protocol_version",
        "protocol version mismatch: this side speaks version 1, the peer speaks version 2; run "
        "the same asyncrl protocol version on both ends",
    )
    assert error(late)[:2] == (10, "deadline_exceeded") and late[8]["retryable"] is True
    assert error(unexpected)[:2] == (11, "unexpected_kind")
    assert error(unknown_kind)[:2] == (12, "unknown_kind")
    assert error(dangling)[:2] == (13, "bad_tensor")


def test_a_wrong_config_exits_with_ex_config(roles: Roles) -> None:
    proc = roles.spawn(config={"suffix": 3})
    out, _ = proc.communicate(timeout=TIMEOUT)
    assert out == ""
    assert proc.returncode == 78


def test_stop_only_from_the_supervisor_and_the_config_from_its_file(roles: Roles) -> None:
    """With the run's secret set, a STOP from a client of the run that did not present it as a
    controller is refused (the role keeps answering); the supervisor's STOP is obeyed. The config
    comes from ASYNCRL_CONFIG_FILE, which the agent always sets (the variable only for small
    configs)."""
    path = os.path.join(roles.run_dir, "echo.config.json")
    with open(path, "w") as f:
        json.dump({"suffix": "?"}, f)
    env = {"ASYNCRL_CONTROL_SECRET": "s3cret", "ASYNCRL_CONFIG_FILE": path, "ASYNCRL_CONFIG": ""}
    proc = roles.start(extra=env, config={})

    async def main() -> tuple[str, str]:
        events: asyncio.Queue[PeerEvent] = asyncio.Queue()
        async with Client(roles.endpoint, name="member", secret="s3cret") as stranger:
            stranger.send_stop()
            # The refusal comes back as an ERROR for the STOP's id, which no call waits on;
            # the next call is answered, so the role is still serving.
            first = await stranger.call("upper", "a", str)
        supervisor = Client(
            roles.endpoint,
            name="supervisor",
            control=True,
            secret="s3cret",
            on_event=events.put_nowait,
        )
        try:
            await supervisor.connect(timeout=TIMEOUT)
            second = await supervisor.call("upper", "b", str)
            supervisor.send_stop()
            await next_event(events, "disconnected")
        finally:
            await supervisor.close()
        return first, second

    assert run(main()) == ("A?", "B?")
    assert proc.wait(timeout=TIMEOUT) == 0


def test_a_peer_without_the_run_secret_is_served_nothing(roles: Roles) -> None:
    """The secret comes from the file ASYNCRL_SECRET_FILE names. A peer whose HANDSHAKE did not
    present it gets ERROR unauthorized for every call and is served nothing; a client with the
    secret is served."""
    path = os.path.join(roles.run_dir, "secret")
    write_secret(path, "s3cret")
    proc = roles.start(extra={"ASYNCRL_SECRET_FILE": path})
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(roles.endpoint)
        for message in (
            [1, 3, 1, "upper", 0.0, 0, 0, "", "a", []],  # a call, no handshake
            [1, 1, 2, "", 0.0, 0, 0, "", {"version": 1, "secret": "guess"}],
            [1, 3, 3, "upper", 0.0, 0, 0, "", "a", []],
        ):
            dealer.send(msgpack.packb(message))
            assert dealer.poll(TIMEOUT * 1000)
            env = msgpack.unpackb(dealer.recv())
            assert (env[1], env[2], env[8]["code"]) == (5, message[2], "unauthorized")
        assert env[8]["message"] == (
            "REQUEST refused: echo serves only the processes of its run; handshake first with "
            "the run's secret (Hello.secret, from the file ASYNCRL_SECRET_FILE names)"
        )
    finally:
        dealer.close(linger=0)
        ctx.term()

    async def main() -> str:
        intruder = Client(roles.endpoint, name="intruder")
        with pytest.raises(RemoteError, match="presented no secret"):
            await intruder.connect(timeout=TIMEOUT)
        await intruder.close()
        async with Client(roles.endpoint, name="member", secret="s3cret") as member:
            return str(await member.call("upper", "b", str))

    assert run(main()) == "B!"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0
