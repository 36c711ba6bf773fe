"""``asyncrl bench scale``: slot turnaround, the projection and the summary in-process; a
``--quick --json`` run end to end on real processes (a driver, helper processes serving the
replicas); and one driver row of more replicas than libzmq's default socket limit allows."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from asyncrl.role import RoleContext
from asyncrl.transport import run
from benchmarks import scale
from benchmarks.scale import (
    QUICK_TIMES,
    TIMES,
    ScaleRollout,
    compare,
    format_table,
    hold_options,
    measure_row,
    project,
    summarize,
    turnarounds,
)
from tests.conftest import ROOT


def test_turnaround_pairs_each_start_with_the_end_that_freed_its_slot() -> None:
    # Two slots, 1 s samples: the third sample takes the slot the first freed, and so on.
    starts = [0.0, 0.25, 1.25, 1.75, 3.0]
    ends = [1.0, 1.25, 2.25, 2.75]  # the last is still running
    assert turnarounds(starts, ends, 2, (0.0, 10.0)) == [0.25, 0.5, 0.75]
    # Only starts in [t0, t1) count; their order in the input does not matter.
    assert turnarounds(starts[::-1], ends[::-1], 2, (1.5, 3.0)) == [0.5]
    # The first `slots` samples took a slot nobody held: no turnaround.
    assert turnarounds([0.0, 0.25], [], 2, (0.0, 10.0)) == []


def test_scale_rollout_reports_the_turnaround_of_samples_started_in_the_window() -> None:
    config = {"speeds": [1.0], "sigma": 0.0, "mean_s": 1.0}
    role = ScaleRollout(RoleContext.local(config, capacity=1))
    role.done = [(0.0, 1.0, 1.0), (1.5, 2.5, 1.0)]  # (start, end, work)
    role.running = {7: (2.75, 1.0)}  # (start, work)
    assert run(role.turnaround([1.0, 3.0])) == [0.5, 0.25]
    with pytest.raises(ValueError) as err:
        run(role.turnaround([3.0, 1.0]))
    assert str(err.value) == (
        "turnaround: expected a window [t0, t1] with t1 > t0, and optionally the samples a "
        "call, got [3.0, 1.0]"
    )
    # Calls of 2 samples: 2 slots hold 2 samples each; the last call's start pairs with the
    # first call's end.
    role.ctx = RoleContext.local(config, capacity=1)
    role.done = [(0.0, 1.0, 1.0), (0.0, 1.0, 1.0), (1.5, 2.5, 1.0), (1.5, 2.5, 1.0)]
    role.running = {}
    assert run(role.turnaround([1.0, 3.0, 2])) == [0.5, 0.5]
    assert run(role.turnaround([1.0, 3.0])) == [0.5, -1.0]  # read as calls of one: wrong


def test_a_hold_row_asks_ten_samples_a_second_of_a_replica_in_either_mode() -> None:
    # One sample a call: 4 slots of 0.4 s; the default warm-up and window already hold calls.
    row = {"slots": 4, "times": TIMES, "group_calls": False, "hosts": 4}
    one = hold_options(row)
    assert one["gen_ms"] == pytest.approx(400.0) and one["slots"] == 4
    assert one["times"] == TIMES and one["hosts"] == 4
    assert one["slots"] / (one["gen_ms"] / 1e3) == pytest.approx(10.0)
    # A group of 8 a call: the same 4 slots, each call 3.2 s, so still 10 samples/s; the
    # warm-up covers two calls and the window three.
    group = hold_options(row | {"group_calls": True})
    assert group["gen_ms"] == pytest.approx(3200.0) and group["slots"] == 4
    assert group["slots"] * 8 / (group["gen_ms"] / 1e3) == pytest.approx(10.0)
    assert group["times"] == {"window": pytest.approx(9.6), "warmup": pytest.approx(6.4)} | {
        "idle": TIMES["idle"]
    }
    assert TIMES["warmup"] == 1.5  # the caller's times are left as they were


def row(replicas: int, loop_s_per_1k: float) -> dict[str, float]:
    return {
        "replicas": replicas,
        "slots": 4,
        "gen_ms": 50.0,
        "driver_loop_cpu_s_per_1k": loop_s_per_1k,
    }


def test_projection_fits_cost_per_sample_and_solves_for_a_full_core() -> None:
    # 100 us + 1 us x replicas, exactly; 80 samples/s a replica.
    p = project([row(n, (100 + n) / 1e3) for n in (1, 4, 16, 64)])
    assert p["cpu_us_per_sample_fixed"] == pytest.approx(100.0)
    assert p["cpu_us_per_sample_per_replica"] == pytest.approx(1.0)
    assert p["replica_rate_per_s"] == 80.0
    n = p["one_core_limit_replicas"]
    assert n * 80 * (100 + n) == pytest.approx(1e6)  # one CPU second per second
    # A flat cost: the limit is one core over the cost of a replica's samples.
    flat = project([row(n, 0.125) for n in (1, 4)])
    assert flat["cpu_us_per_sample_per_replica"] == pytest.approx(0.0)
    assert flat["one_core_limit_replicas"] == pytest.approx(1e6 / (125 * 80))
    # A cost that falls with replicas (noise over few rows) is taken as flat at its fit.
    falling = project([row(1, 0.2), row(4, 0.17)])
    assert falling["cpu_us_per_sample_per_replica"] == pytest.approx(-10.0)
    assert falling["one_core_limit_replicas"] == pytest.approx(1e6 / (210 * 80))
    assert math.isinf(project([row(1, 0.0)])["one_core_limit_replicas"])


def test_the_summary_takes_the_most_carried_and_the_most_replicas_held() -> None:
    def measured(replicas: int, per_s: float, efficiency: float) -> dict[str, float]:
        return {
            "replicas": replicas,
            "samples_per_s": per_s,
            "efficiency": efficiency,
            "driver_loop_cpu_s_per_1k": 1e3 / (2 * per_s),
            "driver_ceiling_samples_per_s": 2 * per_s,
        }

    rows = [measured(64, 5000.0, 0.98), measured(256, 12000.0, 0.59)]
    held = [measured(256, 2500.0, 0.97), measured(512, 4608.0, 0.9), measured(1024, 8000.0, 0.78)]
    assert summarize(rows, held) == {
        "samples_per_s_max": 12000.0,
        "loop_cpu_s_per_1k": 1e3 / 24000.0,
        "driver_ceiling_samples_per_s": 24000.0,
        "replicas_max_held": 512,  # 0.9 of the asked rate counts; 0.78 does not
    }
    # A hold row that failed counts for nothing; with none held, 0.
    failed = [measured(256, 2000.0, 0.78), {"replicas": 512, "error": "it failed"}]
    assert summarize([], failed)["replicas_max_held"] == 0
    assert summarize([], failed)["samples_per_s_max"] == 2000.0


def test_the_sharded_arm_is_compared_row_by_row_with_one_driver() -> None:
    def measured(replicas: int, per_s: float, efficiency: float) -> dict[str, float]:
        return {
            "replicas": replicas,
            "ideal_samples_per_s": per_s / efficiency,
            "samples_per_s": per_s,
            "efficiency": efficiency,
            "driver_loop_cpu_s_per_1k": 0.1,
            "driver_ceiling_samples_per_s": 10000.0,
        }

    one = [measured(64, 4000.0, 0.8)]
    one_held = [measured(256, 2400.0, 0.94), measured(512, 3600.0, 0.7)]
    sharded = [measured(64, 5000.0, 1.0)]
    # The sharded arm held 512 too, and failed at 1,024; one driver's 1,024 row is missing.
    sharded_held = [
        measured(256, 2500.0, 0.98),
        measured(512, 4700.0, 0.92),
        {"replicas": 1024, "error": "it failed"},
    ]
    out = compare(2, one, one_held, sharded, sharded_held)
    assert out["count"] == 2
    assert out["samples_per_s_max"] == 5000.0 and out["replicas_max_held"] == 512
    assert "samples_per_s_max_ratio" not in out  # maxima of different rows: no ratio
    assert out["replicas_max_held_ratio"] == pytest.approx(2.0)
    assert [(r["replicas"], r["hold"]) for r in out["row_ratios"]] == [
        (64, False),
        (256, True),
        (512, True),
    ]
    assert [r["samples_per_s_ratio"] for r in out["row_ratios"]] == pytest.approx(
        [1.25, 2500.0 / 2400.0, 4700.0 / 3600.0]
    )
    # One driver held none: no ratio of replicas held.
    assert compare(2, one, [], sharded, [])["replicas_max_held_ratio"] is None
    # A row measured in rounds: its ratio is the median of the rounds' ratios, not the ratio
    # of the two arms' median rows.
    rounded = [sharded[0] | {"samples_per_s_ratio": 1.1}]
    assert compare(2, one, [], rounded, [])["row_ratios"][0]["samples_per_s_ratio"] == 1.1


def test_the_sharded_arm_alternates_its_order_by_round_and_keeps_medians(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three rounds of a row: one driver first, then the shards first, then one driver first;
    each arm keeps its median round, and the ratio is the median of the rounds' ratios."""
    calls: list[int] = []
    one_driver = iter([1000.0, 3000.0, 2000.0])
    with_shards = iter([1500.0, 3300.0, 1000.0])  # ratios 1.5, 1.1, 0.5

    def row(n: int, shards: int = 0, **_: object) -> dict[str, object]:
        calls.append(shards)
        per_s = next(with_shards if shards else one_driver)
        return {"replicas": n, "shards": shards, "samples_per_s": per_s}

    monkeypatch.setattr(scale, "measure_row", row)
    out = scale.measure_arms(64, [0, 2], 3)
    assert calls == [0, 2, 2, 0, 0, 2]
    assert out[0]["samples_per_s"] == 2000.0 and out[0]["rounds"] == 3
    assert out[0]["samples_per_s_rounds"] == [1000.0, 3000.0, 2000.0]
    assert out[2]["samples_per_s"] == 1500.0
    assert out[2]["samples_per_s_ratio_rounds"] == pytest.approx([1.5, 1.1, 0.5])
    assert out[2]["samples_per_s_ratio"] == pytest.approx(1.1)


