"""Losing a simulated node in multi-node tests: its torchrun, its agent and every process of
its roles SIGKILLed at once, as a machine that loses power."""

from __future__ import annotations

import json
import os
import signal
import subprocess

from tests.helpers.waiting import wait_until

__all__ = ["lose_node"]


def lose_node(torchrun: subprocess.Popen[bytes], node_dir: str) -> None:
    """SIGKILL the process groups of ``torchrun``, of the agent its ``launch.json`` names and of
    every role process its ``registry`` lists (the agent and the roles have sessions of their
    own), and return once none of them runs: nothing of the node serves after this."""
    pids = [torchrun.pid]
    for path in [os.path.join(node_dir, "launch.json")] + [
        os.path.join(node_dir, "registry", name) for name in _listdir(node_dir, "registry")
    ]:
        entry = _json(path)
        if isinstance(entry, dict) and "pid" in entry:
            pids.append(int(entry["pid"]))
    # A pid read from a file may have been reused by then: only a process of the launch (an
    # asyncrl or torchrun command line) has its group killed, and never this test's own group.
    groups = {_group(pid) for pid in pids if _of_the_launch(pid)} - {None, os.getpgrp()}
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    torchrun.wait()
    wait_until(
        lambda: not any(_running(pid) for pid in pids),
        timeout=30,
        what=f"the processes {pids} of the lost node to end",
    )


def _listdir(*parts: str) -> list[str]:
    try:
        return os.listdir(os.path.join(*parts))
    except OSError:
        return []


def _json(path: str) -> object:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _of_the_launch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read()
    except OSError:
        return False
    return b"asyncrl" in argv or b"torchrun" in argv


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
