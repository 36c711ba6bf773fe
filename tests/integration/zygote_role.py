"""A role for the zygote's tests: it answers ``pid`` and exits with a given code on ``exit``."""

from __future__ import annotations

import asyncio
import os

from asyncrl import Delivery, Role, endpoint


class Exiter(Role):
    @endpoint(Delivery.IDEMPOTENT)
    async def pid(self, _: None) -> int:
        return os.getpid()

    @endpoint(Delivery.IDEMPOTENT)
    async def exit(self, code: int) -> None:
        # After the answer is on its way: the caller sees the call succeed, then the exit.
        asyncio.get_running_loop().call_later(0.05, os._exit, code)
