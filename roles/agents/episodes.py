"""Multi-turn episodes: the policy and an environment role take turns, and the runner keeps the
exact tokens of both.

An episode's trajectory is the prompt, then alternating *segments*: what the policy generated
(its token ids, behaviour log-probs and weight versions, exactly as the rollout returned them:
never re-tokenized) and what the environment answered (its observation's tokens, which the
policy did not write and which must not be trained). ``Trajectory.loss_mask`` says which tokens
are the policy's; ``turn_starts`` where each segment begins.

``EpisodeRunner.run`` drives one episode; a program runs many at once, so fast episodes never
wait for slow ones (each is its own task; its generate calls and steps go to whichever replicas
have room, and its steps to the environment replica that holds it). It reaches the environment
through an ``EnvironmentClient`` (``asyncrl.roles.agents.environment_client``), as agent code
does, so what counts as the environment's failure, the quarantine, and where an episode played
again starts are decided in one place. Failures:

- A step past ``step_timeout_s`` is cancelled by the environment (counted in ``timeouts``) and
  ends the episode as ``infra_failed`` (``"timeout"``): the environment failed, not the policy,
  and the sample pipeline never trains it. An environment that declares its timeouts part of
  the task (``Environment.timeout_is_task``) has them shown to the policy as the observation
  ``timeout_text`` instead, or end the episode (trained) when ``on_timeout`` is ``"end"``. A
  replica that does not answer a step at all within twice that (hung, or killed) is treated as
  having lost the episode.
- A step answered by ``EpisodeLost`` (the environment replica was restarted and lost the
  episode), or whose connection broke with it in flight (the replica died), restarts the
  episode from ``reset``, discarding what it had: its tokens are never trained (``restarts``;
  at most ``max_restarts``). With ``deterministic`` the episode is reset and its actions
  replayed instead, and it goes on where it was (``replays``).
- Any other error of a step (the environment raised) ends the episode, counted in ``errors``,
  as ``infra_failed`` (``"error"``); so does an error of its reset, and, in ``source``, an
  episode lost more than ``max_restarts`` times (``"lost"``).

An ``infra_failed`` episode still becomes a sample (``Trajectory.sample``), flagged with its
cause (``Sample.infra_failed``): the sample pipeline completes its group with a fresh episode of
the same prompt (``source`` gives it a fresh episode id) or drops the group, as the manifest's
``pipeline.infra_failed`` says (docs/agents.md).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

from asyncrl.errors import AsyncrlError
from asyncrl.roles.agents.environment import Transition
from asyncrl.roles.agents.environment_client import EnvEpisode, EnvironmentClient, EnvironmentFailed
from asyncrl.roles.payloads import GenerateBatch, GenerateRequest, Prompt, Sample, SamplingParams

__all__ = [
    "EpisodeFailedError",
    "EpisodeRunner",
    "Segment",
    "Trajectory",
    "count",
    "episode_rewards",
]

log = logging.getLogger("asyncrl.agents")


class Segment(msgspec.Struct, kw_only=True):
    """A run of tokens from one side: the policy's (with log-probs and versions) or the
    environment's (an observation)."""

    policy: bool
    token_ids: list[int]
    logprobs: list[float] = []
    versions: list[int] = []


