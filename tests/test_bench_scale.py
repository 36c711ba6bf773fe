"""``asyncrl bench scale``: slot turnaround and the projection in-process, and a ``--quick --json``
run end to end on real processes (a driver, helper processes serving the replicas)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from asyncrl.bench.scale import ScaleRollout, format_table, project, turnarounds
from asyncrl.role import RoleContext
from asyncrl.transport import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    assert str(err.value) == "turnaround: expected a window [t0, t1] with t1 > t0, got [3.0, 1.0]"


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
    cmd = [sys.executable, "-m", "asyncrl.bench.scale", "--quick", "--json", "--hosts", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=ROOT, check=True)
    figures = json.loads(out.stdout)
    rows = figures["rows"]
    assert [r["replicas"] for r in rows] == [1, 4]
    assert [r["hosts"] for r in rows] == [1, 2]
    assert [r["gc"] for r in rows] == [True, True]
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
    table = format_table(figures)
    assert table.splitlines()[3].split() == [
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
    assert table.splitlines()[4].split()[:3] == ["1", "80", f"{rows[0]['samples_per_s']:.0f}"]
