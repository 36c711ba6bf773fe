"""The rollout engines take device, dtype and operators from the hardware plugin registry, and
a rollout can give its device's cache back when it goes idle.

A plugin whose operators deliberately differ (sampling always picks the least likely token;
log-probs are a constant) must change what the engine produces: proof that the engine calls
them rather than its own copies.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
import torch

from asyncrl.plugins.cpu import CpuPlugin
from asyncrl.plugins.errors import PluginError
from asyncrl.plugins.torch_ops import FastOps
from asyncrl.role import RoleContext
from asyncrl.roles.generation.engine import HFEngine, draw
from asyncrl.roles.generation.rollout import (
    GenerateBatch,
    GenerateRequest,
    Prompt,
    Rollout,
    SamplingParams,
    build_engine,
)

torch.set_num_threads(1)

MODEL: dict[str, Any] = {
    "model_type": "gpt2",
    "vocab_size": 16,
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 4,
    "n_positions": 64,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "initializer_range": 0.2,
}
PROMPTS = [[3], [5, 1, 4, 1], [9, 2, 6, 5, 3, 5, 8]]
CONSTANT = -0.25


class ContraryOps(FastOps):
    """Operators that differ on purpose: all probability on the least likely token, and every
    log-prob ``CONSTANT``."""

    def sampling_probs(
        self, logits: torch.Tensor, *, temperature: float, top_p: float, top_k: int
    ) -> torch.Tensor:
        out = torch.zeros_like(logits, dtype=torch.float32)
        return out.scatter(-1, logits.argmin(-1, keepdim=True), 1.0)

    def logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.full(targets.shape, CONSTANT, dtype=torch.float32, device=logits.device)


class ContraryPlugin(CpuPlugin):
    name = "contrary"

    def __init__(self) -> None:
        super().__init__()
        self.ops = ContraryOps()


def requests(n_new: int = 6, **params: Any) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            prompt=Prompt(id=f"p{i}", token_ids=p),
            sample_index=0,
            params=SamplingParams(max_new_tokens=n_new, **params),
            seed=i,
        )
        for i, p in enumerate(PROMPTS)
    ]


def least_likely(model: Any, prompt: Sequence[int], tokens: Sequence[int]) -> list[int]:
    """The argmin of the model's logits after ``prompt`` and each prefix of ``tokens``."""
    ids = torch.tensor([[*prompt, *tokens]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return [int(t) for t in logits.argmin(-1).tolist()]


def test_the_engine_samples_and_scores_with_the_plugins_operators() -> None:
    contrary = HFEngine.from_config(MODEL, ops=ContraryOps())
    samples = contrary.generate(requests(temperature=0.9, top_k=8, top_p=0.9))
    for s in samples:
        assert s.token_ids == least_likely(contrary.model, s.prompt_ids, s.token_ids)
        assert s.logprobs == [CONSTANT] * 6
    scored = contrary.score([s.prompt_ids for s in samples], [s.token_ids for s in samples])
    assert scored == [[CONSTANT] * 6] * 3
    # The same model and seeds with the cpu plugin's operators sample otherwise.
    plain = HFEngine.from_config(MODEL).generate(requests(temperature=0.9, top_k=8, top_p=0.9))
    assert [s.token_ids for s in plain] != [s.token_ids for s in samples]
    assert all(CONSTANT not in s.logprobs for s in plain)


def test_greedy_rows_take_the_argmax_whatever_the_sampling_operator() -> None:
    contrary = HFEngine.from_config(MODEL, ops=ContraryOps())
    plain = HFEngine.from_config(MODEL)
    got = contrary.generate(requests(greedy=True))
    assert [s.token_ids for s in got] == [
        s.token_ids for s in plain.generate(requests(greedy=True))
    ]


def config(**fields: Any) -> Rollout.Config:
    return msgspec.convert({"model_config": MODEL, **fields}, Rollout.Config)


def test_build_engine_takes_device_dtype_and_operators_from_the_plugin() -> None:
    plugin = ContraryPlugin()
    engine: Any = build_engine(config(), "cpu", plugin)
    assert engine.ops is plugin.ops
    assert (engine.device, next(engine.model.parameters()).dtype) == (
        torch.device("cpu"),
        torch.float32,
    )
    half: Any = build_engine(config(dtype="bfloat16"), "cpu", plugin)
    assert next(half.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(PluginError) as info:
        build_engine(config(), "xpu:1", plugin)
    assert str(info.value) == (
        "placement.device 'xpu:1' is not a device of the 'contrary' plugin (its devices are "
        "'cpu' or 'cpu:N'); fix the placement or choose another plugin (run.plugin or "
        "ASYNCRL_PLUGIN)"
    )


def test_draw_walks_the_columns_and_never_picks_one_without_probability() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.25, 0.25, 0.25, 0.25], [0.2, 0.2, 0.2, 0.0]])
    assert draw(probs, [0.0, 0.0, 0.0]).tolist() == [1, 0, 0]
    assert draw(probs, [0.49, 0.74, 0.5]).tolist() == [1, 2, 1]
    assert draw(probs, [0.5, 0.75, 0.99]).tolist() == [3, 3, 2]
    # u * total rounding up to the total must not step onto a column without probability.
    assert draw(probs, [1.0, 1.0, 1.0]).tolist() == [3, 3, 2]


def batch() -> GenerateBatch:
    return GenerateBatch(requests())


async def generate_and_wait_for_release(role: Rollout) -> int:
    """One generate call; returns the releases counted once the batching task is idle."""
    share = role._share
    assert share is not None
    released = threading.Event()
    original = share.release

    def release() -> dict[str, int]:
        try:
            return original()
        finally:
            released.set()

    share.release = release  # type: ignore[method-assign]
    await role.generate(batch())
    if share.release_when_idle:
        assert await asyncio.to_thread(released.wait, 30)
    return int(role.status()["releases"])


@pytest.mark.parametrize("release", [True, False])
def test_a_rollout_releases_its_cache_when_idle_only_when_asked(release: bool) -> None:
    async def scenario() -> tuple[dict[str, Any], int]:
        ctx = RoleContext.local(config={"model_config": MODEL, "release_when_idle": release})
        role = Rollout(ctx)
        assert role.status() == {}
        await role.setup()
        try:
            return role.status(), await generate_and_wait_for_release(role)
        finally:
            await role.teardown()
            ctx.close()

    before, releases = asyncio.run(scenario())
    assert (before["device"], before["release_when_idle"], before["releases"]) == (
        "cpu",
        release,
        0,
    )
    assert set(before["memory"]) >= {"allocated", "reserved", "peak", "total"}
    assert releases == (1 if release else 0)


def test_a_release_that_fails_is_logged_and_batching_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The cache release is an economy: when it raises, the rollout logs why and keeps
    generating (its batching task must not die with it, refusing every later call)."""

    async def scenario() -> list[int]:
        ctx = RoleContext.local(config={"model_config": MODEL, "release_when_idle": True})
        role = Rollout(ctx)
        await role.setup()
        share = role._share
        assert share is not None
        failed = threading.Event()

        def release() -> dict[str, int]:
            failed.set()
            raise RuntimeError("the device said no")

        share.release = release  # type: ignore[method-assign]
        try:
            first = await role.generate(batch())
            assert await asyncio.to_thread(failed.wait, 30)
            second = await role.generate(batch())
            return [len(first), len(second)]
        finally:
            await role.teardown()
            ctx.close()

    assert asyncio.run(scenario()) == [3, 3]
    assert any(
        "rollout cache release failed: RuntimeError('the device said no')" in r.getMessage()
        for r in caplog.records
    )
