"""``asyncrl bench multinode``: what running over several hosts costs.

Weight sync, on one machine split into three simulated hosts (``ASYNCRL_HOST_ID``: no shared
memory between them, tcp only across):

- node 0: a learner (``publish_weights``, not durable) and a rollout replica reading its store;
- node 1 (its own run directory): a relay (``asyncrl.roles.services.relay``) whose source is the
  learner, and a rollout replica reading the relay's store;
- node 2: the same with a relay of ``transport: broadcast`` (the plugin's broadcast, gloo here,
  on a group of two with the learner, in buckets of 256 MiB).

Every round, one behaviour-cloning ``train_step`` makes a new version (not timed); then, in an
order that rotates from round to round, the three syncs are timed from the driver's side:

- local: the node-0 replica's ``sync`` (it copies the version out of the learner's
  shared-memory store and loads it into its model);
- cross-host: the relay's ``sync`` (it asks the learner's version, pulls the weights over tcp as
  tensor frames, republishes them into node 1's store), then the node-1 replica's ``sync``:
  exactly what ``WeightSync`` does after a step; the relay's part is reported on its own
  (``relay_pull``);
- cross-host broadcast: the same on node 2, the relay receiving the learner's broadcast
  (``relay_broadcast`` its part).

Each is checked to end at the round's version. Medians over ``--rounds`` rounds (after one
untimed round), for two models built from configs (no download): the arith example's GPT-2
(``ARITH``, the model of ``examples/arith``) and a ~100M-parameter GPT-2 (``GPT2_100M``).
Every process uses one torch thread.

Then the shortened main job on one node against two (``benchmarks.multinode_runs``:
``one_node_wall_s``, ``two_node_wall_s``), and a GRPO step on one learner against two
data-parallel ones (``dp1_step_ms_p50``, ``dp2_step_ms_p50``; ``asyncrl.bench.learner``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import msgspec

from asyncrl.dispatch.dispatcher import Dispatcher
from asyncrl.dispatch.handles import Context
from asyncrl.manifest.load import Supervision
from asyncrl.manifest.spec import SPEC_FILE_ENV, GroupInfo, ProcessSpec, write_spec
from asyncrl.observe import logs
from asyncrl.roles.payloads import Sample, Scored, StepResult, TrainBatch
from asyncrl.supervision.supervisor import ChildSpec, Supervisor
from asyncrl.transport import run
from asyncrl.transport.control import CONTROL_SECRET_ENV
from asyncrl.transport.shm import HOST_ID_ENV
from benchmarks.multinode_runs import MANIFEST, free_port, wall_times

__all__ = ["ARITH", "GPT2_100M", "main", "measure", "parameters", "weight_sync"]

ARITH: dict[str, Any] = {
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
"""The arith example's model (``examples/arith/bc_grpo.yaml``'s ``model_config``)."""

GPT2_100M: dict[str, Any] = {
    "model_type": "gpt2",
    "vocab_size": 18432,
    "n_positions": 64,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
"""A GPT-2 of 99.3M parameters: GPT-2 small (12 layers of width 768) with an 18k vocabulary."""

RUN = "bench_multinode"
LIVENESS = 20
"""Missed heartbeats (of 1 s) before a process is taken as hung: on a loaded machine, copying
100M parameters starves a process's event loop for seconds."""
_ROLES: dict[str, tuple[int, str, dict[str, Any]]] = {
    # name: (node, class, config on top of the model)
    "learner": (0, "asyncrl.roles.training.learner:Learner", {"lr": 1e-4, "durable": False}),
    "rollout0": (0, "asyncrl.roles.generation.rollout:Rollout", {"weights_from": "learner"}),
    # No polling: every pull is one the timed sync makes.
    "relay": (1, "asyncrl.roles.services.relay:Relay", {"source": "learner", "poll_s": 0}),
    "rollout1": (1, "asyncrl.roles.generation.rollout:Rollout", {"weights_from": "learner"}),
    "relay_broadcast": (
        2,
        "asyncrl.roles.services.relay:Relay",
        {"source": "learner", "poll_s": 0, "transport": "broadcast"},
    ),
    "rollout2": (2, "asyncrl.roles.generation.rollout:Rollout", {"weights_from": "learner"}),
}


