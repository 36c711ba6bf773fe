"""The agent of the tool-calling example, written against the official ``openai`` client: it
offers the policy the calculator's ``add`` tool, runs the calls the policy makes on the
calculator environment, and hands the policy's answer to the environment for its reward.

Nothing in ``play`` knows it is training: it is an ordinary chat-completions tool loop, pointed
at asyncrl's OpenAI-compatible endpoint, with the episode's id as the request's ``user``. The
endpoint records what the policy generated, token for token; ``CalculatorAgent.run`` turns
that into the episode's trajectory with the environment's reward, and ``source`` makes it the
sample pipeline's sample. An episode the environment failed (a step past its deadline, an error,
a lost replica) comes back flagged ``infra_failed`` and is never trained on.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from typing import Any

import openai

from asyncrl.roles.agents.environment_client import EnvEpisode, EnvironmentClient, EnvironmentFailed
from asyncrl.roles.agents.episodes import Trajectory, count
from asyncrl.roles.agents.openai_server import OpenAIServer
from asyncrl.roles.payloads import Prompt, Sample, SamplingParams
from examples.agent_tools.calculator import ADD_TOOL

MAX_TURNS = 3
"""The most replies of the policy in one episode (calls, then the answer)."""


async def play(
    client: Any, env: EnvironmentClient, episode: EnvEpisode, conversation: str, **sampling: Any
) -> tuple[float, int]:
    """One episode of the tool loop: the question to the policy; each ``add`` call it makes to
    the calculator, whose result goes back as the tool's message; its first reply without a
    call is its answer. Every request names the ``conversation`` (``user``), so the endpoint
    records it as one episode. The reward the environment gives the answer (0 when the policy
    does not answer within ``MAX_TURNS`` replies, or before the conversation outgrows the
    model's context), and the calls made."""
    messages: list[Any] = [{"role": "user", "content": episode.observation}]
    for calls in range(MAX_TURNS):
        try:
            reply = await client.chat.completions.create(
                model="policy",
                messages=messages,
                tools=[ADD_TOOL],
                user=conversation,
                **sampling,
            )
        except openai.BadRequestError as exc:
            if exc.code != "context_length_exceeded":
                raise
            return 0.0, calls  # the policy's calls filled the context: its result, as out of turns
        message = reply.choices[0].message
        if not message.tool_calls:
            said = await env.step(episode, f"answer {message.content or ''}")
            return said.reward, calls
        call = message.tool_calls[0]
        args = json.loads(call.function.arguments)
        said = await env.step(episode, f"{call.function.name} {args.get('x')} {args.get('y')}")
        result = {"role": "tool", "tool_call_id": call.id, "content": said.observation}
        messages += [message, result]
    return 0.0, MAX_TURNS


class CalculatorAgent:
    """Plays calculator episodes through the endpoint, as the pipeline's sample source and as
    ``EpisodeEvaluation``'s player (``run``, ``task_of``, ``params``).

    Args:
        server: the endpoint in front of the rollout group.
        client: an ``openai.AsyncOpenAI`` pointed at it.
        env: the calculator environment.
        temperature: the policy's sampling temperature.
        max_tokens: the most tokens of one reply.
    """

    def __init__(
        self,
        server: OpenAIServer,
        client: Any,
        env: EnvironmentClient,
        *,
        temperature: float = 1.0,
        max_tokens: int = 12,
    ) -> None:
        self.server = server
        self.client = client
        self.env = env
        self.sampling = {"temperature": temperature, "max_tokens": max_tokens}
        self._plays = itertools.count()
        self.params = SamplingParams(
            temperature=temperature,
            max_new_tokens=max_tokens,
            stop_token_ids=list(server.stop_token_ids),
        )

    def task_of(self, prompt: Prompt) -> Any:
        return prompt.answer

    async def run(self, episode_id: str, task: Any, prompt_ids: list[int]) -> Trajectory:
        """Play one episode; its trajectory as the endpoint recorded it, with the environment's
        reward, or flagged ``infra_failed`` when the environment failed it."""
        traj, _ = await self.play(episode_id, task, prompt_ids)
        return traj

    async def play(
        self, episode_id: str, task: Any, prompt_ids: list[int]
    ) -> tuple[Trajectory, int]:
        """``run``, with the tool calls the policy made.

        The endpoint's conversation id is the episode's id with ``#<n>`` added, a fresh one
        each play: a held-out task is played under the same episode id at every evaluation,
        and the endpoint refuses a conversation id it has forgotten."""
        conversation = f"{episode_id}#{next(self._plays)}"
        episode: EnvEpisode | None = None
        try:
            episode = await self.env.reset(episode_id, task)
            reward, calls = await play(
                self.client, self.env, episode, conversation, **self.sampling
            )
            traj = self.server.trajectory(conversation, reward=reward, done=episode.done)
            traj.episode_id = episode_id
            return traj, calls
        except EnvironmentFailed as exc:
            failed = Trajectory(
                episode_id=episode_id,
                prompt_ids=prompt_ids,
                timeouts=episode.timeouts if episode else 0,
                errors=episode.errors if episode else int(exc.cause == "error"),
                infra_failed=exc.cause,
            )
            return failed, 0
        finally:
            if episode is not None:
                self.env.close(episode)
            if conversation in self.server.episodes:
                self.server.close(conversation)

    async def source(self, prompt: Prompt, index: int, metrics: Counter[str]) -> Sample:
        """The sample pipeline's source: sample ``index`` of ``prompt`` is the episode
        ``<prompt id>/<index>`` (``~<n>`` after the environment failed it ``n`` times)."""
        name = f"{prompt.id}/{index}"
        episode_id = self.env.episode_id(name)
        traj, calls = await self.play(episode_id, self.task_of(prompt), prompt.token_ids)
        if traj.infra_failed:
            self.env.failed(name)
        count(metrics, traj)
        metrics["tool_calls"] += calls
        self.env.count(metrics)
        return traj.sample(prompt.id, index)
