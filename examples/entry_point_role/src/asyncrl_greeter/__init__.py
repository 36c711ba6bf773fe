"""An asyncrl role in a package of its own, found by its entry-point name.

The package registers ``Greeter`` under the entry-point group ``asyncrl.roles`` as ``greeter``
(see pyproject.toml), so a manifest names it ``class: greeter`` instead of ``module:Class``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from asyncrl.role import Delivery, Role, endpoint

__all__ = ["Greeter"]


class Greeter(Role):
    """Greets names with the greeting of its config, and remembers whom it greeted."""

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        greeting: str = "hello"

    async def setup(self) -> None:
        # Restore state before any request arrives: a restarted replica reads back the names
        # its earlier incarnations wrote to its own directory in the run directory.
        self.path = self.ctx.path("greeted.txt")
        try:
            with open(self.path) as f:
                self.greeted = {line.rstrip("\n") for line in f if line.strip()}
        except FileNotFoundError:
            self.greeted = set()
        self.ctx.log.info("restored", greeted=len(self.greeted))

    @endpoint(Delivery.IDEMPOTENT)
    async def greet(self, name: str) -> str:
        # Idempotent: running it twice for one name writes that name once.
        if name not in self.greeted:
            self.greeted.add(name)
            with open(self.path, "a") as f:
                f.write(name + "\n")
        return f"{self.config.greeting}, {name}"

    @endpoint(Delivery.IDEMPOTENT)
    async def greeted_names(self, _: Any) -> list[str]:
        """Every name greeted in this run, sorted."""
        return sorted(self.greeted)
