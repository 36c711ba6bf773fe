"""The program's position kept with the learner (``ProgramState``): how it merges, and that the
records written when it was a plain map (wire, write-ahead log, checkpoint values) still
decode into it."""

from __future__ import annotations

from typing import Any, cast

import msgspec

from asyncrl.roles.payloads import LearnerStatus, ProgramState, Stopped, TrainBatch
from asyncrl.roles.training.wal import KeepEntry, StepEntry, WriteAheadLog

# A keep as programs wrote it before it was typed: the pipeline's position, the run's phase and
# ended phases, a stopped loop, and a key of the program's own (RLLoop.keep) beside them.
OLD_KEEP: dict[str, Any] = {
    "cursor": 96,
    "resume": {"cursor": 96, "settled": [97], "pipeline": {"admitted_samples": 800}},
    "phase": "rl",
    "phase_start": 400,
    "phases": {"bc": {"start": 0, "end": 400, "accuracy": 0.43}},
    "stopped": {"id": "rl-", "step": 12, "reason": "the reward 0.9 reached its target 0.9"},
    "epoch": 3,
}
TYPED = ProgramState(
    cursor=96,
    resume={"cursor": 96, "settled": [97], "pipeline": {"admitted_samples": 800}},
    phase="rl",
    phase_start=400,
    phases={"bc": {"start": 0, "end": 400, "accuracy": 0.43}},
    stopped=Stopped(id="rl-", step=12, reason="the reward 0.9 reached its target 0.9"),
)


class OldKeepEntry(msgspec.Struct, tag="keep"):
    """The write-ahead log's keep record as it was written before ``ProgramState``."""

    step: int
    keep: dict[str, Any]


def test_an_old_dict_shaped_train_batch_decodes_into_the_struct() -> None:
    old = msgspec.msgpack.encode({"samples": [], "algorithm": "grpo", "keep": OLD_KEEP})
    batch = msgspec.msgpack.decode(old, type=TrainBatch)
    # The six position keys land in their fields; a key the struct does not know is ignored.
    assert batch.keep == TYPED


def test_an_old_status_and_checkpoint_values_decode_into_the_struct() -> None:
    status = msgspec.msgpack.encode({"version": 3, "step": 3, "keep": OLD_KEEP})
    assert msgspec.msgpack.decode(status, type=LearnerStatus).keep == TYPED
    # A checkpoint's values hold the keep as a plain map (msgspec.to_builtins on save).
    assert msgspec.convert(OLD_KEEP, ProgramState) == TYPED
    assert msgspec.convert(msgspec.to_builtins(TYPED), ProgramState) == TYPED


def test_an_old_write_ahead_log_replays_into_the_struct(tmp_path: Any) -> None:
    wal = WriteAheadLog(str(tmp_path), lambda warning: None)
    batch = msgspec.msgpack.encode({"samples": [], "keep": {"cursor": 32}})
    wal.append(StepEntry(1, batch))
    wal.append(cast(Any, OldKeepEntry(1, {"phase": "rl", "phase_start": 1})))
    step, kept = wal.entries()
    assert isinstance(step, StepEntry) and isinstance(kept, KeepEntry)
    assert msgspec.msgpack.decode(step.batch, type=TrainBatch).keep == ProgramState(cursor=32)
    assert kept.keep == ProgramState(phase="rl", phase_start=1)


def test_it_encodes_as_the_map_of_what_it_gives() -> None:
    """The same map a program wrote before: only the keys given."""
    keep = ProgramState(cursor=5, phase="bc", program={"epoch": 1})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(keep)) == {
        "cursor": 5,
        "phase": "bc",
        "program": {"epoch": 1},
    }
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ProgramState())) == {}


def test_merged_takes_what_the_newer_gives_and_keeps_the_rest() -> None:
    held = ProgramState(
        cursor=64,
        resume={"cursor": 64},
        phase="bc",
        phase_start=0,
        phases={"warmup": {"end": 10}},
        program={"epoch": 1, "seen": 7},
    )
    newer = ProgramState(
        phase="rl",
        phase_start=400,
        phases={"bc": {"end": 400}},
        stopped=Stopped(id="rl-", step=3, reason="steps"),
        program={"epoch": 2},
    )
    assert held.merged(newer) == ProgramState(
        cursor=64,
        resume={"cursor": 64},
        phase="rl",
        phase_start=400,
        phases={"warmup": {"end": 10}, "bc": {"end": 400}},
        stopped=Stopped(id="rl-", step=3, reason="steps"),
        program={"epoch": 2, "seen": 7},
    )
    assert held.merged(ProgramState()) == held
    # A cursor of 0 is a position given, not an absence.
    assert held.merged(ProgramState(cursor=0)).cursor == 0
