"""Behaviour cloning, then GRPO, of a policy that calls a tool through the OpenAI-compatible
endpoint: the agent (``examples.agent_tools.agent``) is a plain tool loop on the official
``openai`` client, and the calculator (``examples.agent_tools.calculator``) is an environment
role.

The policy is asked ``17 + 25`` with an ``add`` tool on offer; it can call the tool (Qwen's
``<tool_call>`` format, which the endpoint parses into the reply's ``tool_calls``) and answer
from its result, or answer at once. The scripted demonstrations call the tool in half the games
and guess a number in the others, so after BC the policy calls it about half the time; GRPO,
rewarded by the calculator for a right answer, then learns to call it. The held-out success
rate of sampled play is measured after BC and at the end; ``summary.json`` carries
``success_before_rl``, ``success_final`` and ``tool_calls_mean`` (the tool calls of an episode
the environment did not fail, over the RL phase).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any

import openai

from asyncrl.rl import (
    Context,
    EpisodeEvaluation,
    Prompt,
    PromptFeed,
    RLLoop,
    Run,
    Sample,
    episode_rewards,
    say,
)
from asyncrl.roles.agents.environment_client import EnvironmentClient
from asyncrl.roles.agents.openai_server import OpenAIServer
from asyncrl.roles.payloads import GenerateBatch
from examples.agent_tools import calculator
from examples.agent_tools.agent import CalculatorAgent, play

DEFAULTS: dict[str, Any] = {
    "demos": 1000,  # scripted games for BC
    "demo_tool_share": 0.5,  # of the demonstrations, those that call the tool
    "bc_steps": 300,
    "bc_batch": 64,
    "bc_lr": 3e-3,
    "rl_steps": 100,
    "rl_lr": 2e-3,
    "prompts_per_step": 8,
    "group_size": 8,
    "temperature": 1.0,
    "eval_games": 100,  # held-out games, played with the sampling of RL
    "rl_eval_every": 20,
    "step_timeout_s": 5.0,
    "context_length": 96,
    "seed": 0,
}


async def main(ctx: Context) -> dict[str, Any]:
    cfg = {**DEFAULTS, **ctx.config}
    tok = await asyncio.to_thread(_tokenizer, ctx.model.tokenizer)  # seconds: off the loop
    env = EnvironmentClient(ctx.roles["env"], step_timeout_s=cfg["step_timeout_s"])
    async with OpenAIServer(
        ctx.roles["rollout"], tokenizer=tok, context_length=cfg["context_length"]
    ) as server:
        client = openai.AsyncOpenAI(base_url=server.url, api_key=server.api_key)
        agent = CalculatorAgent(server, client, env, temperature=cfg["temperature"])
        heldout = [
            Prompt(id=f"eval-{i}", token_ids=[], text=calculator.question(x, y), answer=f"{x} {y}")
            for i, (x, y) in enumerate(calculator.tasks(cfg["eval_games"], seed=-1))
        ]
        evaluation = EpisodeEvaluation(heldout, agent, every=cfg["rl_eval_every"])
        run = await Run.open(ctx, phases=["bc", "rl"], evaluation=evaluation)
        if run.phase == "bc":
            await behaviour_cloning(run, cfg, await demonstrations(tok, cfg))
        if run.phase == "rl":
            await reinforce(run, cfg, agent)
        await client.close()
        await env.aclose()
    before, final = run.values("bc")["accuracy"], run.values("rl")["accuracy"]
    say(f"held-out success: {before:.3f} after BC, {final:.3f} after RL")
    summary = await run.finish(
        success_before_rl=before,
        success_final=final,
        accuracy_final=final,  # what asyncrl chaos compares
        rl_gain=final - before,
        tool_calls_mean=run.values("rl")["tool_calls_mean"],
    )
    return {k: summary[k] for k in ("success_before_rl", "success_final", "tool_calls_mean")}


class ScriptedPolicy:
    """Stands in for the rollout group while the demonstrations are played: it reads the
    context the endpoint rendered and writes what a scripted player would. With a tool result
    in the context it answers the number after ``=``; otherwise it calls ``add`` on the
    question's numbers, or (in ``1 - tool_share`` of the episodes, drawn per episode) guesses
    a number."""

    def __init__(self, tok: Any, tool_share: float, seed: int) -> None:
        self.tok, self.tool_share, self.seed = tok, tool_share, seed

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        assert method == "generate" and isinstance(payload, GenerateBatch)
        (request,) = payload.requests
        context = self.tok.decode(request.prompt.token_ids)
        episode = request.prompt.id.rsplit("/", 1)[0]
        rng = random.Random(f"{self.seed}/{episode}")
        if result := re.findall(r"= (\d+)", context):
            text = result[-1]
        elif rng.random() < self.tool_share:
            x, y = re.findall(r"(\d+) \+ (\d+)", context)[-1]
            call = {"name": "add", "arguments": {"x": int(x), "y": int(y)}}
            text = f"<tool_call> {json.dumps(call)} </tool_call>"
        else:
            text = str(rng.randint(0, 2 * calculator.HIGH))
        tokens = [*self.tok.encode(text, add_special_tokens=False), self.tok.eos_token_id]
        return [
            Sample(
                prompt_id=request.prompt.id,
                sample_index=0,
                prompt_ids=request.prompt.token_ids,
                token_ids=tokens,
                logprobs=[0.0] * len(tokens),
                versions=[0] * len(tokens),
                finished=True,
                stop_reason="stop",
            )
        ]


class LocalCalculator:
    """The calculator's rules in this process, behind the environment handle's ``call``, for
    playing the demonstrations without the environment role."""

    name, replicas = "env", 1

    def __init__(self) -> None:
        from asyncrl.role import RoleContext

        self.env = calculator.Calculator(RoleContext.local(name="env"))

    async def call(self, method: str, payload: Any, reply_type: Any = Any, **kw: Any) -> Any:
        return await getattr(self.env, method)(payload)


async def demonstrations(tok: Any, cfg: dict[str, Any]) -> list[Sample]:
    """The scripted games, each played by the agent's own loop through an endpoint in front of
    ``ScriptedPolicy``: so a demonstration is, token for token, the trajectory the endpoint
    records when the policy plays the same way."""
    scripted = ScriptedPolicy(tok, cfg["demo_tool_share"], cfg["seed"])
    env = EnvironmentClient(LocalCalculator())
    room = asyncio.Semaphore(16)
    async with OpenAIServer(scripted, tokenizer=tok, context_length=cfg["context_length"]) as srv:
        client = openai.AsyncOpenAI(base_url=srv.url, api_key=srv.api_key)

        async def demo(i: int, x: int, y: int) -> Sample:
            async with room:
                episode = await env.reset(f"demo-{i}", f"{x} {y}")
                reward, _ = await play(client, env, episode, episode.episode_id)
                traj = srv.trajectory(episode.episode_id, reward=reward)
                srv.close(episode.episode_id)
                return traj.sample(f"demo-{i}", 0)

        tasks = calculator.tasks(cfg["demos"], cfg["seed"])
        demos = await asyncio.gather(*(demo(i, x, y) for i, (x, y) in enumerate(tasks)))
        await client.close()
    return list(demos)


async def behaviour_cloning(run: Run, cfg: dict[str, Any], demos: list[Sample]) -> None:
    """BC on the scripted games for ``bc_steps`` steps; then the held-out success rate."""
    while run.steps < cfg["bc_steps"]:
        # Each step draws from its own seeded stream, so a resumed run draws what the
        # interrupted one would have.
        draw = random.Random(f"{cfg['seed']}-bc-{run.steps}")
        await run.bc_step(draw.sample(demos, min(cfg["bc_batch"], len(demos))), lr=cfg["bc_lr"])
    success = await run.evaluate_at(run.steps)
    await run.end_phase(accuracy=success)
    say(f"after BC: held-out success {success:.3f} ({run.learner_step} steps)")


async def reinforce(run: Run, cfg: dict[str, Any], agent: CalculatorAgent) -> None:
    """GRPO on fresh tasks, each sample an episode the agent played through the endpoint,
    scored by the calculator's reward."""
    loop = RLLoop(
        algorithm="grpo",
        steps=cfg["rl_steps"],
        prompts_per_step=cfg["prompts_per_step"],
        group_size=cfg["group_size"],
        params=agent.params,
        lr=cfg["rl_lr"],
        source=agent.source,
    )
    out = await run.rl_loop(loop, feed=PromptFeed(run.rl), score=episode_rewards)
    counters = out.get("pipeline", {})
    played = counters.get("episodes", 0) - counters.get("infra_failed", 0)
    await run.end_phase(
        accuracy=await run.evaluate_at(run.steps),
        tool_calls_mean=counters.get("tool_calls", 0) / max(1, played),
    )


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
