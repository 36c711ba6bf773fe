"""The rollout role and its payload types: prompts in, sampled completions out.

A rollout replica owns one engine, chosen by ``engine`` in its config: ``hf``, the default, runs
our own transformers decode loop (``asyncrl.roles.generation.engine``); ``vllm`` runs vLLM
(``asyncrl.roles.generation.vllm_engine``, with the ``vllm`` extra installed;
docs/rollout_engines.md). It answers these endpoints:

- ``generate(GenerateBatch) -> list[Sample]``, idempotent: each request names one sample by its
  stable id ``(prompt id, sample index)``; running it again (on this or another replica with the
  same ``seed``) gives the same sample, so a lost request is simply re-run. Calls that wait while
  the engine runs are decoded together as its next batch (up to ``max_batch`` sequences), so
  one-sample calls to a replica with many slots (its ``capacity``) still batch well.
- ``set_weights(WeightsUpdate) -> int``, latest-wins: the new weights take effect between two
  decode steps of a generation in progress, with no restart; it returns the version active now.
- ``sync(None) -> int``, latest-wins: load the newest weights the publisher named by
  ``weights_from`` left in shared memory; applied as ``set_weights`` applies them.
- ``version(None) -> int``, idempotent: the weights version active now.
- ``stats(None) -> RolloutStats``, idempotent: what this replica's engine computed since it
  started (``forward_passes``, ``prefill_tokens``, ``tokens_generated``, ``weight_switches``), so
  a caller can check from outside that a resumed sample regenerated nothing.

Every token of a ``Sample`` carries its behaviour log-prob and the weights version that produced
it, so the learner can correct off-policy tokens and measure staleness. An unfinished sample
(``finished=False``: interrupted, or out of its chunk budget) is a partial rollout; sending it back
as ``GenerateRequest.partial`` resumes it, on any replica, without regenerating a token.

By default new weights that arrive during a generation are switched to between two decode steps
and the generation goes on, its KV cache computed partly under the old weights. With
``interrupt_on_weights`` the generation stops instead, as soon as weights other than those it
started with are pending: its unfinished samples come back ``interrupted``, every token of them
of the old version, and the caller resumes them (here or on another replica) under the new
weights, whose prefill recomputes the whole cache.

A replica owns one batching task, from ``setup`` to ``teardown``, and the reader of the
publisher's weights; ``teardown`` cancels the one (with the generate calls it runs or holds) and
closes the other once no sync is copying from it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import traceback
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from asyncrl.errors import NothingPublishedError, WeightsGoneError
from asyncrl.observe.trace import traced
from asyncrl.plugins.contract import Plugin
from asyncrl.plugins.registry import DTYPES, device_for, dtype_for
from asyncrl.plugins.registry import current as current_plugin
from asyncrl.role import Delivery, Role, RoleContext, endpoint
from asyncrl.roles.device_report import DeviceShare, placement_sharing
from asyncrl.roles.payloads import (
    GenerateBatch,
    GenerateRequest,
    Prompt,
    RolloutStats,
    Sample,
    SamplingParams,
    StopReason,
)
from asyncrl.weights import WeightReader, handle_path, read_handle

if TYPE_CHECKING:
    from asyncrl.roles.generation.engine import Engine

_REOPEN_POLL_S = 0.1
ENGINES = ("hf", "vllm")

__all__ = [
    "GenerateBatch",
    "GenerateRequest",
    "Prompt",
    "Rollout",
    "Sample",
    "SamplingParams",
    "StopReason",
    "WeightsUpdate",
]


class WeightsUpdate(msgspec.Struct):
    """New weights: a (possibly partial) state dict of the rollout model, and its version.

    Tensors travel zero-copy or through shared memory; each must match the shape of the model's
    tensor of the same name.
    """

    version: int
    state: dict[str, torch.Tensor]


class Rollout(Role):
    """Samples completions with an engine; switches weights between decode steps, or with
    ``interrupt_on_weights`` hands back partial samples to resume under the new weights."""

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        """The rollout role's config (the manifest's ``config`` mapping).

        Attributes:
            engine: which engine decodes: ``hf`` (transformers with our own loop, the
                reference) or ``vllm`` (vLLM, with the ``vllm`` extra installed).
            model_path: a directory or hub name loaded with ``from_pretrained``.
            model_config: or a transformers config as a dict (``model_type`` plus fields),
                built with random weights seeded by ``seed`` (tests, benchmarks).
            seed: seeds random weights and the sampling seeds of requests that bring none.
            max_batch: the most sequences one forward pass decodes; larger batches run in turns.
            chunk_tokens: the most new tokens a sample gets per call before it comes back
                unfinished (0: no budget).
            batch_invariant: decode every batch with the same shapes (``max_batch`` rows,
                prompts padded to the model's positions minus ``max_new_tokens``), so a
                sample's tokens and log-probs do not depend on the requests it was batched
                with: what makes a sync-mode run repeatable, at the cost of always decoding
                full batches. ``hf`` only.
            interrupt_on_weights: stop a generation in progress as soon as new weights (from
                ``set_weights`` or ``sync``) are pending, rather than switching to them between
                two steps; its unfinished samples come back with stop reason ``interrupted``,
                to be resumed under the new weights.
            dtype: the model's dtype (``float32``, ``bfloat16``, ``float16``, ``float64``);
                empty: the hardware plugin's on the plugin's device, float32 on the host.
            weights_from: the role that publishes weights in shared memory on this host
                (the learner); ``sync`` reads from it, and a replica that starts or restarts
                loads its latest weights before taking any work. Empty: weights only come
                through ``set_weights``.
            weights_wait_s: how long a starting replica waits for the publisher's store when
                it is gone (the publisher is restarting) before it fails.
            kv_cache_gib: ``vllm``: memory reserved for the KV cache, in GiB (host memory on
                CPU); 0 sizes it by ``memory_fraction`` instead.
            memory_fraction: ``vllm`` with ``kv_cache_gib`` 0: the fraction of the device's
                memory vLLM takes (its ``gpu_memory_utilization``; on CPU, of host memory).
            enforce_eager: ``vllm``: run the model eagerly; false lets vLLM compile it, which
                takes minutes on a few CPU cores.
            release_when_idle: give the device's cached memory back (the plugin's
                ``device.release_cache``) each time a generation leaves no sequence running
                and no call waiting, so a role sharing the device (the learner, in sync mode)
                can use it; the placement's ``release_when_idle`` turns it on too.
        """

        engine: str = "hf"

        model_path: str = ""
        model_config: dict[str, Any] = {}
        seed: int = 0
        max_batch: int = 64
        chunk_tokens: int = 0
        batch_invariant: bool = False
        interrupt_on_weights: bool = False
        dtype: str = ""
        weights_from: str = ""
        weights_wait_s: float = 300.0
        kv_cache_gib: float = 1.0
        memory_fraction: float = 0.5
        enforce_eager: bool = True
        release_when_idle: bool = False

        def __post_init__(self) -> None:
            if bool(self.model_path) == bool(self.model_config):
                raise ValueError(
                    "set exactly one of model_path (a checkpoint to load) or model_config "
                    "(a transformers config dict with a model_type, for random weights)"
                )
            if self.max_batch < 1:
                raise ValueError(f"max_batch: expected an int >= 1, got {self.max_batch}")
            if self.chunk_tokens < 0:
                raise ValueError(f"chunk_tokens: expected an int >= 0, got {self.chunk_tokens}")
            if self.dtype and self.dtype not in DTYPES:
                raise ValueError(f"dtype: expected a torch dtype name, got {self.dtype!r}")
            if self.engine not in ENGINES:
                raise ValueError(
                    f"engine: expected one of {', '.join(ENGINES)}, got {self.engine!r}"
                )
            if self.engine == "vllm" and self.batch_invariant:
                raise ValueError(
                    "batch_invariant: only the hf engine offers it; set engine: hf or turn "
                    "batch_invariant off"
                )
            if self.kv_cache_gib < 0:
                raise ValueError(f"kv_cache_gib: expected a float >= 0, got {self.kv_cache_gib}")
            if not 0.0 < self.memory_fraction <= 1.0:
                raise ValueError(
                    f"memory_fraction: expected a float in (0, 1], got {self.memory_fraction}"
                )

    engine: Engine

    def __init__(self, ctx: RoleContext) -> None:
        super().__init__(ctx)
        # Generations running now: while one runs, new weights wait for it to apply them
        # between steps, rather than queueing an apply behind it in the worker thread.
        self._generating = 0
        self._waiting: deque[tuple[list[GenerateRequest], asyncio.Future[list[Sample]]]] = deque()
        self._pending = asyncio.Event()  # set when a call joins _waiting
        self._batcher: asyncio.Task[None] | None = None  # runs _run_batches from setup on
        self._torn_down = False
        self._reader: WeightReader | None = None
        self._loaded_from = ""  # the store whose weights the engine holds
        # One sync at a time: concurrent sync calls (latest-wins pushes overlap) would otherwise
        # close a reader that another one is still copying from.
        self._syncing = asyncio.Lock()
        self._share: DeviceShare | None = None  # this replica's part of its device, from setup

    @classmethod
    def preload(cls, config: Mapping[str, Any]) -> None:
        import transformers  # noqa: F401

        from asyncrl.roles.generation.engine import HFEngine  # noqa: F401

        if config.get("engine") == "vllm":
            from asyncrl.roles.generation.vllm_engine import import_vllm

            import_vllm()

    async def setup(self) -> None:
        """Take this replica's share of its device (the placement's), build the engine (load
        or create the model) in the worker thread, load the publisher's latest weights (with
        ``weights_from``), and start batching.

        Raises:
            ConfigProblem: ``engine: vllm`` without vLLM installed.
            PluginError: ``placement.device`` is not a device of the hardware plugin.
        """
        # Before the model lands on a device it may share: the placement's memory share.
        fraction, release = placement_sharing(self.ctx)
        self._share = DeviceShare(
            device_for(self.ctx.device), fraction, release or self.config.release_when_idle
        )
        self.engine = await self.ctx.offload(build_engine, self.config, self.ctx.device)
        if self.config.weights_from:
            # Before any credit is advertised: a restarted replica starts from the current
            # weights, not from the initial ones, waiting for a publisher that restarts too.
            await self._sync(wait_s=self.config.weights_wait_s)
            await self._apply_if_idle()
        self._batcher = asyncio.get_running_loop().create_task(
            self._run_batches(), name=f"{self.ctx.name}[{self.ctx.replica}] batching"
        )
        self._batcher.add_done_callback(self._batching_stopped)

    async def teardown(self) -> None:
        """Stop batching, cancelling the generate calls it runs or holds, and close the weight
        reader once no sync is copying from it."""
        self._torn_down = True
        batcher = self._batcher
        if batcher is not None:
            batcher.cancel()
            await asyncio.wait({batcher})
        for _, future in self._waiting:
            future.cancel()
        self._waiting.clear()
        async with self._syncing:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
        close = getattr(getattr(self, "engine", None), "close", None)
        if close is not None:
            close()

    async def _sync(self, *, wait_s: float = 0.0) -> None:
        """Load the newest weights the publisher left in shared memory, if newer than ours.

        A store the publisher replaced (it restarted) is reopened, and its weights are loaded
        whatever their version: they are the publisher's state now, even if its version is not
        above ours. With ``wait_s`` > 0 (a replica starting while the publisher restarts), wait
        that long for a live store before giving up.

        Raises:
            WeightsGoneError: ``wait_s`` passed and the publisher's store is still gone.
        """
        async with self._syncing:
            await self._sync_locked(wait_s)

    async def _sync_locked(self, wait_s: float) -> None:
        path = handle_path(self.ctx.run_dir, self.config.weights_from)
        deadline = asyncio.get_running_loop().time() + wait_s
        while True:
            handle = read_handle(path)
            if (
                self._reader is not None
                and handle is not None
                and (handle.segment != self._reader.name)
            ):
                # The publisher restarted with a new store. The old mapping still reads (a
                # killed writer never marks its store closed), but it will never change again.
                self._reader.close()
                self._reader = None
            if self._reader is None:
                if handle is None:
                    return  # nothing published yet: the initial weights are the publisher's
                try:
                    self._reader = WeightReader(handle)
                except WeightsGoneError:
                    if asyncio.get_running_loop().time() >= deadline:
                        if wait_s:
                            raise
                        return  # the publisher is restarting: keep ours until the next sync
                    await asyncio.sleep(_REOPEN_POLL_S)
                    continue
            since = self.engine.version if self._reader.name == self._loaded_from else -1
            try:
                got = await self.ctx.offload(
                    traced("weight read", self._reader.read_if_newer), since
                )
            except (WeightsGoneError, NothingPublishedError):
                self._reader.close()
                self._reader = None
                continue
            if got is not None:
                version, state = got
                self.engine.set_weights(state, version)
            self._loaded_from = self._reader.name
            return

    @endpoint(Delivery.LATEST)
    async def sync(self, _: None) -> int:
        """Load the newest weights from the publisher's shared-memory store; return the version
        active now (see ``set_weights`` for when an update takes effect)."""
        if not self.config.weights_from:
            raise ValueError("sync needs weights_from in the rollout config")
        await self._sync()
        await self._apply_if_idle()
        return self.engine.version

    @endpoint(Delivery.IDEMPOTENT)
    async def generate(self, batch: GenerateBatch) -> list[Sample]:
        """Sample (or resume) one completion per request, in order.

        With ``interrupt_on_weights``, unfinished samples come back ``interrupted`` once new
        weights arrive during the call.

        Raises:
            ValueError: a request the engine cannot run (empty prompt, a partial of another
                sample, a sequence longer than the model's positions).
        """
        batcher = self._batcher
        if self._torn_down or batcher is None or batcher.done():
            raise RuntimeError(self._refusal())
        future: asyncio.Future[list[Sample]] = asyncio.get_running_loop().create_future()
        self._waiting.append((batch.requests, future))
        self._pending.set()
        return await future

    def status(self) -> dict[str, Any]:
        """This replica's device and its memory (``device_report``), with its share of the
        device and its cache releases (``release_when_idle``); ``{}`` before ``setup``."""
        return {} if self._share is None else self._share.status()

    def _refusal(self) -> str:
        where = f"rollout {self.ctx.name}[{self.ctx.replica}]"
        if self._torn_down:
            return f"{where} was torn down; it takes no more generate calls"
        if self._batcher is None:
            return f"{where} is not set up; call setup() before generate"
        return f"{where} stopped batching; see the error its generate calls failed with"

    async def _run_batches(self) -> None:
        """Run the generate calls waiting now as one engine batch, up to ``max_batch``
        sequences; calls that arrive meanwhile form the next batch. So a replica with many
        slots decodes its one-sample calls together (continuous batching, call by call).

        An error of the engine fails the calls of its batch, and the next batch runs; a
        cancellation (``teardown``) cancels the calls of the batch running. With
        ``release_when_idle``, the device's cache is released once no call is left (a release
        that fails is logged, and batching goes on).
        """
        while True:
            await self._pending.wait()
            self._pending.clear()
            ran = bool(self._waiting)
            while self._waiting:
                calls = self._next_batch()
                try:
                    await self._run_batch(calls)
                except asyncio.CancelledError:
                    for _, future in calls:
                        future.cancel()
                    raise
                except Exception as exc:
                    for _, future in calls:
                        if not future.done():
                            future.set_exception(exc)
            share = self._share
            if ran and share is not None and share.release_when_idle:
                try:
                    await self.ctx.offload(share.release)
                except Exception as exc:  # an economy: batching goes on without it
                    self.ctx.log.error(f"rollout cache release failed: {exc!r}; generating on")

    def _next_batch(self) -> list[tuple[list[GenerateRequest], asyncio.Future[list[Sample]]]]:
        calls: list[tuple[list[GenerateRequest], asyncio.Future[list[Sample]]]] = []
        size = 0
        while self._waiting and (
            not calls or size + len(self._waiting[0][0]) <= self.config.max_batch
        ):
            requests, future = self._waiting.popleft()
            if not future.done():  # its caller may have gone
                calls.append((requests, future))
                size += len(requests)
        return calls

    async def _run_batch(
        self, calls: list[tuple[list[GenerateRequest], asyncio.Future[list[Sample]]]]
    ) -> None:
        if not calls:
            return
        try:
            samples = await self._generate([r for requests, _ in calls for r in requests])
        except ValueError:
            # One call's bad request must not fail the others: run each on its own.
            for requests, future in calls:
                try:
                    result = await self._generate(requests)
                except ValueError as exc:
                    if not future.done():
                        future.set_exception(exc)
                else:
                    if not future.done():
                        future.set_result(result)
            return
        start = 0
        for requests, future in calls:
            if not future.done():
                future.set_result(samples[start : start + len(requests)])
            start += len(requests)

    def _batching_stopped(self, batcher: asyncio.Task[None]) -> None:
        """The batching task ended: by ``teardown``, or by a bug, whose error then goes to
        every call still waiting (a later one is refused)."""
        error = None if batcher.cancelled() else batcher.exception()
        if error is None:
            return
        # One string: the context's log is structlog's in a process, the stdlib's in a test.
        trace = "".join(traceback.format_exception(error))
        self.ctx.log.error(f"rollout batching failed: {error!r}\n{trace}")
        for _, future in self._waiting:
            if not future.done():
                future.set_exception(error)
        self._waiting.clear()

    async def _generate(self, requests: list[GenerateRequest]) -> list[Sample]:
        should_interrupt = self._weights_changed() if self.config.interrupt_on_weights else None
        self._generating += 1
        try:
            samples = await self.ctx.offload(
                traced("generation", self.engine.generate),
                requests,
                should_interrupt=should_interrupt,
            )
        finally:
            self._generating -= 1
        await self._apply_if_idle()
        return samples

    @endpoint(Delivery.LATEST)
    async def set_weights(self, update: WeightsUpdate) -> int:
        """Take new weights; return the version active now.

        During a generation the update is applied by the engine before its next decode step
        (with ``interrupt_on_weights``: once the interrupted generation has returned), so the
        version returned may still be the previous one; when idle it is applied at once.

        Raises:
            ValueError: a tensor name the model does not have, or a shape that differs.
        """
        self.engine.set_weights(update.state, update.version)
        await self._apply_if_idle()
        return self.engine.version

    @endpoint(Delivery.IDEMPOTENT)
    async def version(self, _: None) -> int:
        """The weights version active now."""
        return self.engine.version

    @endpoint(Delivery.IDEMPOTENT)
    async def stats(self, _: None) -> RolloutStats:
        """What this replica's engine computed since it started (its ``EngineStats``). A
        restarted replica counts from 0; read during a generation, the counters may be a step
        apart."""
        return RolloutStats(**dataclasses.asdict(self.engine.stats))

    def _weights_changed(self) -> Callable[[], bool]:
        """A ``should_interrupt`` for one generate call: True once the weights pending or
        active are not those the call starts with (pending ones are loaded by its prefill)."""
        engine = self.engine

        def newest() -> int:
            pending = engine.pending_version
            return engine.version if pending is None else pending

        started = newest()
        return lambda: newest() != started

    async def _apply_if_idle(self) -> None:
        if self._generating == 0 and self.engine.has_pending_weights:
            await self.ctx.offload(self.engine.apply_pending)


def build_engine(cfg: Rollout.Config, placement: str, plugin: Plugin | None = None) -> Engine:
    """The engine ``cfg`` names, over its checkpoint or a model built from its config, on the
    device of ``placement`` (the manifest's ``placement.device``) in ``cfg.dtype``, both as the
    hardware plugin (default: this process's) resolves them; the ``hf`` engine computes with the
    plugin's operators.

    Raises:
        ConfigProblem: ``engine: vllm`` without vLLM installed.
        PluginError: ``placement`` is not a device of the plugin.
    """
    plugin = current_plugin() if plugin is None else plugin
    device = device_for(placement, plugin)
    kwargs: dict[str, Any] = {
        "dtype": dtype_for(cfg.dtype, device, plugin),
        "seed": cfg.seed,
        "max_batch": cfg.max_batch,
        "chunk_tokens": cfg.chunk_tokens,
    }
    factory: Any
    if cfg.engine == "vllm":
        from asyncrl.roles.generation.vllm_engine import VLLMEngine

        # vLLM places the model itself, on the device selected above (the visible
        # accelerator, or the host with its CPU build), and runs its own kernels.
        kwargs |= {
            "kv_cache_gib": cfg.kv_cache_gib,
            "memory_fraction": cfg.memory_fraction,
            "enforce_eager": cfg.enforce_eager,
        }
        factory = VLLMEngine
    else:
        from asyncrl.roles.generation.engine import HFEngine

        kwargs |= {"device": device, "batch_invariant": cfg.batch_invariant, "ops": plugin.ops}
        factory = HFEngine
    if cfg.model_path:
        engine: Engine = factory.from_pretrained(cfg.model_path, **kwargs)
    else:
        engine = factory.from_config(cfg.model_config, **kwargs)
    return engine
