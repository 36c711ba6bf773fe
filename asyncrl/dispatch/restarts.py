"""The driver's line to its node agent for restart requests (``asyncrl.restart_request``): a
program asks the supervisor for a fresh process of a replica that is alive but no good, through
the group's handle (``Handle.restart_replica``)."""

from __future__ import annotations

import asyncio

from asyncrl.observe.status import ASK_TIMEOUT_S, agent_endpoint
from asyncrl.restart_request import RESTART_METHOD, RestartAnswer, RestartRequest
from asyncrl.transport import ChannelOptions, Client

__all__ = ["RESTART_TIMEOUT_S", "Restarts"]

RESTART_TIMEOUT_S = 3 * ASK_TIMEOUT_S
"""Seconds the node agent has to answer a restart request (it may ask the other nodes' agents,
all at once, each with twice ``ASK_TIMEOUT_S``)."""


class Restarts:
    """Restart requests to the node agent that writes in ``run_dir``, over one client connected
    at the first request and kept (it reconnects by itself).

    Args:
        run_dir: this node's run directory (its agent's endpoint is there).
        run: the run's name.
        timeout_s: seconds the agent has to answer one request.
    """

    def __init__(self, run_dir: str, *, run: str, timeout_s: float = RESTART_TIMEOUT_S) -> None:
        self.endpoint = agent_endpoint(run_dir)
        self.run = run
        self.timeout_s = timeout_s
        self._client: Client | None = None
        self._lock = asyncio.Lock()

    async def restart(self, request: RestartRequest) -> RestartAnswer:
        """Send ``request``; the supervisor's answer.

        Raises:
            TransportError: the agent did not answer within ``timeout_s`` (it is gone: the
                run is ending), or refused the connection.
        """
        async with self._lock:
            if self._client is None:
                client = Client(
                    self.endpoint,
                    name="driver->agent",
                    options=ChannelOptions(run=self.run, shm=False),
                )
                try:
                    await client.connect(timeout=self.timeout_s)
                except BaseException:
                    await client.close()
                    raise
                self._client = client
            client = self._client
        answer: RestartAnswer = await client.call(
            RESTART_METHOD, request, RestartAnswer, timeout=self.timeout_s
        )
        return answer

    async def close(self) -> None:
        """Close the client (idempotent)."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()
