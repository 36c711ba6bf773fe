"""A request to the supervisor to restart one replica, and its answer: how the program asks
for a fresh process of a replica that is alive but no good (an environment replica the
quarantine took out), rather than waiting for it to crash.

The driver sends ``RestartRequest`` to its node agent's endpoint (``restart``, beside
``status``: ``asyncrl.observe.status.AgentStatus``), which any process of the run reaches with
the run's secret; the agent hands it to its supervisor, or, in a launch over several nodes,
to the agent of the node that runs the replica. The supervisor stops the replica (STOP, then
SIGKILL after its ``shutdown_timeout_s``) and starts its next incarnation at once, as any
restart: a fresh process, from the replica's durable state. A requested restart is not a crash:
it spends none of the replica's restart budget and has no backoff (the one asking backs off),
and the reason is logged with it (``restart requested``, ``restarting on request``) and counted
(``asyncrl status``: ``restart_requests`` and ``restart_reason`` per process).
"""

from __future__ import annotations

import msgspec

__all__ = ["RESTART_METHOD", "RestartAnswer", "RestartRequest"]

RESTART_METHOD = "restart"
"""The node agent's method that takes a ``RestartRequest``."""


class RestartRequest(msgspec.Struct, kw_only=True, frozen=True):
    """Restart replica ``replica`` of role ``role``, because of ``reason``.

    Attributes:
        role: the role's name in the manifest.
        replica: the replica's index.
        reason: why, as the logs and ``asyncrl status`` show it (not empty).
        incarnation: restart only this incarnation (the one the asker judged); -1: whichever
            runs. A request for an incarnation that is gone already (it crashed and was
            restarted since) is refused, so that two askers never restart a replica twice.
    """

    role: str
    replica: int
    reason: str
    incarnation: int = -1

    def problem(self) -> str:
        """What is wrong with the request, or "" (a supervisor refuses a bad one with it)."""
        if not self.role:
            return "role: expected a role's name, got ''"
        if self.replica < 0:
            return f"replica: expected an int >= 0, got {self.replica}"
        if not self.reason.strip():
            return "reason: expected why the replica should restart, got ''"
        return ""


class RestartAnswer(msgspec.Struct, kw_only=True, frozen=True):
    """What became of a ``RestartRequest``.

    Attributes:
        restarted: the replica is being restarted (its incarnation ``incarnation`` is stopped
            and the next one starts); False: refused, ``why`` says why.
        found: a supervisor runs the replica (False: no node does; ``why`` names it).
        incarnation: the incarnation stopped, or, when refused, the one running now (-1: none).
        pid: that incarnation's process id, when it has one.
        why: why it was refused; "" when restarted.
    """

    restarted: bool
    found: bool = True
    incarnation: int = -1
    pid: int | None = None
    why: str = ""
