"""``asyncrl bench elastic``: a sharded learner's state carried from 2 ranks onto 1 and back.

A sharded learner group that goes on without a lost node's ranks reads every rank's newest
checkpoint of the old group and reshards it to its own size (``Trainer.load_states``: the
shards put together, then this rank's slices cut out; ``asyncrl.roles.training.shard_group``,
docs/multinode.md); growing back at the node's return would do the same. This benchmark
measures what the resharding costs, on a Qwen2-architecture model built from a config
(``asyncrl.bench.engines.QWEN2_300M``, about 303M parameters; ``--small``: a tiny one, for tests),
with AdamW's state (its two moments) carried along, gloo on the CPU, one group after the other in
this run:

1. 2 ranks (sharded with FSDP2, as ``parallel: fsdp``) take an optimizer step (the token-mean
   NLL of a batch) and each saves its state (its shards);
2. **shrink**: 1 rank (the whole model) starts, loads both ranks' states, takes a step, saves;
   then loads its own state again (``Trainer.load_state``: the same-size restore a restart
   makes, its baseline);
3. **grow**: 2 ranks start, load the 1 rank's state, take a step; then each loads its own state
   of step 1 (``Trainer.load_state``, the baseline).

Per move: ``start_s`` (the process started to the trainer built and in its group), ``load_s``
(reading the checkpoint files and resharding), ``same_size_load_s`` (the baseline, read and
loaded in the same process), their ratio ``load_ratio``, ``resume_s`` (``start_s + load_s`` plus
the first step after it), and ``parity_max_abs_diff``: the whole model after the load against
the one the other group saved (0: the weights came across bit for bit). ``--json`` prints
``{"model", "params", "shrink": {...}, "grow": {...}}``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from asyncrl.bench.engines import QWEN2_300M

__all__ = ["MODEL", "SMALL", "main", "measure"]

MODEL: dict[str, Any] = QWEN2_300M.config
"""The sharding benchmark's Qwen2 of about 303M parameters."""
SMALL: dict[str, Any] = {
    **QWEN2_300M.config,
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""The same architecture, tiny (``--small``)."""


def _batch(step: int, vocab: int) -> list[Any]:
    """Step ``step``'s batch: 8 samples of 8 prompt and 8 completion tokens."""
    import random

    from asyncrl.roles.payloads import Sample, Scored

    rng = random.Random(step)
    return [
        Scored(
            sample=Sample(
                prompt_id=f"s{step}p{i}",
                sample_index=0,
                prompt_ids=[rng.randrange(3, vocab) for _ in range(8)],
                token_ids=[rng.randrange(3, vocab) for _ in range(8)],
                logprobs=[-2.0] * 8,
                versions=[0] * 8,
                finished=True,
                stop_reason="stop",
            ),
            reward=1.0,
        )
        for i in range(8)
    ]


def _rank_main(args: dict[str, Any]) -> dict[str, Any]:
    """One rank of one group: build the trainer (the learner's: ``asyncrl.roles.training.
    trainer``), join the group, then run ``args["ops"]`` in order (every rank the same ops: each
    load, step and gather is a collective of the group)."""
    import torch

    from asyncrl.plugins.registry import current
    from asyncrl.roles.training.data_parallel import DataParallel
    from asyncrl.roles.training.models import build_model
    from asyncrl.roles.training.sharding import full_buckets
    from asyncrl.roles.training.trainer import Trainer, TrainerSettings

    torch.set_num_threads(args["threads"])
    model, ranks, rank, folder = args["model"], args["ranks"], args["rank"], args["folder"]
    plugin = current()
    trainer = Trainer(
        TrainerSettings(seed=0, lr=1e-4, micro_batch_tokens=1 << 20, sharded=ranks > 1),
        lambda: build_model("", model, 0),
        plugin=plugin,
        device=torch.device("cpu"),
    )
    if ranks > 1:
        dp = DataParallel.join(
            name="learner",
            rank=rank,
            world=ranks,
            run_dir=os.path.join(folder, f"run-{args['group']}"),
            generation=0,
            timeout_s=900.0,
            comm=plugin.comm,
        )
        trainer.join(dp)
    out: dict[str, Any] = {"start_s": time.time() - args["started"]}
    out["params"] = sum(int(p.numel()) for p in trainer.model.parameters())

    def step(batch: list[Any]) -> None:
        def loss(chunk: list[int], weight: float) -> tuple[torch.Tensor, dict[str, float]]:
            forward = trainer.forward([batch[i].sample for i in chunk])
            value = -(forward.logprobs * forward.target).sum() / forward.target.sum()
            return value, {"nll": float(value.detach()) * weight}

        trainer.optimizer_step(batch, loss)

    for op, name in (op.split(":", 1) for op in args["ops"]):
        if op == "step":
            start = time.perf_counter()
            step(_batch(int(name), model["vocab_size"]))
            out[f"step_s/{name}"] = time.perf_counter() - start
        elif op == "save":
            torch.save(trainer.state(), os.path.join(folder, f"{name}.{rank}.pt"))
        elif op == "load":  # every rank's states of a group of any size, resharded
            start = time.perf_counter()
            files = sorted(glob.glob(os.path.join(folder, f"{name}.*.pt")))
            trainer.load_states([torch.load(f, weights_only=False, mmap=True) for f in files])
            out[f"load_s/{name}"] = time.perf_counter() - start
        elif op == "own":  # this rank's own state, at this group's size: a restart's restore
            start = time.perf_counter()
            path = os.path.join(folder, f"{name}.{rank}.pt")
            trainer.load_state(torch.load(path, weights_only=False, mmap=True))
            out[f"own_s/{name}"] = time.perf_counter() - start
        elif op in ("whole", "compare"):
            path = os.path.join(folder, f"{name}.whole")
            reference = torch.load(path, mmap=True) if op == "compare" else None
            whole, diff = {}, 0.0
            for bucket in full_buckets(trainer.model, 256 << 20):
                for key, t in bucket.items():
                    if rank != 0:
                        continue
                    if reference is None:
                        whole[key] = t
                    else:
                        diff = max(diff, float((t - reference[key]).abs().max()))
            if rank == 0 and reference is None:
                torch.save(whole, path)
            out[f"diff/{name}"] = diff
    if ranks > 1:
        dp.close()
    return out


def _group(group: str, ranks: int, ops: list[str], model: dict[str, Any], folder: str) -> Any:
    """Run one group of ``ranks`` processes through ``ops``; rank 0's report."""
    threads = max(1, (os.cpu_count() or 1) // ranks)
    procs = []
    for rank in range(ranks):
        args = {
            "group": group,
            "rank": rank,
            "ranks": ranks,
            "ops": ops,
            "model": model,
            "threads": threads,
            "folder": folder,
            "started": time.time(),
            "out": os.path.join(folder, f"{group}.{rank}.json"),
        }
        # Each rank's stderr to a file: a pipe nobody reads while the other rank is waited for
        # could fill and stall both in a collective.
        with open(os.path.join(folder, f"{group}.{rank}.stderr"), "w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.elastic", "--worker", json.dumps(args)],
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )
    for p in procs:
        p.wait()
    if any(p.returncode for p in procs):
        errors = []
        for rank in range(ranks):
            with open(os.path.join(folder, f"{group}.{rank}.stderr")) as f:
                errors.append(f.read()[-3000:])
        raise RuntimeError(
            f"bench elastic: a rank of the group {group!r} of {ranks} failed:\n" + "\n".join(errors)
        )
    with open(os.path.join(folder, f"{group}.0.json")) as f:
        return json.load(f)


def _move(report: dict[str, Any], load: str, same: str, step: str, whole: str) -> dict[str, Any]:
    load_s, same_s = report[f"load_s/{load}"], report[f"own_s/{same}"]
    return {
        "start_s": report["start_s"],
        "load_s": load_s,
        "same_size_load_s": same_s,
        "load_ratio": load_s / same_s,
        "resume_s": report["start_s"] + load_s + report[f"step_s/{step}"],
        "parity_max_abs_diff": report[f"diff/{whole}"],
    }


def measure(small: bool = False) -> dict[str, Any]:
    """The figures of the module docstring."""
    model = SMALL if small else MODEL
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-elastic-") as folder:
        _group("two", 2, ["step:0", "save:two", "whole:two"], model, folder)
        one = _group(
            "one",
            1,
            ["load:two", "compare:two", "step:1", "save:one", "whole:one", "own:one"],
            model,
            folder,
        )
        back = _group(
            "back",
            2,
            ["load:one", "compare:one", "step:2", "save:step2", "own:step2"],
            model,
            folder,
        )
    return {
        "model": "qwen2-small" if small else "qwen2",
        "params": one["params"],
        "shrink": _move(one, "two", "one", "1", "two"),
        "grow": _move(back, "one", "step2", "2", "one"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl bench elastic", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--small", action="store_true", help="a tiny model (for tests)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker = json.loads(args.worker)
        report = _rank_main(worker)
        with open(worker["out"], "w") as f:
            json.dump(report, f)
        return 0
    result = measure(args.small)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"elastic learner, {result['model']} of {result['params']:,} parameters")
    print(
        f"{'move':>14} {'start s':>8} {'load s':>8} {'same-size s':>12} {'x same':>7} "
        f"{'resume s':>9} {'parity':>7}"
    )
    for move, label in (("shrink", "2 -> 1 rank"), ("grow", "1 -> 2 ranks")):
        row = result[move]
        print(
            f"{label:>14} {row['start_s']:>8.2f} {row['load_s']:>8.2f} "
            f"{row['same_size_load_s']:>12.2f} {row['load_ratio']:>7.2f} {row['resume_s']:>9.2f} "
            f"{row['parity_max_abs_diff']:>7.1g}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
