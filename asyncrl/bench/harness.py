"""What the benchmarks share: one replica of a role, supervised, quiet, on one torch thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import yaml

from asyncrl.manifest.load import Supervision
from asyncrl.manifest.spec import SPEC_FILE_ENV, ProcessSpec, write_spec
from asyncrl.observe import logs
from asyncrl.supervision.supervisor import ChildSpec
from asyncrl.transport import LocalRegistry

__all__ = ["finished_run", "role_child"]


def finished_run(
    manifest: dict[str, Any], run_dir: str, what: str, timeout: float
) -> dict[str, Any]:
    """``asyncrl run`` of ``manifest`` (written to ``run_dir/manifest.yaml``) in a process of
    its own; the driver's record (``driver.json``) of a run that finished.

    Raises:
        RuntimeError: the run failed (``what`` names it), with the end of its output.
    """
    path = os.path.join(run_dir, "manifest.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(manifest, f, sort_keys=False)
    cmd = [sys.executable, "-m", "asyncrl.cli", "run", path, "--run-dir", run_dir]
    cmd.append("--allow-nonempty")  # the manifest lies in the run directory
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    report: dict[str, Any] = {}
    if os.path.exists(os.path.join(run_dir, "driver.json")):
        with open(os.path.join(run_dir, "driver.json")) as f:
            report = json.load(f)
    if out.returncode != 0 or not report.get("finished"):
        raise RuntimeError(
            f"{what} failed (exit status {out.returncode}, driver "
            f"{report.get('error', 'wrote no result')}); its output ends with:\n"
            f"{out.stdout[-2000:]}{out.stderr[-2000:]}"
        )
    return report


def role_child(
    run_dir: str,
    name: str,
    target: str,
    config: dict[str, Any],
    policy: Supervision,
    *,
    run: str = "bench",
) -> ChildSpec:
    """Replica 0 of role ``name`` (class ``target``) at its stable endpoint in ``run_dir``,
    with its console quiet and one compute thread, as the Supervisor starts it."""
    endpoint = LocalRegistry(run_dir).endpoint(name, 0)

    def launch(incarnation: int) -> tuple[list[str], dict[str, str]]:
        spec = ProcessSpec(
            kind="role",
            name=name,
            incarnation=incarnation,
            target=target,
            endpoint=endpoint,
            run=run,
            run_dir=run_dir,
            config=config,
            parent_pid=os.getpid(),
        )
        env = {
            SPEC_FILE_ENV: write_spec(spec),
            "OMP_NUM_THREADS": "1",
            logs.CONSOLE_ENV: "0",
        }
        return [sys.executable, "-m", "asyncrl.supervision.process"], env

    return ChildSpec(name, 0, "role", endpoint, policy, launch)