def _children(base: str, model: dict[str, Any], policy: Supervision) -> list[ChildSpec]:
    """The six roles, each on its node: its run directory and its host id."""
    endpoints = {name: f"tcp://127.0.0.1:{free_port()}" for name in _ROLES}
    groups = {name: GroupInfo([e], liveness=LIVENESS) for name, e in endpoints.items()}
    children = []
    for name, (node, target, extra) in _ROLES.items():
        config = dict(extra) if target.endswith(":Relay") else {"model_config": model, **extra}
        spec = ProcessSpec(
            kind="role",
            name=name,
            target=target,
            endpoint=endpoints[name],
            run=RUN,
            run_dir=os.path.join(base, f"node-{node}"),
            config=config,
            parent_pid=os.getpid(),
            groups=groups,
            liveness=LIVENESS,
        )

        def launch(incarnation: int, spec: ProcessSpec = spec) -> tuple[list[str], dict[str, str]]:
            env = {
                SPEC_FILE_ENV: write_spec(msgspec.structs.replace(spec, incarnation=incarnation)),
                "OMP_NUM_THREADS": "1",
                logs.CONSOLE_ENV: "0",
                HOST_ID_ENV: spec.run_dir.rsplit(os.sep, 1)[-1],
            }
            return [sys.executable, "-m", "asyncrl.supervision.process"], env

        children.append(ChildSpec(name, 0, "role", endpoints[name], policy, launch))
    return children


def _demo(step: int, vocab: int) -> TrainBatch:
    """A one-demonstration BC batch: a new version per step at little cost."""
    prompt = [2 + (step + i) % (vocab - 2) for i in range(4)]
    sample = Sample(
        prompt_id=f"d{step}",
        sample_index=0,
        prompt_ids=prompt,
        token_ids=[3 + step % (vocab - 3), 1],
        logprobs=[],
        versions=[],
        finished=True,
        stop_reason="stop",
    )
    return TrainBatch(samples=[Scored(sample=sample)], algorithm="bc", id=f"bench-{step}")


async def _timed(ctx: Context, names: tuple[str, ...], version: int) -> list[float]:
    """Seconds for the ``sync`` of each of ``names``, in turn; each must end at ``version``."""
    seconds = []
    for name in names:
        t0 = time.perf_counter()
        got = await ctx.roles[name].call("sync", None, int, timeout=600)
        seconds.append(time.perf_counter() - t0)
        if got != version:
            raise RuntimeError(f"{name} synced to version {got}, expected {version}")
    return seconds


