"""Held-out evaluation for control-flow programs: greedy completions of fixed prompts, checked by
a verifier of the evaluation's own, not by the training reward.

    evaluation = Evaluation(heldout, max_new_tokens=5, stop_token_ids=[eos], verifier=exact,
                            decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
    result = await evaluation.run(rl)        # EvalResult: accuracy, score_mean, versions, ...

The rollout replicas decode each prompt greedily with the weights they hold (sync them first:
``rl_loop`` and ``Run.evaluate`` do), and the verifier scores each completion. A completion is
correct when its score reaches ``correct_at`` (1.0): a partial-credit score of 0.5 is not
counted as correct, so ``accuracy`` is an accuracy whichever verifier scores. The verifier is:

- a function ``verifier(completion, prompt) -> float`` (or bool, or an awaitable of either),
  run in the program's process on the text ``decode`` gives;
- the name of a role that scores as the reward role does (``asyncrl.roles.services.reward``'s
  ``score`` and ``score_samples`` endpoints): a second reward role with a strict verifier;
- None: the run's ``reward`` role (its own score, thresholded at ``correct_at``).

``EvalResult.versions`` lists the weight versions of the tokens evaluated (one, when the
replicas held one version throughout), so a reader can check which policy was measured.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.roles.payloads import GenerateBatch, GenerateRequest, Prompt, Sample, SamplingParams
from asyncrl.roles.program.clients import RewardClient, RLContext

__all__ = ["EvalResult", "Evaluation", "Verifier", "greedy_accuracy"]

Verifier = Callable[[str, Prompt], "float | bool | Awaitable[float | bool]"]
"""A function of a completion's text and its prompt (with its ``answer``): the score."""


@dataclass
class EvalResult:
    """What one evaluation measured.

    Attributes:
        accuracy: the fraction of prompts whose completion scored at least ``correct_at``.
        score_mean: the verifier's mean score (equal to ``accuracy`` for a 0/1 verifier).
        count: prompts evaluated.
        versions: the distinct weight versions of the completions' tokens, ascending.
        step: the loop's step it was taken at (set by ``rl_loop``; 0 otherwise).
    """

    accuracy: float
    score_mean: float
    count: int
    versions: list[int] = field(default_factory=list)
    step: int = 0

    def record(self) -> dict[str, Any]:
        """The result as a JSON-able mapping (``metrics.jsonl``'s ``evaluation``)."""
        return {
            "accuracy": self.accuracy,
            "score_mean": self.score_mean,
            "count": self.count,
            "versions": list(self.versions),
        }


class Evaluation:
    """A fixed prompt set, decoded greedily and checked by a verifier of its own.

    Args:
        prompts: the held-out prompts, each with its answer.
        max_new_tokens, stop_token_ids: as ``SamplingParams``.
        verifier: a function, a role name, or None for the run's ``reward`` role (see the
            module's docstring).
        decode: token ids to text; needed by a function verifier, and used for a role
            without a tokenizer (else the role decodes with its own).
        every: steps between evaluations in ``rl_loop`` (0: only after its last step).
        correct_at: the score from which a completion counts as correct.
        chunk: prompts per generate call (the calls spread over the replicas).
        timeout: seconds each generate call may take.

    Raises:
        ValueError: no prompts, or a function verifier without ``decode``.
    """

    def __init__(
        self,
        prompts: list[Prompt],
        *,
        max_new_tokens: int,
        stop_token_ids: list[int],
        verifier: Verifier | str | None = None,
        decode: Callable[[list[int]], str] | None = None,
        every: int = 0,
        correct_at: float = 1.0,
        chunk: int = 250,
        timeout: float = 600.0,
    ) -> None:
        if not prompts:
            raise ValueError("an Evaluation needs at least one held-out prompt")
        if callable(verifier) and decode is None:
            raise ValueError(
                "a verifier function scores text: give the Evaluation a decode "
                "(token ids to text), e.g. decode=lambda ids: tok.decode(ids)"
            )
        self.prompts = prompts
        self.params = SamplingParams(
            greedy=True, max_new_tokens=max_new_tokens, stop_token_ids=list(stop_token_ids)
        )
        self.verifier = verifier
        self.decode = decode
        self.every = every
        self.correct_at = correct_at
        self.chunk = chunk
        self.timeout = timeout

    def due(self, step: int, last: bool) -> bool:
        """Whether step ``step`` of a loop is an evaluation boundary (``every``, or the last)."""
        return last or bool(self.every and step % self.every == 0)

    async def run(self, rl: RLContext) -> EvalResult:
        """Evaluate the weights the rollout replicas hold now."""
        by_id = {p.id: p for p in self.prompts}
        requests = [
            GenerateRequest(prompt=p, sample_index=0, params=self.params) for p in self.prompts
        ]
        batches = [
            GenerateBatch(requests[i : i + self.chunk]) for i in range(0, len(requests), self.chunk)
        ]
        scores: list[float] = []
        versions: set[int] = set()
        async for samples in rl.rollout.generate_all(batches, timeout=self.timeout):
            scores += await self._score(rl, samples, [by_id[s.prompt_id] for s in samples])
            versions.update(v for s in samples for v in s.versions)
        correct = sum(1 for s in scores if s >= self.correct_at)
        return EvalResult(
            accuracy=correct / len(scores),
            score_mean=sum(scores) / len(scores),
            count=len(scores),
            versions=sorted(versions),
        )

    async def _score(
        self, rl: RLContext, samples: list[Sample], prompts: list[Prompt]
    ) -> list[float]:
        if callable(self.verifier):
            assert self.decode is not None  # checked in __init__
            out = []
            for sample, prompt in zip(samples, prompts, strict=True):
                score = self.verifier(self.decode(sample.token_ids), prompt)
                out.append(float(await score if inspect.isawaitable(score) else score))
            return out
        role = rl.reward if self.verifier is None else RewardClient(rl.ctx.roles[self.verifier])
        answers = [p.answer for p in prompts]
        if self.decode is None:
            return await role.score_samples(samples, answers)
        return await role.score([self.decode(s.token_ids) for s in samples], answers)


async def greedy_accuracy(
    rl: RLContext,
    prompts: list[Prompt],
    *,
    max_new_tokens: int,
    stop_token_ids: list[int],
    decode: Callable[[list[int]], str] | None = None,
    verifier: Verifier | str | None = None,
    chunk: int = 250,
    timeout: float = 600.0,
) -> float:
    """The accuracy of greedy completions of ``prompts``: ``Evaluation(...).run(rl).accuracy``
    (the fraction scored at least 1 by ``verifier``, the run's reward role by default).

    Raises:
        ValueError: as ``Evaluation``.
    """
    evaluation = Evaluation(
        prompts,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        verifier=verifier,
        decode=decode,
        chunk=chunk,
        timeout=timeout,
    )
    return (await evaluation.run(rl)).accuracy
