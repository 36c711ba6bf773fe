"""``asyncrl bench transport`` runs end to end and reports every figure with its baseline."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.conftest import ROOT

KEYS = {
    "rtt_p50_us",
    "rtt_p99_us",
    "rpc_calls_per_s",
    "rpc_calls_per_s_traced",
    "client_cpu_us_per_call",
    "client_cpu_us_per_call_traced",
    "stream_msgs_per_s",
    "raw_zmq_msgs_per_s",
    "tensor_frames_gbps",
    "tensor_shm_gbps",
    "memcpy_gbps",
    "raw_rtt_p50_us",
    "rtt_over_raw",
    "stream_over_raw",
    "shm_over_memcpy",
}


@pytest.mark.slow
def test_transport_benchmark_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "bench", "transport", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=True,
    )
    figures = json.loads(out.stdout)
    assert set(figures) >= KEYS
    for key in KEYS:
        assert figures[key] > 0, key
    assert figures["rtt_p99_us"] >= figures["rtt_p50_us"]
    assert figures["shm_used"] is True
    # Shared memory cannot beat a plain copy of the same bytes; if it did, the benchmark would
    # be measuring something else.
    assert figures["shm_over_memcpy"] < 1.0
    assert figures["stream_over_raw"] == pytest.approx(
        figures["stream_msgs_per_s"] / figures["raw_zmq_msgs_per_s"]
    )


def test_unknown_benchmark_is_refused() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "bench", "nope"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2
    from asyncrl.cli import BENCHMARKS, DEVELOPER_BENCHMARKS, _plugged_benchmarks

    names = [*BENCHMARKS, *DEVELOPER_BENCHMARKS, *sorted(_plugged_benchmarks())]
    choices = ", ".join(repr(name) for name in names)
    assert f"invalid choice: 'nope' (choose from {choices})" in out.stderr


def test_a_developer_benchmark_outside_a_checkout_says_where_to_get_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Installed from a wheel (no ``benchmarks/`` beside the package), ``asyncrl bench scale``
    fails with exit status 2 and names the repository's folder to run it from."""
    from asyncrl import cli

    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "asyncrl" / "cli.py"))
    assert cli.main(["bench", "scale", "--quick"]) == 2
    assert capsys.readouterr().err == (
        "asyncrl bench scale: a developer benchmark, kept in the benchmarks/ folder of the "
        "asyncrl source repository and not in the installed package; run it from a checkout of "
        "the repository, installed in editable mode (pip install -e .): asyncrl bench scale\n"
    )


@pytest.mark.slow
def test_runtime_benchmark_json() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "bench",
            "runtime",
            "--json",
            "--kills",
            "2",
            "--calls",
            "200",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=True,
    )
    figures = json.loads(out.stdout)
    keys = {
        "crash_detect_ms_p50",
        "restart_to_serving_ms_p50",
        "role_import_ms_p50",
        "handle_rtt_us_p50",
        "bare_rtt_us_p50",
        "handle_overhead_ratio",
        "standby_restart_ms_p50",
        "standby_speedup",
    }
    assert set(figures) >= keys
    assert figures["kills"] == 2
    assert figures["standby_speedup"] == pytest.approx(
        figures["restart_to_serving_ms_p50"] / figures["standby_restart_ms_p50"]
    )
    assert 0 < figures["crash_detect_ms_p50"] < figures["restart_to_serving_ms_p50"]
    assert figures["handle_overhead_ratio"] == pytest.approx(
        figures["handle_rtt_us_p50"] / figures["bare_rtt_us_p50"]
    )


@pytest.mark.slow
@pytest.mark.timeout(360)  # the command's own limit is 300 s; compiling takes most of it
def test_learner_benchmark_json() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "bench",
            "learner",
            "--json",
            "--steps",
            "2",
            "--samples",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=True,
    )
    figures = json.loads(out.stdout)
    assert figures["samples_per_step"] == 32
    assert figures["learner_overhead_ratio"] == pytest.approx(
        figures["learner_step_ms_p50"] / figures["plain_step_ms_p50"]
    )
    assert figures["durable_ratio"] == pytest.approx(
        figures["durable_step_ms_p50"] / figures["learner_step_ms_p50"]
    )
    # The scheduler's split of the learner's step: CPU its process ran, against the plain
    # step's; each is real work (a step is milliseconds of matrix products), and the
    # learner's process cannot run more than its step's wall time on one torch thread and
    # a few mostly idle ones. The wait is summed over its threads, so only its sign is sure.
    assert 0 < figures["plain_cpu_ms_p50"] <= figures["plain_step_ms_p50"] * 1.05
    assert 0 < figures["learner_cpu_ms_p50"] <= figures["learner_step_ms_p50"] * 2
    assert figures["learner_wait_ms_p50"] >= 0
    assert figures["learner_cpu_ratio"] == pytest.approx(
        figures["learner_cpu_ms_p50"] / figures["plain_cpu_ms_p50"]
    )
    assert figures["rollout_tokens_per_s"] > 0
    # Where the small step's time goes, from the learner's and its trainer's tracing spans:
    # each part a span, or a span less those nested in it, so none is negative.
    parts = figures["small_breakdown_ms"]
    assert list(parts) == [
        "batching (pad, to device)",
        "forward",
        "loss",
        "backward and grad clip",
        "optimizer",
        "advantages and split",
        "step log (durable: false)",
        "weight publish",
        "metrics and ledger",
        "reply encode",
        "rpc and codec",
    ]
    assert all(parts[k] > 0 for k in list(parts)[:9]), parts


def test_the_multinode_benchmarks_manifest_runs_on_one_node_with_its_overrides() -> None:
    """The one-node half of ``asyncrl bench multinode`` runs the two-node example moved to node
    0; both halves take the shortened settings. (The runs themselves are the multi-node tests'.)"""
    from asyncrl.manifest import ManifestError, load_manifest
    from benchmarks.multinode_runs import MANIFEST, ONE_NODE, SHORT

    path = os.path.join(ROOT, MANIFEST)
    with pytest.raises(ManifestError, match=r"roles\.rollout\.placement\.node: node 1, but"):
        load_manifest(path, list(SHORT), nodes=1)
    one = load_manifest(path, [*SHORT, *ONE_NODE], nodes=1)
    two = load_manifest(path, list(SHORT), nodes=2)
    assert {r.placement.node for r in one.roles.values()} == {0}
    assert set(one.roles["learner"].placement.nodes) == {0}
    assert two.roles["learner"].placement.nodes == [0, 1]
    assert one.run.config["rl_steps"] == two.run.config["rl_steps"] == 6
    assert one.run.config["bc_max_steps"] == two.run.config["bc_max_steps"] == 40
