"""The run's secret: who may call a server of a run at all, and who may control it (STOP).

The node agent makes a random secret for each run and writes it into a file only this user can
read (``RUN_DIR/secret``, mode 0600 in the 0700 run directory), and names that file in the
environment variable ``ASYNCRL_SECRET_FILE`` of every process it starts; the secret itself is
not in the environment. Every client of those processes presents it in its HANDSHAKE
(``Hello.secret``), and every server refuses any other message from a peer whose handshake did
not present it (``admission.py``). A tool outside the run (``asyncrl status``) reads the file of
the run it is pointed at.

Control messages (STOP) additionally need the secret under ``Hello.control``, which only the
supervisor's clients send (``control=True``). Every process of a run can read the secret, so
this keeps a role's ordinary clients from stopping a peer by mistake; it does not keep a
process of the run from doing so on purpose.

A process reads the secret file once, at its first client or server, and keeps presenting what
it read: a process left over from an earlier run, whose run directory a new run has reused,
presents the earlier run's secret and is refused, instead of reading the new run's from the same
path. A process forked from the zygote inherits what its zygote read, the zygote being of the same
run. A process that writes a secret file (``write_secret``: the node agent starting a run)
presents what it wrote from then on.

HTTP endpoints a program serves (the OpenAI-compatible one) require the run's *API key*, a key
derived from the secret (``api_key``), so that it is the same on every node and across a
driver's restarts without travelling anywhere, and that holding it does not give the secret
away. The node agent writes it beside the secret (``RUN_DIR/api_key``, 0600) for agent
programs outside the run; ``run_api_key`` gives it to a process of the run.

``ASYNCRL_CONTROL_SECRET``, the secret itself in the environment, is still read when no file is
named (a server or client used by hand, outside a run).

A server that has no secret (outside a run) serves every peer, and accepts control messages only
on an ``ipc://`` or ``inproc://`` endpoint: the socket file is private to this user (see
``sockets.bind``), so only a process that could signal the server anyway reaches it. On TCP,
where any local user can connect, it refuses them.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Mapping

from .errors import TransportError
from .protocol import MAX_SECRET

__all__ = [
    "API_KEY_FILE",
    "CONTROL_SECRET_ENV",
    "SECRET_FILE",
    "SECRET_FILE_ENV",
    "api_key",
    "new_secret",
    "read_secret",
    "run_api_key",
    "run_secret",
    "secret_matches",
    "write_secret",
]

SECRET_FILE_ENV = "ASYNCRL_SECRET_FILE"
"""The environment variable that names the file holding the run's secret."""

CONTROL_SECRET_ENV = "ASYNCRL_CONTROL_SECRET"
"""The environment variable that may hold the secret itself (read when no file is named)."""

SECRET_FILE = "secret"
"""The name of the secret's file in a run directory (a node's directory in a launch)."""

API_KEY_FILE = "api_key"
"""The name of the API key's file, beside the secret's."""

_known: dict[str, str] = {}
"""The secrets this process has read or written, by the absolute path of their file."""


def new_secret() -> str:
    """A fresh random secret (32 hex digits)."""
    return secrets.token_hex(16)


def read_secret(path: str) -> str:
    """The secret held in the file ``path`` (surrounding whitespace removed).

    Raises:
        TransportError: the file cannot be read, is empty, or holds more than ``MAX_SECRET``
            characters.
    """
    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read(MAX_SECRET + 2).strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise TransportError(
            f"cannot read the run's secret from {path} ({exc}); {SECRET_FILE_ENV} must name "
            f"the secret file of a running run (RUN_DIR/{SECRET_FILE})"
        ) from exc
    if not secret or len(secret) > MAX_SECRET:
        raise TransportError(
            f"{path} holds no secret (empty, or over {MAX_SECRET} characters); it must be "
            f"the secret file of a running run (RUN_DIR/{SECRET_FILE})"
        )
    return secret


def run_secret(environ: Mapping[str, str] | None = None) -> str | None:
    """The run's secret: from the file named by ``ASYNCRL_SECRET_FILE`` (read once a process,
    see the module's docstring), else ``ASYNCRL_CONTROL_SECRET``; None when neither is set
    (outside a run).

    Raises:
        TransportError: ``ASYNCRL_SECRET_FILE`` names a file that holds no readable secret
            (a server must not silently serve everyone instead).
    """
    env = os.environ if environ is None else environ
    path = env.get(SECRET_FILE_ENV)
    if path:
        known = _known.get(os.path.abspath(path))
        if known is None:
            known = _known[os.path.abspath(path)] = read_secret(path)
        return known
    return env.get(CONTROL_SECRET_ENV) or None


def write_secret(path: str, secret: str) -> None:
    """Write ``secret`` into ``path``, readable and writable by this user only (0600), whatever
    the umask; atomically, through a fresh temporary file that follows no link. This process's
    clients and servers present it from then on.

    Raises:
        OSError: the file cannot be written.
    """
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secret.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError:
        os.unlink(tmp)
        raise
    _known[os.path.abspath(path)] = secret


def api_key(secret: str) -> str:
    """The API key of the run whose secret is ``secret``: 40 hex digits of
    HMAC-SHA256(secret, "asyncrl api key")."""
    return hmac.new(secret.encode(), b"asyncrl api key", "sha256").hexdigest()[:40]


def run_api_key(environ: Mapping[str, str] | None = None) -> str | None:
    """The API key of the run this process belongs to (``api_key`` of ``run_secret``); None
    outside a run.

    Raises:
        TransportError: as ``run_secret``.
    """
    secret = run_secret(environ)
    return api_key(secret) if secret else None


def secret_matches(expected: str | None, presented: str) -> bool:
    """True when ``presented`` is the (non-empty) ``expected`` secret, compared in constant
    time."""
    if not expected or not presented:
        return False
    return hmac.compare_digest(expected.encode(), presented.encode())
