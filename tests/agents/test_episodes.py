"""Multi-turn episodes against an environment role (asyncrl.roles.agents), in one process: a
guessing game as the environment, a scripted policy as the rollout, and handles that deliver
calls as the dispatcher does (an error raised by the role arrives as a RemoteError naming its
type; a restarted replica has lost its episodes)."""

from __future__ import annotations

import asyncio
import functools
import re
from collections import Counter
from typing import Any

import pytest

from asyncrl.errors import AsyncrlError, DeadlineExceededError, RemoteError
from asyncrl.role import RoleContext
from asyncrl.roles.agents.environment import (
    Close,
    Environment,
    EpisodeLost,
    Reset,
    Step,
    Transition,
)
from asyncrl.roles.agents.episodes import (
    EpisodeFailedError,
    EpisodeRunner,
    Segment,
    Trajectory,
    episode_rewards,
)
from asyncrl.roles.payloads import GenerateBatch, Prompt, Sample, SamplingParams
from asyncrl.transport import run

DIGITS = "0123456789"


def encode(text: str) -> list[int]:
    """One token per character: digits 0-9 are 0-9, anything else 10 + its code point."""
    return [DIGITS.index(c) if c in DIGITS else 10 + ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(DIGITS[i] if i < 10 else chr(i - 10) for i in ids)


class Guess(Environment):
    """Guess the secret number (the task): each wrong guess is answered 'higher' or 'lower'."""

    deterministic = True

    async def start(self, task: Any) -> tuple[str, Any]:
        return "guess:", {"secret": int(task), "guesses": 0}

    async def act(self, state: Any, action: str) -> Transition:
        state["guesses"] += 1
        try:
            guess = int(action.strip() or "-1")
        except ValueError:
            return Transition(observation="a number please", reward=-0.1)
        if guess == state["secret"]:
            return Transition(observation="right", reward=1.0, done=True)
        return Transition(observation="higher" if guess < state["secret"] else "lower")


class Handle:
    """Calls a role in this process the way the dispatcher delivers them."""

    def __init__(self, make: Any) -> None:
        self.make = make
        self.role = make(0)
        self.incarnation = 0
        self.calls: list[tuple[str, Any]] = []

    def restart(self) -> None:
        self.incarnation += 1
        self.role = self.make(self.incarnation)

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        self.calls.append((method, payload))
        try:
            return await getattr(self.role, method)(payload)
        except Exception as exc:
            raise RemoteError("handler_error", str(exc), remote_type=type(exc).__name__) from exc


def env_handle() -> Handle:
    return Handle(lambda n: Guess(RoleContext.local(name="env", incarnation=n)))


class Bisect:
    """A scripted policy: bisects 0..15 from the observations it has seen in its context."""

    def __init__(self) -> None:
        self.version = 3
        self.calls = 0

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        assert method == "generate" and isinstance(payload, GenerateBatch)
        self.calls += 1
        (request,) = payload.requests
        text = decode(request.prompt.token_ids)
        lo, hi = 0, 15
        for guess, said in _exchanges(text):
            if said == "higher":
                lo = guess + 1
            elif said == "lower":
                hi = guess - 1
        tokens = encode(str((lo + hi) // 2) + ";")
        return [
            Sample(
                prompt_id=request.prompt.id,
                sample_index=0,
                prompt_ids=request.prompt.token_ids,
                token_ids=tokens,
                logprobs=[-0.25] * len(tokens),
                versions=[self.version] * len(tokens),
                finished=True,
                stop_reason="stop",
            )
        ]


def _exchanges(text: str) -> list[tuple[int, str]]:
    """(guess, answer) pairs from a context ``guess:7;higher11;lower9;...``."""
    return [(int(g), said) for g, said in re.findall(r"(\d+);([a-z]*)", text)]


def runner(env: Handle, **kw: Any) -> EpisodeRunner:
    return EpisodeRunner(
        Bisect(),
        env,
        encode=encode,
        decode=lambda ids: decode(ids).rstrip(";"),
        params=SamplingParams(max_new_tokens=4),
        **kw,
    )


def test_an_episode_keeps_both_sides_tokens_and_masks_the_environments() -> None:
    async def main() -> Trajectory:
        return await runner(env_handle()).run("e1", 11, [])

    traj = run(main())
    guesses = [decode(s.token_ids) for s in traj.segments if s.policy]
    answers = [decode(s.token_ids) for s in traj.segments if not s.policy]
    assert guesses == ["7;", "11;"]  # bisection: 7 (higher), 11 (right)
    assert answers == ["higher"]
    assert traj.done and traj.reward == 1.0 and traj.turn_rewards == [0.0, 1.0]
    assert traj.turns == 2 and traj.prompt_ids == encode("guess:")
    assert traj.loss_mask == [1, 1] + [0] * len("higher") + [1, 1, 1]
    assert len(traj.loss_mask) == len(traj.token_ids)
    assert traj.turn_starts == [0, 2, 2 + len("higher")]
    policy = [s for s in traj.segments if s.policy]
    assert all(s.versions == [3] * len(s.token_ids) for s in policy)
    assert all(s.logprobs == [-0.25] * len(s.token_ids) for s in policy)


class Slow(Guess):
    """Its first action of every episode never finishes on its own; the timeout is part of
    its task."""

    timeout_is_task = True

    async def act(self, state: Any, action: str) -> Transition:
        if state["guesses"] == 0:
            state["guesses"] += 1
            await asyncio.Event().wait()
        return await super().act(state, action)


def test_a_task_timeout_becomes_an_observation_or_ends_the_episode() -> None:
    async def main(on_timeout: str) -> tuple[Trajectory, Handle]:
        env = Handle(lambda n: Slow(RoleContext.local(name="env")))
        r = runner(env, on_timeout=on_timeout, timeout_text="slow", step_timeout_s=0.05)
        return await r.run("e", 11, []), env

    observed, env = run(main("observe"))
    assert observed.timeouts == 1 and observed.done and observed.restarts == 0
    assert decode(observed.segments[1].token_ids) == "slow"
    assert env.role.episodes["e"].transitions[0].timed_out  # the environment's record says so
    ended, _ = run(main("end"))
    assert (ended.timeouts, ended.done, ended.turns, ended.reward) == (1, False, 1, 0.0)


class Hangs(Slow):
    """Its first action hangs past the deadline, and the environment does not say its timeouts
    are part of the task: a failure of the environment."""

    timeout_is_task = False


class Raises(Guess):
    """Its second action raises."""

    async def act(self, state: Any, action: str) -> Transition:
        if state["guesses"] == 1:
            raise RuntimeError("the tool's sandbox is gone")
        return await super().act(state, action)


def test_a_step_that_times_out_or_raises_marks_the_episode_infra_failed() -> None:
    async def main(make: Any, index: int) -> tuple[Sample, Counter[str], EpisodeRunner]:
        env = Handle(lambda n: make(RoleContext.local(name="env")))
        r = runner(env, step_timeout_s=0.05, timeout_text="slow")
        metrics: Counter[str] = Counter()
        prompt = Prompt(id="p", token_ids=[1], answer="11")
        sample = await r.source(prompt, index, metrics)
        return sample, metrics, r

    timed_out, metrics, _ = run(main(Hangs, 0))
    assert timed_out.infra_failed == "timeout"
    assert metrics["env_timeouts"] == 1 and metrics["episode_turns"] == 1
    assert decode(timed_out.token_ids) == "7;"  # nothing of "slow": the policy was never told
    raised, metrics, r = run(main(Raises, 2))
    assert raised.infra_failed == "error" and metrics["env_errors"] == 1
    assert (raised.prompt_id, raised.sample_index) == ("p", 2)
    assert r.environment.episode_id("p/2") == "p/2~1"  # the next episode of it: a fresh id


def test_a_reset_that_raises_is_an_infra_failed_sample_of_the_pipelines_source() -> None:
    class NoStart(Guess):
        async def start(self, task: Any) -> tuple[str, Any]:
            raise RuntimeError("no sandbox left")

    async def main() -> tuple[Sample, Counter[str]]:
        env = Handle(lambda n: NoStart(RoleContext.local(name="env")))
        metrics: Counter[str] = Counter()
        prompt = Prompt(id="p", token_ids=[1], answer="11")
        return await runner(env).source(prompt, 0, metrics), metrics

    sample, metrics = run(main())
    assert (sample.infra_failed, sample.token_ids, sample.prompt_ids) == ("error", [], [1])
    assert metrics["env_errors"] == 1 and metrics["episodes"] == 1


def test_a_fresh_episode_in_place_of_an_infra_failed_one_has_an_id_of_its_own() -> None:
    async def main() -> tuple[list[str], Sample]:
        env = Handle(lambda n: Raises(RoleContext.local(name="env")))
        r = runner(env)
        prompt = Prompt(id="p", token_ids=[1], answer="7")  # right at the first guess
        r.environment.failed("p/0")  # as after a failed episode of this sample
        sample = await r.source(prompt, 0, Counter())
        return [p.episode_id for m, p in env.calls if m == "reset"], sample

    resets, sample = run(main())
    assert resets == ["p/0~1"]
    assert sample.infra_failed == "" and sample.turn_rewards == [1.0]


def test_an_episode_lost_past_max_restarts_is_infra_failed_in_the_pipelines_source() -> None:
    class AlwaysLoses(Handle):
        async def call(
            self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any
        ) -> Any:
            if method == "step":
                self.restart()
            return await super().call(method, payload, reply_type, **kw)

    async def main() -> Sample:
        env = AlwaysLoses(lambda n: Guess(RoleContext.local(name="env", incarnation=n)))
        prompt = Prompt(id="p", token_ids=[1], answer="13")
        return await runner(env, max_restarts=1).source(prompt, 0, Counter())

    sample = run(main())
    assert sample.infra_failed == "lost" and sample.token_ids == []


class Replicas:
    """Replicas of an environment group: a call names one (``replica``) or goes to the next in
    turn, as the dispatcher may send it."""

    name = "env"

    def __init__(self, *envs: Environment) -> None:
        self.envs = envs
        self.replicas = len(envs)
        self.turn = 0
        self.resets: list[int] = []  # the replica each reset went to

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        replica = kw.get("replica")
        if replica is None:
            replica, self.turn = self.turn, (self.turn + 1) % self.replicas
        if method == "reset":
            self.resets.append(replica)
        try:
            return await getattr(self.envs[replica], method)(payload)
        except Exception as exc:
            raise RemoteError("handler_error", str(exc), remote_type=type(exc).__name__) from exc


class Broken(Guess):
    """Every step raises."""

    async def act(self, state: Any, action: str) -> Transition:
        raise RuntimeError("the tool's sandbox is gone")


def test_a_replica_failing_its_steps_is_quarantined_and_new_episodes_go_to_the_others() -> None:
    async def main() -> tuple[list[Sample], Replicas, Counter[str]]:
        env = Replicas(
            Guess(RoleContext.local(name="env", replica=0)),
            Broken(RoleContext.local(name="env", replica=1)),
        )
        r = runner(env, quarantine_window=2, probe_after_s=3600.0)
        metrics: Counter[str] = Counter()
        prompt = Prompt(id="p", token_ids=[1], answer="11")
        samples = [await r.source(prompt, k, metrics) for k in range(6)]
        return samples, env, metrics

    samples, env, metrics = run(main())
    # Episodes 1 and 3 fail their first step on replica 1: 2 of its last 2, and it is out.
    assert env.resets == [0, 1, 0, 1, 0, 0]
    assert [s.infra_failed for s in samples] == ["", "error", "", "error", "", ""]
    assert metrics["quarantined"] == 1 and metrics["quarantine_released"] == 0


class FreestFails(Replicas):
    """A reset to any replica goes to the freest, as the dispatcher sends it: replica 1, which
    fails at once, unless the call avoids it."""

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        if kw.get("replica") is None:
            kw["replica"] = 0 if kw.get("avoid") == 1 else 1
        return await super().call(method, payload, reply_type, **kw)


def test_an_episode_played_again_after_a_failure_starts_on_another_replica() -> None:
    async def main() -> tuple[list[Sample], Trajectory, Replicas]:
        env = FreestFails(
            Guess(RoleContext.local(name="env", replica=0)),
            Broken(RoleContext.local(name="env", replica=1)),
        )
        r = runner(env)
        prompt = Prompt(id="p", token_ids=[1], answer="7")  # right at the first guess
        samples = [await r.source(prompt, 0, Counter()) for _ in range(2)]
        # A held-out episode played again under its fresh id, as EpisodeEvaluation plays it.
        assert (await r.run("eval-0", 7, [])).infra_failed == "error"
        return samples, await r.run("eval-0~1", 7, []), env

    samples, again, env = run(main())
    assert [s.infra_failed for s in samples] == ["error", ""]
    assert env.resets == [1, 0, 1, 0]  # each failed episode's next start avoids env.1
    assert again.infra_failed == "" and again.reward == 1.0


class Unanswering(Handle):
    """The replica holding the episodes never answers a step (hung or gone)."""

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        if method == "step" and self.incarnation == 0:
            self.restart()  # the supervisor replaces it; the episode is gone with it
            raise DeadlineExceededError("env.0", "step", kw["timeout"])
        return await super().call(method, payload, reply_type, **kw)


def test_a_replica_that_does_not_answer_a_step_loses_the_episode() -> None:
    async def main() -> Trajectory:
        env = Unanswering(lambda n: NotDeterministic(RoleContext.local(name="env", incarnation=n)))
        return await runner(env, step_timeout_s=0.05).run("e", 11, [])

    traj = run(main())
    assert traj.restarts == 1 and traj.done and traj.timeouts == 0


class LosesOnce(Handle):
    """The environment replica restarts (losing its episodes) just before the second step."""

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        if isinstance(payload, Step) and payload.turn == 1 and self.incarnation == 0:
            self.restart()
        return await super().call(method, payload, reply_type, **kw)


def test_an_episode_lost_with_its_replica_restarts_from_reset() -> None:
    async def main() -> tuple[Trajectory, LosesOnce, EpisodeRunner]:
        env = LosesOnce(lambda n: NotDeterministic(RoleContext.local(name="env", incarnation=n)))
        r = runner(env, max_turns=6, quarantine_share=0.0, quarantine_window=1)
        return await r.run("e", 13, []), env, r

    traj, env, r = run(main())
    assert traj.restarts == 1 and traj.replays == 0 and traj.done
    assert r.environment.quarantine.quarantined == 0  # a restart: not the replica failing steps
    assert [decode(s.token_ids) for s in traj.segments if s.policy] == ["7;", "11;", "13;"]
    resets = [p for m, p in env.calls if m == "reset"]
    assert len(resets) == 2  # the first attempt's tokens were dropped with it
    assert r.rollout.calls == 2 + 3  # turns 0 and 1 of the lost attempt, 3 of the new one


class NotDeterministic(Guess):
    deterministic = False


def test_a_deterministic_environment_replays_the_actions_and_goes_on() -> None:
    async def main() -> tuple[Trajectory, LosesOnce, EpisodeRunner]:
        env = LosesOnce(lambda n: Guess(RoleContext.local(name="env", incarnation=n)))
        r = runner(env, max_turns=6, deterministic=True)
        return await r.run("e", 13, []), env, r

    traj, env, r = run(main())
    assert (traj.restarts, traj.replays) == (0, 1)
    assert [decode(s.token_ids) for s in traj.segments if s.policy] == ["7;", "11;", "13;"]
    assert r.rollout.calls == 3  # nothing generated twice
    steps = [(p.turn, p.action) for m, p in env.calls if m == "step"]
    assert steps == [(0, "7"), (1, "11"), (0, "7"), (1, "11"), (2, "13")]


def test_an_environment_answers_a_retried_step_and_refuses_an_unknown_episode() -> None:
    async def main() -> None:
        env = Guess(RoleContext.local(name="env"))
        await env.reset(Reset(episode_id="a", task=5))
        first = await env.step(Step(episode_id="a", turn=0, action="9"))
        again = await env.step(Step(episode_id="a", turn=0, action="9"))
        assert first == again == Transition(observation="lower")
        assert env.episodes["a"].state["guesses"] == 1  # the retry did not act twice
        with pytest.raises(EpisodeLost, match="at turn 1, not 3"):
            await env.step(Step(episode_id="a", turn=3, action="5"))
        with pytest.raises(EpisodeLost, match="holds no episode 'b'"):
            await env.step(Step(episode_id="b", turn=0, action="5"))
        await env.close(Close(episode_id="a"))
        assert env.episodes == {}

    run(main())


def test_episodes_run_concurrently_and_a_slow_one_holds_no_other() -> None:
    """One environment replica, ten episodes at once: each step of one waits on a gate, the
    others finish meanwhile."""

    class Gated(Guess):
        gate = asyncio.Event()

        async def act(self, state: Any, action: str) -> Transition:
            if state["secret"] == 0:
                await self.gate.wait()
            return await super().act(state, action)

    async def main() -> list[Trajectory]:
        env = Handle(lambda n: Gated(RoleContext.local(name="env")))
        r = runner(env, max_turns=6)
        slow = asyncio.ensure_future(r.run("slow", 0, []))
        fast = await asyncio.gather(*(r.run(f"f{i}", i + 1, []) for i in range(9)))
        assert not slow.done()
        Gated.gate.set()
        return [*fast, await slow]

    trajs = run(main())
    assert all(t.done for t in trajs)


class Updating(Bisect):
    """Bisect, but its first turn comes back partial under version 3 (new weights arrived
    mid-turn) and is resumed under version 4, where every later token is generated."""

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        (request,) = payload.requests
        if request.partial is None and self.calls == 0:
            (whole,) = await super().call(method, payload, reply_type, **kw)
            self.version = 4
            return [
                Sample(
                    prompt_id=whole.prompt_id,
                    sample_index=0,
                    prompt_ids=whole.prompt_ids,
                    token_ids=whole.token_ids[:1],
                    logprobs=[-0.5],
                    versions=[3],
                    finished=False,
                    stop_reason="interrupted",
                )
            ]
        if request.partial is not None:  # resume: the rest of the first guess
            (whole,) = await super().call(method, GenerateBatch([request]), reply_type, **kw)
            part = request.partial
            rest = whole.token_ids[len(part.token_ids) :]
            return [
                Sample(
                    prompt_id=part.prompt_id,
                    sample_index=0,
                    prompt_ids=part.prompt_ids,
                    token_ids=[*part.token_ids, *rest],
                    logprobs=[*part.logprobs, *[-0.25] * len(rest)],
                    versions=[*part.versions, *[4] * len(rest)],
                    finished=True,
                    stop_reason="stop",
                )
            ]
        return await super().call(method, payload, reply_type, **kw)


def test_a_turn_resumed_across_a_weight_update_keeps_each_tokens_version() -> None:
    """Partial rollouts mid-episode: the first guess's first token keeps version 3, the rest of
    the episode is 4; the environment's tokens carry the version before them, and staleness
    reads the policy's tokens only."""

    async def main() -> Trajectory:
        env = env_handle()
        return await EpisodeRunner(
            Updating(),
            env,
            encode=encode,
            decode=lambda ids: decode(ids).rstrip(";"),
            params=SamplingParams(max_new_tokens=4),
        ).run("e1", 11, [])

    traj = run(main())
    sample = traj.sample("p", 0)
    assert decode(sample.token_ids) == "7;higher11;"
    assert sample.versions == [3, 4] + [4] * len("higher") + [4, 4, 4]
    assert sample.logprobs[:2] == [-0.5, -0.25] and sample.logprobs[2:8] == [0.0] * 6
    assert sample.policy_versions == [3, 4, 4, 4, 4]
    assert sample.loss_mask == traj.loss_mask and sample.turn_rewards == [0.0, 1.0]


class Recording(Handle):
    """A handle that also records each call's keywords (``replica``)."""

    def __init__(self, make: Any) -> None:
        super().__init__(make)
        self.kwargs: list[tuple[str, dict[str, Any]]] = []
        self.stepping = asyncio.Event()

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        self.kwargs.append((method, kw))
        if method == "step":
            self.stepping.set()
        return await super().call(method, payload, reply_type, **kw)


def test_a_cancelled_episode_is_closed_on_the_replica_that_holds_it() -> None:
    """An episode cancelled mid-run (its group released) is let go: ``close`` goes to the
    replica its reset named, for its attempt; a stale close of an earlier attempt is ignored."""

    async def main() -> Recording:
        env = Recording(lambda n: Slow(RoleContext.local(name="env", replica=0)))
        r = runner(env, step_timeout_s=30.0)
        task = asyncio.create_task(r.run("e", 11, []))
        await env.stepping.wait()  # reset done, the first step hangs in the environment
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.gather(*r.environment.closes.tasks)
        return env

    env = run(main())
    closes = [kw for m, kw in env.kwargs if m == "close"]
    assert closes == [{"timeout": 5.0, "replica": 0}]
    assert "e" not in env.role.episodes

    async def stale() -> None:
        role = Guess(RoleContext.local(name="env"))
        await role.reset(Reset(episode_id="e", task=3, attempt=1))
        await role.close(Close(episode_id="e", attempt=0))  # the lost attempt's, arriving late
        assert "e" in role.episodes
        await role.close(Close(episode_id="e", attempt=1))
        assert "e" not in role.episodes

    run(stale())


class SlowFirstThenLoses(LosesOnce):
    """Deterministic, but its first action times out; the replica restarts before turn 1."""


def test_a_lost_episode_whose_turn_timed_out_restarts_instead_of_replaying() -> None:
    """A replay checks the environment's answers against what it said; a turn that had timed
    out cannot be replayed, so the episode restarts from reset (and the run goes on)."""

    class SlowGuess(Slow):
        deterministic = True

    async def main() -> Trajectory:
        env = SlowFirstThenLoses(lambda n: SlowGuess(RoleContext.local(name="env", incarnation=n)))
        r = runner(env, max_turns=6, deterministic=True, step_timeout_s=0.05)
        return await r.run("e", 13, [])

    traj = run(main())
    # One replay was tried, found the timed-out turn, and the episode restarted from reset.
    assert (traj.restarts, traj.replays) == (1, 1) and traj.done and traj.reward == 1.0


def test_an_episode_lost_past_max_restarts_fails_with_a_named_error() -> None:
    class AlwaysLoses(Handle):
        async def call(
            self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any
        ) -> Any:
            if method == "step":
                self.restart()
            return await super().call(method, payload, reply_type, **kw)

    async def main() -> None:
        env = AlwaysLoses(lambda n: Guess(RoleContext.local(name="env", incarnation=n)))
        await runner(env, max_restarts=2, deterministic=True).run("e", 13, [])

    with pytest.raises(EpisodeFailedError, match=r"^episode 'e' was lost 3 times \(") as info:
        run(main())
    assert "max_restarts is 2" in str(info.value) and isinstance(info.value, AsyncrlError)


def _one_turn(reward: float = 0.0, turn_rewards: list[float] | None = None) -> Trajectory:
    return Trajectory(
        episode_id="e",
        prompt_ids=[1],
        reward=reward,
        turn_rewards=list(turn_rewards or []),
        segments=[Segment(policy=True, token_ids=[2], logprobs=[0.0], versions=[0])],
    )


def test_a_trajectorys_own_reward_reaches_the_episode_scorer() -> None:
    sample = _one_turn(reward=1.0).sample("p", 0)
    assert sample.turn_rewards == [1.0]
    assert asyncio.run(episode_rewards([sample])) == [1.0]
    # Three turns and only a final reward: the whole of it is the last turn's.
    traj = Trajectory(
        episode_id="e3",
        prompt_ids=[1],
        reward=0.5,
        segments=[
            Segment(policy=True, token_ids=[2], logprobs=[0.0], versions=[0]),
            Segment(policy=False, token_ids=[4]),
            Segment(policy=True, token_ids=[2], logprobs=[0.0], versions=[0]),
            Segment(policy=False, token_ids=[4]),
            Segment(policy=True, token_ids=[2], logprobs=[0.0], versions=[0]),
        ],
    )
    assert traj.sample("p", 1).turn_rewards == [0.0, 0.0, 0.5]
    assert _one_turn().sample("p", 2).turn_rewards == []


def test_turn_rewards_that_do_not_sum_to_the_reward_are_refused_by_name() -> None:
    with pytest.raises(ValueError) as err:
        _one_turn(reward=0.0, turn_rewards=[0.0, 1.0]).sample("p", 0)
    assert str(err.value) == (
        "episode 'e': reward 0.0 is not the sum of turn_rewards [0.0, 1.0] (1.0); set reward "
        "to their sum, or leave turn_rewards empty to give the whole reward to the last turn"
    )


def test_the_episode_scorer_discounts_later_turns_when_asked() -> None:
    sample = _one_turn(reward=1.75, turn_rewards=[1.0, 0.5, 0.25]).sample("p", 0)
    assert asyncio.run(episode_rewards([sample])) == [1.75]
    # 1.0 + 0.5 * 0.5 + 0.25 * 0.5**2 = 1.0 + 0.25 + 0.0625
    discounted = functools.partial(episode_rewards, gamma=0.5)
    assert asyncio.run(discounted([sample])) == [1.3125]
    with pytest.raises(ValueError, match=r"^episode_rewards: gamma must be in \(0, 1\], got 0$"):
        asyncio.run(episode_rewards([sample], gamma=0))
