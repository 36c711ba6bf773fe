"""Environments as roles: the contract an environment serves, and a base class that keeps its
episodes.

An environment is code the policy talks with over several turns: a game, an interpreter, a tool.
It runs as a role of its own, so the supervisor restarts it when it crashes, and the run goes on.
The contract, in any language (a Python role class here, or a ``command:`` role that speaks
docs/protocol.md), is two endpoints:

- ``reset(Reset) -> Observation``: start episode ``episode_id`` on ``task``; the reply names the
  replica and incarnation that now hold the episode's state;
- ``step(Step) -> Transition``: apply the policy's ``action`` (text) to the episode; the reply is
  the observation, the reward of this step, whether the episode is done, and ``info``.

A step has a deadline (``Step.deadline_s``): the base class cancels an action that runs past
it and answers a ``Transition`` with ``timed_out``. Such a timeout is the infrastructure's
failure, not the policy's: the runner marks the episode ``infra_failed`` and it is never trained
on. An environment whose task includes the timeout (the policy asked for a computation too
slow, and should learn not to) says so with ``timeout_is_task``: its timeouts carry
``task_timeout``, and the runner shows the policy a timeout (or ends the episode on it).
``act`` must be ``async`` and await while it works (a tool in a subprocess,
``self.ctx.offload`` for CPU work): synchronous code cannot be cancelled, and a replica that
does not answer at all is treated as lost.

One episode's state lives in one replica: the runner sends every step of an episode to the
replica its reset named. ``step`` is idempotent per (episode, turn): a retried step of a turn the
episode already took answers the recorded transition instead of acting twice. A replica that
does not hold the episode (it was restarted and lost its state, or never had it) raises
``EpisodeLost``; the runner then restarts the episode from ``reset``, or, for an environment that
declares itself ``deterministic``, resets it and replays its actions to where it was.

``close`` forgets an episode; an episode that ends (``done``) is forgotten after ``keep_done``
more episodes end, so a retried last step still finds its answer.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from asyncrl.errors import AsyncrlError
from asyncrl.role import Delivery, Role, endpoint

__all__ = [
    "Close",
    "Environment",
    "EpisodeLost",
    "Observation",
    "Reset",
    "Step",
    "Transition",
]


class Reset(msgspec.Struct, kw_only=True):
    """Start episode ``episode_id`` on ``task`` (what the prompt source's row says); ``attempt``
    counts the runner's starts of this episode (0 first; a lost episode starts again)."""

    episode_id: str
    task: Any = None
    attempt: int = 0


class Observation(msgspec.Struct, kw_only=True):
    """The episode's first observation, and where its state now lives."""

    episode_id: str
    text: str
    replica: int = 0
    incarnation: int = 0


class Step(msgspec.Struct, kw_only=True):
    """The policy's ``action`` at turn ``turn`` (0 for the first action) of an episode, to be
    answered within ``deadline_s`` seconds (0: no deadline)."""

    episode_id: str
    turn: int
    action: str
    deadline_s: float = 0.0


class Transition(msgspec.Struct, kw_only=True):
    """What one action did: the next observation, this step's reward, and whether it ended;
    ``timed_out`` when the action ran past the step's deadline and was cancelled (the episode's
    state is as the action left it when cancelled); ``task_timeout`` when that timeout is part
    of the task (the policy's result, trained on), not a failure of the environment."""

    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = {}
    timed_out: bool = False
    task_timeout: bool = False


class Close(msgspec.Struct, kw_only=True):
    """Forget an episode (the runner gave up on it, or it ended): the attempt ``attempt`` of it,
    or any with None. A close that arrives after a later attempt's reset leaves that one be."""

    episode_id: str
    attempt: int | None = None


class EpisodeLost(AsyncrlError):
    """This replica does not hold the episode: it was restarted, or never had it."""


@dataclass
class _Episode:
    state: Any
    attempt: int = 0
    transitions: list[Transition] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Environment(Role):
    """Base class of an environment role: subclasses implement ``start`` and ``act``.

    ``start(task) -> (observation, state)`` begins an episode; ``act(state, action) ->
    Transition`` applies one action to the state (mutating it or not). Both may be ``async``.
    Episodes run concurrently; the steps of one episode run one at a time.

    Attributes:
        deterministic: the same task and actions always give the same observations and rewards,
            so an episode lost with a replica may be rebuilt by replaying its actions.
        keep_done: ended episodes whose transitions are kept to answer a retried last step.
        timeout_is_task: a step past its deadline is the policy's result (shown to it, and
            trained on), not the environment's failure (the episode marked ``infra_failed``
            and never trained on, the default).
    """

    deterministic: ClassVar[bool] = False
    timeout_is_task: ClassVar[bool] = False
    keep_done: ClassVar[int] = 1024

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.episodes: dict[str, _Episode] = {}
        self._done: OrderedDict[str, None] = OrderedDict()

    async def start(self, task: Any) -> tuple[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement start(task)")

    async def act(self, state: Any, action: str) -> Transition:
        raise NotImplementedError(f"{type(self).__name__} must implement act(state, action)")

    @endpoint(Delivery.IDEMPOTENT)
    async def reset(self, request: Reset) -> Observation:
        text, state = await self.start(request.task)
        self.episodes[request.episode_id] = _Episode(state, request.attempt)
        self._done.pop(request.episode_id, None)
        return Observation(
            episode_id=request.episode_id,
            text=text,
            replica=self.ctx.replica,
            incarnation=self.ctx.incarnation,
        )

    @endpoint(Delivery.IDEMPOTENT)
    async def step(self, request: Step) -> Transition:
        episode = self.episodes.get(request.episode_id)
        if episode is None:
            raise EpisodeLost(
                f"{self.ctx.name}.{self.ctx.replica} (incarnation {self.ctx.incarnation}) "
                f"holds no episode {request.episode_id!r}: reset it again"
            )
        async with episode.lock:
            taken = len(episode.transitions)
            if request.turn < taken:  # a retried step: answer what it did
                return episode.transitions[request.turn]
            if request.turn > taken:
                raise EpisodeLost(
                    f"episode {request.episode_id!r} is at turn {taken}, not {request.turn}: "
                    "a step was lost; reset it again"
                )
            transition = await self._act(episode, request)
            episode.transitions.append(transition)
        if transition.done:
            self._end(request.episode_id)
        return transition

    async def _act(self, episode: _Episode, request: Step) -> Transition:
        """``act`` under the step's deadline: past it, the action is cancelled and the turn's
        answer is a timeout (recorded like any other, so a retried step gets it too)."""
        if not request.deadline_s:
            return await self.act(episode.state, request.action)
        try:
            return await asyncio.wait_for(
                self.act(episode.state, request.action), request.deadline_s
            )
        except TimeoutError:
            return Transition(observation="", timed_out=True, task_timeout=self.timeout_is_task)

    @endpoint(Delivery.IDEMPOTENT)
    async def close(self, request: Close) -> None:
        episode = self.episodes.get(request.episode_id)
        if episode is None or request.attempt not in (None, episode.attempt):
            return
        del self.episodes[request.episode_id]
        self._done.pop(request.episode_id, None)

    def _end(self, episode_id: str) -> None:
        self._done[episode_id] = None
        while len(self._done) > self.keep_done:
            old, _ = self._done.popitem(last=False)
            self.episodes.pop(old, None)
