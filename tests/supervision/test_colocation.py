"""A role's part of a shared device, in-process: its memory share, the placement read from
the process's spec, the release when idle, and the learner's and reference's status."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import msgspec
import pytest
import torch

from asyncrl.manifest.spec import SPEC_FILE_ENV, ProcessSpec, write_spec
from asyncrl.plugins.cpu import CpuDevice, CpuPlugin
from asyncrl.role import RoleContext
from asyncrl.roles.device_report import DeviceShare, device_status, placement_sharing
from asyncrl.roles.generation.rollout import Sample
from asyncrl.roles.services.reference import Reference
from asyncrl.roles.training.critic import Critic
from asyncrl.roles.training.learner import Learner, Scored, TrainBatch
from tests.helpers.waiting import wait_until

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


class CountingDevice(CpuDevice):
    """The host, counting cache releases and memory limits."""

    def __init__(self) -> None:
        super().__init__()
        self.released = 0

    def release_cache(self) -> None:
        self.released += 1
        super().release_cache()


def _plugin() -> tuple[CpuPlugin, CountingDevice]:
    plugin = CpuPlugin()
    plugin.device = CountingDevice()
    return plugin, plugin.device


@pytest.fixture
def no_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SPEC_FILE_ENV, raising=False)


def _spec_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, name: str, **fields: Any) -> None:
    spec = ProcessSpec(kind="role", name=name, endpoint="ipc://x", run="r", run_dir=str(tmp_path))
    monkeypatch.setenv(SPEC_FILE_ENV, write_spec(msgspec.structs.replace(spec, **fields)))


def test_a_share_sets_the_devices_budget_and_reports_it() -> None:
    plugin, dev = _plugin()
    share = DeviceShare("cpu", 0.25, plugin=plugin)
    status = share.status()
    assert dev.fraction == 0.25
    assert status["memory"]["limit"] == int(0.25 * status["memory"]["total"])
    assert (status["device"], status["memory_fraction"], status["release_when_idle"]) == (
        "cpu",
        0.25,
        False,
    )
    assert (status["releases"], status["last_release"]) == (0, {})
    assert DeviceShare("cpu", plugin=plugin).status()["memory_fraction"] == 0.0
    with pytest.raises(ValueError, match=r"memory fraction must be in \(0, 1\], got 1.5"):
        DeviceShare("cpu", 1.5, plugin=plugin)


def test_the_cache_is_released_when_the_last_overlapping_call_returns() -> None:
    plugin, dev = _plugin()
    share = DeviceShare("cpu", release_when_idle=True, plugin=plugin)
    inside, leave = threading.Event(), threading.Event()

    def slow() -> int:
        inside.set()
        assert leave.wait(10)
        return 1

    worker = threading.Thread(target=share.working(slow))
    worker.start()
    assert inside.wait(10)
    assert share.working(lambda: 2)() == 2
    assert dev.released == 0  # the slow call is still working: not idle
    leave.set()
    worker.join(10)
    assert dev.released == 1
    assert share.status()["releases"] == 1
    assert sorted(share.status()["last_release"]) == [
        "allocated_after",
        "allocated_before",
        "reserved_after",
        "reserved_before",
    ]
    with pytest.raises(ZeroDivisionError):
        share.working(lambda: 1 // 0)()
    assert dev.released == 2  # a call that raises ends its work too
    quiet = DeviceShare("cpu", plugin=plugin)
    assert quiet.working(lambda: 3)() == 3
    assert dev.released == 2  # no release_when_idle: nothing released


def test_the_placement_is_read_from_this_process_spec(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, no_spec: None
) -> None:
    ctx = RoleContext.local(name="learner", replica=0)
    assert placement_sharing(ctx) == (0.0, False)
    _spec_env(monkeypatch, tmp_path, "learner", memory_fraction=0.4, release_when_idle=True)
    assert placement_sharing(ctx) == (0.4, True)
    # Another process's spec (a test calling a role in-process under a run) is not ours.
    assert placement_sharing(RoleContext.local(name="reference")) == (0.0, False)


def _batch(n: int) -> TrainBatch:
    samples = [
        Scored(
            sample=Sample(
                prompt_id="p",
                sample_index=i,
                prompt_ids=[2, 3],
                token_ids=[4, 5, 1],
                logprobs=[0.0] * 3,
                versions=[0] * 3,
                finished=True,
                stop_reason="stop",
            ),
            reward=i % 2,
        )
        for i in range(n)
    ]
    return TrainBatch(samples=samples, algorithm="grpo")


def test_the_learner_reports_its_memory_and_releases_after_each_step(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, no_spec: None
) -> None:
    torch.set_num_threads(1)
    _spec_env(monkeypatch, tmp_path, "learner", memory_fraction=0.5, release_when_idle=True)
    ctx = RoleContext.local(
        config={"model_config": MODEL, "publish_weights": False},
        run_dir=str(tmp_path),
        name="learner",
    )
    learner = Learner(ctx)
    assert learner.status() == {}  # before setup: no device yet
    asyncio.run(learner.setup())
    status = learner.status()
    assert (status["device"], status["memory_fraction"], status["releases"]) == ("cpu", 0.5, 0)
    assert status["memory"]["limit"] == int(0.5 * status["memory"]["total"])
    assert status["memory"]["allocated"] > 0
    result = learner.train(_batch(4))
    assert result.step == 1
    status = learner.status()
    assert status["releases"] == 1
    before = status["last_release"]["allocated_before"]
    assert abs(result.metrics["memory_allocated_mib"] - before / 2**20) < 8
    assert status["last_release"]["allocated_before"] > 0
    learner.train(_batch(4))  # the same samples: skipped, no step, nothing released
    assert learner.status()["releases"] == 1


def test_the_reference_reports_its_memory_and_releases_after_scoring(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, no_spec: None
) -> None:
    _spec_env(monkeypatch, tmp_path, "reference", release_when_idle=True)
    reference = Reference(
        RoleContext.local(config={"model_config": MODEL, "seed": 1}, name="reference")
    )
    assert reference.status() == {}

    async def score() -> list[list[float]]:
        await reference.setup()
        sample = Sample(
            prompt_id="p",
            sample_index=0,
            prompt_ids=[2, 3],
            token_ids=[4, 5],
            logprobs=[0.0] * 2,
            versions=[0] * 2,
            finished=True,
            stop_reason="stop",
        )
        return await reference.logprobs([sample])

    assert len(asyncio.run(score())[0]) == 2
    status = reference.status()
    assert (status["device"], status["memory_fraction"], status["releases"]) == ("cpu", 0.0, 1)
    assert status["memory"]["allocated"] > 0


def test_the_critic_holds_its_share_and_releases_after_each_call(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, no_spec: None
) -> None:
    _spec_env(monkeypatch, tmp_path, "critic", memory_fraction=0.2, release_when_idle=True)
    critic = Critic(RoleContext.local(config={"model_config": MODEL}, name="critic"))
    assert critic.status() == {}
    sample = Sample(
        prompt_id="p",
        sample_index=0,
        prompt_ids=[2, 3],
        token_ids=[4, 5],
        logprobs=[0.0] * 2,
        versions=[0] * 2,
        finished=True,
        stop_reason="stop",
    )

    async def work() -> None:
        await critic.setup()
        assert [len(v) for v in await critic.values([sample])] == [2]
        result = await critic.train_step([Scored(sample=sample, reward=1.0, values=[0.0, 0.0])])
        assert result.step == 1

    asyncio.run(work())
    status = critic.status()
    assert (status["device"], status["memory_fraction"], status["releases"]) == ("cpu", 0.2, 2)
    assert status["memory"]["limit"] == int(0.2 * status["memory"]["total"])


class ThreadDevices(CpuDevice):
    """Two devices whose current one is per thread, as CUDA's is (``cudaSetDevice``): what
    each call reads or releases is the calling thread's current device."""

    kind = "meta"

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()
        self.limits: dict[int, float] = {}
        self.released_on: list[int] = []

    def current(self) -> int:
        return int(getattr(self.local, "index", 0))

    def count(self) -> int:
        return 2

    def select(self, index: int = 0) -> torch.device:
        self.local.index = index
        return torch.device("meta", index)

    def memory(self) -> Any:
        index = self.current()
        limit = int(self.limits.get(index, 0.0) * 1000)
        return msgspec.structs.replace(
            super().memory(), allocated=100 + index, total=1000, limit=limit
        )

    def limit_memory(self, fraction: float) -> None:
        self.limits[self.current()] = fraction

    def release_cache(self) -> None:
        self.released_on.append(self.current())


