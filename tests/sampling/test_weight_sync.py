"""Learner -> rollout through the shared-memory weight store, and log-prob agreement across them;
``WeightSync``'s waits and background pushes against a fake rollout group, on a fake clock.

The behaviour log-probs the rollout records must equal the learner's recompute of the same tokens
under the same weights, to 1e-4 in fp32, for a batch with left padding.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from asyncrl.clock import FakeClock
from asyncrl.errors import StallError
from asyncrl.role import RoleContext
from asyncrl.roles.generation.rollout import (
    GenerateBatch,
    GenerateRequest,
    Prompt,
    Rollout,
    Sample,
    SamplingParams,
)
from asyncrl.roles.sampling.weight_sync import WeightSync
from asyncrl.roles.training.learner import Learner, Scored, TrainBatch
from asyncrl.transport import run

WAIT_S = 10.0

MODEL = {
    "model_type": "gpt2",
    "vocab_size": 14,
    "n_positions": 24,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 2,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "pad_token_id": 0,
}


def test_weights_flow_through_shared_memory_and_log_probs_agree(tmp_path: Any) -> None:
    torch.set_num_threads(1)

    async def go() -> None:
        learner = Learner(
            RoleContext.local(
                config={"model_config": MODEL, "seed": 1, "lr": 0.01},
                run_dir=str(tmp_path),
                name="learner",
                run="sync-test",
            )
        )
        await learner.setup()
        demo = Sample(
            prompt_id="d",
            sample_index=0,
            prompt_ids=[2, 3, 12, 4, 5, 13],
            token_ids=[6, 7, 1],
            logprobs=[],
            versions=[],
            finished=True,
            stop_reason="stop",
        )
        learner.train(TrainBatch(samples=[Scored(sample=demo)], algorithm="bc"))
        assert learner.version == 1

        rollout = Rollout(
            RoleContext.local(
                config={"model_config": MODEL, "seed": 99, "weights_from": "learner"},
                run_dir=str(tmp_path),
                name="rollout",
                run="sync-test",
            )
        )
        await rollout.setup()  # a (re)started replica loads the latest weights before work
        assert await rollout.version(None) == 1

        learner.train(
            TrainBatch(
                samples=[
                    Scored(
                        sample=Sample(
                            prompt_id="e",
                            sample_index=0,
                            prompt_ids=[3, 12, 13],
                            token_ids=[8, 1],
                            logprobs=[],
                            versions=[],
                            finished=True,
                            stop_reason="stop",
                        )
                    )
                ],
                algorithm="bc",
            )
        )
        assert await rollout.sync(None) == 2
        for name, tensor in learner.trainer.model.state_dict().items():
            assert torch.equal(rollout.engine.model.state_dict()[name], tensor), name

        prompts = [[2, 3, 12, 4, 5, 13], [9, 13], [4, 12, 7, 13, 2, 2, 2, 3]]  # left padding
        params = SamplingParams(temperature=1.0, max_new_tokens=6)
        requests = [
            GenerateRequest(
                prompt=Prompt(id=f"p{i}", token_ids=ids), sample_index=0, params=params, seed=i
            )
            for i, ids in enumerate(prompts)
        ]
        samples = await rollout.generate(GenerateBatch(requests))
        assert all(s.versions == [2] * len(s.token_ids) for s in samples)
        recomputed = learner.trainer.logprobs(samples)
        for s, again in zip(samples, recomputed, strict=True):
            torch.testing.assert_close(
                torch.tensor(again), torch.tensor(s.logprobs), atol=1e-4, rtol=0
            )
        await learner.teardown()

    asyncio.run(go())


class FakeGroup:
    """A rollout group's ``broadcast``: answers the versions scripted, one list per call, or
    waits for the test's gate, or raises what the test set for that call."""

    def __init__(self, answers: list[list[int]]) -> None:
        self.answers = answers
        self.calls: list[Any] = []
        self.gates: dict[int, asyncio.Event] = {}
        self.errors: dict[int, BaseException] = {}
        self.cancelled: list[int] = []
        self.cancel_seen = asyncio.Event()

    async def broadcast(
        self, method: str, payload: Any = None, reply_type: Any = Any, *, timeout: float = 0.0
    ) -> list[Any]:
        n = len(self.calls)
        self.calls.append(payload)
        try:
            if n in self.gates:
                await self.gates[n].wait()
        except asyncio.CancelledError:
            self.cancelled.append(n)
            self.cancel_seen.set()
            raise
        if n in self.errors:
            raise self.errors[n]
        return self.answers[min(n, len(self.answers) - 1)]


