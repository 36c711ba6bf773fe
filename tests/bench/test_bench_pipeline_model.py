"""The pipeline model against timelines worked out by hand, and its invariants on real workloads.

The hand cases use explicit durations of whole seconds so that every event time is exact; their
timelines are written out next to the expected figures.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics

import pytest

from benchmarks.pipeline_model import ModelResult, Workload, sample_duration, simulate


def one_second(prompt: int, index: int) -> float:
    return 1.0


def test_sample_duration_at_sigma_zero_is_the_mean() -> None:
    assert sample_duration(3, 5, 0.0) == 0.05
    assert sample_duration(3, 5, 0.0, mean_s=0.2, seed=9) == 0.2


def test_sample_duration_is_a_function_of_the_id_with_the_given_mean() -> None:
    assert sample_duration(7, 3, 1.0, seed=1) == sample_duration(7, 3, 1.0, seed=1)
    assert sample_duration(7, 3, 1.0, seed=1) != sample_duration(7, 3, 1.0, seed=2)
    assert sample_duration(7, 3, 1.0) != sample_duration(3, 7, 1.0)
    draws = [sample_duration(p, i, 1.0) for p in range(2500) for i in range(8)]
    # 20000 lognormal draws at sigma 1: the standard error of the mean is 0.93% of it.
    assert statistics.fmean(draws) == pytest.approx(0.05, rel=0.03)
    assert statistics.median(draws) == pytest.approx(0.05 * 2.718281828 ** (-0.5), rel=0.03)


def test_sync_with_equal_speeds_and_equal_samples_steps_every_four_waves() -> None:
    # 64 equal slots, 256 samples of 50 ms: 4 waves (0.2 s), then the learner for
    # 0.25 * 0.2 = 0.05 s with every slot empty. 30 steps of 0.25 s in the window.
    w = Workload(sigma=0.0, speeds=(1.0, 1.0, 1.0, 1.0))
    assert w.capacity == 64
    assert w.learner_s == pytest.approx(0.05)
    r = simulate(w, "sync")
    assert r.window_steps == 30
    assert r.window_s == pytest.approx(30 * 0.25)
    assert r.samples_per_s == pytest.approx(256 / (0.2 + 0.05))
    assert r.efficiency == pytest.approx(0.8)
    assert r.idle == pytest.approx((0.2, 0.2, 0.2, 0.2))
    assert r.consumed_samples == r.dispatched_samples == 30 * 256
    assert (r.staleness_p50, r.staleness_p99, r.staleness_max) == (0, 0, 0)


def test_async_with_equal_speeds_and_equal_samples_keeps_every_slot_busy() -> None:
    r = simulate(Workload(sigma=0.0, speeds=(1.0, 1.0, 1.0, 1.0)), "async")
    assert r.efficiency == pytest.approx(1.0)
    assert r.idle == pytest.approx((0.0, 0.0, 0.0, 0.0), abs=1e-9)
    assert r.samples_per_s == pytest.approx(64 / 0.05)
    assert r.window_s == pytest.approx(30 * 0.2)
    assert r.staleness_max <= 2
    assert r.waste_fraction == 0.0


# Two replicas at speeds 1 and 0.5, two slots each, groups of 1, batches of 4, samples of 1 s;
# capacity 3, learner 0.75 * 4 * 1 / 3 = 1 s. Dispatch by most free slots, ties to the lower
# index: samples 0, 2 go to replica 0 (done at 1 s), samples 1, 3 to replica 1 (done at 2 s).
TWO_REPLICAS = Workload(
    sigma=0.0,
    speeds=(1.0, 0.5),
    slots=2,
    group=1,
    batch=4,
    mean_s=1.0,
    learner_factor=0.75,
    eta=1,
    warmup=1,
    steps=3,
)


def test_sync_on_two_replicas_by_hand() -> None:
    # Every step: 2 s of generation, 1 s of learner. Replica 0 busy 2 of 6 slot-seconds,
    # replica 1 busy 4 of 6.
    r = simulate(TWO_REPLICAS, "sync", one_second)
    assert r.window_s == 9.0
    assert r.samples_per_s == pytest.approx(4 / 3)
    assert r.efficiency == pytest.approx(12 / (3 * 9))
    assert r.idle == pytest.approx((2 / 3, 1 / 3))


def test_async_on_two_replicas_by_hand() -> None:
    # Admission allows (v + 2) * 4 samples. Steps end at 3, 5, 7, 9 s: from t=3 on, replica 1 is
    # always full and replica 0 runs two samples in every other second; each batch (taken at 4,
    # 6, 8 s at versions 1, 2, 3) holds samples that started one version earlier.
    r = simulate(TWO_REPLICAS, "async", one_second)
    assert r.window_s == 6.0
    assert r.window_steps == 3
    assert r.samples_per_s == 2.0
    assert r.efficiency == pytest.approx(12 / (3 * 6))
    assert r.idle == (0.5, 0.0)
    assert r.dispatched_samples == 12  # samples 8..19, started at 3..8 s
    assert (r.staleness_p50, r.staleness_p99, r.staleness_max) == (1, 1, 1)
    assert r.admission_excess_max == 0


# One replica, two slots, groups of 1, batches of 2, eta 1, learner 0.5 s. Sample 0 takes 10 s,
# every other 1 s. Sample 0 holds one slot; the other slot serves samples 1, 2, ... one per
# second, and a batch of two is ready every 2 s: the learner steps at 2, 4, 6, 8 s. The idle
# learner takes sample 9 (version 3) when it completes at 9 s and sample 0 (version 0) at 10 s,
# at version 4: staleness 1 and 4.
LONG_HEAD = Workload(
    sigma=0.0,
    speeds=(1.0,),
    slots=2,
    group=1,
    batch=2,
    mean_s=1.0,
    learner_factor=0.5,
    eta=1,
    warmup=0,
    steps=5,
)


def long_head(prompt: int, index: int) -> float:
    return 10.0 if prompt == 0 else 1.0


def test_correct_keeps_a_sample_older_than_eta() -> None:
    r = simulate(LONG_HEAD, "async", long_head)
    assert r.window_s == 10.5
    assert r.consumed_samples == 10
    assert r.consumed_work == 19.0
    # Staleness of the ten, sorted: 0 x5, 1 x4, 4. Nearest rank: p50 is the 5th, p99 the 10th.
    assert (r.staleness_p50, r.staleness_p99, r.staleness_max) == (0, 4, 4)
    assert (r.wasted_samples, r.wasted_work, r.waste_fraction) == (0, 0.0, 0.0)
    assert r.dispatched_samples == 12
    assert r.mean_consumed_s == 1.9


def test_drop_discards_the_group_reopens_admission_and_takes_another() -> None:
    # At 10 s sample 0 completes first (it was scheduled first) and is dropped at once: the drop
    # frees room for one more sample (12), and sample 11 takes the freed slot. The learner,
    # holding sample 9, takes sample 10 (done at 10 s, version 4) in its place, so the fifth step
    # trains on two samples, as the pipeline tops a batch up after a drop. Both 11 and 12 start
    # at 10 s, in the window.
    r = simulate(dataclasses.replace(LONG_HEAD, over_eta="drop"), "async", long_head)
    assert r.window_s == 10.5
    assert r.window_steps == 5
    assert r.consumed_samples == 10
    assert r.consumed_work == 10.0
    # Staleness of the ten: 0, 0 at version 0, then (1, 0) at each of versions 1 to 4.
    assert (r.staleness_p50, r.staleness_p99, r.staleness_max) == (0, 1, 1)
    assert (r.wasted_samples, r.wasted_work) == (1, 10.0)
    assert r.dispatched_samples == 13
    assert r.dispatched_work == 22.0
    assert r.waste_fraction == pytest.approx(10 / 22)
    assert r.mean_consumed_s == 1.0
    assert r.mean_dispatched_s == pytest.approx(22 / 13)
    assert r.idle == (0.0,)
    assert r.admission_excess_max == 0


def test_drop_bounds_staleness_on_a_heavy_tail_and_correct_wastes_nothing() -> None:
    w = Workload(sigma=1.5)
    kept = simulate(w, "async")
    dropped = simulate(dataclasses.replace(w, over_eta="drop"), "async")
    assert kept.staleness_max > w.eta
    assert kept.wasted_samples == 0 and kept.waste_fraction == 0.0
    assert dropped.staleness_max <= w.eta
    assert dropped.wasted_samples > 0 and 0 < dropped.waste_fraction < 1
    assert dropped.wasted_samples % w.group == 0
    # A drop is made up from the ready queue: every step still trains on a whole batch.
    assert dropped.consumed_samples == kept.consumed_samples == w.steps * w.batch


def test_async_uses_a_slow_replica_better_than_sync() -> None:
    w = Workload(sigma=1.0)
    sync = simulate(w, "sync")
    fast = simulate(w, "async")
    assert fast.efficiency > sync.efficiency
    assert fast.samples_per_s > sync.samples_per_s
    assert min(sync.idle[:3]) > max(fast.idle[:3])


def test_admission_never_passes_the_bound() -> None:
    w = Workload(sigma=1.5, overprovision=64, over_eta="drop")
    assert simulate(w, "async").admission_excess_max == 64
    assert simulate(dataclasses.replace(w, overprovision=0), "async").admission_excess_max == 0
    assert simulate(w, "sync").admission_excess_max == 0


def test_the_same_inputs_give_the_same_result() -> None:
    w = Workload(sigma=1.0, over_eta="drop", eta=1)
    first = simulate(w, "async")
    assert simulate(w, "async") == first
    assert simulate(dataclasses.replace(w, seed=1), "async") != first


def test_as_dict_is_json_ready() -> None:
    r = simulate(TWO_REPLICAS, "sync", one_second)
    d = r.as_dict()
    assert d["idle"] == [pytest.approx(2 / 3), pytest.approx(1 / 3)]
    assert set(d) == {f.name for f in dataclasses.fields(ModelResult)}
    assert json.loads(json.dumps(d))["mode"] == "sync"


def test_a_bad_workload_names_every_problem() -> None:
    msg = (
        "workload: sigma: expected >= 0, got -1; slots: expected int >= 1, got 0; "
        "over_eta: expected one of ('correct', 'drop'), got 'late'"
    )
    with pytest.raises(ValueError, match=re.escape(msg) + "$"):
        Workload(sigma=-1, slots=0, over_eta="late")
    with pytest.raises(ValueError, match=r"batch: expected a multiple of group \(8\), got 100;"):
        Workload(sigma=0, batch=100)


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=re.escape("pipeline model: mode expected one of ('sync', 'async'), got 'fast'"),
    ):
        simulate(Workload(sigma=0), "fast")
