"""Behaviour cloning, then GRPO (or PPO), on fixed-width addition: the README's main job.

Read it top to bottom; it uses only the handles of the runtime:

1. BC on a small, fixed set of demonstrations, until held-out accuracy stops improving (the
   plateau: limited by the demonstrations);
2. GRPO from that checkpoint on fresh prompts, with the BC coefficient at 0 (pure RL: limited
   only by the verifier), through the sample pipeline in the manifest's mode (``sync`` by
   default; ``--set pipeline.mode=async`` overlaps generation with training);
3. held-out greedy accuracy at the plateau and at the end, a plot, ``summary.json``,
   ``heldout.jsonl`` and the final policy in Hugging Face format in ``final/``.

Settings come from the manifest's ``run.config`` (``ctx.config``).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

from asyncrl.roles.learner import Scored, TrainBatch
from asyncrl.roles.pipeline import SamplePipeline, WeightSync
from asyncrl.roles.programs import PromptFeed, learn
from asyncrl.roles.reward import ScoreRequest
from asyncrl.roles.rollout import (
    GenerateBatch,
    GenerateRequest,
    Prompt,
    Sample,
    SamplingParams,
    WeightsUpdate,
)
from examples.arith import data

DEFAULTS: dict[str, Any] = {
    "tokenizer": "examples/arith/tokenizer",
    "demos": 200,  # demonstrations for BC: few enough that the plateau stays low
    "bc_batch": 50,
    "bc_lr": 3e-3,
    "bc_eval_every": 100,  # BC steps between held-out evaluations
    "bc_patience": 3,  # evaluations without improvement that end BC
    "bc_max_steps": 1500,
    "algorithm": "grpo",  # or "ppo" (needs a critic role)
    "rl_steps": 1500,
    "rl_lr": 1e-3,
    "prompts_per_step": 32,
    "group_size": 8,
    "temperature": 1.0,
    "rl_eval_every": 100,
    "seed": 0,
}


async def main(ctx: Any) -> dict[str, Any]:
    cfg = {**DEFAULTS, **ctx.config}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg["tokenizer"])
    eos = tok.eos_token_id
    started = time.monotonic()
    rng = random.Random(cfg["seed"])
    history: list[dict[str, Any]] = []

    heldout = data.heldout()
    data.write_jsonl(os.path.join(ctx.run_dir, "heldout.jsonl"), heldout)
    heldout_prompts = [
        Prompt(r["id"], tok.encode(r["prompt"]), r["prompt"], r["answer"]) for r in heldout
    ]
    by_id = {p.id: p.answer for p in heldout_prompts}
    demos = [
        Sample(
            r["id"],
            0,
            tok.encode(r["prompt"]),
            [*tok.encode(r["answer"]), eos],
            [],
            [],
            True,
            "stop",
        )
        for r in data.demonstrations(cfg["demos"])
    ]

    async def sync_weights() -> int:
        # The learner publishes every version in shared memory; each replica reads the newest.
        versions = await ctx.rollout.broadcast("sync", None, int, timeout=120)
        return min(versions)

    async def accuracy() -> float:
        await sync_weights()
        greedy = SamplingParams(greedy=True, max_new_tokens=5, stop_token_ids=[eos])
        requests = [GenerateRequest(p, 0, greedy) for p in heldout_prompts]
        correct = 0
        chunks = _chunks(requests, 250)
        async for _, samples in ctx.rollout.map("generate", chunks, list[Sample], timeout=600):
            texts = [tok.decode(s.token_ids, skip_special_tokens=True) for s in samples]
            answers = [by_id[s.prompt_id] for s in samples]
            scores = await ctx.reward.call("score", ScoreRequest(texts, answers), list[float])
            correct += int(sum(scores))
        return correct / len(heldout_prompts)

    # 1. Behaviour cloning until the held-out accuracy plateaus.
    best, stale, step = -1.0, 0, 0
    while stale < cfg["bc_patience"] and step < cfg["bc_max_steps"]:
        for _ in range(cfg["bc_eval_every"]):
            batch = rng.sample(demos, min(cfg["bc_batch"], len(demos)))
            # BC samples are re-used every epoch: give each use its own id for the ledger.
            uses = [Scored(_reuse(d, step)) for d in batch]
            bc = TrainBatch(uses, algorithm="bc", lr=cfg["bc_lr"])
            await ctx.learner.call("train_step", bc, timeout=300)
            step += 1
        acc = await accuracy()
        history.append(
            {"phase": "bc", "step": step, "accuracy": acc, "wall_s": time.monotonic() - started}
        )
        _progress(f"BC step {step}: held-out accuracy {acc:.3f}")
        if acc > best + 0.01:
            best, stale = acc, 0
        else:
            stale += 1
    accuracy_before_rl = await accuracy()
    await ctx.learner.call("checkpoint", {"phase": "bc", "cursor": 0})
    _progress(f"BC plateau: held-out accuracy {accuracy_before_rl:.3f} after {step} steps")

    # 2. RL (GRPO, or PPO with a critic) on fresh prompts, BC coefficient 0, through the
    #    sample pipeline: sync or async mode, as the manifest's pipeline section says.
    algorithm = cfg["algorithm"]
    if "reference" in ctx.roles:  # the KL term is measured against the BC policy
        start = await ctx.learner.call("weights", None, WeightsUpdate, timeout=120)
        await ctx.reference.broadcast("set_weights", start, timeout=120)
    status = await ctx.learner.call("status", None)
    await sync_weights()
    feed = PromptFeed(ctx.prompts)

    async def score(samples: list[Sample]) -> list[float]:
        texts = [tok.decode(s.token_ids, skip_special_tokens=True) for s in samples]
        request = ScoreRequest(texts, [feed.answers[s.prompt_id] for s in samples])
        return await ctx.reward.call("score", request, list[float])  # type: ignore[no-any-return]

    spec = ctx.pipeline
    params = SamplingParams(temperature=cfg["temperature"], max_new_tokens=5, stop_token_ids=[eos])
    pipe = SamplePipeline(
        ctx.rollout,
        spec=spec,
        feed=feed,
        score=score,
        params=params,
        batch_size=cfg["prompts_per_step"] * cfg["group_size"],
        group_size=cfg["group_size"],
        start_version=status["version"],
    )
    weights = WeightSync(ctx.rollout, wait=spec.mode == "sync")
    rl_started = time.monotonic()
    samples_consumed = 0
    acc = accuracy_before_rl
    staleness_max = 0.0
    async with pipe:
        for rl_step in range(1, cfg["rl_steps"] + 1):
            batch = await pipe.next_batch()
            result = await learn(ctx, batch, algorithm=algorithm, lr=cfg["rl_lr"])
            # Sync mode: every replica holds the new weights before the next batch is admitted.
            await weights.push()
            pipe.advance(result.version)
            samples_consumed += result.consumed
            staleness_max = max(staleness_max, batch.metrics["staleness_max"])
            reward_mean = sum(s.reward for s in batch.samples) / len(batch.samples)
            entry: dict[str, Any] = {
                "phase": "rl",
                "step": rl_step,
                "reward": reward_mean,
                "wall_s": time.monotonic() - started,
                "staleness_max": batch.metrics["staleness_max"],
            }
            if rl_step % cfg["rl_eval_every"] == 0 or rl_step == cfg["rl_steps"]:
                acc = await accuracy()
                entry["accuracy"] = acc
            history.append(entry)
            _bar(algorithm.upper(), rl_step, cfg["rl_steps"], reward_mean, acc)
    await weights.close()
    pipeline_metrics = dict(pipe.metrics)

    accuracy_final = acc if history[-1].get("accuracy") is not None else await accuracy()
    final_dir = await ctx.learner.call("export", os.path.join(ctx.run_dir, "final"))
    status = await ctx.learner.call("status", None)
    summary = {
        "accuracy_before_rl": accuracy_before_rl,
        "accuracy_final": accuracy_final,
        "rl_gain": accuracy_final - accuracy_before_rl,
        "wall_s": time.monotonic() - started,
        "learner_steps": status["step"],
        "samples_consumed": samples_consumed,
        "samples_per_s": samples_consumed / max(1e-9, time.monotonic() - rl_started),
        "restarts": _restarts(ctx.run_dir),
        "mode": ctx.pipeline.mode,
        "staleness_max": staleness_max,
        "pipeline": pipeline_metrics,
        "final": final_dir,
        "config": cfg,
    }
    with open(os.path.join(ctx.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(ctx.run_dir, "history.jsonl"), "w") as f:
        f.writelines(json.dumps(h) + "\n" for h in history)
    _plot(history, os.path.join(ctx.run_dir, "progress.png"))
    _progress(
        f"held-out accuracy: {accuracy_before_rl:.3f} at the BC plateau, "
        f"{accuracy_final:.3f} after {algorithm.upper()}"
    )
    return {k: summary[k] for k in ("accuracy_before_rl", "accuracy_final", "learner_steps")}


def _chunks(items: list[Any], size: int) -> list[GenerateBatch]:
    return [GenerateBatch(items[i : i + size]) for i in range(0, len(items), size)]


def _reuse(demo: Sample, step: int) -> Sample:
    return Sample(
        f"{demo.prompt_id}#bc{step}", 0, demo.prompt_ids, demo.token_ids, [], [], True, "stop"
    )


def _restarts(run_dir: str) -> int:
    """Restarts so far, counted from the supervisor's log (the program runs under it)."""
    path = os.path.join(run_dir, "logs", "agent.jsonl")
    try:
        with open(path) as f:
            return sum(1 for line in f if '"event": "restarting"' in line)
    except OSError:
        return 0


