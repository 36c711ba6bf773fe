"""Operators in plain torch: ``FastOps`` (fused kernels, chunked where it saves memory) and
``ReferenceOps`` (the textbook formulas, the self-check's yardstick). The built-in plugins use
both; a vendor's plugin may delegate to them for whatever it does not accelerate."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["FastOps", "ReferenceOps"]


def _check_targets(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() < 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits has shape {tuple(logits.shape)} but targets has shape "
            f"{tuple(targets.shape)}; targets must be the logits' shape without the vocabulary"
        )


def _check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected in (0, 1], got {top_p!r}")
    if top_k < 0:
        raise ValueError(f"top_k: expected >= 0 (0: all), got {top_k!r}")


class ReferenceOps:
    """The textbook formulas, in float32 or wider: slow and plain, and the yardstick."""

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool
    ) -> torch.Tensor:
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            t, s = q.shape[-2], k.shape[-2]
            mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        wide = x.float()
        out = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        return (out * weight.float()).to(x.dtype)

    def layer_norm(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
    ) -> torch.Tensor:
        wide = x.float()
        mean = wide.mean(-1, keepdim=True)
        var = (wide - mean).pow(2).mean(-1, keepdim=True)
        out = (wide - mean) / torch.sqrt(var + eps) * weight.float() + bias.float()
        return out.to(x.dtype)

    def logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _check_targets(logits, targets)
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    def entropy(self, logits: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits, dim=-1)
        return -(logp.exp() * logp).sum(-1)

    def sampling_probs(
        self, logits: torch.Tensor, *, temperature: float, top_p: float, top_k: int
    ) -> torch.Tensor:
        _check_sampling(temperature, top_p, top_k)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        order = probs.argsort(dim=-1, descending=True)
        sorted_p = probs.gather(-1, order)
        keep = torch.ones_like(sorted_p, dtype=torch.bool)
        if top_k:
            keep[..., top_k:] = False
        sorted_p = sorted_p * keep
        sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
        # A token stays while the mass before it is below top_p (the first always stays).
        before = sorted_p.cumsum(-1) - sorted_p
        keep &= before < top_p
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        out = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        return out / out.sum(-1, keepdim=True)

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


class FastOps(ReferenceOps):
    """torch's fused kernels: SDPA, ``F.rms_norm``, ``F.layer_norm``; log-probs as the chosen
    logit minus the logsumexp (no [N, V] log-softmax at all); entropy in chunks of rows;
    sampling sorts only the top-k, and nothing when neither top-k nor top-p cuts."""

    chunk_rows = 1024
    """Rows (positions) per chunk of the log-prob and entropy kernels."""

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool
    ) -> torch.Tensor:
        if causal and q.shape[-2] != k.shape[-2]:
            return super().attention(q, k, v, causal=causal)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def layer_norm(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    def logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # asyncrl.roles.learning.estimators.token_logprobs's formula, so the numbers (and the speed)
        # are the learner's to the bit: the chosen logit minus the logsumexp, with no [N, V]
        # log-softmax held for the backward pass.
        _check_targets(logits, targets)
        chosen = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
        return chosen - torch.logsumexp(logits, dim=-1)

    def entropy(self, logits: torch.Tensor) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        parts = []
        for f in torch.split(flat, self.chunk_rows):
            logp = torch.log_softmax(f, dim=-1)
            p = logp.exp()
            # A -inf logit (a masked token) has p == 0 and adds nothing.
            parts.append(-(p * logp.masked_fill(p == 0, 0)).sum(-1))
        return torch.cat(parts).reshape(logits.shape[:-1])

    def sampling_probs(
        self, logits: torch.Tensor, *, temperature: float, top_p: float, top_k: int
    ) -> torch.Tensor:
        _check_sampling(temperature, top_p, top_k)
        scaled = logits.float() / temperature
        if top_p == 1 and not 0 < top_k < scaled.shape[-1]:
            return torch.softmax(scaled, dim=-1)  # nothing is cut: no sort at all
        k = top_k or scaled.shape[-1]
        values, index = scaled.topk(min(k, scaled.shape[-1]), dim=-1)
        sorted_p = torch.softmax(values, dim=-1)
        if top_p < 1:
            before = sorted_p.cumsum(-1) - sorted_p
            sorted_p = sorted_p.masked_fill(before >= top_p, 0)
            sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
        return torch.zeros_like(scaled).scatter(-1, index, sorted_p)
