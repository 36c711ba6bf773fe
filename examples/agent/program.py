"""Behaviour cloning, then GRPO, on a multi-turn guessing game played against an environment
role (``examples.agent.game``).

Each episode is the policy guessing a secret number over up to four turns, the environment
answering each guess; the episode is one training sample whose environment tokens are masked
out of training. BC imitates scripted games that guess anywhere in the interval the answers
leave; GRPO then plays fresh games with rewards from the environment (1 for a win). The
held-out success rate of sampled play is measured after BC and at the end; ``summary.json``
carries ``success_before_rl``, ``success_final`` and ``turns_mean``.
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

from asyncrl.observe.metrics import read_metrics
from asyncrl.rl import (
    Context,
    EpisodeEvaluation,
    EpisodeRunner,
    Prompt,
    PromptFeed,
    RLLoop,
    Run,
    Sample,
    SamplingParams,
    episode_rewards,
    say,
)
from examples.agent import game

DEFAULTS: dict[str, Any] = {
    "demos": 2000,  # scripted games for BC
    "bc_steps": 300,
    "bc_batch": 64,
    "bc_lr": 1e-3,
    "rl_steps": 300,
    "rl_lr": 2e-3,
    "prompts_per_step": 8,
    "group_size": 8,
    "temperature": 1.0,
    "eval_games": 150,  # held-out games, played with the sampling of RL
    "rl_eval_every": 25,
    "step_timeout_s": 10.0,
    "quarantine_window": 20,  # an environment replica failing most of these steps is restarted
    "probe_after_s": 30.0,  # and tried again this long after (doubled each time in a row)
    "seed": 0,
}


async def main(ctx: Context) -> dict[str, Any]:
    cfg = {**DEFAULTS, **ctx.config}
    tok = await asyncio.to_thread(_tokenizer, ctx.model.tokenizer)  # seconds: off the loop
    eos = tok.eos_token_id

    def runner() -> EpisodeRunner:
        return EpisodeRunner(
            ctx.roles["rollout"],
            ctx.roles["env"],
            encode=lambda text: tok.encode(text, add_special_tokens=False),
            decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
            params=SamplingParams(
                temperature=cfg["temperature"], max_new_tokens=2, stop_token_ids=[eos]
            ),
            max_turns=game.MAX_TURNS,
            step_timeout_s=cfg["step_timeout_s"],
            deterministic=game.GuessingGame.deterministic,
            quarantine_window=cfg["quarantine_window"],
            probe_after_s=cfg["probe_after_s"],
        )

    prompt_ids = tok.encode(game.PROMPT, add_special_tokens=False)
    heldout = [
        Prompt(id=f"eval-{i}", token_ids=prompt_ids, text=game.PROMPT, answer=str(secret))
        for i, secret in enumerate(game.games(cfg["eval_games"], seed=-1))
    ]
    evaluating = runner()
    evaluation = EpisodeEvaluation(heldout, evaluating, every=cfg["rl_eval_every"])
    run = await Run.open(ctx, phases=["bc", "rl"], evaluation=evaluation)
    if run.phase == "bc":
        await behaviour_cloning(run, cfg, tok)
    if run.phase == "rl":
        playing = runner()
        await reinforce(run, cfg, playing)
        await playing.aclose()
    await evaluating.aclose()
    before, final = run.values("bc")["accuracy"], run.values("rl")["accuracy"]
    say(f"held-out success: {before:.3f} after BC, {final:.3f} after RL")
    summary = await run.finish(
        success_before_rl=before,
        success_final=final,
        accuracy_final=final,  # what asyncrl chaos compares
        rl_gain=final - before,
        turns_mean=run.values("rl")["turns_mean"],
        eval_turns_mean=evaluation.turns_mean,
    )
    return {k: summary[k] for k in ("success_before_rl", "success_final", "turns_mean")}


def demonstration(i: int, secret: int, tok: Any, rng: random.Random) -> Sample:
    """One scripted game as an episode sample: the guesses are the policy's tokens (trained),
    the answers the environment's (masked), exactly as the episode runner lays them out."""
    eos = tok.eos_token_id
    tokens: list[int] = []
    mask: list[int] = []
    plays = game.scripted(secret, rng)
    for turn, (guess, said) in enumerate(plays):
        action = [*tok.encode(str(guess), add_special_tokens=False), eos]
        tokens += action
        mask += [1] * len(action)
        if turn < len(plays) - 1:  # the last answer ends the game: the runner keeps none
            answer = tok.encode(said, add_special_tokens=False)
            tokens += answer
            mask += [0] * len(answer)
    return Sample(
        prompt_id=f"demo-{i}",
        sample_index=0,
        prompt_ids=tok.encode(f"{game.PROMPT} {game.START}", add_special_tokens=False),
        token_ids=tokens,
        logprobs=[0.0] * len(tokens),
        versions=[0] * len(tokens),
        finished=True,
        stop_reason="stop",
        loss_mask=mask,
    )


async def behaviour_cloning(run: Run, cfg: dict[str, Any], tok: Any) -> None:
    """BC on scripted games for ``bc_steps`` steps; then the held-out success rate."""
    rng = random.Random(cfg["seed"])
    demos = [
        demonstration(i, secret, tok, rng)
        for i, secret in enumerate(game.games(cfg["demos"], cfg["seed"]))
    ]
    while run.steps < cfg["bc_steps"]:
        step = run.steps
        # Each step draws from its own seeded stream, so a resumed run draws what the
        # interrupted one would have (bc_step gives each use of a demonstration its own id).
        draw = random.Random(f"{cfg['seed']}-bc-{step}")
        await run.bc_step(draw.sample(demos, min(cfg["bc_batch"], len(demos))), lr=cfg["bc_lr"])
    success = await run.evaluate_at(run.steps)
    await run.end_phase(accuracy=success)
    say(f"after BC: held-out success {success:.3f} ({run.learner_step} steps)")


async def reinforce(run: Run, cfg: dict[str, Any], runner: EpisodeRunner) -> None:
    """GRPO on fresh games, each sample an episode scored by the environment's rewards."""
    loop = RLLoop(
        algorithm="grpo",
        steps=cfg["rl_steps"],
        prompts_per_step=cfg["prompts_per_step"],
        group_size=cfg["group_size"],
        params=runner.params,
        lr=cfg["rl_lr"],
        source=runner.source,
    )
    out = await run.rl_loop(loop, feed=PromptFeed(run.rl), score=episode_rewards)
    # The pipeline's counters; a driver restarted after the last step has none of its own, and
    # takes them from the last step's record.
    counters = out.get("pipeline") or _last_record(run).get("pipeline", {})
    turns = counters.get("episode_turns", 0) / max(1, counters.get("episodes", 0))
    await run.end_phase(accuracy=await run.evaluate_at(run.steps), turns_mean=turns)


def _last_record(run: Run) -> dict[str, Any]:
    """The last line of the run's ``metrics.jsonl``, or {}."""
    try:
        records = read_metrics(os.path.join(run.rl.run_dir, "metrics.jsonl"))
    except OSError:
        return {}
    return records[-1] if records else {}


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
