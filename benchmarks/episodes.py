"""``asyncrl bench episodes``: multi-turn episodes per second against the number of environment
replicas, sync against async, when environment steps take widely spread times.

One ``asyncrl run`` (real processes over ipc: the driver, one simulated rollout replica, as many
environment replicas as the largest count asked) runs ``EpisodeRunner`` episodes against
``episode_sim``'s roles: a policy turn takes ``--gen-ms`` (8 tokens, finished), an environment
step a log-normal time of median ``--median-ms`` and log-space standard deviation ``--sigma``
(default 1.0), an episode 3 to 5 turns; every draw is seeded by the task and the turn, so both modes
wait on exactly the same steps. Each episode in flight is held by its own environment replica
(the driver pins its reset there; the runner would otherwise send a reset to any replica with
room, and two episodes could queue on one), so N replicas hold N episodes at once:

- **sync**: batches of N episodes run together (``asyncio.gather``); the next batch starts
  when the slowest episode of the batch has ended;
- **async**: N episodes always in flight; a new one starts on a replica the moment the
  episode it held ends.

At each replica count N both modes run the same ``--batches`` x N episodes a round, sync then
async, ``--rounds`` rounds; the figures are medians over rounds: ``episodes_per_s_sync``,
``episodes_per_s_async``, ``ratio`` (async over sync, per round), and the rollout's idle
fraction in each mode, ``idle_fraction_sync`` and ``idle_fraction_async``: the share of the
mode's wall time during which the rollout replica had no ``generate`` call in progress, as the
replica itself recorded it (``TurnRollout.idle``; it has a slot for every episode in flight, so
a turn never queues). ``model_ratio`` is the same ratio on a
zero-overhead clock: the episodes' drawn durations scheduled as each mode schedules them.
``--quick`` runs 1 and 4 replicas, 4 batches, 3 rounds (about 15 s).

``endpoint_over_runner``: an RL step's episodes (``STEP_EPISODES``, 8 prompts x 8, all in
flight at once as the sample pipeline runs them) played through the OpenAI-compatible endpoint
by an agent on the official ``openai`` client (one chat request a turn, its environment reached
through ``EnvironmentClient``), over the same episodes played by ``EpisodeRunner``: the same
tasks, rollout and environment (the ``tools`` role: ``STEP_ENV_REPLICAS`` replicas of the same
simulated environment with room for the whole step), ``--rounds`` rounds, each runner then
endpoint; the median of the rounds' ratios, with each path's median step seconds
(``runner_step_s``, ``endpoint_step_s``). It measures what the endpoint adds (HTTP, the chat
rendering, the history check, the trajectory) and what the ``openai`` client costs in the same
event loop: the rollout and the environment wait the same. ``plain_http_over_runner`` (with
``plain_http_step_s``) plays the same agent with one ``aiohttp`` session posting the request's
JSON itself, in the same rounds: what the endpoint costs an agent whose HTTP client adds little.
``null`` when ``openai`` or ``aiohttp`` is not installed (``endpoint_unavailable`` says which).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from asyncrl.bench.harness import finished_run
from asyncrl.roles.agents.environment_client import EnvironmentClient
from asyncrl.roles.agents.episodes import EpisodeRunner, Trajectory
from asyncrl.roles.payloads import SamplingParams
from benchmarks.episode_sim import MAX_TURNS, MIN_TURNS, episode_seconds, turns_of

__all__ = [
    "PARAMS",
    "QUICK",
    "format_table",
    "ideal_seconds",
    "main",
    "manifest",
    "measure",
    "program",
    "task_plan",
]

PARAMS: dict[str, Any] = {
    "replicas": [1, 2, 4, 8],
    "batches": 6,
    "rounds": 5,
    "gen_ms": 10.0,
    "median_ms": 20.0,
    "sigma": 1.0,
    "seed": 0,
}
"""The full run's parameters (about a minute on an idle machine)."""
QUICK: dict[str, Any] = {"replicas": [1, 4], "batches": 4, "rounds": 3}
"""What ``--quick`` changes."""
TOKENS = 8
"""Tokens of one policy turn."""
STEP_TIMEOUT_S = 30.0
"""A step's deadline: far past any drawn latency, so no step times out."""
PROMPT = list(b"act: ")
RUN_TIMEOUT_S = 600.0
STEP_EPISODES = 64
"""The episodes of one RL step in ``endpoint_over_runner`` (8 prompts x 8)."""
STEP_ENV_REPLICAS = 4
"""Replicas of the ``tools`` environment that ``endpoint_over_runner`` plays on."""

