"""A hardware plugin for asyncrl, written from its contract (``asyncrl.plugins.contract``).

Every part is a plain class with the contract's methods; nothing is inherited from asyncrl. The
operators delegate to torch: replace them with your device's kernels, and keep torch's as the
reference the self-check compares them with.
"""

from __future__ import annotations

import gc
import math
import os

import torch
import torch.nn.functional as F

from asyncrl.plugins.collectives import TorchCommunication
from asyncrl.plugins.compiling import BucketCompiler
from asyncrl.plugins.contract import MemoryStats
from asyncrl.plugins.profiling import TraceProfiler

__all__ = ["TemplateDevice", "TemplateOps", "TemplatePlugin", "plugin"]


class TemplateDevice:
    """The device: here the host. Replace ``kind`` with your torch device type."""

    kind = "cpu"
    visible_env = ""
    fraction = 0.0  # the share of the device this process may use (limit_memory; 0: none set)

    def available(self) -> bool:
        return True

    def count(self) -> int:
        return 1

    def select(self, index: int = 0) -> torch.device:
        return torch.device(self.kind, index) if index else torch.device(self.kind)

    def synchronize(self) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def memory(self) -> MemoryStats:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * 4096
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return MemoryStats(
            allocated=rss, reserved=rss, peak=rss, total=total, limit=int(self.fraction * total)
        )

    def release_cache(self) -> None:
        gc.collect()

    def limit_memory(self, fraction: float) -> None:
        # Cap this process's share of your device here (cuda: set_per_process_memory_fraction);
        # the host has no safe per-process cap, so the template records the budget it reports.
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"memory fraction must be in (0, 1], got {fraction!r}")
        self.fraction = fraction

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def copy_async(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return tensor.to(device)


class TemplateOps:
    """The operators. ``fast=True``: torch's fused kernels (where yours go); ``fast=False``:
    the textbook formulas, the reference."""

    def __init__(self, fast: bool) -> None:
        self.fast = fast

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool
    ) -> torch.Tensor:
        if self.fast:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.fast:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def layer_norm(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if self.fast:
            return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + eps) * weight + bias

    def logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.fast:  # never builds the [N, V] log-softmax
            return logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(-1)
        return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)

    def entropy(self, logits: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits, -1)
        return -(logp.exp() * logp).sum(-1)

    def sampling_probs(
        self, logits: torch.Tensor, *, temperature: float, top_p: float, top_k: int
    ) -> torch.Tensor:
        scaled = logits.float() / temperature
        k = top_k or scaled.shape[-1]
        values, index = scaled.topk(k, dim=-1)
        probs = torch.softmax(values, dim=-1)
        before = probs.cumsum(-1) - probs
        probs = probs.masked_fill(before >= top_p, 0)
        probs = probs / probs.sum(-1, keepdim=True)
        return torch.zeros_like(scaled).scatter(-1, index, probs)

    def sample(
        self,
        logits: torch.Tensor,
        *,
        temperature: float,
        top_p: float,
        top_k: int,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        probs = self.sampling_probs(logits, temperature=temperature, top_p=top_p, top_k=top_k)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class TemplatePlugin:
    """The plugin asyncrl loads: its name, the asyncrl versions it supports, its dtype, and
    the parts of the contract."""

    name = "template"
    asyncrl_versions = ">=0.1,<0.2"
    dtype = torch.float32

    def __init__(self) -> None:
        self.device = TemplateDevice()
        self.comm = TorchCommunication("gloo")  # your torch.distributed backend's name
        self.ops = TemplateOps(fast=True)
        self.reference_ops = TemplateOps(fast=False)
        self.compiler = BucketCompiler("inductor")  # or your torch.compile backend
        self.profiler = TraceProfiler(self.device.synchronize)


def plugin() -> TemplatePlugin:
    """The entry point (``asyncrl.plugins``: ``template``)."""
    return TemplatePlugin()
