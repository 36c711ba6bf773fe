"""Fuzzing a live server: random and mutated frames from a raw DEALER, then a call that must work.

The server runs in its own process (tests/helpers/echo_server.py), with the run's secret in its
environment. The fuzzer presents it in a HANDSHAKE before each check, but never as a controller:
every STOP it sends must be refused. Fuzzed handshakes carry no secret, the right one, a wrong
one, an oversized one or one of the wrong type, and are counted as the server's admission
decides. After every example the same DEALER handshakes again, sends a correct ``add`` request
and waits for its reply: one connection is FIFO, so by then the server has handled the fuzzed
message. The answers to fuzzed messages are
drained without judging whether they come (the server may drop bad input silently), only that
they are valid envelopes. At the end the server is stopped with SIGTERM and its ``STATS`` line
must count every bad input exactly as this side's own codec classifies it.
"""

from __future__ import annotations

import ast
import math
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from asyncrl.transport import ChannelOptions, Client, run
from asyncrl.transport.codec import Codec
from asyncrl.transport.control import CONTROL_SECRET_ENV, secret_matches
from asyncrl.transport.errors import (
    DecodeError,
    MessageTooLargeError,
    ProtocolError,
    ProtocolVersionError,
    TensorDescriptorError,
    UnknownKindError,
)
from asyncrl.transport.protocol import (
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
from asyncrl.transport.shm import ShmReader
from tests.conftest import ServerProcess, start_server_process
from tests.helpers.echo_server import AddArgs

pytestmark = pytest.mark.slow

MAX_MESSAGE_BYTES = 64 * 1024  # the server's limit, so that oversized messages stay cheap
ANSWER_TIMEOUT_MS = 10_000
CHECK_IDS = 0x5EED << 32  # ids of the checking requests; fuzzed ids stay clear of them
# The request type of each method the fuzz may call, as tests/helpers/echo_server.py declares
# them. ``sleep`` and ``block`` are left out: they stall the server on purpose.
METHOD_TYPES: dict[str, Any] = {"echo": Any, "add": AddArgs, "sum": torch.Tensor, "fail": Any}
STALLING = ("sleep", "block")
SECRET = "the fuzzer's run secret"
BAD_INPUT_CODES = {
    DecodeError: ErrorCode.DECODE,
    UnknownKindError: ErrorCode.UNKNOWN_KIND,
    MessageTooLargeError: ErrorCode.TOO_LARGE,
    TensorDescriptorError: ErrorCode.BAD_TENSOR,
    ProtocolVersionError: ErrorCode.PROTOCOL_VERSION,
}
KNOWN_ERROR_CODES = {v for k, v in vars(ErrorCode).items() if not k.startswith("_")}


# -- a raw peer ---------------------------------------------------------------------------


class RawPeer:
    """A DEALER that sends whatever it is given and checks the server with ``add``."""

    def __init__(self, endpoint: str, secret: str = "") -> None:
        self.secret = secret  # presented in a HANDSHAKE before each check
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, b"fuzzer")
        self.sock.connect(endpoint)
        self.codec = Codec()
        self.checks = 0
        self.answers: Counter[int] = Counter()  # kinds of the drained answers

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def check(self) -> list[tuple[RawEnvelope, ErrorInfo | None]]:
        """Call ``add`` and assert its reply; return the answers that came before it."""
        self.checks += 1
        request_id = CHECK_IDS + self.checks
        a, b = self.checks, 1_000_000
        if self.secret:
            hello = Hello(PROTOCOL_VERSION, name="checker", secret=self.secret)
            self.send(self.codec.encode(Envelope(PROTOCOL_VERSION, Kind.HANDSHAKE, payload=hello)))
        self.send(
            self.codec.encode(
                Envelope(
                    PROTOCOL_VERSION, Kind.REQUEST, request_id, "add", payload={"a": a, "b": b}
                )
            )
        )
        before: list[tuple[RawEnvelope, ErrorInfo | None]] = []
        while True:
            if not self.sock.poll(ANSWER_TIMEOUT_MS):
                raise AssertionError(
                    f"no answer to check {self.checks} within {ANSWER_TIMEOUT_MS} ms: "
                    f"the server stopped answering"
                )
            frames = self.sock.recv_multipart()
            env = self.codec.decode_envelope(frames)  # whatever the server sends is valid
            if env.id == request_id and env.kind in (Kind.REPLY, Kind.ERROR):
                info = self._error_info(env, frames)
                assert env.kind == Kind.REPLY, f"check {self.checks} failed: {info}"
                assert self.codec.decode_payload(env, frames, int) == a + b
                return before
            self.answers[env.kind] += 1
            before.append((env, self._error_info(env, frames)))

    def _error_info(self, env: RawEnvelope, frames: list[bytes]) -> ErrorInfo | None:
        if env.kind != Kind.ERROR:
            return None
        info: ErrorInfo = self.codec.decode_payload(env, frames, ErrorInfo)
        assert info.code in KNOWN_ERROR_CODES, info
        return info


