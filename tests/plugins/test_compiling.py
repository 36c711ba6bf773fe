"""The bucketed compilation layer: inputs padded to a bucket, outputs cut back, one graph per
bucket; run with a stand-in compiler (the function itself), so no toolchain is needed."""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.plugins.compiling import BucketedFunction


def traced_shapes() -> tuple[list[tuple[int, ...]], Any]:
    seen: list[tuple[int, ...]] = []

    def compile_fn(fn: Any) -> Any:
        def run(*args: torch.Tensor) -> Any:
            seen.append(tuple(args[0].shape))
            return fn(*args)

        return run

    return seen, compile_fn


def test_tuple_outputs_are_cut_back_and_a_loss_is_returned_as_it_is() -> None:
    seen, compile_fn = traced_shapes()

    def fn(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        per_token = x.cumsum(1)  # a position's output depends on earlier positions only
        return per_token, (x * mask).sum() / mask.sum(), torch.stack([x.sum(), mask.sum()])

    f = BucketedFunction(fn, [4, 8], 1, compile_fn)
    x = torch.arange(10.0).reshape(2, 5)
    mask = torch.ones(2, 5)
    per_token, loss, stats = f(x, mask)
    assert seen == [(2, 8)]  # padded to the bucket
    assert torch.equal(per_token, x.cumsum(1))  # cut back to 5 columns
    assert loss.dim() == 0 and float(loss) == float(x.mean())  # the padding has mask 0
    assert stats.tolist() == [45.0, 10.0]  # not a sequence output: as it is
    f(torch.ones(2, 7), torch.ones(2, 7))
    f(torch.ones(2, 3), torch.ones(2, 3))
    assert seen == [(2, 8), (2, 8), (2, 4)]
    assert (f.compiles, f.eager, f.error) == (2, False, "")
    assert f.compile_s > 0


def test_a_function_that_fails_to_compile_runs_eagerly_with_the_reason() -> None:
    def compile_fn(fn: Any) -> Any:
        def run(*args: torch.Tensor) -> Any:
            raise RuntimeError("no compiler here\nsecond line")

        return run

    f = BucketedFunction(lambda x: x * 2, [8], 1, compile_fn)
    x = torch.ones(1, 3)
    assert torch.equal(f(x), x * 2)
    assert (f.compiles, f.eager, f.error) == (0, True, "RuntimeError: no compiler here")
    assert torch.equal(f(x), x * 2)
