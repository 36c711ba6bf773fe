"""``asyncrl bench durability`` runs end to end on a tiny model: every figure, each ratio against
its own round's baseline, and a SIGKILLed write-ahead-logged learner that replays its logged
steps into the weights of a learner never killed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.durability import format_table
from tests.conftest import ROOT

ARGS = ["--steps", "2", "--warmup", "1", "--k", "3"]
KEYS = {
    "params",
    "step_s_off",
    "step_s_wal",
    "step_s_checkpoint",
    "wal_over_off",
    "checkpoint_over_off",
    "recovery_s",
    "replayed_steps",
    "bit_identical",
}


@pytest.mark.slow
def test_durability_benchmark_json_on_a_small_model() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "bench", "durability", "--small", "--json", *ARGS],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=True,
    )
    figures = json.loads(out.stdout)
    assert set(figures) >= KEYS
    assert figures["model"] == "qwen2-small"
    assert figures["params"] == 107_072  # SMALL's, the tied embedding counted once
    # The kill came 3 logged steps after the checkpoint of step warmup + steps = 3.
    assert (figures["restored_step"], figures["replayed_steps"]) == (3, 3)
    assert figures["bit_identical"] is True
    assert figures["wal_over_off"] == pytest.approx(
        figures["step_s_wal"] / figures["step_s_off_round1"]
    )
    assert figures["checkpoint_over_off"] == pytest.approx(
        figures["step_s_checkpoint"] / figures["step_s_off_round2"]
    )
    assert (
        min(figures["step_s_off_round1"], figures["step_s_off_round2"])
        <= figures["step_s_off"]
        <= max(figures["step_s_off_round1"], figures["step_s_off_round2"])
    )
    assert figures["wal_log_only_over_off"] > 0  # --steps 2: one step before the checkpoint
    # A restart imports torch and builds the model before it loads and replays.
    assert figures["recovery_s"] > figures["replay_s"] > 0
    assert figures["checkpoint_bytes"] > 12 * figures["params"]  # weights and AdamW's moments
    table = format_table(figures)
    assert f"{figures['wal_over_off']:.2f}x" in table
    assert f"{figures['checkpoint_over_off']:.2f}x" in table
    assert "equal those of a learner never killed: True" in table
