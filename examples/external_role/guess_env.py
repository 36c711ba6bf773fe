"""An environment role outside asyncrl: the guessing game of examples/agent, served over the wire
protocol by the server of ``echo_role.py`` (only the standard library, pyzmq and msgpack).

It speaks the environment contract of docs/agents.md, which a program drives with
``asyncrl.roles.agents.episodes.EpisodeRunner`` exactly as it drives a Python ``Environment``:

- ``reset`` ``{episode_id, task, attempt}`` -> ``{episode_id, text, replica, incarnation}``:
  the task is the secret, 1 to 15;
- ``step`` ``{episode_id, turn, action, deadline_s}`` -> ``{observation, reward, done, info,
  timed_out}``: ``higher 9 to 15``, ``lower 1 to 7`` or ``correct`` (reward 1); the game ends
  after 4 guesses. A retried step of a turn already taken answers what it answered;
- ``close`` ``{episode_id, attempt}``: forget the episode (unless a later attempt's reset
  replaced it); an ended episode is forgotten once 1,024 more have ended;
- an episode this process does not hold (it was restarted) fails with an error of type
  ``EpisodeLost``, which tells the runner to restart or replay it.

Steps are instant, so the step deadline never binds; a slow game would check ``deadline_s``.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import echo_role as wire  # the protocol server, next to this file
import zmq

HIGH = 15
MAX_TURNS = 4
KEEP_ENDED = 1024


class EpisodeLost(Exception):
    """The contract's name for an episode this replica does not hold."""


class GuessEnv:
    """The game's methods; each takes a ``wire.Request`` and returns a msgpack-able value."""

    def __init__(self, settings: wire.Settings) -> None:
        self.settings = settings
        self.episodes: dict[str, dict[str, Any]] = {}
        self.ended: dict[str, None] = {}  # ended episodes, oldest first, kept for a retried step
        self.methods: dict[str, Callable[[wire.Request], Any]] = {
            "reset": self.reset,
            "step": self.step,
            "close": self.close,
            "whoami": lambda req: {"incarnation": settings.incarnation, "pid": os.getpid()},
        }

    def reset(self, req: wire.Request) -> dict[str, Any]:
        episode, secret = req.payload["episode_id"], int(req.payload["task"])
        if not 1 <= secret <= HIGH:
            raise ValueError(f"task: expected a secret from 1 to {HIGH}, got {secret}")
        attempt = int(req.payload.get("attempt", 0))
        self.episodes[episode] = {
            "secret": secret,
            "low": 1,
            "high": HIGH,
            "said": [],
            "attempt": attempt,
        }
        self.ended.pop(episode, None)
        s = self.settings
        return {
            "episode_id": episode,
            "text": f"1 to {HIGH}",
            "replica": s.replica,
            "incarnation": s.incarnation,
        }

    def step(self, req: wire.Request) -> dict[str, Any]:
        episode, turn = req.payload["episode_id"], int(req.payload["turn"])
        game = self.episodes.get(episode)
        if game is None or turn > len(game["said"]):
            raise EpisodeLost(f"incarnation {self.settings.incarnation} holds no {episode!r}")
        if turn < len(game["said"]):  # a retried step: answer what it answered
            return game["said"][turn]
        word = req.payload["action"].strip().split(" ")[0]
        guess = int(word) if word.isascii() and word.isdigit() else None
        if guess == game["secret"]:
            text = "correct"
        elif guess is None or not 1 <= guess <= HIGH:
            text = f"invalid {game['low']} to {game['high']}"
        elif guess < game["secret"]:
            game["low"] = max(game["low"], guess + 1)
            text = f"higher {game['low']} to {game['high']}"
        else:
            game["high"] = min(game["high"], guess - 1)
            text = f"lower {game['low']} to {game['high']}"
        won = text == "correct"
        done = won or turn + 1 >= MAX_TURNS
        answer = {
            "observation": text,
            "reward": float(won),
            "done": done,
            "info": {},
            "timed_out": False,
        }
        game["said"].append(answer)
        if done:  # forgotten once KEEP_ENDED more have ended
            self.ended[episode] = None
            while len(self.ended) > KEEP_ENDED:
                old = next(iter(self.ended))
                del self.ended[old]
                self.episodes.pop(old, None)
        return answer

    def close(self, req: wire.Request) -> None:
        """Forget the episode, unless the close is for an earlier attempt than the one held."""
        episode, attempt = req.payload["episode_id"], req.payload.get("attempt")
        game = self.episodes.get(episode)
        if game is not None and attempt in (None, game["attempt"]):
            del self.episodes[episode]
            self.ended.pop(episode, None)


def main() -> int:
    wire.die_with_parent()
    try:
        settings = wire.Settings.from_env(dict(os.environ))
        server = wire.Server(settings, GuessEnv(settings))  # type: ignore[arg-type]
    except wire.ConfigError as exc:
        wire.log(f"configuration error: {exc}")
        return wire.EXIT_CONFIG
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.on_signal)
    try:
        try:
            server.bind()
        except zmq.ZMQError as exc:
            wire.log(f"cannot bind {settings.endpoint}: {exc}")
            return 1
        print("READY", flush=True)
        server.serve()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