@contextmanager
def raw_peer(endpoint: str, secret: str = "") -> Iterator[RawPeer]:
    peer = RawPeer(endpoint, secret)
    try:
        yield peer
    finally:
        peer.close()


def _stats(server: ServerProcess) -> Counter[str]:
    """Stop the server with SIGTERM and read the counters it prints on the way out."""
    out = server.stop(signal.SIGTERM)
    assert server.proc.returncode == 0, out
    [line] = [line for line in out.splitlines() if line.startswith("STATS ")]
    return Counter(ast.literal_eval(line.removeprefix("STATS ")))


# -- what the server will count -----------------------------------------------------------


def _judge(codec: Codec, frames: list[bytes]) -> list[str] | None:
    """The counters the server bumps for ``frames``, found with a codec configured like its
    own and the same decisions (see Server._on_message); None for a message that would stop
    or stall the server."""
    try:
        env = codec.decode_envelope(frames)
    except ProtocolError as exc:
        return [BAD_INPUT_CODES[type(exc)]]
    type_: Any = None
    counts = []
    if env.kind == Kind.STOP:
        return ["control_refused"]  # the fuzzer never presents the secret as a controller
    if env.kind == Kind.REQUEST:
        if env.method in STALLING:
            return None
        counts.append("requests")
        if env.method not in METHOD_TYPES:
            return [*counts, "unknown_method"]
        if env.deadline and env.deadline < time.time():
            return [*counts, "expired"]
        type_ = METHOD_TYPES[env.method]
    elif env.kind == Kind.HANDSHAKE:
        type_ = Hello
    elif env.kind == Kind.RELEASE:
        type_ = Release
    if type_ is not None:
        try:
            # The fuzzer never handshakes from the server's host: shared memory is refused.
            payload = codec.decode_payload(env, frames, type_, allow_shm=False)
        except ProtocolError as exc:
            counts.append(BAD_INPUT_CODES[type(exc)])
        else:
            if type_ is Hello:
                counts += _admission(payload)
    return counts


def _admission(hello: Hello) -> list[str]:
    """What the server counts for a HANDSHAKE that decoded (admission.Gate's order)."""
    if hello.version != PROTOCOL_VERSION:
        return ["version_mismatch"]
    if hello.control and not secret_matches(SECRET, hello.control):
        return ["control_refused"]
    if secret_matches(SECRET, hello.secret or hello.control):
        return ["handshakes"]
    return ["secret_refused" if hello.secret else "unauthenticated"]


# -- strategies ---------------------------------------------------------------------------

