"""Evaluation by episodes: held-out tasks played to their end by the policy against an
environment role, scored by the environment's rewards.

``EpisodeEvaluation`` is an ``Evaluation`` (``asyncrl.roles.program.evaluation``), so a ``Run``
and ``rl_loop`` take it as they take any: ``accuracy`` is the share of episodes whose reward
reaches ``correct_at`` (the success rate), ``score_mean`` their mean reward, and
``turns_mean`` (an attribute, of the last evaluation) the actions per episode. The episodes run
concurrently through an ``EpisodeRunner`` (``asyncrl.roles.agents.episodes``), each task's
prompt id its episode id, so the rollout's seeds, derived from the stable ids, make an
evaluation of the same weights repeatable. An episode that failed through no fault of the
policy (``Trajectory.infra_failed``: its environment timed out, raised or lost it) is played
again under a fresh id (``<prompt id>~<n>``), up to ``INFRA_TRIES`` times, and never counts as a
failure of the policy.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from asyncrl.errors import AsyncrlError
from asyncrl.roles.agents.episodes import Trajectory
from asyncrl.roles.payloads import Prompt, SamplingParams
from asyncrl.roles.program.clients import RLContext
from asyncrl.roles.program.evaluation import EvalResult, Evaluation

__all__ = ["INFRA_TRIES", "EpisodeEvaluation", "EpisodePlayer"]

INFRA_TRIES = 8
"""The most times one held-out episode is played while its environment keeps failing it."""


class EpisodePlayer(Protocol):
    """What plays the held-out episodes: an ``EpisodeRunner``, or an agent of one's own (one
    that plays through the OpenAI-compatible endpoint, as ``examples/agent_tools``' does)."""

    params: SamplingParams
    """How the policy samples (the evaluation's ``max_new_tokens`` and stop tokens)."""

    def task_of(self, prompt: Prompt) -> Any:
        """A held-out prompt's task."""
        ...

    async def run(self, episode_id: str, task: Any, prompt_ids: list[int]) -> Trajectory:
        """Play one episode to its end; ``infra_failed`` set when the environment failed it."""
        ...


class EpisodeEvaluation(Evaluation):
    """Held-out tasks played as episodes.

    Args:
        tasks: one prompt per episode; ``runner.task_of(prompt)`` is its task (by default its
            ``answer``); its id is the episode's id.
        runner: plays them (an ``EpisodeRunner`` or any ``EpisodePlayer``; its ``params`` are
            the evaluation's sampling: greedy, or sampled, as it says).
        every: steps between evaluations in ``rl_loop`` (0: only after its last step).
        correct_at: the reward from which an episode counts as a success.
        concurrency: episodes in flight at once.

    Raises:
        ValueError: no tasks.
    """

    def __init__(
        self,
        tasks: list[Prompt],
        runner: EpisodePlayer,
        *,
        every: int = 0,
        correct_at: float = 1.0,
        concurrency: int = 64,
    ) -> None:
        super().__init__(
            tasks,
            max_new_tokens=runner.params.max_new_tokens,
            stop_token_ids=runner.params.stop_token_ids,
            every=every,
            correct_at=correct_at,
        )
        self.runner = runner
        self.concurrency = concurrency
        self.turns_mean = float("nan")

    async def run(self, rl: RLContext) -> EvalResult:
        """Play every task once with the weights the rollout replicas hold now."""
        room = asyncio.Semaphore(self.concurrency)

        async def play(prompt: Prompt) -> Trajectory:
            async with room:
                task = self.runner.task_of(prompt)
                for n in range(INFRA_TRIES):
                    episode_id = f"{prompt.id}~{n}" if n else prompt.id
                    traj = await self.runner.run(episode_id, task, prompt.token_ids)
                    if not traj.infra_failed:
                        return traj
                raise AsyncrlError(
                    f"held-out episode {prompt.id!r}: its environment failed it {INFRA_TRIES} "
                    f"times (the last: {traj.infra_failed}); is every environment replica "
                    "failing? See the environment's log"
                )

        async with asyncio.TaskGroup() as group:  # one failure cancels the others
            tasks = [group.create_task(play(p)) for p in self.prompts]
        played = [t.result() for t in tasks]
        rewards = [t.reward for t in played]
        self.turns_mean = sum(t.turns for t in played) / len(played)
        versions = {v for t in played for s in t.segments if s.policy for v in s.versions}
        return EvalResult(
            accuracy=sum(r >= self.correct_at for r in rewards) / len(rewards),
            score_mean=sum(rewards) / len(rewards),
            count=len(rewards),
            versions=sorted(versions),
        )
