"""The program of test_external_env: episodes of a bisecting policy against the command-role
environment of examples/external_role/guess_env.py, one replica of which it kills mid-run."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from typing import Any

from asyncrl.dispatch.handles import Context
from asyncrl.roles.agents.episodes import EpisodeRunner, Trajectory
from asyncrl.roles.payloads import GenerateBatch, Sample, SamplingParams


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(map(chr, ids))


class Bisect:
    """A policy in the program: guesses the middle of the last interval the game told."""

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        assert isinstance(payload, GenerateBatch)
        (request,) = payload.requests
        await asyncio.sleep(0.01)  # a turn takes time, so episodes are in flight at the kill
        low, high = map(int, re.findall(r"(\d+) to (\d+)", decode(request.prompt.token_ids))[-1])
        tokens = encode(f" {(low + high) // 2} ")
        return [
            Sample(
                prompt_id=request.prompt.id,
                sample_index=0,
                prompt_ids=request.prompt.token_ids,
                token_ids=tokens,
                logprobs=[0.0] * len(tokens),
                versions=[0] * len(tokens),
                finished=True,
                stop_reason="stop",
            )
        ]


async def main(ctx: Context) -> dict[str, Any]:
    env = ctx.roles["env"]
    runner = EpisodeRunner(
        Bisect(),
        env,
        encode=encode,
        decode=decode,
        params=SamplingParams(max_new_tokens=4),
        max_turns=4,
        step_timeout_s=5.0,
        deterministic=bool(ctx.config.get("deterministic")),
    )
    games = int(ctx.config.get("games", 60))
    done: list[Trajectory] = []
    quarter = asyncio.Event()

    async def play(i: int) -> None:
        secret = 1 + i % 15
        done.append(await runner.run(f"game-{i}", secret, encode("guess: ")))
        if len(done) >= games // 4:
            quarter.set()

    first = await env.call("whoami", None, dict, replica=0)
    tasks = [asyncio.create_task(play(i)) for i in range(games)]
    await quarter.wait()  # a quarter of the games ended; the rest are in flight
    os.kill(int(first["pid"]), signal.SIGKILL)
    await asyncio.gather(*tasks)
    after = await env.call("whoami", None, dict, replica=0)
    return {
        "won": sum(t.reward == 1.0 for t in done),
        "turns": [t.turns for t in done],
        "restarts": sum(t.restarts for t in done),
        "replays": sum(t.replays for t in done),
        "incarnation_after": after["incarnation"],
    }
