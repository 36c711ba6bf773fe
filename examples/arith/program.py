"""Behaviour cloning, then GRPO (or PPO), on fixed-width addition: the README's main job.

BC on a small, fixed set of demonstrations until held-out accuracy stops improving (the plateau),
then GRPO on fresh prompts with the BC coefficient at 0; held-out greedy accuracy, checked by
exact match, at the plateau and at the end. Phases, history, resuming, plots, ``summary.json``
and the exported policy are the framework's (``asyncrl.rl.Run``).
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

from asyncrl.rl import Context, Evaluation, Prompt, RLLoop, Run, Sample, SamplingParams, say
from examples.arith import data

DEFAULTS: dict[str, Any] = {
    "demos": 200,  # demonstrations for BC: few enough that the plateau stays low
    "bc_batch": 50,
    "bc_lr": 0.0,  # BC's rate; 0: the learner's (with dropout, 3e-3 left seeds at chance)
    "bc_eval_every": 100,  # BC steps between held-out evaluations
    "bc_patience": 3,  # evaluations without improvement that end BC ...
    "bc_min_steps": 800,  # ... but not before this: with dropout, BC may start slowly
    "bc_max_steps": 1500,
    "rl_steps": 300,
    "rl_lr": 0.0,  # RL's rate; 0: the learner's
    "prompts_per_step": 32,
    "group_size": 8,
    "temperature": 1.0,
    "rl_eval_every": 100,
    "rl_budget_s": 0.0,  # a wall budget for RL in seconds; 0: none
    "stop_at": {},  # e.g. {accuracy: 0.99}: end RL at the first evaluation that reaches it
}
# The algorithm (grpo, rloo, or ppo with a critic role), the learning rate and the seed are the
# learner's (roles.learner.config): set there, they are set in one place.


async def main(ctx: Context) -> dict[str, Any]:
    cfg = {**DEFAULTS, **ctx.config}
    tok = await asyncio.to_thread(_tokenizer, ctx.model.tokenizer)  # seconds: off the loop
    rows = data.heldout()
    data.write_jsonl(os.path.join(ctx.run_dir, "heldout.jsonl"), rows)
    heldout = [
        Prompt(id=r["id"], token_ids=tok.encode(r["prompt"]), text=r["prompt"], answer=r["answer"])
        for r in rows
    ]
    evaluation = Evaluation(
        heldout,
        max_new_tokens=5,
        stop_token_ids=[tok.eos_token_id],
        verifier=lambda completion, prompt: completion.strip() == prompt.answer,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        every=cfg["rl_eval_every"],
    )
    run = await Run.open(ctx, phases=["bc", "rl"], evaluation=evaluation)
    if run.phase == "bc":
        await behaviour_cloning(run, cfg, tok)
    if run.phase == "rl":
        await reinforce(run, cfg, tok.eos_token_id)
    before, final = run.values("bc")["accuracy"], run.values("rl")["accuracy"]
    say(f"held-out accuracy: {before:.3f} at the BC plateau, {final:.3f} after RL")
    summary = await run.finish(
        accuracy_before_rl=before, accuracy_final=final, rl_gain=final - before
    )
    return {k: summary[k] for k in ("accuracy_before_rl", "accuracy_final", "learner_steps")}


async def behaviour_cloning(run: Run, cfg: dict[str, Any], tok: Any) -> None:
    """BC on a small, fixed set of demonstrations until held-out accuracy stops improving."""
    demos = [
        Sample(
            prompt_id=r["id"],
            sample_index=0,
            prompt_ids=tok.encode(r["prompt"]),
            token_ids=[*tok.encode(r["answer"], add_special_tokens=False), tok.eos_token_id],
            logprobs=[],
            versions=[],
            finished=True,
            stop_reason="stop",
        )
        for r in data.demonstrations(cfg["demos"])
    ]
    while True:
        step = run.steps
        if step and step % cfg["bc_eval_every"] == 0:
            say(f"BC step {step}: held-out accuracy {await run.evaluate_at(step):.3f}")
        stale = _since_best(run.history.values("bc", "accuracy"))
        plateau = stale >= cfg["bc_patience"] and step >= cfg["bc_min_steps"]
        if plateau or step >= cfg["bc_max_steps"]:
            break
        # Each step draws from its own seeded stream, so a resumed run draws what the
        # interrupted one would have (bc_step gives each use of a demonstration its own id).
        rng = random.Random(f"{run.rl.settings.seed}-bc-{step}")
        await run.bc_step(rng.sample(demos, min(cfg["bc_batch"], len(demos))), lr=cfg["bc_lr"])
    accuracy = await run.evaluate_at(run.steps)
    await run.end_phase(accuracy=accuracy)
    say(f"BC plateau: held-out accuracy {accuracy:.3f} after {run.learner_step} steps")


async def reinforce(run: Run, cfg: dict[str, Any], eos: int) -> None:
    """The learner's algorithm (GRPO, RLOO, or PPO with a critic) on fresh prompts, with the BC
    coefficient at 0."""
    loop = RLLoop(
        steps=cfg["rl_steps"],
        prompts_per_step=cfg["prompts_per_step"],
        group_size=cfg["group_size"],
        params=SamplingParams(
            temperature=cfg["temperature"], max_new_tokens=5, stop_token_ids=[eos]
        ),
        lr=cfg["rl_lr"],
        budget_s=cfg["rl_budget_s"],
        stop_at=cfg["stop_at"],
    )
    await run.rl_loop(loop)
    await run.end_phase(accuracy=await run.evaluate_at(run.steps))  # the last step's


def _since_best(accuracies: list[float]) -> int:
    """Evaluations since the held-out accuracy last improved on the best by 0.01."""
    best, stale = -1.0, 0
    for acc in accuracies:
        best, stale = (acc, 0) if acc > best + 0.01 else (best, stale + 1)
    return stale


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
