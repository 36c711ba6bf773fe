"""``asyncrl bench sharding``: a sharded learner's memory per rank against one unsharded rank.

One learner (``asyncrl.roles.training.learner.Learner``, in-process in each rank's own process)
trains a Qwen2-architecture model built from a config (``MODEL``: about 302M parameters,
grouped-query attention, tied embeddings) for ``--steps`` GRPO steps on a fixed batch:

- as one rank holding the whole model, its gradients and AdamW's moments (the baseline);
- as 2 (and, with ``--ranks 1,2,4``, 4) ranks with ``parallel: fsdp``, gloo on the CPU.

The groups run one after the other, in this run. Each rank reports its peak resident set
(``VmHWM``: everything the process ever held at once, the model's build included) and the
median step time; every group's figures come with their ratio to the one rank's. After the
steps, the sharded group's rank 0 gathers the whole model and compares it with the one rank's
(``parity_max_abs_diff``: float32, so rounding of sums in another order shows).

``--json`` prints ``{"model", "params", "ranks": [{"ranks", "peak_mib_per_rank", "step_s",
"peak_ratio", "step_ratio"}, ...], "parity_max_abs_diff", "moved_max_abs"}``; the last is how
far the steps moved the one rank's weights from their start, what the parity is read against.
The goal: at 2 ranks, the peak per rank at most 0.6x one rank's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from asyncrl.bench.engines import QWEN2_300M

__all__ = ["MODEL", "main", "measure"]

MODEL: dict[str, Any] = QWEN2_300M.config
"""A Qwen2 of about 303M parameters (Qwen2.5-0.5B's shape, narrower and with a smaller
vocabulary), built from this config: no download. The rollout benchmark's, so both measure the
same model."""


def _peak_mib() -> float:
    """This process's peak resident set (VmHWM), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _batch(step: int, vocab: int, prompts: int, group: int, length: int) -> Any:
    """Step ``step``'s GRPO batch of ``prompts`` x ``group`` samples of ``length`` prompt and
    completion tokens, with varied rewards (sample ids of its own: the learner's ledger skips
    a sample it consumed)."""
    import random

    from asyncrl.roles.payloads import Sample, Scored, TrainBatch

    rng = random.Random(step)
    samples = []
    for p in range(prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        for k in range(group):
            tokens = [rng.randrange(3, vocab) for _ in range(length)]
            sample = Sample(
                prompt_id=f"s{step}p{p}",
                sample_index=k,
                prompt_ids=prompt,
                token_ids=tokens,
                logprobs=[-2.0] * length,
                versions=[0] * length,
                finished=True,
                stop_reason="stop",
            )
            samples.append(Scored(sample=sample, reward=float(k % 2)))
    return TrainBatch(samples=samples, algorithm="grpo", id=f"bench-{step}")


async def _rank_main(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    from asyncrl.role import RoleContext
    from asyncrl.roles.training.learner import Learner, build_model
    from asyncrl.roles.training.sharding import full_buckets

    torch.set_num_threads(args["threads"])
    ranks, rank = args["ranks"], args["rank"]
    config = {
        "model_config": MODEL,
        "seed": 0,
        "lr": 1e-5,
        "durable": False,
        "publish_weights": False,
        "micro_batch_tokens": 1 << 20,
        "dist_timeout_s": 600.0,
        "parallel": "fsdp" if ranks > 1 else "replicate",
    }
    ctx = RoleContext.local(
        config=config, name="learner", replica=rank, replicas=ranks, run_dir=args["run_dir"]
    )
    learner = Learner(ctx)
    await learner.setup()
    params = sum(int(p.numel()) for p in learner.template.values()) - (
        MODEL["vocab_size"] * MODEL["hidden_size"] if MODEL["tie_word_embeddings"] else 0
    )
    times = []
    # Replica 0 takes the calls and runs each on every rank (the group's lockstep); the others
    # run them with it until it closes, and report its times.
    for step in range(args["steps"]) if rank == 0 else []:
        # The first step includes AdamW's allocation of its state.
        batch = _batch(step, MODEL["vocab_size"], 2, 4, 8)
        start = time.perf_counter()
        await learner.train_step(batch)
        times.append(time.perf_counter() - start)
    if learner.lockstep is not None:
        await learner.ctx.offload(learner.lockstep.close, learner.config.dist_timeout_s)
    peak = _peak_mib()  # before any comparison adds to it
    diff = moved = None
    if ranks == 1:
        torch.save(learner.trainer.model.state_dict(), args["reference"])
        # How far the steps moved the weights: what a parity of 0 is to be read against.
        start = build_model("", MODEL, 0).state_dict()
        trained = learner.trainer.model.state_dict()
        moved = max(float((trained[k] - start[k]).abs().max()) for k in start)
    elif os.path.exists(args["reference"]):
        reference = torch.load(args["reference"], mmap=True, weights_only=True)
        diff = 0.0
        for bucket in full_buckets(learner.trainer.model, 256 << 20):
            for name, t in bucket.items():
                if rank == 0:
                    diff = max(diff, float((t - reference[name]).abs().max()))
    await learner.teardown()
    return {
        "peak_mib": peak,
        "step_s": statistics.median(times) if times else 0.0,  # replica 0's times
        "params": params,
        "diff": diff,
        "moved": moved,
    }


def _group(ranks: int, steps: int, folder: str) -> list[dict[str, Any]]:
    """Run one group of ``ranks`` processes; each rank's report."""
    threads = max(1, (os.cpu_count() or 1) // ranks)
    run_dir = os.path.join(folder, f"run{ranks}")
    procs = []
    for rank in range(ranks):
        args = {
            "rank": rank,
            "ranks": ranks,
            "steps": steps,
            "threads": threads,
            "run_dir": run_dir,
            "reference": os.path.join(folder, "one.pt"),
            "out": os.path.join(folder, f"r{ranks}.{rank}.json"),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.sharding", "--worker", json.dumps(args)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    errors = [p.communicate()[1] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(
            f"bench sharding: a rank of the group of {ranks} failed:\n"
            + "\n".join(e[-2000:] for e in errors)
        )
    reports = []
    for rank in range(ranks):
        with open(os.path.join(folder, f"r{ranks}.{rank}.json")) as f:
            reports.append(json.load(f))
    return reports


def measure(steps: int = 3, ranks: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    """The figures of the module docstring, for groups of ``ranks`` (1 is always measured
    first: it is the baseline)."""
    groups = sorted({1, *ranks})
    rows: list[dict[str, Any]] = []
    parity = moved = None
    params = 0
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-sharding-") as folder:
        for n in groups:
            reports = _group(n, steps, folder)
            params = reports[0]["params"]
            rows.append(
                {
                    "ranks": n,
                    "peak_mib_per_rank": max(r["peak_mib"] for r in reports),
                    "step_s": max(r["step_s"] for r in reports),
                }
            )
            if n == 1:
                moved = reports[0].get("moved")
            diffs = [r["diff"] for r in reports if r["diff"] is not None]
            if diffs:
                parity = max(parity or 0.0, *diffs)
    for row in rows:
        row["peak_ratio"] = row["peak_mib_per_rank"] / rows[0]["peak_mib_per_rank"]
        row["step_ratio"] = row["step_s"] / rows[0]["step_s"]
    return {
        "model": "qwen2",
        "params": params,
        "ranks": rows,
        "parity_max_abs_diff": parity,
        "moved_max_abs": moved,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl bench sharding", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per group")
    parser.add_argument("--ranks", default="1,2", help="group sizes, e.g. 1,2,4")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker = json.loads(args.worker)
        report = asyncio.run(_rank_main(worker))
        with open(worker["out"], "w") as f:
            json.dump(report, f)
        return 0
    result = measure(args.steps, tuple(int(r) for r in args.ranks.split(",")))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"sharded learner, {result['model']} of {result['params'] / 1e6:.0f}M parameters")
    print(f"{'ranks':>5} {'peak MiB/rank':>14} {'x one rank':>10} {'step s':>8} {'x one rank':>10}")
    for row in result["ranks"]:
        print(
            f"{row['ranks']:>5} {row['peak_mib_per_rank']:>14.0f} {row['peak_ratio']:>10.2f} "
            f"{row['step_s']:>8.2f} {row['step_ratio']:>10.2f}"
        )
    print(
        f"parity, max abs diff of the whole model after the steps: "
        f"{result['parity_max_abs_diff']} (the steps moved a weight by up to "
        f"{result['moved_max_abs']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
