"""A replicated rank that rejoins its data-parallel group takes the lead's state first.

A group over several nodes that went on at a smaller size after a node's loss grows back when
the node comes back (docs/multinode.md, ``asyncrl.manifest.membership.grow``). The ranks that
were out hold checkpoints, a write-ahead log and a step ledger from before the loss; the group
trained on without them. Before a returning rank restores, its node's agent leaves it a
``rejoin.json`` (``asyncrl.manifest.membership.Rejoin``) naming the replica that led the group
meanwhile and that replica's node folder. ``take_lead_state`` then replaces the rank's own
checkpoints (the lead's complete ones), write-ahead log and step ledger with copies of the
lead's, and removes the file: the rank restores exactly what the lead restores, and replays
the same logged steps after it (every rank logs each step's whole batch, so the lead's log
serves any rank).

It runs once the group has formed at its new size (``DataParallel.join``), before any rank
restores: the lead's earlier incarnation, which wrote those files, is gone by then (its node
restarted it into the group), and the new one reads them only after the ranks agree on the
checkpoint, which waits for this rank. A rank that dies while it copies keeps the file and
copies again at its next start.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import msgspec

from asyncrl.manifest.membership import REJOIN_FILE, Rejoin
from asyncrl.role import RoleContext
from asyncrl.roles.training.checkpoints import CheckpointError, fsync_dir, problem
from asyncrl.roles.training.journal import wal_path

__all__ = ["take_lead_state"]


def take_lead_state(ctx: RoleContext) -> bool:
    """When the rank's folder holds a ``rejoin.json``: replace its checkpoints, write-ahead log
    and step ledger with the lead's, then remove the file. Returns whether it did.

    Raises:
        CheckpointError: the file does not decode, or the lead's checkpoint folder is not
            there (the run directory is not on storage every node shares); the file is kept.
        OSError: a copy failed; the file is kept, and the next start copies again.
    """
    own = os.path.join(ctx.run_dir, "roles", f"{ctx.name}.{ctx.replica}")
    marker = os.path.join(own, REJOIN_FILE)
    try:
        with open(marker, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return False
    try:
        rejoin = msgspec.json.decode(data, type=Rejoin)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(
            f"{ctx.name}.{ctx.replica}: {marker} is not a rejoin file ({exc}); its node's agent "
            f"writes it whole as the group grows back, so it was damaged: stop the run and "
            f"resume it (asyncrl run --resume)"
        ) from exc
    lead = f"{ctx.name}.{rejoin.lead}"
    source = os.path.join(rejoin.folder, "roles", lead, "checkpoints")
    if not os.path.isdir(source):
        raise CheckpointError(
            f"{ctx.name}.{ctx.replica}: rejoining its group, it takes the state of {lead}, its "
            f"lead, but {source} is not there: the run directory must be on storage every "
            f"node shares (run.shared_storage: true)"
        )
    complete = sorted(
        name
        for name in os.listdir(source)
        if name.startswith("step-") and problem(os.path.join(source, name)) is None
    )

    def checkpoints(into: str) -> None:
        os.makedirs(into)
        for name in complete:
            shutil.copytree(os.path.join(source, name), os.path.join(into, name))

    _replace(os.path.join(own, "checkpoints"), checkpoints)
    log = wal_path(rejoin.folder, ctx.name, rejoin.lead)
    _replace(
        wal_path(ctx.run_dir, ctx.name, ctx.replica),
        lambda into: shutil.copytree(log, into) if os.path.isdir(log) else os.makedirs(into),
    )
    ledger = os.path.join(rejoin.folder, "ledger", f"{lead}.steps.jsonl")
    mine = os.path.join(ctx.run_dir, "ledger", f"{ctx.name}.{ctx.replica}.steps.jsonl")
    if os.path.exists(ledger):
        shutil.copyfile(ledger, mine + ".rejoin")
        _fsync(mine + ".rejoin")
        os.replace(mine + ".rejoin", mine)
    elif os.path.exists(mine):
        os.remove(mine)
    fsync_dir(os.path.dirname(mine))
    os.remove(marker)
    fsync_dir(own)
    ctx.log.info(
        f"{ctx.name}.{ctx.replica}: rejoining its group, took the state of {lead}, its lead: "
        f"checkpoints {[int(n[len('step-') :]) for n in complete]}, its write-ahead log and "
        f"step ledger"
    )
    return True


def _replace(folder: str, fill: Callable[[str], object]) -> None:
    """Make ``folder`` what ``fill(path)`` writes at a new path, every file of it durable,
    then put it in place."""
    building = folder + ".rejoin"
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    shutil.rmtree(building, ignore_errors=True)
    fill(building)
    for where, _, files in os.walk(building):
        for name in files:
            _fsync(os.path.join(where, name))
        fsync_dir(where)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(building, folder)
    fsync_dir(os.path.dirname(folder))


def _fsync(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
