"""GRPO on a reasoning-gym task (``task.py``), from a tiny model built from its config.

The training reward is reasoning-gym's own score, with partial credit (the reward role);
held-out accuracy is checked by a verifier of its own that takes exact answers only. The RL
loop, history, resuming, plots and ``summary.json`` are the built-in ``grpo`` program's
(``asyncrl.rl.grpo``); its steps, batch and group sizes come from ``run.config``, the learning
rate from the learner's config.
"""

import asyncio
from typing import Any

from asyncrl.rl import Context, Evaluation, SamplingParams, grpo
from examples.reasoning_gym import task

DEFAULTS = {"heldout": 200, "eval_every": 50, "max_new_tokens": 4}


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
    out = await grpo(ctx, evaluation=evaluation, params=SamplingParams(**stop))
    return {k: out[k] for k in ("accuracy_final", "learner_steps", "samples_consumed")}
