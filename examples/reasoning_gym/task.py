"""The task of the reasoning-gym example: reasoning-gym's ``basic_arithmetic`` ("Calculate 5 +
-3.", answer "2"; some with brackets and signs, "Calculate ( -( -6 - -6 ) )."), sums and
differences of two one-digit terms, generated locally (no download).

The rows and the training reward are the reasoning-gym adapter's
(``asyncrl.roles.agents.adapters.reasoning_gym``, docs/agents.md): each row's answer names its
entry, and the reward role's verifier ``reasoning_gym_entry`` scores with reasoning-gym's own
``score_answer``: 1 for the exact answer, partial credit for a completion that contains it.

- ``prompts``: the RL prompts, for the prompt source (``examples.reasoning_gym.task:prompts``);
- ``heldout``: held-out problems, from another seed, as ``Prompt``s whose answer is the
  reference answer itself;
- ``tokenizer``: the example's character-level tokenizer (``make_tokenizer.py``);
- ``exact``: the held-out evaluation's verifier: exact answers only, so its accuracy is one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from asyncrl.roles.agents.adapters import reasoning_gym
from asyncrl.roles.payloads import Prompt

TASK = "basic_arithmetic"
OPTIONS: dict[str, Any] = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 1,
    "operators": ("+", "-"),
}
HELDOUT_SEED = 10_000


def prompts(size: int = 20_000, seed: int = 0, **_: Any) -> Iterator[dict[str, Any]]:
    """The RL prompts: the adapter's rows, each answer naming its entry."""
    return reasoning_gym.rows(TASK, size=size, seed=seed, **OPTIONS)


def heldout(tok: Any, size: int) -> list[Prompt]:
    """Held-out problems (another seed than the RL prompts'), tokenized by ``tok``, each with
    its reference answer."""
    return [
        Prompt(
            id=r["id"],
            token_ids=tok.encode(r["prompt"]),
            text=r["prompt"],
            answer=json.loads(r["answer"])["answer"],
        )
        for r in reasoning_gym.rows(TASK, size=size, seed=HELDOUT_SEED, **OPTIONS)
    ]


def tokenizer(path: str) -> Any:
    """The tokenizer at ``path`` (imports transformers: seconds)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def exact(completion: str, prompt: Prompt) -> float:
    """1 for the exact answer, else 0."""
    return float(completion.strip() == prompt.answer)