# -- the control-flow program (runs in the driver process) -----------------------------------


def _encode(text: str) -> list[int]:
    return list(text.encode())


def _decode(ids: list[int]) -> str:
    return bytes(ids).decode(errors="replace")  # the policy's tokens are letters


class _Pinned:
    """The environment group's handle, with every reset sent to one replica."""

    def __init__(self, env: Any, replica: int) -> None:
        self.env = env
        self.replica = replica

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        if method == "reset":
            kw["replica"] = self.replica
        return await self.env.call(method, payload, reply_type, **kw)


def _check(traj: Trajectory, task: int, seed: int) -> None:
    """An episode must end as drawn: every step taken, nothing lost, timed out or failed."""
    steps = len(traj.turn_rewards)
    troubles = (traj.restarts, traj.replays, traj.timeouts, traj.errors)
    if not traj.done or steps != turns_of(task, seed) or any(troubles):
        raise RuntimeError(
            f"bench episodes: episode {traj.episode_id!r} ended after {steps} of "
            f"{turns_of(task, seed)} steps (done {traj.done}; restarts, replays, timeouts, "
            f"errors {troubles}); the roles' logs under the run directory say why"
        )


async def _run_mode(
    mode: str, runners: Sequence[EpisodeRunner], tasks: list[int], tag: str, seed: int
) -> float:
    """Run ``tasks`` on the ``len(runners)`` replicas in ``mode``; the seconds it took.

    Raises:
        RuntimeError: an episode did not end as drawn (see ``_check``).
    """
    n = len(runners)
    trajectories: list[tuple[Trajectory, int]] = []

    async def one(runner: EpisodeRunner, task: int) -> None:
        traj = await runner.run(f"{tag}.{task}", task, PROMPT)
        trajectories.append((traj, task))

    start = time.perf_counter()
    if mode == "sync":
        for at in range(0, len(tasks), n):
            batch = tasks[at : at + n]
            await asyncio.gather(*(one(runners[k], task) for k, task in enumerate(batch)))
    else:
        queue = iter(tasks)

        async def slot(runner: EpisodeRunner) -> None:
            for task in queue:  # shared: a free slot takes the next task
                await one(runner, task)

        async with asyncio.TaskGroup() as group:
            for runner in runners:
                group.create_task(slot(runner))
    seconds = time.perf_counter() - start
    for traj, task in trajectories:
        _check(traj, task, seed)
    return seconds


def ideal_seconds(durations: Sequence[float], n: int, mode: str) -> float:
    """Wall seconds of episodes of ``durations`` on ``n`` replicas with no overhead: sync sums
    each batch's longest; async hands each episode, in order, to the first replica free."""
    if mode == "sync":
        return sum(max(durations[at : at + n]) for at in range(0, len(durations), n))
    free = [0.0] * n
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


async def _measure(
    ctx: Any, runners: list[EpisodeRunner], tasks: list[int], tag: str
) -> dict[str, dict[str, float]]:
    """Both modes on ``tasks``, sync first; per mode: episodes/s, the rollout's idle fraction,
    and the model's episodes/s."""
    cfg = ctx.config
    seed, gen_s = int(cfg["seed"]), float(cfg["gen_ms"]) / 1e3
    median_s, sigma = float(cfg["median_ms"]) / 1e3, float(cfg["sigma"])
    durations = [episode_seconds(t, gen_s, median_s, sigma, seed) for t in tasks]
    out: dict[str, dict[str, float]] = {}
    for mode in ("sync", "async"):
        t0 = time.time()
        seconds = await _run_mode(mode, runners, tasks, f"{tag}.{mode}", seed)
        usage = await ctx.roles["rollout"].call("idle", [t0, time.time()], dict[str, float])
        ideal = ideal_seconds(durations, len(runners), mode)
        out[mode] = {
            "episodes_per_s": len(tasks) / seconds,
            "idle": usage["idle"],
            "model_episodes_per_s": len(tasks) / ideal,
        }
    return out