INTS = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]),
)
IDS = INTS.filter(lambda i: not CHECK_IDS <= i < CHECK_IDS + 2**20)
MSGPACK = st.recursive(
    st.none() | st.booleans() | INTS | st.floats() | st.text(max_size=12) | st.binary(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
TORCH_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.int64,
    torch.bool,
    torch.uint8,
    torch.complex64,
    torch.float8_e4m3fn,
    torch.int4,  # type: ignore[attr-defined]  # bit-packed: a byte an element on the wire
]
NUMPY_DTYPES = ["<f4", ">f8", "|u1", "<i2", "|b1", ">c8"]


@st.composite
def tensors(draw: st.DrawFn) -> Any:
    shape = draw(st.sampled_from([(), (0,), (3,), (7, 5), (300,), (40, 40)]))
    if draw(st.booleans()):
        dtype = draw(st.sampled_from(TORCH_DTYPES))
        # Through uint8: torch cannot fill some dtypes (int4) itself.
        return (
            torch.zeros(math.prod(shape) * dtype.itemsize, dtype=torch.uint8)
            .view(dtype)
            .view(shape)
        )
    return np.zeros(shape, dtype=draw(st.sampled_from(NUMPY_DTYPES)))


PAYLOADS = st.one_of(
    st.fixed_dictionaries({"a": INTS, "b": INTS}),
    tensors(),
    st.lists(tensors() | MSGPACK, max_size=4),
    st.dictionaries(st.text(max_size=4), tensors() | MSGPACK, max_size=3),
    MSGPACK,
    st.builds(
        Hello,
        version=st.integers(0, 3),
        name=st.text(max_size=5),
        shm=st.booleans(),
        secret=st.sampled_from(["", SECRET, SECRET[:-1], "x" * 257]) | st.text(max_size=8),
        control=st.sampled_from(["", SECRET]) | st.text(max_size=3),
    ),
    st.fixed_dictionaries({"version": st.just(1), "secret": MSGPACK}),  # of any type
    st.builds(Release, slots=st.lists(INTS, max_size=3)),
)
KINDS = st.sampled_from(list(Kind))
METHODS = st.sampled_from(["add", "echo", "sum", "fail", "nope", "", "ADD"]) | st.text(max_size=8)
DEADLINES = st.sampled_from([0.0, 1.0, -1.0, 1e12, math.inf, -math.inf, math.nan])


@st.composite
def valid_messages(draw: st.DrawFn) -> list[bytes]:
    """A message as asyncrl itself writes it, tensors and frames included."""
    env = Envelope(
        PROTOCOL_VERSION,
        draw(KINDS),
        draw(IDS),
        draw(METHODS),
        draw(DEADLINES),
        draw(st.integers(0, 5)),
        draw(st.integers(0, 3)),
        draw(st.text(max_size=8)),
        draw(PAYLOADS),
    )
    return [bytes(frame) for frame in Codec().encode(env)]


def _ref(index: int, code: int = TENSOR_EXT, width: int = 4) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(code, index.to_bytes(width, "little"))


FIELD_VALUES = [
    st.sampled_from([0, 2, 3, 255, -1, 2**64 - 1]),  # version
    st.sampled_from([0, 12, 99, 255, 2**32, -1]) | KINDS,  # kind
    st.sampled_from([0, 2**63, 2**64 - 1, -(2**63)]) | IDS,  # id
    METHODS,  # method
    DEADLINES,  # deadline
    INTS,  # attempt
    INTS,  # incarnation
    st.text(max_size=8),  # trace
    st.builds(_ref, st.integers(0, 70))
    | st.builds(_ref, st.integers(0, 3), st.sampled_from([0, 2, 127]))
    | st.builds(_ref, st.integers(0, 3), st.just(TENSOR_EXT), st.sampled_from([1, 3, 8])),
    st.lists(MSGPACK, max_size=3),  # tensors
]
DESC_VALUES = [
    st.sampled_from(["torch", "numpy", "jax", ""]),  # lib
    st.sampled_from(
        [
            "float32",
            "float33",
            "bfloat16",
            "int4",
            "<f4",
            ">f8",
            "<f3",
            "|O",
            "(2,)<f4",
            "V0",
            "V8",
            "M8",
            "",
            "float64",
            "int8",
            "bool",
            "qint8",
        ]
    ),
    st.lists(st.integers(-3, 2**64 - 1) | st.sampled_from([0, 1, 2, 2**63]), max_size=70),
    st.integers(-1, 2**64 - 1) | st.integers(0, 5000),  # nbytes
    st.sampled_from([0, 1, 2, 3, 255, -1]),  # where
    st.binary(max_size=64),  # data
    st.sampled_from([-1, 0, 1, 2, 99]),  # frame
    st.sampled_from(
        ["", "../etc/passwd", "../../etc/passwd", "asyncrl.fuzz-none.1.0.1", "/dev/shm/x", ".."]
    ),  # segment
    st.integers(-1, 2**64 - 1),  # offset
    INTS,  # slot
]
DESC_DEFAULTS: list[Any] = ["torch", "float32", [1], 4, 0, b"\0\0\0\0", 0, "", 0, 0]

Mutation = Callable[[st.DrawFn, list[bytes]], list[bytes]]


def _envelope_list(frame: bytes) -> list[Any] | None:
    try:
        value = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, list) else None