KEYS = {
    "replicas",
    "samples_per_s",
    "ideal_samples_per_s",
    "efficiency",
    "driver_cpu_s_per_1k",
    "driver_cpu_fraction",
    "driver_loop_cpu_s_per_1k",
    "driver_loop_busy_fraction",
    "driver_ceiling_samples_per_s",
    "driver_idle_cpu_fraction",
    "dispatch_ms_p50",
    "dispatch_ms_p99",
    "dispatch_ms_max",
    "driver_rss_mb",
    "driver_peak_rss_mb",
    "hosts",
    "hosts_cpu_fraction",
    "hosts_busy_max",
}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_scale_benchmark_quick_json() -> None:
    cmd = [sys.executable, "-m", "benchmarks.scale", "--quick", "--json", "--hosts", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=ROOT, check=True)
    figures = json.loads(out.stdout)
    rows, held = figures["rows"], figures["hold"]["rows"]
    assert [r["replicas"] for r in rows] == [1, 4]
    assert [r["hosts"] for r in rows] == [1, 2]
    assert [r["replicas"] for r in held] == [8]
    assert figures["hold"]["samples_per_s_a_replica"] == 10.0
    assert held[0]["ideal_samples_per_s"] == pytest.approx(80.0)  # 8 replicas, 4 slots of 0.4 s
    assert [r["gc"] for r in rows + held] == ["freeze"] * 3
    carried = max(r["samples_per_s"] for r in rows + held)
    assert figures["samples_per_s_max"] == carried
    assert figures["replicas_max_held"] in (0, 8)
    assert (figures["replicas_max_held"] == 8) == (held[0]["efficiency"] >= 0.9)
    for r in rows:
        assert set(r) >= KEYS
        ideal = r["replicas"] * 4 / 0.05
        assert r["ideal_samples_per_s"] == ideal
        # Whole groups of 8 are consumed; a replica never does more than its slots allow.
        assert r["consumed_samples"] % 8 == 0 and r["consumed_samples"] > 0
        assert 0 < r["samples_per_s"] <= ideal * 1.05
        assert r["driver_cpu_s_per_1k"] > 0 and r["driver_loop_cpu_s_per_1k"] > 0
        assert r["driver_loop_cpu_s_per_1k"] <= r["driver_cpu_s_per_1k"]
        assert r["driver_ceiling_samples_per_s"] == pytest.approx(
            1e3 / r["driver_loop_cpu_s_per_1k"]
        )
        assert 0 < r["driver_loop_busy_fraction"] < 1.5
        assert 0 <= r["dispatch_ms_p50"] <= r["dispatch_ms_p99"] <= r["dispatch_ms_max"] < 1e3
        assert r["dispatch_count"] > 0
        assert 20 < r["driver_rss_mb"] <= r["driver_peak_rss_mb"] < 2000
        assert 0 < r["hosts_busy_max"] < 1.5
    assert set(figures["projection"]) == {
        "cpu_us_per_sample_fixed",
        "cpu_us_per_sample_per_replica",
        "replica_rate_per_s",
        "one_core_limit_replicas",
    }
    table = format_table(figures).splitlines()
    assert table[3] == "50 ms a sample"
    assert table[4].split() == [
        "replicas",
        "ideal/s",
        "samples/s",
        "eff",
        "cpu",
        "s/1k",
        "loop",
        "s/1k",
        "loop",
        "busy",
        "ceiling/s",
        "idle",
        "cpu",
        "p50",
        "ms",
        "p99",
        "ms",
        "rss",
        "MB",
        "peak",
        "host",
        "busy",
    ]
    assert table[5].split()[:3] == ["1", "80", f"{rows[0]['samples_per_s']:.0f}"]
    assert table[-1] == (
        f"one driver carried at most {carried:.0f} samples/s (loop "
        f"{figures['loop_cpu_s_per_1k']:.3f} s a 1,000 samples); it held "
        f"{figures['replicas_max_held']} replicas at 10 samples/s each (>= 90% of the asked rate)"
    )


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_one_driver_holds_more_replicas_than_the_default_socket_limit_allows() -> None:
    # 400 replicas take 1,200 sockets in the driver: past libzmq's default of 1,023, which
    # stopped one driver at 341 replicas before it reserved its sockets.
    times = {"window": 1.0, "warmup": 0.5, "idle": 0.2}
    r = measure_row(400, slots=1, gen_ms=400.0, hosts=2, times=times)
    assert r["replicas"] == 400 and r["ideal_samples_per_s"] == pytest.approx(1000.0)
    assert r["consumed_samples"] > 0 and r["consumed_samples"] % 8 == 0
    assert r["dispatch_count"] > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_sharded_row_carries_the_samples_through_two_shard_processes() -> None:
    r = measure_row(4, shards=2, hosts=2, times=QUICK_TIMES)
    assert (r["replicas"], r["shards"], r["hosts"]) == (4, 2, 2)
    assert set(r) >= KEYS | {"shards_cpu_fraction", "shards_busy_max"}
    # Whole groups reached the driver from the shards; the replicas ran the samples.
    assert r["consumed_samples"] % 8 == 0 and r["consumed_samples"] > 0
    assert 0 < r["samples_per_s"] <= r["ideal_samples_per_s"] * 1.05
    assert r["dispatch_count"] > 0
    assert r["shards_cpu_fraction"] > 0 and 0 < r["shards_busy_max"] < 1.5
