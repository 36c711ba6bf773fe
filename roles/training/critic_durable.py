"""The critic's durable state, as the learner's (``asyncrl.roles.training.journal``, ``durable`` in
its config): a write-ahead log of each step's batch before the reply, checkpoints in the background,
and a restart that loads the newest checkpoint and replays the logged steps after it, bit for
bit, before it serves. A batch re-sent with the last step's id (``CriticBatch.id``) gets that
step's result back (``replayed``) and trains nothing. The critic keeps no ledger of consumed
ids: its batches are the learner's, which keeps that ledger.
"""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec

from asyncrl.role import RoleContext
from asyncrl.roles.payloads import CriticBatch, CriticStepResult
from asyncrl.roles.training.checkpoints import (
    CheckpointDir,
    rng_bytes,
    rng_from_bytes,
    rng_state,
    set_rng_state,
)
from asyncrl.roles.training.data_parallel import DataParallel
from asyncrl.roles.training.journal import Journal, durability, replay_summary, wal_path
from asyncrl.roles.training.trainer import Trainer
from asyncrl.roles.training.wal import StepEntry, WalError
from asyncrl.supervision.faults import FaultPlan

__all__ = ["CriticDurable"]


class CriticDurable:
    """Mixed into the critic: its checkpoints and write-ahead log."""

    ctx: RoleContext
    config: Any
    trainer: Trainer
    dp: DataParallel | None
    plugin: Any
    step: int
    last: dict[str, Any]
    replaying: bool = False
    replayed_steps: int = 0
    restored_step: int = -1

    def _open_journal(self) -> None:
        ctx = self.ctx
        self.faults = FaultPlan.from_env(ctx.incarnation)
        keep = (
            self.config.keep_checkpoints
            if self.dp is None
            else max(2, self.config.keep_checkpoints)
        )
        self.checkpoints = CheckpointDir(
            ctx.path("checkpoints"), keep, self.faults, self.plugin.device.pin, ctx.log.warning
        )
        self.journal = Journal(
            f"{ctx.name}.{ctx.replica}",
            self.checkpoints,
            None,
            wal_path(ctx.run_dir, ctx.name, ctx.replica),
            durability(self.config.durable),
            self.config.checkpoint_every,
            self.config.checkpoint_every_s,
            self.dp,
            ctx.log,
        )

    def _restore(self) -> None:
        """Load the agreed checkpoint, then replay the log after it."""
        self.last = {}
        latest = self.journal.restore_point()
        if latest is not None:
            self._load(latest)
            self.restored_step = self.step
        entries = [e for e in self.journal.replay_entries(self.step) if isinstance(e, StepEntry)]
        if not entries:
            return
        started = time.monotonic()
        for entry in entries:
            self.faults.at("replay_step")
            set_rng_state(rng_from_bytes(entry.rng))
            batch = msgspec.msgpack.decode(entry.batch, type=CriticBatch)
            self.replaying = True
            try:
                result: CriticStepResult = self.train(batch)  # type: ignore[attr-defined]
            finally:
                self.replaying = False
            if result.step != entry.step:
                raise WalError(
                    f"{self.ctx.name}: replaying the write-ahead log's step {entry.step} made "
                    f"step {result.step}: the log does not follow the restored checkpoint"
                )
            self.last = {"id": batch.id, "result": entry.result}
            self.replayed_steps += 1
        self.ctx.log.info(
            f"{self.ctx.name}: replayed {self.replayed_steps} logged step(s) "
            f"({replay_summary(entries)}) in {time.monotonic() - started:.2f} s"
        )
        self.journal.save_async(self.step, self._state)

    def _repeat(self, batch: CriticBatch) -> CriticStepResult | None:
        """The last step's result when ``batch`` is that step's, re-sent; else None."""
        if not (batch.id and batch.id == self.last.get("id")):
            return None
        result = msgspec.convert(self.last["result"], CriticStepResult)
        result.replayed = True
        return result

    def _step_rng(self) -> dict[str, Any]:
        return rng_bytes() if self.journal.wal is not None and not self.replaying else {}

    def _durable_step(
        self, batch: CriticBatch, result: CriticStepResult, rng: dict[str, Any]
    ) -> None:
        """The step just taken, made durable as ``durable`` says, before its reply."""
        self.last = {"id": batch.id, "result": msgspec.to_builtins(result)}
        if self.replaying:
            return
        self.faults.at("mid_step")
        self.journal.log_step(
            self.step, {}, msgspec.msgpack.encode(batch), rng, self.last["result"]
        )
        self.journal.after_step(self.step, self._state)
        if self.dp is not None:
            self.dp.barrier("the critic step's log on every rank")
        self.faults.at("after_log")

    def _state(self) -> dict[str, Any]:
        return {
            **self.trainer.state(),
            "step": self.step,
            "last": json.dumps(self.last),
            "rng": rng_state(),
        }

    def _load(self, path: str) -> None:
        state = CheckpointDir.load(path)
        self.trainer.load_state(state)
        self.step = state["step"]
        self.last = json.loads(state.get("last", "{}"))
        set_rng_state(state["rng"])