def _row(n: int, episodes: int, rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    def median(mode: str, key: str) -> float:
        return statistics.median(r[mode][key] for r in rounds)

    def ratios(key: str) -> list[float]:
        return [r["async"][key] / r["sync"][key] for r in rounds]

    return {
        "replicas": n,
        "episodes": episodes,
        "episodes_per_s_sync": median("sync", "episodes_per_s"),
        "episodes_per_s_async": median("async", "episodes_per_s"),
        "ratio": statistics.median(ratios("episodes_per_s")),
        "idle_fraction_sync": median("sync", "idle"),
        "idle_fraction_async": median("async", "idle"),
        "model_episodes_per_s_sync": median("sync", "model_episodes_per_s"),
        "model_episodes_per_s_async": median("async", "model_episodes_per_s"),
        "model_ratio": statistics.median(ratios("model_episodes_per_s")),
        "rounds_ratio": ratios("episodes_per_s"),
    }


def task_plan(counts: Sequence[int], batches: int, rounds: int) -> list[tuple[int, list[int]]]:
    """The tasks each (replica count, round) runs, in order, as ``(count, tasks)``: ``batches``
    x count tasks of its own, after the warm-up's ``range(max(counts))``."""
    first = max(counts)
    plan = []
    for n in counts:
        for _ in range(rounds):
            plan.append((n, list(range(first, first + batches * n))))
            first += batches * n
    return plan


Chat = Callable[[list[dict[str, Any]], str], Awaitable[str]]
"""An agent's chat request: the messages and the episode id (``user``) -> the reply's text."""


def _openai_chat(client: Any) -> Chat:
    """A chat request on the official ``openai`` client."""

    async def chat(messages: list[dict[str, Any]], user: str) -> str:
        reply = await client.chat.completions.create(
            model="policy", messages=messages, user=user, max_tokens=TOKENS
        )
        text: str = reply.choices[0].message.content
        return text

    return chat


def _plain_http_chat(session: Any, server: Any) -> Chat:
    """A chat request as JSON posted with one ``aiohttp`` session."""
    url = f"{server.url}/chat/completions"
    headers = {"Authorization": f"Bearer {server.api_key}"}

    async def chat(messages: list[dict[str, Any]], user: str) -> str:
        body = {"model": "policy", "messages": messages, "user": user, "max_tokens": TOKENS}
        async with session.post(url, json=body, headers=headers) as response:
            response.raise_for_status()
            reply = await response.json()
        text: str = reply["choices"][0]["message"]["content"]
        return text

    return chat


async def _endpoint_episode(
    chat: Chat, server: Any, env: EnvironmentClient, episode_id: str, task: int
) -> Trajectory:
    """One episode as an agent plays it through the endpoint: a chat request a turn, the
    reply's text the action, the observation the next user message."""
    episode = await env.reset(episode_id, task)
    messages: list[dict[str, Any]] = [{"role": "user", "content": episode.observation}]
    reward = 0.0
    while not episode.done:
        text = await chat(messages, episode_id)
        said = await env.step(episode, text)
        reward += said.reward
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": said.observation},
        ]
    traj: Trajectory = server.trajectory(episode_id, reward=reward)
    server.close(episode_id)
    return traj


async def _endpoint_over_runner(ctx: Any, rounds: int, seed: int) -> dict[str, Any]:
    """The figures of ``endpoint_over_runner`` (see the module docstring)."""
    try:
        import aiohttp
        import openai

        from asyncrl.roles.agents.openai_server import OpenAIServer
    except ImportError as exc:
        return {"endpoint_over_runner": None, "endpoint_unavailable": str(exc)}
    runner = EpisodeRunner(
        ctx.roles["rollout"],
        ctx.roles["tools"],
        encode=_encode,
        decode=_decode,
        params=SamplingParams(max_new_tokens=TOKENS),
        max_turns=MAX_TURNS,
        step_timeout_s=STEP_TIMEOUT_S,
    )
    env = EnvironmentClient(ctx.roles["tools"], step_timeout_s=STEP_TIMEOUT_S)
    server = OpenAIServer(ctx.roles["rollout"], encode=_encode, decode=_decode, context_length=4096)
    times: dict[str, list[float]] = {"runner": [], "endpoint": [], "plain": []}
    async with server, aiohttp.ClientSession() as session:
        client = openai.AsyncOpenAI(base_url=server.url, api_key=server.api_key, max_retries=0)
        chats = {"endpoint": _openai_chat(client), "plain": _plain_http_chat(session, server)}
        first = 1_000_000
        for r in range(rounds + 1):  # the first round warms every path up, and is not kept
            tasks = list(range(first + r * STEP_EPISODES, first + (r + 1) * STEP_EPISODES))
            for path in ("runner", "endpoint", "plain"):
                tag = f"step{r}.{path}"
                start = time.perf_counter()
                if path == "runner":
                    played = await asyncio.gather(
                        *(runner.run(f"{tag}.{t}", t, PROMPT) for t in tasks)
                    )
                else:
                    chat = chats[path]
                    played = await asyncio.gather(
                        *(_endpoint_episode(chat, server, env, f"{tag}.{t}", t) for t in tasks)
                    )
                seconds = time.perf_counter() - start
                for traj, task in zip(played, tasks, strict=True):
                    _check(traj, task, seed)
                if r:
                    times[path].append(seconds)
        await client.close()
    await runner.aclose()
    await env.aclose()
    ratios = [e / r for e, r in zip(times["endpoint"], times["runner"], strict=True)]
    plain = [p / r for p, r in zip(times["plain"], times["runner"], strict=True)]
    return {
        "endpoint_over_runner": statistics.median(ratios),
        "plain_http_over_runner": statistics.median(plain),
        "runner_step_s": statistics.median(times["runner"]),
        "endpoint_step_s": statistics.median(times["endpoint"]),
        "plain_http_step_s": statistics.median(times["plain"]),
        "step_episodes": STEP_EPISODES,
        "rounds_endpoint_over_runner": ratios,
        "rounds_plain_http_over_runner": plain,
    }


