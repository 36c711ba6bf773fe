"""Nodes of a launch that share a host share its weight store.

A publisher of weights (the learner, a relay) leaves the handle of its shared-memory store in its
node's ``weights`` folder (``asyncrl.weights.publishing.handle_path``), and the rollout replicas of
the node read it there. Two node ranks on one host (one machine, without ``ASYNCRL_HOST_ID``) have
two run folders, RUN_DIR and RUN_DIR/node-1, so before this module node 1's rollouts never found the
learner's handle, and its relay copied nothing (its source was on its own host): node 1 stayed at
version 0 until the program's wait failed with ``StallError``.

So at start, each agent of a launch (``asyncrl.launch``):

1. ``announce``: makes its node's ``weights`` folder a folder of its own (one an earlier attempt
   linked elsewhere is unlinked), writes a fresh token into ``weights/.host``, and publishes a
   ``HostRecord`` (its ``asyncrl.transport.shm.host_id``, the folder, the token) with its tcp
   endpoints;
2. ``share``, once every node's record is in: a node whose host id equals that of a lower node
   rank (the host's *first* node) replaces its ``weights`` folder by a symlink to the first
   node's, once it has read the first node's token there (so the folder it links to is the one
   that node writes, not a namesake on another filesystem).

Every publisher and reader of the host then meets in one folder: a learner on any node of the
host, the host's rollouts and its relay. A relay on its source's host copies nothing and writes
nothing (``asyncrl.roles.services.relay``), so no relay republishes into the learner's name; a host
without the source needs one relay, on any of its nodes (two would both republish). A node that
shares a host id but cannot read the first node's token (another filesystem under the same path,
a run folder the other cannot reach) is refused at start with a message naming
``ASYNCRL_HOST_ID``, which makes each node a host of its own.
"""

from __future__ import annotations

import os
import secrets
import shutil

import msgspec

from asyncrl.safe_files import write_atomic
from asyncrl.transport.shm import HOST_ID_ENV, host_id

__all__ = ["HOST_FILE", "HostRecord", "announce", "first_node", "share"]

HOST_FILE = ".host"
"""The token file in a node's ``weights`` folder (no role is named ``.host``)."""


class HostRecord(msgspec.Struct, frozen=True):
    """What a node publishes about its host at start.

    Attributes:
        host: its ``asyncrl.transport.shm.host_id()``.
        weights: the absolute path of its ``weights`` folder.
        token: the random token it wrote into ``weights/.host``.
    """

    host: str
    weights: str
    token: str


def _weights_dir(node_dir: str) -> str:
    return os.path.join(os.path.abspath(node_dir), "weights")


def announce(node_dir: str) -> HostRecord:
    """Make ``node_dir/weights`` a folder of this node's own, write a fresh token into it and
    return the record to publish.

    Raises:
        OSError: the folder cannot be made or written.
    """
    folder = _weights_dir(node_dir)
    if os.path.islink(folder):  # an earlier attempt shared another node's folder
        os.unlink(folder)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    token = secrets.token_hex(16)
    write_atomic(os.path.join(folder, HOST_FILE), token.encode())
    return HostRecord(host=host_id(), weights=folder, token=token)


def first_node(node: int, records: dict[int, HostRecord]) -> int:
    """The lowest node rank with the same host id as ``node`` (``node`` itself when none)."""
    return min(n for n, r in records.items() if r.host == records[node].host)


def share(node: int, node_dir: str, records: dict[int, HostRecord]) -> str:
    """Link this node's ``weights`` folder to its host's first node's; "" when done (or when
    this node is its host's first), else why it cannot, for the launch to refuse with.

    Args:
        node: this node's rank.
        node_dir: this node's folder (RUN_DIR/node-R).
        records: every node's ``HostRecord``, by rank.
    """
    first = first_node(node, records)
    if first == node:
        return ""
    theirs = records[first]
    try:
        with open(os.path.join(theirs.weights, HOST_FILE)) as f:
            seen = f.read()
    except OSError as exc:
        seen = f"unreadable: {exc.strerror or exc}"
    if seen != theirs.token:
        why = seen if seen.startswith("unreadable") else "another node's token is there"
        return (
            f"node {node} shares its host with node {first} (the same host id, "
            f"{theirs.host!r}) but cannot see node {first}'s weights folder {theirs.weights} "
            f"({why}). Nodes on one host share its weight store: give them the same --run-dir "
            f"on one filesystem, or set {HOST_ID_ENV} to a different value on each node so that "
            f"each acts as a host of its own (its relay then copies the weights over tcp)"
        )
    mine = _weights_dir(node_dir)
    if os.path.realpath(mine) == os.path.realpath(theirs.weights):
        return ""
    if os.path.isdir(mine) and not os.path.islink(mine):
        shutil.rmtree(mine)  # this node's own handles: nothing publishes here any more
    tmp = f"{mine}.{os.getpid()}.tmp"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(theirs.weights, tmp)
    os.replace(tmp, mine)
    return ""
