"""The self-check's training layers: checkpoints across devices and dtypes, and a tiny end-to-end
run (behaviour cloning first, the simpler thing to get stable on new hardware, then GRPO)."""

from __future__ import annotations

import io

import torch

from asyncrl.plugins.contract import Plugin
from asyncrl.plugins.selfcheck_layers import Check, TinyLM, _error

__all__ = ["checkpoints", "end_to_end"]

VOCAB = 8


def _bc_steps(model: TinyLM, steps: int, seed: int) -> tuple[float, float]:
    """Behaviour cloning on "each token is followed by the next one": first and last loss."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (16, 1), generator=g)
        seq = ((start + torch.arange(9)) % VOCAB).to(device)
        logits = model(seq[:, :-1]).float()
        loss = -model.ops.logprobs(logits, seq[:, 1:]).mean()
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(float(loss.detach()))
    return losses[0], losses[-1]


def _grpo_steps(model: TinyLM, steps: int, seed: int) -> tuple[float, float]:
    """GRPO on "answer the prompt plus two": groups of 8 samples, rewards centred and scaled
    per group. First and last mean reward."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rewards = []
    for _ in range(steps):
        prompts = torch.randint(0, VOCAB, (8,), generator=g).repeat_interleave(8)[:, None]
        prompts = prompts.to(device)
        logits = model(prompts)[:, -1].float()
        with torch.no_grad():
            drawn = model.ops.sample(logits, temperature=1.0, top_p=1.0, top_k=0)
        reward = (drawn == (prompts[:, 0] + 2) % VOCAB).float()
        grouped = reward.view(8, 8)
        adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
        loss = -(adv.view(-1) * model.ops.logprobs(logits, drawn)).mean()
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        rewards.append(float(reward.mean()))
    return sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5


def end_to_end(plugin: Plugin, device: torch.device) -> list[Check]:
    """A tiny BC run, then a tiny GRPO run from its weights, on the plugin's device and
    operators (float32 parameters)."""
    plugin.device.manual_seed(0)
    model = TinyLM(plugin.ops, VOCAB).to(device)
    try:
        first, last = _bc_steps(model, 60, seed=0)
        bc = Check(
            "behaviour cloning learns",
            last < 0.5 * first,
            detail=f"loss {first:.3f} -> {last:.3f} in 60 steps",
        )
        start, end = _grpo_steps(model, 60, seed=1)
        grpo = Check(
            "GRPO raises the reward",
            end >= start + 0.3,
            detail=f"mean reward {start:.2f} -> {end:.2f} in 60 steps",
        )
    except Exception as exc:
        return [Check("end to end", False, detail=f"{type(exc).__name__}: {exc}")]
    return [bc, grpo]


def _roundtrip(
    plugin: Plugin, save: tuple[torch.device, torch.dtype], load: tuple[torch.device, torch.dtype]
) -> Check:
    """A model saved on ``save`` (device, dtype) and loaded on ``load``: the first forward pass
    matches within the coarser dtype's tolerance, and a training step continues."""
    name = f"{save[0].type} {str(save[1])[6:]} -> {load[0].type} {str(load[1])[6:]}"
    plugin.device.manual_seed(3)
    src = TinyLM(plugin.ops, VOCAB).to(device=save[0], dtype=save[1])
    ids = torch.arange(VOCAB).repeat(2, 1).to(save[0])
    expected = src(ids).float().cpu()
    buffer = io.BytesIO()
    torch.save(src.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, map_location="cpu", weights_only=True)
    dst = TinyLM(plugin.ops, VOCAB).to(device=load[0], dtype=load[1])
    dst.load_state_dict(state)
    err = _error(dst(ids.to(load[0])).float(), expected)
    coarse = torch.float32 not in (save[1],) or load[1] != torch.float32
    tol = 3e-2 if coarse else 1e-6
    first, last = _bc_steps(dst, 3, seed=4)
    trains = torch.isfinite(torch.tensor([first, last])).all().item()
    detail = f"tolerance {tol:g}; a BC step after loading: loss {first:.3f} -> {last:.3f}"
    return Check(name, err <= tol and bool(trains), err, None, detail)


def checkpoints(plugin: Plugin, device: torch.device) -> list[Check]:
    """Checkpoints written under one device and dtype load under another (both ways)."""
    host = torch.device("cpu")
    pairs = [((host, torch.float32), (host, torch.bfloat16))]
    if device.type != "cpu" or plugin.dtype != torch.float32:
        pairs.append(((device, plugin.dtype), (host, torch.float32)))
    out = []
    for a, b in pairs:
        for save, load in ((a, b), (b, a)):
            try:
                out.append(_roundtrip(plugin, save, load))
            except Exception as exc:
                out.append(Check(f"{save} -> {load}", False, detail=f"{exc}"))
    return out
