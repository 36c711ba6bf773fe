"""``asyncrl bench learning``: time to accuracy on the main job's task, asyncrl async and sync
against a plain PyTorch GRPO loop, side by side in one run.

What a user buys from an asynchronous runtime is a better model sooner. The bench makes one BC
checkpoint (``plain_grpo.behaviour_cloning``: the main job's BC, ``--bc-steps`` steps), then,
for each seed, runs three arms from it, in an order that rotates with the seed:

- **async**: ``asyncrl run`` of the main job's manifest (``examples/arith/bc_grpo.yaml``) as
  shipped (async pipeline, its dynamic sampling and schedule, the learner's write-ahead log, one
  torch thread a role), with the checkpoint as its model and this module's ``program`` (RL
  only) as its program; ``--set``-style changes are the seed (learner, rollout, prompt source)
  and the program;
- **sync**: the same with ``pipeline.mode: sync``;
- **plain**: ``plain_grpo.PlainGRPO`` in a process of its own, torch given every core
  (``--plain-threads``), its threads waiting passively (``OMP_WAIT_POLICY=PASSIVE``).

Every arm takes the same batch (``--prompts-per-step`` x ``--group-size``), evaluates the same
1,000 held-out problems (greedy, exact match) at step 0 and every ``--eval-every`` steps, and
stops at the first evaluation at or above the top threshold, or at ``--max-steps``. The clock
runs from the arm's first RL step to each evaluation, with the evaluations' own time taken out
(asyncrl arms: the time of ``Evaluation.run`` inside ``rl_loop``; an async pipeline keeps
generating while it runs, up to eta versions ahead, which the clock does not see). Per arm and
seed: seconds and steps to each threshold (0.7, 0.9, 0.95), steps/s, samples/s (trained) and
generated samples/s; per arm, the medians over seeds; and
``async_over_plain_to_0_9`` (the plain loop's median seconds to 0.9 over async's) and
``async_over_sync_to_0_9`` (sync's over async's), None when an arm reached 0.9 on no seed.
``--quick`` sizes it for a test: one seed, 10 steps, an evaluation every 5 (a few minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import yaml

from asyncrl.bench.harness import finished_run
from asyncrl.rl import Context, EvalResult, Evaluation, Prompt, RLLoop, RLStep, Run, SamplingParams
from benchmarks import plain_grpo
from examples.arith import data

__all__ = ["ARMS", "PARAMS", "QUICK", "THRESHOLDS", "format_table", "main", "measure", "program"]

THRESHOLDS = (0.7, 0.9, 0.95)
"""Held-out accuracies timed in every arm."""
ARMS = ("plain", "async", "sync")
PARAMS: dict[str, Any] = {
    "seeds": 3,
    "bc_steps": 1400,  # where the main job's BC plateaued (0.433 held-out, seed 0)
    "prompts_per_step": 32,
    "group_size": 8,
    "max_steps": 300,
    "eval_every": 10,
    "plain_threads": os.cpu_count() or 1,
}
QUICK: dict[str, Any] = {"seeds": 1, "max_steps": 10, "eval_every": 5}
RUN_TIMEOUT_S = 3600.0


def _key(threshold: float) -> str:
    return f"{threshold:g}"


def heldout_digest() -> str:
    """A digest of the held-out problems (their ids, in order): the same in every arm."""
    ids = "\n".join(r["id"] for r in data.heldout())
    return hashlib.sha256(ids.encode()).hexdigest()[:16]


# -- the asyncrl arms: the program each run executes ---------------------------------------------


async def program(ctx: Context) -> dict[str, Any]:
    """RL from the run's model (the BC checkpoint) as the main job's RL phase, with held-out
    evaluations at step 0 and every ``eval_every`` steps, each timed on the loop's clock
    without the evaluations' own time; stops at the first at or above ``stop_at``."""
    cfg = ctx.config
    tok = await asyncio.to_thread(_tokenizer, ctx.model.tokenizer)
    rows = data.heldout()
    heldout = [
        Prompt(id=r["id"], token_ids=tok.encode(r["prompt"]), text=r["prompt"], answer=r["answer"])
        for r in rows
    ]
    evaluation = Evaluation(
        heldout,
        max_new_tokens=plain_grpo.MAX_NEW_TOKENS,
        stop_token_ids=[tok.eos_token_id],
        verifier=lambda completion, prompt: completion.strip() == prompt.answer,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        every=int(cfg["eval_every"]),
    )
    run = await Run.open(ctx, phases=["rl"], evaluation=evaluation)
    first = await run.evaluate()  # step 0: the BC checkpoint, on the rollout replica
    points: list[dict[str, Any]] = [
        {"step": 0, "train_s": 0.0, "accuracy": first.accuracy, "count": first.count}
    ]
    clock = {"start": 0.0, "eval_s": 0.0}

    async def timed() -> EvalResult:
        t0 = time.monotonic()
        train_s = t0 - clock["start"] - clock["eval_s"]
        result = await evaluation.run(run.rl)
        clock["eval_s"] += time.monotonic() - t0
        points.append({"train_s": train_s, "accuracy": result.accuracy, "count": result.count})
        return result

    def on_step(step: RLStep) -> None:
        if step.evaluation is not None:
            points[-1]["step"] = step.step

    loop = RLLoop(
        algorithm="grpo",
        steps=int(cfg["max_steps"]),
        prompts_per_step=int(cfg["prompts_per_step"]),
        group_size=int(cfg["group_size"]),
        params=SamplingParams(
            temperature=plain_grpo.TEMPERATURE,
            max_new_tokens=plain_grpo.MAX_NEW_TOKENS,
            stop_token_ids=[tok.eos_token_id],
        ),
        lr=1e-3,
        evaluate=timed,
        eval_every=int(cfg["eval_every"]),
        stop_at={"accuracy": float(cfg["stop_at"])},
    )
    clock["start"] = time.monotonic()
    out = await run.rl_loop(loop, on_step=on_step, display=False)
    train_s = time.monotonic() - clock["start"] - clock["eval_s"]
    return {
        "evaluations": points,
        "steps": out["steps"],
        "train_s": train_s,
        "samples_generated": _generated(out["pipeline"]),
        "stop_reason": out["stop_reason"],
    }