async def program(ctx: Any) -> dict[str, Any]:
    """Measure every replica count of ``ctx.config`` (see the module docstring) on the tasks of
    ``task_plan``, the same in both modes; return the rows."""
    cfg = ctx.config
    counts, batches, rounds = list(cfg["replicas"]), int(cfg["batches"]), int(cfg["rounds"])
    params = SamplingParams(max_new_tokens=TOKENS)
    runners = [
        EpisodeRunner(
            ctx.roles["rollout"],
            _Pinned(ctx.roles["env"], k),
            encode=_encode,
            decode=_decode,
            params=params,
            max_turns=MAX_TURNS,
            step_timeout_s=STEP_TIMEOUT_S,
        )
        for k in range(max(counts))
    ]
    # Warm-up: every replica's connection made, the driver's code paths run once.
    await _run_mode("async", runners, list(range(len(runners))), "warmup", int(cfg["seed"]))
    measured: dict[int, list[dict[str, dict[str, float]]]] = {n: [] for n in counts}
    for n, tasks in task_plan(counts, batches, rounds):
        tag = f"n{n}.r{len(measured[n])}"
        measured[n].append(await _measure(ctx, runners[:n], tasks, tag))
    for runner in runners:
        await runner.aclose()
    rows = [_row(n, batches * n, measured[n]) for n in counts]
    step = await _endpoint_over_runner(ctx, rounds, int(cfg["seed"]))
    return {"rows": rows, **step, "load_avg_1m": os.getloadavg()[0]}


# -- the benchmark (runs the manifest) ---------------------------------------------------------


