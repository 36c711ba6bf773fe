"""Standby processes: the next incarnation of a replica, started ahead (``supervision.standby``).

A standby is ``python -m asyncrl.supervision.process --standby``: it imports the role's modules,
then waits on its stdin. The supervisor writes ``go`` to it when the replica fails, and it takes
over as that incarnation; closing its stdin without ``go`` makes it exit. The supervisor keeps
which standby belongs to which replica; this module starts, wakes and kills one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

__all__ = ["activate", "kill", "start"]


async def start(argv: list[str], env: dict[str, str], log_path: str) -> asyncio.subprocess.Process:
    """Start ``argv`` as a standby, in a session of its own, its stderr appended to
    ``log_path``.

    Raises:
        OSError: the process cannot be started.
    """
    with open(log_path, "ab") as stderr:
        return await asyncio.create_subprocess_exec(
            *argv,
            "--standby",
            env={**os.environ, **env},
            stdin=asyncio.subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
        )


async def activate(spare: asyncio.subprocess.Process) -> bool:
    """Tell a standby to take over; False if it is gone (then a fresh process starts)."""
    if spare.returncode is not None or spare.stdin is None:
        return False
    try:
        spare.stdin.write(b"go\n")
        await spare.stdin.drain()
        spare.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


def kill(spare: asyncio.subprocess.Process) -> asyncio.subprocess.Process | None:
    """SIGKILL a standby's process group; return it, to be waited for, or None when it had
    already exited."""
    if spare.returncode is not None:
        return None
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(spare.pid, signal.SIGKILL)
    return spare