def test_a_share_reads_limits_and_releases_its_own_device_from_any_thread() -> None:
    """A role on device 1 builds its share in one worker thread, is asked its status on the
    event loop's thread and releases in another worker: each acts on device 1, never on the
    thread's default device 0 (where it would report another device's memory and, on cuda,
    open a context on it)."""
    plugin = CpuPlugin()
    dev = plugin.device = ThreadDevices()
    made: list[DeviceShare] = []

    def build() -> None:
        dev.select(1)  # device_for(placement) in the compute thread, as the learner does
        made.append(DeviceShare(torch.device("meta", 1), 0.3, True, plugin=plugin))

    def run(fn: Any) -> None:
        thread = threading.Thread(target=fn)
        thread.start()
        thread.join(10)

    run(build)
    (share,) = made
    assert dev.limits == {1: 0.3}
    status = share.status()  # this thread never selected a device: its current is 0
    assert (status["device"], status["memory"]["allocated"], status["memory"]["limit"]) == (
        "meta:1",
        101,
        300,
    )
    assert share.memory().allocated == 101
    run(share.working(lambda: None))
    assert dev.released_on == [1]
    assert share.status()["last_release"]["allocated_after"] == 101
    assert device_status("meta:1", plugin)["memory"]["allocated"] == 101


