"""The control-flow program of the example: greet a few names, then shout one through the
external echo role."""

from __future__ import annotations

from typing import Any

NAMES = ["Ada", "Grace", "Alan"]


async def main(ctx: Any) -> dict[str, Any]:
    # map yields (key, reply) as each call completes; the keys are the items' indexes.
    replies = {key: text async for key, text in ctx.roles["greeter"].map("greet", NAMES, str)}
    greetings = {name: replies[i] for i, name in enumerate(NAMES)}
    shouted = await ctx.roles["echo"].call("upper", greetings["Ada"], str)
    greeted = await ctx.roles["greeter"].call("greeted_names", None, list[str])
    return {"greetings": greetings, "shouted": shouted, "greeted": greeted}
