"""An environment role driven by agent code: episodes reset, stepped and closed one call at a
time, with the failures of the environment typed apart from the policy's results.

``EnvironmentClient`` is the one place that owns the rules for an environment's failures, for
both of its users: ``EpisodeRunner`` (``asyncrl.roles.agents.episodes``), which plays whole
episodes and asks the rollout group for each action, and an agent that asks the policy through
the OpenAI-compatible endpoint (``asyncrl.roles.agents.openai_server``), with the ``openai``
client, and plays its own turns. The rules:

- ``reset`` starts an episode on a replica the quarantine allows (round robin over the healthy
  ones; a probe now and then to a quarantined one); every step of the episode goes to that
  replica. An episode played again after the environment failed it (its fresh id
  ``<name>~<n>``, or the same id started again) goes to another replica than the one that
  failed it (its step or its reset), while another has room: a replica that fails at once is
  the freest, and would otherwise draw every retry until the quarantine takes it out.
- ``reset`` raises ``EnvironmentFailed`` when the environment failed it: ``"error"`` (it
  raised) or ``"lost"`` (not answered).
- ``step`` answers the environment's ``Transition``, or raises ``EnvironmentFailed`` with the
  cause when the environment failed the step: ``"timeout"`` (past ``step_timeout_s``, unless the
  environment declares its timeouts part of the task: then the timed-out ``Transition`` is the
  answer), ``"error"`` (the environment raised) or ``"lost"`` (the replica lost the episode: it
  died or was restarted, or did not answer within twice the deadline). Such an episode is the
  environment's failure, not the policy's, and is never trained on: the agent returns it as a
  trajectory flagged ``infra_failed`` with the cause, and the sample pipeline completes its
  group with a fresh episode (``episode_id`` gives that one a fresh id).
- Every step feeds the quarantine, and so does every reset a replica failed (as a failed
  step): a replica failing more than its share of its last steps takes no new episode
  (``asyncrl.roles.agents.quarantine``). Episodes lost with a replica's death do not count
  against it: the supervisor restarts it. That includes a step that no process took before
  its deadline (the replica was down, its restart not yet up: the deadline error names no
  pid); a step a live replica took and did not answer counts.
- A replica the quarantine takes out (again: a failed probe) is restarted: its supervisor is
  asked for a fresh process (``Handle.restart_replica``, without waiting), with the reason,
  for the incarnation that failed (a reset that raised names none: whichever runs); its
  episodes in flight are lost with it and play again elsewhere. The probe that lets it back
  goes to the fresh process, after the quarantine's backoff, which doubles with each
  quarantine in a row. A handle that cannot restart (an in-process stand-in without
  ``restart_replica``) leaves the replica as it is.
- ``close`` forgets an episode on its replica without waiting (an episode that ended ``done``
  needs none).
- ``aclose``, once the client is done with, cancels the ``close`` calls and restart requests
  still in flight and waits for them, so that none is left pending when the run ends.

A lost episode is not replayed here: the runner replays one (or restarts it from ``reset``)
itself, while an agent's conversation with the endpoint went on from what the lost replica
said, and the agent alone knows how to play it again, so there it ends as ``"lost"`` and the
pipeline plays the prompt afresh.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

from asyncrl.errors import (
    AsyncrlError,
    BrokenError,
    DeadlineExceededError,
    RemoteError,
    TransportError,
)
from asyncrl.roles.agents.environment import Close, Observation, Reset, Step, Transition
from asyncrl.roles.agents.quarantine import Quarantine

__all__ = ["EnvEpisode", "EnvironmentClient", "EnvironmentFailed"]

log = logging.getLogger("asyncrl.agents")

FAILED_KEPT = 4096
"""The failed episodes whose next id ``episode_id`` remembers; past it, the oldest are
forgotten (the pipeline plays a failed episode's prompt again at once, or never)."""

LOST = "EpisodeLost"
"""The remote type of the error a replica without the episode raises."""

FRESH = "~"
"""What separates an episode's name from the count of its failed tries in a fresh id."""


def name_of(episode_id: str) -> str:
    """The episode an id plays: ``p/0`` for ``p/0`` and for its fresh ids ``p/0~<n>``."""
    name, sep, tries = episode_id.rpartition(FRESH)
    return name if sep and tries.isdigit() else episode_id


class EnvironmentFailed(AsyncrlError):
    """The environment failed an episode through no fault of the policy. Recoverable: the
    episode is not trained on, and a fresh one takes its place.

    Attributes:
        cause: ``"timeout"``, ``"error"`` or ``"lost"`` (what ``Sample.infra_failed`` records).
        episode_id: the episode's id.
    """

    retryable = True

    def __init__(self, episode_id: str, cause: str, detail: str) -> None:
        super().__init__(f"episode {episode_id!r}: {detail}")
        self.episode_id = episode_id
        self.cause = cause


def _failed_on(exc: TransportError, replica: int | None) -> int | None:
    """The replica a failed call went to: the one it was aimed at, or the one the dispatcher
    sent it to (the error's ``replica``)."""
    return replica if replica is not None else exc.replica


class EnvEpisode:
    """One episode on the environment: its id, the replica that holds it, which start of the
    episode this is (``attempt``), the steps it took, whether the environment ended it, and
    the timeouts and errors met on the way."""

    def __init__(self, episode_id: str, replica: int, observation: str, attempt: int = 0) -> None:
        self.episode_id = episode_id
        self.replica = replica
        self.attempt = attempt
        self.observation = observation
        self.turn = 0
        self.done = False
        self.timeouts = 0
        self.errors = 0


class Closes:
    """``close`` calls sent to an environment group without waiting (a cancelled episode cannot
    wait), each task kept until it ends; a close that fails is only logged, since a replica
    forgets its episodes when it restarts anyway."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.tasks: set[asyncio.Task[None]] = set()

    def send(self, close: Close, replica: int) -> None:
        """Tell ``replica`` to forget ``close.episode_id``."""
        task = asyncio.get_running_loop().create_task(self._close(close, replica))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        """Cancel the ``close`` calls still in flight, and wait until they have ended."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _close(self, close: Close, replica: int) -> None:
        try:
            await self.env.call("close", close, None, timeout=5.0, replica=replica)
        except Exception as exc:
            log.debug("closing episode %r failed: %s", close.episode_id, exc)


class QuarantineRestarts:
    """Restart requests for quarantined replicas, sent without waiting (an episode's step
    must not wait on a supervisor), each task kept until it ends or ``close`` cancels it.
    ``restarted`` counts those the supervisor made; a refusal or an agent that does not
    answer is only logged."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.tasks: set[asyncio.Task[None]] = set()
        self.restarted = 0

    def send(self, replica: int, reason: str, incarnation: int | None) -> None:
        """Ask for a fresh process of ``replica`` (``incarnation``, if known)."""
        if getattr(self.env, "restart_replica", None) is None:
            log.warning("%s.%d cannot be restarted from here: %s", _name(self.env), replica, reason)
            return
        task = asyncio.get_running_loop().create_task(self._restart(replica, reason, incarnation))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _restart(self, replica: int, reason: str, incarnation: int | None) -> None:
        name = f"{_name(self.env)}.{replica}"
        try:
            answer = await self.env.restart_replica(replica, reason, incarnation=incarnation)
        except AsyncrlError as exc:
            log.warning("%s: its restart was not asked for: %s", name, exc)
            return
        if answer.restarted:
            self.restarted += 1
            log.warning(
                "%s restarts (incarnation %d, pid %s stopped): %s",
                name,
                answer.incarnation,
                answer.pid,
                reason,
            )
        else:
            log.warning("%s was not restarted: %s", name, answer.why)

    async def close(self) -> None:
        """Cancel the requests still waiting for an answer, and wait until they have ended (a
        supervisor that got one restarts the replica all the same)."""
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _name(env: Any) -> str:
    return str(getattr(env, "name", "env"))


class EnvironmentClient:
    """Episodes of one environment group, for agent code (see the module).

    Args:
        env: the environment group's handle (``ctx.roles["env"]``).
        step_timeout_s: the deadline of a step (and of a reset).
        quarantine_share, quarantine_window, probe_after_s, probe_max_s: as
            ``EpisodeRunner``'s: a replica that failed more than ``quarantine_share`` of its
            last ``quarantine_window`` steps is restarted and takes no new episode until a
            probe, ``probe_after_s`` seconds later (doubled for each quarantine in a row, at
            most ``probe_max_s``; None: 16 times ``probe_after_s``).

    Raises:
        ValueError: a bad quarantine setting or a ``step_timeout_s`` that is not positive.
    """

    def __init__(
        self,
        env: Any,
        *,
        step_timeout_s: float = 30.0,
        quarantine_share: float = 0.5,
        quarantine_window: int = 20,
        probe_after_s: float = 30.0,
        probe_max_s: float | None = None,
    ) -> None:
        if not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s: expected a number > 0, got {step_timeout_s!r}")
        self.env = env
        self.step_timeout_s = step_timeout_s
        self.quarantine = Quarantine(
            _name(env),
            int(getattr(env, "replicas", 1)),
            share=quarantine_share,
            window=quarantine_window,
            probe_after_s=probe_after_s,
            probe_max_s=probe_max_s,
        )
        self._failed: dict[str, int] = {}  # episode name -> its failed tries, until run again
        self._failed_on: dict[str, int] = {}  # episode name -> the replica that failed it last
        self.closes = Closes(env)
        self.restarts = QuarantineRestarts(env)
        self._incarnations: dict[int, int] = {}  # replica -> the newest incarnation seen
        self._counted = (0, 0, 0)  # (quarantined, released, restarted) counted in metrics

    def episode_id(self, name: str) -> str:
        """The id to play episode ``name`` under: ``name`` itself, or ``name~<n>`` after it
        failed ``n`` times, so that neither the endpoint nor a replica confuses the fresh
        episode with the failed one."""
        tries = self._failed.get(name, 0)
        return f"{name}{FRESH}{tries}" if tries else name

    def failed(self, name: str) -> None:
        """Episode ``name`` failed through no fault of the policy: its next ``episode_id`` is
        a fresh one."""
        self._failed[name] = self._failed.get(name, 0) + 1
        while len(self._failed) > FAILED_KEPT:
            del self._failed[next(iter(self._failed))]

    def count(self, metrics: Counter[str]) -> None:
        """Add the replicas quarantined, let back and restarted on the quarantine's request
        since the last call to ``metrics`` (``quarantined``, ``quarantine_released``,
        ``quarantine_restarts``)."""
        quarantined, released, restarted = self._counted
        now = (self.quarantine.quarantined, self.quarantine.released, self.restarts.restarted)
        self._counted = now
        metrics["quarantined"] += now[0] - quarantined
        metrics["quarantine_released"] += now[1] - released
        metrics["quarantine_restarts"] += now[2] - restarted

    def _judge(self, replica: int, failed: bool, incarnation: int | None) -> None:
        """Record a step (or a failed reset) of ``replica`` in the quarantine; restart the
        replica when that quarantines it: the ``incarnation`` that failed (None: whichever
        runs)."""
        why = self.quarantine.record(replica, failed)
        if why:
            streak = self.quarantine.streak(replica)
            reason = f"{why} ({streak} quarantine{'s' * (streak > 1)} in a row)"
            self.restarts.send(replica, reason, incarnation)

    def _failed_by(self, episode_id: str, replica: int | None) -> None:
        """``replica`` failed the episode: the next reset of its name goes elsewhere."""
        if replica is None:
            return
        name = name_of(episode_id)
        self._failed_on.pop(name, None)
        self._failed_on[name] = replica
        while len(self._failed_on) > FAILED_KEPT:
            del self._failed_on[next(iter(self._failed_on))]

    async def reset(self, episode_id: str, task: Any, *, attempt: int = 0) -> EnvEpisode:
        """Start ``episode_id`` on ``task``, on a replica the quarantine allows, and another
        than the one that failed it last while another has room. ``attempt`` counts the starts
        of this episode id (0 first; the episode runner starts a lost episode again).

        A reset the environment raised, or a live replica did not answer, counts against
        the replica that failed it as a failed step does, and the episode's next reset goes
        elsewhere.

        Raises:
            EnvironmentFailed: the reset raised (``"error"``) or was not answered (``"lost"``).
            ReplicasQuarantinedError: every replica is quarantined.
        """
        avoid = self._failed_on.pop(name_of(episode_id), None)
        replica = self.quarantine.pick(avoid)
        try:
            obs: Observation = await self.env.call(
                "reset",
                Reset(episode_id=episode_id, task=task, attempt=attempt),
                Observation,
                timeout=self.step_timeout_s,
                key=(episode_id, attempt, "reset"),
                replica=replica,
                avoid=avoid,
            )
        except RemoteError as exc:
            self._reset_failed(episode_id, _failed_on(exc, replica), counts=True, incarnation=None)
            raise EnvironmentFailed(episode_id, "error", f"the reset failed: {exc}") from exc
        except DeadlineExceededError as exc:
            # A live process took it and was silent: its failure; else it was down, as a step.
            failed_on = _failed_on(exc, replica)
            counts = exc.pid is not None
            self._reset_failed(episode_id, failed_on, counts=counts, incarnation=exc.incarnation)
            raise EnvironmentFailed(episode_id, "lost", f"the reset was lost: {exc}") from exc
        except BrokenError as exc:  # it died with the reset in flight
            self._reset_failed(episode_id, _failed_on(exc, replica), counts=False, incarnation=None)
            raise EnvironmentFailed(episode_id, "lost", f"the reset was lost: {exc}") from exc
        self._incarnations[obs.replica] = max(
            obs.incarnation, self._incarnations.get(obs.replica, 0)
        )
        return EnvEpisode(episode_id, obs.replica, obs.text, attempt)

    def _reset_failed(
        self, episode_id: str, replica: int | None, *, counts: bool, incarnation: int | None
    ) -> None:
        """``replica`` (None: not known) failed the reset of ``episode_id``: the next reset of
        the episode goes elsewhere; ``counts``: it counts against the replica as a failed
        step, of its ``incarnation`` (None: not known, since no reset of the incarnation that
        failed succeeded: a restart is asked for whichever runs)."""
        self._failed_by(episode_id, replica)
        if counts and replica is not None:
            self._judge(replica, True, incarnation)

    async def step(self, episode: EnvEpisode, action: str) -> Transition:
        """Take ``action`` in the episode, on the replica that holds it.

        Raises:
            EnvironmentFailed: the step timed out (and the timeout is not part of the task),
                raised, or was lost with the replica.
        """
        step = Step(
            episode_id=episode.episode_id,
            turn=episode.turn,
            action=action,
            deadline_s=self.step_timeout_s,
        )
        replica = episode.replica
        try:
            transition: Transition = await self.env.call(
                "step",
                step,
                Transition,
                timeout=2 * self.step_timeout_s,
                key=(episode.episode_id, episode.attempt, episode.turn),
                replica=replica,
            )
        except RemoteError as exc:
            self._failed_by(episode.episode_id, episode.replica)
            if exc.remote_type == LOST:  # the replica restarted: the supervisor's business
                raise EnvironmentFailed(episode.episode_id, "lost", str(exc)) from exc
            self._judge(replica, True, self._incarnations.get(replica))
            episode.errors += 1
            raise EnvironmentFailed(
                episode.episode_id, "error", f"the environment failed turn {step.turn}: {exc}"
            ) from exc
        except DeadlineExceededError as exc:
            self._failed_by(episode.episode_id, episode.replica)
            if exc.pid is not None:  # a live process took the step and was silent: its failure
                self._judge(replica, True, self._incarnations.get(replica))
            # Else no process took it before its deadline: the replica was down (killed, and
            # not yet restarted), so the episode is lost with its death, as below.
            raise EnvironmentFailed(
                episode.episode_id, "lost", f"turn {step.turn} was not answered: {exc}"
            ) from exc
        except BrokenError as exc:  # it died with the step in flight
            self._failed_by(episode.episode_id, episode.replica)
            raise EnvironmentFailed(
                episode.episode_id, "lost", f"turn {step.turn} was lost: {exc}"
            ) from exc
        infra_timeout = transition.timed_out and not transition.task_timeout
        self._judge(replica, infra_timeout, self._incarnations.get(replica))
        if transition.timed_out:
            episode.timeouts += 1
        if infra_timeout:
            self._failed_by(episode.episode_id, episode.replica)
            raise EnvironmentFailed(
                episode.episode_id,
                "timeout",
                f"turn {step.turn} ran past its deadline of {self.step_timeout_s:g} s",
            )
        episode.turn += 1
        episode.done = transition.done
        return transition

    async def aclose(self) -> None:
        """Cancel the ``close`` calls and restart requests still in flight and wait until they
        have ended; call it once the client is done with (idempotent)."""
        await self.closes.close()
        await self.restarts.close()

    def close(self, episode: EnvEpisode) -> None:
        """Tell the replica to forget the episode, without waiting (a cancelled agent cannot
        wait); nothing for an episode the environment ended."""
        if not episode.done:
            close = Close(episode_id=episode.episode_id, attempt=episode.attempt)
            self.closes.send(close, episode.replica)
