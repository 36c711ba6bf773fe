"""An external asyncrl role in plain Python: only the standard library, pyzmq and msgpack.

The supervisor starts it as a manifest ``command:`` with the ``ASYNCRL_*`` environment variables
(see README.md next to this file). It binds a ROUTER on ``ASYNCRL_ENDPOINT`` (with CurveZMQ
when ``ASYNCRL_CURVE_KEYS`` names the run's key folder) and speaks the wire protocol of
docs/protocol.md as a server:

- HANDSHAKE -> WELCOME (its Hello), then a CREDIT of ``ASYNCRL_CAPACITY`` slots;
- PING -> PONG with the same id;
- REQUEST -> REPLY or ERROR with the same id; every envelope carries its incarnation;
- STOP, SIGTERM or SIGINT -> close the socket with linger 0 and exit 0.

Methods: ``echo`` (the payload back, tensors included), ``upper`` (a string in upper case, with
the config's ``suffix`` appended) and ``whoami`` (role, replica, incarnation and pid).

It prints ``READY`` on stdout once bound. Everything else it says goes to stderr.
"""

from __future__ import annotations

import ctypes
import errno
import hmac
import json
import os
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

VERSION = 1
HANDSHAKE, WELCOME, REQUEST, REPLY, ERROR, CREDIT, PING, PONG, STOP, RELEASE, MESSAGE = range(1, 12)
SERVER_REFUSES = {WELCOME, REPLY, ERROR, CREDIT, PONG, MESSAGE}
KIND_NAMES = {
    HANDSHAKE: "HANDSHAKE",
    REQUEST: "REQUEST",
    PING: "PING",
    STOP: "STOP",
    RELEASE: "RELEASE",
    WELCOME: "WELCOME",
    REPLY: "REPLY",
    ERROR: "ERROR",
    CREDIT: "CREDIT",
    PONG: "PONG",
    MESSAGE: "MESSAGE",
}
TENSOR_EXT = 1
INLINE, FRAME, SHM = 0, 1, 2
MAX_ID = 1 << 64
EXIT_CONFIG = 78  # EX_CONFIG: a configuration error; restarting the process cannot help

# Envelope positions: version, kind, id, method, deadline, attempt, incarnation, trace, payload,
# tensors. A reader accepts 2 to 10 elements; missing trailing ones take these defaults.
ENVELOPE_DEFAULTS: list[Any] = [None, None, 0, "", 0.0, 0, 0, "", None, []]
ENVELOPE_TYPES: list[tuple[str, Any]] = [
    ("version", int),
    ("kind", int),
    ("id", int),
    ("method", str),
    ("deadline", (int, float)),
    ("attempt", int),
    ("incarnation", int),
    ("trace", str),
    ("payload", object),
    ("tensors", list),
]
# TensorDesc positions: lib, dtype, shape, nbytes, where, data, frame, segment, offset, slot.
DESC_DEFAULTS: list[Any] = [None, None, None, None, None, b"", 0, "", 0, 0]
DESC_TYPES: list[tuple[str, Any]] = [
    ("lib", str),
    ("dtype", str),
    ("shape", list),
    ("nbytes", int),
    ("where", int),
    ("data", bytes),
    ("frame", int),
    ("segment", str),
    ("offset", int),
    ("slot", int),
]


# -- the contract: environment variables ----------------------------------------------------


class ConfigError(Exception):
    """The environment is not what the contract says; the process exits with EXIT_CONFIG."""


