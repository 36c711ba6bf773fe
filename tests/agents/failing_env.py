"""An environment replica that fails every step, beside healthy ones: the agent example's game,
whose replica ``FAILING`` answers no step: one failure in two hangs past the step's deadline
(cancelled there: a timeout), the other raises; with ``FailingResetsAndSteps``, one reset in
two raises as well."""

from __future__ import annotations

import asyncio

from asyncrl.roles.agents.environment import Transition
from examples.agent.game import Game, GuessingGame

FAILING = 1
"""The replica that fails."""


class FailingReplica(GuessingGame):
    def __init__(self, ctx: object) -> None:
        super().__init__(ctx)
        self.failures = 0

    async def act(self, state: Game, action: str) -> Transition:
        if self.ctx.replica != FAILING:
            return await super().act(state, action)
        self.failures += 1
        if self.failures % 2:
            await asyncio.Event().wait()  # hangs until the step's deadline cancels it
        raise RuntimeError(f"env.{FAILING}: the tool's sandbox is gone")


class FailingResetsAndSteps(FailingReplica):
    """Replica ``FAILING`` also fails every other reset (it raises): each episode started there
    fails, at its reset or at a step."""

    def __init__(self, ctx: object) -> None:
        super().__init__(ctx)
        self.resets = 0

    async def start(self, task: object) -> tuple[str, Game]:
        if self.ctx.replica == FAILING:
            self.resets += 1
            if self.resets % 2:
                raise RuntimeError(f"env.{FAILING}: the tool's sandbox does not start")
        return await super().start(task)
