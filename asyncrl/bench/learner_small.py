"""``asyncrl bench learner``'s small-batch case: where a small GRPO step's time goes.

The case a new user tries first: the arith model (``examples/arith``), 64 samples a step (8
prompts x 8 samples, prompts of 7 tokens, completions of 2 to 5), GRPO with PPO's clip, lr 5e-4,
gradient clipping, AdamW, one torch thread, dropout off, ``durable: false``, weights published
to the shared-memory store every step (the default). Three series, interleaved step by step
(their order rotating), medians over the timed steps:

- ``small_step_ms``: the driver's view of ``train_step`` on a supervised learner process,
  from ``await call("train_step", batch)`` to its reply (RPC and codec included);
- ``small_compiled_ms``: the same on a second learner with ``compile: true``, after its
  warm-up steps have compiled the graphs;
- ``small_plain_ms``: a plain eager PyTorch loop in one process of its own (started like the
  learners, one torch thread), the same work and nothing around it (the learners' fused
  AdamW included), timed in that process. It
  keeps glibc's allocator as a user's script has it, where a role process holds its heap
  (``asyncrl.supervision.heap``); that is worth about 1,100 page faults a step to the loop.

``small_breakdown_ms`` then runs the eager learner's steps (``Learner.train``) in a process of its
own with tracing on and says where a step's time goes (means per step), from the spans the
learner and its trainer record (``training epochs``, ``optimizer step``, ``micro-batch loss``,
``forward``, ``model forward``, ``optimizer``, ``step log``, ``weight publish``), with ``rpc and
codec`` the driver's median less the in-process one. That process holds its heap as a role
process does.
"""

from __future__ import annotations

import asyncio
import collections
import multiprocessing
import os
import random
import statistics
import time
from typing import Any

import msgspec
import torch

from asyncrl.bench.harness import role_child
from asyncrl.dispatch.dispatcher import Dispatcher
from asyncrl.dispatch.handles import Context
from asyncrl.manifest.load import Supervision
from asyncrl.manifest.spec import GroupInfo
from asyncrl.observe import trace
from asyncrl.role import RoleContext
from asyncrl.roles.learning import algorithms as alg
from asyncrl.roles.payloads import Sample
from asyncrl.roles.training.learner import (
    Learner,
    Scored,
    StepResult,
    TrainBatch,
    build_model,
    pad_batch,
)
from asyncrl.roles.training.learner_config import LearnerConfig
from asyncrl.supervision.heap import hold_heap
from asyncrl.supervision.supervisor import Supervisor
from asyncrl.transport import LocalRegistry, tracing

__all__ = ["ARITH_MODEL", "PlainStep", "breakdown", "small_batch", "small_remote"]

