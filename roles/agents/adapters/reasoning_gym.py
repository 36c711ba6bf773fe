"""reasoning-gym's procedural tasks as prompts, scored by the tasks' own ``score_answer``.

reasoning-gym generates its problems from a seed, so nothing is downloaded. Two pieces plug into
the service roles that exist:

- ``rows(dataset, size, seed, **options)`` is a generator for ``PromptSource``
  (``generator: asyncrl.roles.agents.adapters.reasoning_gym:rows``); the prompt source tokenizes
  each prompt with its ``tokenizer_path``. A row's ``answer`` is JSON naming its entry: the
  dataset, its options, seed and size, the entry's index, and its question and reference answer.
  The verifier scores against the entry itself, regenerated from that name (reasoning-gym
  generates an entry from the seed and its index), never against a JSON copy: JSON turns
  tuples into lists, and some tasks' scoring (``arc_agi``'s grids) compares tuples;
- the verifier ``reasoning_gym_entry`` (``Reward`` with ``imports:
  [asyncrl.roles.agents.adapters.reasoning_gym]``) scores a completion with
  ``dataset.score_answer(completion, entry)``: 1.0 for a right answer, partial credit where the
  task gives it.

::

    prompts:
      class: asyncrl.roles.services.prompts:PromptSource
      config:
        generator: asyncrl.roles.agents.adapters.reasoning_gym:rows
        options: {dataset: basic_arithmetic, size: 10000, seed: 0, max_terms: 2}
    reward:
      class: asyncrl.roles.services.reward:Reward
      config:
        verifier: reasoning_gym_entry
        imports: [asyncrl.roles.agents.adapters.reasoning_gym]
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

try:
    import reasoning_gym
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        f"{__name__} needs reasoning-gym: pip install 'asyncrl[agents-adapters]'"
    ) from exc

from asyncrl.roles.services.reward import verifier

__all__ = ["entry", "rows", "score"]


def rows(dataset: str, size: int = 1000, seed: int = 0, **options: Any) -> Iterator[dict[str, Any]]:
    """The prompt source's rows of reasoning-gym's ``dataset``: ``size`` entries generated from
    ``seed``, with the dataset's own ``options`` (``min_terms``, ``max_digits`` ...).

    Each row is ``{"id": "<dataset>/<seed>/<index>", "prompt": question, "answer": json}``; the
    ``answer`` names the entry (see the module).

    Raises:
        ValueError: reasoning-gym knows no such dataset, or refuses its options.
    """
    data = _dataset(dataset, size, seed, json.dumps(options, sort_keys=True))
    for index, item in enumerate(data):
        named = {"dataset": dataset, "options": options, "seed": seed, "size": size}
        named |= {"index": index, "question": item["question"], "answer": str(item["answer"])}
        yield {
            "id": f"{dataset}/{seed}/{index}",
            "prompt": item["question"],
            "answer": json.dumps(named),
        }


def entry(answer: str) -> tuple[Any, dict[str, Any]]:
    """The dataset and the entry a row's ``answer`` names, regenerated.

    Raises:
        ValueError: ``answer`` is not what ``rows`` wrote, or the entry regenerated here is not
            the one the row was made from (another version of reasoning-gym, or of the
            dataset's options, in this process than in the prompt source's).
    """
    try:
        named = json.loads(answer)
        key = (named["dataset"], named["size"], named["seed"])
        options = json.dumps(named["options"], sort_keys=True)
        index, question = int(named["index"]), named["question"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"reasoning_gym_entry: the answer {answer[:80]!r} is not a row of "
            "asyncrl.roles.agents.adapters.reasoning_gym:rows; give the prompt source that "
            "generator"
        ) from exc
    data = _dataset(*key, options)
    item = data[index]
    if item["question"] != question:
        raise ValueError(
            f"reasoning_gym_entry: entry {index} of {key[0]!r} (seed {key[2]}) regenerates as "
            f"{item['question'][:60]!r}, not the row's {question[:60]!r}; run the prompt source "
            "and the reward with the same version of reasoning-gym"
        )
    return data, item


@functools.lru_cache(maxsize=64)
def _dataset(name: str, size: int, seed: int, options: str) -> Any:
    """The dataset, built once per process and settings (entries are generated on demand:
    regenerating one is cheap)."""
    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **json.loads(options))
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise ValueError(
            f"reasoning-gym cannot create {name!r} with size={size}, seed={seed} and options "
            f"{options}: {exc}"
        ) from exc


@verifier("reasoning_gym_entry")
def score(completion: str, answer: str, options: dict[str, Any]) -> float:
    """The dataset's ``score_answer`` of ``completion`` for the entry ``answer`` names."""
    data, item = entry(answer)
    return float(data.score_answer(completion, item))
