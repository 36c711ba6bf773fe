"""Critics with replicas: two ranks in two processes (gloo, a FileStore), sharded with FSDP2
(``parallel: fsdp``) or replicated, give the values and take the steps one critic gives and
takes, run concurrent calls in replica 0's order on both ranks, refuse calls sent to replica 1,
and exit when a rank dies; through ``asyncrl run``, PPO completes with a sharded critic. What
each rank ran is read from its trace: the span ``lockstep <call>`` the group's lockstep records
for every call (``asyncrl.roles.training.lockstep``)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import zlib
from typing import Any

import msgspec
import pytest
import torch

from asyncrl.observe import trace
from asyncrl.role import RoleContext
from asyncrl.roles.payloads import Sample, Scored
from asyncrl.roles.training.critic import Critic, TrainStep, Values
from tests.conftest import ROOT
from tests.training.test_data_parallel import batches, run_ranks

MODEL = {
    "model_type": "gpt2",
    "vocab_size": 14,
    "n_positions": 24,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 2,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "pad_token_id": 0,
}

# Two epochs of two mini-batches in micro-batches of 12 tokens (the ranks' shares and passes
# differ), the value clip, a KL penalty in the returns, a per-sequence aggregation, activation
# checkpointing (sharded ranks only). float64: float32 sums taken in another order round
# otherwise, and AdamW turns that into differences where a gradient is near zero.
CONFIG: dict[str, Any] = {
    "model_config": MODEL,
    "seed": 3,
    "lr": 3e-3,
    "ppo_epochs": 2,
    "mini_batches": 2,
    "micro_batch_tokens": 12,
    "clip_eps": 0.05,
    "gamma": 0.9,
    "lam": 0.8,
    "kl_mode": "reward",
    "kl_coef": 0.05,
    "aggregation": "seq_mean_token_mean",
    "activation_checkpointing": True,
    "dist_timeout_s": 60.0,
    "dtype": "float64",
}

HELDOUT = [
    Sample(
        prompt_id="h",
        sample_index=k,
        prompt_ids=[3, 5 + k],
        token_ids=[2 + (3 * k + j) % 12 for j in range(1 + k)],
        logprobs=[],
        versions=[],
        finished=True,
        stop_reason="stop",
    )
    for k in range(5)
]
"""Samples the critic never trains on: their values after each step show its weights."""


async def ppo_rounds(critic: Any) -> dict[str, Any]:
    """Three rounds as a PPO program calls the critic: values of a batch's samples, a step on
    the batch with them, then values of ``HELDOUT`` under the new weights."""
    out: dict[str, Any] = {"values": [], "results": []}
    for batch in batches():
        samples = [s.sample for s in batch.samples]
        values = await critic.values(samples)
        scored = [
            Scored(sample=s.sample, reward=s.reward, ref_logprobs=s.ref_logprobs, values=v)
            for s, v in zip(batch.samples, values, strict=True)
        ]
        result = await critic.train_step(scored)
        out["values"] += [values, await critic.values(HELDOUT)]
        out["results"].append(msgspec.to_builtins(result))
    return out


def concurrent_calls() -> list[Values | TrainStep]:
    """Calls a program and a sample pipeline might make at once: values of every batch and of
    ``HELDOUT``, and steps on every batch with made-up old values; no two alike, so that a
    reply tells its call."""
    calls: list[Values | TrainStep] = []
    for step, batch in enumerate(batches()):
        calls.append(Values([s.sample for s in batch.samples]))
        scored = [
            Scored(
                sample=s.sample,
                reward=s.reward,
                values=[0.1 * j - 0.2 for j in range(len(s.sample.token_ids))],
            )
            for s in batch.samples
        ]
        calls += [TrainStep(scored), Values(HELDOUT[: 3 + step])]
    return calls


def ran(folder: str) -> list[list[Any]]:
    """What each rank of a group ran, in rank order, from the traces in ``folder``: each
    ``lockstep`` span as ``[call, index, crc, thread]``, in the order the rank ran them."""
    by_rank: dict[int, list[list[Any]]] = {}
    for proc in trace.load(folder):
        spans = sorted((e for e in proc.spans if e[1].startswith("lockstep ")), key=lambda e: e[3])
        by_rank[proc.replica] = [
            [e[1].removeprefix("lockstep "), e[5]["index"], e[5]["crc"], e[2]] for e in spans
        ]
    return [by_rank[r] for r in sorted(by_rank)]


def crc(call: Values | TrainStep) -> int:
    """The checksum a ``lockstep`` span records of ``call``: of its bytes on the group."""
    return zlib.crc32(msgspec.msgpack.encode(call))


RANK_SCRIPT = """
import asyncio, functools, json, sys
import msgspec, torch
torch.set_num_threads(1)
import asyncrl.roles.training.critic as critic_module
from asyncrl.role import RoleContext
from asyncrl.roles.training.critic import Critic, TrainStep, Values
from asyncrl.roles.training.sharding import full_buckets
from asyncrl.transport import tracing
from tests.training.test_critic_sharding import (
    CONFIG, HELDOUT, concurrent_calls, ppo_rounds, replica_calls,
)
from tests.helpers.waiting import wait_until_async

