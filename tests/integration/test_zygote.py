"""Restarts through the zygote, with real processes: a killed replica comes back forked by the
node's zygote (its parent, not the agent), its exit statuses reach the supervisor through the
zygote, and a killed zygote takes its forks with it, after which they start cold and a new
zygote takes over."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from typing import Any

import pytest

from asyncrl.bench.harness import role_child
from asyncrl.manifest import Supervision
from asyncrl.supervisor import Supervisor
from asyncrl.transport import Client

pytestmark = pytest.mark.slow

ROLE = "tests.integration.zygote_role:Exiter"
WAIT_S = 60.0


class Lives:
    """The supervisor's observer: a queue of ``(event, incarnation)`` per process."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[tuple[str, int]] = asyncio.Queue()

    def __call__(self, kind: str, label: str, incarnation: int) -> None:
        self.events.put_nowait((kind, incarnation))

    async def until(self, wanted: tuple[str, int]) -> None:
        async with asyncio.timeout(WAIT_S):
            while await self.events.get() != wanted:
                pass


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def run_supervised(run_dir: str, body: Callable[[Supervisor, Lives, Client], Any]) -> Any:
    policy = Supervision(max_restarts=10, period_s=3600.0, backoff_initial_s=0.0, backoff_max_s=0.0)
    spec = role_child(run_dir, "exiter", ROLE, {}, policy, run="zygote-test")
    lives = Lives()
    supervisor = Supervisor(
        [spec], run="zygote-test", log_dir=os.path.join(run_dir, "logs"), observer=lives
    )

    async def main() -> Any:
        supervised = asyncio.get_running_loop().create_task(supervisor.run())
        try:
            async with Client(spec.endpoint, name="test") as client:
                await lives.until(("serving", 0))
                async with asyncio.timeout(WAIT_S):
                    await supervisor.launcher.ready.wait()
                return await body(supervisor, lives, client)
        finally:
            supervisor.stop("test done")
            report = await supervised
            assert report.status == "interrupted"

    return asyncio.run(main())


def test_a_killed_replica_restarts_forked_by_the_zygote_and_its_exits_reach_the_supervisor(
    run_dir: str,
) -> None:
    async def body(supervisor: Supervisor, lives: Lives, client: Client) -> None:
        [first] = supervisor.status()
        assert (first["incarnation"], first["forked"]) == (0, False)  # the first start is cold
        os.killpg(first["pid"], signal.SIGKILL)
        await lives.until(("serving", 1))
        [row] = supervisor.status()
        zygote = supervisor.launcher.pid
        assert (row["incarnation"], row["forked"], row["alive"]) == (1, True, True)
        assert zygote is not None and parent_of(row["pid"]) == zygote
        assert os.getpgid(row["pid"]) == row["pid"]  # its own group: killpg reaches it
        assert await client.call("pid", None, timeout=10.0) == row["pid"]
        # An exit code, then a signal: each reaches the supervisor through the zygote.
        await client.call("exit", 7, timeout=10.0)
        await lives.until(("serving", 2))
        [row2] = supervisor.status()
        assert row2["forked"] and parent_of(row2["pid"]) == zygote
        os.kill(row2["pid"], signal.SIGTERM)
        await lives.until(("serving", 3))
        exits = [(e.incarnation, e.pid, e.code, e.signal, e.reason) for e in supervisor._exits]
        assert exits == [
            (0, first["pid"], None, "SIGKILL", "killed by SIGKILL"),
            (1, row["pid"], 7, None, "exited with code 7"),
            (2, row2["pid"], 0, None, "exited with code 0"),
        ]

    run_supervised(run_dir, body)


def test_a_killed_zygote_takes_its_forks_with_it_and_a_new_one_takes_over(run_dir: str) -> None:
    async def body(supervisor: Supervisor, lives: Lives, client: Client) -> None:
        [first] = supervisor.status()
        os.killpg(first["pid"], signal.SIGKILL)
        await lives.until(("serving", 1))
        [forked] = supervisor.status()
        old = supervisor.launcher.pid
        assert forked["forked"] and old is not None
        os.kill(old, signal.SIGKILL)
        # Its fork dies with it (parent-death signal) and comes back cold.
        await lives.until(("serving", 2))
        [cold] = supervisor.status()
        assert (cold["forked"], parent_of(cold["pid"])) == (False, os.getpid())
        async with asyncio.timeout(WAIT_S):
            await supervisor.launcher.ready.wait()
        new = supervisor.launcher.pid
        assert new is not None and new != old
        os.killpg(cold["pid"], signal.SIGKILL)
        await lives.until(("serving", 3))
        [again] = supervisor.status()
        assert again["forked"] and parent_of(again["pid"]) == new
        assert await client.call("pid", None, timeout=10.0) == again["pid"]
        reasons = [(e.incarnation, e.signal) for e in supervisor._exits]
        assert reasons == [(0, "SIGKILL"), (1, "SIGKILL"), (2, "SIGKILL")]

    run_supervised(run_dir, body)
