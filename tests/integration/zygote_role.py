"""A role for the zygote's tests: it answers ``pid`` and exits with a given code on ``exit``;
``seen`` tells the variable ``ZYGOTE_TEST_VAR`` as this module read it at import, ``draw`` a
number from numpy's global random state; ``preload`` notes each call in ``config.preloads``,
and each incarnation writes ``atexit.<pid>`` into the run directory when it exits."""

from __future__ import annotations

import asyncio
import atexit
import os
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy

from asyncrl import Delivery, Role, endpoint

IMPORTED = os.environ.get("ZYGOTE_TEST_VAR", "")


def _mark(path: str) -> None:
    with open(path, "w") as f:
        f.write("exited\n")


class Exiter(Role):
    class Config(msgspec.Struct, forbid_unknown_fields=True):
        preloads: str = ""

    @classmethod
    def preload(cls, config: Mapping[str, Any]) -> None:
        if config.get("preloads"):
            with open(config["preloads"], "a") as f:
                f.write(f"{os.getpid()}\n")

    async def setup(self) -> None:
        atexit.register(_mark, os.path.join(self.ctx.run_dir, f"atexit.{os.getpid()}"))

    @endpoint(Delivery.IDEMPOTENT)
    async def pid(self, _: None) -> int:
        return os.getpid()

    @endpoint(Delivery.IDEMPOTENT)
    async def seen(self, _: None) -> str:
        return IMPORTED

    @endpoint(Delivery.IDEMPOTENT)
    async def draw(self, _: None) -> float:
        return float(numpy.random.random())

    @endpoint(Delivery.IDEMPOTENT)
    async def exit(self, code: int) -> None:
        # After the answer is on its way: the caller sees the call succeed, then the exit.
        asyncio.get_running_loop().call_later(0.05, os._exit, code)