def flip_bytes(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    frame = bytearray(frames[0])
    for _ in range(draw(st.integers(1, 4)) if frame else 0):
        frame[draw(st.integers(0, len(frame) - 1))] ^= draw(st.integers(1, 255))
    return [bytes(frame), *frames[1:]]


def truncate(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    return [frames[0][: draw(st.integers(0, max(len(frames[0]) - 1, 0)))], *frames[1:]]


def extend(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    return [frames[0] + draw(st.binary(min_size=1, max_size=40)), *frames[1:]]


def set_field(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    env = _envelope_list(frames[0])
    if env is None:
        return frames
    index = draw(st.integers(0, 9))
    value = draw(FIELD_VALUES[index] | MSGPACK)
    env = env + [None] * (index + 1 - len(env))
    env[index] = value
    return [msgspec.msgpack.encode(env), *frames[1:]]


def shorten_envelope(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    env = _envelope_list(frames[0])
    if env is None:
        return frames
    return [msgspec.msgpack.encode(env[: draw(st.integers(0, len(env)))]), *frames[1:]]


def break_descriptor(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    env = _envelope_list(frames[0])
    if env is None or len(env) < 10 or not isinstance(env[9], list):
        return frames
    if not env[9] or draw(st.booleans()):
        env[9].append(list(DESC_DEFAULTS))  # an extra descriptor, with a reference to it
        env[8] = [env[8], _ref(len(env[9]) - 1)]
    index = draw(st.integers(0, len(env[9]) - 1))
    desc = env[9][index]
    if isinstance(desc, list):
        desc = desc + DESC_DEFAULTS[len(desc) :]
        field = draw(st.integers(0, 9))
        desc[field] = draw(DESC_VALUES[field])
        env[9][index] = desc
    return [msgspec.msgpack.encode(env), *frames[1:]]


def add_frames(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    return frames + draw(st.lists(st.binary(max_size=64), min_size=1, max_size=4))


def drop_frames(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    return frames[: draw(st.integers(1, len(frames)))]


def oversize(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    return [*frames, bytes(MAX_MESSAGE_BYTES)]


MUTATIONS: list[Mutation] = [
    flip_bytes,
    truncate,
    extend,
    set_field,
    shorten_envelope,
    break_descriptor,
    add_frames,
    drop_frames,
    oversize,
]


@st.composite
def mutated_messages(draw: st.DrawFn) -> list[bytes]:
    frames = draw(valid_messages())
    for _ in range(draw(st.integers(1, 3))):
        frames = draw(st.sampled_from(MUTATIONS))(draw, frames)
    return frames


@st.composite
def requests_with_broken_descriptors(draw: st.DrawFn) -> list[bytes]:
    """A request to a served method whose tensor descriptors are wrong: the payload is decoded."""
    payload = draw(tensors() | st.lists(tensors(), min_size=1, max_size=3))
    env = Envelope(
        PROTOCOL_VERSION,
        Kind.REQUEST,
        draw(IDS),
        draw(st.sampled_from(sorted(METHOD_TYPES))),
        payload=payload,
    )
    frames = [bytes(frame) for frame in Codec().encode(env)]
    for _ in range(draw(st.integers(1, 2))):
        frames = break_descriptor(draw, frames)
    finish: Mutation = draw(st.sampled_from([add_frames, drop_frames, lambda d, f: f]))
    return finish(draw, frames)


MESSAGES = st.one_of(
    st.lists(st.binary(max_size=200), min_size=1, max_size=6),
    valid_messages(),
    mutated_messages(),
    requests_with_broken_descriptors(),
)


def _encoded(env: Envelope, *extra: bytes) -> list[bytes]:
    return [*(bytes(frame) for frame in Codec().encode(env)), *extra]


def _hello(hello: Any) -> list[bytes]:
    return _encoded(Envelope(PROTOCOL_VERSION, Kind.HANDSHAKE, 21, payload=hello))


def _shm_request(segment: str) -> list[bytes]:
    """A request whose tensor claims to sit in shared memory at ``segment``."""
    env = Envelope(
        PROTOCOL_VERSION,
        Kind.REQUEST,
        11,
        "echo",
        payload=_ref(0),
        tensors=[TensorDesc("numpy", "|u1", [4], 4, Where.SHM, segment=segment, slot=1)],
    )
    return [msgspec.msgpack.encode(env)]


def _bad_descriptor() -> list[bytes]:
    frames = _encoded(Envelope(PROTOCOL_VERSION, Kind.REQUEST, 4, "sum", payload=torch.ones(3)))
    env = msgspec.msgpack.decode(frames[0])
    env[9][0][3] = 99  # nbytes
    return [msgspec.msgpack.encode(env)]


# -- the tests ----------------------------------------------------------------------------


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


def test_the_server_survives_fuzzed_input(run_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    run_name = os.path.basename(run_dir)
    monkeypatch.setenv(CONTROL_SECRET_ENV, SECRET)
    server = start_server_process(
        f"ipc://{run_dir}/fuzz.sock",
        "--run",
        run_name,
        "--max-message-bytes",
        str(MAX_MESSAGE_BYTES),
    )
    judge = Codec(max_message_bytes=MAX_MESSAGE_BYTES, shm_reader=ShmReader())
    expected: Counter[str] = Counter()
    try:
        with raw_peer(server.endpoint, SECRET) as peer:
            peer.check()  # the server answers before any fuzz
            rss_before = _rss_kib(server.pid)

            @settings(
                max_examples=150,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            )
            @given(frames=MESSAGES)
            @example(frames=[b"garbage"])
            @example(frames=[b"", b"", b""])
            @example(frames=_encoded(Envelope(PROTOCOL_VERSION, 99, 1)))
            @example(frames=_encoded(Envelope(PROTOCOL_VERSION, 255, 2**64 - 1)))
            @example(frames=_encoded(Envelope(2, Kind.REQUEST, 3, "add")))
            @example(frames=_encoded(Envelope(PROTOCOL_VERSION, Kind.PING, 5), bytes(1 << 16)))
            @example(frames=_bad_descriptor())
            @example(frames=_encoded(Envelope(PROTOCOL_VERSION, Kind.REQUEST, 6, "nope")))
            @example(frames=[b"\x92\x01\x09"])  # the two-byte STOP
            @example(frames=_hello(Hello(PROTOCOL_VERSION)))  # no secret
            @example(frames=_hello(Hello(2, secret=SECRET)))
            @example(frames=_hello(Hello(PROTOCOL_VERSION, secret="guess")))
            @example(frames=_hello(Hello(PROTOCOL_VERSION, secret="x" * 300)))
            @example(frames=_hello({"version": 1, "secret": [SECRET]}))
            @example(frames=_hello(Hello(PROTOCOL_VERSION, control="guess", secret=SECRET)))
            @example(frames=_shm_request("../../etc/passwd"))
            @example(frames=_shm_request("asyncrl.fuzz.1.0.1"))
            def fuzz(frames: list[bytes]) -> None:
                counts = _judge(judge, frames)
                assume(counts is not None)
                assert counts is not None
                peer.send(frames)
                peer.check()
                expected.update(counts)

            fuzz()
            rss_after = _rss_kib(server.pid)

        async def call_add() -> int:
            options = ChannelOptions(run=run_name, shm=False)
            async with Client(server.endpoint, options=options, secret=SECRET) as client:
                result: int = await client.call("add", {"a": 20, "b": 22}, int, timeout=10)
                return result

        assert run(call_add()) == 42
        checks = peer.checks
        stats = _stats(server)
    finally:
        if server.proc.poll() is None:
            server.stop(signal.SIGKILL)

    # Every kind of bad input was sent, and the server counted each one exactly once.
    for code in (
        ErrorCode.DECODE,
        ErrorCode.UNKNOWN_KIND,
        ErrorCode.PROTOCOL_VERSION,
        ErrorCode.TOO_LARGE,
        ErrorCode.BAD_TENSOR,
    ):
        assert expected[code] > 0, code
        assert stats[code] == expected[code], (code, stats, expected)
    assert stats["requests"] == expected["requests"] + checks + 1
    assert stats["unknown_method"] == expected["unknown_method"]
    assert stats["stops"] == 0
    assert expected["control_refused"] > 0
    assert stats["control_refused"] == expected["control_refused"]
    assert stats["replies"] >= checks + 1
    # Every kind of handshake refusal was sent, and counted exactly once; the checks, after
    # each of them, were served.
    for counter in ("unauthenticated", "secret_refused", "version_mismatch"):
        assert expected[counter] > 0, counter
        assert stats[counter] == expected[counter], (counter, stats, expected)
    assert stats["handshakes"] == expected["handshakes"] + checks + 1
    # Nothing the fuzzer sent stayed in memory: at most a few MiB of caches and arenas.
    assert rss_after - rss_before < 32 * 1024, (rss_before, rss_after)


def test_a_bad_message_is_answered_with_its_id_and_code(server_process: ServerProcess) -> None:
    with raw_peer(server_process.endpoint) as peer:
        peer.send(_bad_descriptor())
        peer.send(_encoded(Envelope(PROTOCOL_VERSION, 99, 8)))
        peer.send([msgspec.msgpack.encode([1, 3, "not an id"])])
        answers = peer.check()
    assert [(env.kind, env.id, info and info.code) for env, info in answers] == [
        (Kind.ERROR, 4, ErrorCode.BAD_TENSOR),
        (Kind.ERROR, 8, ErrorCode.UNKNOWN_KIND),
        (Kind.ERROR, 0, ErrorCode.DECODE),
    ]
    assert answers[0][1] is not None and answers[0][1].message == (
        "tensor 0 (torch float32 [3]): nbytes is 99, but shape and dtype need 12"
    )
    stats = _stats(server_process)
    assert (stats["bad_tensor"], stats["unknown_kind"], stats["decode_error"]) == (1, 1, 1)


def test_a_deeply_nested_envelope_is_counted_and_answered(server_process: ServerProcess) -> None:
    with raw_peer(server_process.endpoint) as peer:
        # An envelope whose payload is nested 5000 deep: too deep even to skip.
        head = msgspec.msgpack.encode([1, 3, 7, "add", 0.0, 0, 0, ""])
        peer.send([b"\x9a" + head[1:] + b"\x91" * 5000 + b"\xc0" + b"\x90"])
        answers = peer.check()
    stats = _stats(server_process)
    assert [(env.kind, env.id, info) for env, info in answers] == [
        (
            Kind.ERROR,
            0,
            ErrorInfo(
                ErrorCode.DECODE,
                "frame 0 is not a valid envelope: maximum recursion depth exceeded while "
                "deserializing an object",
            ),
        )
    ]
    assert stats["decode_error"] == 1


def test_a_reply_that_cannot_be_encoded_is_answered_with_an_error(
    server_process: ServerProcess,
) -> None:
    with raw_peer(server_process.endpoint) as peer:
        peer.send(
            _encoded(
                Envelope(PROTOCOL_VERSION, Kind.REQUEST, 5, "add", payload={"a": 2**64 - 1, "b": 1})
            )
        )
        answers = peer.check()
    stats = _stats(server_process)
    assert [(env.kind, env.id, info) for env, info in answers] == [
        (
            Kind.ERROR,
            5,
            ErrorInfo(
                ErrorCode.BAD_REPLY,
                "the reply of 'add' cannot be encoded: can't serialize ints < -2**63 or "
                "> 2**64 - 1",
            ),
        )
    ]
    assert stats["bad_replies"] == 1
