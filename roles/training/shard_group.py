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

Reading another rank's folder needs the run directory on storage every node shares
(``run.shared_storage`` in the manifest); a writer's folder that is not there at all is an
error that says so.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from asyncrl.roles.training.checkpoints import (
    CheckpointDir,
    CheckpointError,
    problem,
    read_values,
)
from asyncrl.roles.training.data_parallel import DataParallel

__all__ = ["GROUP_KEY", "ShardGroup"]

GROUP_KEY = "group"
"""The key of a sharded checkpoint that lists the folders of the group that wrote it."""


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

    @classmethod
    def gather(cls, name: str, checkpoints: CheckpointDir, dp: DataParallel) -> ShardGroup:
        """The group of ``dp``: every rank's checkpoint folder, each broadcast by its rank
        (every rank calls it, in the same order)."""
        mine = os.path.abspath(checkpoints.path).encode()
        folders = [
            dp.broadcast_bytes(
                "the ranks' checkpoint folders", mine if r == dp.rank else b"", src=r
            ).decode()
            for r in range(dp.world)
        ]
        return cls(name, checkpoints, folders)

    def relative(self) -> list[str]:
        """The group's folders relative to this rank's own (what a checkpoint records)."""
        own = os.path.abspath(self.checkpoints.path)
        return [os.path.relpath(f, own) for f in self.folders]

    def writers(self, step: int) -> list[str] | None:
        """The folders of the group that wrote this rank's checkpoint of ``step``, in rank
        order, when that group is another than this one; None: this group wrote it, or it
        names no group (a whole state, or one written before checkpoints named theirs).

        Raises:
            CheckpointError: its values do not read.
        """
        recorded = read_values(self.checkpoints.dir_of(step)).get(GROUP_KEY)
        if not recorded:
            return None
        own = os.path.abspath(self.checkpoints.path)
        folders = [os.path.normpath(os.path.join(own, f)) for f in recorded]
        return None if folders == self.folders else folders

    def loadable(self, step: int) -> bool:
        """Whether this rank can load its (complete) checkpoint of ``step``: its group wrote
        it, or every folder of the group that did holds that step complete.

        Raises:
            CheckpointError: a writer's folder is not there at all (the run directory is not
                on storage every node shares).
        """
        writers = self.writers(step)
        if writers is None:
            return True
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
        return all(problem(os.path.join(f, where)) is None for f in writers)

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
        own_folder = os.path.normpath(os.path.abspath(self.checkpoints.path))
        return [
            own if folder == own_folder else CheckpointDir.load(os.path.join(folder, where))
            for folder in writers
        ]
