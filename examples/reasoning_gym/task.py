"""The task of the reasoning-gym example: reasoning-gym's ``basic_arithmetic`` ("Calculate 5 +
-3.", answer "2"; some with brackets and signs, "Calculate ( -( -6 - -6 ) )."), sums and
differences of two one-digit terms, generated locally (no download).

- ``prompts``: the RL prompts, for the prompt source (``examples.reasoning_gym.task:prompts``);
- ``heldout``: held-out problems, from another seed, as ``Prompt``s;
- ``tokenizer``: the example's character-level tokenizer (``make_tokenizer.py``);
- ``gym_score``: reasoning-gym's own score, the training reward (registered as the verifier
  ``reasoning_gym``): 1 for the exact answer, partial credit for a completion that contains it;
- ``exact``: the held-out evaluation's verifier: exact answers only, so its accuracy is one.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import reasoning_gym

from asyncrl.roles.payloads import Prompt
from asyncrl.roles.services.reward import verifier

TASK = "basic_arithmetic"
OPTIONS: dict[str, Any] = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 1,
    "operators": ("+", "-"),
}
HELDOUT_SEED = 10_000


def _rows(size: int, seed: int) -> Iterator[dict[str, Any]]:
    dataset = reasoning_gym.create_dataset(TASK, size=size, seed=seed, **OPTIONS)
    for i, entry in enumerate(dataset):
        yield {"id": f"{seed}-{i}", "prompt": entry["question"], "answer": entry["answer"]}


def prompts(size: int = 20_000, seed: int = 0, **_: Any) -> Iterator[dict[str, Any]]:
    """The RL prompts."""
    return _rows(size, seed)


def heldout(tok: Any, size: int) -> list[Prompt]:
    """Held-out problems (another seed than the RL prompts'), tokenized by ``tok``."""
    return [
        Prompt(id=r["id"], token_ids=tok.encode(r["prompt"]), text=r["prompt"], answer=r["answer"])
        for r in _rows(size, HELDOUT_SEED)
    ]


def tokenizer(path: str) -> Any:
    """The tokenizer at ``path`` (imports transformers: seconds)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@functools.cache
def _scorer() -> Any:
    return reasoning_gym.create_dataset(TASK, size=1, seed=0, **OPTIONS)


@verifier("reasoning_gym")
def gym_score(completion: str, answer: str, options: dict[str, Any]) -> float:
    """reasoning-gym's score of ``completion`` against ``answer``."""
    return float(_scorer().score_answer(completion, {"answer": answer, "metadata": {}}))


def exact(completion: str, prompt: Prompt) -> float:
    """1 for the exact answer, else 0."""
    return float(completion.strip() == prompt.answer)
