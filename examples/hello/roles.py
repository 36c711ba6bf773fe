"""Two small roles: a tokenizer-like splitter and a counter that keeps a ledger.

Each is a plain class: a test can build it with ``RoleContext.local()`` and call its endpoints
in-process. ``asyncrl run`` runs each replica in its own supervised process.
"""

from __future__ import annotations

import msgspec

from asyncrl.ledger import Ledger
from asyncrl.role import Delivery, Role, endpoint


class Line(msgspec.Struct):
    id: int
    text: str


class Words(msgspec.Struct):
    id: int
    words: list[str]


class Splitter(Role):
    class Config(msgspec.Struct):
        lowercase: bool = True

    @endpoint(Delivery.IDEMPOTENT)
    async def split(self, line: Line) -> Words:
        text = line.text.lower() if self.config.lowercase else line.text
        return Words(line.id, text.split())


class Counter(Role):
    async def setup(self) -> None:
        # Restored before any work arrives: a restarted counter still knows which lines it
        # counted, so a re-sent line is not counted twice.
        self.seen = Ledger(self.ctx.path("lines.jsonl"))
        self.counts: dict[str, int] = {}

    @endpoint(Delivery.IDEMPOTENT)
    async def add(self, words: Words) -> bool:
        if not self.seen.add(words.id):
            return False
        for word in words.words:
            self.counts[word] = self.counts.get(word, 0) + 1
        return True

    @endpoint(Delivery.IDEMPOTENT)
    async def top(self, n: int) -> list[tuple[str, int]]:
        return sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
