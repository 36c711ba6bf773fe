"""GRPO on a reasoning-gym task (``task.py``), from a tiny model built from its config.

The training reward is reasoning-gym's own score, with partial credit; held-out accuracy is
checked by a verifier of its own that takes exact answers only. History, resuming, plots and
``summary.json`` are the framework's (``asyncrl.roles.program.run.Run``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.dispatch.handles import Context
from asyncrl.roles.payloads import SamplingParams
from asyncrl.roles.program.evaluation import Evaluation
from asyncrl.roles.program.loop import PromptFeed, RLLoop, rl_loop
from asyncrl.roles.program.run import Run
from examples.reasoning_gym import task

DEFAULTS: dict[str, Any] = {"steps": 200, "prompts_per_step": 16, "group_size": 8, "lr": 1e-3}
DEFAULTS |= {"heldout": 200, "eval_every": 50, "max_new_tokens": 4, "stop_at": {}}


async def main(ctx: Context) -> dict[str, Any]:
    cfg = {**DEFAULTS, **ctx.config}
    tok = await asyncio.to_thread(task.tokenizer, ctx.model.tokenizer)  # seconds: off the loop
    evaluation = Evaluation(
        task.heldout(tok, cfg["heldout"]),
        max_new_tokens=cfg["max_new_tokens"],
        stop_token_ids=[tok.eos_token_id],
        verifier=task.exact,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        every=cfg["eval_every"],
    )
    run = await Run.open(ctx, phases=["rl"], evaluation=evaluation)
    if run.phase == "rl":
        feed = PromptFeed(run.rl)
        loop = RLLoop(
            algorithm="grpo",
            steps=cfg["steps"],
            prompts_per_step=cfg["prompts_per_step"],
            group_size=cfg["group_size"],
            params=SamplingParams(
                max_new_tokens=cfg["max_new_tokens"], stop_token_ids=[tok.eos_token_id]
            ),
            lr=cfg["lr"],
            stop_at=cfg["stop_at"],
        )
        await rl_loop(run.rl, loop, feed=feed, score=feed.scorer(run.rl.reward), run=run)
        await run.end_phase(accuracy=await run.evaluate_at(run.steps))
    summary = await run.finish(accuracy_final=run.values("rl")["accuracy"])
    return {k: summary[k] for k in ("accuracy_final", "learner_steps", "samples_consumed")}
