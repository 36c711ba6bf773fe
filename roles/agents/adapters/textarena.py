"""A single-player textarena game as an environment role.

``TextArenaGame`` serves one game of textarena's registry (``GuessTheNumber-v0`` by default:
guess a number from 1 to 20 within 10 turns, told ``higher`` or ``lower``) through the
``Environment`` contract, so ``EpisodeRunner`` plays it with the policy:

- ``reset``: the task is the game's seed (an int, or a mapping with ``seed``); the observation
  is the game's prompt;
- ``step``: the action goes to the game as the player's move (wrapped in ``[...]`` when it has no
  brackets, as textarena's ``ActionFormattingWrapper`` does); the observation is what the game
  said since (its hints, or why the move was refused), never the policy's own action, which is
  already in the context; the reward is 0 until the game ends, then the player's reward
  (1 for a win in GuessTheNumber, partial credit for a close last guess).

Games are built from textarena's ``-raw`` registration (no observation wrapper): the runner
keeps the whole history itself. The games named here need no network and no judge; a game that
downloads word lists (Wordle and others built on nltk corpora) does not work offline.

textarena seeds Python's global ``random`` at each reset, and the game draws its secret there
and then, so the same seed always gives the same game; ``deterministic`` stays False because a
game that draws again during its steps would interleave with other episodes in the replica.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

try:
    import textarena
    from textarena.wrappers import ActionFormattingWrapper
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        f"{__name__} needs textarena: pip install 'asyncrl[agents-adapters]'"
    ) from exc

from asyncrl.errors import ConfigProblem
from asyncrl.roles.agents.environment import Environment, Transition

__all__ = ["TextArenaGame"]


@dataclass
class _Game:
    env: Any
    seed: int


class TextArenaGame(Environment):
    """One single-player textarena game per episode."""

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        """The game's settings (``roles.<name>.config`` in the manifest).

        Attributes:
            env_id: the game's id in textarena's registry (``GuessTheNumber-v0``,
                ``GuessTheNumber-v0-hardcore``, ``Mastermind-v0`` ...); single-player only.
            options: the game's keyword arguments, over the registry's (``max_turns``,
                ``min_number`` ...).
            bracket_actions: wrap an action without square brackets in them, as the games
                expect moves like ``[5]``.
        """

        env_id: str = "GuessTheNumber-v0"
        options: dict[str, Any] = {}
        bracket_actions: bool = True

    async def setup(self) -> None:
        """Build the game once, so a bad id or a game for several players fails at start.

        Raises:
            ConfigProblem: textarena has no such game, refuses its options, or the game is
                not for one player.
        """
        try:
            _make(self.config).reset(num_players=1, seed=0)
        except Exception as exc:  # any failure of the game's own code is a configuration error
            raise ConfigProblem(
                f"{self.ctx.name}: textarena cannot start {self.config.env_id!r} for one player "
                f"with options {self.config.options} ({type(exc).__name__}: {exc}); name a "
                "single-player game of textarena's registry (GuessTheNumber-v0, Mastermind-v0, "
                "...) and its keyword arguments"
            ) from exc

    async def start(self, task: Any) -> tuple[str, Any]:
        seed = int(task["seed"] if isinstance(task, Mapping) else task)
        env = _make(self.config)
        env.reset(num_players=1, seed=seed)
        return _said(env), _Game(env, seed)

    async def act(self, state: _Game, action: str) -> Transition:
        done, info = state.env.step(action)
        text = _said(state.env)
        if not done:
            return Transition(observation=text, info=dict(info))
        rewards, game_info = state.env.close()
        player = game_info.get(0, {})
        return Transition(
            observation=text,
            reward=float((rewards or {}).get(0, 0.0)),
            done=True,
            info={
                "reason": str(player.get("reason", "")),
                "invalid_move": bool(player.get("invalid_move", False)),
                "turns": int(player.get("turn_count", 0)),
            },
        )


def _make(config: TextArenaGame.Config) -> Any:
    env = textarena.make(f"{config.env_id}-raw", **config.options)
    return ActionFormattingWrapper(env) if config.bracket_actions else env


def _said(env: Any) -> str:
    """What the game told the player since it last asked, the player's own moves left out."""
    _, messages = env.get_observation()
    return "\n".join(
        text.strip()
        for _, text, kind in messages
        if kind != textarena.ObservationType.PLAYER_ACTION
    )