class Trajectory(msgspec.Struct, kw_only=True):
    """One episode, as the learner will train it and the program counts it.

    Attributes:
        episode_id: the episode's stable id.
        prompt_ids: the prompt's tokens and the reset's observation.
        segments: policy and environment segments, alternating, the policy's first.
        reward: the episode's reward: the sum of ``turn_rewards`` when they are given. A
            trajectory with a reward and no ``turn_rewards`` gives the whole reward to its last
            turn.
        turn_rewards: each turn's reward (``turn_rewards[i]`` follows the policy's ``i``-th
            action: the environment's step, or the agent's ``reward`` on the endpoint).
        done: the environment ended the episode (False: it ran out of turns or was ended).
        restarts, replays, timeouts, errors: what went wrong on the way, and how it was met.
        infra_failed: why the episode failed through no fault of the policy (``"timeout"``,
            ``"error"``, ``"lost"``), or empty: such an episode is never trained on.
        said: each step's observation as the environment answered it (None: the step timed
            out), what a replay checks the environment's answers against.
    """

    episode_id: str
    prompt_ids: list[int]
    segments: list[Segment] = []
    reward: float = 0.0
    turn_rewards: list[float] = []
    done: bool = False
    restarts: int = 0
    replays: int = 0
    timeouts: int = 0
    errors: int = 0
    said: list[str | None] = []
    infra_failed: str = ""

    @property
    def turns(self) -> int:
        """Actions the policy took."""
        return sum(s.policy for s in self.segments)

    @property
    def token_ids(self) -> list[int]:
        """Every token after the prompt, both sides."""
        return [t for s in self.segments for t in s.token_ids]

    @property
    def loss_mask(self) -> list[int]:
        """1 for each of the policy's tokens (trained), 0 for the environment's."""
        return [int(s.policy) for s in self.segments for _ in s.token_ids]

    @property
    def turn_starts(self) -> list[int]:
        """Where each segment starts in ``token_ids``."""
        starts, at = [], 0
        for s in self.segments:
            starts.append(at)
            at += len(s.token_ids)
        return starts

    def sample(self, prompt_id: str, index: int) -> Sample:
        """The episode as one training sample, stable id ``(prompt_id, index)``: the policy's
        tokens with their behaviour log-probs and versions, the environment's with log-prob 0
        and the version of the turn before them, and the loss mask that keeps the latter out
        of training (``Sample.loss_mask``)."""
        logprobs: list[float] = []
        versions: list[int] = []
        version = 0
        for segment in self.segments:
            if segment.policy:
                logprobs += segment.logprobs
                versions += segment.versions
                version = segment.versions[-1] if segment.versions else version
            else:
                logprobs += [0.0] * len(segment.token_ids)
                versions += [version] * len(segment.token_ids)
        return Sample(
            prompt_id=prompt_id,
            sample_index=index,
            prompt_ids=self.prompt_ids,
            token_ids=self.token_ids,
            logprobs=logprobs,
            versions=versions,
            finished=True,
            stop_reason="stop" if self.done else "length",
            loss_mask=self.loss_mask,
            turn_starts=self.turn_starts,
            turn_rewards=self.rewards(),
            infra_failed=self.infra_failed,
        )

    def rewards(self) -> list[float]:
        """Each turn's reward as the scorer reads it: ``turn_rewards``, or, when none were
        given, ``reward`` at the last turn (zeros before it).

        Raises:
            ValueError: ``turn_rewards`` are given and do not sum to ``reward``.
        """
        if not self.turn_rewards:
            if self.reward == 0.0:
                return []
            return [0.0] * (max(self.turns, 1) - 1) + [self.reward]
        total = sum(self.turn_rewards)
        if not math.isclose(total, self.reward, rel_tol=1e-9, abs_tol=1e-12):
            raise ValueError(
                f"episode {self.episode_id!r}: reward {self.reward} is not the sum of "
                f"turn_rewards {self.turn_rewards} ({total}); set reward to their sum, or "
                "leave turn_rewards empty to give the whole reward to the last turn"
            )
        return list(self.turn_rewards)


async def episode_rewards(samples: list[Sample], *, gamma: float = 1.0) -> list[float]:
    """The pipeline's scorer for episodes: each one's return from its first turn,
    ``sum(gamma**t * turn_rewards[t])``; with ``gamma`` 1 (the default), the sum of its turns'
    rewards. Discount later turns with ``functools.partial(episode_rewards, gamma=0.9)``.

    Raises:
        ValueError: ``gamma`` is not in (0, 1].
    """
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"episode_rewards: gamma must be in (0, 1], got {gamma}")
    return [sum(r * gamma**t for t, r in enumerate(s.turn_rewards)) for s in samples]


class _Lost(Exception):
    """The environment replica lost the episode."""


