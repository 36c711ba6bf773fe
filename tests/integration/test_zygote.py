"""Restarts through the zygote, with real processes: a killed replica comes back forked by the
node's zygote (its parent, not the agent), its exit statuses reach the supervisor through the
zygote, and a killed zygote takes its forks with it, after which they start cold and a new
zygote takes over. A restart forked by the zygote behaves as a cold one: same environment at
import, its own numpy random state, its atexit handlers run."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import pytest

from asyncrl.bench.harness import role_child
from asyncrl.manifest.load import Supervision
from asyncrl.manifest.spec import SPEC_FILE_ENV, ProcessSpec, write_spec
from asyncrl.observe import logs
from asyncrl.supervision.supervisor import ChildSpec, Supervisor
from asyncrl.transport import Client, LocalRegistry

pytestmark = pytest.mark.slow

ROLE = "tests.integration.zygote_role:Exiter"
WAIT_S = 60.0


POLICY = Supervision(max_restarts=10, period_s=3600.0, backoff_initial_s=0.0, backoff_max_s=0.0)


class Lives:
    """The supervisor's observer: a queue of ``(event, incarnation)`` per process."""

    def __init__(self) -> None:
        self.events: dict[str, asyncio.Queue[tuple[str, int]]] = {}

    def __call__(self, kind: str, label: str, incarnation: int) -> None:
        self.events.setdefault(label, asyncio.Queue()).put_nowait((kind, incarnation))

    async def until(self, wanted: tuple[str, int], label: str = "exiter[0]") -> None:
        async with asyncio.timeout(WAIT_S):
            while await self.events.setdefault(label, asyncio.Queue()).get() != wanted:
                pass


def child(
    run_dir: str, name: str, replica: int, env: dict[str, str], config: dict[str, Any]
) -> ChildSpec:
    """Replica ``replica`` of role ``name`` as the agent starts it: a spec file, and ``env``
    (a run's and role's ``env``) beside the agent's own environment."""
    endpoint = LocalRegistry(run_dir).endpoint(name, replica)

    def launch(incarnation: int) -> tuple[list[str], dict[str, str]]:
        spec = ProcessSpec(
            kind="role",
            name=name,
            replica=replica,
            incarnation=incarnation,
            target=ROLE,
            endpoint=endpoint,
            run="zygote-test",
            run_dir=run_dir,
            config=config,
            parent_pid=os.getpid(),
        )
        extra = {SPEC_FILE_ENV: write_spec(spec), "OMP_NUM_THREADS": "1", logs.CONSOLE_ENV: "0"}
        return [sys.executable, "-m", "asyncrl.supervision.process"], {**env, **extra}

    return ChildSpec(name, replica, "role", endpoint, POLICY, launch)


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def run_supervised(
    run_dir: str,
    body: Callable[[Supervisor, Lives, Client], Any],
    specs: list[ChildSpec] | None = None,
) -> Any:
    """Supervise ``specs`` (one replica of the test role by default) until ``body`` returns;
    ``body`` gets a client of the first."""
    specs = specs or [role_child(run_dir, "exiter", ROLE, {}, POLICY, run="zygote-test")]
    lives = Lives()
    supervisor = Supervisor(
        specs, run="zygote-test", log_dir=os.path.join(run_dir, "logs"), observer=lives
    )

    async def main() -> Any:
        supervised = asyncio.get_running_loop().create_task(supervisor.run())
        try:
            async with Client(specs[0].endpoint, name="test") as client:
                for spec in specs:
                    await lives.until(("serving", 0), f"{spec.name}[{spec.replica}]")
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


def test_a_fork_imports_with_the_run_env_and_a_role_with_its_own_env_restarts_cold(
    run_dir: str,
) -> None:
    specs = [
        child(run_dir, "exiter", 0, {"ZYGOTE_TEST_VAR": "from-run-env"}, {}),
        child(run_dir, "other", 0, {"ZYGOTE_TEST_VAR": "from-role-env"}, {}),
        child(run_dir, "third", 0, {"ZYGOTE_TEST_VAR": "from-run-env"}, {}),
    ]

    async def body(supervisor: Supervisor, lives: Lives, client: Client) -> None:
        assert await client.call("seen", None, timeout=10.0) == "from-run-env"  # cold
        rows = {r["role"]: r for r in supervisor.status()}
        os.killpg(rows["exiter"]["pid"], signal.SIGKILL)
        await lives.until(("serving", 1))
        os.killpg(rows["other"]["pid"], signal.SIGKILL)
        await lives.until(("serving", 1), "other[0]")
        rows = {r["role"]: r for r in supervisor.status()}
        assert (rows["exiter"]["forked"], rows["other"]["forked"]) == (True, False)
        # The fork imported its module with the run's env, as its cold start did.
        assert await client.call("seen", None, timeout=10.0) == "from-run-env"
        async with Client(specs[1].endpoint, name="test") as other:
            assert await other.call("seen", None, timeout=10.0) == "from-role-env"

    run_supervised(run_dir, body, specs)


def test_the_zygote_preloads_a_role_once_whatever_its_replicas(run_dir: str) -> None:
    preloads = os.path.join(run_dir, "preloads")
    config = {"preloads": preloads}
    specs = [child(run_dir, "exiter", replica, {}, config) for replica in range(3)]

    async def body(supervisor: Supervisor, lives: Lives, client: Client) -> None:
        with open(preloads) as f:
            assert f.read() == f"{supervisor.launcher.pid}\n"

    run_supervised(run_dir, body, specs)


def test_forks_draw_from_numpy_random_states_of_their_own(run_dir: str) -> None:
    async def body(supervisor: Supervisor, lives: Lives, client: Client) -> None:
        draws = []
        for incarnation in (1, 2):
            [row] = supervisor.status()
            os.killpg(row["pid"], signal.SIGKILL)
            await lives.until(("serving", incarnation))
            assert supervisor.status()[0]["forked"]
            draws.append(await client.call("draw", None, timeout=10.0))
        assert draws[0] != draws[1]  # not the zygote's state, drawn again by each fork

    run_supervised(run_dir, body)


def test_a_forks_end_is_watched_through_a_pidfd_opened_when_it_is_forked(run_dir: str) -> None:
    async def body(supervisor: Supervisor, lives: Lives, client: Client) -> None:
        [first] = supervisor.status()
        os.killpg(first["pid"], signal.SIGKILL)
        await lives.until(("serving", 1))
        [row] = supervisor.status()
        assert row["forked"]
        # Held from the fork on, not opened after the zygote's death, when its pid may be reused.
        proc = supervisor._children[0].proc
        with open(f"/proc/self/fdinfo/{proc._pidfd}") as f:  # type: ignore[union-attr]
            assert f"Pid:\t{row['pid']}\n" in f.read()

    run_supervised(run_dir, body)


def test_a_fork_runs_its_atexit_handlers_when_it_ends(run_dir: str) -> None:
    async def body(supervisor: Supervisor, lives: Lives, client: Client) -> None:
        [first] = supervisor.status()
        os.killpg(first["pid"], signal.SIGKILL)
        await lives.until(("serving", 1))
        [row] = supervisor.status()
        assert row["forked"]
        os.kill(row["pid"], signal.SIGTERM)
        await lives.until(("exited", 1))
        with open(os.path.join(run_dir, f"atexit.{row['pid']}")) as f:
            assert f.read() == "exited\n"

    run_supervised(run_dir, body)
