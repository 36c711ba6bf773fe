"""Held-out evaluation for control-flow programs: greedy accuracy over a fixed prompt set.

    accuracy = await greedy_accuracy(rl, heldout, max_new_tokens=5, stop_token_ids=[eos])

The rollout replicas decode each prompt greedily with the weights they hold (sync them first;
``rl_loop`` does before it calls its ``evaluate`` hook), and the reward role checks each
completion against the prompt's answer: the fraction it scores 1 is the accuracy. Completions
are decoded by ``decode`` in the program's process when given, else by the reward role's own
tokenizer (``Reward.Config.tokenizer_path``).
"""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.roles.payloads import GenerateBatch, GenerateRequest, Prompt, SamplingParams
from asyncrl.roles.program.clients import RLContext

__all__ = ["greedy_accuracy"]


async def greedy_accuracy(
    rl: RLContext,
    prompts: list[Prompt],
    *,
    max_new_tokens: int,
    stop_token_ids: list[int],
    decode: Callable[[list[int]], str] | None = None,
    chunk: int = 250,
    timeout: float = 600.0,
) -> float:
    """The mean reward of greedy completions of ``prompts`` (accuracy, for a 0/1 verifier).

    Args:
        rl: the run's typed context (its ``rollout`` and ``reward`` are used).
        prompts: the held-out prompts, each with its answer.
        max_new_tokens, stop_token_ids: as ``SamplingParams``.
        decode: token ids to text, for a reward role without a tokenizer.
        chunk: prompts per generate call (calls spread over the replicas).
        timeout: seconds each generate call may take.

    Raises:
        ValueError: no prompts.
    """
    if not prompts:
        raise ValueError("greedy_accuracy needs at least one held-out prompt")
    answers = {p.id: p.answer for p in prompts}
    greedy = SamplingParams(
        greedy=True, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids
    )
    requests = [GenerateRequest(prompt=p, sample_index=0, params=greedy) for p in prompts]
    batches = [GenerateBatch(requests[i : i + chunk]) for i in range(0, len(requests), chunk)]
    total = 0.0
    async for samples in rl.rollout.generate_all(batches, timeout=timeout):
        wanted = [answers[s.prompt_id] for s in samples]
        if decode is None:
            scores = await rl.reward.score_samples(samples, wanted)
        else:
            scores = await rl.reward.score([decode(s.token_ids) for s in samples], wanted)
        total += sum(scores)
    return total / len(prompts)
