"""The task: fixed-width two-digit addition, "07+45=" -> "052".

All 10,000 problems are split once, by a seeded permutation, into three disjoint parts: the
held-out set (1,000), the demonstrations for behaviour cloning (a few hundred), and the prompts
for RL (the rest). Disjoint by construction: they are slices of one permutation.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

SPLIT_SEED = 1234
HELDOUT = 1000


def problem(a: int, b: int) -> dict[str, Any]:
    return {"id": f"{a:02d}+{b:02d}", "prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"}


def _split() -> list[tuple[int, int]]:
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    return pairs


def heldout() -> list[dict[str, Any]]:
    return [problem(a, b) for a, b in _split()[:HELDOUT]]


def demonstrations(n: int) -> list[dict[str, Any]]:
    return [problem(a, b) for a, b in _split()[HELDOUT : HELDOUT + n]]


def rl_prompts(demos: int = 200, **_: Any) -> Iterator[dict[str, Any]]:
    """The RL prompts: every problem in neither the held-out set nor the demonstrations."""
    for a, b in _split()[HELDOUT + demos :]:
        yield problem(a, b)


def write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
