"""``asyncrl bench durability``: what each ``durable`` mode of the learner costs a step, and how
fast a learner with a write-ahead log comes back after a SIGKILL.

Three supervised learner processes (``asyncrl.roles.training.learner:Learner``, one torch thread
each) train the same model from the same seed on the same GRPO batches, with ``durable: false``
(``off``: nothing on disk before the reply; the baseline), ``durable: wal`` (the step's batch
appended to a write-ahead log and fsynced; a checkpoint staged and written in the background
every ``checkpoint_every`` steps) and ``durable: checkpoint`` (a whole checkpoint written and
fsynced before every reply). The model is the rollout benchmark's Qwen2 of about 303M
parameters (``asyncrl.bench.engines.QWEN2_300M``; ``--small``: a tiny Qwen2, for a quick
run). Each step goes to the learners one after the other, timed from the call to the reply
through the transport.

At 303M parameters in float32 a learner holds 4.8 GB of training state (weights, gradients,
AdamW's two moments), and one that checkpoints keeps 3.6 GB more of staging buffers, so the
three cannot all be trained at once within 16 GB. They run in two rounds, each interleaved step
by step with the ``off`` learner, which trains throughout and is the baseline of both:

1. ``off`` and ``wal``: ``--warmup`` untimed steps, ``--steps`` timed ones, after which ``wal``
   checkpoints (``checkpoint_every`` is set so that the checkpoint lands there), then ``--k``
   more steps, which only its log holds. Once that checkpoint is complete, ``wal`` is SIGKILLed;
   its supervisor restarts it, and it loads the checkpoint and replays the logged steps before
   it serves. ``recovery_s`` is from the kill until its next incarnation answers a call (the
   learner's ``status``, which waits for ``setup``: imports, the model's build, the load and
   the replay); ``replayed_steps`` and ``restored_step`` are from that ``status``.
   ``bit_identical``: every tensor of its weights (as its ``export`` writes them; SHA-256 per
   tensor) equals those of ``off``, which took the same steps and was never killed.
2. ``wal`` stops; ``off`` and ``checkpoint`` (started now) take ``--warmup`` untimed and
   ``--steps`` timed steps on the same batches.

``step_s_wal`` is the median of every timed ``wal`` step (those of round 1 after the warm-up,
the checkpoint's staging and the steps that its background write overlapped included),
``step_s_checkpoint`` of the timed ``checkpoint`` steps, and ``step_s_off`` of all timed ``off``
steps. Each ratio is taken within its round: ``wal_over_off`` is ``step_s_wal`` over the median
of the ``off`` steps of round 1 (``step_s_off_round1``), ``checkpoint_over_off`` is
``step_s_checkpoint`` over that of round 2 (``step_s_off_round2``). ``wal_log_only_over_off``
takes only the timed steps before the one that stages the checkpoint (each with the ``off``
step of the same batch): the price of the log alone (None with ``--steps 1``).

``--json`` prints ``{"model", "params", "steps", "k", "step_s_off", "step_s_off_round1",
"step_s_off_round2", "step_s_wal", "step_s_checkpoint", "wal_over_off", "checkpoint_over_off",
"wal_log_only_over_off", "recovery_s", "replay_s", "replayed_steps", "restored_step",
"bit_identical", "checkpoint_bytes", "checkpoint_stage_s", "checkpoint_write_s"}``: the last
three from the ``wal`` learner's checkpoint (bytes on disk; staging and writing seconds as its
log reports them), ``replay_s`` as its log reports the replay (None when the line is not
found).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.bench.engines import QWEN2_300M
from asyncrl.bench.harness import role_child
from asyncrl.manifest.load import Supervision
from asyncrl.observe import logs
from asyncrl.roles.payloads import Sample, Scored, StepResult, TrainBatch
from asyncrl.roles.training.checkpoints import CheckpointDir
from asyncrl.supervision.faults import FaultPlan
from asyncrl.supervision.supervisor import Supervisor
from asyncrl.transport import ChannelOptions, Client, TransportError, run

__all__ = ["MODEL", "SMALL", "main", "measure"]

MODEL: dict[str, Any] = QWEN2_300M.config
"""The rollout and sharding benchmarks' Qwen2 of about 303M parameters."""
SMALL: dict[str, Any] = {
    **QWEN2_300M.config,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""The same architecture at about 100K parameters (``--small``)."""
LEARNER = "asyncrl.roles.training.learner:Learner"
CALL_S = 600.0
"""The longest one call waits (a 303M step on a loaded core, a restart's load and replay)."""
LIVENESS = 30
"""Missed one-second heartbeats before a learner is taken as dead (3 by default): its
``export`` of a 303M model was seen to leave heartbeats unanswered for over 3 s on this
machine's disk, and the benchmark must not count that as a crash."""


@dataclass
class Plan:
    """One run's shape: ``warmup`` untimed and ``steps`` timed steps a round, ``k`` steps
    logged past the ``wal`` learner's checkpoint, batches of ``prompts`` x ``group`` samples of
    ``length`` prompt and completion tokens."""

    model: dict[str, Any]
    steps: int = 5
    warmup: int = 2
    k: int = 4
    prompts: int = 2
    group: int = 2
    length: int = 8


def _batch(step: int, plan: Plan) -> TrainBatch:
    """Step ``step``'s GRPO batch: random tokens, rewards that differ within each group (so the
    weights move), sample ids of its own."""
    gen = torch.Generator().manual_seed(step)
    vocab, n = int(plan.model["vocab_size"]), plan.length
    samples = []
    for p in range(plan.prompts):
        prompt = torch.randint(3, vocab, (n,), generator=gen).tolist()
        for k in range(plan.group):
            tokens = torch.randint(3, vocab, (n,), generator=gen).tolist()
            sample = Sample(
                prompt_id=f"d{step}p{p}",
                sample_index=k,
                prompt_ids=prompt,
                token_ids=tokens,
                logprobs=[-2.0] * n,
                versions=[0] * n,
                finished=True,
                stop_reason="stop",
            )
            samples.append(Scored(sample=sample, reward=float(k % 2)))
    return TrainBatch(samples=samples, algorithm="grpo", id=f"durability-{step}")


def _config(plan: Plan, durable: str | bool, every: int = 0) -> dict[str, Any]:
    return {
        "model_config": plan.model,
        "seed": 0,
        "lr": 1e-5,
        "durable": durable,
        "checkpoint_every": every,
        "checkpoint_every_s": 0.0,
        "publish_weights": False,
        "micro_batch_tokens": 1 << 20,
    }


@dataclass
class _Learner:
    """One supervised learner process (a supervisor of its own, so that it stops alone), a
    client to it, and the supervisor's events: ``(kind, incarnation)`` with their times."""

    name: str
    run_dir: str
    supervisor: Supervisor
    task: asyncio.Task[Any]
    client: Client
    events: asyncio.Queue[tuple[str, int, float]] = field(default_factory=asyncio.Queue)

    @classmethod
    async def start(cls, run_dir: str, name: str, config: dict[str, Any]) -> _Learner:
        policy = Supervision(
            max_restarts=3,
            backoff_initial_s=0.0,
            backoff_max_s=0.0,
            startup_timeout_s=CALL_S,
            liveness=LIVENESS,
        )
        child = role_child(run_dir, name, LEARNER, config, policy, run="durability")
        events: asyncio.Queue[tuple[str, int, float]] = asyncio.Queue()
        supervisor = Supervisor(
            [child],
            run="durability",
            log_dir=os.path.join(run_dir, "logs", name),
            observer=lambda kind, _, n: events.put_nowait((kind, n, time.perf_counter())),
        )
        task = asyncio.get_running_loop().create_task(supervisor.run())
        client = Client(child.endpoint, name="bench", options=ChannelOptions(liveness=LIVENESS))
        await client.connect(timeout=CALL_S)
        learner = cls(name, run_dir, supervisor, task, client, events)
        await learner.until("serving", 0)
        return learner

    async def until(self, kind: str, incarnation: int) -> float:
        """When the supervisor saw this learner's ``incarnation`` reach ``kind``."""
        while True:
            got, n, at = await asyncio.wait_for(self.events.get(), CALL_S)
            if (got, n) == (kind, incarnation):
                return at

    async def step(self, batch: TrainBatch) -> float:
        """Train one step; its seconds, call to reply."""
        start = time.perf_counter()
        result = await self.client.call("train_step", batch, StepResult, timeout=CALL_S)
        seconds = time.perf_counter() - start
        if result.consumed != len(batch.samples):
            raise RuntimeError(f"bench durability: {self.name} consumed {result.consumed}")
        return seconds

    async def call(self, method: str, reply_type: Any) -> Any:
        return await self.client.call(method, None, reply_type, timeout=CALL_S)

    async def stop(self) -> None:
        await self.client.close()
        self.supervisor.stop("benchmark done")
        await self.task


async def _round(
    learners: list[_Learner], plan: Plan, first: int, count: int
) -> dict[str, list[float]]:
    """Steps ``first`` to ``first + count - 1``, each sent to every learner in turn; the
    seconds of each learner's steps."""
    times: dict[str, list[float]] = {learner.name: [] for learner in learners}
    for step in range(first, first + count):
        batch = _batch(step, plan)
        for learner in learners:
            times[learner.name].append(await learner.step(batch))
    return times


async def _checkpoint_complete(run_dir: str, name: str, step: int) -> str:
    """Wait until the checkpoint of ``step`` of learner ``name`` is complete; its directory."""
    checkpoints = CheckpointDir(
        os.path.join(run_dir, "roles", f"{name}.0", "checkpoints"), 2, FaultPlan.from_env(0)
    )
    async with asyncio.timeout(CALL_S):
        # Another process's background thread writes it: its marker on disk is the only sign.
        while (where := checkpoints.at(step)) is None:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
    return where


async def _digest(learner: _Learner) -> tuple[dict[str, str], int]:
    """A SHA-256 of each of the learner's weights, as its ``export`` writes them (into
    ``RUN_DIR/exports/<name>``: no copy of the model crosses a socket), and how many elements
    they hold (a tied embedding once)."""
    from safetensors import safe_open

    where = os.path.join(learner.run_dir, "exports", learner.name)
    await learner.client.call("export", where, str, timeout=CALL_S)
    digests, count = {}, 0
    for file in sorted(n for n in os.listdir(where) if n.endswith(".safetensors")):
        with safe_open(os.path.join(where, file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors file is not a mapping)
                tensor = f.get_tensor(name)
                raw = tensor.contiguous().view(torch.uint8).numpy()
                digests[name] = hashlib.sha256(memoryview(raw)).hexdigest()
                count += int(tensor.numel())
    shutil.rmtree(where, ignore_errors=True)
    return digests, count


def _log_figures(run_dir: str, name: str) -> dict[str, float | None]:
    """The checkpoint's staging and writing seconds and the replay's seconds, as the learner's
    log reports them (None where no such line is found)."""
    figures: dict[str, float | None] = {
        "checkpoint_stage_s": None,
        "checkpoint_write_s": None,
        "replay_s": None,
    }
    path = os.path.join(run_dir, "logs", f"{name}.0.jsonl")
    if not os.path.exists(path):
        return figures
    with open(path) as f:
        for line in f:
            event = str(json.loads(line).get("event", ""))
            saved = re.search(r"complete: staged in ([\d.]+) s, written in ([\d.]+) s", event)
            if saved and figures["checkpoint_stage_s"] is None:
                figures["checkpoint_stage_s"] = float(saved.group(1))
                figures["checkpoint_write_s"] = float(saved.group(2))
            replayed = re.search(r"replayed \d+ logged step.* in ([\d.]+) s", event)
            if replayed:
                figures["replay_s"] = float(replayed.group(1))
    return figures


async def _kill_and_recover(wal: _Learner) -> dict[str, Any]:
    """SIGKILL ``wal``; the seconds until its next incarnation answers ``status`` (an endpoint
    answers only once ``setup``, the load and the replay included, has returned), and what
    that status says."""
    pid = (await wal.call("_describe", dict))["pid"]
    killed = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    async with asyncio.timeout(CALL_S):
        while True:  # a call made while it is down fails, or waits for the next incarnation
            try:
                status = await wal.call("status", dict)
            except TransportError:
                continue
            answered = time.perf_counter()
            if (await wal.call("_describe", dict))["pid"] != pid:
                break
    return {
        "recovery_s": answered - killed,
        "replayed_steps": int(status.get("replayed", -1)),
        "restored_step": int(status.get("restored_step", -1)),
    }


async def _measure(run_dir: str, plan: Plan) -> dict[str, Any]:
    """Both rounds of the module docstring; the figures before the medians are taken."""
    landed = plan.warmup + plan.steps  # the wal learner's checkpoint: after the timed steps
    out: dict[str, Any] = {}
    off = await _Learner.start(run_dir, "off", _config(plan, False))
    try:
        wal = await _Learner.start(run_dir, "wal", _config(plan, "wal", landed))
        try:
            await _round([off, wal], plan, 0, plan.warmup)
            timed = await _round([off, wal], plan, plan.warmup, plan.steps + plan.k)
            where = await _checkpoint_complete(run_dir, "wal", landed)
            out["checkpoint_bytes"] = sum(
                os.path.getsize(os.path.join(where, n)) for n in os.listdir(where)
            )
            out.update(await _kill_and_recover(wal))
            mine, params = await _digest(wal)
            theirs, _ = await _digest(off)
            out["bit_identical"] = mine == theirs
            out["params"] = params
        finally:
            await wal.stop()
        out["times_off_1"], out["times_wal"] = timed["off"], timed["wal"]
        checkpoint = await _Learner.start(run_dir, "checkpoint", _config(plan, "checkpoint"))
        try:
            first = landed + plan.k
            await _round([off, checkpoint], plan, first, plan.warmup)
            timed = await _round([off, checkpoint], plan, first + plan.warmup, plan.steps)
        finally:
            await checkpoint.stop()
        out["times_off_2"], out["times_checkpoint"] = timed["off"], timed["checkpoint"]
    finally:
        await off.stop()
    out.update(_log_figures(run_dir, "wal"))
    return out


def measure(*, small: bool = False, steps: int = 5, warmup: int = 2, k: int = 4) -> dict[str, Any]:
    """Run the benchmark; the figures of the module docstring."""
    plan = Plan(SMALL if small else MODEL, steps=max(1, steps), warmup=max(1, warmup), k=k)
    tmp = tempfile.mkdtemp(prefix="arl-dur-")
    try:
        logs.configure(role="bench", console=False)
        raw = run(_measure(tmp, plan))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    median = statistics.median
    off1, off2 = raw.pop("times_off_1"), raw.pop("times_off_2")
    wal_times = raw.pop("times_wal")
    wal, checkpoint = median(wal_times), median(raw.pop("times_checkpoint"))
    # The timed steps before the one that stages the checkpoint: the log's own price.
    logged = plan.steps - 1
    figures = {
        "model": "qwen2-small" if small else QWEN2_300M.name,
        "params": raw.pop("params"),
        "steps": plan.steps,
        "k": plan.k,
        "step_s_off": median(off1 + off2),
        "step_s_off_round1": median(off1),
        "step_s_off_round2": median(off2),
        "step_s_wal": wal,
        "step_s_checkpoint": checkpoint,
        "wal_over_off": wal / median(off1),
        "checkpoint_over_off": checkpoint / median(off2),
        "wal_log_only_over_off": (
            median(wal_times[:logged]) / median(off1[:logged]) if logged else None
        ),
    }
    return figures | raw


def format_table(f: dict[str, Any]) -> str:
    """The human form: each step time with its ratio to the ``off`` baseline of its round."""

    def row(label: str, seconds: float | None, ratio: float | None = None) -> str:
        median = f"{'':>11}" if seconds is None else f"{seconds:>9.3f} s"
        return f"{label:<44}{median}" + ("" if ratio is None else f"{ratio:>9.2f}x")

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    size = f"{f['checkpoint_bytes'] / 2**30:.2f} GiB"
    return "\n".join(
        [
            f"learner durability, {f['model']} of {f['params'] / 1e6:.1f}M parameters "
            f"({f['steps']} timed steps a round, medians; 1 torch thread a learner)",
            "",
            f"{'train_step, call to reply':<44}{'median':>11}{'x off':>10}",
            row("durable: false (off), round 1", f["step_s_off_round1"]),
            row("durable: wal", f["step_s_wal"], f["wal_over_off"]),
            row("  steps before the checkpoint (the log alone)", None, f["wal_log_only_over_off"]),
            row("durable: false (off), round 2", f["step_s_off_round2"]),
            row("durable: checkpoint", f["step_s_checkpoint"], f["checkpoint_over_off"]),
            "",
            f"wal checkpoint: {size}, staged in {seconds(f['checkpoint_stage_s'])}, written "
            f"in the background in {seconds(f['checkpoint_write_s'])}",
            f"SIGKILL {f['k']} logged steps past it: serving again after "
            f"{f['recovery_s']:.2f} s (replay of {f['replayed_steps']} step(s) from the "
            f"checkpoint of step {f['restored_step']}: {seconds(f['replay_s'])})",
            f"weights after the restart equal those of a learner never killed: "
            f"{f['bit_identical']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="asyncrl bench durability",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--small", action="store_true", help="a tiny Qwen2, for a quick run")
    parser.add_argument("--steps", type=int, default=5, help="timed steps a round (>= 1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps a round (>= 1)")
    parser.add_argument(
        "--k", type=int, default=4, help="steps logged past the checkpoint before the kill"
    )
    args = parser.parse_args(argv)
    if args.k < 1:
        parser.error(f"--k: expected an integer >= 1, got {args.k}")
    figures = measure(small=args.small, steps=args.steps, warmup=args.warmup, k=args.k)
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