class RefusingDevice(CpuDevice):
    """The host, whose cache release fails."""

    def release_cache(self) -> None:
        raise RuntimeError("the device said no")


def test_a_release_that_fails_neither_fails_nor_hides_the_work_that_ended(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plugin = CpuPlugin()
    plugin.device = RefusingDevice()
    share = DeviceShare("cpu", release_when_idle=True, plugin=plugin)
    assert share.working(lambda: 7)() == 7
    with pytest.raises(ZeroDivisionError):
        share.working(lambda: 1 // 0)()
    status = share.status()
    assert (status["releases"], status["release_error"]) == (0, "RuntimeError: the device said no")
    assert [r.getMessage() for r in caplog.records] == [
        "cache release of cpu failed (RuntimeError: the device said no); the work goes on "
        "with the cache held"
    ] * 2


class HeldDevice(CpuDevice):
    """The host, whose cache release waits for ``go`` and records who was working then."""

    def __init__(self, share_busy: Any) -> None:
        super().__init__()
        self.go = threading.Event()
        self.releasing = threading.Event()
        self.busy_at_release: list[int] = []
        self.share_busy = share_busy

    def release_cache(self) -> None:
        self.busy_at_release.append(self.share_busy())
        self.releasing.set()
        assert self.go.wait(10)


def test_releases_run_one_at_a_time_and_skip_when_work_began_meanwhile() -> None:
    """Work X ends and its release holds; work A ends meanwhile, then work B begins before A's
    release could start: A releases nothing (B's end will), so no release runs under B's work,
    and X's and B's are the only two."""
    plugin = CpuPlugin()
    box: list[DeviceShare] = []
    dev = HeldDevice(lambda: box[0]._busy)
    plugin.device = dev
    share = DeviceShare("cpu", release_when_idle=True, plugin=plugin)
    box.append(share)
    b_in, b_out = threading.Event(), threading.Event()

    def b_work() -> None:
        b_in.set()
        assert b_out.wait(10)

    x = threading.Thread(target=share.working(lambda: None))
    x.start()
    assert dev.releasing.wait(10)  # X's release is under way, held
    a_ran = threading.Event()
    a = threading.Thread(target=share.working(a_ran.set))
    a.start()
    assert a_ran.wait(10)
    # A's work is counted ended: its release is due (a spin, no sleep: the release is a thread)
    wait_until(lambda: share._busy == 0, timeout=10, what="work A counted ended", interval=0)
    b = threading.Thread(target=share.working(b_work))
    b.start()
    assert b_in.wait(10)
    dev.go.set()  # X's release ends; A's turn comes while B works
    x.join(10)
    a.join(10)
    assert share.releases == 1
    b_out.set()
    b.join(10)
    assert (share.releases, dev.busy_at_release) == (2, [0, 0])
