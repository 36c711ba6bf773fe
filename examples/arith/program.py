"""Behaviour cloning, then GRPO (or PPO), on fixed-width addition: the README's main job.

Read it top to bottom; it uses only the handles of the runtime:

1. BC on a small, fixed set of demonstrations, until held-out accuracy stops improving (the
   plateau: limited by the demonstrations);
2. GRPO from that checkpoint on fresh prompts, with the BC coefficient at 0 (pure RL: limited
   only by the verifier), through the sample pipeline in the manifest's mode (``async`` in
   ``bc_grpo.yaml``; ``--set pipeline.mode=sync`` waits for each step's weights), with the
   manifest's dynamic sampling;
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

from asyncrl.dispatch.handles import Context
from asyncrl.observe.metrics import Restarts
from asyncrl.observe.progress import say
from asyncrl.roles.payloads import LearnerStatus, Prompt, Sample, SamplingParams, Scored, TrainBatch
from asyncrl.roles.program.clients import RLContext
from asyncrl.roles.program.evaluation import greedy_accuracy
from asyncrl.roles.program.programs import PromptFeed, RLLoop, RLStep, rl_loop, weight_sync
from examples.arith import data

DEFAULTS: dict[str, Any] = {
    "tokenizer": "examples/arith/tokenizer",
    "demos": 200,  # demonstrations for BC: few enough that the plateau stays low
    "bc_batch": 50,
    "bc_lr": 1e-3,  # with dropout in BC, 3e-3 left some seeds at chance for 800 steps
    "bc_eval_every": 100,  # BC steps between held-out evaluations
    "bc_patience": 3,  # evaluations without improvement that end BC ...
    "bc_min_steps": 800,  # ... but not before this: with dropout, BC may start slowly
    "bc_max_steps": 1500,
    "algorithm": "grpo",  # or "rloo", or "ppo" (needs a critic role)
    "rl_steps": 300,
    "rl_lr": 1e-3,
    "prompts_per_step": 32,
    "group_size": 8,
    "temperature": 1.0,
    "rl_eval_every": 100,
    "seed": 0,
}


async def main(ctx: Context) -> dict[str, Any]:
    run = await Run.start(RLContext.of(ctx), {**DEFAULTS, **ctx.config})
    if run.phase == "bc":
        await behaviour_cloning(run)
    await reinforce(run)
    return await report(run)


class Run:
    """What the three phases share: the roles, the settings, the tokenizer, the held-out set,
    the history so far and where the learner is."""

    def __init__(
        self, rl: RLContext, cfg: dict[str, Any], tok: Any, status: LearnerStatus, plot: bool
    ) -> None:
        self.rl, self.cfg, self.tok, self.plot = rl, cfg, tok, plot
        self.keep = status.keep
        self.eos = int(tok.eos_token_id)
        # A new run (the learner has taken no step) starts the history afresh; a resumed one
        # goes on from the wall time it had reached.
        self.history = _History(os.path.join(rl.run_dir, "history.jsonl"), fresh=status.step == 0)
        self.started = time.monotonic() - self.history.wall_s
        rows = data.heldout()
        data.write_jsonl(os.path.join(rl.run_dir, "heldout.jsonl"), rows)
        self.heldout = [
            Prompt(
                id=r["id"], token_ids=tok.encode(r["prompt"]), text=r["prompt"], answer=r["answer"]
            )
            for r in rows
        ]
        self.pipeline: dict[str, Any] = {}  # the sample pipeline's metrics, once RL ran

    @classmethod
    async def start(cls, rl: RLContext, cfg: dict[str, Any]) -> Run:
        # Checked now (a missing package must not fail the end), and off the event loop like
        # every slow step here: a driver whose loop is blocked for seconds misses heartbeats.
        plot = await asyncio.to_thread(_plotting_available)
        # Off the event loop: importing transformers takes seconds, and a driver whose loop is
        # blocked that long misses its heartbeats and is restarted as hung.
        tok = await asyncio.to_thread(_tokenizer, cfg["tokenizer"])
        # Resume, never replay: the learner keeps the program's position with every step it
        # acknowledges, and history.jsonl holds what was measured so far.
        status = await rl.learner.status()
        run = cls(rl, cfg, tok, status, plot)
        if status.step:
            say(f"resuming at learner step {status.step} ({run.phase} phase)")
        return run

    @property
    def phase(self) -> str:
        return str(self.keep.get("phase", "bc"))

    def wall(self) -> float:
        return time.monotonic() - self.started

    async def accuracy(self) -> float:
        """Held-out greedy accuracy of the weights the learner holds now."""
        status = await self.rl.learner.status()
        await weight_sync(self.rl, wait=True, timeout=300).ensure(status.version)
        return await self.greedy()

    async def greedy(self) -> float:
        """Held-out greedy accuracy of the weights the rollout replicas hold."""
        return await greedy_accuracy(
            self.rl,
            self.heldout,
            max_new_tokens=5,
            stop_token_ids=[self.eos],
            decode=lambda ids: self.tok.decode(ids, skip_special_tokens=True),
        )


async def behaviour_cloning(run: Run) -> None:
    """BC on a small, fixed set of demonstrations until held-out accuracy stops improving."""
    cfg, tok, history = run.cfg, run.tok, run.history
    demos = [
        Sample(
            prompt_id=r["id"],
            sample_index=0,
            prompt_ids=tok.encode(r["prompt"]),
            token_ids=[*tok.encode(r["answer"], add_special_tokens=False), run.eos],
            logprobs=[],
            versions=[],
            finished=True,
            stop_reason="stop",
        )
        for r in data.demonstrations(cfg["demos"])
    ]
    step = (await run.rl.learner.status()).step
    while True:
        stale = _since_best([h["accuracy"] for h in history.phase("bc")])
        evaluated = any(h["step"] == step for h in history.phase("bc"))
        if step and step % cfg["bc_eval_every"] == 0 and not evaluated:
            acc = await run.accuracy()
            history.add({"phase": "bc", "step": step, "accuracy": acc, "wall_s": run.wall()})
            say(f"BC step {step}: held-out accuracy {acc:.3f}")
            continue
        plateau = stale >= cfg["bc_patience"] and step >= cfg["bc_min_steps"]
        if plateau or step >= cfg["bc_max_steps"]:
            break
        # Each step's demonstrations are drawn from its own seeded stream, so a resumed run
        # draws what the interrupted one would have.
        rng = random.Random(f"{cfg['seed']}-bc-{step}")
        batch = rng.sample(demos, min(cfg["bc_batch"], len(demos)))
        # BC samples are re-used every epoch: give each use its own id for the ledger.
        uses = [Scored(sample=_reuse(d, step)) for d in batch]
        bc = TrainBatch(
            samples=uses, algorithm="bc", lr=cfg["bc_lr"], keep={"phase": "bc"}, id=f"bc-{step + 1}"
        )
        step = (await run.rl.learner.train_step(bc)).step
    accuracy = await run.accuracy()
    run.keep = {"phase": "rl", "bc_steps": step, "accuracy_before_rl": accuracy, "cursor": 0}
    run.keep["rl_started_wall"] = run.wall()
    await run.rl.learner.checkpoint(run.keep)
    say(f"BC plateau: held-out accuracy {accuracy:.3f} after {step} steps")


async def reinforce(run: Run) -> None:
    """GRPO (or RLOO, or PPO with a critic) from the BC checkpoint on fresh prompts, through
    the sample pipeline in the manifest's mode, with the BC coefficient at 0."""
    cfg, rl, history = run.cfg, run.rl, run.history
    status = await rl.learner.status()
    done = status.step - int(run.keep["bc_steps"])  # RL steps the learner has taken
    history.recover_rl_step(done, status.last)
    if done and done % cfg["rl_eval_every"] == 0 and "accuracy" not in history.last("rl"):
        history.amend_last("rl", accuracy=await run.accuracy())  # not measured before the crash
    feed = PromptFeed(rl)

    async def score(samples: list[Sample]) -> list[float]:
        texts = [run.tok.decode(s.token_ids, skip_special_tokens=True) for s in samples]
        return await rl.reward.score(texts, [feed.answers[s.prompt_id] for s in samples])

    def on_step(step: RLStep) -> None:
        entry: dict[str, Any] = {
            "phase": "rl",
            "step": step.step,
            "reward": step.reward,
            "wall_s": run.wall(),
            "staleness_max": step.batch.metrics["staleness_max"],
        }
        if step.evaluation is not None:
            entry["accuracy"] = step.evaluation
        history.add(entry)

    loop = RLLoop(
        algorithm=cfg["algorithm"],
        steps=cfg["rl_steps"],
        prompts_per_step=cfg["prompts_per_step"],
        group_size=cfg["group_size"],
        params=SamplingParams(
            temperature=cfg["temperature"], max_new_tokens=5, stop_token_ids=[run.eos]
        ),
        lr=cfg["rl_lr"],
        id_prefix="rl-",
        evaluate=run.greedy,  # rl_loop syncs the replicas to the step's weights first
        eval_every=cfg["rl_eval_every"],
    )
    run.pipeline = (await rl_loop(rl, loop, feed=feed, score=score, done=done, on_step=on_step))[
        "pipeline"
    ]


