"""GRPO on a reasoning-gym task (``task.py``), from a tiny model built from its config.

The training reward is reasoning-gym's own score, with partial credit (the reward role);
held-out accuracy is checked by a verifier of its own that takes exact answers only. History,
resuming, plots and ``summary.json`` are the framework's (``asyncrl.rl.Run``).
"""

import asyncio
from typing import Any

from asyncrl.rl import Context, Evaluation, RLLoop, Run, SamplingParams
from examples.reasoning_gym import task

DEFAULTS = {"steps": 200, "prompts_per_step": 16, "group_size": 8, "lr": 1e-3, "stop_at": {}}
DEFAULTS |= {"heldout": 200, "eval_every": 50, "max_new_tokens": 4}


async def main(ctx: Context) -> dict[str, Any]:
    cfg = {**DEFAULTS, **ctx.config}
    tok = await asyncio.to_thread(task.tokenizer, ctx.model.tokenizer)  # seconds: off the loop
    stop = {"max_new_tokens": cfg["max_new_tokens"], "stop_token_ids": [tok.eos_token_id]}
    evaluation = Evaluation(
        task.heldout(tok, cfg["heldout"]),
        verifier=task.exact,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        every=cfg["eval_every"],
        **stop,
    )
    run = await Run.open(ctx, phases=["rl"], evaluation=evaluation)
    if run.phase == "rl":
        loop = {k: cfg[k] for k in ("steps", "prompts_per_step", "group_size", "lr", "stop_at")}
        await run.rl_loop(RLLoop(algorithm="grpo", **loop, params=SamplingParams(**stop)))
        await run.end_phase(accuracy=await run.evaluate_at(run.steps))
    summary = await run.finish(accuracy_final=run.values("rl")["accuracy"])
    return {k: summary[k] for k in ("accuracy_final", "learner_steps", "samples_consumed")}
