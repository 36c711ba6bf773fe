"""The textarena adapter (asyncrl.roles.agents.adapters.textarena) against the real package:
GuessTheNumber in-process, then as a real role process played by EpisodeRunner with a scripted
policy role (``asyncrl run``, tests/agents/adapter_programs.py)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from asyncrl.errors import ConfigProblem
from asyncrl.role import RoleContext
from asyncrl.roles.agents.environment import Reset, Step, Transition
from tests.conftest import ROOT

textarena = pytest.importorskip(
    "textarena", reason="textarena is not installed (pip install 'asyncrl[agents-adapters]')"
)
from asyncrl.roles.agents.adapters.textarena import TextArenaGame  # noqa: E402

HIGHER, LOWER = "The target number is higher.", "The target number is lower."


def secret(seed: int) -> int:
    """The number textarena's GuessTheNumber-v0 draws for ``seed``, asked of textarena itself."""
    env = textarena.make("GuessTheNumber-v0-raw")
    env.reset(num_players=1, seed=seed)
    return int(env.state.game_state["game_number"])


def bisection(number: int, lo: int = 1, hi: int = 20) -> list[int]:
    guesses = []
    while True:
        guesses.append((lo + hi) // 2)
        if guesses[-1] == number:
            return guesses
        lo, hi = (guesses[-1] + 1, hi) if guesses[-1] < number else (lo, guesses[-1] - 1)


def game(config: dict[str, Any] | None = None) -> TextArenaGame:
    return TextArenaGame(RoleContext.local(name="game", config=config or {}))


def test_a_game_starts_from_its_seed_hints_refuses_a_bad_move_and_rewards_a_win() -> None:
    number = secret(7)

    async def main() -> tuple[str, list[Transition]]:
        env = game()
        await env.setup()
        obs = await env.reset(Reset(episode_id="a", task={"seed": 7}))
        moves = [str(number - 1), "no idea", str(number + 1), f"[{number}]"]
        out = [
            await env.step(Step(episode_id="a", turn=turn, action=move))
            for turn, move in enumerate(moves)
        ]
        return obs.text, out

    prompt, (low, bad, high, win) = asyncio.run(main())
    assert "You are playing Guess The Number" in prompt and "between 1 and 20" in prompt
    assert (low.observation, low.reward, low.done) == (HIGHER, 0.0, False)
    assert bad.observation.startswith("You attempted an invalid move.") and not bad.done
    assert (high.observation, high.reward, high.done) == (LOWER, 0.0, False)
    assert (win.reward, win.done, win.info["turns"]) == (1.0, True, 3)
    assert win.info["reason"] == "Congratulations! You guessed the correct number."


def test_a_game_that_is_not_single_player_or_unknown_is_a_configuration_error() -> None:
    with pytest.raises(ConfigProblem, match=r"textarena cannot start 'Nope-v0' for one player"):
        asyncio.run(game({"env_id": "Nope-v0"}).setup())
    with pytest.raises(ConfigProblem, match=r"'ConnectFour-v0' for one player .*AssertionError"):
        asyncio.run(game({"env_id": "ConnectFour-v0"}).setup())


MANIFEST = """\
run:
  name: textarena-live
  program: tests.agents.adapter_programs:textarena_games
  config: {{seeds: {seeds}}}
roles:
  policy:
    class: tests.agents.adapter_programs:Bisector
  game:
    class: asyncrl.roles.agents.adapters.textarena:TextArenaGame
    replicas: 2
    config: {{env_id: GuessTheNumber-v0, options: {{max_turns: 10}}}}
"""


@pytest.mark.slow
def test_episode_runner_plays_the_game_in_a_role_process_and_wins(run_dir: str) -> None:
    seeds = [1, 7, 12]
    path = os.path.join(run_dir, "manifest.yaml")
    with open(path, "w") as f:
        f.write(MANIFEST.format(seeds=json.dumps(seeds)))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "run",
            path,
            "--run-dir",
            run_dir,
            "--allow-nonempty",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(os.path.join(run_dir, "driver.json")) as f:
        games = json.load(f)["result"]
    assert [g["seed"] for g in games] == seeds
    for g in games:
        guesses = bisection(secret(g["seed"]))
        policy = [s for s in g["segments"] if s["policy"]]
        said = [s["text"] for s in g["segments"] if not s["policy"]]
        assert [int(s["text"]) for s in policy] == guesses, g
        assert all(s["versions"] == [7] * len(s["text"]) for s in policy)
        # Each wrong guess got its hint from the game, in the role's process.
        assert said == [HIGHER if x < guesses[-1] else LOWER for x in guesses[:-1]]
        assert g["prompt"].startswith("You are Player 0. You are playing Guess The Number.")
        assert g["turn_rewards"] == [0.0] * (len(guesses) - 1) + [1.0]
        assert (g["reward"], g["done"], g["restarts"], g["errors"]) == (1.0, True, 0, 0)
    assert len({len(g["turn_rewards"]) for g in games}) > 1  # the seeds give different games
