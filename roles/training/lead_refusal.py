"""The refusal of a call sent to a replica that does not lead its group, as its callers tell it.

A learner's or a critic's group of replicas takes its calls at its lead only
(``asyncrl.roles.training.lockstep``); another replica refuses one with ``NotLeaderError``. The
refusal crosses the transport as a ``RemoteError`` whose ``remote_type`` is the error's name,
and runs nothing, so sending the call again is always harmless. A caller sees one when the lead
moved (a node's loss took replica 0 out: docs/multinode.md, "The lead moves") and the replica
that leads now still runs its old process, a follower, until its node's agent restarts it as
the new group's rank 0: ``asyncrl.roles.program.clients.to_lead`` and the relay
(``asyncrl.roles.services.relay``) send the call again until the new lead answers.

A module of its own, without torch, so that a program's process can tell the refusal apart.
"""

from __future__ import annotations

from asyncrl.errors import RemoteError

__all__ = ["NotLeaderError", "refused_as_follower"]


class NotLeaderError(ValueError):
    """A replica that does not lead its group refused a call only its lead takes (a group call,
    or one served from the lead's weight store). Nothing ran: the call may go again, to the
    group's lead."""


def refused_as_follower(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``NotLeaderError``: raised here, or answered by a replica (a
    ``RemoteError`` that names it)."""
    if isinstance(exc, NotLeaderError):
        return True
    return isinstance(exc, RemoteError) and exc.remote_type == NotLeaderError.__qualname__
