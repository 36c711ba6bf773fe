"""The checkpoints of a sharded group across its ranks' folders, loaded at another size.

Each rank of a sharded learner or critic (``parallel: fsdp``) writes only its own shards of the
training state, into its own checkpoint folder, which is on its own node
(``RUN_DIR/node-R/roles/learner.R/checkpoints``). So that the group can go on at another size
(the ranks left after a node's loss, docs/multinode.md), each sharded checkpoint names the
folders of the group that wrote it: ``group``, every rank's checkpoint folder in rank order,
relative to the writer's own (a run directory moved whole keeps them).

A rank restores a checkpoint of its own folder as before when its own group wrote it. When
another group did (the folders differ: the group went on without some of its ranks), the rank
takes that step only if every writer's folder holds it complete (else it goes back to an older
one, and replays more of its write-ahead log), and loads every writer's shards, to be
resharded to its own group's size (``Trainer.load_states``). Every rank logs every step's
whole batch in its own write-ahead log, so the ranks left replay the steps after it from their
own logs.

A checkpoint without ``group`` that holds a whole state (no ``world``: a group of one rank
wrote it, training alone) counts as written by its own folder's rank alone: a sharded group of
several ranks loads it from that folder and reshards it (the group grows back from one rank).

When the group grows back, a returning rank takes the lead's checkpoints
(``asyncrl.roles.training.rejoin``): hard links, in its own folder, of the lead's. Such a
checkpoint holds the lead's shards, and its ``group`` is relative to the lead's folder, so the
take leaves beside it a file, ``WRITTEN_IN``, naming the folder it was written in (relative
to this rank's); the rank reads its ``group`` from there and loads it from its writers'
folders, never as its own shards. The take links none whose writers include the returning
rank's own folder: it keeps its own checkpoint of that step, its shards of the group's state.

Reading another rank's folder needs the run directory on storage every node shares
(``run.shared_storage`` in the manifest); a writer's folder that is not there at all is an
error that says so.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from asyncrl.roles.training.checkpoints import (
    CheckpointDir,
    CheckpointError,
    problem,
    read_values,
)
from asyncrl.roles.training.data_parallel import DataParallel
from asyncrl.safe_files import UnsafePathError, open_dir, open_subdir

__all__ = ["GROUP_KEY", "WRITTEN_IN", "ShardGroup", "written_by"]

_NODE = re.compile(r"^node-\d+\Z")

GROUP_KEY = "group"
"""The key of a sharded checkpoint that lists the folders of the group that wrote it."""

WRITTEN_IN = "WRITTEN_IN"
"""The file beside a checkpoint taken from another rank's folder (a hard link of the lead's, as
the group grows back) that names the folder it was written in, relative to the one it is in."""


def written_in(checkpoint: str) -> str:
    """The folder the checkpoint directory ``checkpoint`` was written in (absolute): the one it
    is in, or the one its ``WRITTEN_IN`` file names."""
    here = os.path.dirname(os.path.normpath(os.path.abspath(checkpoint)))
    try:
        with open(os.path.join(checkpoint, WRITTEN_IN)) as f:
            return os.path.normpath(os.path.join(here, f.read().strip()))
    except FileNotFoundError:
        return here


def written_by(checkpoint: str, values: dict[str, Any], several: bool) -> list[str] | None:
    """The checkpoint folders of the group that wrote the checkpoint directory ``checkpoint``
    (its plain ``values``), in rank order: its ``group`` read from the folder it was written in;
    a whole state (no ``world``) with none, read by a group of ``several`` ranks: that folder
    alone; else None (a whole state or one that names no group, read by one rank)."""
    origin = written_in(checkpoint)
    recorded = values.get(GROUP_KEY)
    if recorded:
        return [os.path.normpath(os.path.join(origin, str(f))) for f in recorded]
    if several and values.get("world") is None:
        return [origin]
    return None


def _layout(folder: str) -> tuple[str, str]:
    """A rank's checkpoint folder (absolute, ``RUN_DIR/[node-R/]roles/<role>.<replica>/
    checkpoints``) as the run directory it lies in and its path under it."""
    node = os.path.dirname(os.path.dirname(os.path.dirname(folder)))
    run_dir = os.path.dirname(node) if _NODE.match(os.path.basename(node)) else node
    return run_dir, os.path.relpath(folder, run_dir)


class ShardGroup:
    """The checkpoint folders of this rank's group now, and which checkpoints of its own
    folder it can load.

    Args:
        name: the replica's name (``learner.0``), for messages.
        checkpoints: this rank's checkpoints.
        folders: every rank's checkpoint folder of the group now, in rank order; one rank
            alone: its own.
    """

    def __init__(self, name: str, checkpoints: CheckpointDir, folders: Sequence[str]) -> None:
        self.name = name
        self.checkpoints = checkpoints
        self.folders = [os.path.normpath(os.path.abspath(f)) for f in folders]
        self._own = os.path.normpath(os.path.abspath(checkpoints.path))

    @classmethod
    def gather(cls, name: str, checkpoints: CheckpointDir, dp: DataParallel) -> ShardGroup:
        """The group of ``dp``: every rank's checkpoint folder, each broadcast by its rank
        (every rank calls it, in the same order) as its path under the run directory, found
        here under this node's run directory (nodes may mount the shared run directory at
        different paths); its absolute path only where that is not there and this is."""
        own = os.path.normpath(os.path.abspath(checkpoints.path))
        run_dir, under = _layout(own)
        mine = f"{own}\0{under}".encode()
        folders = []
        for r in range(dp.world):
            got = dp.broadcast_bytes(
                "the ranks' checkpoint folders", mine if r == dp.rank else b"", src=r
            ).decode()
            there, _, rel = got.partition("\0")
            here = os.path.normpath(os.path.join(run_dir, rel))
            folders.append(there if not os.path.isdir(here) and os.path.isdir(there) else here)
        return cls(name, checkpoints, folders)

    def relative(self) -> list[str]:
        """The group's folders relative to this rank's own (what a checkpoint records)."""
        return [os.path.relpath(f, self._own) for f in self.folders]

    def readable(self, step: int) -> bool:
        """Whether this rank's complete checkpoint of ``step`` has values that read; one that
        does not is skipped with a warning, as an incomplete one is (an older one loads)."""
        try:
            read_values(self.checkpoints.dir_of(step))
        except CheckpointError as e:
            self.checkpoints.warn(
                f"checkpoint {self.checkpoints.dir_of(step)} skipped: its values do not read "
                f"({e.__cause__ or e})"
            )
            return False
        return True

    def writers(self, step: int) -> list[str] | None:
        """The folders of the group that wrote this rank's checkpoint of ``step``, in rank
        order, when that group is another than this one; None: this group wrote it, or it
        names no group (a whole state, or one written before checkpoints named theirs).

        Raises:
            CheckpointError: its values do not read; a folder it names is not a rank's
                checkpoint folder of this role in this run directory, or lies through a link.
        """
        where = self.checkpoints.dir_of(step)
        values = read_values(where)
        origin = written_in(where)
        if origin != self._own:
            self._confined(step, -1, origin)
        folders = written_by(where, values, len(self.folders) > 1)
        if folders is None or (folders == self.folders and origin == self._own):
            return None
        for rank, folder in enumerate(folders):
            self._confined(step, rank, folder)
        return folders

    def _run_dirs(self) -> list[str]:
        """The run directories this rank's folder may lie in: its node's folder (``RUN_DIR``
        on node 0), and ``RUN_DIR`` above it when that is a ``node-R`` folder."""
        node = os.path.dirname(os.path.dirname(os.path.dirname(self._own)))
        out = [node]
        if _NODE.match(os.path.basename(node)):
            out.append(os.path.dirname(node))
        return out

    def _confined(self, step: int, rank: int, folder: str) -> None:
        """Raise unless ``folder``, a writer's folder the checkpoint of ``step`` records, is a
        rank's checkpoint folder of this role in this run directory
        (``RUN_DIR/[node-R/]roles/<role>.<replica>/checkpoints``), reached through no link."""
        role = re.escape(self.name.rsplit(".", 1)[0])
        shape = re.compile(rf"^(node-\d+/)?roles/{role}\.\d+/checkpoints\Z")
        what = f"rank {rank}'s folder of it" if rank >= 0 else "the folder it was written in"
        head = (
            f"{self.name}: the checkpoint of step {step} in {self.checkpoints.path} names "
            f"{folder} as {what}"
        )
        for run_dir in self._run_dirs():
            rel = os.path.relpath(folder, run_dir)
            if shape.match(rel.replace(os.sep, "/")):
                break
        else:
            raise CheckpointError(
                f"{head}, which is not a rank's checkpoint folder of this run directory "
                f"({' or '.join(self._run_dirs())}/[node-R/]roles/{role}.R/checkpoints): this "
                f"rank reads no other folder. Remove that checkpoint, or start a new run"
            )
        if not os.path.lexists(folder):
            return  # not there at all: ``loadable`` says so
        try:
            fd = open_dir(run_dir)
            try:
                os.close(open_subdir(fd, rel, where=run_dir))
            finally:
                os.close(fd)
        except UnsafePathError as e:
            raise CheckpointError(
                f"{head}, reached through a link or a folder of another user ({e}): this rank "
                f"reads the ranks' shards only from the run directory's own folders"
            ) from e
        except OSError:
            return  # a component is missing or unreadable: ``loadable`` says so

    def loadable(self, step: int) -> bool:
        """Whether this rank can load its (complete) checkpoint of ``step``: its group wrote
        it, or every folder of the group that did holds that step complete.

        Raises:
            CheckpointError: a writer's folder is not there at all (the run directory is not
                on storage every node shares), lies outside this run directory, or is reached
                through a link.
        """
        return not self.missing(step)

    def missing(self, step: int) -> list[str]:
        """The folders of the group that wrote this rank's checkpoint of ``step`` that do not
        hold it complete (empty: it loads).

        Raises:
            CheckpointError: as ``loadable``.
        """
        writers = self.writers(step)
        if writers is None:
            return []
        for rank, folder in enumerate(writers):
            if not os.path.isdir(folder):
                raise CheckpointError(
                    f"{self.name}: the checkpoint of step {step} in {self.checkpoints.path} was "
                    f"written by a sharded group of {len(writers)} ranks, and rank {rank}'s "
                    f"folder of it, {folder}, is not there: this rank cannot read that rank's "
                    f"shards. A sharded group goes on at a smaller size only with the run "
                    f"directory on storage every node shares (run.shared_storage: true, "
                    f"docs/multinode.md)"
                )
        where = os.path.basename(self.checkpoints.dir_of(step))
        for rank, folder in enumerate(writers):
            if os.path.islink(os.path.join(folder, where)):
                raise CheckpointError(
                    f"{self.name}: rank {rank}'s checkpoint of step {step}, "
                    f"{os.path.join(folder, where)}, is a link: this rank reads the ranks' "
                    f"shards only from the run directory's own folders. Remove the link"
                )
        return [f for f in writers if problem(os.path.join(f, where)) is not None]

    def none_loadable(self, steps: Sequence[int]) -> str:
        """The error for a rank whose complete checkpoints of ``steps`` none load: each step
        and the writers' folders that lack it."""
        lacking = "; ".join(
            f"step {s} is not complete in {', '.join(self.missing(s))}" for s in reversed(steps)
        )
        return (
            f"{self.name}: none of the checkpoints in {self.checkpoints.path} can be loaded: "
            f"each was written by a sharded group, and {lacking}. Nothing was removed: starting "
            f"from the initial weights would throw away the training they hold. Put those "
            f"folders back as they were written (the run directory on storage every node "
            f"shares, run.shared_storage: true), or start a new run from the newest export"
        )

    def states(self, path: str, own: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Every writer's state of the checkpoint ``path`` of this rank (``own``, loaded), in
        the writers' rank order, when another group wrote it; None when this group did (load
        ``own`` alone).

        Raises:
            CheckpointError: a writer's checkpoint does not load.
        """
        step = int(os.path.basename(path).split("-")[-1])
        writers = self.writers(step)
        if writers is None:
            return None
        where = os.path.basename(path)
        origin = written_in(path)
        return [
            own if folder == origin else CheckpointDir.load(os.path.join(folder, where))
            for folder in writers
        ]
