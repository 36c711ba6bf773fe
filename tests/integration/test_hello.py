"""The README's hello example runs as documented."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_hello_example(run_dir: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "run",
            "examples/hello/manifest.yaml",
            "--run-dir",
            run_dir,
            "--set",
            "roles.splitter.replicas=3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    with open(os.path.join(run_dir, "driver.json")) as f:
        assert json.load(f)["result"] == [["the", 4], ["dog", 3], ["fox", 3]]
    assert "splitter: 3 replica(s), restarts 0, requests served 3" in out.stdout
