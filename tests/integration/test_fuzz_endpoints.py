"""Fuzzing the other endpoints: the external role, and a client's inbound path.

The external role (examples/external_role/echo_role.py) gets the messages of the server fuzz
(tests/integration/test_server_fuzz.py) from a raw DEALER, STOP left out: started without a run's
secret, on ipc, that example (like asyncrl's own servers) obeys STOP from any peer. A client (in
its own process, the ``_client`` mode of tools/fuzz.py) hears the same garbage from a fake server
before each right answer, the way a supervisor's or driver's client would hear a hostile role.
After every example the target answers a valid call correctly; at the end its resident set has
not grown by more than a few MiB.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, assume, given, settings

from asyncrl.transport.codec import Codec
from asyncrl.transport.protocol import PROTOCOL_VERSION, Envelope, Hello, Kind
from tests.conftest import ROOT
from tests.integration.test_server_fuzz import MESSAGES

pytestmark = pytest.mark.slow

RSS_GROWTH_LIMIT_KIB = 32 * 1024


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "fuzz_tool", os.path.join(ROOT, "tools", "fuzz.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_tool"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


fuzz = _tool()


def _kind(frames: list[bytes]) -> Any:
    try:
        raw = msgspec.msgpack.decode(frames[0])
    except (msgspec.DecodeError, RecursionError):
        return None
    return raw[1] if isinstance(raw, list) and len(raw) > 1 else None


@pytest.fixture
def external_role(run_dir: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc, endpoint = fuzz.start_external_role(run_dir)
    yield proc, endpoint
    fuzz.stop_process(proc)


def test_the_external_role_survives_fuzzed_input(
    external_role: tuple[subprocess.Popen[str], str],
) -> None:
    proc, endpoint = external_role
    peer = fuzz.RawDealer(endpoint, fuzz._upper_check)
    try:
        assert peer.check()
        rss_before = fuzz.rss_kib(proc.pid)

        @settings(
            max_examples=150,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(frames=MESSAGES)
        def run_one(frames: list[bytes]) -> None:
            assume(_kind(frames) != Kind.STOP)
            fuzz._move_off_check_ids(frames)
            peer.sock.send_multipart(frames)
            assert peer.check()
            assert proc.poll() is None

        run_one()
        assert fuzz.rss_kib(proc.pid) - rss_before < RSS_GROWTH_LIMIT_KIB
    finally:
        peer.close()


class FakeServer:
    """A raw ROUTER that a fuzzed client (tools/fuzz.py ``_client``) calls ``check(n)`` on."""

    def __init__(self, run_dir: str) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"ipc://{run_dir}/fake.sock"
        self.router.bind(self.endpoint)
        self.codec = Codec()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tools", "fuzz.py"), "_client", self.endpoint],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.identity = b""
        self.pending = (0, 0)  # (request id, n) of the call waiting for its answer
        self.next_request()
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().startswith("READY ")

    def next_request(self) -> None:
        """Serve handshakes and pings until the client's next ``check`` request arrives."""
        while True:
            assert self.router.poll(30_000), "the client stopped calling"
            self.identity, *frames = self.router.recv_multipart()
            env = self.codec.decode_envelope(frames)
            if env.kind == Kind.HANDSHAKE:
                welcome = Hello(PROTOCOL_VERSION, name="fake", host="elsewhere")
                self.send(Envelope(PROTOCOL_VERSION, Kind.WELCOME, env.id, payload=welcome))
            elif env.kind == Kind.PING:
                self.send(Envelope(PROTOCOL_VERSION, Kind.PONG, env.id))
            elif env.kind == Kind.REQUEST:
                self.pending = (env.id, self.codec.decode_payload(env, frames))
                return

    def send(self, env: Envelope) -> None:
        self.router.send_multipart([self.identity, *self.codec.encode(env)])

    def answer(self, garbage: list[bytes]) -> str:
        """Send ``garbage``, then the right answer; return the client's verdict line."""
        request_id, n = self.pending
        if garbage:
            fuzz._avoid_id(garbage, request_id)
            self.router.send_multipart([self.identity, *garbage])
        self.send(Envelope(PROTOCOL_VERSION, Kind.REPLY, request_id, payload=n + 1))
        assert self.proc.stdout is not None
        verdict = self.proc.stdout.readline().strip()
        self.next_request()
        return verdict

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send(Envelope(PROTOCOL_VERSION, Kind.REPLY, self.pending[0], payload="stop"))
        try:
            self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
        self.router.close(linger=0)
        self.ctx.term()


def test_a_client_survives_a_server_that_answers_garbage(run_dir: str) -> None:
    server = FakeServer(run_dir)
    try:
        assert server.answer([]) == "OK 1"
        rss_before = fuzz.rss_kib(server.proc.pid)

        @settings(
            max_examples=150,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(frames=MESSAGES)
        def run_one(frames: list[bytes]) -> None:
            n = server.pending[1]
            assert server.answer(frames) == f"OK {n}"

        run_one()
        assert server.proc.poll() is None
        assert fuzz.rss_kib(server.proc.pid) - rss_before < RSS_GROWTH_LIMIT_KIB
    finally:
        server.close()
    assert server.proc.returncode == 0


def test_every_target_survives_a_short_random_fuzz() -> None:
    results = fuzz.fuzz_all(3000, seed=7, batch=250, targets=["server", "external", "client"])
    assert [r.target for r in results] == ["server", "external", "client"]
    for result in results:
        assert result.inputs == 1000, result.line()
        assert (result.crashes, result.wrong) == (0, 0), (result.line(), result.notes)
        assert result.rss_after_kib - result.rss_before_kib < RSS_GROWTH_LIMIT_KIB, result.line()
