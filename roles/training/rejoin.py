"""A rank that rejoins its data-parallel group takes the lead's state first.

A group over several nodes that went on at a smaller size after a node's loss grows back when
the node comes back (docs/multinode.md, ``asyncrl.manifest.membership.grow``). The ranks that
were out hold checkpoints, a write-ahead log and a step ledger from before the loss; the group
trained on without them. Before a returning rank restores, its node's agent leaves it a
``rejoin.json`` (``asyncrl.manifest.membership.Rejoin``) naming the replica that led the group
meanwhile and that replica's node folder. The rank then replaces its own checkpoints,
write-ahead log and step ledger with the lead's, and removes the file: it restores exactly what
the lead restores, and replays the same logged steps after it (every rank logs each step's
whole batch, so the lead's log serves any rank). Where the run directory is on shared storage
(``run.shared_storage``) it reads them from the lead's folder (``take_lead_state``); otherwise
the lead sends them over the group's collectives as the group forms (``rejoin_group``): the
checkpoint the group resumes from, the log and the ledger, in pieces, each piece a broadcast
with the group's deadline.

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

Either runs once the group has formed at its new size (``DataParallel.join``), before any
rank restores, within the group's collective deadline (the lead waits for this rank in
``agree_checkpoint``, or sends to it). Not earlier: until the join, the lead's earlier
incarnation may still be running on its node, appending to its log and writing (and pruning)
checkpoints, since its node restarts it into the group on its own clock; once the group has
joined, it is gone, and the new one reads its files only after the ranks agree on the
checkpoint, which waits for this rank. The log and ledger are small: bounded by
``checkpoint_every`` steps. Each part is built in a ``.rejoin`` folder beside its place and put
there whole; the file is removed last, so a rank that dies mid-take keeps it and takes the
lead's state again at its next start.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable

import msgspec

from asyncrl.manifest.membership import REJOIN_FILE, Rejoin
from asyncrl.role import RoleContext
from asyncrl.roles.training.checkpoints import CheckpointError, fsync_dir, problem, read_values
from asyncrl.roles.training.data_parallel import DataParallel
from asyncrl.roles.training.journal import ledger_path, wal_path
from asyncrl.roles.training.shard_group import WRITTEN_IN, written_by, written_in

__all__ = ["CHUNK", "rejoin_group", "take_lead_state"]

_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
"""What ``os.link`` raises where a hard link cannot be made: another filesystem, one without
hard links, or a file with too many links already."""


def rejoin_group(ctx: RoleContext, dp: DataParallel, sharded: bool = False) -> bool:
    """As the rank starts into its group (``Durability``, once the group has formed), take the
    lead's state when its folder holds a ``rejoin.json``: from the lead's folder where the run
    directory is shared (``take_lead_state``), else from the lead over the group
    (``_take_over_group``). Every rank of a group of several takes part in the second (one
    small all-gather when no rank takes the state over the group), whichever way it took the
    state, so every rank calls this. Returns whether this rank took the lead's state.

    Raises:
        CheckpointError: the file does not decode, the lead's folder is not there, or the
            lead's state cannot be sent (every rank of the group raises); the file is kept.
        DataParallelError: a collective of the transfer failed (a rank died); the file is
            kept, and the next start takes the state again.
        OSError: a link, copy or write failed; the file is kept.
    """
    taken = take_lead_state(ctx, sharded)
    # None, or a file that says the run directory is not shared.
    rejoin = None if taken else _rejoin_file(ctx)
    if dp.world > 1:
        # Every rank takes part, one that took the state from the shared directory too (as a
        # rank that holds the group's state now): the group's next collectives pair up.
        return _take_over_group(ctx, dp, rejoin, sharded) or taken
    if rejoin is not None:
        raise CheckpointError(
            f"{ctx.name}.{ctx.replica}: rejoining its group, it takes the state of "
            f"{ctx.name}.{rejoin.lead}, its lead, over the group, but it is alone in its group: "
            f"stop the run and resume it (asyncrl run --resume)"
        )
    return taken


def _own(ctx: RoleContext) -> str:
    return os.path.join(ctx.run_dir, "roles", f"{ctx.name}.{ctx.replica}")


def _rejoin_file(ctx: RoleContext) -> Rejoin | None:
    """The rank's ``rejoin.json``, or None when it has none.

    Raises:
        CheckpointError: the file does not decode; it is kept.
    """
    marker = os.path.join(_own(ctx), REJOIN_FILE)
    try:
        with open(marker, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    try:
        return msgspec.json.decode(data, type=Rejoin)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(
            f"{ctx.name}.{ctx.replica}: {marker} is not a rejoin file ({exc}); its node's agent "
            f"writes it whole as the group grows back, so it was damaged: stop the run and "
            f"resume it (asyncrl run --resume)"
        ) from exc


def _complete(folder: str) -> list[str]:
    """The names of the complete checkpoints in ``folder`` (``step-…``), oldest first."""
    if not os.path.isdir(folder):
        return []
    return sorted(
        name
        for name in os.listdir(folder)
        if name.startswith("step-") and problem(os.path.join(folder, name)) is None
    )


def take_lead_state(ctx: RoleContext, sharded: bool = False) -> bool:
    """When the rank's folder holds a ``rejoin.json`` that says the run directory is on shared
    storage (``Rejoin.shared``): replace the rank's checkpoints (hard links of the lead's
    complete ones), write-ahead log and step ledger with the lead's, read under the file's
    ``folder``, then remove the file. Returns whether it did.

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
    rejoin = _rejoin_file(ctx)
    if rejoin is None or not rejoin.shared:
        return False
    own = _own(ctx)
    lead = f"{ctx.name}.{rejoin.lead}"
    source = os.path.join(rejoin.folder, "roles", lead, "checkpoints")
    if not os.path.isdir(source):
        raise CheckpointError(
            f"{ctx.name}.{ctx.replica}: rejoining its group, it takes the state of {lead}, its "
            f"lead, but {source} is not there: the run directory must be on storage every "
            f"node shares (run.shared_storage: true)"
        )
    complete = _complete(source)

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
    ledger = ledger_path(rejoin.folder, ctx.name, rejoin.lead)
    _put_ledger(ctx, lambda into: shutil.copyfile(ledger, into), os.path.exists(ledger))
    _taken(ctx, f"took the state of {lead}, its lead: checkpoints {taken} ({''.join(how)})")
    return True