rank, run_dir, out, parallel, mode = (
    int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
)
# What the group runs, as its lockstep records it: a trace per rank.
tracing.install(tracing.Recorder(f"{out}/trace-{parallel}-{mode}", label=f"critic.{rank}"))

if mode == "concurrent":
    # Replica 0's keep-alive announces Idle after 2 ms without a call: between the calls too.
    critic_module.Lockstep = functools.partial(critic_module.Lockstep, idle_s=0.002)

async def main():
    ctx = RoleContext.local(config=dict(CONFIG, parallel=parallel), name="critic",
                            replica=rank, replicas=2, run_dir=run_dir, capacity=4)
    critic = Critic(ctx)
    await critic.setup()
    report = {"blocks": sorted({type(m).__name__ for m in critic.trainer.model.modules()}
                               & {"FSDPCheckpointWrapper", "GPT2Block"})}
    if rank == 0:
        if mode == "rounds":
            report["rounds"] = await ppo_rounds(critic)
        else:
            replies = await asyncio.gather(*(
                critic.values(c.samples) if isinstance(c, Values) else critic.train_step(c.batch)
                for c in concurrent_calls()
            ))
            report["replies"] = [msgspec.to_builtins(r) for r in replies]
            await wait_until_async(  # and with no call
                lambda: critic.lockstep.idles >= 3, timeout=60, what="three idle rounds"
            )
        await critic.ctx.offload(critic.lockstep.close)
        # Counted once closed: a keep-alive may still go out until then.
        report["idles"] = critic.lockstep.idles
    else:
        refused = []
        for method, payload in replica_calls():
            try:
                await getattr(critic, method)(payload)
            except ValueError as exc:
                refused.append(str(exc))
        report["refused"] = refused
        report["closed"] = await critic.ctx.offload(critic.lockstep.close, 120.0)
        report["idles"] = critic.lockstep.idles
    # Both ranks left the lockstep: gather the whole model together, then leave the group.
    whole = {k: v.clone() for b in full_buckets(critic.trainer.model, 2**20) for k, v in b.items()}
    torch.save(whole, f"{out}/{parallel}-{mode}{rank}.pt")
    await critic.teardown()
    with open(f"{out}/{parallel}-{mode}{rank}.json", "w") as f:
        json.dump(report, f)