def _generated(pipeline: dict[str, Any]) -> int:
    """Samples the pipeline generated, dropped ones included."""
    return int(pipeline.get("generated_samples", 0))


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def manifest(checkpoint: str, mode: str, seed: int, p: dict[str, Any]) -> dict[str, Any]:
    """The main job's manifest as shipped, starting from ``checkpoint``, running ``program`` in
    pipeline ``mode`` with every seed set to ``seed``."""
    with open(plain_grpo.MANIFEST) as f:
        m: dict[str, Any] = yaml.safe_load(f)
    m["run"] = {
        "name": f"bench-learning-{mode}",
        "program": "benchmarks.learning:program",
        "config": {
            "max_steps": p["max_steps"],
            "prompts_per_step": p["prompts_per_step"],
            "group_size": p["group_size"],
            "eval_every": p["eval_every"],
            "stop_at": THRESHOLDS[-1],
        },
    }
    m["model"] = {"path": checkpoint, "tokenizer": plain_grpo.TOKENIZER}
    m["roles"]["prompts"]["config"]["shuffle_seed"] = seed
    m["roles"]["rollout"]["config"]["seed"] = seed
    m["roles"]["learner"]["config"]["seed"] = seed
    m["pipeline"]["mode"] = mode
    return m


def _asyncrl_arm(checkpoint: str, mode: str, seed: int, p: dict[str, Any]) -> dict[str, Any]:
    run_dir = tempfile.mkdtemp(prefix="arl-bl-")  # short: ipc socket paths live under it
    try:
        t0 = time.perf_counter()
        report = finished_run(
            manifest(checkpoint, mode, seed, p), run_dir, f"bench learning: {mode}", RUN_TIMEOUT_S
        )
        result: dict[str, Any] = report["result"]
        return {**result, "run_wall_s": time.perf_counter() - t0}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


# -- the plain arm ----------------------------------------------------------------------------


def _plain_arm(checkpoint: str, seed: int, p: dict[str, Any]) -> dict[str, Any]:
    """The plain loop from ``checkpoint`` (runs in ``_own_process``)."""
    task = plain_grpo.Arith()
    t0 = time.perf_counter()
    loop = plain_grpo.PlainGRPO(
        checkpoint,
        task,
        seed=seed,
        prompts_per_step=int(p["prompts_per_step"]),
        group_size=int(p["group_size"]),
    )
    count = len(task.heldout_ids)
    first = plain_grpo.greedy_accuracy(loop.model, task)
    points = [{"step": 0, "train_s": 0.0, "accuracy": first, "count": count}]
    train_s, step = 0.0, 0
    while step < int(p["max_steps"]):
        started = time.perf_counter()
        loop.step()
        train_s += time.perf_counter() - started
        step += 1
        if step % int(p["eval_every"]) and step < int(p["max_steps"]):
            continue
        accuracy = plain_grpo.greedy_accuracy(loop.model, task)
        points.append({"step": step, "train_s": train_s, "accuracy": accuracy, "count": count})
        if accuracy >= THRESHOLDS[-1]:
            break
    return {
        "evaluations": points,
        "steps": step,
        "train_s": train_s,
        "samples_generated": loop.generated,
        "run_wall_s": time.perf_counter() - t0,
    }


