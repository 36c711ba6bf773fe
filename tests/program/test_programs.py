"""Helpers of the built-in programs, in-process: re-sending a once call that broke."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from asyncrl.errors import PeerUnreachableError, RemoteError
from asyncrl.roles.program.programs import resend


class Flaky:
    """A handle whose calls break ``breaks`` times (as while a replica restarts), then answer."""

    name = "learner"

    def __init__(self, breaks: int, error: Exception | None = None) -> None:
        self.breaks = breaks
        self.error = error
        self.calls: list[float] = []

    async def call(self, method: str, payload: Any, reply_type: Any, *, timeout: float) -> Any:
        self.calls.append(asyncio.get_running_loop().time())
        if self.error is not None:
            raise self.error
        if len(self.calls) <= self.breaks:
            raise PeerUnreachableError("ipc:///run/sockets/learner.0")
        return payload


def test_a_call_that_breaks_many_times_in_a_row_is_sent_again_with_pauses() -> None:
    """Calls to a replica that is down break at once, many times; resend pauses between tries
    (doubling) instead of spending a fixed number of them in a few microseconds."""

    async def main() -> tuple[Any, list[float]]:
        handle = Flaky(breaks=30)
        result = await resend(
            handle, "train_step", "batch", timeout=60, first_pause_s=0.001, max_pause_s=0.008
        )
        return result, handle.calls

    result, calls = asyncio.run(main())
    assert result == "batch" and len(calls) == 31
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert gaps[0] >= 0.001 and min(gaps[4:]) >= 0.008  # the pauses doubled up to the cap


def test_resend_gives_up_at_its_timeout_and_never_repeats_a_remote_error() -> None:
    async def breaks_forever() -> None:
        await resend(Flaky(breaks=10**9), "train_step", "batch", timeout=0.05, max_pause_s=0.01)

    with pytest.raises(PeerUnreachableError):
        asyncio.run(breaks_forever())
    refused = Flaky(0, RemoteError("internal", "boom", remote_type="ValueError", peer="p"))

    async def remote() -> None:
        await resend(refused, "train_step", "batch", timeout=60)

    with pytest.raises(RemoteError):
        asyncio.run(remote())
    assert len(refused.calls) == 1