asyncio.run(main())
"""


def replica_calls() -> list[tuple[str, Any]]:
    """What replica 1 is sent directly, and refuses."""
    return [("values", HELDOUT), ("train_step", [Scored(sample=s) for s in HELDOUT])]


def _two_ranks(tmp_path: Any, parallel: str, mode: str) -> list[dict[str, Any]]:
    run_dir, out = str(tmp_path / f"run-{parallel}-{mode}"), str(tmp_path)
    report = os.path.join(out, f"{parallel}-{mode}{{rank}}.json")
    return run_ranks(RANK_SCRIPT, [run_dir, out, parallel, mode], report, timeout=300)


def _one_critic(tmp_path: Any) -> Critic:
    torch.set_num_threads(1)
    config = dict(CONFIG, parallel="replicate")
    critic = Critic(RoleContext.local(config=config, name="critic", run_dir=str(tmp_path / "1")))
    asyncio.run(critic.setup())
    return critic


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _rows_diff(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(r) for r in a] == [len(r) for r in b]
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return max((abs(x - y) for x, y in pairs), default=0.0)


REFUSED = (
    "critic.1: a critic with 2 replicas runs every call on all of them in the order replica 0 "
    "(its lead) sets; send {method} to replica 0 (CriticClient does: "
    "Handle.call(..., replica=0))"
)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel", ["fsdp", "replicate"])
def test_two_critic_ranks_give_one_critics_values_and_steps(tmp_path: Any, parallel: str) -> None:
    ranks = _two_ranks(tmp_path, parallel, "rounds")
    one = _one_critic(tmp_path)
    start = {k: v.clone() for k, v in one.trainer.model.state_dict().items()}
    single = asyncio.run(ppo_rounds(one))
    rounds = ranks[0]["rounds"]
    # Every values call (a batch's before its step, HELDOUT's after it) within 1e-10.
    assert len(rounds["values"]) == len(single["values"]) == 6
    for mine, theirs in zip(rounds["values"], single["values"], strict=True):
        assert _rows_diff(mine, theirs) < 1e-10
    for mine, theirs in zip(rounds["results"], single["results"], strict=True):
        assert (mine["step"], mine["optimizer_steps"]) == (theirs["step"], 4)
        for key in ("value_loss", "value_clip_fraction", "grad_norm"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-12), key
    assert any(r["value_clip_fraction"] > 0 for r in single["results"])  # the clip took part
    # The parameters after three steps, gathered whole on both ranks, within 1e-10.
    params = [
        torch.load(tmp_path / f"{parallel}-rounds{r}.pt", weights_only=True) for r in range(2)
    ]
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    assert _max_diff(params[0], one.trainer.model.state_dict()) < 1e-10
    assert _max_diff(start, one.trainer.model.state_dict()) > 1e-3  # the steps moved the weights
    # Replica 1 ran the same nine calls (its share of each), in the thread of the group's
    # lockstep, and refused the ones sent to it.
    leader, follower = ran(str(tmp_path / f"trace-{parallel}-rounds"))
    assert [r[:3] for r in follower] == [r[:3] for r in leader]
    assert [r[0] for r in leader] == ["values", "train_step", "values"] * 3
    assert [r[1] for r in leader] == list(range(9))
    assert {r[3] for r in follower} == {"critic.1 lockstep follower"}
    assert ranks[1]["refused"] == [REFUSED.format(method=m) for m, _ in replica_calls()]
    assert ranks[1]["closed"] is True
    blocks = ["FSDPCheckpointWrapper", "GPT2Block"] if parallel == "fsdp" else ["GPT2Block"]
    assert ranks[0]["blocks"] == ranks[1]["blocks"] == blocks


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_concurrent_calls_to_two_sharded_critic_ranks_run_in_one_order(tmp_path: Any) -> None:
    """Nine values and train_step calls at once on replica 0 (four worker threads), with its
    keep-alive announcing between them: no deadlock, and no divergence: both ranks ran one
    sequence, and one critic running that sequence gives the same replies and weights."""
    leader, follower = _two_ranks(tmp_path, "fsdp", "concurrent")
    calls = concurrent_calls()
    led, followed = ran(str(tmp_path / "trace-fsdp-concurrent"))
    assert len(led) == len(calls)
    assert leader["idles"] >= 3
    assert [r[:3] for r in followed] == [r[:3] for r in led]
    assert follower["idles"] == leader["idles"]
    # Every call ran once, in an order of replica 0's making; each caller's reply, that of
    # its own call, is within 1e-10 of one critic's running replica 0's order.
    replies = zip(calls, leader["replies"], strict=True)
    by_crc = {crc(call): (call, reply) for call, reply in replies}
    assert len(by_crc) == len(calls) and sorted(r[2] for r in led) == sorted(by_crc)
    one = _one_critic(tmp_path)
    steps = []
    for kind, _, checksum, _ in led:
        call, reply = by_crc[checksum]
        if isinstance(call, Values):
            assert kind == "values"
            assert _rows_diff(reply, asyncio.run(one.values(call.samples))) < 1e-10
        else:
            assert kind == "train_step"
            mine = msgspec.to_builtins(asyncio.run(one.train_step(call.batch)))
            assert reply["step"] == mine["step"]
            assert reply["value_loss"] == pytest.approx(mine["value_loss"], rel=1e-6)
            steps.append(reply["step"])
    assert steps == [1, 2, 3]
    params = torch.load(tmp_path / "fsdp-concurrent0.pt", weights_only=True)
    assert _max_diff(params, one.trainer.model.state_dict()) < 1e-10


DEATH_SCRIPT = """
import asyncio, os, sys
import torch
torch.set_num_threads(1)
from asyncrl.role import RoleContext
from asyncrl.roles.training.critic import Critic
from tests.training.test_critic_sharding import CONFIG, HELDOUT