def _bc(checkpoint: str, p: dict[str, Any]) -> dict[str, Any]:
    """The shared BC checkpoint (runs in ``_own_process``)."""
    return plain_grpo.behaviour_cloning(plain_grpo.Arith(), checkpoint, steps=int(p["bc_steps"]))


def _threads_then(threads: int, fn: Callable[..., Any], *args: Any) -> Any:
    torch.set_num_threads(threads)
    return fn(*args)


def _own_process(fn: Callable[..., dict[str, Any]], p: dict[str, Any], *args: Any) -> Any:
    """``fn(*args, p)`` in a fresh process, as a user's script runs, with torch on
    ``plain_threads`` threads that wait passively (``OMP_WAIT_POLICY=PASSIVE``): on a machine
    others share, spinning threads that wait for a descheduled sibling cost a step several
    times over."""
    saved = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(_threads_then, (int(p["plain_threads"]), fn, *args, p))
    finally:
        if saved is None:
            os.environ.pop("OMP_WAIT_POLICY", None)
        else:
            os.environ["OMP_WAIT_POLICY"] = saved


# -- the figures ------------------------------------------------------------------------------


def _seed_figures(raw: dict[str, Any], samples_per_step: int) -> dict[str, Any]:
    """One arm's run: seconds and steps to each threshold (None: not reached), rates."""
    points = raw["evaluations"]
    seconds_to: dict[str, float | None] = {}
    steps_to: dict[str, int | None] = {}
    for threshold in THRESHOLDS:
        hit = next((pt for pt in points if pt["accuracy"] >= threshold), None)
        seconds_to[_key(threshold)] = None if hit is None else float(hit["train_s"])
        steps_to[_key(threshold)] = None if hit is None else int(hit["step"])
    train_s = max(float(raw["train_s"]), 1e-9)
    return {
        "seconds_to": seconds_to,
        "steps_to": steps_to,
        "steps": raw["steps"],
        "train_s": raw["train_s"],
        "steps_per_s": raw["steps"] / train_s,
        "samples_per_s": raw["steps"] * samples_per_step / train_s,
        "generated_per_s": raw["samples_generated"] / train_s,
        "start_accuracy": points[0]["accuracy"],
        "final_accuracy": points[-1]["accuracy"],
        "heldout_count": points[0]["count"],
        "evaluations": points,
        "run_wall_s": raw["run_wall_s"],
    }


def _median(values: list[float | None]) -> float | None:
    """The median of the values, a seed that never reached the threshold counting as
    infinitely slow; None when half or more never reached it."""
    ranked = sorted(float("inf") if v is None else v for v in values)
    mid = statistics.median(ranked)
    return None if mid == float("inf") else mid


def _arm_figures(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "seconds_to": {
            _key(t): _median([s["seconds_to"][_key(t)] for s in seeds]) for t in THRESHOLDS
        },
        "reached": {
            _key(t): sum(s["seconds_to"][_key(t)] is not None for s in seeds) for t in THRESHOLDS
        },
        "steps_per_s": statistics.median(s["steps_per_s"] for s in seeds),
        "samples_per_s": statistics.median(s["samples_per_s"] for s in seeds),
        "generated_per_s": statistics.median(s["generated_per_s"] for s in seeds),
        "seeds": seeds,
    }


def _ratio(slow: float | None, fast: float | None) -> float | None:
    return None if slow is None or fast is None or fast <= 0 else slow / fast


