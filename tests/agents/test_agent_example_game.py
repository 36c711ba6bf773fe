"""The agent example's game and its demonstrations: a scripted game laid out by the program is
token for token the episode the runner records when the policy plays the same guesses, so BC
imitates exactly what RL then trains on."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import pytest

from asyncrl.role import RoleContext
from asyncrl.roles.agents.episodes import EpisodeRunner, episode_rewards
from asyncrl.roles.payloads import GenerateBatch, Prompt, Sample, SamplingParams
from examples.agent import game
from examples.agent.program import demonstration
from tests.agents.test_episodes import Handle

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok() -> Any:
    return transformers.AutoTokenizer.from_pretrained("examples/agent/tokenizer")


class Plays:
    """A policy that guesses the given numbers in order, each followed by EOS."""

    def __init__(self, tok: Any, guesses: list[int]) -> None:
        self.tok, self.guesses = tok, list(guesses)

    async def call(self, method: str, payload: Any = None, reply_type: Any = Any, **kw: Any) -> Any:
        assert isinstance(payload, GenerateBatch)
        (request,) = payload.requests
        guess = self.guesses.pop(0)
        tokens = [*self.tok.encode(str(guess), add_special_tokens=False), self.tok.eos_token_id]
        return [
            Sample(
                prompt_id=request.prompt.id,
                sample_index=0,
                prompt_ids=request.prompt.token_ids,
                token_ids=tokens,
                logprobs=[-0.5] * len(tokens),
                versions=[7] * len(tokens),
                finished=True,
                stop_reason="stop",
            )
        ]


def play(tok: Any, secret: int, guesses: list[int]) -> tuple[Sample, Counter[str]]:
    env = Handle(lambda n: game.GuessingGame(RoleContext.local(name="env", incarnation=n)))
    runner = EpisodeRunner(
        Plays(tok, guesses),
        env,
        encode=lambda text: tok.encode(text, add_special_tokens=False),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        params=SamplingParams(max_new_tokens=2, stop_token_ids=[tok.eos_token_id]),
        max_turns=game.MAX_TURNS,
    )
    prompt = Prompt(id="g", token_ids=tok.encode(game.PROMPT, add_special_tokens=False))
    prompt.answer = str(secret)
    metrics: Counter[str] = Counter()
    return asyncio.run(runner.source(prompt, 0, metrics)), metrics


@pytest.mark.parametrize("seed", range(12))
def test_a_demonstration_is_the_episode_the_runner_records(tok: Any, seed: int) -> None:
    rng = random.Random(seed)
    secret = rng.randint(1, game.HIGH)
    demo = demonstration(0, secret, tok, random.Random(seed))
    plays = game.scripted(secret, random.Random(seed))
    sample, metrics = play(tok, secret, [guess for guess, _ in plays])
    assert sample.prompt_ids == demo.prompt_ids
    assert sample.token_ids == demo.token_ids
    assert sample.loss_mask == demo.loss_mask
    won = plays[-1][1] == "correct"
    assert asyncio.run(episode_rewards([sample])) == [float(won)]
    assert metrics["episodes"] == 1 and metrics["episode_turns"] == len(plays)
    assert metrics["env_tokens"] == demo.loss_mask.count(0)
    policy = [v for v, m in zip(sample.versions, sample.loss_mask, strict=True) if m]
    assert policy == [7] * (2 * len(plays))


def test_the_game_tells_the_interval_and_ends_after_four_guesses(tok: Any) -> None:
    sample, _ = play(tok, 11, [8, 20, 12, 9])
    text = tok.decode(sample.token_ids, skip_special_tokens=True)
    assert text == "8 higher 9 to 15 invalid 9 to 15 12 lower 9 to 11 9"
    assert sample.turn_rewards == [0.0] * 4 and sample.stop_reason == "stop"
    won, _ = play(tok, 8, [8])
    assert won.turn_rewards == [1.0] and won.loss_mask == [1, 1]
