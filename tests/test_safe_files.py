"""Writes into the run directory never follow or reuse a name someone could have planted."""

from __future__ import annotations

import os
from pathlib import Path

from asyncrl.safe_files import private_tmpdir, replace_dir, write_atomic


def test_write_atomic_never_writes_through_a_planted_name(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    for planted in ["driver.json.tmp", f"driver.json.{os.getpid()}.tmp"]:
        os.symlink(outside, run / planted)
    os.symlink(outside, run / "driver.json")  # a link at the name itself is replaced, not followed
    assert write_atomic(str(run / "driver.json"), b"{}", fsync=True) == str(run / "driver.json")
    assert outside.read_text() == "precious"
    assert (run / "driver.json").read_bytes() == b"{}"
    assert not os.path.islink(run / "driver.json")
    assert os.stat(run / "driver.json").st_mode & 0o777 == 0o600
    assert sorted(os.listdir(run)) == sorted(
        ["driver.json", "driver.json.tmp", f"driver.json.{os.getpid()}.tmp"]
    )


def test_replace_dir_swaps_a_folder_whole_and_never_follows_a_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    target = tmp_path / "model"
    os.symlink(outside, target)
    tmp = private_tmpdir(str(target))
    assert os.stat(tmp).st_mode & 0o777 == 0o700
    (Path(tmp) / "a").write_text("1")
    replace_dir(tmp, str(target))
    assert os.listdir(outside) == [] and os.listdir(target) == ["a"]
    again = private_tmpdir(str(target))
    (Path(again) / "b").write_text("2")
    replace_dir(again, str(target))
    assert os.listdir(target) == ["b"]
    assert sorted(os.listdir(tmp_path)) == ["model", "outside"]
