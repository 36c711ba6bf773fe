"""Losing a simulated node in multi-node tests: its torchrun, its agent and every process of
its roles SIGKILLed at once, as a machine that loses power (``asyncrl.chaos.nodes.kill_node``,
what ``asyncrl chaos --nodes`` does), then waited for until none of them runs; or all of them
stopped (SIGSTOP), as a machine cut off from the network: its connections stay open and nothing
answers on them."""

from __future__ import annotations

import os
import signal
import subprocess

from asyncrl.chaos.nodes import JANITOR_MODULE, kill_node, node_tree
from tests.helpers.waiting import wait_until

__all__ = ["lose_node", "silence_node"]


def lose_node(torchrun: subprocess.Popen[bytes], node_dir: str) -> None:
    """``kill_node`` of the node whose folder is ``node_dir``; return once none of the
    processes killed runs: nothing of the node serves after this."""
    pids = kill_node(torchrun, node_dir)
    wait_until(
        lambda: not any(_running(pid) for pid in pids),
        timeout=30,
        what=f"the processes {pids} of the lost node to end",
    )


def silence_node(torchrun: subprocess.Popen[bytes]) -> list[int]:
    """SIGSTOP ``torchrun`` and every process descended from it but the node's janitor (as
    ``kill_node`` spares it); return the pids stopped. Their sockets stay open: a peer sees
    silence, not a closed connection. ``lose_node`` ends them."""
    pids = sorted(p for p in node_tree(torchrun.pid) if not _is_janitor(p))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            continue
    return pids


def _is_janitor(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return JANITOR_MODULE in f.read().split(b"\0")
    except OSError:
        return False


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
