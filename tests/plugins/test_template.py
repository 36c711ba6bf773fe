"""examples/plugin_template: installed as its own package (into a scratch directory, not the
shared environment), discovered through its entry point, and passing the self-check on CPU.
Its collectives are asyncrl's, checked with the cpu plugin; compilation is left to ``asyncrl
selfcheck`` itself, being slow on CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import ROOT

TEMPLATE = os.path.join(ROOT, "examples", "plugin_template")


@pytest.mark.slow
def test_the_template_installs_is_discovered_and_passes(tmp_path: Any) -> None:
    source, site = tmp_path / "src", tmp_path / "site"
    # pip builds in the source tree (build/, *.egg-info): build from a copy.
    shutil.copytree(TEMPLATE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), ROOT])}
    found = subprocess.run(
        [
            sys.executable,
            "-c",
            "from asyncrl.plugins import registry; print(registry.registered()['template'])",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=60,
    )
    assert found.stdout.strip() == "asyncrl_plugin_template:plugin"
    layers = ["operators", "memory", "checkpoints", "end_to_end"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.plugins.selfcheck",
            "--plugin",
            "template",
            "--json",
            "--layers",
            *layers,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    report = json.loads(out.stdout)
    failed = [c for layer in report["layers"] for c in layer["checks"] if not c["ok"]]
    assert (out.returncode, report["plugin"], failed) == (0, "template", [])
    assert [layer["name"] for layer in report["layers"]] == layers
