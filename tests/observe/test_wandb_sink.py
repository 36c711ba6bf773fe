"""Weights & Biases as a sink of the per-step metrics, in offline mode (no network): the W&B run's
own file is read back, record by record."""

from __future__ import annotations

import glob
import json
import os
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest

from asyncrl.errors import ManifestError
from asyncrl.manifest.load import parse_manifest
from asyncrl.observe.wandb_sink import RUN_ID_FILE, WANDB_DIR
from asyncrl.supervision.rundir import save_manifest
from tests.observe.test_metrics import write_steps

MANIFEST = """
run:
  name: sink
  program: a:b
  metrics: {wandb: {project: asyncrl-test, mode: offline}}
roles: {r: {class: a:B}}
"""

_BLOCK = 32768  # the W&B file is a LevelDB-style log: 32 KiB blocks of framed records
_HEADER = 7  # the file's own header (":W&B", version), then each record's (crc, length, type)


def wandb_records(path: str) -> Iterator[Any]:
    """Every record of a ``.wandb`` file, as W&B's protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, parts = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if (length, kind) == (0, 0):
            pos += left
            continue
        parts += data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (1, 4):  # a whole record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def history_and_config(run_dir: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The logged rows (without W&B's own ``_`` keys) and the config of every W&B run file of
    the run, in the order written."""
    rows: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    files = sorted(glob.glob(os.path.join(run_dir, WANDB_DIR, "offline-run-*", "run-*.wandb")))
    assert files, os.listdir(os.path.join(run_dir, WANDB_DIR))
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                rows.append(
                    {k: v for k, v in items.items() if not k.startswith("_")}
                    | {"step": items["_step"]}
                )
            elif kind == "run":
                for item in record.run.config.update:
                    config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return rows, config


def test_offline_wandb_gets_every_number_and_the_manifest(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb", reason="wandb (the wandb extra, in dev) is missing")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, whatever the manifest says
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    run_dir = str(tmp_path / "run")
    manifest = parse_manifest(MANIFEST)
    save_manifest(manifest, run_dir)
    write_steps(run_dir, range(1, 4), done=0)
    with open(os.path.join(run_dir, WANDB_DIR, RUN_ID_FILE)) as f:
        run_id = f.read().strip()
    # W&B names an offline run's folder by its id and start time to the second: a resumed
    # incarnation that starts within the same second would share it.
    started = int(time.time())
    while int(time.time()) == started:
        time.sleep(0.05)
    write_steps(run_dir, range(4, 6), done=3)  # a resumed run: the same W&B run
    with open(os.path.join(run_dir, WANDB_DIR, RUN_ID_FILE)) as f:
        assert f.read().strip() == run_id
    rows, config = history_and_config(run_dir)
    assert rows == [
        {"step": step, "wall_s": float(step), "reward/mean": step / 10} for step in range(1, 6)
    ]
    assert config["run"]["name"] == "sink"
    assert config["run"]["metrics"] == {"wandb": {"project": "asyncrl-test", "mode": "offline"}}
    assert config["roles"]["r"]["class"] == "a:B"
    runs = glob.glob(os.path.join(run_dir, WANDB_DIR, "offline-run-*"))
    assert {os.path.basename(r).rsplit("-", 1)[1] for r in runs} == {run_id}


def test_no_wandb_section_or_mode_disabled_writes_no_wandb_run(tmp_path: Any) -> None:
    plain = str(tmp_path / "plain")
    save_manifest(
        parse_manifest(
            MANIFEST.replace("  metrics: {wandb: {project: asyncrl-test, mode: offline}}\n", "")
        ),
        plain,
    )
    write_steps(plain, range(1, 3), done=0)
    disabled = str(tmp_path / "disabled")
    save_manifest(parse_manifest(MANIFEST.replace("offline", "disabled")), disabled)
    write_steps(disabled, range(1, 3), done=0)
    for run_dir in (plain, disabled):
        assert not os.path.exists(os.path.join(run_dir, WANDB_DIR))


def test_the_manifest_refuses_a_bad_wandb_section_with_every_problem() -> None:
    bad = MANIFEST.replace(
        "{project: asyncrl-test, mode: offline}", "{project: '', mode: cloud, entity: me}"
    )
    with pytest.raises(ManifestError) as caught:
        parse_manifest(bad)
    assert str(caught.value).splitlines()[1:] == [
        "  run.metrics.wandb.project: expected a non-empty string of at most 128 characters, "
        "got ''",
        "  run.metrics.wandb.mode: expected one of 'disabled', 'offline', 'online', got 'cloud'",
        "  run.metrics.wandb.entity: unknown key; expected one of 'project', 'mode'",
    ]


def test_without_the_package_the_manifest_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ManifestError) as caught:
        parse_manifest(MANIFEST)
    assert str(caught.value).splitlines()[1:] == [
        "  run.metrics.wandb.mode: mode offline needs the wandb package, which is not "
        "installed; install it with: pip install 'asyncrl[wandb]' (or set mode: disabled)"
    ]
    parse_manifest(MANIFEST.replace("offline", "disabled"))  # asks for nothing: no package


def test_a_wandb_run_that_cannot_start_is_a_warning_and_the_metrics_go_on(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``online`` without an API key or a network: W&B refuses to start; the run is told once,
    and metrics.jsonl is written as ever."""
    pytest.importorskip("wandb", reason="wandb (the wandb extra, in dev) is missing")
    import wandb

    def refuse(**kwargs: Any) -> Any:
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", refuse)
    run_dir = str(tmp_path / "run")
    save_manifest(parse_manifest(MANIFEST.replace("offline", "online")), run_dir)
    write_steps(run_dir, range(1, 3), done=0)
    said = [r.getMessage() for r in caplog.records if r.name == "asyncrl.observe.metrics"]
    assert said == [
        "no Weights & Biases run (run.metrics.wandb): UsageError: api_key not configured "
        "(no-tty); the metrics still go to metrics.jsonl"
    ]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]