class EpisodeRunner:
    """Runs episodes of a policy (the rollout group) against an environment role.

    The environment is reached through an ``EnvironmentClient``
    (``asyncrl.roles.agents.environment_client``, the runner's ``environment``), which owns
    the rules for what the environment failed, the quarantine, the fresh ids of episodes played
    again and the replica each is sent to; the runner owns the turns, the restarts and replays
    of a lost episode, and the trajectory.

    Args:
        rollout: the rollout group's handle (``generate`` takes one sample per call).
        env: the environment group's handle.
        encode: text -> token ids (for observations); decode: token ids -> text (for actions).
        params: how the policy samples each turn.
        max_turns: the most actions an episode takes.
        step_timeout_s: the deadline of one step of the environment.
        on_timeout: a timeout that is part of the task (``Environment.timeout_is_task``):
            ``"observe"`` (tell the policy ``timeout_text``) or ``"end"``. Any other timeout
            marks the episode ``infra_failed``.
        deterministic: the environment replays exactly: a lost episode is replayed, not
            restarted.
        max_restarts: the most restarts (or replays) of one episode before it fails.
        generate_timeout_s: the deadline of one generate call.
        task_of: a prompt's task for ``reset`` (``source``); by default its ``answer``.
        quarantine_share, quarantine_window, probe_after_s, probe_max_s: a replica that
            failed more than ``quarantine_share`` of its last ``quarantine_window`` steps (a
            failed reset counts as one) is quarantined and restarted by its supervisor: no
            new episode starts on it until a probe ``probe_after_s`` seconds later (doubled
            for each quarantine in a row, at most ``probe_max_s``, by default 16 times
            ``probe_after_s``), which lets it back once
            it serves a step (``asyncrl.roles.agents.quarantine``).

    Raises:
        ValueError: a bad ``on_timeout``, ``max_turns``, ``step_timeout_s`` or quarantine
            setting.
    """

    def __init__(
        self,
        rollout: Any,
        env: Any,
        *,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        params: SamplingParams,
        max_turns: int = 8,
        step_timeout_s: float = 30.0,
        on_timeout: str = "observe",
        timeout_text: str = "[the tool timed out]",
        deterministic: bool = False,
        max_restarts: int = 8,
        generate_timeout_s: float = 600.0,
        task_of: Callable[[Prompt], Any] = lambda prompt: prompt.answer,
        quarantine_share: float = 0.5,
        quarantine_window: int = 20,
        probe_after_s: float = 30.0,
        probe_max_s: float | None = None,
    ) -> None:
        if on_timeout not in ("observe", "end"):
            raise ValueError(f"on_timeout: expected 'observe' or 'end', got {on_timeout!r}")
        if max_turns < 1:
            raise ValueError(f"max_turns: expected an int >= 1, got {max_turns}")
        self.rollout = rollout
        self.environment = EnvironmentClient(
            env,
            step_timeout_s=step_timeout_s,
            quarantine_share=quarantine_share,
            quarantine_window=quarantine_window,
            probe_after_s=probe_after_s,
            probe_max_s=probe_max_s,
        )
        self.encode = encode
        self.decode = decode
        self.params = params
        self.max_turns = max_turns
        self.on_timeout = on_timeout
        self.timeout_text = timeout_text
        self.deterministic = deterministic
        self.max_restarts = max_restarts
        self.generate_timeout_s = generate_timeout_s
        self.task_of = task_of

    async def source(self, prompt: Prompt, index: int, metrics: Counter[str]) -> Sample:
        """The sample pipeline's ``SampleSource``: sample ``index`` of ``prompt`` is episode
        ``<prompt id>/<index>`` on the task ``task_of(prompt)`` (by default the prompt's
        ``answer``), run to its end and returned as one sample (``Trajectory.sample``); what
        happened on the way is counted in ``metrics``. The pipeline keeps the accounting: a
        lost episode is restarted here under the same stable id, so each is trained once.

        An episode that failed through no fault of the policy comes back flagged
        (``Sample.infra_failed``): a step timed out or raised, its reset raised, or it was lost
        more than ``max_restarts`` times. The pipeline's fresh episode in its place is
        ``<prompt id>/<index>~<n>`` (``EnvironmentClient.episode_id``), so that no replica
        confuses it with the failed one, and it starts on another replica than the one that
        failed it."""
        name = f"{prompt.id}/{index}"
        episode_id = self.environment.episode_id(name)
        try:
            traj = await self.run(episode_id, self.task_of(prompt), prompt.token_ids)
        except EpisodeFailedError as exc:
            log.warning("%s", exc)
            traj = Trajectory(
                episode_id=episode_id,
                prompt_ids=prompt.token_ids,
                restarts=self.max_restarts,
                infra_failed="lost",
            )
        if traj.infra_failed:
            self.environment.failed(name)
        count(metrics, traj)
        self.environment.count(metrics)
        return traj.sample(prompt.id, index)

    async def aclose(self) -> None:
        """Cancel the environment's ``close`` calls and restart requests still in flight
        (``EnvironmentClient.aclose``); call it once the runner is done with."""
        await self.environment.aclose()

    async def run(self, episode_id: str, task: Any, prompt_ids: list[int]) -> Trajectory:
        """Run one episode to its end; its trajectory, exact to the token (flagged
        ``infra_failed`` when its reset raised, or a step timed out or raised).

        Raises:
            EpisodeFailedError: the episode was lost more than ``max_restarts`` times.
            ReplicasQuarantinedError: every environment replica is quarantined.
        """
        restarts = replays = 0
        resumed: Trajectory | None = None
        while True:
            attempt = _Attempt(restarts + replays)
            try:
                traj = await self._episode(episode_id, task, prompt_ids, resumed, attempt)
            except (_Lost, _Unreplayable) as exc:
                self._forget(attempt)  # a replica still holding it lets it go
                if restarts + replays >= self.max_restarts:
                    raise EpisodeFailedError(
                        episode_id, restarts, replays, self.max_restarts, exc
                    ) from exc
                if isinstance(exc, _Unreplayable):
                    log.warning("episode %r restarts from reset: %s", episode_id, exc)
                if self.deterministic and attempt.traj and not isinstance(exc, _Unreplayable):
                    replays += 1
                    resumed = attempt.traj
                else:
                    restarts += 1
                    resumed = None
                continue
            except BaseException:  # cancelled (its group was released), or failed
                self._forget(attempt)
                raise
            traj.restarts, traj.replays = restarts, replays
            self._forget(attempt)  # nothing for an episode the environment ended
            return traj

    async def _episode(
        self,
        episode_id: str,
        task: Any,
        prompt_ids: list[int],
        resumed: Trajectory | None,
        attempt: _Attempt,
    ) -> Trajectory:
        """One attempt: reset (and replay ``resumed``'s actions), then take turns to the end."""
        try:
            episode = await self.environment.reset(episode_id, task, attempt=attempt.number)
        except EnvironmentFailed as exc:
            if exc.cause == "lost":
                raise _Lost(str(exc)) from exc
            log.warning("episode %r: the environment's reset failed: %s", episode_id, exc)
            return Trajectory(
                episode_id=episode_id, prompt_ids=prompt_ids, errors=1, infra_failed=exc.cause
            )
        attempt.episode = episode
        if resumed is None:
            traj = Trajectory(
                episode_id=episode_id, prompt_ids=prompt_ids + self.encode(episode.observation)
            )
        else:
            traj = resumed
        attempt.traj = traj  # what a replay goes on from, if this attempt loses the episode
        if resumed is not None:
            await self._replay(traj, episode)
        while not traj.done:
            turn = len(traj.turn_rewards)  # steps taken; a replayed episode may owe one
            if turn == traj.turns:
                if turn >= self.max_turns:
                    break
                sample = await self._generate(traj, attempt.number)
                traj.segments.append(
                    Segment(
                        policy=True,
                        token_ids=list(sample.token_ids),
                        logprobs=list(sample.logprobs),
                        versions=list(sample.versions),
                    )
                )
            action = self.decode(traj.segments[-1].token_ids)
            transition = await self._step(episode, action, traj)
            if transition is None:  # ended on a timeout or an error
                break
            traj.said.append(None if transition.timed_out else transition.observation)
            traj.turn_rewards.append(transition.reward)
            traj.reward += transition.reward
            traj.done = transition.done
            if transition.observation and not transition.done:
                traj.segments.append(
                    Segment(policy=False, token_ids=self.encode(transition.observation))
                )
        return traj

    def _forget(self, attempt: _Attempt) -> None:
        """Tell the replica that holds the attempt's episode to forget it, without waiting (a
        cancelled episode cannot wait)."""
        if attempt.episode is not None:
            self.environment.close(attempt.episode)

    async def _generate(self, traj: Trajectory, attempt: int) -> Sample:
        context = [*traj.prompt_ids, *traj.token_ids]
        prompt = Prompt(id=f"{traj.episode_id}/{attempt}/{traj.turns}", token_ids=context)
        request = GenerateRequest(prompt=prompt, sample_index=0, params=self.params)
        while True:
            sample: Sample
            (sample,) = await self.rollout.call(
                "generate",
                GenerateBatch([request]),
                list[Sample],
                timeout=self.generate_timeout_s,
                key=(prompt.id, 0),
            )
            if sample.finished:
                return sample
            request = GenerateRequest(
                prompt=prompt, sample_index=0, params=self.params, partial=sample
            )

    async def _step(self, episode: EnvEpisode, action: str, traj: Trajectory) -> Transition | None:
        """One step on the replica that holds the episode; None when a timeout or an error of
        the environment ends it (``infra_failed``), or a task's timeout with ``on_timeout``
        ``"end"``."""
        try:
            transition = await self.environment.step(episode, action)
        except EnvironmentFailed as exc:
            if exc.cause == "lost":
                raise _Lost(str(exc)) from exc
            log.debug("%s", exc)
            traj.timeouts += exc.cause == "timeout"
            traj.errors += exc.cause == "error"
            traj.infra_failed = exc.cause
            return None
        if transition.timed_out:  # part of the task: the policy's result
            traj.timeouts += 1
            if self.on_timeout == "end":
                return None
            return Transition(observation=self.timeout_text, timed_out=True)
        return transition

    async def _replay(self, traj: Trajectory, episode: EnvEpisode) -> None:
        """Take a resumed trajectory's actions again on a fresh reset; the environment is
        deterministic, so it answers each as it did. A turn that timed out, an answer that
        differs or an error raises ``_Unreplayable``: the episode then restarts from reset."""
        actions = [self.decode(s.token_ids) for s in traj.segments if s.policy]
        for turn, action in enumerate(actions[: len(traj.turn_rewards)]):  # the steps it took
            if traj.said[turn] is None:
                raise _Unreplayable(f"turn {turn} timed out; its answer cannot be replayed")
            try:
                transition = await self.environment.step(episode, action)
            except EnvironmentFailed as exc:
                if exc.cause == "lost":
                    raise _Lost(str(exc)) from exc
                raise _Unreplayable(f"turn {turn} failed on replay: {exc}") from exc
            if transition.timed_out or transition.observation != traj.said[turn]:
                raise _Unreplayable(
                    f"the environment answered turn {turn} differently on replay: it is not "
                    "deterministic"
                )