async def _rounds(base: str, model: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    # As the node agent does: tcp endpoints take STOP only from a holder of the run's secret.
    os.environ.setdefault(CONTROL_SECRET_ENV, secrets.token_hex(16))
    policy = Supervision(startup_timeout_s=600.0, liveness=LIVENESS)
    children = _children(base, model, policy)
    supervisor = Supervisor(children, run=RUN, log_dir=os.path.join(base, "logs"))
    supervised = asyncio.get_running_loop().create_task(supervisor.run())
    groups = {c.name: GroupInfo([c.endpoint], liveness=LIVENESS) for c in children}
    dispatcher = Dispatcher(groups, run=RUN)
    dispatcher.start()
    ctx = Context(dispatcher, run=RUN, run_dir=base, log=None)
    paths = {
        "local": ("rollout0",),
        "cross_host": ("relay", "rollout1"),
        "cross_host_broadcast": ("relay_broadcast", "rollout2"),
    }
    relay_part = {"cross_host": "relay_pull", "cross_host_broadcast": "relay_broadcast"}
    times: dict[str, list[float]] = {k: [] for k in [*paths, *relay_part.values()]}
    try:
        for step in range(1, rounds + 2):
            batch = _demo(step, int(model["vocab_size"]))
            result = await ctx.roles["learner"].call("train_step", batch, StepResult, timeout=600)
            kinds = list(paths)
            order = kinds[step % 3 :] + kinds[: step % 3]  # each kind goes first in turn
            for kind in order:
                seconds = await _timed(ctx, paths[kind], result.version)
                if step > 1:  # the first round warms up
                    times[kind].append(sum(seconds))
                    if kind in relay_part:
                        times[relay_part[kind]].append(seconds[0])
    finally:
        await dispatcher.close()
        supervisor.stop("benchmark done")
        await supervised
    return times


def weight_sync(model: dict[str, Any], rounds: int) -> dict[str, float]:
    """Median sync times of ``model`` over ``rounds`` rounds, in ms: ``local``,
    ``cross_host`` and ``cross_host_broadcast``, and the relay's part of each, ``relay_pull``
    and ``relay_broadcast``."""
    base = tempfile.mkdtemp(prefix="arl-mn-")
    try:
        times = run(_rounds(base, model, rounds))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {kind: statistics.median(series) * 1e3 for kind, series in times.items()}


def parameters(model: dict[str, Any]) -> int:
    """The parameter count of a GPT-2 built from ``model`` (tied embeddings counted once)."""
    d, layers = int(model["n_embd"]), int(model["n_layer"])
    embeddings = (int(model["vocab_size"]) + int(model["n_positions"])) * d
    block = 12 * d * d + 13 * d  # attention 4d² + 4d, MLP 8d² + 5d, two layer norms 4d
    return embeddings + layers * block + 2 * d


def measure(
    *, rounds: int = 10, rounds_100m: int = 5, wall_rounds: int = 1, dp_steps: int = 10
) -> dict[str, Any]:
    """The weight-sync figures (see the module docstring), then, unless their counts are 0,
    one node against two on a shortened main job (``multinode_runs``) and one learner against
    two data-parallel ones (``asyncrl.bench.learner.measure_data_parallel``)."""
    logs.configure(role="bench", console=False)
    arith = weight_sync(ARITH, rounds)
    big = weight_sync(GPT2_100M, rounds_100m)
    more: dict[str, Any] = {}
    if wall_rounds:
        if not os.path.exists(MANIFEST):
            raise SystemExit(
                f"asyncrl bench multinode: {MANIFEST} not found here; run it from an asyncrl "
                f"checkout, or pass --wall-rounds 0"
            )
        more.update(wall_times(os.getcwd(), wall_rounds))
    if dp_steps:
        from asyncrl.bench.learner import measure_data_parallel

        more.update(measure_data_parallel(steps=dp_steps))
    return more | {
        "weight_sync_ms_p50_local": arith["local"],
        "weight_sync_ms_p50_cross_host": arith["cross_host"],
        "weight_sync_100m_ms_p50_local": big["local"],
        "weight_sync_100m_ms_p50_cross_host": big["cross_host"],
        "weight_sync_ms_p50_relay_pull": arith["relay_pull"],
        "weight_sync_100m_ms_p50_relay_pull": big["relay_pull"],
        "weight_sync_ms_p50_cross_host_broadcast": arith["cross_host_broadcast"],
        "weight_sync_100m_ms_p50_cross_host_broadcast": big["cross_host_broadcast"],
        "weight_sync_ms_p50_relay_broadcast": arith["relay_broadcast"],
        "weight_sync_100m_ms_p50_relay_broadcast": big["relay_broadcast"],
        # Below 1: the broadcast is faster than the tcp pull, measured in the same rounds.
        "weight_sync_broadcast_ratio": arith["cross_host_broadcast"] / arith["cross_host"],
        "weight_sync_100m_broadcast_ratio": big["cross_host_broadcast"] / big["cross_host"],
        "weight_sync_arith_params": parameters(ARITH),
        "weight_sync_100m_params": parameters(GPT2_100M),
        "weight_sync_rounds": rounds,
        "weight_sync_100m_rounds": rounds_100m,
    }


def format_table(f: dict[str, Any]) -> str:
    rows = [
        ("arith model", f["weight_sync_arith_params"], "weight_sync_ms_p50"),
        ("GPT-2 100M", f["weight_sync_100m_params"], "weight_sync_100m_ms_p50"),
    ]
    kinds = ("local", "cross_host", "relay_pull", "cross_host_broadcast", "relay_broadcast")
    heads = ("local (shm)", "cross-host", "relay pull", "broadcast", "relay bcast")
    lines = [
        "asyncrl multinode benchmark: weight sync after a step (p50), three simulated hosts",
        "(cross-host: the relay's tcp pull; broadcast: the plugin's, gloo here)",
        "",
        f"{'model':<14}{'parameters':>14}" + "".join(f"{h:>14}" for h in heads),
    ]
    for label, params, key in rows:
        cells = "".join(f"{f[f'{key}_{k}']:>11.1f} ms" for k in kinds)
        lines.append(f"{label:<14}{params:>14,}{cells}")
    if "one_node_wall_s" in f:
        lines += [
            "",
            f"shortened main job (40 BC + 6 RL steps), wall time, median of {f['wall_rounds']}:",
            f"  one node {f['one_node_wall_s']:.1f} s, two simulated nodes "
            f"{f['two_node_wall_s']:.1f} s (two/one {f['two_node_ratio']:.2f})",
        ]
    if "dp1_step_ms_p50" in f:
        lines += [
            "",
            f"GRPO step of {f['dp_samples_per_step']} samples (p50 of {f['dp_steps']}): one "
            f"learner {f['dp1_step_ms_p50']:.1f} ms, two data-parallel "
            f"{f['dp2_step_ms_p50']:.1f} ms (speed-up {f['dp2_speedup']:.2f})",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="asyncrl bench multinode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds, arith model")
    parser.add_argument("--rounds-100m", type=int, default=5, help="timed rounds, 100M model")
    parser.add_argument(
        "--wall-rounds", type=int, default=1, help="one-node/two-node runs of each (0: none)"
    )
    parser.add_argument(
        "--dp-steps", type=int, default=10, help="timed data-parallel learner steps (0: none)"
    )
    args = parser.parse_args(argv)
    figures = measure(
        rounds=max(1, args.rounds),
        rounds_100m=max(1, args.rounds_100m),
        wall_rounds=max(0, args.wall_rounds),
        dp_steps=max(0, args.dp_steps),
    )
    print(json.dumps(figures) if args.json else format_table(figures))
    return 0
