"""The self-check's layers that run in this process: operators, compilation, memory,
cross-hardware checkpoints and a tiny end-to-end training run. Each returns a list of ``Check``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec
import torch
from torch import nn

from asyncrl.plugins.contract import Device, Operators, Plugin

__all__ = ["Check", "TinyLM", "compilation", "memory", "operators"]


class Check(msgspec.Struct):
    """One check of a layer.

    Attributes:
        name: what was checked.
        ok: whether it was correct.
        max_error: the largest error against the yardstick (None: not a numerical check).
        speed: how many times faster than the yardstick (None: not timed); for communication,
            the median call in milliseconds.
        detail: what was compared, or what went wrong.
    """

    name: str
    ok: bool
    max_error: float | None = None
    speed: float | None = None
    detail: str = ""


def _median_time(fn: Callable[[], Any], sync: Callable[[], None], reps: int = 5) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return max(statistics.median(times), 1e-9)


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference, relative to the reference's scale (at least 1)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2


def _operator_cases(
    device: torch.device, dtype: torch.dtype
) -> dict[str, tuple[Callable[[Operators], torch.Tensor], torch.dtype]]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)

    q, k, v = rand(2, 4, 128, 32), rand(2, 4, 128, 32), rand(2, 4, 128, 32)
    x, w, b = rand(512, 256), rand(256), rand(256)
    logits = rand(4, 128, 4096, scale=4.0, dt=torch.float32)
    targets = torch.randint(0, 4096, (4, 128), generator=g).to(device)
    flat = logits[0]
    sample = {"temperature": 0.8, "top_p": 0.9, "top_k": 50}
    return {
        "attention (causal)": (lambda o: o.attention(q, k, v, causal=True), dtype),
        "attention": (lambda o: o.attention(q, k, v, causal=False), dtype),
        "rms_norm": (lambda o: o.rms_norm(x, w, 1e-6), dtype),
        "layer_norm": (lambda o: o.layer_norm(x, w, b, 1e-5), dtype),
        "logprobs": (lambda o: o.logprobs(logits, targets), torch.float32),
        "entropy": (lambda o: o.entropy(logits), torch.float32),
        "sampling (t, top-p, top-k)": (lambda o: o.sampling_probs(flat, **sample), torch.float32),
    }


def operators(plugin: Plugin, device: torch.device) -> list[Check]:
    """Each operator, fast against reference: the max error and the speed ratio."""
    sync = plugin.device.synchronize
    out = []
    for name, (run, dtype) in _operator_cases(device, plugin.dtype).items():
        try:
            fast, ref = run(plugin.ops), run(plugin.reference_ops)
            err = _error(fast, ref) if fast.shape == ref.shape else float("inf")
            ref_s = _median_time(partial(run, plugin.reference_ops), sync)
            speed = ref_s / _median_time(partial(run, plugin.ops), sync)
            tol = _tolerance(dtype)
            detail = f"{dtype}, tolerance {tol:g}"
            out.append(Check(name, err <= tol, err, speed, detail))
        except Exception as exc:
            out.append(Check(name, False, detail=f"{type(exc).__name__}: {exc}"))
    out.append(_sampling_support(plugin, device))
    return out


def _sampling_support(plugin: Plugin, device: torch.device) -> Check:
    """Tokens drawn by the fast sampler lie where the reference distribution is not zero."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(64, 1000, generator=g) * 3).to(device)
    kw: dict[str, Any] = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    try:
        drawn = plugin.ops.sample(logits, **kw)
        probs = plugin.reference_ops.sampling_probs(logits, **kw)
        ok = bool((probs.gather(-1, drawn[:, None].long()) > 0).all())
        return Check("sample draws inside top-k/top-p", ok, detail="64 rows, 1000 tokens")
    except Exception as exc:
        return Check("sample draws inside top-k/top-p", False, detail=f"{exc}")


