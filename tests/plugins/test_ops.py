"""The torch operators: fast against reference, exactly where they share a formula; the
learner's log-prob formula; sampling's filters; bucketed compilation and the profiler."""

from __future__ import annotations

import pytest
import torch

from asyncrl.plugins.compiling import BucketCompiler
from asyncrl.plugins.profiling import TraceProfiler
from asyncrl.plugins.torch_ops import FastOps, ReferenceOps
from asyncrl.roles.learning.estimators import entropy_from_logits, token_logprobs

FAST, REF = FastOps(), ReferenceOps()


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_fast_matches_reference() -> None:
    g = _gen()
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g) for _ in range(3))
    for causal in (False, True):
        torch.testing.assert_close(
            FAST.attention(q, k, v, causal=causal), REF.attention(q, k, v, causal=causal)
        )
    x, w, b = torch.randn(4, 16, generator=g), torch.randn(16, generator=g), torch.randn(16)
    torch.testing.assert_close(FAST.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(FAST.layer_norm(x, w, b, 1e-5), REF.layer_norm(x, w, b, 1e-5))
    logits = torch.randn(3, 7, 11, generator=g) * 5
    ids = torch.randint(0, 11, (3, 7), generator=g)
    torch.testing.assert_close(FAST.logprobs(logits, ids), REF.logprobs(logits, ids))
    torch.testing.assert_close(FAST.entropy(logits), REF.entropy(logits))


def test_logprobs_are_the_learners_to_the_bit_and_chunked_entropy_matches() -> None:
    ops = FastOps()
    ops.chunk_rows = 4
    logits = torch.randn(3, 7, 11, generator=_gen()) * 5
    ids = torch.randint(0, 11, (3, 7), generator=_gen())
    assert torch.equal(ops.logprobs(logits, ids), token_logprobs(logits, ids))
    torch.testing.assert_close(ops.entropy(logits), entropy_from_logits(logits))


def test_sampling_filters() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    for top_k, top_p in [(0, 1.0), (2, 1.0), (0, 0.7), (3, 0.9)]:
        fast = FAST.sampling_probs(logits, temperature=0.7, top_p=top_p, top_k=top_k)
        ref = REF.sampling_probs(logits, temperature=0.7, top_p=top_p, top_k=top_k)
        torch.testing.assert_close(fast, ref)
    probs = REF.sampling_probs(logits, temperature=1.0, top_p=1.0, top_k=2)
    assert (probs[0, 2:] == 0).all() and probs[0, :2].sum().item() == pytest.approx(1.0)
    drawn = FAST.sample(logits.repeat(50, 1), temperature=1.0, top_p=1.0, top_k=2, generator=_gen())
    assert set(drawn.tolist()) == {0, 1}
    with pytest.raises(ValueError, match=r"top_p: expected in \(0, 1\], got 0"):
        FAST.sampling_probs(logits, temperature=1.0, top_p=0, top_k=0)


def test_buckets_pad_and_cut_back_and_eager_runs_the_function() -> None:
    eager = BucketCompiler(enabled=False).compile(lambda x: x * 2, buckets=[4, 8])
    x = torch.ones(2, 3)
    assert torch.equal(eager(x), x * 2) and (eager.compiles, eager.eager) == (0, True)
    assert eager.bucket(5) == 8
    with pytest.raises(ValueError, match="sequence length 9 is over the largest bucket 8"):
        eager.bucket(9)


def test_profiler_records_chrome_events() -> None:
    prof = TraceProfiler()
    with prof.range("step"):
        pass
    (event,) = list(prof.events())
    assert (event["name"], event["ph"]) == ("step", "X") and event["dur"] >= 0