CHUNK = 64 << 20
"""The most bytes of a file the lead sends in one broadcast (``_take_over_group``)."""


class _Sending(msgspec.Struct, frozen=True):
    """What the rank that sends the lead's state over the group says first.

    Attributes:
        replica: the replica whose state it is (the group's lead).
        step: the step of the checkpoint it sends (-1: none).
        files: each file it sends next, in order, with its size: its place under the
            rank's folder being built (``checkpoints/step-…/…``, ``wal/…``, ``ledger``).
        error: why it sends nothing (every rank then raises it).
    """

    replica: int
    step: int = -1
    files: list[tuple[str, int]] = []
    error: str = ""


def _take_over_group(
    ctx: RoleContext, dp: DataParallel, rejoin: Rejoin | None, sharded: bool
) -> bool:
    """Send the lead's state over the group to the ranks that rejoin it (``rejoin`` is not
    None on those), the run directory not being shared: every rank says whether it rejoins, which
    lead its file names, its replica and its newest complete checkpoint; when one rejoins, the
    lead (the named replica, or the lowest rank that stayed where that one is not in the group:
    lost since the file was written; both hold the group's state) broadcasts the checkpoint the
    group will resume from (the newest every rank that stayed holds: ``agree_checkpoint``), its
    write-ahead log and its step ledger, file by file in pieces of at most ``CHUNK`` bytes,
    each broadcast bounded by the group's ``timeout_s``. A rejoining rank builds them in a
    ``rejoin.transfer`` folder of its own and puts each part in place whole; ``rejoin.json`` is
    removed last, so a rank cut off midway takes the state again at its next start.

    Raises:
        CheckpointError: every rank rejoins (no rank holds the group's state), the lead
            holds no complete checkpoint of the step, the group is sharded, or a piece came
            short (a file of the lead changed while it was sent); every rank raises it.
        DataParallelError: a broadcast failed.
    """
    own = _own(ctx)
    mine = _complete(os.path.join(own, "checkpoints"))
    newest = _step(mine[-1]) if mine and rejoin is None else -1
    named = -1 if rejoin is None else rejoin.lead
    said = dp.all_gather_ints(
        "who rejoins the group", [int(rejoin is not None), named, newest, ctx.replica]
    )
    rejoining = [r for r, row in enumerate(said) if row[0]]
    if not rejoining:
        return False
    stayed = [r for r, row in enumerate(said) if not row[0]]
    if not stayed:
        raise CheckpointError(
            f"{ctx.name}: every rank of its group rejoins it (ranks {rejoining}), so none holds "
            f"the group's state to take: stop the run and resume it (asyncrl run --resume)"
        )
    lead = said[rejoining[0]][1]
    src = next((r for r in stayed if said[r][3] == lead), stayed[0])
    step = min(said[r][2] for r in stayed)
    header = b""
    if dp.rank == src:
        header = msgspec.msgpack.encode(_sending(ctx, step, sharded))
    sending = msgspec.msgpack.decode(
        dp.broadcast_bytes("the lead's state: what it sends", header, src), type=_Sending
    )
    if sending.error:
        raise CheckpointError(sending.error)
    lead_name = f"{ctx.name}.{sending.replica}"
    sources = _sources(ctx, sending.step) if dp.rank == src else {}
    staging = os.path.join(own, "rejoin.transfer")
    if rejoin is not None:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    sent = 0
    for where, size in sending.files:
        target = os.path.join(staging, where) if rejoin is not None else None
        _pass_file(dp, src, lead_name, where, size, sources.get(where), target)
        sent += size
    if dp.rank == src:
        takers = [said[r][3] for r in rejoining]
        ctx.log.info(
            f"{ctx.name}.{ctx.replica}: sent its state to replica(s) {takers}, rejoining the "
            f"group: checkpoint {sending.step}, its write-ahead log and step ledger "
            f"({sent / 2**20:.1f} MiB)"
        )
    if rejoin is None:
        return False

    def put(part: str) -> Callable[[str], object]:
        def fill(into: str) -> None:
            got = os.path.join(staging, part)
            if os.path.isdir(got):
                os.rename(got, into)
            else:
                os.makedirs(into)

        return fill

    _replace(os.path.join(own, "checkpoints"), put("checkpoints"))
    _replace(wal_path(ctx.run_dir, ctx.name, ctx.replica), put("wal"))
    ledger = os.path.join(staging, "ledger")
    _put_ledger(ctx, lambda into: os.rename(ledger, into), os.path.exists(ledger))
    shutil.rmtree(staging, ignore_errors=True)
    taken = [sending.step] if sending.step >= 0 else []
    _taken(
        ctx,
        f"took the state of {lead_name}, its lead, over the group: checkpoints {taken} "
        f"({sent / 2**20:.1f} MiB)",
    )
    return True


