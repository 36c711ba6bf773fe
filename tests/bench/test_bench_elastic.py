"""``asyncrl bench elastic`` runs end to end on a tiny model: a sharded group's state loads onto
one rank and back onto two, the whole model bit for bit each time, with every figure and its
ratio to the same-size restore measured in the same process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

MOVE = {
    "start_s",
    "load_s",
    "same_size_load_s",
    "load_ratio",
    "resume_s",
    "parity_max_abs_diff",
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_elastic_benchmark_json_on_a_small_model() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "bench", "elastic", "--small", "--json"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
        check=True,
    )
    figures = json.loads(out.stdout)
    assert figures["model"] == "qwen2-small"
    assert figures["params"] == 20_768  # the tiny Qwen2's, the tied embedding counted once
    for move in ("shrink", "grow"):
        row = figures[move]
        assert set(row) == MOVE, move
        # The other group's whole model, after the load, to the bit.
        assert row["parity_max_abs_diff"] == 0.0, move
        assert row["load_ratio"] == pytest.approx(row["load_s"] / row["same_size_load_s"])
        assert row["resume_s"] > row["start_s"] + row["load_s"] > 0
