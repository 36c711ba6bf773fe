"""What a server serves: its methods, each with a handler, and the ``Call`` a handler receives.

A handler is ``handler(payload, call) -> reply``: a plain function runs inline on the loop (it
must be quick), a coroutine function runs as a task the server owns.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = ["Call", "Handler", "Method", "Methods"]

Handler = Callable[[Any, "Call"], Any]
"""``handler(payload, call) -> reply``, or a coroutine function with the same signature."""


class Call(msgspec.Struct, frozen=True):
    """What a handler knows about the request it serves (a Struct: cheap to build per call)."""

    peer: bytes
    id: int
    method: str
    attempt: int
    deadline: float
    trace: str


@dataclass(slots=True)
class Method:
    """One served method: its handler, the type its payload is decoded as, and how it runs."""

    handler: Handler
    request_type: Any
    is_async: bool


class Methods:
    """The methods the server named ``server`` serves, by name."""

    def __init__(self, server: str) -> None:
        self.server = server
        self._methods: dict[str, Method] = {}

    def add(self, method: str, handler: Handler, request_type: Any = Any) -> None:
        """Serve ``method`` with ``handler``; its payload is decoded as ``request_type``.

        Raises:
            ValueError: ``method`` is served already.
        """
        if method in self._methods:
            raise ValueError(f"method {method!r} is already served by {self.server}")
        self._methods[method] = Method(handler, request_type, inspect.iscoroutinefunction(handler))

    def get(self, method: str) -> Method | None:
        return self._methods.get(method)

    def unknown(self, method: str) -> str:
        """The error message for a request to ``method``, which is not served."""
        known = ", ".join(sorted(self._methods)) or "none"
        return f"{self.server} has no method {method!r}; it serves: {known}"
