"""The durability of a role that trains (the learner, the critic): its checkpoints, its
write-ahead log, its replay, and its last step's result (``durable`` in its config;
``asyncrl.roles.training.journal`` says what each mode keeps).

``Durability`` is one component both roles compose. The role says what its state is and how
to take a step again; the component does the rest:

- **Each step.** ``step_rng`` is every RNG at the step's start (``wal`` only). After the step,
  ``took`` remembers its batch id and result, and ``made_durable`` logs the batch (and the
  learner's step-log record) before the reply and checkpoints when one is due; ranks of a
  group then wait for each other, so no rank replies before every rank has the step on disk.
- **A batch re-sent** with the last step's id gets that step's result back (``repeat``),
  marked ``replayed``, and trains nothing.
- **Restart.** ``restore`` loads the newest complete checkpoint (agreed with the other ranks),
  reads the ledger of consumed ids up to it (a role that keeps one), and replays the logged
  steps after it, in order, each with the RNGs of its start and the same micro-batching: the
  step the role took, bit for bit on the same hardware. A replayed step writes its step-log
  line again, and neither logs, checkpoints, publishes nor replies (``replaying``). A sharded
  checkpoint that another group wrote (the group went on at a smaller size) is loaded from
  every writer's folder, to be resharded (``asyncrl.roles.training.shard_group``).
- **A rank back in its group** as the group grows back after a node's loss takes the lead's
  checkpoints, log and ledger first (``asyncrl.roles.training.rejoin``), so that it restores
  the group's state rather than its own from before the loss.
- **A checkpoint** holds the role's state, the last step's result and every RNG (``state``);
  a sharded rank's also names its group's checkpoint folders.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from asyncrl.observe.trace import span, traced
from asyncrl.role import RoleContext
from asyncrl.roles.payloads import ProgramState
from asyncrl.roles.training.checkpoints import (
    CheckpointDir,
    StepLog,
    rng_bytes,
    rng_from_bytes,
    rng_state,
    set_rng_state,
)
from asyncrl.roles.training.data_parallel import DataParallel
from asyncrl.roles.training.journal import (
    Journal,
    durability,
    ledger_path,
    replay_summary,
    wal_path,
)
from asyncrl.roles.training.rejoin import rejoin_group
from asyncrl.roles.training.shard_group import GROUP_KEY, ShardGroup
from asyncrl.roles.training.wal import KeepEntry, StepEntry, WalError
from asyncrl.supervision.faults import FaultPlan

__all__ = ["Durability"]

R = TypeVar("R", bound=msgspec.Struct)


class Durability:
    """One replica's checkpoints, write-ahead log and replay.

    Args:
        ctx: the replica's context (name, replica, run directory, incarnation, log).
        durable: the config's ``durable`` (``wal``, ``checkpoint``, ``false``).
        every: steps between checkpoints (0: none by count).
        every_s: seconds between checkpoints (0: none by time).
        keep: the newest checkpoints kept.
        dp: the replica's data-parallel group, if any.
        pin: the hardware plugin's pinned copy (``plugin.device.pin``), for staging.
        step_log: keep a ledger of consumed ids (``RUN_DIR/ledger/<role>.<replica>.steps.jsonl``).
        sharded: the replica holds only its shards of the state (``parallel: fsdp`` in a group):
            its checkpoints name its group's folders (``ShardGroup``).

    Attributes:
        faults: the fault plan of this incarnation (``ASYNCRL_FAULTS``).
        checkpoints: where its checkpoints go.
        journal: its checkpoints, step log and write-ahead log together.
        group: its group's checkpoint folders (its own alone until ``restore`` gathers a
            sharded group's).
        last: the last step's batch id and result (``{}`` before the first).
        replaying: a logged step is being taken again.
        replayed_steps: how many logged steps the restart replayed.
        restored_step: the step of the checkpoint it restored (-1: none).
    """

    def __init__(
        self,
        ctx: RoleContext,
        *,
        durable: bool | str,
        every: int,
        every_s: float,
        keep: int,
        dp: DataParallel | None,
        pin: Any,
        step_log: bool,
        sharded: bool = False,
    ) -> None:
        self.ctx = ctx
        self.dp = dp
        self.sharded = sharded
        if dp is not None:
            # A rank back in its group as it grows: the lead's state is the group's now.
            rejoin_group(ctx, dp, sharded)
        self.faults = FaultPlan.from_env(ctx.incarnation)
        self.checkpoints = CheckpointDir(
            ctx.path("checkpoints"), keep, self.faults, pin, ctx.log.warning
        )
        log = None
        if step_log:
            log = StepLog(ledger_path(ctx.run_dir, ctx.name, ctx.replica))
        self.journal = Journal(
            f"{ctx.name}.{ctx.replica}",
            self.checkpoints,
            log,
            wal_path(ctx.run_dir, ctx.name, ctx.replica),
            durability(durable),
            every,
            every_s,
            dp,
            ctx.log,
        )
        self.group = ShardGroup(
            f"{ctx.name}.{ctx.replica}", self.checkpoints, [self.checkpoints.path]
        )
        self.last: dict[str, Any] = {}
        self.replaying = False
        self.replayed_steps = 0
        self.restored_step = -1

    # -- at start -----------------------------------------------------------------------------

    def restore(
        self,
        *,
        load: Callable[[dict[str, Any], list[dict[str, Any]] | None], int],
        replay: Callable[[bytes], int],
        state: Callable[[], dict[str, Any]],
        ledger: Callable[[set[tuple[str, int]]], None] | None = None,
        keep: Callable[[ProgramState], None] | None = None,
    ) -> None:
        """Load the agreed checkpoint, read the ledger up to it, replay the log after it.

        Args:
            load: puts a checkpoint's role state back (what ``state`` saved) and returns its
                step; the last result and the RNGs are put back here. Its second argument is
                None, or, for a sharded checkpoint another group wrote, every writer's state
                in rank order (its shards to reshard: ``Trainer.load_states``).
            replay: takes again the step of a logged batch (its encoded bytes) and returns
                its step number (``replaying`` is set meanwhile).
            state: the role's state now, for the checkpoint of the replayed state.
            ledger: given the consumed ids of the step log up to the restored step.
            keep: given each ``keep`` logged after the checkpoint, in order.

        Raises:
            WalError: the log is corrupt, does not reach back to the checkpoint, or a replayed
                step made another step than the one logged.
            CheckpointError: a sharded checkpoint another group wrote cannot be read whole.
        """
        step = 0
        if self.sharded and self.dp is not None:
            self.group = ShardGroup.gather(self.group.name, self.checkpoints, self.dp)
        latest = self.journal.restore_point(self.group)
        if latest is not None:
            saved = CheckpointDir.load(latest)
            states = self.group.states(latest, saved)
            if states is not None:
                self.ctx.log.info(
                    f"{self.ctx.name}: checkpoint {os.path.basename(latest)} was written by a "
                    f"group of {len(states)} rank(s); loading their shards at a group of "
                    f"{len(self.group.folders)}"
                )
            step = load(saved, states)
            self.last = json.loads(saved.get("last", "{}"))
            set_rng_state(saved["rng"])
            self.restored_step = step
        if self.journal.step_log is not None:
            consumed, cut = self.journal.step_log.read(step)
            if cut and self.journal.wal is None:
                self.ctx.log.warning(
                    f"step log: cut {cut} line(s) past the restored step {step}: steps that "
                    f"never became durable, to be trained again"
                )
            if ledger is not None:
                ledger(consumed)
        entries = self.journal.replay_entries(step)
        if not entries:
            return
        started = time.monotonic()
        for entry in entries:
            if isinstance(entry, KeepEntry):
                if keep is not None:
                    keep(entry.keep)
                continue
            assert isinstance(entry, StepEntry)
            self.faults.at("replay_step")
            set_rng_state(rng_from_bytes(entry.rng))
            self.replaying = True
            try:
                step = replay(entry.batch)
            finally:
                self.replaying = False
            if step != entry.step:
                raise WalError(
                    f"{self.ctx.name}: replaying the write-ahead log's step {entry.step} made "
                    f"step {step}: the log does not follow the restored checkpoint "
                    f"(step {self.restored_step}); start a new run from the newest export"
                )
            self.last["result"] = entry.result  # what the step replied, exactly
            self.replayed_steps += 1
        if not self.replayed_steps:  # only a keep given after the checkpoint
            return
        # A checkpoint of the replayed state, in the background: a role killed again soon
        # (a crash loop) then replays only what follows it.
        self.journal.save_async(step, lambda: self.state(state))
        self.ctx.log.info(
            f"{self.ctx.name}: replayed {self.replayed_steps} logged step(s) "
            f"({replay_summary(entries)}) after checkpoint step {max(0, self.restored_step)} in "
            f"{time.monotonic() - started:.2f} s"
        )

    # -- each step ----------------------------------------------------------------------------

    def step_rng(self) -> dict[str, Any]:
        """Every RNG at a step's start, for its log entry (``wal`` only, not replaying)."""
        return rng_bytes() if self.journal.wal is not None and not self.replaying else {}

    def repeat(self, batch_id: str, kind: type[R]) -> R | None:
        """The last step's result, as a ``kind`` marked ``replayed``, when ``batch_id`` is
        that step's (a batch re-sent after a lost reply); else None."""
        if not (batch_id and batch_id == self.last.get("id")):
            return None
        result = msgspec.convert(self.last["result"], kind)
        result.replayed = True  # type: ignore[attr-defined]
        return result

    def took(self, batch_id: str, result: msgspec.Struct) -> None:
        """Remember the step just taken: its batch id and result."""
        self.last = {"id": batch_id, "result": msgspec.to_builtins(result)}

    def made_durable(
        self,
        step: int,
        batch: msgspec.Struct,
        rng: dict[str, Any],
        state: Callable[[], dict[str, Any]],
        record: dict[str, Any] | None = None,
    ) -> None:
        """The step just taken (``took``), made durable as ``durable`` says, before its reply:
        ``batch`` logged with the RNGs of the step's start and ``record`` (the step log's line,
        a role that keeps one), a checkpoint of ``state`` when one is due. A replayed step
        writes its step-log line again and nothing else."""
        if self.replaying:
            self.journal.replayed(record or {})
            return
        with span("step log"):
            self._log(step, batch, rng, state, record or {})

    def _log(
        self,
        step: int,
        batch: msgspec.Struct,
        rng: dict[str, Any],
        state: Callable[[], dict[str, Any]],
        record: dict[str, Any],
    ) -> None:
        self.faults.at("mid_step")
        encoded = msgspec.msgpack.encode(batch)
        self.journal.log_step(step, record, encoded, rng, self.last["result"])
        traced("checkpoint", self.journal.after_step)(step, lambda: self.state(state))
        if self.dp is not None:
            # No rank publishes nor replies before every rank has the step on disk.
            self.dp.barrier("the step's log on every rank")
        self.faults.at("after_log")

    def keep_position(
        self, step: int, keep: ProgramState, state: Callable[[], dict[str, Any]]
    ) -> str:
        """Keep ``keep`` (a program's position, given after step ``step``) durably: in the
        write-ahead log with ``wal``, else in a whole checkpoint of ``state``; returns where."""
        if self.journal.wal is not None:
            self.journal.log_keep(step, keep)
            return self.journal.wal.path
        self.journal.wait()
        return self.checkpoints.save(step, self.state(state))

    # -- state --------------------------------------------------------------------------------

    def state(self, role: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """What a checkpoint holds: the ``role``'s state, the last step's result, every RNG;
        a sharded rank: its own shards and its group's checkpoint folders (``GROUP_KEY``),
        read only when another group loads it."""
        out = {**role(), "last": json.dumps(self.last), "rng": rng_state()}
        if out.get("world") is not None:
            out[GROUP_KEY] = self.group.relative()
        return out

    @property
    def mode(self) -> str:
        """``wal``, ``checkpoint`` or ``off``."""
        return self.journal.mode

    def close(self) -> None:
        """Wait for a checkpoint in progress and close the log."""
        self.journal.close()
