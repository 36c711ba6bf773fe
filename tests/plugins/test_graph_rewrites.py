"""Graph rewrites before the compiler's backend: the tanh GELU as a sigmoid, the same function
and gradient to float rounding, and every other ``tanh`` left as it is. A recording backend
stands in for the compiler (it runs the rewritten graph as Python), so no toolchain is needed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.activations import ACT2FN

from asyncrl.plugins.compiling import BucketCompiler
from asyncrl.plugins.cpu import CpuPlugin
from asyncrl.plugins.graph_rewrites import rewriting, tanh_gelu_as_sigmoid

TANH = {torch.tanh, "tanh", torch._C._nn.gelu}


class Recorder:
    """A backend that keeps each graph it is given and runs it as Python."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.kwargs: list[dict[str, Any]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        self.graphs.append(gm)
        self.kwargs.append(kwargs)
        return gm.forward


def compiled_with_rewrite(fn: Any) -> tuple[Any, list[torch.fx.GraphModule]]:
    record = Recorder()
    torch._dynamo.reset()
    return torch.compile(fn, backend=rewriting(record, [tanh_gelu_as_sigmoid])), record.graphs


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
    assert not TANH & set(ops)
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


def test_a_tanh_that_something_else_reads_is_left_alone() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.tanh()
        return 0.5 * x * (1.0 + t), t

    x = torch.randn(64)
    compiled, graphs = compiled_with_rewrite(fn)
    assert all(torch.equal(a, b) for a, b in zip(compiled(x), fn(x), strict=True))
    assert torch.sigmoid not in targets(graphs[0])


def test_in_place_operations_survive_and_a_later_change_of_the_input_is_not_read() -> None:
    def fn(x: torch.Tensor, u: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
        counter.add_(1)  # its result is unused: still done
        t = torch.tanh(u)
        u.mul_(3.0)  # after the tanh: 1 + t is of u as it was
        return 0.5 * x * (1.0 + t)

    x, u = torch.randn(64), torch.randn(64)
    want = 0.5 * x * (1.0 + torch.tanh(u))
    compiled, graphs = compiled_with_rewrite(fn)
    counter, u_in = torch.zeros(()), u.clone()
    got = compiled(x, u_in, counter)
    torch.testing.assert_close(got, want)
    assert float(counter) == 1.0 and torch.equal(u_in, u * 3.0)
    assert torch.sigmoid in targets(graphs[0]) and not TANH & set(targets(graphs[0]))


def test_the_rewrite_counts_what_it_changed() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        gelu_new = 0.5 * x * (1.0 + torch.tanh(0.8 * (x + 0.044715 * x**3)))
        return gelu_new + torch.nn.functional.gelu(x, approximate="tanh") + torch.tanh(x)

    gm = torch.fx.symbolic_trace(fn)
    assert tanh_gelu_as_sigmoid(gm) == 2
    assert tanh_gelu_as_sigmoid(gm) == 0
    x = torch.randn(32)
    torch.testing.assert_close(gm(x), fn(x))


def test_the_compilers_pass_graphs_through_their_rewrites() -> None:
    assert CpuPlugin().compiler.rewrites == [tanh_gelu_as_sigmoid]
    record = Recorder()
    torch._dynamo.reset()
    compiler = BucketCompiler(record, rewrites=[tanh_gelu_as_sigmoid], options={"a": 1})
    f = compiler.compile(ACT2FN["gelu_new"], buckets=[8])
    x = torch.randn(2, 5)
    torch.testing.assert_close(f(x), ACT2FN["gelu_new"](x))
    assert (f.compiles, f.eager) == (1, False)
    assert torch.sigmoid in targets(record.graphs[0])
    assert record.kwargs == [{"options": {"a": 1}}]  # torch.compile's options reach the backend
