"""The critic's write-ahead log (``durable: wal``, the default): a restarted critic loads its
newest checkpoint and replays the logged steps after it, to the parameters of a critic never
restarted, bit for bit; a batch re-sent with its id gets the step's result back; a critic
SIGKILLed after logging a step, before its reply, comes back with that step."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import torch

from asyncrl.role import RoleContext
from asyncrl.roles.generation.rollout import Sample
from asyncrl.roles.payloads import CriticBatch, Scored
from asyncrl.roles.training.critic import Critic
from tests.conftest import ROOT

MODEL = {
    "model_type": "gpt2",
    "vocab_size": 14,
    "n_positions": 16,
    "n_embd": 32,
    "n_layer": 1,
    "n_head": 2,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
CONFIG = {"model_config": MODEL, "seed": 2, "lr": 1e-2, "mini_batches": 2, "checkpoint_every": 2}
STEPS = 5


def batch(step: int) -> CriticBatch:
    samples = []
    for k in range(3):
        n = 1 + (step + k) % 4
        tokens = [2 + (step * 5 + k + j) % 11 for j in range(n)]
        sample = Sample(
            prompt_id=f"s{step}",
            sample_index=k,
            prompt_ids=[3, 4 + k],
            token_ids=tokens,
            logprobs=[-1.0] * n,
            versions=[0] * n,
            finished=True,
            stop_reason="stop",
        )
        values = [0.1 * j - 0.05 * k for j in range(n)]
        samples.append(Scored(sample=sample, reward=float((k + step) % 2), values=values))
    return CriticBatch(samples, id=f"rl-{step}")


def make(run_dir: Any) -> Critic:
    critic = Critic(RoleContext.local(config=dict(CONFIG), run_dir=str(run_dir), name="critic"))
    asyncio.run(critic.setup())
    return critic


def test_a_restarted_critic_replays_its_log_bit_for_bit(tmp_path: Any) -> None:
    torch.set_num_threads(1)
    straight = make(tmp_path / "straight")
    for step in range(STEPS):
        straight.train(batch(step))
    first = make(tmp_path / "run")
    results = []
    for step in range(STEPS):
        results.append(first.train(batch(step)))
        first.durability.journal.wait()  # saves at steps 2 and 4, each complete before the next
    restarted = make(tmp_path / "run")
    assert (
        restarted.durability.restored_step,
        restarted.durability.replayed_steps,
        restarted.step,
    ) == (4, 1, 5)
    again = restarted.train(batch(STEPS - 1))  # the reply was lost: re-sent
    assert again.replayed and again.step == STEPS
    assert again.value_loss == results[-1].value_loss
    for (name, a), b in zip(
        straight.trainer.model.state_dict().items(),
        restarted.trainer.model.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(a, b), name


SCRIPT = """
import asyncio, json, os, sys
import torch
torch.set_num_threads(1)
from asyncrl.role import RoleContext
from asyncrl.roles.training.critic import Critic
from tests.training.test_critic_durable import CONFIG, STEPS, batch

run_dir, incarnation = sys.argv[1], int(sys.argv[2])

async def main():
    ctx = RoleContext.local(config=dict(CONFIG), name="critic", run_dir=run_dir,
                            incarnation=incarnation)
    critic = Critic(ctx)
    await critic.setup()
    replayed = critic.durability.replayed_steps
    print(json.dumps({"step": critic.step, "replayed": replayed}), flush=True)
    for step in range(critic.step, STEPS):
        await critic.train_step(batch(step))
    await critic.teardown()
    torch.save(critic.trainer.model.state_dict(), os.path.join(run_dir, "final.pt"))

asyncio.run(main())
"""


def test_a_critic_killed_after_logging_a_step_comes_back_with_it(tmp_path: Any) -> None:
    torch.set_num_threads(1)
    run_dir = str(tmp_path / "run")
    faults = {"kill_at": {"point": "after_log", "every": 3}}
    starts = []
    for incarnation in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", SCRIPT, run_dir, str(incarnation)],
            cwd=ROOT,
            env={**os.environ, "ASYNCRL_FAULTS": json.dumps(faults)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        starts.append(json.loads(proc.stdout.splitlines()[0]))
        assert proc.returncode == (-9 if incarnation == 0 else 0), proc.stderr[-3000:]
    # Killed after its third step was logged: back at step 3, from step 2's checkpoint (1 step
    # replayed) or, when that save was still writing in the background, from the start (3).
    assert starts[0] == {"step": 0, "replayed": 0}
    assert starts[1]["step"] == 3 and starts[1]["replayed"] in (1, 3)
    straight = make(tmp_path / "straight")
    for step in range(STEPS):
        straight.train(batch(step))
    final = torch.load(os.path.join(run_dir, "final.pt"), weights_only=True)
    assert all(torch.equal(v, final[k]) for k, v in straight.trainer.model.state_dict().items())
