"""Partial rollouts with real processes: chunks of a sample resumed on either rollout replica.

``asyncrl run`` starts two rollout replicas with a 2-token chunk budget and the program in
``tests/integration/partial_program.py``, which resumes every sample chunk by chunk through the
dispatcher until all finish. Every resume keeps the tokens it was given, chunks move between
the replicas, and the replicas together generated exactly the tokens the samples hold.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 8
CHUNK = 2

MANIFEST = f"""\
run:
  name: partial-live
  program: tests.integration.partial_program:main
  config: {{groups: [1, 2], max_new_tokens: {MAX_NEW_TOKENS}}}
roles:
  rollout:
    class: asyncrl.roles.generation.rollout:Rollout
    replicas: 2
    capacity: 1
    threads: 1
    config:
      model_config: {{model_type: gpt2, vocab_size: 14, n_positions: 16, n_embd: 32,
                     n_layer: 1, n_head: 2, bos_token_id: 1, eos_token_id: 1, pad_token_id: 0}}
      chunk_tokens: {CHUNK}
      seed: 0
"""


def run_program(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, "manifest.yaml")
    with open(path, "w") as f:
        f.write(textwrap.dedent(MANIFEST))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "run",
            path,
            "--run-dir",
            run_dir,
            "--allow-nonempty",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(os.path.join(run_dir, "driver.json")) as f:
        result: dict[str, Any] = json.load(f)["result"]
    return result


def test_chunks_resume_on_either_replica_and_nothing_is_regenerated(run_dir: str) -> None:
    result = run_program(run_dir)
    chunks: list[list[dict[str, Any]]] = result["chunks"]
    assert len(chunks) == 3
    for sample in chunks:
        # One chunk per call, each CHUNK tokens longer; only the last is finished.
        assert [len(c["token_ids"]) for c in sample] == list(
            range(CHUNK, MAX_NEW_TOKENS + 1, CHUNK)
        )
        assert [(c["finished"], c["stop_reason"]) for c in sample] == [(False, "chunk")] * (
            len(sample) - 1
        ) + [(True, "length")]
        for before, after in itertools.pairwise(sample):
            k = len(before["token_ids"])
            for field in ("token_ids", "logprobs", "versions"):
                assert after[field][:k] == before[field], field
        assert sample[-1]["versions"] == [0] * MAX_NEW_TOKENS
    # Every call was told apart by the replicas' token counts, and a sample moved between them.
    replicas = [{c["replica"] for c in sample} for sample in chunks]
    assert all(None not in served for served in replicas), result["rounds"]
    assert any(served == {0, 1} for served in replicas), replicas
    stats = result["stats"]
    assert all(s["tokens_generated"] > 0 for s in stats), stats
    assert sum(s["tokens_generated"] for s in stats) == sum(
        len(sample[-1]["token_ids"]) for sample in chunks
    )
