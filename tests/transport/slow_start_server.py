"""A server whose start-up blocks its loop: ``python -m tests.transport.slow_start_server
ENDPOINT INCARNATION BLOCK_S``.

It binds, prints ``READY <endpoint> <pid>``, then blocks its event loop for ``BLOCK_S`` seconds
(as a role does while it imports or loads a checkpoint) before it answers anything. It serves
``add`` (``[a, b]`` -> ``a + b``) until SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from typing import Any

from asyncrl.transport import ChannelOptions, Server, run


def add(payload: list[int], call: Any) -> int:
    return payload[0] + payload[1]


async def main(endpoint: str, incarnation: int, block_s: float) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    server = Server(
        endpoint, name="slow", incarnation=incarnation, options=ChannelOptions(shm=False)
    )
    server.add("add", add, list[int])
    async with server:
        print(f"READY {server.endpoint} {os.getpid()}", flush=True)
        time.sleep(block_s)  # noqa: ASYNC251  # the loop is blocked on purpose
        await stop.wait()


if __name__ == "__main__":
    run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
