"""Reward verifiers and the prompt source, in-process."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from asyncrl.errors import ConfigProblem
from asyncrl.role import RoleContext
from asyncrl.roles.services import prompts as prompts_module
from asyncrl.roles.services.prompts import PromptSource, Take, load_rows
from asyncrl.roles.services.reward import VERIFIERS, Reward, ScoreRequest

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
    with pytest.raises(ValueError, match="got 2 completions and 1 answers"):
        score({"verifier": "exact"}, ["1", "2"], ["1"])


BUILT_IN = ("exact", "format", "numeric")


@pytest.fixture
def built_in_only() -> Iterator[None]:
    """Only the built-in verifiers registered (a module imported by another test, such as an
    adapter, registers its own in this process); the registry is restored afterwards."""
    saved = dict(VERIFIERS)
    for name in set(VERIFIERS) - set(BUILT_IN):
        del VERIFIERS[name]
    yield
    VERIFIERS.clear()
    VERIFIERS.update(saved)


@pytest.mark.usefixtures("built_in_only")
def test_an_unknown_verifier_is_a_configuration_error_naming_what_is_known() -> None:
    with pytest.raises(ConfigProblem) as info:
        score({"verifier": "nope"}, [], [])
    assert str(info.value) == (
        "role: unknown verifier 'nope'; registered: exact, format, numeric (modules imported "
        "from imports: none); register it with @verifier('nope') in a module and list that "
        "module in the role's imports"
    )


VERIFIER_MODULE = """\
from asyncrl.roles.services.reward import verifier


@verifier("last_word")
def last_word(completion, answer, options):
    words = completion.split()
    return float(bool(words) and words[-1] == answer)
"""


@pytest.fixture
def user_module(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, built_in_only: None
) -> Iterator[str]:
    """A module of the user's, ``mytask_verify``, importable; the verifiers it registers are
    forgotten afterwards."""
    (tmp_path / "mytask_verify.py").write_text(VERIFIER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mytask_verify", raising=False)
    saved = dict(VERIFIERS)
    yield "mytask_verify"
    VERIFIERS.clear()
    VERIFIERS.update(saved)


def test_a_verifier_of_your_own_is_imported_from_the_modules_named_in_imports(
    user_module: str,
) -> None:
    assert "last_word" not in VERIFIERS
    config = {"verifier": "last_word", "imports": [user_module]}
    assert score(config, ["so it is 052", "052 it is", ""], ["052"] * 3) == [1.0, 0.0, 0.0]


def test_a_verifier_missing_from_the_imported_modules_names_them(user_module: str) -> None:
    with pytest.raises(ConfigProblem) as info:
        score({"verifier": "lastword", "imports": [user_module]}, [], [])
    assert str(info.value) == (
        "role: unknown verifier 'lastword'; registered: exact, format, last_word, numeric "
        "(modules imported from imports: 'mytask_verify'); register it with "
        "@verifier('lastword') in a module and list that module in the role's imports"
    )


def test_a_module_in_imports_that_does_not_import_is_named() -> None:
    with pytest.raises(ConfigProblem) as info:
        score({"verifier": "x", "imports": ["no_such_module_here"]}, [], [])
    assert str(info.value) == (
        "role: cannot import 'no_such_module_here', named in imports (ModuleNotFoundError: "
        "No module named 'no_such_module_here'); check the module path and that it is "
        "importable from the run's working directory"
    )
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


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


def test_the_source_encodes_each_row_once_within_its_cache(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schedule that skips most prompts asks for the same rows epoch after epoch: each row is
    encoded once, until ``TOKEN_CACHE_BYTES`` are spent; rows past it are encoded each time,
    and every prompt carries the same token ids either way."""
    path = tmp_path / "p.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"0{i}+01=", "answer": "0"}) + "\n" for i in range(5))
    )
    row = prompts_module._kept_bytes(6)
    monkeypatch.setattr(prompts_module, "TOKEN_CACHE_BYTES", 3 * row)  # three rows of 6 tokens

    async def go() -> tuple[list[Any], list[Any], int]:
        source = PromptSource(
            RoleContext.local(config={"path": str(path), "tokenizer_path": TOKENIZER})
        )
        await source.setup()
        encode = source.tokenizer.encode
        calls = 0

        def counted(text: str) -> Any:
            nonlocal calls
            calls += 1
            return encode(text)

        source.tokenizer.encode = counted
        first = await source.take(Take(0, 5))
        later = await source.take(Take(5, 20))  # four more epochs
        return first, later, calls

    first, later, calls = asyncio.run(go())
    assert calls == 5 + 4 * 2  # three rows kept, two encoded in every epoch
    by_id = {p.id.split("@")[0]: p.token_ids for p in first}
    assert all(p.token_ids == by_id[p.id.split("@")[0]] and len(p.token_ids) == 6 for p in later)


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


def test_a_demonstrations_answer_carries_no_bos_even_where_the_tokenizer_adds_one(
    tmp_path: Any,
) -> None:
    # Llama-3's tokenizer prepends <|begin_of_text|> to every encode: the prompt keeps it, the
    # completion (the answer and the end of the turn) must not hold a second one.
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "q", "prompt": "01+02=", "answer": "003"}) + "\n")
    llama = "examples/qwen/llama3_tokenizer"

    async def go() -> list[Any]:
        source = PromptSource(
            RoleContext.local(config={"path": str(path), "tokenizer_path": llama})
        )
        await source.setup()
        return list(await source.demonstrations(Take(0, 1)))

    (demo,) = asyncio.run(go())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama)
    assert demo.prompt_ids[0] == tok.bos_token_id
    assert demo.token_ids == [*tok.encode("003", add_special_tokens=False), tok.eos_token_id]
    assert tok.bos_token_id not in demo.token_ids
