"""The guessing game of the agent example: an environment role, its rules, and scripted play.

The environment holds a secret number from 1 to ``HIGH``; each turn the policy guesses one and
is told ``higher`` or ``lower`` with the interval still possible (``higher 9 to 15``), or
``correct``. Guessing right within ``MAX_TURNS`` guesses scores 1, else 0. Halving the interval
always wins (``HIGH`` is 2^MAX_TURNS - 1); guessing anywhere inside it wins about 60% of the
games: the scripted demonstrations play that way, so behaviour cloning learns the game's form
and to stay inside the interval, and RL has the rest to find.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

from asyncrl.roles.agents.environment import Environment, Transition

HIGH = 15
MAX_TURNS = 4
PROMPT = "guess"
START = f"1 to {HIGH}"
"""The reset's observation."""


@dataclass
class Game:
    secret: int
    turns: int = 0
    low: int = 1
    high: int = HIGH

    def answer(self, guess: int | None) -> str:
        """What the game says to a guess (None: not a number from 1 to HIGH), narrowing the
        interval it tells."""
        if guess == self.secret:
            return "correct"
        if guess is None:
            said = "invalid"
        elif guess < self.secret:
            said, self.low = "higher", max(self.low, guess + 1)
        else:
            said, self.high = "lower", min(self.high, guess - 1)
        return f"{said} {self.low} to {self.high}"


def parse(action: str) -> int | None:
    """The number an action guesses, or None."""
    word = action.strip().split()[0] if action.strip() else ""
    return int(word) if word.isascii() and word.isdigit() and 1 <= int(word) <= HIGH else None


class GuessingGame(Environment):
    """The game as an environment role. The task is the secret (a prompt's ``answer``)."""

    deterministic: ClassVar[bool] = True

    async def start(self, task: Any) -> tuple[str, Game]:
        secret = int(task)
        if not 1 <= secret <= HIGH:
            raise ValueError(f"task: expected a secret from 1 to {HIGH}, got {task!r}")
        return START, Game(secret)

    async def act(self, state: Game, action: str) -> Transition:
        state.turns += 1
        said = state.answer(parse(action))
        won = said == "correct"
        return Transition(observation=said, reward=float(won), done=won or state.turns >= MAX_TURNS)


def scripted(secret: int, rng: random.Random) -> list[tuple[int, str]]:
    """One demonstration: guesses drawn uniformly from the interval the answers leave, each
    with the game's answer, until it is right or out of turns."""
    game, plays = Game(secret), []
    for _ in range(MAX_TURNS):
        guess = rng.randint(game.low, game.high)
        said = game.answer(guess)
        plays.append((guess, said))
        if said == "correct":
            break
    return plays


def games(n: int, seed: int) -> list[int]:
    """``n`` secrets, every number equally often (then seeded at random for the remainder)."""
    rng = random.Random(seed)
    secrets = [1 + i % HIGH for i in range(n)]
    rng.shuffle(secrets)
    return secrets


def rl_prompts(count: int = 100_000, seed: int = 1, **_: Any) -> Any:
    """The prompt source's rows: one game per row, its secret as the answer."""
    for i, secret in enumerate(games(count, seed)):
        yield {"id": f"game-{i}", "prompt": PROMPT, "answer": str(secret)}
