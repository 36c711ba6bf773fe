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
        # Restored before any work arrives: each line counted is in the ledger with its words,
        # so a restarted counter counts them again from there and refuses a re-sent line.
        self.seen = Ledger(self.ctx.path("lines.jsonl"))
        self.counts: dict[str, int] = {}
        for _, words in self.seen.items():
            self._count(words)

    @endpoint(Delivery.IDEMPOTENT)
    async def add(self, words: Words) -> bool:
        if not self.seen.add(words.id, words.words):  # the line's id and its effect, at once
            return False
        self._count(words.words)
        return True

    def _count(self, words: list[str]) -> None:
        for word in words:
            self.counts[word] = self.counts.get(word, 0) + 1

    @endpoint(Delivery.IDEMPOTENT)
    async def top(self, n: int) -> list[tuple[str, int]]:
        return sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]

    async def teardown(self) -> None:
        self.seen.close()
