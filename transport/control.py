"""Who may send control messages (STOP): only a peer that holds the run's control secret.

The node agent puts a random secret in the environment variable ``ASYNCRL_CONTROL_SECRET`` for the
whole run, so every process it starts inherits it. The supervisor's clients are created with
``control=True`` and present the secret in their HANDSHAKE (``Hello.control``); a server records,
per peer, whether the secret matched, and accepts control messages only from such a peer.

A server whose environment holds no secret (a server used on its own, outside a run) accepts
control messages only on an ``ipc://`` or ``inproc://`` endpoint: the socket file is private to
this user (see ``sockets.bind``), so only a process that could signal the server anyway reaches
it. On TCP, where any local user can connect, it refuses them.
"""

from __future__ import annotations

import hmac
import os

__all__ = ["CONTROL_SECRET_ENV", "control_secret", "secret_matches"]

CONTROL_SECRET_ENV = "ASYNCRL_CONTROL_SECRET"
"""The environment variable that holds the run's control secret."""


def control_secret() -> str | None:
    """The run's control secret from the environment, or None when it is unset or empty."""
    return os.environ.get(CONTROL_SECRET_ENV) or None


def secret_matches(expected: str | None, presented: str) -> bool:
    """True when ``presented`` is the (non-empty) ``expected`` secret, compared in constant
    time."""
    if not expected or not presented:
        return False
    return hmac.compare_digest(expected.encode(), presented.encode())
