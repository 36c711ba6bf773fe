"""An environment written outside asyncrl (examples/external_role/guess_env.py: only pyzmq and
msgpack) runs as a ``command:`` role: the episode runner plays it as it plays a Python
``Environment``, and a replica killed mid-run has its episodes restarted (or replayed) and
each still played to its end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MANIFEST = """\
run:
  name: external-env
  program: tests.integration.external_env_program:main
  config: {{games: 60, deterministic: {deterministic}}}
roles:
  env:
    command: [{python}, examples/external_role/guess_env.py]
    replicas: 2
    capacity: 64
"""

BISECT_TURNS = {1: 1, 2: 2, 3: 3, 4: 4}  # turns -> games a bisection wins in that many, of 15


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_command_role_environment_survives_a_kill(run_dir: str, deterministic: bool) -> None:
    path = os.path.join(run_dir, "m.yaml")
    with open(path, "w") as f:
        f.write(MANIFEST.format(deterministic=str(deterministic).lower(), python=sys.executable))
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
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    with open(os.path.join(run_dir, "driver.json")) as f:
        result = json.load(f)["result"]
    assert result["won"] == 60  # bisecting 1..15 always wins within four guesses
    # 1 game in 15 takes one guess, 2 take two, 4 three and 8 four: as bisection does
    assert sorted(result["turns"]) == sorted([1] * 4 + [2] * 8 + [3] * 16 + [4] * 32)
    assert result["incarnation_after"] == 1
    lost = result["replays"] if deterministic else result["restarts"]
    assert lost >= 1 and result["replays" if not deterministic else "restarts"] == 0