@dataclass(frozen=True)
class Settings:
    """What the supervisor passed in the ``ASYNCRL_*`` environment variables."""

    endpoint: str
    role: str
    replica: int
    incarnation: int
    run: str
    run_dir: str
    config: dict[str, Any]
    capacity: int
    curve: CurveKeys | None = None

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Settings:
        endpoint = env.get("ASYNCRL_ENDPOINT", "")
        if not endpoint:
            raise ConfigError("ASYNCRL_ENDPOINT is not set; the supervisor sets it")
        path = env.get("ASYNCRL_CONFIG_FILE")
        try:
            # The file always holds the config; the variable only a small one.
            if path:
                with open(path, encoding="utf-8") as f:
                    raw = f.read()
            else:
                raw = env.get("ASYNCRL_CONFIG") or "{}"
        except OSError as exc:
            raise ConfigError(f"ASYNCRL_CONFIG_FILE {path!r} cannot be read: {exc}") from exc
        try:
            config = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(f"ASYNCRL_CONFIG is not JSON: {exc}") from exc
        if not isinstance(config, dict):
            raise ConfigError(f"ASYNCRL_CONFIG must be a JSON object, got {config!r}")
        capacity = _int_var(env, "ASYNCRL_CAPACITY", 1)
        if capacity < 1:
            raise ConfigError(f"ASYNCRL_CAPACITY must be at least 1, got {capacity}")
        keys = env.get("ASYNCRL_CURVE_KEYS", "")
        return cls(
            endpoint=endpoint,
            role=env.get("ASYNCRL_ROLE", "echo"),
            replica=_int_var(env, "ASYNCRL_REPLICA", 0),
            incarnation=_int_var(env, "ASYNCRL_INCARNATION", 0),
            run=env.get("ASYNCRL_RUN", ""),
            run_dir=env.get("ASYNCRL_RUN_DIR", "."),
            config=config,
            capacity=capacity,
            curve=CurveKeys.load(keys) if keys else None,
        )


@dataclass(frozen=True)
class CurveKeys:
    """The run's Curve keys (``ASYNCRL_CURVE_KEYS``, a folder ``asyncrl keys generate`` wrote):
    the server pair it serves with, and the client public keys it admits (the run's, and those
    in ``authorized/``). The supervisor sets the variable when the endpoint is tcp in a run with
    Curve on (a node other than 0): every tcp peer of the run then speaks Curve."""

    public: bytes
    secret: bytes
    clients: frozenset[bytes]

    @classmethod
    def load(cls, folder: str) -> CurveKeys:
        try:
            public, secret = zmq.auth.load_certificate(os.path.join(folder, "server.key_secret"))
            clients = {zmq.auth.load_certificate(os.path.join(folder, "client.key"))[0]}
            if os.path.isdir(os.path.join(folder, "authorized")):
                clients |= set(zmq.auth.load_certificates(os.path.join(folder, "authorized")))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"ASYNCRL_CURVE_KEYS {folder!r}: {exc}") from exc
        if secret is None:
            raise ConfigError(f"ASYNCRL_CURVE_KEYS {folder!r}: server.key_secret holds no secret")
        return cls(public, secret, frozenset(clients))

    def callback(self, domain: str, client_key: bytes) -> bool:
        """pyzmq's ZAP credentials callback: admit the run's client keys only."""
        return client_key in self.clients


