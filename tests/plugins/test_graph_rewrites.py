"""Graph rewrites before the compiler's backend: the tanh GELU as a sigmoid, the same function
and gradient to float rounding, and every other ``tanh`` left as it is. A recording backend
stands in for the compiler (it runs the rewritten graph as Python), so no toolchain is needed."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
from transformers.activations import ACT2FN

from asyncrl.plugins.graph_rewrites import rewriting, tanh_gelu_as_sigmoid


def compiled_with_rewrite(fn: Any) -> tuple[Any, list[torch.fx.GraphModule]]:
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=rewriting(record, [tanh_gelu_as_sigmoid])), graphs


def targets(gm: torch.fx.GraphModule) -> list[Any]:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


@pytest.mark.parametrize("name", ["gelu_new", "gelu_fast", "gelu_pytorch_tanh"])
def test_the_tanh_gelus_become_sigmoids_with_the_same_values_and_gradients(name: str) -> None:
    act = ACT2FN[name]
    x = torch.linspace(-12.0, 12.0, 4001, requires_grad=True)
    want = act(x)
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    fn, graphs = compiled_with_rewrite(act)
    got = fn(x)
    (got_grad,) = torch.autograd.grad(got.sum(), x)
    assert len(graphs) == 1
    ops = targets(graphs[0])
    assert torch.sigmoid in ops
    assert not {torch.tanh, torch._C._nn.gelu} & set(ops)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-5)
    far_left = torch.tensor([-5.0, -4.0])  # 1 + tanh(u) cancels there in float32; no sigmoid
    torch.testing.assert_close(fn(far_left).double(), act(far_left.double()), rtol=1e-4, atol=0)


def other_tanhs(x: torch.Tensor) -> torch.Tensor:
    a = 1 - torch.tanh(x)  # not 1 + tanh
    b = torch.tanh(x) * 30.0  # a soft cap
    c = torch.tanh(x) + 2.0
    d = torch.nn.functional.gelu(x)  # the exact GELU
    return a + b + c + d


def test_every_other_tanh_and_the_exact_gelu_are_left_alone() -> None:
    x = torch.randn(64)
    fn, graphs = compiled_with_rewrite(other_tanhs)
    assert torch.equal(fn(x), other_tanhs(x))
    ops = targets(graphs[0])
    assert ops.count(torch.tanh) == 3 and torch.sigmoid not in ops


def test_a_tanh_with_other_users_is_kept_for_them() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tanh(x)
        return 0.5 * x * (1.0 + t), t

    x = torch.randn(64)
    compiled, graphs = compiled_with_rewrite(fn)
    gelu, t = compiled(x)
    assert torch.equal(t, torch.tanh(x))
    torch.testing.assert_close(gelu, fn(x)[0])
    ops = targets(graphs[0])
    assert torch.tanh in ops and torch.sigmoid in ops
    assert operator.add not in ops  # the 1 + tanh(u) itself became 2 * sigmoid(2u)
