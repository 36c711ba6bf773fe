"""The examples end to end: install the entry-point example package, then ``asyncrl run`` it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

EXAMPLE = os.path.join(ROOT, "examples", "entry_point_role")
MANIFEST = "examples/entry_point_role/manifest.yaml"
RESULT = {
    "greetings": {"Ada": "Hello, Ada", "Grace": "Hello, Grace", "Alan": "Hello, Alan"},
    "shouted": "HELLO, ADA!",
    "greeted": ["Ada", "Alan", "Grace"],
}


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    """The example package installed into a directory of its own, not into the shared venv."""
    work = tempfile.mkdtemp(prefix="arl-")
    # pip builds a local directory in place; a copy keeps build/ and *.egg-info out of the repo.
    source = os.path.join(work, "src")
    shutil.copytree(
        EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    target = os.path.join(work, "site")
    cmd = [
        *(sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation"),
        *("--disable-pip-version-check", "--no-input", "--target", target, source),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    yield target
    shutil.rmtree(work, ignore_errors=True)


def run_example(site: str, run_dir: str, *args: str) -> tuple[int, str, str]:
    """``asyncrl run`` the example's manifest from the repository root; wait for it to exit."""
    path = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
    # The manifest starts the external role as `python`: the one of this venv (pyzmq, msgpack).
    bin_path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "run", MANIFEST, "--run-dir", run_dir, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": path, "PATH": bin_path},
    )
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the run did not end within 90 s:\n{out}{err}") from None
    return proc.returncode, out, err


@dataclass
class Finished:
    code: int
    out: str
    err: str
    run_dir: str

    def json(self, name: str) -> Any:
        with open(os.path.join(self.run_dir, name)) as f:
            return json.load(f)


@pytest.fixture(scope="module")
def example(site: str) -> Iterator[Finished]:
    """One run of the example, shared by the tests that read it."""
    run_dir = tempfile.mkdtemp(prefix="arl-")
    yield Finished(*run_example(site, run_dir), run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)


def test_the_entry_point_example_runs(example: Finished) -> None:
    assert example.code == 0, example.out + example.err
    driver = example.json("driver.json")
    assert driver["finished"] is True
    assert driver["result"] == RESULT
    assert "greeter: 1 replica(s), restarts 0, requests served 4" in example.out
    assert "echo: 1 replica(s), restarts 0, requests served 1" in example.out
    assert f"result: {json.dumps(RESULT)}" in example.out
    report = example.json("report.json")
    assert report["status"] == "completed"
    assert report["restarts"]["greeter"] == report["restarts"]["echo"] == 0
    with open(os.path.join(example.run_dir, "roles", "greeter.0", "greeted.txt")) as f:
        assert sorted(f.read().split()) == RESULT["greeted"]


def test_the_driver_takes_an_external_role_without_describe(example: Finished) -> None:
    with open(os.path.join(example.run_dir, "logs", "driver.0.jsonl")) as f:
        retries = [line for line in f if "not reachable yet" in line]
    assert retries == []
    assert example.json("report.json")["restarts"]["driver"] == 0


def test_an_unregistered_role_name_is_a_configuration_error(site: str, run_dir: str) -> None:
    """``class: no_such_role``: the process exits with 78 and the run ends, unrestarted."""
    code, out, err = run_example(site, run_dir, "--set", "roles.greeter.class=no_such_role")
    assert code == 1, out + err
    message = (
        "configuration error: class 'no_such_role': no role of that name is registered under "
        "the entry-point group 'asyncrl.roles' (registered: greeter); use 'module:Class' or "
        "install the package that provides it"
    )
    assert "run failed: greeter[0] has a configuration error" in out
    assert f"| {message}" in out
    report = Finished(code, out, err, run_dir).json("report.json")
    assert report["status"] == "failed"
    assert report["failure"]["role"] == "greeter"
    assert report["failure"]["code"] == 78
    assert report["failure"]["reason"] == "configuration error"
    assert message in report["failure"]["stderr_tail"]
    assert report["restarts"]["greeter"] == 0
    assert [e["role"] for e in report["exits"]] == ["greeter"]
