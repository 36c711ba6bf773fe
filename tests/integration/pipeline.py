"""Roles and a control-flow program for the runtime's integration tests.

A three-role pipeline: ``square`` and ``offset`` transform items (idempotent), ``sink`` counts
each result once in a ledger kept in the run directory. The program maps items through the two
stages and records every result, then asks the sink how many ids it holds.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import time
from typing import Any

import msgspec

from asyncrl.ledger import Ledger
from asyncrl.role import Delivery, Role, endpoint


class Item(msgspec.Struct):
    key: int
    value: int


class Square(Role):
    @endpoint(Delivery.IDEMPOTENT)
    async def work(self, item: Item) -> Item:
        return Item(item.key, item.value * item.value)


class Offset(Role):
    class Config(msgspec.Struct):
        offset: int = 1

    @endpoint(Delivery.IDEMPOTENT)
    async def work(self, item: Item) -> Item:
        return Item(item.key, item.value + self.config.offset)


class Sink(Role):
    async def setup(self) -> None:
        # Restored before any work arrives: a restarted sink still knows what it counted.
        self.ledger = Ledger(self.ctx.path("ledger.jsonl"))
        self.duplicates = 0

    @endpoint(Delivery.IDEMPOTENT)
    async def record(self, item: Item) -> bool:
        new = self.ledger.add(item.key)
        if not new:
            self.duplicates += 1
        return new

    @endpoint(Delivery.IDEMPOTENT)
    async def count(self, _: Any) -> dict[str, int]:
        return {"ids": len(self.ledger), "duplicates": self.duplicates}

    async def teardown(self) -> None:
        self.ledger.close()


class Sleeper(Role):
    """Endpoints that misbehave on purpose: for hang and crash tests."""

    @endpoint(Delivery.IDEMPOTENT)
    async def compute(self, seconds: float) -> float:
        # Long compute in the worker thread: the loop keeps answering heartbeats.
        await self.ctx.offload(time.sleep, seconds)
        return seconds

    @endpoint(Delivery.ONCE)
    async def block_loop(self, seconds: float) -> float:
        time.sleep(seconds)  # noqa: ASYNC251  (the bug on purpose: the loop stops)
        return seconds

    @endpoint(Delivery.IDEMPOTENT)
    async def pid(self, _: Any) -> int:
        return os.getpid()


class SlowSetup(Sleeper):
    """A setup that waits ``SETUP_S`` seconds off the loop: the replica answers its callers
    all along, and is not ready until it returns."""

    async def setup(self) -> None:
        await asyncio.sleep(float(os.environ["SETUP_S"]))


class CrashAtStart(Role):
    async def setup(self) -> None:
        raise RuntimeError("cannot start: the weights file is missing (on purpose)")


async def pipeline(ctx: Any) -> dict[str, Any]:
    """Map 1,000 items through square and offset, record each result once."""
    n = int(os.environ.get("PIPELINE_ITEMS", "1000"))
    squares = ctx.roles["square"].map("work", [Item(i, i) for i in range(n)], Item, timeout=120)
    stage1 = [item async for _, item in squares]
    results = [item async for _, item in ctx.roles["offset"].map("work", stage1, Item, timeout=120)]
    recorded = await asyncio.gather(
        *(ctx.roles["sink"].call("record", r, timeout=120) for r in results)
    )
    counts = await ctx.roles["sink"].call("count", None)
    wrong = [r.key for r in results if r.value != r.key * r.key + 1]
    return {"recorded_new": sum(recorded), "sink": counts, "wrong": wrong}


async def wait_forever(ctx: Any) -> None:
    """A program that only ends when the run is stopped."""
    await ctx.roles["sleeper"].call("pid", None)
    await asyncio.Event().wait()


async def block_then_finish(ctx: Any) -> dict[str, Any]:
    """Block the sleeper's loop for 10 s (a busy process: warned about, never killed)."""
    first = await ctx.roles["sleeper"].call("pid", None)
    try:
        blocked = await ctx.roles["sleeper"].call("block_loop", 10.0, timeout=60)
    except Exception as exc:  # its callers may take 10 s of silence as its death
        blocked = type(exc).__name__
    after_block = await ctx.roles["sleeper"].call("pid", None, timeout=60)
    return {"first": first, "blocked": blocked, "after_block": after_block}


async def finish_then_linger(ctx: Any) -> int:
    """Work for 2 s, finish, then take 6 s to exit (as a process that flushes traces, tears
    down torch or joins its threads on a loaded machine does): its event loop has ended."""
    await ctx.roles["sleeper"].call(
        "compute", 2.0, timeout=60
    )  # its supervisor has heard it by then
    atexit.register(time.sleep, 6.0)
    return int(await ctx.roles["sleeper"].call("pid", None))


async def hang_then_finish(ctx: Any) -> dict[str, Any]:
    """Compute long in a worker thread (must not be flagged), then block the loop (must be)."""
    first = await ctx.roles["sleeper"].call("pid", None)
    await ctx.roles["sleeper"].call("compute", 2.0, timeout=30)
    after_compute = await ctx.roles["sleeper"].call("pid", None)
    try:
        await ctx.roles["sleeper"].call("block_loop", 5.0, timeout=30)
        blocked = "returned"
    except Exception as exc:  # the replica is killed while it blocks
        blocked = type(exc).__name__
    after_block = await ctx.roles["sleeper"].call("pid", None, timeout=60)
    return {
        "first": first,
        "after_compute": after_compute,
        "blocked": blocked,
        "after_block": after_block,
    }