def _pass_file(
    dp: DataParallel,
    src: int,
    lead: str,
    where: str,
    size: int,
    source: str | None,
    target: str | None,
) -> None:
    """One file of the lead's state, ``size`` bytes, broadcast by rank ``src`` from its path
    ``source`` in pieces of at most ``CHUNK``; a rank given a ``target`` writes it there.

    Raises:
        CheckpointError: a piece came short (the file changed as it was sent); every rank
            sees it.
        DataParallelError: a broadcast failed.
    """
    with contextlib.ExitStack() as files:
        reader = files.enter_context(open(source, "rb")) if source is not None else None
        writer = None
        if target is not None:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            writer = files.enter_context(open(target, "wb"))
        for offset in range(0, size, CHUNK):
            n = min(CHUNK, size - offset)
            data = reader.read(n) if reader is not None else b""
            piece = dp.broadcast_bytes(f"the lead's state: {where}", data, src)
            if len(piece) != n:
                raise CheckpointError(
                    f"{dp.name}: {lead} sent {len(piece)} bytes of {where} at {offset} where "
                    f"{n} were due: the file changed as it was sent; the group restarts and "
                    f"sends it again"
                )
            if writer is not None:
                writer.write(piece)


def _step(name: str) -> int:
    return int(name[len("step-") :])


