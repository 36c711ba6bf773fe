"""Reward verifiers and the prompt source, in-process."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from asyncrl.role import RoleContext
from asyncrl.roles.prompts import PromptSource, Take, load_rows
from asyncrl.roles.reward import Reward, ScoreRequest

TOKENIZER = "examples/arith/tokenizer"


def score(config: dict[str, Any], completions: list[str], answers: list[str]) -> list[float]:
    async def go() -> list[float]:
        role = Reward(RoleContext.local(config=config))
        await role.setup()
        return await role.score(ScoreRequest(completions, answers))

    return asyncio.run(go())


def test_verifiers() -> None:
    assert score({"verifier": "exact"}, ["052", " 052 ", "52"], ["052"] * 3) == [1.0, 1.0, 0.0]
    assert score({"verifier": "numeric"}, ["052", "52.0", "x", "53"], ["52"] * 4) == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]
    assert score(
        {"verifier": "format", "options": {"pattern": r"\d{3}"}}, ["052", "52"], ["", ""]
    ) == [1.0, 0.0]


def test_bad_reward_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown verifier 'nope'; registered: exact, format"):
        score({"verifier": "nope"}, [], [])
    with pytest.raises(ValueError, match="got 2 completions and 1 answers"):
        score({"verifier": "exact"}, ["1", "2"], ["1"])


def test_prompts_are_a_pure_function_of_the_cursor(tmp_path: Any) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": f"0{i}+01=", "answer": f"00{i + 1}"}) + "\n"
            for i in range(5)
        )
    )

    async def go() -> tuple[list[Any], list[Any], list[Any]]:
        source = PromptSource(
            RoleContext.local(
                config={"path": str(path), "tokenizer_path": TOKENIZER, "shuffle_seed": 3}
            )
        )
        await source.setup()
        first = await source.take(Take(0, 7))
        again = await source.take(Take(2, 3))
        other = PromptSource(
            RoleContext.local(
                config={"path": str(path), "tokenizer_path": TOKENIZER, "shuffle_seed": 3}
            )
        )
        await other.setup()
        return first, again, await other.take(Take(0, 7))

    first, again, other = asyncio.run(go())
    assert [p.id for p in first] == [p.id for p in other]
    assert first[2:5] == again
    assert {p.id.split("@")[0] for p in first[:5]} == {f"q{i}" for i in range(5)}
    assert [p.id.split("@")[1] for p in first] == ["0"] * 5 + ["1"] * 2
    assert first[0].token_ids and len(first[0].token_ids) == 6


def test_rows_need_a_prompt(tmp_path: Any) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0 of .*bad\.jsonl has no .prompt."):
        load_rows(str(path))
    with pytest.raises(ValueError, match="exactly one of 'path' and 'generator'"):
        load_rows()
    rows = load_rows(generator="examples.arith.data:rl_prompts", options={"demos": 200})
    assert len(rows) == 8800


def test_a_reward_model_scores_completions(tmp_path: Any) -> None:
    """The reward-model option: a sequence-classification model with one logit, from a path."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type="gpt2",
        vocab_size=14,
        n_positions=16,
        n_embd=16,
        n_layer=1,
        n_head=2,
        num_labels=1,
        pad_token_id=0,
    )
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(tmp_path / "rm")
    scores = score({"model_path": str(tmp_path / "rm")}, ["052", "13", "052"], ["", "", ""])
    assert len(scores) == 3 and scores[0] == pytest.approx(scores[2])
    assert scores[0] != scores[1]