class _Attempt:
    """One attempt at an episode: its number, its episode on the environment once reset, its
    trajectory."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.episode: EnvEpisode | None = None
        self.traj: Trajectory | None = None


class _Unreplayable(Exception):
    """A lost episode's actions could not be replayed: restart it from reset instead."""


class EpisodeFailedError(AsyncrlError):
    """An episode was lost more often than ``max_restarts`` allows: the run stops, since its
    environment keeps losing what it holds."""

    def __init__(
        self, episode_id: str, restarts: int, replays: int, limit: int, cause: Exception
    ) -> None:
        super().__init__(
            f"episode {episode_id!r} was lost {restarts + replays + 1} times ({restarts} "
            f"restarts, {replays} replays; max_restarts is {limit}); the last time: {cause}. "
            "Is the environment crashing on this task, or its steps slower than "
            "step_timeout_s? Raise max_restarts or step_timeout_s, or fix the environment"
        )
        self.episode_id = episode_id


def count(metrics: Counter[str], traj: Trajectory) -> None:
    """Add one finished episode to the pipeline's counters: ``episodes``, ``episodes_done``
    (the environment ended them), ``episode_turns``, ``env_tokens`` (the environment's tokens
    in the samples, all masked out of training), ``episode_restarts``, ``episode_replays``,
    ``env_timeouts`` and ``env_errors``."""
    metrics["episodes"] += 1
    metrics["episodes_done"] += traj.done
    metrics["episode_turns"] += traj.turns
    metrics["env_tokens"] += sum(len(s.token_ids) for s in traj.segments if not s.policy)
    metrics["episode_restarts"] += traj.restarts
    metrics["episode_replays"] += traj.replays
    metrics["env_timeouts"] += traj.timeouts
    metrics["env_errors"] += traj.errors
