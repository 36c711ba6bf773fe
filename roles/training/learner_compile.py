"""The learner's compiled step (``compile: true``): its forward pass and each correction's policy
loss through the hardware plugin's compiler, one graph per padded-length bucket.

BC's loss and the terms added to the policy loss (KL, entropy) stay eager; the forward pass
they read is the compiled one. A function that fails to compile runs eagerly, and the learner
says so once.

In buckets up to ``MATH_ATTENTION_MAX`` tokens the compiled forward pass runs the model's plain
("eager", matmul and softmax) attention, which the compiler fuses with what surrounds it, rather
than the model's fused attention kernel (``sdpa``), which it can only call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from asyncrl.plugins.contract import Compiled, Compiler
from asyncrl.roles.payloads import TrainBatch
from asyncrl.roles.training.objective import (
    CompiledPolicy,
    Objective,
    PolicyGradient,
    compile_policy,
)

__all__ = ["COMPILE_BUCKETS", "MATH_ATTENTION_MAX", "CompiledStep", "bucket_of"]

_LADDER = sorted({b for p in range(5, 18) for b in (2**p, 3 * 2 ** (p - 1))})
COMPILE_BUCKETS = [*range(8, 32, 4), *_LADDER]
"""Padded lengths the compiled step is specialised to: multiples of 4 up to 28, since a short
batch's padding costs it most (on one CPU thread, the arith step of lengths 9 to 12 compiled for
bucket 16 took 1.32 times the same step compiled with dynamic shapes and no padding); then powers
of two from 32 and the midpoints between them (32, 48, 64, 96, ...), so a length is padded by
less than half and lengths within a factor of two from 32 on compile at most two graphs."""

MATH_ATTENTION_MAX = 128
"""The longest bucket whose compiled graph runs plain attention (see the module). On one CPU
thread, a 2-layer GPT-2 step of about 1,500 tokens took 0.96 to 0.98 times the sdpa graph's time
with plain attention at 16 to 128 tokens, 1.07 times at 256 and 1.18 times at 512; the arith
model's small step (length 12) took 0.93 times."""


def bucket_of(length: int) -> int:
    """The compiled step's bucket for a padded length (the length itself past the last)."""
    return next((b for b in COMPILE_BUCKETS if b >= length), length)


class CompiledStep:
    """The compiled functions of one learner.

    Args:
        compiler: the hardware plugin's ``Compiler``.
        forward: the learner's forward pass, a function of ``input_ids``, ``attention_mask``
            and ``position_ids`` whose outputs keep the input's length.
        model: the model ``forward`` runs (its ``config`` says which attention it runs), or
            None to leave its attention alone (the learner passes None with activation
            checkpointing, whose backward pass runs the forward again, after the call has
            restored the model's own attention).

    Attributes:
        functions: every compiled function, the forward pass first.
    """

    def __init__(self, compiler: Compiler, forward: Callable[..., Any], model: Any = None) -> None:
        self.compiler = compiler
        self.functions: list[Compiled] = []
        self._forward = self._compile(forward)
        self._config: Any = getattr(model, "config", None)
        self._policies: dict[tuple[str, float], CompiledPolicy] = {}
        self._warned = False

    def forward(self, *args: Any) -> Any:
        """The compiled forward pass on ``input_ids``, ``attention_mask`` and
        ``position_ids``: with plain attention in buckets up to ``MATH_ATTENTION_MAX``."""
        config = self._config
        implementation = getattr(config, "_attn_implementation", None)
        if (
            implementation in (None, "eager")
            or getattr(config, "sub_configs", None)  # a composite model's choices stay its own
            or self._forward.eager  # compilation failed: sdpa is the faster eager attention
            or bucket_of(args[0].shape[1]) > MATH_ATTENTION_MAX
        ):
            return self._forward(*args)
        config._attn_implementation = "eager"  # read as the graph is traced, and guarded on
        try:
            return self._forward(*args)
        finally:
            config._attn_implementation = implementation

    def _compile(self, fn: Callable[..., Any]) -> Compiled:
        compiled = self.compiler.compile(fn, buckets=COMPILE_BUCKETS, dim=1)
        self.functions.append(compiled)
        return compiled

    def objective(self, objective: Objective, batch: TrainBatch) -> Objective:
        """``objective`` with its policy loss compiled, once per correction and importance cap
        (BC's objective as it is)."""
        if not isinstance(objective.loss, PolicyGradient):
            return objective
        key = (batch.correction, batch.importance_cap)
        policy = self._policies.get(key)
        if policy is None:
            policy = compile_policy(objective.loss.policy, self._compile)
            self._policies[key] = policy
        return dataclasses.replace(objective, loss=PolicyGradient(policy, objective.algorithm))

    def graphs(self) -> int:
        """How many graphs were compiled so far."""
        return sum(c.compiles for c in self.functions)

    def report(
        self, before: int, seconds: float, metrics: dict[str, float], log: Any, name: str
    ) -> None:
        """After a step that started with ``before`` graphs and took ``seconds``: when it
        compiled one, ``compile_s`` in its metrics (the step's wall time, one run included) and
        a log line; the first function found running eagerly, once, as a warning."""
        if self.graphs() > before:
            metrics["compile_s"] = seconds
            log.info(
                f"{name}: compiled the training step: {self.graphs()} graph(s) so far; "
                f"the step took {seconds:.1f} s"
            )
        failed = [c.error for c in self.functions if c.eager and c.error]
        if failed and not self._warned:
            self._warned = True
            log.warning(f"{name}: compile: true, but the step runs eagerly: {failed[0]}")
