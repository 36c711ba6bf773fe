"""The calculator of the tool-calling example: an environment role, its tasks, and the tool the
agent offers the policy.

A task is two numbers from 0 to ``HIGH``. The episode starts with the question
(``17 + 25``); the agent sends the environment one action a turn: ``add X Y`` when the policy
called the ``add`` tool (the environment answers ``= N``, the tool's result) and ``answer V``
when it answered (reward 1 if ``V`` is the sum, else 0; the episode ends).

The fault switch ``fail_replica: K`` (config) makes replica K fail every step it is sent, the
way a broken sandbox does: one step in two hangs until the step's deadline cancels it (a
timeout), the other raises. Neither is the policy's fault: the episode is marked
``infra_failed`` and never trained on (docs/agents.md).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

from asyncrl.roles.agents.environment import Environment, Transition

HIGH = 49
"""The largest number of a task."""

ADD_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "add two numbers",
        "parameters": {
            "type": "object",
            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
            "required": ["x", "y"],
        },
    },
}
"""The tool as the agent offers it in each request (OpenAI's ``tools`` format)."""


@dataclass
class Sum:
    x: int
    y: int


def question(x: int, y: int) -> str:
    """The reset's observation: what the agent asks the policy."""
    return f"{x} + {y}"


class Calculator(Environment):
    """The calculator as an environment role. The task is ``"X Y"`` (a prompt's ``answer``)."""

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        fail_replica: int = -1
        """The replica that fails every step (-1: none); see the module."""

    deterministic: ClassVar[bool] = True

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.failures = 0

    async def start(self, task: Any) -> tuple[str, Sum]:
        x, y = (int(word) for word in str(task).split())
        if not (0 <= x <= HIGH and 0 <= y <= HIGH):
            raise ValueError(f"task: expected two numbers from 0 to {HIGH}, got {task!r}")
        return question(x, y), Sum(x, y)

    async def act(self, state: Sum, action: str) -> Transition:
        if self.ctx.replica == self.config.fail_replica:
            self.failures += 1
            if self.failures % 2:
                await asyncio.Event().wait()  # hangs until the step's deadline cancels it
            raise RuntimeError(f"env.{self.ctx.replica}: the calculator's sandbox is gone")
        verb, *args = action.split() or [""]
        if verb == "add" and len(args) == 2 and all(_is_int(a) for a in args):
            return Transition(observation=f"= {int(args[0]) + int(args[1])}")
        if verb == "answer":
            right = len(args) == 1 and _is_int(args[0]) and int(args[0]) == state.x + state.y
            return Transition(observation="", reward=float(right), done=True)
        return Transition(observation=f"cannot {action!r}: expected 'add X Y' or 'answer V'")


def _is_int(word: str) -> bool:
    return word.lstrip("-").isascii() and word.lstrip("-").isdigit()


def tasks(n: int, seed: int) -> list[tuple[int, int]]:
    """``n`` tasks drawn at random (seeded)."""
    rng = random.Random(seed)
    return [(rng.randint(0, HIGH), rng.randint(0, HIGH)) for _ in range(n)]


def rl_prompts(count: int = 100_000, seed: int = 1, **_: Any) -> Any:
    """The prompt source's rows: one task per row, its numbers as the answer."""
    for i, (x, y) in enumerate(tasks(count, seed)):
        yield {"id": f"sum-{i}", "prompt": question(x, y), "answer": f"{x} {y}"}
