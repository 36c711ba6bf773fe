"""The event loop every asyncrl process runs: uvloop when it is installed, asyncio otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["loop_name", "run"]

T = TypeVar("T")


def _uvloop() -> Any:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """Run ``main`` to completion on a new event loop and return its result."""
    uvloop = _uvloop() if use_uvloop else None
    if uvloop is not None:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)


def loop_name() -> str:
    """The running loop's implementation, for logs and benchmark reports."""
    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__}.{type(loop).__name__}"
