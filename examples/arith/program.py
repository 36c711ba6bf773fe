"""Behaviour cloning, then GRPO (or PPO), on fixed-width addition: the README's main job.

Read it top to bottom; it uses only the handles of the runtime:

1. BC on a small, fixed set of demonstrations, until held-out accuracy stops improving (the
   plateau: limited by the demonstrations);
2. GRPO from that checkpoint on fresh prompts, with the BC coefficient at 0 (pure RL: limited
   only by the verifier), through the sample pipeline in the manifest's mode (``sync`` by
   default; ``--set pipeline.mode=async`` overlaps generation with training);
3. held-out greedy accuracy at the plateau and at the end, a plot, ``summary.json``,
   ``heldout.jsonl`` and the final policy in Hugging Face format in ``final/``.

A restarted driver resumes where the learner's last acknowledged step left it (the phase and the
pipeline's position travel with each step), and ``history.jsonl`` grows as the run goes, so
nothing is trained or measured twice.

Settings come from the manifest's ``run.config`` (``ctx.config``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from typing import Any

from asyncrl.roles.payloads import (
    GenerateBatch,
    GenerateRequest,
    Prompt,
    Sample,
    SamplingParams,
    Scored,
    StepResult,
    TrainBatch,
)
from asyncrl.roles.pipeline import SamplePipeline, WeightSync
from asyncrl.roles.programs import PromptFeed, learn, resend
from asyncrl.roles.reward import ScoreRequest
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
    plot = _plotting_available()  # checked now: a missing package must not fail the end
    # Off the event loop: importing transformers takes seconds, and a driver whose loop is
    # blocked that long misses its heartbeats and is restarted as hung.
    tok = await asyncio.to_thread(_tokenizer, cfg["tokenizer"])
    eos = tok.eos_token_id

    # Resume, never replay: the learner keeps the program's position with every step it
    # acknowledges, and history.jsonl holds what was measured so far.
    status = await ctx.learner.call("status", None)
    keep = status["keep"]
    history = _History(os.path.join(ctx.run_dir, "history.jsonl"), fresh=status["step"] == 0)
    started = time.monotonic() - history.wall_s
    if status["step"]:
        _progress(f"resuming at learner step {status['step']} ({keep.get('phase', 'bc')} phase)")

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

    async def sync_weights() -> None:
        # The learner publishes every version in shared memory; each replica reads the newest,
        # asked again while the learner restarts, so an evaluation never runs on old weights.
        version = (await ctx.learner.call("status", None))["version"]
        await WeightSync(ctx.rollout, wait=True, timeout=300).ensure(version)

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
    step = status["step"]
    if keep.get("phase", "bc") == "bc":
        while True:
            stale = _since_best([h["accuracy"] for h in history.phase("bc")])
            evaluated = any(h["step"] == step for h in history.phase("bc"))
            if step and step % cfg["bc_eval_every"] == 0 and not evaluated:
                acc = await accuracy()
                history.add(
                    {"phase": "bc", "step": step, "accuracy": acc, "wall_s": _since(started)}
                )
                _progress(f"BC step {step}: held-out accuracy {acc:.3f}")
                continue
            if stale >= cfg["bc_patience"] or step >= cfg["bc_max_steps"]:
                break
            # Each step's demonstrations are drawn from its own seeded stream, so a resumed
            # run draws what the interrupted one would have.
            rng = random.Random(f"{cfg['seed']}-bc-{step}")
            batch = rng.sample(demos, min(cfg["bc_batch"], len(demos)))
            # BC samples are re-used every epoch: give each use its own id for the ledger.
            uses = [Scored(_reuse(d, step)) for d in batch]
            bc = TrainBatch(
                uses, algorithm="bc", lr=cfg["bc_lr"], keep={"phase": "bc"}, id=f"bc-{step + 1}"
            )
            result = await resend(ctx.learner, "train_step", bc, StepResult)
            step = result.step
        accuracy_before_rl = await accuracy()
        keep = {"phase": "rl", "bc_steps": step, "accuracy_before_rl": accuracy_before_rl}
        keep.update(rl_started_wall=_since(started), cursor=0)
        await resend(ctx.learner, "checkpoint", keep, str)
        _progress(f"BC plateau: held-out accuracy {accuracy_before_rl:.3f} after {step} steps")
    accuracy_before_rl = keep["accuracy_before_rl"]
    bc_steps = keep["bc_steps"]

    # 2. RL (GRPO, or PPO with a critic) on fresh prompts, BC coefficient 0, through the
    #    sample pipeline: sync or async mode, as the manifest's pipeline section says.
    algorithm = cfg["algorithm"]
    status = await ctx.learner.call("status", None)
    done = status["step"] - bc_steps  # RL steps the learner has taken
    if "reference" in ctx.roles:  # the KL term is measured against the BC policy
        from asyncrl.roles.rollout import WeightsUpdate  # tensors: torch only when needed

        start = await ctx.learner.call("weights", None, WeightsUpdate, timeout=120)
        await ctx.reference.broadcast("set_weights", start, timeout=120)
    await sync_weights()
    history.recover_rl_step(done, status["last"])
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
        **status.get("advantages", {}),  # computed as the learner computes them
        start_version=status["version"],
        resume=status["keep"].get("resume"),
        watchdog=ctx.watchdog,
    )
    weights = WeightSync(ctx.rollout, wait=spec.mode == "sync")
    accs = [h["accuracy"] for h in history.phase("rl") if "accuracy" in h]
    acc = accs[-1] if accs else accuracy_before_rl
    async with pipe:
        if done and done % cfg["rl_eval_every"] == 0 and "accuracy" not in history.last("rl"):
            acc = await accuracy()  # the interrupted run had not measured it yet
            history.amend_last("rl", accuracy=acc)
        for rl_step in range(done + 1, cfg["rl_steps"] + 1):
            batch = await pipe.next_batch()
            result = await learn(
                ctx, batch, algorithm=algorithm, lr=cfg["rl_lr"], id=f"rl-{rl_step}"
            )
            # Sync mode: every replica holds the new weights before the next batch is admitted.
            await weights.push(version=result.version)
            pipe.advance(result.version)
            reward_mean = sum(s.reward for s in batch.samples) / len(batch.samples)
            entry: dict[str, Any] = {
                "phase": "rl",
                "step": rl_step,
                "reward": reward_mean,
                "wall_s": _since(started),
                "staleness_max": batch.metrics["staleness_max"],
            }
            if rl_step % cfg["rl_eval_every"] == 0 or rl_step == cfg["rl_steps"]:
                acc = await accuracy()
                entry["accuracy"] = acc
            history.add(entry)
            _bar(algorithm.upper(), rl_step, cfg["rl_steps"], reward_mean, acc)
        await weights.close()
        pipeline_metrics = {**pipe.metrics, "in_flight_at_end": pipe.in_flight}

    last = history.last("rl")
    accuracy_final = last["accuracy"] if "accuracy" in last else await accuracy()
    final_dir = await ctx.learner.call("export", os.path.join(ctx.run_dir, "final"))
    status = await ctx.learner.call("status", None)
    rl_wall = max(1e-9, _since(started) - float(keep.get("rl_started_wall", 0.0)))
    rl = history.phase("rl")
    summary = {
        "accuracy_before_rl": accuracy_before_rl,
        "accuracy_final": accuracy_final,
        "rl_gain": accuracy_final - accuracy_before_rl,
        "wall_s": _since(started),
        "learner_steps": status["step"],
        "samples_consumed": pipeline_metrics.get("consumed_samples", 0),
        "samples_per_s": pipeline_metrics.get("consumed_samples", 0) / rl_wall,
        "restarts": _restarts(ctx.run_dir),
        "driver_incarnation": ctx.incarnation,
        "mode": ctx.pipeline.mode,
        "staleness_max": max((h.get("staleness_max", 0) for h in rl), default=0),
        "pipeline": pipeline_metrics,
        "final": final_dir,
        "config": cfg,
    }
    with open(os.path.join(ctx.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if plot:
        _plot(history.entries, os.path.join(ctx.run_dir, "progress.png"))
    _progress(
        f"held-out accuracy: {accuracy_before_rl:.3f} at the BC plateau, "
        f"{accuracy_final:.3f} after {algorithm.upper()}"
    )
    return {k: summary[k] for k in ("accuracy_before_rl", "accuracy_final", "learner_steps")}


class _History:
    """``history.jsonl``, appended as the run goes, so a resumed program has what came before.

    Args:
        path: the file.
        fresh: a new run (the learner has taken no step): start the file afresh.
    """

    def __init__(self, path: str, *, fresh: bool) -> None:
        self.path = path
        self.entries: list[dict[str, Any]] = []
        if fresh:
            open(path, "w").close()
        elif os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        self.entries.append(json.loads(line))
                    except ValueError:
                        pass  # a line cut short by a crash
            self._rewrite()

    @property
    def wall_s(self) -> float:
        return float(self.entries[-1]["wall_s"]) if self.entries else 0.0

    def phase(self, phase: str) -> list[dict[str, Any]]:
        return [h for h in self.entries if h["phase"] == phase]

    def last(self, phase: str) -> dict[str, Any]:
        entries = self.phase(phase)
        return entries[-1] if entries else {}

    def add(self, entry: dict[str, Any]) -> None:
        self.entries.append(entry)
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def amend_last(self, phase: str, **values: Any) -> None:
        self.last(phase).update(values)
        self._rewrite()

    def recover_rl_step(self, done: int, last: dict[str, Any]) -> None:
        """The driver may have died after the learner's step ``done`` and before its entry was
        written: write it from the learner's record of its last step."""
        if done and self.last("rl").get("step", 0) < done:
            metrics = last.get("result", {}).get("metrics", {})
            self.add(
                {
                    "phase": "rl",
                    "step": done,
                    "reward": metrics.get("reward_mean", float("nan")),
                    "wall_s": self.wall_s,
                    "staleness_max": metrics.get("staleness_max", 0),
                }
            )

    def _rewrite(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(h) + "\n" for h in self.entries)
        os.replace(tmp, self.path)


def _since_best(accuracies: list[float]) -> int:
    """Evaluations since the held-out accuracy last improved on the best by 0.01."""
    best, stale = -1.0, 0
    for acc in accuracies:
        if acc > best + 0.01:
            best, stale = acc, 0
        else:
            stale += 1
    return stale


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _since(started: float) -> float:
    return time.monotonic() - started


def _plotting_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "matplotlib is not installed, so progress.png will not be written; install it "
            "with: pip install 'asyncrl[examples]'",
            file=sys.stderr,
            flush=True,
        )
        return False
    return True


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
