"""The control-flow program: split lines on whichever splitter has room, count each once."""

from __future__ import annotations

from typing import Any

from examples.hello.roles import Line, Words

TEXT = """\
the quick brown fox jumps over the lazy dog
the dog sleeps and the fox runs
a fox is quick and a dog is lazy
"""


async def main(ctx: Any) -> list[tuple[str, int]]:
    splitter, counter = ctx.roles["splitter"], ctx.roles["counter"]  # by their manifest names
    lines = [Line(i, text) for i, text in enumerate(TEXT.splitlines())]
    async for _, words in splitter.map("split", lines, Words):
        await counter.call("add", words)
    top: list[tuple[str, int]] = await counter.call("top", 3)
    return top