def _int_var(env: dict[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None


# -- the methods ------------------------------------------------------------------------------


class DecodeError(Exception):
    """The message or its payload does not decode: answered ``decode_error``."""


class BadTensor(Exception):
    """A tensor descriptor or reference is wrong: answered ``bad_tensor``."""


@dataclass
class Request:
    """One decoded REQUEST, as a method sees it."""

    method: str
    payload: Any
    tensors: list[Any]  # the envelope's descriptors, already checked
    frames: list[bytes]  # the tensor frames after the envelope
    attempt: int
    trace: str


@dataclass
class Reply:
    """A method's result with tensors: descriptors and the frames they number from 1."""

    payload: Any
    tensors: list[Any] = field(default_factory=list)
    frames: list[bytes] = field(default_factory=list)


class EchoRole:
    """The methods of the example. Each takes a Request and returns a value or a Reply."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        suffix = settings.config.get("suffix", "")
        if not isinstance(suffix, str):
            raise ConfigError(f"config option suffix must be a string, got {suffix!r}")
        self.suffix = suffix
        self.methods: dict[str, Callable[[Request], Any]] = {
            "echo": self.echo,
            "upper": self.upper,
            "whoami": self.whoami,
        }

    def echo(self, req: Request) -> Reply:
        # Tensor references in the payload index the request's descriptors, whose frame numbers
        # count from the envelope: sending both back unchanged, with the same frames, keeps them.
        return Reply(req.payload, req.tensors, req.frames)

    def upper(self, req: Request) -> str:
        if not isinstance(req.payload, str):
            raise DecodeError(f"upper takes a string, got {type(req.payload).__name__}")
        return req.payload.upper() + self.suffix

    def whoami(self, req: Request) -> dict[str, Any]:
        s = self.settings
        return {
            "role": s.role,
            "replica": s.replica,
            "incarnation": s.incarnation,
            "pid": os.getpid(),
        }


# -- decoding ---------------------------------------------------------------------------------


def peek(frame: bytes) -> tuple[Any, int]:
    """Position 0 (the version) and position 2 (the id, or 0) of a frame that may not decode."""
    version: Any = None
    request_id = 0
    try:
        unpacker = msgpack.Unpacker(strict_map_key=False)
        unpacker.feed(frame)
        size = unpacker.read_array_header()
        if size >= 1:
            version = unpacker.unpack()
        if size >= 3:
            unpacker.skip()
            value = unpacker.unpack()
            if type(value) is int and 0 <= value < MAX_ID:
                request_id = value
    except Exception:
        pass
    return version, request_id


def _check_fields(values: list[Any], types: list[tuple[str, Any]], what: str) -> None:
    for (name, expected), value in zip(types, values, strict=False):
        # bool is an int in Python, but not on the wire: a MessagePack bool is refused.
        if expected is not object and (isinstance(value, bool) or not isinstance(value, expected)):
            raise DecodeError(f"{what} field {name} has the wrong type: {value!r}")


def decode_envelope(frame: bytes) -> list[Any]:
    """The envelope of frame 0 as a list of all 10 positions, its types checked."""
    try:
        env = msgpack.unpackb(frame, strict_map_key=False)
    except Exception as exc:
        raise DecodeError(f"frame 0 is not one MessagePack value: {exc}") from None
    if not isinstance(env, list) or len(env) < 2:
        raise DecodeError("frame 0 is not a MessagePack array of at least 2 elements")
    env = env[:10] + ENVELOPE_DEFAULTS[len(env) :]
    _check_fields(env, ENVELOPE_TYPES, "envelope")
    if not 0 <= env[2] < MAX_ID:
        raise DecodeError(f"envelope id {env[2]} is out of range")
    return env


def check_tensors(descs: list[Any], frames: list[bytes]) -> list[Any]:
    """Check each descriptor against the bytes; frames[0] is the envelope."""
    out = []
    for i, desc in enumerate(descs):
        if not isinstance(desc, list) or len(desc) < 5:
            raise DecodeError(f"tensor descriptor {i} is not an array of at least 5 elements")
        full = desc[:10] + DESC_DEFAULTS[len(desc) :]
        _check_fields(full, DESC_TYPES, f"tensor descriptor {i}")
        shape, nbytes, where, data, frame = full[2], full[3], full[4], full[5], full[6]
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise BadTensor(f"tensor {i}: shape {shape} is not a list of sizes >= 0")
        if where == INLINE:
            if len(data) != nbytes:
                raise BadTensor(f"tensor {i}: {len(data)} inline bytes, nbytes says {nbytes}")
        elif where == FRAME:
            if not 1 <= frame < len(frames):
                raise BadTensor(f"tensor {i}: frame {frame} is not in 1..{len(frames) - 1}")
            if len(frames[frame]) != nbytes:
                raise BadTensor(f"tensor {i}: frame {frame} has {len(frames[frame])} bytes")
        elif where == SHM:
            raise BadTensor(f"tensor {i} is in shared memory, which this role refused (shm false)")
        else:
            raise BadTensor(f"tensor {i}: where {where} is not 0, 1 or 2")
        out.append(desc)
    return out


def check_references(payload: Any, count: int) -> None:
    """Every extension in the payload is a tensor reference to one of ``count`` descriptors."""
    stack = [payload]
    while stack:  # a loop, not recursion: payloads may nest deeply
        value = stack.pop()
        if isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value)
            stack.extend(value.values())
        elif isinstance(value, msgpack.ExtType):
            if value.code != TENSOR_EXT or len(value.data) != 4:
                raise BadTensor(f"extension type {value.code} of {len(value.data)} bytes")
            index = int.from_bytes(value.data, "little")
            if index >= count:
                raise BadTensor(f"tensor reference {index}, but only {count} descriptors")


# -- the server -------------------------------------------------------------------------------


class Server:
    """The ROUTER inbox and its loop: one message at a time, answered before the next."""

    def __init__(self, settings: Settings, role: EchoRole) -> None:
        self.settings = settings
        self.role = role
        self.inc = settings.incarnation
        self.stats: Counter[str] = Counter()
        self.stop_reason = ""
        # With the run's secret, only peers whose HANDSHAKE carried it are served (members), and
        # STOP is obeyed only from those that carried it as controllers: the supervisor's.
        self.secret = run_secret()
        self.members: set[bytes] = set()
        self.controllers: set[bytes] = set()
        self.ctx = zmq.Context()
        self.auth: ThreadAuthenticator | None = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 10_000)
        self.sock.setsockopt(zmq.RCVHWM, 10_000)

    def bind(self) -> None:
        endpoint = self.settings.endpoint
        keys = self.settings.curve
        if keys is not None and endpoint.startswith("tcp://"):
            # CURVE server (docs/protocol.md#security): its secret key, and a ZAP handler that
            # refuses a client whose key is not the run's before any message reaches us.
            self.auth = ThreadAuthenticator(self.ctx)
            self.auth.start()
            self.auth.configure_curve_callback(domain="asyncrl", credentials_provider=keys)
            self.sock.curve_secretkey = keys.secret
            self.sock.curve_publickey = keys.public
            self.sock.curve_server = True
            self.sock.zap_domain = b"asyncrl"
        if endpoint.startswith("ipc://"):
            # The supervisor's socket directory may not exist yet. zmq replaces a socket file left
            # by a dead incarnation, so a restarted process binds the same path again.
            os.makedirs(os.path.dirname(endpoint[len("ipc://") :]) or ".", exist_ok=True)
        self.sock.bind(endpoint)

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()

    # The signal handler only records the signal. The wakeup fd wakes the poll below; a flag
    # alone would not, as pyzmq resumes an interrupted poll after running the Python handler.

    def on_signal(self, signum: int, frame: Any) -> None:
        self.stop_reason = signal.Signals(signum).name

    def serve(self) -> None:
        """Answer messages until STOP or a signal."""
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        old_wakeup = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        try:
            poller = zmq.Poller()
            poller.register(self.sock, zmq.POLLIN)
            poller.register(wake_r, zmq.POLLIN)
            while not self.stop_reason:
                ready = dict(poller.poll())
                if wake_r in ready:
                    try:
                        while wake_r.recv(512):
                            pass
                    except BlockingIOError:
                        pass
                if self.sock in ready:
                    self.drain()
        finally:
            signal.set_wakeup_fd(old_wakeup)
            wake_r.close()
            wake_w.close()

    def drain(self) -> None:
        while not self.stop_reason:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.on_message(frames[0], frames[1:])
            except Exception as exc:  # a bug in one message must not stop the others
                self.stats["internal_errors"] += 1
                log(f"dropped a message whose handling raised {exc!r}")

    # -- receiving --------------------------------------------------------------------------

    def on_message(self, identity: bytes, frames: list[bytes]) -> None:
        version, salvaged = peek(frames[0])
        # The version comes first and from position 0 alone, whatever the rest looks like.
        if type(version) is int and version != VERSION:
            self.error(
                identity,
                salvaged,
                "protocol_version",
                f"protocol version mismatch: this side speaks version {VERSION}, the peer speaks "
                f"version {version}; run the same asyncrl protocol version on both ends",
            )
            return
        try:
            env = decode_envelope(frames[0])
        except DecodeError as exc:
            self.error(identity, salvaged, "decode_error", str(exc))
            return
        kind, request_id = env[1], env[2]
        if self.secret and kind != HANDSHAKE and identity not in self.members:
            self.stats["unauthenticated"] += 1
            if kind not in (PING, RELEASE):  # those are dropped without an answer
                name = KIND_NAMES.get(kind, f"kind {kind}")
                self.error(
                    identity,
                    request_id,
                    "unauthorized",
                    f"{name} refused: {self.settings.role} serves only the processes of its run; "
                    f"handshake first with the run's secret (Hello.secret, from the file "
                    f"ASYNCRL_SECRET_FILE names)",
                )
            return
        if kind == REQUEST:
            self.request(identity, env, frames)
        elif kind == PING:
            self.send(identity, PONG, request_id)
        elif kind == HANDSHAKE:
            self.handshake(identity, env)
        elif kind == STOP:
            if identity in self.controllers or (
                not self.secret and self.settings.endpoint.startswith("ipc://")
            ):
                self.stop_reason = "STOP"
            else:
                self.stats["control_refused"] += 1
                self.error(
                    identity,
                    request_id,
                    "unauthorized",
                    "STOP refused: only the supervisor (a peer that presented the run's control "
                    "secret in its HANDSHAKE) may stop this role",
                )
        elif kind == RELEASE:
            # This role never lends shared memory, so there is nothing to take back.
            slots = env[8].get("slots") if isinstance(env[8], dict) else None
            if not isinstance(slots, list):
                self.error(identity, request_id, "decode_error", "RELEASE without slots")
        elif kind in SERVER_REFUSES:
            self.error(
                identity,
                request_id,
                "unexpected_kind",
                f"a server does not accept {KIND_NAMES[kind]} messages",
            )
        else:
            self.error(identity, request_id, "unknown_kind", f"unknown message kind {kind}")

    def handshake(self, identity: bytes, env: list[Any]) -> None:
        hello, request_id = env[8], env[2]
        if (
            not isinstance(hello, dict)
            or isinstance(hello.get("version"), bool)
            or not isinstance(hello.get("version"), int)
        ):
            self.error(identity, request_id, "decode_error", "HANDSHAKE payload is not a Hello")
            return
        if hello["version"] != VERSION:
            name = hello.get("name", "")
            peer = f"the peer {name}" if isinstance(name, str) and name else "the peer"
            self.error(
                identity,
                request_id,
                "protocol_version",
                f"protocol version mismatch: this side speaks version {VERSION}, {peer} speaks "
                f"version {hello['version']}; run the same asyncrl protocol version on both ends",
            )
            return
        control, secret = hello.get("control", ""), hello.get("secret", "")
        self.members.discard(identity)
        self.controllers.discard(identity)
        if control and not self.matches(control):
            self.error(identity, request_id, "unauthorized", "wrong control secret")
            return
        if self.secret and not self.matches(secret or control):
            self.stats["unauthenticated"] += 1
            self.error(
                identity,
                request_id,
                "unauthorized",
                f"{self.settings.role} serves only the processes of its run: the HANDSHAKE "
                f"presented {'a wrong' if secret else 'no'} secret (Hello.secret); read it from "
                f"the file ASYNCRL_SECRET_FILE names (RUN_DIR/secret)",
            )
            return
        self.members.add(identity)
        if control:
            self.controllers.add(identity)
        s = self.settings
        welcome = {
            "version": VERSION,
            "name": s.role,
            "pid": os.getpid(),
            "incarnation": s.incarnation,
            "host": "",
            "shm": False,
            "run": s.run,
        }
        self.stats["handshakes"] += 1
        if self.send(identity, WELCOME, request_id, welcome):
            self.send(identity, CREDIT, 0, {"slots": s.capacity})

    def matches(self, presented: object) -> bool:
        """Whether ``presented`` is the run's secret (compared in constant time)."""
        return bool(
            self.secret
            and isinstance(presented, str)
            and hmac.compare_digest(presented.encode(), self.secret.encode())
        )

    def request(self, identity: bytes, env: list[Any], frames: list[bytes]) -> None:
        request_id, method, deadline = env[2], env[3], env[4]
        self.stats["requests"] += 1
        handler = self.role.methods.get(method)
        if handler is None:
            served = ", ".join(sorted(self.role.methods))
            self.error(
                identity,
                request_id,
                "unknown_method",
                f"{self.settings.role} has no method {method!r}; it serves: {served}",
            )
            return
        if deadline and deadline < time.time():
            self.error(
                identity,
                request_id,
                "deadline_exceeded",
                f"request {request_id} to {method!r} arrived after its deadline",
                retryable=True,
            )
            return
        try:
            tensors = check_tensors(env[9], frames)
            check_references(env[8], len(tensors))
            result = handler(Request(method, env[8], tensors, frames[1:], env[5], env[7]))
        except DecodeError as exc:
            self.error(identity, request_id, "decode_error", str(exc))
            return
        except BadTensor as exc:
            self.error(identity, request_id, "bad_tensor", str(exc))
            return
        except Exception as exc:
            self.stats["handler_errors"] += 1
            self.error(
                identity,
                request_id,
                "handler_error",
                str(exc) or repr(exc),
                type_=type(exc).__qualname__,
                retryable=getattr(exc, "retryable", False) is True,
            )
            return
        reply = result if isinstance(result, Reply) else Reply(result)
        try:
            self.send(identity, REPLY, request_id, reply.payload, reply.tensors, reply.frames)
        except (TypeError, ValueError, OverflowError) as exc:  # msgpack cannot pack the result
            message = f"the reply of {method!r} cannot be encoded: {exc}"
            self.error(identity, request_id, "bad_reply", message)

    # -- sending ----------------------------------------------------------------------------

    def send(
        self,
        identity: bytes,
        kind: int,
        request_id: int,
        payload: Any = None,
        tensors: list[Any] | None = None,
        frames: list[bytes] | None = None,
    ) -> bool:
        """Send one message; True if zmq took it. A gone or full client loses it (counted).

        Raises:
            TypeError, ValueError, OverflowError: msgpack cannot pack the payload.
        """
        env = [VERSION, kind, request_id, "", 0.0, 0, self.inc, "", payload, tensors or []]
        message = [identity, msgpack.packb(env), *(frames or [])]
        try:
            self.sock.send_multipart(message, zmq.NOBLOCK)
        except zmq.Again:
            self.stats["dropped_queue_full"] += 1
            return False
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self.stats["dropped_unreachable"] += 1  # ROUTER_MANDATORY: the client is gone
            return False
        return True

    def error(
        self,
        identity: bytes,
        request_id: int,
        code: str,
        message: str,
        *,
        type_: str = "",
        retryable: bool = False,
    ) -> None:
        self.stats[code] += 1
        info: dict[str, Any] = {"code": code, "message": message}
        if type_:
            info["type"] = type_
        if retryable:
            info["retryable"] = True
        self.send(identity, ERROR, request_id, info)


def run_secret() -> str:
    """The run's secret: the file ASYNCRL_SECRET_FILE names (0600, written by the node agent),
    else ASYNCRL_CONTROL_SECRET; "" outside a run (then every peer is served)."""
    path = os.environ.get("ASYNCRL_SECRET_FILE", "")
    if not path:
        return os.environ.get("ASYNCRL_CONTROL_SECRET", "")
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read(300).strip()
    except OSError as exc:
        raise ConfigError(f"ASYNCRL_SECRET_FILE {path!r} cannot be read: {exc}") from exc
    if not secret:
        raise ConfigError(f"ASYNCRL_SECRET_FILE {path!r} holds no secret")
    return secret


def log(message: str) -> None:
    print(f"echo_role: {message}", file=sys.stderr, flush=True)


def die_with_parent() -> None:
    """Die with the supervisor, even if it is killed with SIGKILL (Linux): ask the kernel for
    SIGKILL when the parent goes, then check the parent did not go before the request."""
    parent = os.environ.get("ASYNCRL_PARENT_PID")
    if not parent or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != int(parent):
        os._exit(1)


def main() -> int:
    die_with_parent()
    try:
        settings = Settings.from_env(dict(os.environ))
        role = EchoRole(settings)
        server = Server(settings, role)
    except ConfigError as exc:
        log(f"configuration error: {exc}")
        return EXIT_CONFIG
    # Handlers first: a SIGTERM that arrives while binding still ends in a clean exit.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.on_signal)
    try:
        try:
            server.bind()
        except zmq.ZMQError as exc:
            log(f"cannot bind {settings.endpoint}: {exc}")
            return 1
        print("READY", flush=True)
        server.serve()
        stats = ", ".join(f"{k}={v}" for k, v in sorted(server.stats.items())) or "none"
        log(f"{settings.role}.{settings.replica} stopping on {server.stop_reason}; stats: {stats}")
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
