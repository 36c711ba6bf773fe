"""A rank that rejoins its data-parallel group takes the lead's state first.

A group over several nodes that went on at a smaller size after a node's loss grows back when
the node comes back (docs/multinode.md, ``asyncrl.manifest.membership.grow``). The ranks that
were out hold checkpoints, a write-ahead log and a step ledger from before the loss; the group
trained on without them. Before a returning rank restores, its node's agent leaves it a
``rejoin.json`` (``asyncrl.manifest.membership.Rejoin``) naming the replica that led the group
meanwhile and that replica's node folder. ``take_lead_state`` then replaces the rank's own
checkpoints, write-ahead log and step ledger with the lead's, and removes the file: the rank
restores exactly what the lead restores, and replays the same logged steps after it (every
rank logs each step's whole batch, so the lead's log serves any rank).

The lead's complete checkpoints are hard-linked, not copied: a complete checkpoint never
changes (``CheckpointDir.write`` marks it complete last, and a later save of the same step or
a removal unlinks its files rather than writing into them), so the rank's links read the same
bytes the lead's files hold, and the take costs a few file-system operations per checkpoint
whatever the model's size. All of them are linked, as cheap as one, so the rank holds every
step the lead holds and agrees with any rank of the group on an older one. Where a link
cannot be made (the rank's folder on another filesystem than the lead's, or one without hard
links), they are copied, all of them (at most the learner's ``keep``): the group resumes from
the oldest of its ranks' newest checkpoints, and a rank that went on beside the lead may be one
behind it. A sharded rank's linked checkpoints hold the lead's shards; each gets a
``WRITTEN_IN`` file naming the lead's folder, so its group is read from there
(``asyncrl.roles.training.shard_group``).

It runs once the group has formed at its new size (``DataParallel.join``), before any rank
restores, within the group's collective deadline (the lead waits for this rank in
``agree_checkpoint``). Not earlier: until the join, the lead's earlier incarnation may still
be running on its node, appending to its log and writing (and pruning) checkpoints, since its
node restarts it into the group on its own clock; once the group has joined, it is gone, and
the new one reads its files only after the ranks agree on the checkpoint, which waits for this
rank. The log and ledger are small: bounded by ``checkpoint_every`` steps. Each part is built
in a ``.rejoin`` folder beside its place and put there whole; the file is removed last, so a
rank that dies mid-take keeps it and takes the lead's state again at its next start.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable

import msgspec

from asyncrl.manifest.membership import REJOIN_FILE, Rejoin
from asyncrl.role import RoleContext
from asyncrl.roles.training.checkpoints import CheckpointError, fsync_dir, problem, read_values
from asyncrl.roles.training.journal import wal_path
from asyncrl.roles.training.shard_group import WRITTEN_IN, written_by, written_in

__all__ = ["take_lead_state"]

_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
"""What ``os.link`` raises where a hard link cannot be made: another filesystem, one without
hard links, or a file with too many links already."""


def take_lead_state(ctx: RoleContext, sharded: bool = False) -> bool:
    """When the rank's folder holds a ``rejoin.json``: replace its checkpoints (hard links of
    the lead's complete ones), write-ahead log and step ledger with the lead's, then remove the
    file. Returns whether it did.

    A ``sharded`` rank (``parallel: fsdp``): each linked checkpoint holds the lead's shards and
    names its group relative to the folder it was written in, so a ``WRITTEN_IN`` file beside
    it names that folder (``asyncrl.roles.training.shard_group``), and the group loads it from
    its writers' folders. A lead's checkpoint whose writers include this rank's own folder (the
    group wrote it before the loss, and the lead still holds it) is not linked: the rank keeps
    its own checkpoint of that step, its shards of it, when it holds it complete.

    Raises:
        CheckpointError: the file does not decode, or the lead's checkpoint folder is not
            there (the run directory is not on storage every node shares); the file is kept.
        OSError: a link or copy failed; the file is kept, and the next start takes the state
            again.
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

    how: list[str] = []
    taken: list[int] = []
    folder = os.path.normpath(os.path.abspath(os.path.join(own, "checkpoints")))

    def take(name: str, put: Callable[[str, str], object]) -> None:
        """Put the lead's checkpoint ``name`` into the folder being built (``put``), or, for a
        sharded rank, this rank's own of that step where the lead's names it as a writer."""
        lead_dir = os.path.join(source, name)
        taken.append(int(name[len("step-") :]))
        if not sharded:
            put(lead_dir, os.path.join(building, name))
            return
        writers = written_by(lead_dir, read_values(lead_dir), several=True) or []
        if folder in writers:
            mine = os.path.join(folder, name)
            if problem(mine) is None:
                put(mine, os.path.join(building, name))
            else:
                taken.pop()
            return
        put(lead_dir, os.path.join(building, name))
        mark = os.path.join(building, name, WRITTEN_IN)
        if os.path.lexists(mark):
            os.remove(mark)  # a link of the lead's own file: never written into
        with open(mark, "w") as f:
            f.write(os.path.relpath(written_in(lead_dir), folder))

    building = ""

    def checkpoints(into: str) -> None:
        nonlocal building
        building = into
        os.makedirs(into)
        try:
            for name in complete:
                take(name, _link_tree)
            how.append("linked")
        except OSError as exc:
            if exc.errno not in _NO_LINK:
                raise
            # Another filesystem (or one without hard links): copy them all. The group
            # resumes from the oldest of its ranks' newest checkpoints, and a rank that went on
            # beside the lead may be one behind it (its save cut off by the group's restart).
            shutil.rmtree(into)
            os.makedirs(into)
            taken.clear()
            for name in complete:
                take(name, shutil.copytree)
            how.append("copied")

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
        f"checkpoints {taken} ({''.join(how)}), its "
        f"write-ahead log and step ledger"
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


def _link_tree(source: str, into: str) -> None:
    """Make ``into`` hold a hard link of every file under ``source``, folders as there.

    Raises:
        OSError: a link cannot be made (``_NO_LINK``: another filesystem), or a folder not.
    """
    os.makedirs(into)
    with os.scandir(source) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                _link_tree(entry.path, os.path.join(into, entry.name))
            else:
                os.link(entry.path, os.path.join(into, entry.name))


def _fsync(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