def _progress(text: str) -> None:
    print(f"\r{text}".ljust(80), flush=True)


def _bar(name: str, step: int, total: int, reward: float, accuracy: float) -> None:
    width = 30
    done = int(width * step / total)
    sys.stdout.write(
        f"\r{name} [{'#' * done}{'.' * (width - done)}] {step}/{total} "
        f"reward {reward:.3f} held-out {accuracy:.3f}"
    )
    sys.stdout.flush()
    if step == total:
        sys.stdout.write("\n")


def _plot(history: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bc = [h for h in history if h["phase"] == "bc"]
    rl = [h for h in history if h["phase"] == "rl"]
    offset = bc[-1]["step"] if bc else 0
    ax.plot([h["step"] for h in bc], [h["accuracy"] for h in bc], "o-", label="BC held-out acc.")
    ax.plot(
        [offset + h["step"] for h in rl],
        [h["reward"] for h in rl],
        "-",
        alpha=0.6,
        label="RL reward",
    )
    acc = [h for h in rl if "accuracy" in h]
    ax.plot(
        [offset + h["step"] for h in acc],
        [h["accuracy"] for h in acc],
        "s-",
        label="RL held-out acc.",
    )
    ax.axvline(offset, color="grey", linestyle=":")
    ax.set_xlabel("learner step")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
