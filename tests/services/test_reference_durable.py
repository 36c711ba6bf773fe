"""The reference keeps the weights it was given: in-process, and a real process SIGKILLed and
restarted by its supervisor."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
from typing import Any

import pytest
import torch

from asyncrl.bench.harness import role_child
from asyncrl.manifest.load import Supervision
from asyncrl.observe import logs
from asyncrl.role import RoleContext
from asyncrl.roles.generation.rollout import Sample, WeightsUpdate
from asyncrl.roles.services.reference import WEIGHTS_FILE, Reference
from asyncrl.roles.training.learner import build_model
from asyncrl.supervision.supervisor import Supervisor
from asyncrl.transport import Client, run

MODEL = {
    "model_type": "gpt2",
    "vocab_size": 14,
    "n_positions": 16,
    "n_embd": 32,
    "n_layer": 1,
    "n_head": 2,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
SAMPLES = [
    Sample(
        prompt_id="a",
        sample_index=0,
        prompt_ids=[2, 3, 12, 4, 13],
        token_ids=[5, 6, 1],
        logprobs=[0.0] * 3,
        versions=[0] * 3,
        finished=True,
        stop_reason="stop",
    ),
    Sample(
        prompt_id="b",
        sample_index=0,
        prompt_ids=[7, 13],
        token_ids=[8, 1],
        logprobs=[0.0] * 2,
        versions=[0] * 2,
        finished=True,
        stop_reason="stop",
    ),
]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _learners_weights(seed: int) -> dict[str, torch.Tensor]:
    """Weights other than any reference's own initial ones: a model built with ``seed``."""
    return {k: v.clone() for k, v in build_model("", MODEL, seed).state_dict().items()}


async def _reference(run_dir: str) -> Reference:
    reference = Reference(
        RoleContext.local(config={"model_config": MODEL, "seed": 9}, run_dir=run_dir)
    )
    await reference.setup()
    return reference


def test_set_weights_is_on_disk_before_the_reply_and_a_new_replica_loads_it(
    tmp_path: Any,
) -> None:
    async def go() -> None:
        first = await _reference(str(tmp_path))
        path = first.ctx.path(WEIGHTS_FILE)
        assert not os.path.exists(path)
        initial = await first.logprobs(SAMPLES)
        assert await first.set_weights(WeightsUpdate(5, _learners_weights(3))) == 5
        given = await first.logprobs(SAMPLES)
        assert given != initial
        kept = torch.load(path, weights_only=True)
        assert kept["version"] == 5
        assert not os.path.exists(path + ".tmp")

        # A partial update keeps the tensors of the earlier one, on disk too.
        part = {"transformer.ln_f.bias": torch.full((32,), 0.5)}
        assert await first.set_weights(WeightsUpdate(6, part)) == 6
        partial = await first.logprobs(SAMPLES)

        second = await _reference(str(tmp_path))
        assert second.engine.version == 6
        assert await second.logprobs(SAMPLES) == partial
        whole = second.engine.model.state_dict()
        assert torch.equal(whole["transformer.ln_f.bias"], torch.full((32,), 0.5))
        learner = _learners_weights(3)
        assert torch.equal(
            whole["transformer.h.0.mlp.c_fc.weight"], learner["transformer.h.0.mlp.c_fc.weight"]
        )

    asyncio.run(go())


def test_a_write_that_died_is_removed_and_never_loaded(tmp_path: Any) -> None:
    async def go() -> None:
        first = await _reference(str(tmp_path))
        initial = await first.logprobs(SAMPLES)
        # What a kill in the middle of torch.save leaves, under this release's temporary name
        # and an earlier release's fixed one.
        torn = [first.ctx.path(f".{WEIGHTS_FILE}.k3x9.tmp"), first.ctx.path(WEIGHTS_FILE + ".tmp")]
        for path in torn:
            with open(path, "wb") as f:
                f.write(b"torn")
        second = await _reference(str(tmp_path))
        assert second.engine.version == 0
        assert await second.logprobs(SAMPLES) == initial
        assert not any(os.path.exists(path) for path in torn)

    asyncio.run(go())


class _Lives:
    """The supervisor's observer: a queue of ``(event, incarnation)`` of the reference."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[tuple[str, int]] = asyncio.Queue()

    def __call__(self, kind: str, label: str, incarnation: int) -> None:
        self.events.put_nowait((kind, incarnation))

    async def until(self, wanted: tuple[str, int]) -> None:
        while await asyncio.wait_for(self.events.get(), 90) != wanted:
            pass


@pytest.mark.slow
def test_a_sigkilled_reference_comes_back_with_the_weights_it_was_last_given() -> None:
    run_dir = tempfile.mkdtemp(prefix="arl-ref-")
    policy = Supervision(
        startup_timeout_s=90.0, backoff_initial_s=0.0, backoff_max_s=0.0, max_restarts=3
    )
    child = role_child(
        run_dir,
        "reference",
        "asyncrl.roles.services.reference:Reference",
        {"model_config": MODEL, "seed": 9},
        policy,
    )
    lives = _Lives()
    logs.configure(role="test", console=False)

    async def main() -> None:
        supervisor = Supervisor(
            [child], run="bench", log_dir=os.path.join(run_dir, "logs"), observer=lives
        )
        supervised = asyncio.get_running_loop().create_task(supervisor.run())
        try:
            await lives.until(("serving", 0))
            async with Client(child.endpoint, name="test") as client:
                initial = await client.call("logprobs", SAMPLES, list[list[float]], timeout=60)
                update = WeightsUpdate(5, _learners_weights(3))
                assert await client.call("set_weights", update, int, timeout=60) == 5
                before = await client.call("logprobs", SAMPLES, list[list[float]], timeout=60)
                assert before != initial
                pid = (await client.call("_describe", None, timeout=60))["pid"]
                os.kill(pid, signal.SIGKILL)
                await lives.until(("serving", 1))
                after = await client.call("logprobs", SAMPLES, list[list[float]], timeout=60)
                assert (await client.call("_describe", None, timeout=60))["pid"] != pid
            assert after == before
        finally:
            supervisor.stop("test done")
            await supervised
        with open(os.path.join(run_dir, "logs", "reference.0.jsonl")) as f:
            lines = [json.loads(line) for line in f]
        loaded = [e for e in lines if "loaded the weights it was last given" in e["event"]]
        assert [(e["incarnation"], "version 5" in e["event"]) for e in loaded] == [(1, True)]

    try:
        run(main())
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