def compilation(plugin: Plugin, device: torch.device) -> list[Check]:
    """Bucketed compile against eager: outputs, one graph per bucket, speed."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(64, 64, generator=g) / 8).to(device)
    norm = torch.ones(64, device=device)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(torch.nn.functional.silu(x) @ w + x, (64,), norm)

    compiled = plugin.compiler.compile(fn, buckets=[16, 32], dim=1)
    lengths = [9, 13, 16, 20, 32, 11, 27]
    try:
        inputs = [torch.randn(4, n, 64, generator=g).to(device) for n in lengths]
        err = max(_error(compiled(x), fn(x)) for x in inputs)
    except Exception as exc:
        return [Check("bucketed compile", False, detail=f"{type(exc).__name__}: {exc}")]
    if compiled.eager:
        detail = f"eager fallback ({compiled.error or 'compilation off'})"
        return [Check("bucketed compile", err == 0.0, err, 1.0, detail)]
    sync = plugin.device.synchronize
    x = inputs[-1]
    speed = _median_time(lambda: fn(x), sync) / _median_time(lambda: compiled(x), sync)
    return [
        Check("bucketed compile matches eager", err <= 1e-4, err, speed, "7 lengths, 2 buckets"),
        Check(
            "one graph per bucket",
            compiled.compiles == 2,
            detail=f"{compiled.compiles} graph(s) for lengths {lengths} in buckets [16, 32]",
        ),
    ]


def _statistics(dev: Device, device: torch.device, size: int) -> Check:
    """Whether ``dev.memory().allocated`` grows by a ``size``-byte tensor and falls back when
    it is released. On the host a tensor can be served from memory the process already holds
    (a free block in glibc's heap, which a plugin's ``release_cache`` need not hand back), so
    there a tensor that does not move the figure is kept, and a fresh one tried, up to 3; on
    another device the first tensor must move it."""
    tries = 3 if device.type == "cpu" else 1
    held: list[torch.Tensor] = []  # tensors that reused held memory: kept so the next cannot
    grown = shrunk = 0
    for _ in range(tries):
        dev.release_cache()
        before = dev.memory().allocated
        block = torch.ones(size // 4, device=device)
        dev.synchronize()
        grown = dev.memory().allocated - before
        if grown < 0.9 * size:
            held.append(block)
            continue
        del block
        dev.release_cache()
        shrunk = before + size - dev.memory().allocated
        break
    reused = len(held)
    held.clear()
    dev.release_cache()
    ok = grown >= 0.9 * size and shrunk >= 0.9 * size
    detail = f"+{grown / 2**20:.1f} MiB allocated, -{shrunk / 2**20:.1f} MiB after release"
    if not ok and grown < 0.9 * size and tries > 1:
        detail += f" (the last of {tries} tensors, none of which moved the figure)"
    elif reused:
        detail += f" (tensor {reused + 1}: the ones before it reused memory the process held)"
    return Check(f"statistics follow a {size >> 20} MiB tensor", ok, detail=detail)


def memory(plugin: Plugin, device: torch.device) -> list[Check]:
    """Memory statistics follow an allocation and its release; pinned and async copies."""
    dev = plugin.device
    stats = _statistics(dev, device, 64 << 20)
    host = torch.arange(1 << 20, dtype=torch.float32)
    pinned = dev.pin(host)
    start = time.perf_counter()
    there = dev.copy_async(pinned, device)
    back = there.to("cpu")
    dev.synchronize()
    seconds = max(time.perf_counter() - start, 1e-9)
    copies = Check(
        "pinned, asynchronous copy round trip",
        bool(torch.equal(back, host)),
        detail=f"4 MiB there and back at {2 * 4 / 1024 / seconds:.2f} GiB/s",
    )
    return [stats, copies]


class TinyLM(nn.Module):
    """A one-block causal LM built on a plugin's operators (attention, RMSNorm)."""

    def __init__(self, ops: Operators, vocab: int = 8, dim: int = 32) -> None:
        super().__init__()
        self.ops = ops
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm = nn.Parameter(torch.ones(dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        q, k, v = (t[:, None] for t in self.qkv(h).chunk(3, dim=-1))
        h = h + self.ops.attention(q, k, v, causal=True)[:, 0]
        out: torch.Tensor = self.head(self.ops.rms_norm(h, self.norm, 1e-6))
        return out
