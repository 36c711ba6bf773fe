"""``torch.compile`` with sequence-length bucketing, and an eager fallback.

A compiled graph is specialised to its input shapes. Sequence lengths change every step, so each
input is padded (with zeros, at the end of the sequence dimension) to the smallest bucket that
holds it and the outputs cut back: one graph per bucket, compiled once. That is right for
functions whose output at a position does not depend on later positions (causal attention,
norms, per-token log-probs), and for reductions over masked positions (a loss whose padded
positions have mask 0), which is what a training step runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.plugins.graph_rewrites import GraphRewrite, rewriting

__all__ = ["BucketCompiler", "BucketedFunction"]


class BucketedFunction:
    """``fn`` run through one compiled graph per bucket, or eagerly.

    Outputs: a tensor, or a tuple of tensors. An output whose size along ``dim`` is the
    bucket's is cut back to the input's length; others (a 0-dim loss, a vector of statistics)
    are returned as they are.

    Attributes:
        compiles: how many graphs were compiled (one per bucket and input shape seen).
        compile_s: wall seconds of the calls that compiled a graph (each includes one run of
            it; a graph's backward may compile later, in its first backward pass).
        eager: whether it runs eagerly (asked for, or compilation failed).
        error: why compilation failed, when it did.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        buckets: Sequence[int],
        dim: int,
        compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]] | None,
    ) -> None:
        if not buckets or any(b < 1 for b in buckets):
            raise ValueError(f"buckets: expected sizes >= 1, got {list(buckets)!r}")
        self.fn = fn
        self.buckets = sorted(buckets)
        self.dim = dim
        self.compiles = 0
        self.compile_s = 0.0
        self.eager = compile_fn is None
        self.error = ""
        self._compiled = None if compile_fn is None else compile_fn(fn)
        self._seen: set[tuple[tuple[int, ...], ...]] = set()

    def bucket(self, length: int) -> int:
        """The smallest bucket that holds ``length``.

        Raises:
            ValueError: ``length`` is over the largest bucket.
        """
        for b in self.buckets:
            if b >= length:
                return b
        raise ValueError(
            f"sequence length {length} is over the largest bucket {self.buckets[-1]}; "
            f"add a larger bucket"
        )

    def __call__(self, *args: torch.Tensor) -> Any:
        length = args[0].shape[self.dim]
        if self.eager or self._compiled is None:
            return self.fn(*args)
        size = self.bucket(length)
        padded = [self._pad(a, size) for a in args]
        shapes = tuple(tuple(a.shape) for a in padded)
        new = shapes not in self._seen
        start = time.perf_counter()
        try:
            out = self._compiled(*padded)
        except Exception as exc:  # no compiler toolchain, an unsupported op: run eagerly
            self.eager, self.error = True, f"{type(exc).__name__}: {exc}".splitlines()[0]
            return self.fn(*args)
        if new:
            self._seen.add(shapes)
            self.compiles += 1
            self.compile_s += time.perf_counter() - start
        if size == length:
            return out
        if isinstance(out, tuple):
            return tuple(self._cut(o, size, length) for o in out)
        return self._cut(out, size, length)

    def _cut(self, out: Any, size: int, length: int) -> Any:
        if not isinstance(out, torch.Tensor) or out.dim() == 0:
            return out
        dim = self.dim if self.dim >= 0 else self.dim + out.dim()
        if not 0 <= dim < out.dim() or out.shape[dim] != size:
            return out
        return out.narrow(dim, 0, length)

    def _pad(self, tensor: torch.Tensor, size: int) -> torch.Tensor:
        extra = size - tensor.shape[self.dim]
        if extra == 0:
            return tensor
        dim = self.dim % tensor.dim()
        pad: list[int] = [0, 0] * (tensor.dim() - 1 - dim) + [0, extra]
        return F.pad(tensor, pad)


class BucketCompiler:
    """The ``Compiler`` contract over ``torch.compile``.

    Args:
        backend: ``torch.compile``'s backend (``inductor``, ``aot_eager``, a vendor's), a name
            or a backend function.
        enabled: False: every function runs eagerly.
        rewrites: run on each captured graph before ``backend`` sees it
            (``asyncrl.plugins.graph_rewrites``): the device's faster form of the same function.
        options: more keywords for ``torch.compile`` (``dynamic`` defaults to False: one
            static graph per bucket).
    """

    def __init__(
        self,
        backend: str | Callable[..., Any] = "inductor",
        enabled: bool = True,
        rewrites: Sequence[GraphRewrite] = (),
        **options: Any,
    ) -> None:
        self.backend = backend
        self.enabled = enabled
        self.rewrites = list(rewrites)
        self.options = {"dynamic": False, **options}

    def compile(
        self, fn: Callable[..., Any], *, buckets: Sequence[int], dim: int = 1
    ) -> BucketedFunction:
        def compile_fn(f: Callable[..., Any]) -> Callable[..., Any]:
            options, backend = dict(self.options), self.backend
            if self.rewrites:  # a backend function: torch.compile's mode and options go to it
                mode, patches = options.pop("mode", None), options.pop("options", None)
                backend = rewriting(self.backend, self.rewrites, mode, patches)
            compiled: Callable[..., Any] = torch.compile(f, backend=backend, **options)
            return compiled

        return BucketedFunction(fn, buckets, dim, compile_fn if self.enabled else None)
