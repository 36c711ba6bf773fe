"""An environment role driven by agent code (asyncrl.roles.agents.environment_client): an
adding tool, its replicas in this process behind a fake group handle that honours ``replica=``
and deadlines as the dispatcher does, names the replica a failed call went to, and restarts a
replica in-process when asked. A step or reset the environment fails raises
``EnvironmentFailed`` with its cause; a replica failing its steps or resets is quarantined and
restarted; a failed episode's next id is fresh and starts elsewhere."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import msgspec
import pytest

from asyncrl.errors import DeadlineExceededError, RemoteError
from asyncrl.restart_request import RestartAnswer
from asyncrl.role import RoleContext
from asyncrl.roles.agents.environment import Environment, Transition
from asyncrl.roles.agents.environment_client import EnvironmentClient, EnvironmentFailed
from asyncrl.roles.agents.quarantine import ReplicasQuarantinedError
from asyncrl.transport import run


class Adder(Environment):
    """``add X Y`` answers ``= N``; ``answer V`` scores 1 for the sum and ends the episode.
    Replica ``fail_replica`` fails every step: one in two hangs, the other raises."""

    class Config(msgspec.Struct):
        fail_replica: int = -1
        fail_resets: bool = False  # the failing replica fails its resets (not its steps)

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.failures = 0

    async def start(self, task: Any) -> tuple[str, int]:
        if self.config.fail_resets and self.ctx.replica == self.config.fail_replica:
            raise RuntimeError(f"env.{self.ctx.replica}: the sandbox does not start")
        x, y = map(int, str(task).split())
        return f"{x} + {y}", x + y

    async def act(self, state: int, action: str) -> Transition:
        if self.ctx.replica == self.config.fail_replica:
            self.failures += 1
            if self.failures % 2:
                await asyncio.Event().wait()
            raise RuntimeError(f"env.{self.ctx.replica}: the calculator's sandbox is gone")
        verb, *args = action.split()
        if verb == "add":
            return Transition(observation=f"= {sum(map(int, args))}")
        return Transition(observation="", reward=float(args == [str(state)]), done=True)


class Group:
    """Replicas of an environment class (``Adder``) in this process; env.``failing`` fails
    every step."""

    name = "env"

    def __init__(
        self, replicas: int, failing: int = -1, env_class: Any = Adder, fail_resets: bool = False
    ) -> None:
        self.replicas = replicas
        self.incarnations = [0] * replicas
        config: dict[str, Any] = {"fail_replica": failing}
        if fail_resets:  # Adder's alone: another class may not take it
            config["fail_resets"] = True
        self.make = lambda i: env_class(
            RoleContext.local(
                name="env", replica=i, incarnation=self.incarnations[i], config=config
            )
        )
        self.roles = [self.make(i) for i in range(replicas)]
        self.resets: list[int] = []  # the replica each reset went to
        self.reset_ids: list[str] = []  # and its episode
        self.restarted: list[tuple[int, str, int | None]] = []  # restart_replica's requests

    def restart(self, replica: int) -> None:
        """A fresh process of ``replica``, without its episodes."""
        self.incarnations[replica] += 1
        self.roles[replica] = self.make(replica)

    async def restart_replica(
        self, replica: int, reason: str, *, incarnation: int | None = None
    ) -> RestartAnswer:
        """As the supervisor answers ``Handle.restart_replica``: a fresh process, unless the
        incarnation asked about is gone already."""
        self.restarted.append((replica, reason, incarnation))
        if incarnation is not None and incarnation != self.incarnations[replica]:
            return RestartAnswer(restarted=False, why="gone already")
        self.restart(replica)
        return RestartAnswer(restarted=True, incarnation=self.incarnations[replica] - 1)

    def choose(self, avoid: int | None) -> int:
        """The replica a call to any goes to: the next in turn, or the one after it when the
        call avoids that one, as the dispatcher prefers any other to the replica avoided."""
        turn = len(self.resets) % self.replicas
        return (turn + 1) % self.replicas if turn == avoid else turn

    async def call(self, method: str, payload: Any, reply_type: Any = Any, **kw: Any) -> Any:
        replica = kw.get("replica")
        replica = self.choose(kw.get("avoid")) if replica is None else replica
        if method == "reset":
            self.resets.append(replica)
            self.reset_ids.append(payload.episode_id)
        try:
            async with asyncio.timeout(kw.get("timeout")):
                return await getattr(self.roles[replica], method)(payload)
        except TimeoutError as exc:
            # A live process (its pid known) took the call and did not answer it.
            pid = 1000 + replica
            late = DeadlineExceededError(f"env.{replica}", method, kw["timeout"], pid=pid)
            late.replica = replica  # as the dispatcher names the replica that failed a call
            raise late from exc
        except Exception as exc:
            error = RemoteError("handler_error", str(exc), remote_type=type(exc).__name__)
            error.replica = replica
            raise error from exc


class FailsAtOnce(Group):
    """A call to any replica goes to the freest, as the dispatcher sends it: the failing
    replica, which answers at once, unless the call avoids it (then the next)."""

    def choose(self, avoid: int | None) -> int:
        return 0 if avoid != 0 else 1


def test_an_episode_is_reset_and_stepped_on_the_replica_that_holds_it() -> None:
    async def main() -> None:
        group = Group(2)
        env = EnvironmentClient(group, step_timeout_s=5.0)
        episode = await env.reset("e", "17 25")
        assert (episode.observation, episode.replica) == ("17 + 25", 0)
        said = await env.step(episode, "add 17 25")
        assert (said.observation, said.reward, said.done) == ("= 42", 0.0, False)
        said = await env.step(episode, "answer 42")
        assert (said.reward, said.done, episode.done, episode.turn) == (1.0, True, True, 2)
        other = await env.reset("f", "1 2")
        assert other.replica == 1  # round robin over the healthy replicas

    run(main())


def test_a_step_the_environment_fails_raises_its_cause_and_counts_against_the_replica() -> None:
    async def main() -> None:
        group = Group(2, failing=1)
        env = EnvironmentClient(group, step_timeout_s=0.2, quarantine_window=2)
        await env.reset("a", "1 2")
        hung = await env.reset("b", "1 2")  # on env.1: its first step hangs past the deadline
        with pytest.raises(EnvironmentFailed) as info:
            await env.step(hung, "add 1 2")
        assert info.value.cause == "timeout" and hung.timeouts == 1
        assert str(info.value) == "episode 'b': turn 0 ran past its deadline of 0.2 s"
        await env.reset("c", "1 2")
        raised = await env.reset("d", "1 2")  # round robin: c on env.0, d on env.1
        assert raised.replica == 1
        with pytest.raises(EnvironmentFailed) as info:
            await env.step(raised, "add 1 2")  # its second raises
        assert info.value.cause == "error" and raised.errors == 1
        assert "env.1: the calculator's sandbox is gone" in str(info.value)
        # env.1 failed 2 of its last 2 steps: quarantined; new episodes go to env.0 alone.
        assert env.quarantine.is_quarantined(1)
        metrics: Counter[str] = Counter()
        env.count(metrics)
        assert metrics == Counter({"quarantined": 1})
        replicas = [(await env.reset(f"n{i}", "1 2")).replica for i in range(4)]
        assert replicas == [0, 0, 0, 0]

    run(main())


def test_an_episode_lost_with_a_restarted_replica_is_lost_not_held_against_it() -> None:
    async def main() -> None:
        group = Group(1)
        env = EnvironmentClient(group, step_timeout_s=5.0, quarantine_window=1)
        episode = await env.reset("e", "3 4")
        group.restart(0)  # its episodes are gone with it
        with pytest.raises(EnvironmentFailed) as info:
            await env.step(episode, "add 3 4")
        assert info.value.cause == "lost"
        assert not env.quarantine.is_quarantined(0)

    run(main())


class Down(FailsAtOnce):
    """env.0 is down past every step's deadline: the dispatcher holds each step for its restart
    until the deadline passes, so no process took it (the error names no pid)."""

    down = False

    async def call(self, method: str, payload: Any, reply_type: Any = Any, **kw: Any) -> Any:
        if method == "step" and self.down:
            raise DeadlineExceededError("env[0] (no replica took it)", method, kw["timeout"])
        return await super().call(method, payload, reply_type, **kw)


def test_a_step_no_process_took_while_its_replica_was_down_is_lost_not_held_against_it() -> None:
    async def main() -> None:
        group = Down(2)
        env = EnvironmentClient(group, step_timeout_s=0.2, quarantine_window=1)
        episode = await env.reset("e", "3 4")
        group.down = True
        with pytest.raises(EnvironmentFailed) as info:
            await env.step(episode, "add 3 4")
        assert info.value.cause == "lost" and not env.quarantine.is_quarantined(0)
        assert (await env.reset("e", "3 4")).replica == 1  # started again elsewhere

    run(main())


class Silent(Group):
    """Every step reaches a live env.0, which never answers it."""

    async def call(self, method: str, payload: Any, reply_type: Any = Any, **kw: Any) -> Any:
        if method == "step":
            raise DeadlineExceededError("env[0]", method, kw["timeout"], pid=4242)
        return await super().call(method, payload, reply_type, **kw)


def test_a_step_a_live_replica_took_and_never_answered_counts_against_it() -> None:
    async def main() -> None:
        env = EnvironmentClient(Silent(2), step_timeout_s=0.2, quarantine_window=1)
        episode = await env.reset("e", "3 4")
        with pytest.raises(EnvironmentFailed) as info:
            await env.step(episode, "add 3 4")
        assert info.value.cause == "lost" and env.quarantine.is_quarantined(0)

    run(main())


def test_every_replica_quarantined_stops_new_episodes_by_name() -> None:
    async def main() -> None:
        group = Group(1, failing=0)
        env = EnvironmentClient(group, step_timeout_s=0.1, quarantine_window=1)
        episode = await env.reset("e", "3 4")
        with pytest.raises(EnvironmentFailed):
            await env.step(episode, "add 3 4")
        with pytest.raises(ReplicasQuarantinedError, match=r"^every replica of 'env' is quar"):
            await env.reset("f", "3 4")

    run(main())


def test_an_episode_played_again_goes_to_another_replica_than_the_one_that_failed_it() -> None:
    async def main() -> None:
        group = FailsAtOnce(3, failing=0)
        env = EnvironmentClient(group, step_timeout_s=0.2)
        for episode_id in ("eval-0", "eval-0~1", "p/0", "p/0", "q/0"):
            episode = await env.reset(episode_id, "1 2")
            try:
                await env.step(episode, "add 1 2")
            except EnvironmentFailed as exc:
                assert exc.cause in ("timeout", "error")
                env.close(episode)
        # eval-0 failed on env.0: its fresh id goes elsewhere; so does p/0 started again under
        # the same id; q/0, failed by none, goes to the freest.
        assert group.resets == [0, 1, 0, 1, 0]
        assert group.reset_ids == ["eval-0", "eval-0~1", "p/0", "p/0", "q/0"]
        assert not env.quarantine.is_quarantined(0)  # 3 of its 20 steps: not judged yet

    run(main())


def test_a_failed_episode_is_played_again_under_a_fresh_id() -> None:
    env = EnvironmentClient(Group(1))
    assert env.episode_id("p/0") == "p/0"
    env.failed("p/0")
    assert env.episode_id("p/0") == "p/0~1"
    env.failed("p/0")
    assert (env.episode_id("p/0"), env.episode_id("p/1")) == ("p/0~2", "p/1")


def test_a_step_timeout_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^step_timeout_s: expected a number > 0, got 0$"):
        EnvironmentClient(Group(1), step_timeout_s=0)


def test_a_failed_reset_counts_against_its_replica_and_the_next_start_goes_elsewhere() -> None:
    async def main() -> None:
        group = FailsAtOnce(3, failing=0, fail_resets=True)
        env = EnvironmentClient(group, step_timeout_s=1.0, quarantine_window=2)
        with pytest.raises(EnvironmentFailed) as info:
            await env.reset("p/0", "1 2")  # the freest is env.0, whose resets raise
        assert info.value.cause == "error"
        assert "env.0: the sandbox does not start" in str(info.value)
        env.failed("p/0")
        again = await env.reset(env.episode_id("p/0"), "1 2")
        assert (again.episode_id, again.replica) == ("p/0~1", 1)  # not env.0 again
        assert not env.quarantine.is_quarantined(0)  # 1 failure of a window of 2
        with pytest.raises(EnvironmentFailed):
            await env.reset("q/0", "1 2")
        # A second failed reset: env.0 failed 2 of its last 2, as if they were steps.
        assert env.quarantine.is_quarantined(0)
        assert group.resets == [0, 1, 0]

    run(main())


def test_a_reset_a_live_replica_never_answered_counts_and_one_lost_with_it_does_not() -> None:
    class SilentResets(FailsAtOnce):
        pid: int | None = 4242

        async def call(self, method: str, payload: Any, reply_type: Any = Any, **kw: Any) -> Any:
            if method == "reset" and kw.get("avoid") != 0:
                error = DeadlineExceededError("env[0]", method, kw["timeout"], pid=self.pid)
                error.replica = 0
                raise error
            return await super().call(method, payload, reply_type, **kw)

    async def main() -> None:
        group = SilentResets(2)
        env = EnvironmentClient(group, step_timeout_s=0.2, quarantine_window=1)
        group.pid = None  # no process took it: env.0 was down
        with pytest.raises(EnvironmentFailed) as info:
            await env.reset("e", "3 4")
        assert info.value.cause == "lost" and not env.quarantine.is_quarantined(0)
        assert (await env.reset("e", "3 4")).replica == 1  # started again elsewhere
        group.pid = 4242  # a live env.0 took it and was silent
        with pytest.raises(EnvironmentFailed) as info:
            await env.reset("f", "3 4")
        assert info.value.cause == "lost" and env.quarantine.is_quarantined(0)

    run(main())


def test_a_quarantined_replica_is_restarted_with_the_reason_and_the_incarnation_judged() -> None:
    async def main() -> None:
        group = Group(2, failing=1)
        env = EnvironmentClient(group, step_timeout_s=0.1, quarantine_window=1, probe_after_s=0.0)
        await env.reset("a", "1 2")
        failing = await env.reset("b", "1 2")  # on env.1, incarnation 0
        with pytest.raises(EnvironmentFailed):
            await env.step(failing, "add 1 2")  # hangs past its deadline: quarantined
        await asyncio.gather(*env.restarts.tasks)
        assert group.restarted == [
            (1, "quarantined: it failed 1 of its last 1 steps (1 quarantine in a row)", 0)
        ]
        assert group.incarnations == [0, 1]
        # Its probe goes to the fresh process, which fails it (its steps raise): restarted
        # again, for the incarnation that failed the probe.
        probe = await env.reset("c", "1 2")
        assert probe.replica == 1
        with pytest.raises(EnvironmentFailed):
            await env.step(probe, "add 1 2")
        await asyncio.gather(*env.restarts.tasks)
        assert group.restarted[1] == (
            1,
            "quarantined: it failed its probe (2 quarantines in a row)",
            1,
        )
        assert group.incarnations == [0, 2]
        metrics: Counter[str] = Counter()
        env.count(metrics)
        assert metrics == Counter({"quarantined": 2, "quarantine_restarts": 2})

    run(main())


def test_a_restart_the_supervisor_refuses_is_not_counted() -> None:
    async def main() -> None:
        group = Group(2, failing=1)
        env = EnvironmentClient(group, step_timeout_s=0.1, quarantine_window=1)
        await env.reset("a", "1 2")
        failing = await env.reset("b", "1 2")  # on env.1, incarnation 0
        group.incarnations[1] = 1  # by the time it is judged, another incarnation runs
        with pytest.raises(EnvironmentFailed):
            await env.step(failing, "add 1 2")
        await asyncio.gather(*env.restarts.tasks)
        assert [(r, i) for r, _, i in group.restarted] == [(1, 0)]
        metrics: Counter[str] = Counter()
        env.count(metrics)
        assert metrics == Counter({"quarantined": 1, "quarantine_restarts": 0})

    run(main())


def test_a_replica_whose_resets_fail_after_a_restart_is_restarted_again() -> None:
    """Each restart request names the incarnation whose reset failed (a reset that was not
    answered names it; one that raised names none: whichever runs), not the last one a reset
    succeeded on, so a supervisor that refuses stale incarnations restarts it every time."""

    class FailingResets(Group):
        resets_fail = False

        async def call(self, method: str, payload: Any, reply_type: Any = Any, **kw: Any) -> Any:
            replica = kw.get("replica")
            replica = self.choose(kw.get("avoid")) if replica is None else replica
            if method == "reset" and self.resets_fail and replica == 1:
                self.resets.append(1)
                if len(self.resets) % 2 == 0:  # the live incarnation took it, was silent
                    incarnation = self.incarnations[1]
                    error: Exception = DeadlineExceededError(
                        "env.1", method, kw["timeout"], pid=4242, incarnation=incarnation
                    )
                else:  # it raised
                    error = RemoteError("handler_error", "no sandbox", remote_type="RuntimeError")
                error.replica = 1  # type: ignore[attr-defined]
                raise error
            return await super().call(method, payload, reply_type, **kw)

    async def main() -> None:
        group = FailingResets(2)
        env = EnvironmentClient(group, step_timeout_s=1.0, quarantine_window=1, probe_after_s=0.0)
        await env.reset("a", "1 2")
        await env.reset("b", "1 2")  # on env.1, incarnation 0: its last successful reset
        group.resets_fail = True
        await env.reset("c", "1 2")  # on env.0
        for name in ("d", "e", "f"):  # env.1's turn, then its probes: each fails
            with pytest.raises(EnvironmentFailed):
                await env.reset(name, "1 2")
            await asyncio.gather(*env.restarts.tasks)
        assert group.resets == [0, 1, 0, 1, 1, 1]
        assert [(r, i) for r, _, i in group.restarted] == [(1, 0), (1, None), (1, 2)]
        assert group.incarnations == [0, 3]  # every request accepted
        metrics: Counter[str] = Counter()
        env.count(metrics)
        assert metrics == Counter({"quarantined": 3, "quarantine_restarts": 3})

    run(main())


def test_closing_the_client_cancels_the_restart_requests_still_waiting() -> None:
    """A restart request the supervisor has not answered yet is cancelled by ``aclose`` and
    waited for, so none is left pending when the run ends."""

    class Unanswered(Group):
        asked = asyncio.Event()

        async def restart_replica(
            self, replica: int, reason: str, *, incarnation: int | None = None
        ) -> RestartAnswer:
            self.restarted.append((replica, reason, incarnation))
            self.asked.set()
            await asyncio.Event().wait()  # the agent never answers
            raise AssertionError("unreachable")

    async def main() -> None:
        group = Unanswered(2, failing=1)
        env = EnvironmentClient(group, step_timeout_s=0.1, quarantine_window=1)
        await env.reset("a", "1 2")
        failing = await env.reset("b", "1 2")
        with pytest.raises(EnvironmentFailed):
            await env.step(failing, "add 1 2")
        await asyncio.wait_for(group.asked.wait(), 5.0)
        (pending,) = env.restarts.tasks
        await env.aclose()
        assert pending.cancelled() and not env.restarts.tasks
        await env.aclose()  # idempotent
        metrics: Counter[str] = Counter()
        env.count(metrics)
        assert metrics == Counter({"quarantined": 1, "quarantine_restarts": 0})

    run(main())
