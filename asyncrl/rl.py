"""What an RL program uses, in one place: ``from asyncrl.rl import Run, RLLoop, ...``.

A program is an async function of the run's ``Context``. ``Run`` carries its phases, history,
evaluation and summary across restarts; ``Run.rl_loop(RLLoop(...))`` runs RL with prompts and
rewards from the run's roles; ``Run.bc_step(samples)`` is a behaviour-cloning step; the built-in
programs (``grpo``, ``rloo``, ``ppo``) are one RL phase of a ``Run``, which a program may call
with an evaluation of its own (``await grpo(ctx, evaluation=...)``)::

    from asyncrl.rl import Context, Evaluation, RLLoop, Run, SamplingParams

    async def main(ctx: Context) -> dict:
        run = await Run.open(ctx, phases=["rl"], evaluation=Evaluation(...))
        if run.phase == "rl":
            params = SamplingParams(max_new_tokens=4)
            await run.rl_loop(RLLoop(steps=200, prompts_per_step=16, group_size=8, params=params))
            await run.end_phase(accuracy=await run.evaluate_at(run.steps))
        return await run.finish(accuracy_final=run.values("rl")["accuracy"])

The names live in the roles' program part (``asyncrl.roles.program``), their payloads
(``asyncrl.roles.payloads``) and the runtime; this module gathers them and defines none.
"""

from __future__ import annotations

from asyncrl.dispatch.handles import Context
from asyncrl.observe.progress import say
from asyncrl.roles.agents.episodes import EpisodeRunner, episode_rewards
from asyncrl.roles.payloads import Prompt, Sample, SamplingParams, Scored, StepResult, TrainBatch
from asyncrl.roles.program.clients import RLContext
from asyncrl.roles.program.episode_evaluation import EpisodeEvaluation
from asyncrl.roles.program.evaluation import EvalResult, Evaluation
from asyncrl.roles.program.programs import grpo, ppo, rloo
from asyncrl.roles.program.rl_loop import PromptFeed, RLLoop, RLStep, Stop, rl_loop
from asyncrl.roles.program.run import Run

__all__ = [
    "Context",
    "EpisodeEvaluation",
    "EpisodeRunner",
    "EvalResult",
    "Evaluation",
    "Prompt",
    "PromptFeed",
    "RLContext",
    "RLLoop",
    "RLStep",
    "Run",
    "Sample",
    "SamplingParams",
    "Scored",
    "StepResult",
    "Stop",
    "TrainBatch",
    "episode_rewards",
    "grpo",
    "ppo",
    "rl_loop",
    "rloo",
    "say",
]
