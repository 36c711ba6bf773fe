"""``asyncrl bench learner``: what the runtime adds to a learner step, and rollout throughput.

- learner step: one GRPO ``train_step`` on a fixed batch, timed from the caller's
  ``await call("train_step", batch)`` through a handle to a supervised learner process, against
  a plain single-process PyTorch loop doing the same forward (no KV cache, as the learner's),
  loss, backward, clipping and AdamW step on the same model and batch. Both use one torch
  thread and are interleaved step by step (the plain step runs in the benchmark's process
  between the learners' steps, the three series in an order that rotates with the step, so
  every series sees the same load and none always comes first); medians over ``--steps``
  steps. The target is at most 10% overhead. That learner does not checkpoint (``durable:
  false``). Where a step's wall time goes is split by the scheduler's own accounting
  (``/proc/<pid>/task/*/schedstat``, every thread of the learner's process, read before and
  after each step): ``learner_cpu_ms_p50``, the CPU the learner's process ran for the step, to
  compare with ``plain_cpu_ms_p50``, the plain step's thread CPU, one torch thread in both
  (``learner_cpu_ratio``, the work the runtime adds whatever the load);
  ``learner_wait_ms_p50``, the time its threads were ready but waited for a core (the
  machine's load, not the runtime's work). Linux only (``/proc``).
- durable step: the same step on a second learner with ``durable: wal`` (the default: the
  step's batch is in the write-ahead log, fsynced, before the reply; its checkpoints in the
  background), interleaved step by step with the first, so the ratio is the price of never
  losing an acknowledged step.
- rollout: tokens per second of a supervised rollout replica generating a batch, through a
  handle.
- small step (``asyncrl.bench.learner_small``): a new user's first GRPO run, the arith model at
  64 samples a step: the driver's view of ``train_step``, eager (``small_step_ms``) and with
  ``compile: true`` (``small_compiled_ms``), against a plain eager loop (``small_plain_ms``),
  interleaved; ``small_over_plain`` (target <= 1.1), ``small_compiled_over_eager`` (target
  <= 0.8), and ``small_breakdown_ms``, where the eager step's time goes.
- data-parallel step (``--data-parallel``; ``measure_data_parallel``): the same GRPO step through
  ``LearnerClient.train_step`` on a learner of one replica and on a data-parallel learner of two
  (gloo, ``one_for_all``), interleaved step by step: ``dp1_step_ms_p50`` and
  ``dp2_step_ms_p50``. Each replica has one torch thread, so two replicas use two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from asyncrl.bench.harness import role_child
from asyncrl.bench.learner_small import breakdown, small_remote
from asyncrl.dispatch.dispatcher import Dispatcher
from asyncrl.dispatch.handles import Context
from asyncrl.manifest.load import Supervision
from asyncrl.manifest.spec import SPEC_FILE_ENV, GroupInfo, ProcessSpec, write_spec
from asyncrl.observe import logs
from asyncrl.roles.generation.rollout import (
    GenerateBatch,
    GenerateRequest,
    Prompt,
    Sample,
    SamplingParams,
)
from asyncrl.roles.learning import algorithms as alg
from asyncrl.roles.program.clients import LearnerClient
from asyncrl.roles.training.learner import Scored, StepResult, TrainBatch, build_model, pad_batch
from asyncrl.roles.training.learner_config import LearnerConfig
from asyncrl.supervision.supervisor import ChildSpec, Supervisor
from asyncrl.transport import LocalRegistry, run

__all__ = ["MODEL", "PlainStep", "grpo_batch", "main", "measure", "measure_data_parallel"]

MODEL: dict[str, Any] = {
    "model_type": "gpt2",
    "vocab_size": 14,
    "n_positions": 32,
    "n_embd": 128,
    "n_layer": 2,
    "n_head": 4,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "pad_token_id": 0,
}


def grpo_batch(n: int, step: int) -> list[Scored]:
    """Step ``step``'s batch: ``n`` samples of one prompt id (one GRPO group), prompts of 6
    tokens, completions of 5, rewards 0 or 1."""
    rng = random.Random(step)
    out = []
    for i in range(n):
        prompt = [rng.randrange(2, 14) for _ in range(6)]
        tokens = [rng.randrange(2, 14) for _ in range(4)] + [1]
        out.append(
            Scored(
                sample=Sample(
                    prompt_id=f"s{step}",
                    sample_index=i,
                    prompt_ids=prompt,
                    token_ids=tokens,
                    logprobs=[-2.5] * 5,
                    versions=[0] * 5,
                    finished=True,
                    stop_reason="stop",
                ),
                reward=float(rng.random() < 0.5),
            )
        )
    return out


class PlainStep:
    """The baseline: the same GRPO step, in this process, with nothing around it."""

    def __init__(self) -> None:
        self.model = build_model("", MODEL, 0).train(False)
        # The learner's AdamW: its default weight decay (0), not torch's (0.01).
        decay = LearnerConfig().weight_decay
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=decay)

    def __call__(self, batch: list[Scored]) -> float:
        """One step on ``batch``; returns its seconds."""
        t0 = time.perf_counter()
        ids, attention, positions, target = pad_batch(
            [s.sample.prompt_ids for s in batch], [s.sample.token_ids for s in batch]
        )
        logits = self.model(
            input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False
        ).logits
        logprobs = alg.token_logprobs(logits[:, :-1].float(), ids[:, 1:])
        groups = torch.zeros(len(batch), dtype=torch.long)
        adv = alg.grpo_advantages(torch.tensor([s.reward for s in batch]), groups)
        old = torch.full_like(target, -2.5) * target
        loss, _ = alg.ppo_policy_loss(
            logprobs, old, adv[:, None].expand_as(target) * target, target, 0.2
        )
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return time.perf_counter() - t0


def schedstat(pid: int) -> tuple[float, float]:
    """Seconds every thread of process ``pid`` ran, and waited ready on a run queue, so far
    (the sums of ``/proc/<pid>/task/*/schedstat``). A thread that ended meanwhile drops out of
    the sums, so read it around a span no thread of ``pid`` starts or ends in."""
    ran = waited = 0
    tasks = f"/proc/{pid}/task"
    for tid in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, tid, "schedstat")) as f:
                fields = f.read().split()
        except FileNotFoundError:  # the thread ended since the listing
            continue
        ran += int(fields[0])
        waited += int(fields[1])
    return ran / 1e9, waited / 1e9


def _pid(supervisor: Supervisor, role: str) -> int:
    for row in supervisor.status():
        if row["role"] == role and row["pid"] is not None:
            return int(row["pid"])
    raise RuntimeError(f"bench learner: no process of {role!r} runs")


async def _remote(run_dir: str, samples_per_step: int, steps: int) -> dict[str, Any]:
    registry = LocalRegistry(run_dir)
    policy = Supervision(startup_timeout_s=300.0)
    specs = {
        "learner": (
            "asyncrl.roles.training.learner:Learner",
            {"model_config": MODEL, "lr": 1e-3, "publish_weights": False, "durable": False},
        ),
        "durable": (
            "asyncrl.roles.training.learner:Learner",
            {"model_config": MODEL, "lr": 1e-3, "publish_weights": False, "durable": "wal"},
        ),
        "rollout": (
            "asyncrl.roles.generation.rollout:Rollout",
            {"model_config": MODEL, "max_batch": 256},
        ),
    }
    children = [
        role_child(run_dir, name, target, config, policy)
        for name, (target, config) in specs.items()
    ]
    supervisor = Supervisor(children, run="bench", log_dir=os.path.join(run_dir, "logs"))
    supervised = asyncio.get_running_loop().create_task(supervisor.run())
    dispatcher = Dispatcher({n: GroupInfo([registry.endpoint(n, 0)]) for n in specs}, run="bench")
    dispatcher.start()
    ctx = Context(dispatcher, run="bench", run_dir=run_dir, log=None)
    out: dict[str, Any] = {}
    try:
        # Interleaved step by step: the plain step runs in this process between the learners'
        # steps (each waits for the one before), so every series sees the same load; the
        # order rotates with the step, so no series always follows the same one.
        plain = PlainStep()
        times: dict[str, list[float]] = {"learner": [], "durable": [], "plain": []}
        cpu: dict[str, list[float]] = {"learner": [], "learner_wait": [], "plain": []}
        pid: int | None = None
        for step in range(steps + 2):
            samples = grpo_batch(samples_per_step, step)
            batch = TrainBatch(samples=samples, algorithm="grpo")
            order = list(times)
            order = order[step % len(order) :] + order[: step % len(order)]
            for name in order:
                if name == "plain":
                    c0 = time.thread_time()
                    seconds = plain(samples)
                    ran, waited = time.thread_time() - c0, 0.0
                else:
                    ran, waited = 0.0, 0.0
                    # The learner's process exists once its first step was answered.
                    before = schedstat(pid) if pid is not None and name == "learner" else None
                    t0 = time.perf_counter()
                    result = await ctx.roles[name].call(
                        "train_step", batch, StepResult, timeout=300
                    )
                    seconds = time.perf_counter() - t0
                    assert result.consumed == samples_per_step
                    if before is not None and pid is not None:
                        after = schedstat(pid)
                        ran, waited = after[0] - before[0], after[1] - before[1]
                    if pid is None and name == "learner":
                        pid = _pid(supervisor, "learner")
                if step >= 2:  # two warm-up steps for each
                    times[name].append(seconds)
                    if name in cpu:
                        cpu[name].append(ran)
                    if name == "learner":
                        cpu["learner_wait"].append(waited)
        out["learner_step_ms"] = times["learner"]
        out["durable_step_ms"] = times["durable"]
        out["plain_step_ms"] = times["plain"]
        out["learner_cpu"] = cpu["learner"]
        out["learner_wait"] = cpu["learner_wait"]
        out["plain_cpu"] = cpu["plain"]
        params = SamplingParams(max_new_tokens=16, temperature=1.0)
        requests = [
            GenerateRequest(
                prompt=Prompt(id=f"p{i}", token_ids=[2 + i % 10, 12, 3, 13]),
                sample_index=0,
                params=params,
                seed=i,
            )
            for i in range(256)
        ]
        rollout = ctx.roles["rollout"]
        await rollout.call("generate", GenerateBatch(requests[:8]), list[Sample])  # warm-up
        rates = []
        for _ in range(3):
            t0 = time.perf_counter()
            samples = await rollout.call(
                "generate", GenerateBatch(requests), list[Sample], timeout=300
            )
            rates.append(sum(len(s.token_ids) for s in samples) / (time.perf_counter() - t0))
        out["rollout_tokens_per_s"] = statistics.median(rates)
    finally:
        await dispatcher.close()
        supervisor.stop("benchmark done")
        await supervised
    return out


def measure(*, samples_per_step: int = 256, steps: int = 10) -> dict[str, Any]:
    """Run both measurements; return the figures (see the module docstring)."""
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="arl-lb-")
    try:
        logs.configure(role="bench", console=False)
        remote = run(_remote(tmp, samples_per_step, steps))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    small = measure_small(steps=max(20, 2 * steps))
    handle_ms = statistics.median(remote["learner_step_ms"]) * 1e3
    durable_ms = statistics.median(remote["durable_step_ms"]) * 1e3
    plain_ms = statistics.median(remote["plain_step_ms"]) * 1e3
    learner_cpu_ms = statistics.median(remote["learner_cpu"]) * 1e3
    plain_cpu_ms = statistics.median(remote["plain_cpu"]) * 1e3
    return {
        "learner_step_ms_p50": handle_ms,
        "plain_step_ms_p50": plain_ms,
        "learner_overhead_ratio": handle_ms / plain_ms,
        "learner_cpu_ms_p50": learner_cpu_ms,
        "plain_cpu_ms_p50": plain_cpu_ms,
        "learner_cpu_ratio": learner_cpu_ms / plain_cpu_ms,
        "learner_wait_ms_p50": statistics.median(remote["learner_wait"]) * 1e3,
        "durable_step_ms_p50": durable_ms,
        "durable_ratio": durable_ms / handle_ms,
        "rollout_tokens_per_s": remote["rollout_tokens_per_s"],
        "samples_per_step": samples_per_step,
        "steps": steps,
        **small,
    }


def measure_small(*, steps: int = 20) -> dict[str, Any]:
    """The small-batch case (``asyncrl.bench.learner_small``): medians in milliseconds, their
    ratios, the compiled learner's compilation seconds and the eager step's breakdown."""
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="arl-ls-")
    try:
        logs.configure(role="bench", console=False)
        times = run(small_remote(tmp, steps))
        eager = statistics.median(times["eager"]) * 1e3
        parts = breakdown(os.path.join(tmp, "breakdown"), steps, eager)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    compiled = statistics.median(times["compiled"]) * 1e3
    plain = statistics.median(times["plain"]) * 1e3
    return {
        "small_step_ms": eager,
        "small_compiled_ms": compiled,
        "small_plain_ms": plain,
        "small_over_plain": eager / plain,
        "small_compiled_over_eager": compiled / eager,
        "small_compile_s": sum(times["compile_s"]),
        "small_breakdown_ms": parts,
        "small_steps": steps,
    }


def _replicas(
    run_dir: str, name: str, replicas: int, config: dict[str, Any], policy: Supervision
) -> list[ChildSpec]:
    """The ``replicas`` replicas of a learner role named ``name``, quiet, one thread each."""
    registry = LocalRegistry(run_dir)
    children = []
    for replica in range(replicas):
        endpoint = registry.endpoint(name, replica)

        def launch(incarnation: int, replica: int = replica, endpoint: str = endpoint) -> Any:
            spec = ProcessSpec(
                kind="role",
                name=name,
                replica=replica,
                replicas=replicas,
                incarnation=incarnation,
                target="asyncrl.roles.training.learner:Learner",
                endpoint=endpoint,
                run="bench",
                run_dir=run_dir,
                config=config,
                parent_pid=os.getpid(),
            )
            env = {
                SPEC_FILE_ENV: write_spec(spec),
                "OMP_NUM_THREADS": "1",
                logs.CONSOLE_ENV: "0",
            }
            return [sys.executable, "-m", "asyncrl.supervision.process"], env

        children.append(ChildSpec(name, replica, "role", endpoint, policy, launch))
    return children


async def _data_parallel(run_dir: str, samples_per_step: int, steps: int) -> dict[str, list[float]]:
    registry = LocalRegistry(run_dir)
    policy = Supervision(startup_timeout_s=300.0, strategy="one_for_all")
    config = {"model_config": MODEL, "lr": 1e-3, "publish_weights": False, "durable": False}
    sizes = {"dp1": 1, "dp2": 2}
    children = [c for n, k in sizes.items() for c in _replicas(run_dir, n, k, config, policy)]
    supervisor = Supervisor(children, run="bench", log_dir=os.path.join(run_dir, "logs"))
    supervised = asyncio.get_running_loop().create_task(supervisor.run())
    groups = {n: GroupInfo([registry.endpoint(n, r) for r in range(k)]) for n, k in sizes.items()}
    dispatcher = Dispatcher(groups, run="bench")
    dispatcher.start()
    ctx = Context(dispatcher, run="bench", run_dir=run_dir, log=None)
    times: dict[str, list[float]] = {name: [] for name in sizes}
    try:
        for step in range(steps + 2):
            batch = TrainBatch(samples=grpo_batch(samples_per_step, step), algorithm="grpo")
            for name, series in times.items():
                t0 = time.perf_counter()
                result = await LearnerClient(ctx.roles[name]).train_step(batch)
                if step >= 2:  # two warm-up steps
                    series.append(time.perf_counter() - t0)
                assert result.consumed == samples_per_step
    finally:
        await dispatcher.close()
        supervisor.stop("benchmark done")
        await supervised
    return times


def measure_data_parallel(*, samples_per_step: int = 256, steps: int = 10) -> dict[str, Any]:
    """One GRPO step through ``LearnerClient`` on one learner replica and on two data-parallel
    replicas (see the module docstring); medians in milliseconds and their ratio."""
    tmp = tempfile.mkdtemp(prefix="arl-dp-")
    try:
        logs.configure(role="bench", console=False)
        times = run(_data_parallel(tmp, samples_per_step, steps))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    dp1 = statistics.median(times["dp1"]) * 1e3
    dp2 = statistics.median(times["dp2"]) * 1e3
    return {
        "dp1_step_ms_p50": dp1,
        "dp2_step_ms_p50": dp2,
        "dp2_speedup": dp1 / dp2,
        "dp_samples_per_step": samples_per_step,
        "dp_steps": steps,
    }


def format_table(f: dict[str, Any]) -> str:
    met = "met" if f["learner_overhead_ratio"] <= 1.1 else "MISSED"
    return "\n".join(
        [
            f"asyncrl learner benchmark ({f['samples_per_step']} samples a step, "
            f"{f['steps']} steps, 1 torch thread)",
            "",
            f"{'figure':<36}{'measured':>14}   target",
            f"{'train_step through a handle (p50)':<36}{f['learner_step_ms_p50']:>11.1f} ms",
            f"{'plain PyTorch step (p50)':<36}{f['plain_step_ms_p50']:>11.1f} ms",
            f"{'  handle / plain':<36}{f['learner_overhead_ratio']:>13.2f}x   <= 1.1  {met}",
            f"{'durable train_step (p50)':<36}{f['durable_step_ms_p50']:>11.1f} ms",
            f"{'  durable / not durable':<36}{f['durable_ratio']:>13.2f}x",
            f"{'rollout tokens per second':<36}{f['rollout_tokens_per_s']:>14,.0f}",
            "",
            *format_small(f),
        ]
    )


def format_small(f: dict[str, Any]) -> list[str]:
    """The small-batch case's lines of the table."""
    plain_met = "met" if f["small_over_plain"] <= 1.1 else "MISSED"
    compiled_met = "met" if f["small_compiled_over_eager"] <= 0.8 else "MISSED"
    return [
        f"small batch: arith model, 64 samples, {f['small_steps']} steps, 1 torch thread",
        f"{'train_step, eager (p50)':<36}{f['small_step_ms']:>11.1f} ms",
        f"{'train_step, compile: true (p50)':<36}{f['small_compiled_ms']:>11.1f} ms",
        f"{'plain eager PyTorch step (p50)':<36}{f['small_plain_ms']:>11.1f} ms",
        f"{'  eager / plain':<36}{f['small_over_plain']:>13.2f}x   <= 1.1  {plain_met}",
        f"{'  compiled / eager':<36}{f['small_compiled_over_eager']:>13.2f}x   <= 0.8  "
        f"{compiled_met}",
        f"{'  compilation':<36}{f['small_compile_s']:>12.1f} s",
        "where the eager step goes (ms per step):",
        *(f"  {k:<34}{v:>11.2f} ms" for k, v in f["small_breakdown_ms"].items()),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="asyncrl bench learner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (>= 1)")
    parser.add_argument("--samples", type=int, default=256, help="samples per step")
    parser.add_argument(
        "--small-only",
        action="store_true",
        help="measure the small-batch case only (small_step_ms, small_compiled_ms, ...)",
    )
    parser.add_argument(
        "--data-parallel",
        action="store_true",
        help="measure dp1_step_ms_p50 and dp2_step_ms_p50 instead",
    )
    args = parser.parse_args(argv)
    if args.data_parallel:
        figures = measure_data_parallel(samples_per_step=args.samples, steps=max(1, args.steps))
        print(json.dumps(figures) if args.json else format_dp_table(figures))
        return 0
    if args.small_only:
        figures = measure_small(steps=max(1, args.steps))
        print(json.dumps(figures) if args.json else "\n".join(format_small(figures)))
        return 0
    figures = measure(samples_per_step=args.samples, steps=max(1, args.steps))
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0


def format_dp_table(f: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"asyncrl data-parallel learner benchmark ({f['dp_samples_per_step']} samples a "
            f"step, {f['dp_steps']} steps, 1 torch thread per replica)",
            "",
            f"{'train_step, 1 replica (p50)':<36}{f['dp1_step_ms_p50']:>11.1f} ms",
            f"{'train_step, 2 replicas (p50)':<36}{f['dp2_step_ms_p50']:>11.1f} ms",
            f"{'  speed-up':<36}{f['dp2_speedup']:>13.2f}x",
        ]
    )
