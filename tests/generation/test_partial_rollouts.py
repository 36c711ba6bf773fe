"""Partial rollouts across rollout replicas, in-process: chunks and weight-update interrupts.

Two ``Rollout`` roles with the same model config and seed stand for two replicas. A sample is
cut (by the chunk budget, or by new weights with ``interrupt_on_weights``) and resumed on the
other replica: the tokens it had are kept as they were, each with the version that produced it,
and the replicas' ``stats`` show that no token was generated twice.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
import torch

from asyncrl.role import Delivery, RoleContext, endpoints_of
from asyncrl.roles.generation.engine import HFEngine
from asyncrl.roles.generation.rollout import (
    GenerateBatch,
    GenerateRequest,
    Prompt,
    Rollout,
    Sample,
    SamplingParams,
    WeightsUpdate,
)
from asyncrl.roles.payloads import RolloutStats
from asyncrl.weights import WeightStore, handle_path, write_handle

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
SEED = 5
PROMPT = Prompt(id="p", token_ids=[3, 1, 4, 1, 5])
TOL = 1e-4


async def started(**config: Any) -> Rollout:
    ctx_kw = config.pop("ctx", {})
    role = Rollout(
        RoleContext.local(config={"model_config": MODEL, "seed": SEED, **config}, **ctx_kw)
    )
    await role.setup()
    return role


def request(max_new_tokens: int, partial: Sample | None = None) -> GenerateBatch:
    return GenerateBatch(
        [
            GenerateRequest(
                prompt=PROMPT,
                sample_index=0,
                params=SamplingParams(max_new_tokens=max_new_tokens),
                partial=partial,
            )
        ]
    )


def new_state(seed: int = 1) -> dict[str, torch.Tensor]:
    return dict(HFEngine.from_config(MODEL, seed=seed).model.state_dict())


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    worst = max((abs(a - b) for a, b in zip(got, want, strict=True)), default=0.0)
    assert worst <= TOL, f"log-probs differ by {worst:.3g}: {got} vs {want}"


def assert_kept(before: Sample, after: Sample) -> None:
    """``after`` resumed ``before``: its first tokens are ``before``'s, exactly."""
    k = len(before.token_ids)
    assert after.token_ids[:k] == before.token_ids
    assert after.logprobs[:k] == before.logprobs
    assert after.versions[:k] == before.versions


def hold_at_step(role: Rollout, step: int) -> tuple[asyncio.Event, threading.Event]:
    """Make ``role``'s next generation stop after decode step ``step`` until the test lets it go.

    Returns ``(reached, go)``: ``reached`` is set (on the loop) when the worker thread holds;
    setting ``go`` lets it continue.
    """
    loop = asyncio.get_running_loop()
    reached = asyncio.Event()
    go = threading.Event()

    def on_step(steps: int) -> None:  # in the worker thread, between two decode steps
        if steps == step:
            loop.call_soon_threadsafe(reached.set)
            if not go.wait(timeout=60):
                raise TimeoutError("the test never let the generation go on")

    role.engine.on_step = on_step
    return reached, go


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        return await scenario()

    return asyncio.run(main())


def test_the_stats_endpoint_is_idempotent_and_counts_by_field() -> None:
    spec = endpoints_of(Rollout)["stats"]
    assert (spec.delivery, spec.request_type, spec.reply_type) == (
        Delivery.IDEMPOTENT,
        type(None),
        RolloutStats,
    )

    async def scenario() -> tuple[RolloutStats, RolloutStats]:
        role = await started()
        try:
            before = await role.stats(None)
            await role.generate(request(4))
            return before, await role.stats(None)
        finally:
            role.ctx.close()

    before, after = run(scenario)
    assert before == RolloutStats(
        forward_passes=0, prefill_tokens=0, tokens_generated=0, weight_switches=0
    )
    # One prefill and three decode steps; the prompt's tokens were the prefill.
    assert after == RolloutStats(
        forward_passes=4, prefill_tokens=5, tokens_generated=4, weight_switches=0
    )
    # On the wire it is a map by field, so a caller may still decode it as a dict.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(after), type=dict[str, int]) == {
        "forward_passes": 4,
        "prefill_tokens": 5,
        "tokens_generated": 4,
        "weight_switches": 0,
    }


