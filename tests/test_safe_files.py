"""Writes into the run directory never follow or reuse a name someone could have planted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncrl.safe_files import (
    UnsafePathError,
    open_append,
    open_dir,
    open_subdir,
    private_tmpdir_at,
    replace_dir_at,
    write_atomic,
)


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
    fd = open_dir(str(tmp_path))
    try:
        tmp = private_tmpdir_at(fd, "model")
        assert os.stat(tmp_path / tmp).st_mode & 0o777 == 0o700
        (tmp_path / tmp / "a").write_text("1")
        replace_dir_at(fd, tmp, "model")
        assert os.listdir(outside) == [] and os.listdir(target) == ["a"]
        again = private_tmpdir_at(fd, "model")
        (tmp_path / again / "b").write_text("2")
        replace_dir_at(fd, again, "model")
    finally:
        os.close(fd)
    assert os.listdir(target) == ["b"]
    assert sorted(os.listdir(tmp_path)) == ["model", "outside"]


def test_open_subdir_never_follows_a_link_and_bounds_the_depth(tmp_path: Path) -> None:
    """A link on the way is an error naming it; a path 2,100 folders deep is refused with a
    message, not a ``RecursionError``; missing folders are made 0700."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "run").mkdir()
    os.symlink(outside, tmp_path / "run" / "logs")
    fd = open_dir(str(tmp_path / "run"))
    try:
        with pytest.raises(UnsafePathError) as planted:
            open_subdir(fd, "logs/old", create=True, where="RD")
        assert str(planted.value) == (
            "RD/logs is a link; a run writes only into folders of its own, never through a "
            "link: remove it, or give another path"
        )
        with pytest.raises(UnsafePathError, match=r"is 2100 folders deep, over the limit of 64"):
            open_subdir(fd, "/".join(["a"] * 2100), create=True)
        with pytest.raises(UnsafePathError, match=r"must be a relative path inside RD"):
            open_subdir(fd, "../outside", where="RD")
        sub = open_subdir(fd, "a/b", create=True)
        os.close(sub)
    finally:
        os.close(fd)
    assert os.listdir(outside) == []
    assert os.stat(tmp_path / "run" / "a" / "b").st_mode & 0o777 == 0o700
    assert not (tmp_path / "run" / "a" / "b" / "a").exists()


def test_open_append_never_writes_through_a_link(tmp_path: Path) -> None:
    """A log, a journal or a ledger opened for appends: created 0600, appended to, and a link
    at its name is an error naming it."""
    log = tmp_path / "agent.jsonl"
    for line in [b"one\n", b"two\n"]:
        with open_append(str(log)) as f:
            f.write(line)
    assert log.read_bytes() == b"one\ntwo\n"
    assert os.stat(log).st_mode & 0o777 == 0o600
    with open_append(str(log), truncate=True) as f:
        f.write(b"anew\n")
    assert log.read_bytes() == b"anew\n"
    outside = tmp_path / "outside"
    outside.write_text("precious")
    os.symlink(outside, tmp_path / "planted.jsonl")
    with pytest.raises(UnsafePathError) as planted:
        open_append(str(tmp_path / "planted.jsonl"))
    assert str(planted.value) == (
        f"{tmp_path}/planted.jsonl is a link; a run writes its files only in its own folders, "
        "never through a link: remove it"
    )
    assert outside.read_text() == "precious"