rank, run_dir, dead = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])

async def main():
    ctx = RoleContext.local(config=dict(CONFIG, parallel="fsdp", dist_timeout_s=20.0),
                            name="critic", replica=rank, replicas=2, run_dir=run_dir)
    critic = Critic(ctx)
    await critic.setup()
    if rank == dead:
        os._exit(3)  # dies with the group formed
    if rank == 0:
        await critic.values(HELDOUT)
        print("replica 0 answered with rank 1 dead", flush=True)
    else:
        await critic.ctx.offload(critic.lockstep.close, 120.0)
        print("replica 1 heard replica 0 close", flush=True)

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dead", [0, 1])
def test_when_a_critic_rank_dies_the_other_exits(tmp_path: Any, dead: int) -> None:
    """A rank dies with the group formed: the other cannot reach it at its next collective (a
    follower waiting for replica 0's next call, or replica 0 announcing one) and exits rather
    than answer or wait, so that ``one_for_all`` (or its own node's agent, across nodes)
    restarts it with the group."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DEATH_SCRIPT, str(rank), str(tmp_path), str(dead)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    alive = 1 - dead
    assert procs[dead].returncode == 3, outs[dead][1][-3000:]
    assert procs[alive].returncode == 1, outs[alive][1][-3000:]
    assert outs[alive][0] == ""  # neither answered nor closed
    exiting = next(line for line in outs[alive][1].splitlines() if "exiting" in line)
    hint = (
        "in a group of 2 (the timeout is 20 s): a rank died, or did not take part; every rank "
        "must run every call replica 0 announces (LearnerClient and CriticClient send their "
        "calls to replica 0; a call sent to another replica is refused)"
    )
    if alive == 1:  # waiting for the next call: the wait is what fails
        assert exiting.startswith(
            "critic.1: exiting: critic: rank 1: the group's next call (its size) failed ("
        ), exiting
        assert exiting.endswith(hint), exiting
    else:
        # Sending the call may still go out before the death is seen; then a collective of
        # running it fails instead.
        assert exiting.startswith("critic.0: exiting: critic: rank 0: "), exiting
        assert exiting.endswith(hint) or exiting.endswith(
            "; the other ranks may be waiting at another collective, so the group must restart"
        ), exiting


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ppo_runs_with_two_sharded_critic_ranks_and_survives_their_restart(run_dir: str) -> None:
    """``asyncrl run``: PPO on the arithmetic task with a critic of two FSDP ranks under
    ``one_for_all``, the program calling it through ``CriticClient``. Replica 0 dies after
    computing the second step's values, before replying: the group restarts together, the
    values call (idempotent) runs again on the new replica 0, and the run completes."""
    from tests.integration.test_programs import run_program

    critic = "critic: {class: 'asyncrl.roles.training.critic:Critic'}"
    faults = {"kill_before_reply": {"method": "values", "every": 2, "incarnations": 1}}
    overrides = (
        "roles.critic.replicas=2",
        "roles.critic.supervision.strategy=one_for_all",
        "roles.critic.config.parallel=fsdp",
        f"roles.critic.env.ASYNCRL_FAULTS='{json.dumps(faults)}'",
    )
    result = run_program(run_dir, "ppo", 3, critic, overrides=overrides)
    assert len(result["rewards"]) == 3
    with open(os.path.join(run_dir, "report.json")) as f:
        assert json.load(f)["restarts"]["critic"] == 2  # each replica once, together
    # Replica 0 answered every call (the killed one in both incarnations); replica 1 took none
    # directly and ran each one with it.
    served: dict[int, list[int]] = {}
    for replica in range(2):
        with open(os.path.join(run_dir, "logs", f"critic.{replica}.jsonl")) as f:
            lines = [json.loads(line) for line in f]
        served[replica] = [r["served"] for r in lines if r.get("event") == "stopping"]
    # The first incarnation died before it stopped; the second served the values call sent
    # again and the rest: values and train_step of steps 2 and 3.
    assert served == {0: [4], 1: [0]}