def test_chunks_alternate_between_replicas_and_nothing_is_regenerated() -> None:
    n = 11

    async def scenario() -> tuple[list[Sample], Sample, list[dict[str, int]]]:
        a = await started(chunk_tokens=3)
        b = await started(chunk_tokens=3)
        whole = await started()  # no budget: the uninterrupted sample
        try:
            parts: list[Sample] = []
            partial = None
            for replica in (a, b, a, b):
                (partial,) = await replica.generate(request(n, partial))
                parts.append(partial)
            (reference,) = await whole.generate(request(n))
            return parts, reference, [await a.stats(None), await b.stats(None)]
        finally:
            for role in (a, b, whole):
                role.ctx.close()

    parts, reference, stats = run(scenario)
    assert [(len(s.token_ids), s.finished, s.stop_reason) for s in parts] == [
        (3, False, "chunk"),
        (6, False, "chunk"),
        (9, False, "chunk"),
        (11, True, "length"),
    ]
    for before, after in itertools.pairwise(parts):
        assert_kept(before, after)
    final = parts[-1]
    assert final.versions == [0] * n
    # Each replica sampled only its own chunks: 3 + 3 on A, 3 + 2 on B.
    assert [s.tokens_generated for s in stats] == [6, 5]
    assert sum(s.tokens_generated for s in stats) == len(final.token_ids)
    # Seeds are per token position, so the chunked sample is the uninterrupted one.
    assert final.token_ids == reference.token_ids
    assert_close(final.logprobs, reference.logprobs)


def update_mid_generation(
    interrupt: bool, k: int, n: int
) -> tuple[Sample, int, dict[str, int], Sample | None, dict[str, int] | None]:
    """Generate ``n`` tokens on replica A; new weights (version 1) arrive after step ``k``.

    With ``interrupt``, the partial A returns is resumed on replica B, which holds version 1.
    Returns A's sample, the version ``set_weights`` answered, A's stats, and B's sample and
    stats (None without ``interrupt``).
    """
    state = new_state()

    async def scenario() -> tuple[Sample, int, dict[str, int], Sample | None, Any]:
        a = await started(interrupt_on_weights=interrupt)
        b = await started()
        try:
            assert await b.set_weights(WeightsUpdate(1, state)) == 1  # idle: at once
            reached, go = hold_at_step(a, k)
            async with asyncio.TaskGroup() as tg:
                generating = tg.create_task(a.generate(request(n)))
                await reached.wait()
                try:
                    answered = await a.set_weights(WeightsUpdate(1, state))
                finally:
                    go.set()
            (first,) = generating.result()
            assert await a.version(None) == 1  # applied once the generation returned
            if not interrupt:
                return first, answered, await a.stats(None), None, None
            (resumed,) = await b.generate(request(n, first))
            return first, answered, await a.stats(None), resumed, await b.stats(None)
        finally:
            a.ctx.close()
            b.ctx.close()

    result: tuple[Sample, int, dict[str, int], Sample | None, dict[str, int] | None]
    result = run(scenario)
    return result


def test_new_weights_interrupt_and_the_sample_resumes_elsewhere_under_them() -> None:
    k, n = 3, 12
    partial, answered, stats_a, final, stats_b = update_mid_generation(True, k, n)
    assert answered == 0  # pending: the generation had not reached a step boundary
    assert (len(partial.token_ids), partial.finished, partial.stop_reason) == (
        k,
        False,
        "interrupted",
    )
    assert partial.versions == [0] * k
    assert final is not None and stats_b is not None
    assert (len(final.token_ids), final.finished, final.stop_reason) == (n, True, "length")
    assert final.versions == [0] * k + [1] * (n - k)
    assert_kept(partial, final)
    assert stats_a.tokens_generated + stats_b.tokens_generated == n
    assert (stats_a.tokens_generated, stats_a.weight_switches) == (k, 1)
    # The resume's prefill recomputed the cache under version 1: no token mixes versions, so
    # each part equals a plain recompute under its own weights.
    old = HFEngine.from_config(MODEL, seed=SEED).score([PROMPT.token_ids], [final.token_ids])[0]
    new = HFEngine.from_config(MODEL, seed=1).score([PROMPT.token_ids], [final.token_ids])[0]
    assert_close(final.logprobs[:k], old[:k])
    assert_close(final.logprobs[k:], new[k:])


