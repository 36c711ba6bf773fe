"""What a trainer (the learner, the critic) keeps durable, by mode (``durable`` in its config):

- ``wal`` (the default): before a step replies, the batch it consumed is appended to a
  write-ahead log and fsynced (``asyncrl.roles.training.wal``): kilobytes to megabytes, not the
  model. Checkpoints are written every ``checkpoint_every`` steps or ``checkpoint_every_s`` seconds,
  whichever comes first, asynchronously: the step pauses only to copy the state into host
  buffers (``CheckpointDir.stage``); a background thread writes it and marks it complete. While
  one save is still writing, a due save is skipped (and logged): saves never pile up. A
  restarted trainer loads the newest complete checkpoint and replays the logged steps after it
  (``replay_entries``), bit for bit, before it serves.
- ``checkpoint``: a whole checkpoint, written before every reply (small models).
- ``off``: checkpoints as ``wal`` schedules them, no log: a restarted trainer goes back to its
  last checkpoint, and the run fails loudly (its version goes back).

Data-parallel ranks decide together: each save is started by all of them at the same step, and
at a restart they agree on the checkpoint (the newest every rank holds complete) and on the last
logged step (a step some rank never logged was never acknowledged: the others cut it). The log
keeps the steps after the older of the two newest checkpoints, so a rank that has the newest
only half written, or a damaged newest, goes back one checkpoint and replays from there.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from asyncrl.roles.payloads import ProgramState
from asyncrl.roles.training.checkpoints import CheckpointDir, CheckpointError, Staged, StepLog
from asyncrl.roles.training.data_parallel import DataParallel, agree_checkpoint
from asyncrl.roles.training.shard_group import ShardGroup
from asyncrl.roles.training.wal import Entry, KeepEntry, StepEntry, WalError, WriteAheadLog
from asyncrl.supervision.faults import FaultPlan

__all__ = ["Durable", "Journal", "durability", "ledger_path", "replay_summary", "wal_path"]

Durable = Literal["wal", "checkpoint", "off"]


def durability(value: bool | str) -> Durable:
    """A config's ``durable``: ``wal``, ``checkpoint`` or ``off`` (``true``: ``wal``,
    ``false``: ``off``).

    Raises:
        ValueError: any other value.
    """
    if value is True or value == "wal":
        return "wal"
    if value is False or value in ("off", "false"):
        return "off"
    if value == "checkpoint":
        return "checkpoint"
    raise ValueError(f"durable: expected wal, checkpoint or false, got {value!r}")


def replay_summary(entries: Sequence[Entry]) -> str:
    steps = [e.step for e in entries if isinstance(e, StepEntry)]
    return f"steps {steps[0]}..{steps[-1]}" if steps else "no step"


class Journal:
    """One trainer replica's durable state: its checkpoints, step log and write-ahead log.

    Args:
        name: the role's name, for messages.
        checkpoints: where its checkpoints go.
        step_log: its ledger of consumed ids, if it keeps one.
        wal_path: its write-ahead log's directory.
        mode: ``wal``, ``checkpoint`` or ``off``.
        every: steps between checkpoints (0: none by count).
        every_s: seconds between checkpoints (0: none by time).
        dp: its data-parallel group, if any.
        log: its logger (``info``, ``warning``, ``error``).
    """

    def __init__(
        self,
        name: str,
        checkpoints: CheckpointDir,
        step_log: StepLog | None,
        wal_path: str,
        mode: Durable,
        every: int,
        every_s: float,
        dp: DataParallel | None,
        log: Any,
    ) -> None:
        self.name = name
        self.checkpoints = checkpoints
        self.step_log = step_log
        self.mode = mode
        self.every = every
        self.every_s = every_s
        self.dp = dp
        self.log = log
        self.wal = WriteAheadLog(wal_path, log.warning) if mode == "wal" else None
        self._writer = concurrent.futures.ThreadPoolExecutor(1, f"{name}-checkpoint")
        self._pending: concurrent.futures.Future[str] | None = None
        self._pending_step = -1
        self._skipped_for = -1
        self._saved_step = 0
        self._saved_at = time.monotonic()
        self.faults: FaultPlan = checkpoints.faults

    # -- at start -----------------------------------------------------------------------------

    def restore_point(self, group: ShardGroup | None = None) -> str | None:
        """The checkpoint to load (None: the initial state, no checkpoint held): the newest
        complete one, agreed with the other ranks; incomplete or damaged ones are removed with
        a warning. ``group``: this rank's group now; a checkpoint whose values do not read is
        skipped with a warning, and a sharded checkpoint another group wrote counts only where
        every writer's folder holds it complete (``ShardGroup.loadable``); the checkpoints past
        the one taken are removed (a timeline it goes back from).

        Raises:
            CheckpointError: a writer's folder of such a checkpoint is not there at all, lies
                outside the run directory or through a link; or checkpoints are held (on any
                rank) but none loads: then none is removed.
        """
        self.checkpoints.sweep()
        steps = self.checkpoints.steps()
        loadable = steps
        why_none = ""
        if group is not None:  # newest first: a folder not there is named at the newest
            steps = [s for s in steps if group.readable(s)]
            loadable = [s for s in reversed(steps) if group.loadable(s)][::-1]
            if steps and not loadable:
                why_none = group.none_loadable(steps)
        if self.dp is None:
            if why_none:
                raise CheckpointError(why_none)
            if loadable:
                self.checkpoints.drop_after(loadable[-1])
            return self.checkpoints.at(loadable[-1]) if loadable else None
        return agree_checkpoint(self.dp, self.checkpoints, loadable, why_none)

    def replay_entries(self, restored: int) -> list[Entry]:
        """The logged entries to replay after the checkpoint of step ``restored`` (0: none),
        oldest first, cut at the last step every rank logged.

        Raises:
            WalError: the log is corrupt, or does not reach back to ``restored``.
        """
        self._saved_step = restored
        if self.wal is None:
            return []
        entries = self.wal.entries()
        last = max((e.step for e in entries if isinstance(e, StepEntry)), default=restored)
        if self.dp is not None:
            agreed = self.dp.min_int("the last logged step", last)
            cut = self.wal.cut_after(agreed)
            if cut:
                self.log.warning(
                    f"{self.name}: write-ahead log: cut {cut} entr(ies) past step {agreed}, the "
                    f"last step every rank logged (never acknowledged)"
                )
                entries = self.wal.entries()
        out = [
            e
            for e in entries
            if e.step > restored or (isinstance(e, KeepEntry) and e.step == restored)
        ]
        steps = [e.step for e in out if isinstance(e, StepEntry)]
        if steps and steps != list(range(restored + 1, restored + 1 + len(steps))):
            raise WalError(
                f"{self.name}: write-ahead log {self.wal.path} holds steps {steps[0]}..{steps[-1]} "
                f"after the checkpoint of step {restored} (expected them from step {restored + 1} "
                f"on, without gaps): the steps between were lost. Start a new run from the "
                f"newest export, or restore the removed log segments"
            )
        return out

    # -- each step ------------------------------------------------------------------------------

    def log_step(
        self,
        step: int,
        record: dict[str, Any],
        batch: bytes,
        rng: dict[str, Any],
        result: dict[str, Any],
    ) -> None:
        """Make step ``step`` durable as the mode says (the log before the reply)."""
        if self.step_log is not None:
            # Synced only where the step log is what makes the step durable: with ``wal`` the
            # log holds the step, and ``off`` promises nothing before the reply.
            self.step_log.append(record, sync=self.mode == "checkpoint")
        if self.wal is not None:
            self.wal.append(StepEntry(step, batch, rng, result))

    def log_keep(self, step: int, keep: ProgramState) -> None:
        """Make a ``keep`` given after step ``step`` durable (``wal``)."""
        if self.wal is not None:
            self.wal.append(KeepEntry(step, keep))

    def replayed(self, record: dict[str, Any]) -> None:
        """A replayed step: its step-log line, written again (the log past the checkpoint was
        cut when it was read)."""
        if self.step_log is not None:
            self.step_log.append(record, sync=False)

    def after_step(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """Checkpoint after step ``step`` if one is due (``state`` makes what it holds)."""
        self.settle()
        if self.mode == "checkpoint":
            self.checkpoints.save(step, state())
            self._saved_step = step
            return
        due = (self.every > 0 and step - self._saved_step >= self.every) or (
            self.every_s > 0 and time.monotonic() - self._saved_at >= self.every_s
        )
        busy = self._pending is not None
        go = due and not busy
        if self.dp is not None:  # every rank saves at the same step, or none does
            go = self.dp.min_int("whether to checkpoint", int(go)) == 1
        if not go:
            if due and self._skipped_for != self._pending_step:  # once per save in progress
                self._skipped_for = self._pending_step
                self.log.debug(
                    f"{self.name}: checkpoint of step {step} skipped: the save of step "
                    f"{self._pending_step} is still writing (saves never pile up; the next "
                    f"one starts when it is done)"
                )
            return
        self.save_async(step, state)

    def save_async(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """Stage the state of step ``step`` now, and write it in the background."""
        started = time.monotonic()
        if self.step_log is not None:  # its lines up to the step, durable before the marker
            self.step_log.sync()
        staged = self.checkpoints.stage(step, state())
        if self.wal is not None:  # the steps after it go to a segment of their own
            self.wal.begin_segment(step + 1)
        self._pending = self._writer.submit(self._write, staged, started)
        self._pending_step = step
        self._saved_step = step
        self._saved_at = started

    def _write(self, staged: Staged, started: float) -> str:
        staged_s = time.monotonic() - started
        path = self.checkpoints.write(staged)
        self.log.debug(
            f"{self.name}: checkpoint of step {staged.step} complete: staged in {staged_s:.2f} s, "
            f"written in {time.monotonic() - started - staged_s:.2f} s"
        )
        return path

    def settle(self) -> None:
        """Take in a finished background save: drop the log segments the older of the two
        newest checkpoints covers. A failed save is logged; the log still holds its steps."""
        pending = self._pending
        if pending is None or not pending.done():
            return
        self._pending = None
        error = pending.exception()
        if error is not None:
            self.log.error(
                f"{self.name}: the checkpoint of step {self._pending_step} failed ({error}); "
                f"the write-ahead log keeps every step since the last complete one"
            )
            return
        steps = self.checkpoints.steps()
        if self.wal is not None and len(steps) >= 2:
            self.wal.drop_through(steps[-2])

    def wait(self) -> None:
        """Wait for a save in progress, and take it in."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending])
            self.settle()

    def close(self) -> None:
        self.wait()
        self._writer.shutdown(wait=True)
        if self.wal is not None:
            self.wal.close()


def ledger_path(run_dir: str, name: str, replica: int) -> str:
    """A replica's step ledger: ``RUN_DIR/ledger/<role>.<replica>.steps.jsonl``."""
    return os.path.join(run_dir, "ledger", f"{name}.{replica}.steps.jsonl")


def wal_path(run_dir: str, name: str, replica: int) -> str:
    """A replica's write-ahead log: ``RUN_DIR/ledger/<role>.<replica>.wal/``."""
    return os.path.join(run_dir, "ledger", f"{name}.{replica}.wal")
