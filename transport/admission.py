"""Whom a server admits: the checks on a HANDSHAKE (protocol version, control secret) and on a
control message (STOP). See docs/protocol.md, Control messages; the secret itself is
``control.py``'s.
"""

from __future__ import annotations

from typing import NamedTuple

from .control import CONTROL_SECRET_ENV, secret_matches
from .errors import ProtocolVersionError
from .protocol import PROTOCOL_VERSION, ErrorCode, Hello
from .sockets import ipc_path

__all__ = ["Refusal", "control_refusal", "handshake_refusal"]


class Refusal(NamedTuple):
    """Why a handshake is refused: the server's counter, the ERROR code, and its message."""

    counter: str
    code: str
    message: str


def handshake_refusal(hello: Hello, secret: str | None, server: str) -> Refusal | None:
    """Why a server named ``server`` with control secret ``secret`` refuses ``hello``; None
    when it admits it."""
    if hello.version != PROTOCOL_VERSION:
        err = ProtocolVersionError(PROTOCOL_VERSION, hello.version, hello.name)
        return Refusal("version_mismatch", ErrorCode.PROTOCOL_VERSION, str(err))
    if hello.control and secret is not None and not secret_matches(secret, hello.control):
        return Refusal(
            "control_refused",
            ErrorCode.UNAUTHORIZED,
            f"the control secret presented by {hello.name or 'this client'} is not "
            f"{server}'s; both processes must inherit the same {CONTROL_SECRET_ENV} "
            f"(set by the node agent for the whole run)",
        )
    return None


def control_refusal(presented: bool, secret: str | None, endpoint: str, server: str) -> str:
    """Why a control message is refused, or "" when it is authorised.

    Args:
        presented: the peer presented the run's control secret in its handshake.
        secret: the server's control secret, None when it has none.
        endpoint: where the server listens.
        server: the server's name.
    """
    if secret is not None:
        if presented:
            return ""
        return (
            f"control messages are accepted only from a client that presented the run's "
            f"control secret in its HANDSHAKE (Hello.control, from {CONTROL_SECRET_ENV}); "
            f"create the client with control=True in a process that has the secret"
        )
    if ipc_path(endpoint) is not None or endpoint.startswith("inproc://"):
        return ""
    return (
        f"{server} has no control secret ({CONTROL_SECRET_ENV} is unset) and listens on "
        f"{endpoint}, where any local user can connect; set {CONTROL_SECRET_ENV} in "
        f"both processes and create the client with control=True"
    )