async def report(run: Run) -> dict[str, Any]:
    """Held-out accuracy before and after RL, ``summary.json``, the plot, the final policy."""
    rl, history, keep = run.rl, run.history, run.keep
    last = history.last("rl")
    accuracy_final = last["accuracy"] if "accuracy" in last else await run.accuracy()
    final_dir = await rl.learner.export("final")  # RUN_DIR/exports/final
    status = await rl.learner.status()
    rl_wall = max(1e-9, run.wall() - float(keep.get("rl_started_wall", 0.0)))
    consumed = run.pipeline.get("consumed_samples", 0)
    summary = {
        "accuracy_before_rl": keep["accuracy_before_rl"],
        "accuracy_final": accuracy_final,
        "rl_gain": accuracy_final - keep["accuracy_before_rl"],
        "wall_s": run.wall(),
        "learner_steps": status.step,
        "samples_consumed": consumed,
        "samples_per_s": consumed / rl_wall,
        "restarts": Restarts(rl.run_dir)(),
        "driver_incarnation": rl.incarnation,
        "mode": rl.pipeline.mode,
        "staleness_max": max((h.get("staleness_max", 0) for h in history.phase("rl")), default=0),
        "pipeline": run.pipeline,
        "final": final_dir,
        "config": run.cfg,
    }
    with open(os.path.join(rl.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if run.plot:
        await asyncio.to_thread(_plot, history.entries, os.path.join(rl.run_dir, "progress.png"))
    say(
        f"held-out accuracy: {summary['accuracy_before_rl']:.3f} at the BC plateau, "
        f"{accuracy_final:.3f} after {run.cfg['algorithm'].upper()}"
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


def _reuse(demo: Sample, step: int) -> Sample:
    return Sample(
        prompt_id=f"{demo.prompt_id}#bc{step}",
        sample_index=0,
        prompt_ids=demo.prompt_ids,
        token_ids=demo.token_ids,
        logprobs=[],
        versions=[],
        finished=True,
        stop_reason="stop",
    )


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
    # Every RL step's metrics, drawn as `asyncrl plot RUN_DIR` draws them, in RUN_DIR/plots/.
    from asyncrl.observe.plots import plot_runs

    try:
        plot_runs([os.path.dirname(path)])
    except (OSError, ValueError) as exc:  # no RL step was taken
        print(f"no plots of the RL steps: {exc}", file=sys.stderr, flush=True)