def measure(p: dict[str, Any]) -> dict[str, Any]:
    """The BC checkpoint, then every arm on every seed (see the module docstring)."""
    t0 = time.perf_counter()
    work = tempfile.mkdtemp(prefix="arl-bl-bc-")
    try:
        checkpoint = os.path.join(work, "bc")
        bc = _own_process(_bc, p, checkpoint)
        per_arm: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
        per_step = int(p["prompts_per_step"]) * int(p["group_size"])
        for seed in range(int(p["seeds"])):
            for k in range(len(ARMS)):
                arm = ARMS[(seed + k) % len(ARMS)]  # the order rotates with the seed
                if arm == "plain":
                    raw = _own_process(_plain_arm, p, checkpoint, seed)
                else:
                    raw = _asyncrl_arm(checkpoint, arm, seed, p)
                per_arm[arm].append({"seed": seed, **_seed_figures(raw, per_step)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    arms = {arm: _arm_figures(seeds) for arm, seeds in per_arm.items()}
    to = _key(0.9)
    return {
        "params": p,
        "thresholds": list(THRESHOLDS),
        "heldout": {"count": len(data.heldout()), "digest": heldout_digest()},
        "bc": bc,
        "arms": arms,
        "async_over_plain_to_0_9": _ratio(
            arms["plain"]["seconds_to"][to], arms["async"]["seconds_to"][to]
        ),
        "async_over_sync_to_0_9": _ratio(
            arms["sync"]["seconds_to"][to], arms["async"]["seconds_to"][to]
        ),
        "load_avg_1m": os.getloadavg()[0],
        "wall_s": time.perf_counter() - t0,
    }


# -- the report --------------------------------------------------------------------------------


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_table(f: dict[str, Any]) -> str:
    """The figures of ``measure`` as a readable table."""
    p = f["params"]
    keys = [_key(t) for t in THRESHOLDS]
    lines = [
        "asyncrl learning benchmark: time to held-out accuracy from one BC checkpoint",
        f"{p['seeds']} seeds, {p['prompts_per_step']} x {p['group_size']} samples a step, at most "
        f"{p['max_steps']} steps, held-out ({f['heldout']['count']} problems) every "
        f"{p['eval_every']} steps;",
        f"BC {f['bc']['steps']} steps, {f['bc']['accuracy']:.3f} held-out; plain loop on "
        f"{p['plain_threads']} torch threads.",
        "Medians over seeds, seconds without evaluation (reached: seeds that reached it).",
        "",
        f"{'arm':<8}"
        + "".join(f"{'s to ' + k:>10}{'reached':>9}" for k in keys)
        + f"{'steps/s':>9}{'samples/s':>11}{'generated/s':>13}",
    ]
    for arm in ARMS:
        a = f["arms"][arm]
        cells = "".join(f"{_s(a['seconds_to'][k]):>10}{a['reached'][k]:>9}" for k in keys)
        lines.append(
            f"{arm:<8}{cells}{a['steps_per_s']:>9.2f}{a['samples_per_s']:>11.1f}"
            f"{a['generated_per_s']:>13.1f}"
        )
    lines += [
        "",
        f"async over plain to 0.9: {_x(f['async_over_plain_to_0_9'])}   (goal >= 1.5)",
        f"async over sync to 0.9:  {_x(f['async_over_sync_to_0_9'])}   (goal >= 1.5)",
        f"{f['wall_s']:.0f} s, load average {f['load_avg_1m']:.1f}",
    ]
    return "\n".join(lines)


def _problems(p: dict[str, Any]) -> list[str]:
    """Every bad parameter of ``p``, each with the option that sets it."""
    bounds = (
        ("seeds", "--seeds", 1),
        ("bc_steps", "--bc-steps", 0),
        ("prompts_per_step", "--prompts-per-step", 1),
        ("group_size", "--group-size", 2),
        ("max_steps", "--max-steps", 1),
        ("eval_every", "--eval-every", 1),
        ("plain_threads", "--plain-threads", 1),
    )
    return [
        f"{opt}: expected an int >= {least}, got {p[key]}"
        for key, opt, least in bounds
        if p[key] < least
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="asyncrl bench learning",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1 seed, 10 steps, an evaluation every 5 (for tests)",
    )
    parser.add_argument("--seeds", type=int, help="seeds 0..N-1 (default 3)")
    parser.add_argument("--bc-steps", type=int, help="BC steps of the checkpoint (default 1400)")
    parser.add_argument("--prompts-per-step", type=int, help="groups a step (default 32)")
    parser.add_argument("--group-size", type=int, help="samples a group (default 8)")
    parser.add_argument("--max-steps", type=int, help="the step cap of each arm (default 300)")
    parser.add_argument("--eval-every", type=int, help="steps between evaluations (default 10)")
    parser.add_argument(
        "--plain-threads", type=int, help="the plain loop's torch threads (default: every core)"
    )
    args = parser.parse_args(argv)
    p = {**PARAMS, **(QUICK if args.quick else {})}
    p.update({k: v for k in PARAMS if (v := getattr(args, k)) is not None})
    problems = _problems(p)
    if problems:
        parser.error("; ".join(problems))
    figures = measure(p)
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
