"""Programs and a scripted policy role for the adapters' live tests (``asyncrl run`` starts
them as real processes; see test_adapter_textarena.py and test_adapter_verifiers.py).

Text is tokenized one character a token (``tests.agents.test_episodes.encode``), so a policy
or a test reads any context back exactly.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import re
import signal
from typing import Any

from asyncrl.dispatch.handles import Context
from asyncrl.role import Delivery, Role, endpoint
from asyncrl.roles.agents.episodes import EpisodeRunner, Trajectory
from asyncrl.roles.agents.openai_server import OpenAIServer
from asyncrl.roles.payloads import GenerateBatch, Sample, SamplingParams
from tests.agents.test_episodes import decode, encode

HINT = re.compile(r"(\d+)The target number is (higher|lower)\.")
"""A guess of the policy's followed by the game's hint, as they stand in the context."""


def bisect(context: str, lo: int = 1, hi: int = 20) -> int:
    """The next guess of GuessTheNumber from the hints in ``context``."""
    for guess, hint in HINT.findall(context):
        if hint == "higher":
            lo = int(guess) + 1
        else:
            hi = int(guess) - 1
    return (lo + hi) // 2


class Bisector(Role):
    """A scripted policy as a rollout role: answers each context with its bisection guess."""

    @endpoint(Delivery.IDEMPOTENT)
    async def generate(self, batch: GenerateBatch) -> list[Sample]:
        out = []
        for request in batch.requests:
            tokens = encode(str(bisect(decode(request.prompt.token_ids))))
            out.append(
                Sample(
                    prompt_id=request.prompt.id,
                    sample_index=request.sample_index,
                    prompt_ids=request.prompt.token_ids,
                    token_ids=tokens,
                    logprobs=[-0.5] * len(tokens),
                    versions=[7] * len(tokens),
                    finished=True,
                    stop_reason="stop",
                )
            )
        return out


def _segments(traj: Trajectory) -> list[dict[str, Any]]:
    return [
        {"policy": s.policy, "text": decode(s.token_ids), "versions": s.versions}
        for s in traj.segments
    ]


async def textarena_games(ctx: Context) -> list[dict[str, Any]]:
    """Plays GuessTheNumber once per seed of ``run.config.seeds``, all at once."""
    runner = EpisodeRunner(
        ctx.roles["policy"],
        ctx.roles["game"],
        encode=encode,
        decode=decode,
        params=SamplingParams(max_new_tokens=4),
        max_turns=10,
    )
    seeds = ctx.config["seeds"]
    trajs = await asyncio.gather(*(runner.run(f"game-{s}", {"seed": s}, []) for s in seeds))
    return [
        {
            "seed": seed,
            "prompt": decode(t.prompt_ids),
            "segments": _segments(t),
            "reward": t.reward,
            "turn_rewards": t.turn_rewards,
            "done": t.done,
            "restarts": t.restarts,
            "errors": t.errors,
        }
        for seed, t in zip(seeds, trajs, strict=True)
    ]


def distinct_characters(completion: Any, **_: Any) -> float:
    """The rubric's reward: distinct characters the assistant wrote, over 100."""
    written = "".join(m["content"] for m in completion if m["role"] == "assistant")
    return len(set(written)) / 100


def _go_on_env(questions: list[str]) -> Any:
    """A two-turn ``vf.MultiTurnEnv`` over ``questions``: the environment answers each turn
    "go on", the rubric rewards ``distinct_characters``."""
    import verifiers as vf
    from datasets import Dataset, disable_progress_bars

    disable_progress_bars()

    class GoOn(vf.MultiTurnEnv):  # type: ignore[misc]
        async def env_response(self, messages: Any, state: Any, **kw: Any) -> Any:
            return [vf.UserMessage(content="go on")]

    dataset = Dataset.from_list([{"question": q, "answer": ""} for q in questions])
    return GoOn(dataset=dataset, rubric=vf.Rubric(funcs=[distinct_characters]), max_turns=2)


def _import_verifiers() -> Any:
    """The adapter, verifiers' classic environments and datasets, imported (seconds)."""
    importlib.import_module("verifiers.legacy")
    importlib.import_module("datasets")
    return importlib.import_module("asyncrl.roles.agents.adapters.verifiers")


async def verifiers_episodes(ctx: Context) -> list[dict[str, Any]]:
    """Two-turn rollouts of a verifiers environment (one per question), through the endpoint,
    against the rollout group."""
    # In a worker thread, so that the driver's loop keeps its heartbeats; the environment is
    # then built in the main thread, where make_env can put the driver's signal handlers back.
    adapter = await asyncio.to_thread(_import_verifiers)
    before = signal.getsignal(signal.SIGTERM)
    env = adapter.make_env(_go_on_env, ctx.config["questions"])
    kept = signal.getsignal(signal.SIGTERM) is before
    VerifiersRunner = adapter.VerifiersRunner
    server = OpenAIServer(
        ctx.roles["rollout"], context_length=128, encode=encode, decode=decode, max_tokens=6
    )
    async with server, VerifiersRunner(env, server, sampling_args={"temperature": 1.0}) as runner:
        examples = runner.examples()
        episodes = await asyncio.gather(
            *(runner.run(example, f"vf-{i}") for i, example in enumerate(examples))
        )
        left = len(server.episodes)
    with open(os.path.join(ctx.run_dir, "api_key")) as f:
        key_is_the_runs = server.api_key == ctx.api_key == f.read()
    return [
        {
            "prompt": decode(e.trajectory.prompt_ids),
            "segments": _segments(e.trajectory),
            "logprobs": [lp for s in e.trajectory.segments for lp in s.logprobs],
            "reward": e.reward,
            "trajectory_reward": e.trajectory.reward,
            "done": e.trajectory.done,
            "metrics": e.metrics,
            "stop_condition": e.stop_condition,
            "error": e.error,
            "episodes_left": left,
            "signal_handlers_kept": kept,
            "key_is_the_runs": key_is_the_runs,
        }
        for e in episodes
    ]
