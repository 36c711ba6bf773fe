"""The README is the front door: its Python example runs and its commands exist."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_python_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", _readme(), re.S)
    assert blocks, "the README has no Python example"
    for code in blocks:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "5"


def test_make_targets_named_in_the_readme_exist() -> None:
    with open(os.path.join(ROOT, "Makefile")) as f:
        targets = set(re.findall(r"^([a-z-]+):", f.read(), re.M))
    named = set(re.findall(r"`?make ([a-z-]+)", _readme()))
    assert {"run", "test", "lint", "bench"} <= named
    assert named <= targets


def test_ci_runs_the_readme_test_command() -> None:
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert "make test" in f.read().splitlines()
    assert "make test    # sets up .venv, then runs the whole test suite" in _readme()


def test_the_pipeline_section_in_the_readme_is_valid() -> None:
    from asyncrl.manifest.load import parse_manifest

    (block,) = re.findall(r"```yaml\n(pipeline:.*?)```", _readme(), re.S)
    manifest = parse_manifest("run: {name: x, program: a:b}\nroles: {r: {class: a:B}}\n" + block)
    assert manifest.pipeline.mode == "async"
    assert manifest.pipeline.straggler.policy == "emit"


def test_the_summary_table_in_the_readme_is_what_a_run_prints(tmp_path: Any) -> None:
    """The README's example of ``make run``'s output ends with the table ``asyncrl run``
    prints for that run's report and summary.json (its figures)."""
    from asyncrl.supervision.runreport import RunReport, summary_table

    (block,) = re.findall(r"```text\n(BC step 100.*?)```", _readme(), re.S)
    shown = block[block.index("run summary") :].rstrip("\n")
    with open(os.path.join(tmp_path, "summary.json"), "w") as f:
        json.dump(
            {
                "accuracy_before_rl": 0.433,
                "accuracy_final": 0.998,
                "samples_consumed": 102400,
                "pipeline": {"generated_samples": 154974, "wasted_samples": 52541},
            },
            f,
        )
    report = RunReport(
        status="completed",
        reason="the control-flow program finished",
        restarts={"driver": 0, "learner": 0},
        wall_s=221.3,
    )
    assert summary_table(report, str(tmp_path)) == shown
