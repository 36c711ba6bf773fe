"""One ``generate`` call per group: the samples of one prompt that the pipeline asks for in the
same loop turn travel as one ``GenerateBatch``.

The pipeline's unit of work stays one sample (its stable id, its accounting, its resume as a
partial); only the call is shared. ``GroupCalls`` is a ``SampleSource``: the first request of a
prompt in a loop turn leads, waits that turn for the others (the pipeline starts a group's
samples together), sends them as one call with a key naming every sample, and hands each its
sample. A replica decodes them together, and the driver dispatches, encodes and settles one
call instead of ``group_size``. The price: a group's samples run on one replica (no stealing
within the group), and the dispatcher's retry of a lost call re-runs all of them under their
own stable ids (they replace what was lost, as for one sample).

A sample that comes back unfinished (out of its chunk budget, or interrupted by new weights) is
resumed alone, through ``Generate``. A follower whose leader was cancelled (its group released
while the call ran) makes its own call.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from asyncrl.roles.payloads import GenerateBatch, GenerateRequest, Prompt, Sample, SamplingParams
from asyncrl.roles.sampling.contract import Caller, Generate

__all__ = ["GroupCalls"]


class GroupCalls:
    """The ``SampleSource`` of ``pipeline.group_calls``: one call per prompt per loop turn.

    Args:
        rollout: the rollout group's handle; params: how to sample; timeout: per call.
    """

    def __init__(self, rollout: Caller, params: SamplingParams, *, timeout: float) -> None:
        self.rollout, self.params, self.timeout = rollout, params, timeout
        self.single = Generate(rollout, params, timeout=timeout)
        self._open: dict[str, dict[int, asyncio.Future[Sample]]] = {}

    async def __call__(self, prompt: Prompt, index: int, metrics: Counter[str]) -> Sample:
        waiting = self._open.get(prompt.id)
        if waiting is not None:  # a follower: the leader of this turn calls for it
            future: asyncio.Future[Sample] = asyncio.get_running_loop().create_future()
            waiting[index] = future
            try:
                sample = await future
            except _LeaderGone:
                return await self.single(prompt, index, metrics)
        else:
            sample = await self._lead(prompt, index)
        if sample.finished:
            return sample
        metrics["resumed"] += 1
        return await self.single(prompt, index, metrics, partial=sample)

    async def _lead(self, prompt: Prompt, index: int) -> Sample:
        followers: dict[int, asyncio.Future[Sample]] = {}
        self._open[prompt.id] = followers
        try:
            await asyncio.sleep(0)  # this loop turn's other samples of the prompt join
            self._close(prompt.id, followers)
            ks = [index, *followers]
            requests = [
                GenerateRequest(prompt=prompt, sample_index=k, params=self.params) for k in ks
            ]
            samples: list[Sample] = await self.rollout.call(
                "generate",
                GenerateBatch(requests),
                list[Sample],
                timeout=self.timeout,
                key=(prompt.id, *ks),
            )
            for k, sample in zip(ks[1:], samples[1:], strict=True):
                if not followers[k].done():
                    followers[k].set_result(sample)
            return samples[0]
        except BaseException as exc:
            self._close(prompt.id, followers)
            gone = isinstance(exc, asyncio.CancelledError)
            for future in followers.values():
                if not future.done():
                    future.set_exception(_LeaderGone() if gone else exc)
            raise

    def _close(self, prompt_id: str, followers: dict[int, asyncio.Future[Sample]]) -> None:
        """Later requests of the prompt start a call of their own."""
        if self._open.get(prompt_id) is followers:
            del self._open[prompt_id]


class _LeaderGone(Exception):
    """The call a follower waited on was cancelled with its leader's sample."""