def test_without_interrupt_on_weights_the_update_switches_mid_generation() -> None:
    k, n = 3, 12
    interrupted, _, _, _, _ = update_mid_generation(True, k, n)
    sample, answered, stats, resumed, _ = update_mid_generation(False, k, n)
    assert resumed is None
    assert answered == 0
    assert (len(sample.token_ids), sample.finished, sample.stop_reason) == (n, True, "length")
    assert sample.versions == [0] * k + [1] * (n - k)
    assert_kept(interrupted, sample)  # the same first k tokens, before the update
    assert (stats.tokens_generated, stats.weight_switches) == (n, 1)


def test_weights_from_sync_interrupt_and_the_sample_resumes_on_the_same_replica(
    tmp_path: Any,
) -> None:
    k, n = 2, 7
    state = new_state()

    async def scenario() -> tuple[Sample, int, Sample, dict[str, int]]:
        # Capacity 2: the shared-memory read runs beside the generation, not behind it.
        ctx = {"run_dir": str(tmp_path), "name": "rollout", "run": f"partial-{uuid.uuid4().hex}"}
        role = await started(
            weights_from="learner", interrupt_on_weights=True, ctx={**ctx, "capacity": 2}
        )
        assert await role.version(None) == 0  # nothing published yet
        store = WeightStore(state, run=ctx["run"])
        try:
            reached, go = hold_at_step(role, k)
            async with asyncio.TaskGroup() as tg:
                generating = tg.create_task(role.generate(request(n)))
                await reached.wait()
                try:
                    store.publish(state, 1)
                    write_handle(handle_path(str(tmp_path), "learner"), store.describe())
                    answered = await role.sync(None)
                finally:
                    go.set()
            (partial,) = generating.result()
            (final,) = await role.generate(request(n, partial))
            return partial, answered, final, await role.stats(None)
        finally:
            role.ctx.close()
            store.close()

    partial, answered, final, stats = run(scenario)
    assert answered == 0
    assert (len(partial.token_ids), partial.stop_reason, partial.versions) == (
        k,
        "interrupted",
        [0] * k,
    )
    assert (final.finished, final.versions) == (True, [0] * k + [1] * (n - k))
    assert_kept(partial, final)
    assert (stats.tokens_generated, stats.weight_switches) == (n, 1)


def test_interrupt_on_weights_is_off_by_default() -> None:
    assert msgspec.convert({"model_path": "x"}, Rollout.Config).interrupt_on_weights is False
    on = msgspec.convert({"model_path": "x", "interrupt_on_weights": True}, Rollout.Config)
    assert on.interrupt_on_weights is True


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"model_path": "x", "interrupt_on_weights": "yes"},
            "Expected `bool`, got `str` - at `$.interrupt_on_weights`",
        ),
        (
            {"model_path": "x", "interrupt_on_weights": 1},
            "Expected `bool`, got `int` - at `$.interrupt_on_weights`",
        ),
        ({"model_path": "x", "chunk_tokens": -1}, "chunk_tokens: expected an int >= 0, got -1"),
        (
            {"model_path": "x", "interrupt_on_weight": True},
            "Object contains unknown field `interrupt_on_weight`",
        ),
    ],
)
def test_config_errors_say_what_to_fix(config: dict[str, Any], message: str) -> None:
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.convert(config, Rollout.Config)
    assert str(info.value) == message
