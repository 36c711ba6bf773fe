"""What the benchmarks share: one replica of a role, supervised, quiet, on one torch thread."""

from __future__ import annotations

import os
import sys
from typing import Any

import msgspec

from asyncrl.manifest.load import Supervision
from asyncrl.manifest.spec import SPEC_ENV, ProcessSpec
from asyncrl.observe import logs
from asyncrl.supervision.supervisor import ChildSpec
from asyncrl.transport import LocalRegistry

__all__ = ["role_child"]


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
            SPEC_ENV: msgspec.json.encode(spec).decode(),
            "OMP_NUM_THREADS": "1",
            logs.CONSOLE_ENV: "0",
        }
        return [sys.executable, "-m", "asyncrl.supervision.process"], env

    return ChildSpec(name, 0, "role", endpoint, policy, launch)
