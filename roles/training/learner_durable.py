"""The learner's durable state (``durable`` in its config; ``asyncrl.roles.training.journal``): what
a checkpoint holds, how a restarted learner loads it and replays its write-ahead log, and the
``checkpoint`` endpoint.

A replayed step is the step the learner took, bit for bit on the same hardware: the batch as it
was logged, every RNG as it was at the step's start, the same micro-batching (seeded by the
step). It writes its step-log line again, and neither logs, checkpoints, publishes nor replies.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import msgspec

from asyncrl.observe.trace import traced
from asyncrl.role import Delivery, RoleContext, endpoint
from asyncrl.roles.payloads import StepResult, TrainBatch
from asyncrl.roles.training.checkpoints import (
    CheckpointDir,
    StepLog,
    rng_bytes,
    rng_from_bytes,
    rng_state,
    set_rng_state,
)
from asyncrl.roles.training.data_parallel import DataParallel
from asyncrl.roles.training.journal import Journal, durability, replay_summary, wal_path
from asyncrl.roles.training.trainer import Trainer
from asyncrl.roles.training.wal import KeepEntry, StepEntry, WalError

__all__ = ["DurableSteps"]


class DurableSteps:
    """Mixed into the learner: its checkpoints, step log and write-ahead log."""

    ctx: RoleContext
    config: Any
    trainer: Trainer
    dp: DataParallel | None
    plugin: Any
    faults: Any
    version: int
    step: int
    keep: dict[str, Any]
    last: dict[str, Any]
    consumed: set[tuple[str, int]]
    replaying: bool = False
    replayed_steps: int = 0
    restored_step: int = -1

    def _open_journal(self, keep: int) -> None:
        """This replica's checkpoints, step log and (``durable: wal``) write-ahead log."""
        ctx = self.ctx
        self.checkpoints = CheckpointDir(
            ctx.path("checkpoints"), keep, self.faults, self.plugin.device.pin, ctx.log.warning
        )
        step_log = StepLog(
            os.path.join(ctx.run_dir, "ledger", f"{ctx.name}.{ctx.replica}.steps.jsonl")
        )
        self.journal = Journal(
            f"{ctx.name}.{ctx.replica}",
            self.checkpoints,
            step_log,
            wal_path(ctx.run_dir, ctx.name, ctx.replica),
            durability(self.config.durable),
            self.config.checkpoint_every,
            self.config.checkpoint_every_s,
            self.dp,
            ctx.log,
        )

    def _restore(self) -> None:
        """Load the agreed checkpoint, read the ledger up to it, replay the log after it."""
        latest = self.journal.restore_point()
        if latest is not None:
            self._load(latest)
            self.restored_step = self.step
        self._read_step_log()
        self._replay()

    # -- each step --------------------------------------------------------------------------

    def _step_rng(self) -> dict[str, Any]:
        """Every RNG at a step's start, for its log entry (``wal`` only)."""
        return rng_bytes() if self.journal.wal is not None and not self.replaying else {}

    def _durable_step(
        self, batch: TrainBatch, ids: list[tuple[str, int]], skipped: int, rng: dict[str, Any]
    ) -> None:
        """The step just taken, made durable as ``durable`` says, before its reply."""
        record = {
            "step": self.step,
            "version": self.version,
            "ids": ids,
            "skipped": skipped,
            "incarnation": self.ctx.incarnation,
            "phase": str(self.keep.get("phase", "")),
        }
        if self.replaying:
            self.journal.replayed(record)
            return
        self.faults.at("mid_step")
        self.journal.log_step(
            self.step, record, msgspec.msgpack.encode(batch), rng, self.last["result"]
        )
        traced("checkpoint", self.journal.after_step)(self.step, self._state)
        if self.dp is not None:
            # No rank publishes nor replies before every rank has the step on disk.
            self.dp.barrier("the step's log on every rank")
        self.faults.at("after_log")

    @endpoint(Delivery.ONCE)
    async def checkpoint(self, keep: dict[str, Any]) -> str:
        """Keep ``keep`` (the program's position) durably; returns where it is kept."""
        return await self.ctx.offload(traced("checkpoint", self._checkpoint), keep)

    def _checkpoint(self, keep: dict[str, Any]) -> str:
        self.keep.update(keep)
        if self.journal.wal is not None:
            self.journal.log_keep(self.step, keep)
            return self.journal.wal.path
        self.journal.wait()
        return self.checkpoints.save(self.step, self._state())

    # -- state --------------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        """What a checkpoint holds (a sharded rank: its own shards; ranks need no shared
        disk)."""
        return {
            **self.trainer.state(),
            "version": self.version,
            "step": self.step,
            "keep": self.keep,
            "last": json.dumps(self.last),
            "rng": rng_state(),
        }

    def _load(self, path: str) -> None:
        state = CheckpointDir.load(path)
        self.trainer.load_state(state)
        self.version = state["version"]
        self.step = state["step"]
        self.keep = state["keep"]
        self.last = json.loads(state.get("last", "{}"))
        set_rng_state(state["rng"])

    def _read_step_log(self) -> None:
        """The ledger from the step log, up to the restored step; the lines past it are cut
        (those steps are replayed from the write-ahead log, or trained again)."""
        assert self.journal.step_log is not None
        self.consumed, cut = self.journal.step_log.read(self.step)
        if cut and self.journal.wal is None:
            self.ctx.log.warning(
                f"step log: cut {cut} line(s) past the restored step {self.step}: steps that "
                f"never became durable, to be trained again"
            )

    def _replay(self) -> None:
        """Take again, in order, the steps logged after the restored checkpoint."""
        entries = self.journal.replay_entries(self.step)
        if not entries:
            return
        started = time.monotonic()
        for entry in entries:
            if isinstance(entry, KeepEntry):
                self.keep.update(entry.keep)
                continue
            assert isinstance(entry, StepEntry)
            self.faults.at("replay_step")
            set_rng_state(rng_from_bytes(entry.rng))
            batch = msgspec.msgpack.decode(entry.batch, type=TrainBatch)
            self.replaying = True
            try:
                result: StepResult = self.train(batch)  # type: ignore[attr-defined]
            finally:
                self.replaying = False
            if result.step != entry.step:
                raise WalError(
                    f"{self.ctx.name}: replaying the write-ahead log's step {entry.step} made "
                    f"step {result.step}: the log does not follow the restored checkpoint "
                    f"(step {self.restored_step}); start a new run from the newest export"
                )
            self.last["result"] = entry.result  # what the step replied, exactly
            self.replayed_steps += 1
        if not self.replayed_steps:  # only a keep given after the checkpoint
            return
        # A checkpoint of the replayed state, in the background: a learner killed again soon
        # (a crash loop) then replays only what follows it.
        self.journal.save_async(self.step, self._state)
        self.ctx.log.info(
            f"{self.ctx.name}: replayed {self.replayed_steps} logged step(s) "
            f"({replay_summary(entries)}) after checkpoint step {max(0, self.restored_step)} in "
            f"{time.monotonic() - started:.2f} s"
        )