def test_sync_mode_asks_again_until_every_replica_holds_the_version() -> None:
    async def main() -> None:
        clock = FakeClock()
        group = FakeGroup([[1, 2], [1, 2], [2, 3]])
        sync = WeightSync(group, wait=True, timeout=5.0, clock=clock)
        push = asyncio.ensure_future(sync.push(version=2))
        for asks in (1, 2):
            await clock.wait_for_timers(1)  # asked, and waiting before the next ask
            assert len(group.calls) == asks and not push.done()
            clock.advance(0.1)
        await asyncio.wait_for(push, WAIT_S)
        assert len(group.calls) == 3 and clock.now() == 0.2
        await sync.close()

    run(main())


def test_sync_mode_gives_up_after_its_timeout_naming_the_versions() -> None:
    async def main() -> None:
        clock = FakeClock()
        sync = WeightSync(FakeGroup([[1, 1]]), wait=True, timeout=0.25, clock=clock)
        ensure = asyncio.ensure_future(sync.ensure(2))
        while not ensure.done():
            await clock.wait_for_timers(1)
            clock.advance(0.125)
            await asyncio.sleep(0)
        with pytest.raises(StallError) as err:
            await ensure
        assert str(err.value) == (
            "rollout replicas hold weights versions [1, 1] after 0.25 s, not version 2: the "
            "publisher's store never came back (is the learner restarting over and over?)"
        )
        assert clock.now() == 0.25

    run(main())


def test_a_failed_background_push_cancels_the_others_and_is_raised_once() -> None:
    """Async mode: push 0 hangs, push 1 fails. The failure cancels push 0, the next push raises
    it, and closing afterwards does not raise it again."""

    async def main() -> None:
        group = FakeGroup([[0, 0]])
        group.gates[0] = asyncio.Event()
        group.errors[1] = TypeError("sync() takes no 'payload'")
        async with WeightSync(group, wait=False) as sync:
            await sync.push("v1")
            await sync.push("v2")
            await asyncio.wait_for(group.cancel_seen.wait(), WAIT_S)
            assert group.cancelled == [0]
            with pytest.raises(TypeError) as err:
                await sync.push("v3")
            assert str(err.value) == "sync() takes no 'payload'"
        assert group.calls == ["v1", "v2"]

    run(main())


def test_close_waits_for_the_pushes_in_flight_and_raises_a_failure_not_raised_yet() -> None:
    async def main() -> None:
        group = FakeGroup([[0, 0]])
        group.gates[0] = asyncio.Event()
        group.errors[0] = RuntimeError("replica 1 refused the weights")
        sync = WeightSync(group, wait=False)
        await sync.push()
        closing = asyncio.ensure_future(sync.close())
        await asyncio.sleep(0)
        assert not closing.done()  # the push is waited for, not cancelled
        group.gates[0].set()
        with pytest.raises(RuntimeError, match="replica 1 refused the weights"):
            await asyncio.wait_for(closing, WAIT_S)
        assert group.cancelled == []

    run(main())


def test_a_relay_group_left_without_replicas_is_reached_at_once() -> None:
    """The relays' node was lost for good: their group answers a broadcast with nothing, and
    the push goes on to the rollout replicas left."""

    async def main() -> None:
        relays, rollout = FakeGroup([[]]), FakeGroup([[3]])
        sync = WeightSync(rollout, relays=[relays], wait=True, timeout=5.0, clock=FakeClock())
        assert await asyncio.wait_for(sync.ensure(3), WAIT_S) == [3]
        assert (len(relays.calls), len(rollout.calls)) == (1, 1)
        await sync.close()

    run(main())
