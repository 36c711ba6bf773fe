"""Held-out evaluation with a verifier of its own (asyncrl.roles.program.evaluation), in-process:
a fake rollout answers each prompt with its id's digits as tokens, of a fixed version."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import pytest

from asyncrl.roles.payloads import GenerateBatch, Prompt, Sample
from asyncrl.roles.program.clients import RLContext
from asyncrl.roles.program.evaluation import EvalResult, Evaluation, greedy_accuracy
from asyncrl.roles.services.reward import ScoreRequest
from asyncrl.transport import run

PROMPTS = [Prompt(id=str(i), token_ids=[i], answer=str(i % 3)) for i in range(6)]


class Rollout:
    """Completes prompt ``i`` with the tokens ``[i]`` under version ``7`` (``9`` for prompt 5,
    as if new weights arrived mid-evaluation); records each batch's parameters."""

    def __init__(self) -> None:
        self.batches: list[GenerateBatch] = []

    async def generate_all(
        self, batches: list[GenerateBatch], *, timeout: float
    ) -> AsyncIterator[list[Sample]]:
        for batch in batches:
            self.batches.append(batch)
            yield [
                Sample(
                    prompt_id=r.prompt.id,
                    sample_index=0,
                    prompt_ids=r.prompt.token_ids,
                    token_ids=list(r.prompt.token_ids),
                    logprobs=[0.0],
                    versions=[9 if r.prompt.id == "5" else 7],
                    finished=True,
                    stop_reason="stop",
                )
                for r in batch.requests
            ]


class Judge:
    """A reward role's handle: partial credit, 0.5 for an answer of "1"."""

    name = "judge"

    def __init__(self) -> None:
        self.calls: list[ScoreRequest] = []

    async def call(self, method: str, payload: Any, reply_type: Any = Any, **kw: Any) -> Any:
        assert method == "score"
        self.calls.append(payload)
        return [0.5 if a == "1" else 1.0 for a in payload.answers]


def fake_rl(judge: Judge | None = None) -> RLContext:
    handles = {"judge": judge}
    return cast(
        RLContext,
        SimpleNamespace(rollout=Rollout(), ctx=SimpleNamespace(roles=handles), reward=None),
    )


def decode(ids: list[int]) -> str:
    return "".join(str(i) for i in ids)


def partial_credit(completion: str, prompt: Prompt) -> float:
    """1 for the id itself, 0.5 for an id whose answer is the completion's last digit mod 3."""
    return 1.0 if completion in ("0", "4") else 0.5


def test_accuracy_counts_only_full_scores_and_says_which_versions_it_saw() -> None:
    evaluation = Evaluation(
        PROMPTS,
        max_new_tokens=3,
        stop_token_ids=[1],
        verifier=partial_credit,
        decode=decode,
        chunk=4,
    )
    rl = fake_rl()
    result = run(evaluation.run(rl))
    assert result == EvalResult(accuracy=2 / 6, score_mean=4 / 6, count=6, versions=[7, 9])
    batches = cast(Rollout, rl.rollout).batches
    assert [len(b.requests) for b in batches] == [4, 2]
    params = batches[0].requests[0].params
    assert params.greedy and params.max_new_tokens == 3 and params.stop_token_ids == [1]


def test_an_async_verifier_and_a_bool_verifier_score_alike() -> None:
    async def exact(completion: str, prompt: Prompt) -> bool:
        return completion == prompt.id

    evaluation = Evaluation(
        PROMPTS, max_new_tokens=1, stop_token_ids=[], verifier=exact, decode=decode
    )
    assert run(evaluation.run(fake_rl())).accuracy == 1.0


def test_a_role_verifier_is_called_with_the_decoded_text_and_thresholded() -> None:
    judge = Judge()
    evaluation = Evaluation(
        PROMPTS, max_new_tokens=1, stop_token_ids=[], verifier="judge", decode=decode
    )
    result = run(evaluation.run(fake_rl(judge)))
    # Answers 0,1,2,0,1,2: the two "1" get partial credit, which is not accuracy.
    assert (result.accuracy, result.score_mean) == (4 / 6, 5 / 6)
    assert judge.calls[0].completions == ["0", "1", "2", "3", "4", "5"]
    got = run(
        greedy_accuracy(
            fake_rl(judge),
            PROMPTS,
            max_new_tokens=1,
            stop_token_ids=[],
            verifier="judge",
            decode=decode,
        )
    )
    assert got == 4 / 6


def test_an_evaluation_without_prompts_or_a_function_without_decode_is_refused() -> None:
    with pytest.raises(ValueError, match="an Evaluation needs at least one held-out prompt"):
        Evaluation([], max_new_tokens=1, stop_token_ids=[])
    with pytest.raises(ValueError, match="a verifier function scores text: give the Evaluation"):
        Evaluation(PROMPTS, max_new_tokens=1, stop_token_ids=[], verifier=partial_credit)


def test_the_schedule_is_every_n_steps_and_the_last() -> None:
    evaluation = Evaluation(PROMPTS, max_new_tokens=1, stop_token_ids=[], every=3)
    assert [s for s in range(1, 8) if evaluation.due(s, last=s == 7)] == [3, 6, 7]
