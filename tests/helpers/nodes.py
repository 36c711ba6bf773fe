"""Losing a simulated node in multi-node tests: its torchrun, its agent and every process of
its roles SIGKILLed at once, as a machine that loses power (``asyncrl.chaos.nodes.kill_node``,
what ``asyncrl chaos --nodes`` does), then waited for until none of them runs."""

from __future__ import annotations

import subprocess

from asyncrl.chaos.nodes import kill_node
from tests.helpers.waiting import wait_until

__all__ = ["lose_node"]


def lose_node(torchrun: subprocess.Popen[bytes], node_dir: str) -> None:
    """``kill_node`` of the node whose folder is ``node_dir``; return once none of the
    processes killed runs: nothing of the node serves after this."""
    pids = kill_node(torchrun, node_dir)
    wait_until(
        lambda: not any(_running(pid) for pid in pids),
        timeout=30,
        what=f"the processes {pids} of the lost node to end",
    )


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