ARITH_MODEL: dict[str, Any] = {
    "model_type": "gpt2",
    "vocab_size": 14,
    "n_positions": 16,
    "n_embd": 128,
    "n_layer": 2,
    "n_head": 4,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
"""The model of ``examples/arith/bc_grpo.yaml``."""

PROMPTS, GROUP, LR = 8, 8, 5e-4
CONFIG: dict[str, Any] = {
    "model_config": ARITH_MODEL,
    "lr": LR,
    "durable": False,
    "fused_optimizer": True,
}
WARMUP = 3  # the compiled learner compiles its graphs in the first step


def small_batch(step: int) -> TrainBatch:
    """Step ``step``'s batch: 8 groups of 8 arith-shaped samples, rewards 0 or 1."""
    rng = random.Random(step)
    samples = []
    for i in range(PROMPTS * GROUP):
        n = rng.randrange(2, 6)
        tokens = [rng.randrange(2, 12) for _ in range(n - 1)] + [1]
        sample = Sample(
            prompt_id=f"s{step}-{i // GROUP}",
            sample_index=i % GROUP,
            prompt_ids=[1] + [rng.randrange(2, 14) for _ in range(6)],
            token_ids=tokens,
            logprobs=[-rng.random() * 2.5 for _ in range(n)],
            versions=[0] * n,
            finished=True,
            stop_reason="stop",
        )
        samples.append(Scored(sample=sample, reward=float(rng.random() < 0.5)))
    return TrainBatch(samples=samples, algorithm="grpo")


class PlainStep:
    """The baseline: the same GRPO step in this process with nothing around it: pad, forward,
    log-probs, GRPO's advantages per group, PPO's clipped loss, backward, clipping, AdamW (fused
    where the device has the kernel, as the learners' ``fused_optimizer`` makes theirs)."""

    def __init__(self) -> None:
        self.model = build_model("", ARITH_MODEL, 0).train(False)
        params = list(self.model.parameters())
        # The learners' AdamW: their default weight decay (0), not torch's (0.01).
        options: dict[str, Any] = {"lr": LR, "weight_decay": LearnerConfig().weight_decay}
        try:
            fused = CONFIG["fused_optimizer"] or None
            self.opt = torch.optim.AdamW(params, fused=fused, **options)
        except (RuntimeError, ValueError):  # no fused kernel here: the learners' fallback too
            self.opt = torch.optim.AdamW(params, **options)

    def __call__(self, batch: TrainBatch) -> None:
        samples = [s.sample for s in batch.samples]
        ids, attention, positions, target = pad_batch(
            [s.prompt_ids for s in samples], [s.token_ids for s in samples]
        )
        logits = self.model(
            input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False
        ).logits
        logprobs = alg.token_logprobs(logits[:, :-1].float(), ids[:, 1:])
        groups = torch.arange(len(samples)) // GROUP
        adv = alg.grpo_advantages(torch.tensor([s.reward for s in batch.samples]), groups)
        old = torch.zeros_like(target)
        for i, s in enumerate(samples):
            old[i, target.shape[1] - len(s.logprobs) :] = torch.tensor(s.logprobs)
        loss, _ = alg.ppo_policy_loss(logprobs, old, adv[:, None] * target, target, 0.2)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()


def _plain_process(conn: Any) -> None:
    """A child process: one ``PlainStep`` per step number received, replying its seconds."""
    torch.set_num_threads(1)
    plain = PlainStep()
    while (step := conn.recv()) is not None:
        batch = small_batch(step)
        t0 = time.perf_counter()
        plain(batch)
        conn.send(time.perf_counter() - t0)


async def small_remote(
    run_dir: str, steps: int, *, compiled: bool = True
) -> dict[str, list[float]]:
    """The three series of the module docstring, in seconds, interleaved (without the
    compiled learner's when ``compiled`` is False)."""
    registry = LocalRegistry(run_dir)
    policy = Supervision(startup_timeout_s=300.0)
    configs = {"eager": CONFIG, "compiled": {**CONFIG, "compile": True}}
    if not compiled:
        del configs["compiled"]
    target = "asyncrl.roles.training.learner:Learner"
    children = [role_child(run_dir, n, target, c, policy) for n, c in configs.items()]
    supervisor = Supervisor(children, run="bench", log_dir=os.path.join(run_dir, "logs"))
    supervised = asyncio.get_running_loop().create_task(supervisor.run())
    groups = {n: GroupInfo([registry.endpoint(n, 0)]) for n in configs}
    dispatcher = Dispatcher(groups, run="bench")
    dispatcher.start()
    ctx = Context(dispatcher, run="bench", run_dir=run_dir, log=None)
    spawn = multiprocessing.get_context("spawn")
    conn, child_conn = spawn.Pipe()
    plain = spawn.Process(target=_plain_process, args=(child_conn,), daemon=True)
    plain.start()
    times: dict[str, list[float]] = {"eager": [], "compiled": [], "plain": [], "compile_s": []}
    try:
        for step in range(steps + WARMUP):
            batch = small_batch(step)
            order = [*configs, "plain"]
            order = order[step % len(order) :] + order[: step % len(order)]
            for name in order:
                t0 = time.perf_counter()
                if name == "plain":
                    conn.send(step)
                    seconds = await asyncio.to_thread(conn.recv)
                else:
                    result = await ctx.roles[name].call(
                        "train_step", batch, StepResult, timeout=900
                    )
                    assert result.consumed == len(batch.samples)
                    if "compile_s" in result.metrics:
                        times["compile_s"].append(result.metrics["compile_s"])
                    seconds = time.perf_counter() - t0
                if step >= WARMUP:
                    times[name].append(seconds)
    finally:
        conn.send(None)
        plain.join(timeout=60)
        await dispatcher.close()
        supervisor.stop("benchmark done")
        await supervised
    return times


def breakdown(run_dir: str, steps: int, driver_ms: float) -> dict[str, float]:
    """Where the eager learner's step goes, in ms per step (see the module docstring), measured
    in a process of its own."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        parts: dict[str, float] = pool.apply(_breakdown, (run_dir, steps, driver_ms))
    return parts


def _breakdown(run_dir: str, steps: int, driver_ms: float) -> dict[str, float]:
    torch.set_num_threads(1)
    hold_heap()  # as a role process does
    folder = os.path.join(run_dir, "trace")
    recorder = tracing.install(tracing.Recorder(folder, "learner.0"))
    ctx = RoleContext.local(config=CONFIG, run_dir=run_dir, name="learner")
    learner = Learner(ctx)
    asyncio.run(learner.setup())
    totals, encode, timed_from = [], 0.0, 0
    for step in range(steps + WARMUP):
        if step == WARMUP:
            timed_from = tracing.clock()
        batch = small_batch(step)
        t0 = time.perf_counter()
        result = learner.train(batch)
        totals.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        msgspec.msgpack.encode(result)
        encode += time.perf_counter() - t0 if step >= WARMUP else 0.0
    asyncio.run(learner.teardown())
    recorder.flush()
    tracing.uninstall()
    ms: dict[str, float] = collections.defaultdict(float)
    for proc in trace.load(folder):
        for _, name, _thread, start, end, *_ in proc.spans:
            if start >= timed_from:
                ms[name] += (end - start) / 1e6 / steps
    in_process = statistics.median(totals[WARMUP:]) * 1e3
    step_ms = statistics.fmean(totals[WARMUP:]) * 1e3
    return {
        "batching (pad, to device)": ms["forward"] - ms["model forward"],
        "forward": ms["model forward"],
        "loss": ms["micro-batch loss"] - ms["forward"],
        "backward and grad clip": ms["optimizer step"] - ms["micro-batch loss"] - ms["optimizer"],
        "optimizer": ms["optimizer"],
        "advantages and split": ms["training epochs"] - ms["optimizer step"],
        "step log (durable: false)": ms["step log"],
        "weight publish": ms["weight publish"],
        "metrics and ledger": (
            step_ms - ms["training epochs"] - ms["step log"] - ms["weight publish"]
        ),
        "reply encode": encode / steps * 1e3,
        "rpc and codec": driver_ms - in_process - encode / steps * 1e3,
    }
