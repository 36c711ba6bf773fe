"""Simulated rollout and learner roles: real processes and messages, generation and training
replaced by sleeps.

``SimRollout`` answers ``generate`` as ``Rollout`` does, one finished one-token sample per request,
after sleeping for the sample's drawn duration (``pipeline_model.sample_duration``, divided by
the replica's speed). ``SimLearner`` answers ``train_step`` as ``Learner`` does (a ledger of
consumed ids, the version up by one per step) after sleeping ``step_s``. Used by ``asyncrl
bench pipeline``, they let the sample pipeline run on the real runtime with a workload whose
ideal schedule ``pipeline_model`` computes exactly.

``ScaleRollout`` adds the slot turnaround ``asyncrl bench scale`` measures, and ``host_main``
is that benchmark's helper process: it serves many replicas, one transport ``Server`` each.

Durations are a function of the sample's stable id alone, so a re-run request, on any replica,
costs the same work. Prompt ids must be ``p<index>`` (the index names the draw).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import time
from typing import Any

import msgspec

from asyncrl.observe import logs
from asyncrl.role import Delivery, Role, RoleContext, endpoint, endpoints_of
from asyncrl.roles.payloads import GenerateBatch, GenerateRequest, Sample, StepResult, TrainBatch
from asyncrl.supervision.process import die_with_parent
from asyncrl.transport import Call, ChannelOptions, Server, run
from asyncrl.transport.sockets import reserve_sockets
from benchmarks.pipeline_model import sample_duration

__all__ = [
    "HostSpec",
    "ScaleRollout",
    "SimLearner",
    "SimRollout",
    "host_main",
    "prompt_index",
    "start_hosts",
    "turnarounds",
    "work_of",
]

TOKEN = 2
"""The one token of every simulated completion."""


def prompt_index(prompt_id: str) -> int:
    """The index in a prompt id ``p<index>``.

    Raises:
        ValueError: the id is not of that form.
    """
    digits = prompt_id[1:]
    if not (prompt_id.startswith("p") and digits.isdigit()):
        raise ValueError(
            f"simulated rollout: prompt id {prompt_id!r} is not 'p<index>'; the index names the "
            "sample's drawn duration, so feed prompts with ids p0, p1, ..."
        )
    return int(digits)


def work_of(prompt_id: str, sample_index: int, sigma: float, mean_s: float, seed: int) -> float:
    """Seconds of generation at speed 1 of one sample, by its stable id."""
    return sample_duration(prompt_index(prompt_id), sample_index, sigma, mean_s=mean_s, seed=seed)


class SimRollout(Role):
    """A rollout replica whose samples take drawn times; it records when its slots are busy.

    Endpoints:

    - ``generate(GenerateBatch) -> list[Sample]``, idempotent: the requests of one call run
      together in the call's slot, as an engine decodes a batch (the pipeline sends one a
      call, or a group's with ``group_calls``). Each sleeps ``work / speed``
      and comes back finished, with one token, log-prob 0.0 and the version it started at.
    - ``set_version(int) -> int``, latest-wins: the weights version new samples start at.
    - ``usage([t0, t1, per_call]) -> dict``, idempotent: over a wall-clock window
      (``time.time()``), the busy sample-seconds, the work and number of the samples started in
      it, and the idle fraction of the slots when each call carries ``per_call`` samples (1 when
      left out).

    The replica has ``capacity`` slots (the manifest's), and speed ``speeds[replica]``.
    """

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        """The simulated rollout's config.

        Attributes:
            speeds: the relative speed of each replica, by replica index.
            sigma: log-space standard deviation of sample durations (0: all ``mean_s``).
            mean_s: the mean sample duration at speed 1, in seconds.
            seed: seeds the draws (with each sample's stable id).
        """

        speeds: list[float] = msgspec.field(default_factory=lambda: [1.0])
        sigma: float = 0.0
        mean_s: float = 0.05
        seed: int = 0

        def __post_init__(self) -> None:
            if not self.speeds or any(not s > 0 for s in self.speeds):
                raise ValueError(f"speeds: expected one or more values > 0, got {self.speeds}")
            if not self.sigma >= 0:
                raise ValueError(f"sigma: expected >= 0, got {self.sigma}")
            if not self.mean_s > 0:
                raise ValueError(f"mean_s: expected > 0, got {self.mean_s}")

    def __init__(self, ctx: RoleContext) -> None:
        super().__init__(ctx)
        if ctx.replica >= len(self.config.speeds):
            raise msgspec.ValidationError(
                f"speeds: replica {ctx.replica} has no speed in {self.config.speeds}; give one "
                "speed per replica"
            )
        self.speed: float = self.config.speeds[ctx.replica]
        self.version = 0
        self.done: list[tuple[float, float, float]] = []  # (start, end, work) of each sample
        self.running: dict[int, tuple[float, float]] = {}  # (start, work) of those in progress
        self._ids = itertools.count()

    @endpoint(Delivery.IDEMPOTENT)
    async def generate(self, batch: GenerateBatch) -> list[Sample]:
        return list(await asyncio.gather(*(self._one(r) for r in batch.requests)))

    async def _one(self, request: GenerateRequest) -> Sample:
        prompt = request.prompt
        if request.partial is not None:
            raise ValueError(
                f"simulated rollout: got a partial sample of {prompt.id}/{request.sample_index}, "
                "but this role never hands one out"
            )
        cfg = self.config
        work = work_of(prompt.id, request.sample_index, cfg.sigma, cfg.mean_s, cfg.seed)
        version = self.version
        start = time.time()
        sid = next(self._ids)
        self.running[sid] = (start, work)
        try:
            await asyncio.sleep(work / self.speed)
        finally:
            del self.running[sid]
            self.done.append((start, time.time(), work))
        return Sample(
            prompt_id=prompt.id,
            sample_index=request.sample_index,
            prompt_ids=prompt.token_ids,
            token_ids=[TOKEN],
            logprobs=[0.0],
            versions=[version],
            finished=True,
            stop_reason="length",
        )

    @endpoint(Delivery.LATEST)
    async def set_version(self, version: int) -> int:
        self.version = version
        return self.version

    @endpoint(Delivery.IDEMPOTENT)
    async def usage(self, window: list[float]) -> dict[str, float]:
        t0, t1, per_call = _window("usage", window)
        now = time.time()
        busy = work = 0.0
        started = 0
        for start, end, w in [*self.done, *((s, now, w) for s, w in self.running.values())]:
            busy += max(0.0, min(end, t1) - max(start, t0))
            if t0 <= start < t1:
                work += w
                started += 1
        slots = self.ctx.capacity
        return {
            "replica": float(self.ctx.replica),
            "speed": self.speed,
            "slots": float(slots),
            "busy_s": busy,
            "work_s": work,
            "started": float(started),
            "idle": max(0.0, 1.0 - busy / (slots * per_call * (t1 - t0))),
        }


def _window(endpoint: str, window: list[float]) -> tuple[float, float, int]:
    """``[t0, t1]`` or ``[t0, t1, per_call]`` as ``(t0, t1, per_call)``: a wall-clock window and
    the samples of one call (1 when left out; a call's samples share its slot).

    Raises:
        ValueError: not such a list, or ``t1 <= t0``; the message names ``endpoint``.
    """
    if len(window) not in (2, 3) or not window[1] > window[0]:
        raise ValueError(
            f"{endpoint}: expected a window [t0, t1] with t1 > t0, and optionally the samples a "
            f"call, got {window}"
        )
    return window[0], window[1], int(window[2]) if len(window) == 3 else 1


class SimLearner(Role):
    """A learner whose step is a sleep: it keeps the ledger and the version as ``Learner`` does.

    Endpoints: ``train_step(TrainBatch) -> StepResult`` (once): samples already consumed are
    skipped; a batch with fresh samples sleeps ``step_s`` and takes the version up by one.
    ``status(None) -> dict`` (idempotent): version, step, consumed count and an empty ``keep``,
    as ``Learner.status`` has them.
    """

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        """The simulated learner's config.

        Attributes:
            step_s: seconds one step takes.
        """

        step_s: float = 0.0

        def __post_init__(self) -> None:
            if not self.step_s >= 0:
                raise ValueError(f"step_s: expected >= 0, got {self.step_s}")

    def __init__(self, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.version = 0
        self.step = 0
        self.consumed: set[tuple[str, int]] = set()

    @endpoint(Delivery.ONCE)
    async def train_step(self, batch: TrainBatch) -> StepResult:
        fresh = [s.sample.key for s in batch.samples if s.sample.key not in self.consumed]
        skipped = len(batch.samples) - len(fresh)
        if fresh:
            await asyncio.sleep(self.config.step_s)
            self.consumed.update(fresh)
            self.step += 1
            self.version += 1
        return StepResult(
            version=self.version, step=self.step, consumed=len(fresh), skipped=skipped, metrics={}
        )

    @endpoint(Delivery.IDEMPOTENT, name="status")
    async def sim_status(self, _: Any) -> dict[str, Any]:
        return {
            "version": self.version,
            "step": self.step,
            "consumed": len(self.consumed),
            "keep": {},
        }


# -- the replicas of ``asyncrl bench scale`` (run in its helper processes) ----------------------


def turnarounds(
    starts: list[float], ends: list[float], slots: int, window: tuple[float, float]
) -> list[float]:
    """The turnaround of each sample that started in ``window``: its start minus the end of
    the sample whose slot it took.

    With a fixed generation time and work always queued, a replica of ``slots`` slots gives
    its k-th sample (in start order) the slot the (k - slots)-th freed (in end order). The first
    ``slots`` samples took a slot nobody held before, and have none.

    Args:
        starts, ends: the replica's sample start and end times, in any order (``ends`` may be
            shorter: samples still running).
        slots: the replica's slots; window: ``(t0, t1)``, on the same clock.
    """
    starts, ends = sorted(starts), sorted(ends)
    t0, t1 = window
    return [
        start - ends[k - slots]
        for k, start in enumerate(starts)
        if k >= slots and t0 <= start < t1 and k - slots < len(ends)
    ]


class ScaleRollout(SimRollout):
    """``SimRollout`` that also tells its slots' turnaround (see ``turnarounds``).

    Endpoints: those of ``SimRollout``, and ``turnaround([t0, t1, per_call]) -> list[float]``
    (idempotent): the turnaround, in seconds, of each sample that started in the window, when
    each call carries ``per_call`` samples (1 when left out; a call's samples share its slot).
    """

    @endpoint(Delivery.IDEMPOTENT)
    async def turnaround(self, window: list[float]) -> list[float]:
        t0, t1, per_call = _window("turnaround", window)
        starts = [s for s, _, _ in self.done] + [s for s, _ in self.running.values()]
        ends = [e for _, e, _ in self.done]
        return turnarounds(starts, ends, self.ctx.capacity * per_call, (t0, t1))


class HostSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one helper process serves: the replicas ``first`` on, one per endpoint."""

    endpoints: list[str]
    first: int
    replicas: int
    slots: int
    gen_s: float
    run_dir: str
    parent_pid: int
    run: str


def _handler(method: Any) -> Any:
    async def handle(payload: Any, call: Call) -> Any:
        return await method(payload)

    return handle


def _constant(value: dict[str, Any]) -> Any:
    def answer(payload: Any, call: Call) -> dict[str, Any]:
        return value

    return answer


async def _serve_host(spec: HostSpec) -> None:
    """Serve ``spec``'s replicas until stdin closes (the driver ended or closed it)."""
    config = ScaleRollout.Config(speeds=[1.0] * spec.replicas, sigma=0.0, mean_s=spec.gen_s)
    methods = endpoints_of(ScaleRollout)
    servers = []
    for offset, address in enumerate(spec.endpoints):
        replica = spec.first + offset
        ctx = RoleContext(
            name="rollout",
            replica=replica,
            run=spec.run,
            run_dir=spec.run_dir,
            config=config,
            capacity=spec.slots,
            replicas=spec.replicas,
        )
        role = ScaleRollout(ctx)
        server = Server(address, name=f"rollout.{replica}", options=ChannelOptions(run=spec.run))
        for ep in methods.values():
            server.add(ep.name, _handler(getattr(role, ep.attr)), ep.request_type)
        described = {
            "role": "rollout",
            "replica": replica,
            "incarnation": 0,
            "pid": os.getpid(),
            "endpoints": {n: e.delivery.value for n, e in methods.items()},
        }
        server.add("_describe", _constant(described))
        await server.start()
        server.set_credit(spec.slots)
        servers.append(server)
    try:
        await asyncio.to_thread(sys.stdin.read)
    finally:
        for server in servers:
            await server.close()


def host_main() -> int:
    """A helper process of ``asyncrl bench scale``: read its ``HostSpec`` (one JSON line on
    stdin), serve those replicas until stdin closes."""
    spec = msgspec.json.decode(sys.stdin.readline(), type=HostSpec)
    die_with_parent(spec.parent_pid)
    reserve_sockets(0, spare=len(spec.endpoints) + 64)
    logs.configure(role="bench-scale-host", console=False)
    run(_serve_host(spec))
    return 0


def start_hosts(
    endpoints: list[str], slots: int, gen_s: float, run_dir: str, hosts: int, *, run: str
) -> list[subprocess.Popen[str]]:
    """Spread the replicas over ``hosts`` helper processes (contiguous runs of replicas), each
    ``python -m benchmarks.scale --host`` reading its ``HostSpec``; ``run``: the run's name."""
    n = len(endpoints)
    count = max(1, min(hosts, n))
    procs = []
    for h in range(count):
        lo, hi = h * n // count, (h + 1) * n // count
        spec = HostSpec(
            endpoints=endpoints[lo:hi],
            first=lo,
            replicas=n,
            slots=slots,
            gen_s=gen_s,
            run_dir=run_dir,
            parent_pid=os.getpid(),
            run=run,
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.scale", "--host"],
            stdin=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.stdin is not None
        proc.stdin.write(msgspec.json.encode(spec).decode() + "\n")
        proc.stdin.flush()
        procs.append(proc)
    return procs