def _sending(ctx: RoleContext, step: int, sharded: bool) -> _Sending:
    """What this rank, the group's lead, sends of its state: its checkpoint of ``step``,
    its write-ahead log and its step ledger (``_sources``), or why it cannot."""
    me = f"{ctx.name}.{ctx.replica}"
    if sharded:
        return _Sending(
            ctx.replica,
            error=f"{ctx.name}: a sharded group's rejoining rank reads its lead's shards from "
            f"the shared run directory, which this run does not have (run.shared_storage: false)",
        )
    if step >= 0 and not any(
        _step(n) == step for n in _complete(os.path.join(_own(ctx), "checkpoints"))
    ):
        return _Sending(
            ctx.replica,
            error=f"{me}, the lead of its group, holds no complete checkpoint of step {step}, the "
            f"newest every rank that stayed in the group holds, to send to a rank rejoining it: "
            f"keep at least 2 checkpoints (keep_checkpoints)",
        )
    files = [(where, os.path.getsize(path)) for where, path in _sources(ctx, step).items()]
    return _Sending(ctx.replica, step, files)


def _sources(ctx: RoleContext, step: int) -> dict[str, str]:
    """This rank's files that make up its state from its checkpoint of ``step`` on, each by
    its place in a rejoining rank's ``rejoin.transfer`` folder, in the order they are sent."""
    out: dict[str, str] = {}
    parts = [("wal", wal_path(ctx.run_dir, ctx.name, ctx.replica))]
    if step >= 0:
        checkpoints = os.path.join(_own(ctx), "checkpoints")
        name = next(n for n in _complete(checkpoints) if _step(n) == step)
        parts.insert(0, (f"checkpoints/{name}", os.path.join(checkpoints, name)))
    for part, folder in parts:
        for where, dirs, files in os.walk(folder):
            dirs.sort()
            for file in sorted(files):
                path = os.path.join(where, file)
                out[os.path.join(part, os.path.relpath(path, folder))] = path
    ledger = ledger_path(ctx.run_dir, ctx.name, ctx.replica)
    if os.path.exists(ledger):
        out["ledger"] = ledger
    return out


def _put_ledger(ctx: RoleContext, fill: Callable[[str], object], there: bool) -> None:
    """Make the rank's step ledger what ``fill(path)`` writes (``there``), durably, or remove
    it (the lead keeps none)."""
    mine = ledger_path(ctx.run_dir, ctx.name, ctx.replica)
    os.makedirs(os.path.dirname(mine), exist_ok=True)
    if there:
        fill(mine + ".rejoin")
        _fsync(mine + ".rejoin")
        os.replace(mine + ".rejoin", mine)
    elif os.path.exists(mine):
        os.remove(mine)
    fsync_dir(os.path.dirname(mine))


def _taken(ctx: RoleContext, what: str) -> None:
    """The rank's state is the lead's now: remove its ``rejoin.json``, last, and say ``what``
    it took."""
    own = _own(ctx)
    os.remove(os.path.join(own, REJOIN_FILE))
    fsync_dir(own)
    ctx.log.info(
        f"{ctx.name}.{ctx.replica}: rejoining its group, {what}, its write-ahead log and step "
        f"ledger"
    )


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