def manifest(p: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a run with parameters ``p`` (``PARAMS``'s keys), as a mapping."""
    most = max(p["replicas"])
    return {
        "run": {"name": "bench-episodes", "program": "benchmarks.episodes:program", "config": p},
        "roles": {
            "rollout": {
                "class": "benchmarks.episode_sim:TurnRollout",
                "capacity": most,  # one turn of each episode in flight: none ever queues
                "config": {"gen_s": p["gen_ms"] / 1e3, "tokens": TOKENS},
            },
            "env": {
                "class": "benchmarks.episode_sim:SpreadEnv",
                "replicas": most,
                "capacity": 1,
                "config": {
                    "median_s": p["median_ms"] / 1e3,
                    "sigma": p["sigma"],
                    "seed": p["seed"],
                },
            },
            # endpoint_over_runner's environment: room for a whole RL step's episodes.
            "tools": {
                "class": "benchmarks.episode_sim:SpreadEnv",
                "replicas": STEP_ENV_REPLICAS,
                "capacity": STEP_EPISODES,
                "config": {
                    "median_s": p["median_ms"] / 1e3,
                    "sigma": p["sigma"],
                    "seed": p["seed"],
                },
            },
        },
    }


def measure(p: dict[str, Any]) -> dict[str, Any]:
    """Run the manifest of ``p`` with ``asyncrl run`` in a fresh run directory; the figures.

    Raises:
        RuntimeError: the run failed; the message holds the end of its output.
    """
    run_dir = tempfile.mkdtemp(prefix="arl-be-")  # short: ipc socket paths live under it
    try:
        start = time.perf_counter()
        report = finished_run(manifest(p), run_dir, "bench episodes: the run", RUN_TIMEOUT_S)
        result: dict[str, Any] = report["result"]
        fixed = {"min_turns": MIN_TURNS, "max_turns": MAX_TURNS, "tokens": TOKENS}
        return {"params": {**p, **fixed}, **result, "wall_s": time.perf_counter() - start}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


# -- the report --------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_table(figures: dict[str, Any]) -> str:
    """The figures of ``measure`` as a readable table."""
    p = figures["params"]
    lines = [
        "asyncrl episodes benchmark: real rollout and environment roles, simulated latency",
        f"policy turns of {p['gen_ms']:g} ms ({TOKENS} tokens); environment steps log-normal, "
        f"median {p['median_ms']:g} ms, sigma {p['sigma']}; {MIN_TURNS} to {MAX_TURNS} turns "
        f"an episode; {p['batches']} x N episodes a mode a round, {p['rounds']} rounds "
        "interleaved (sync, then async), medians. Model: the same draws, no overhead.",
        "",
        f"{'replicas':>8}{'episodes':>10}{'sync ep/s':>11}{'async ep/s':>12}{'async/sync':>12}"
        f"{'model':>8}{'rollout idle sync':>19}{'async':>8}",
    ]
    for r in figures["rows"]:
        lines.append(
            f"{r['replicas']:>8}{r['episodes']:>10}{r['episodes_per_s_sync']:>11.1f}"
            f"{r['episodes_per_s_async']:>12.1f}{r['ratio']:>12.2f}{r['model_ratio']:>8.2f}"
            f"{_pct(r['idle_fraction_sync']):>19}{_pct(r['idle_fraction_async']):>8}"
        )
    ratio = figures.get("endpoint_over_runner")
    if ratio is None:
        why = figures.get("endpoint_unavailable", "not measured")
        lines += ["", f"endpoint over runner: not measured ({why})"]
    else:
        lines += [
            "",
            f"an RL step of {figures['step_episodes']} episodes: runner "
            f"{figures['runner_step_s']:.2f} s, endpoint (openai client) "
            f"{figures['endpoint_step_s']:.2f} s, endpoint (plain HTTP) "
            f"{figures['plain_http_step_s']:.2f} s; over runner: openai client {ratio:.2f}, "
            f"plain HTTP {figures['plain_http_over_runner']:.2f} (medians of the rounds' ratios)",
        ]
    lines += ["", f"{figures['wall_s']:.0f} s, load average {figures['load_avg_1m']:.1f}"]
    return "\n".join(lines)


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(
            f"expected distinct replica counts >= 1 separated by commas (e.g. 1,2,4,8), "
            f"got {text!r}"
        )
    return counts


def _problems(p: dict[str, Any]) -> list[str]:
    """Every bad parameter of ``p``, each with the option that sets it."""
    bounds = (
        ("batches", "--batches", p["batches"] >= 1, "an int >= 1"),
        ("rounds", "--rounds", p["rounds"] >= 1, "an int >= 1"),
        ("gen_ms", "--gen-ms", p["gen_ms"] >= 0, ">= 0"),
        ("median_ms", "--median-ms", p["median_ms"] > 0, "> 0"),
        ("sigma", "--sigma", p["sigma"] >= 0, ">= 0"),
    )
    return [f"{opt}: expected {want}, got {p[key]}" for key, opt, ok, want in bounds if not ok]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="asyncrl bench episodes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--quick", action="store_true", help="1 and 4 replicas, 4 batches, 3 rounds (for tests)"
    )
    parser.add_argument("--replicas", type=_counts, help="replica counts (default 1,2,4,8)")
    parser.add_argument("--batches", type=int, help="sync batches a mode a round (default 6)")
    parser.add_argument("--rounds", type=int, help="rounds at each replica count (default 5)")
    parser.add_argument("--gen-ms", type=float, help="a policy turn's milliseconds (default 10)")
    parser.add_argument("--median-ms", type=float, help="a step's median milliseconds (default 20)")
    parser.add_argument("--sigma", type=float, help="a step's log-space std. dev. (default 1.0)")
    parser.add_argument("--seed", type=int, help="seeds the turns and latencies (default 0)")
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
