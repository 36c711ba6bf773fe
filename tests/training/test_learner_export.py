"""The learner's ``export`` writes only into ``RUN_DIR/exports`` or a ``write_paths`` folder,
never over the run's own state and never through a planted link (a fake model: no torch)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path

import pytest

from asyncrl.roles.training.learner_export import EXPORT_MARKER, export_pretrained, writable


class FakeModel:
    """Saves one file, as ``save_pretrained`` saves ``config.json`` and the weights."""

    def save_pretrained(self, path: str) -> None:
        with open(os.path.join(path, "model.safetensors"), "w") as f:
            f.write("weights")


def export(run_dir: Path, path: str, write_paths: list[str] | None = None) -> str:
    """What ``Learner.export`` does: check the target, then write it."""
    where = writable(path, "learner", str(run_dir), write_paths or [])
    return export_pretrained(FakeModel(), where)


def a_run(tmp_path: Path) -> Path:
    """A run directory with the state a learner keeps, each with a file in it."""
    run_dir = tmp_path / "run"
    for part in ["roles/learner.0/checkpoints", "ledger", "sockets", "logs", "weights"]:
        (run_dir / part).mkdir(parents=True)
        (run_dir / part / "state").write_text("keep")
    return run_dir


@pytest.mark.parametrize(
    "target", ["roles/learner.0", "ledger", "sockets", "logs", "weights", "roles", "final"]
)
def test_export_refuses_the_runs_own_state(tmp_path: Path, target: str) -> None:
    run_dir = a_run(tmp_path)
    path = str(run_dir / target)
    with pytest.raises(PermissionError) as caught:
        export(run_dir, path, write_paths=[str(run_dir)])  # even when the manifest allows it
    assert str(caught.value) == (
        f"learner: refusing to write {path!r}: it is the run directory {str(run_dir)!r}, holds "
        f"it, or is part of the run's own state there; export to a name inside "
        f"{run_dir}/exports (a relative path such as 'final' goes there), or add a folder to "
        f"roles.learner.config.write_paths in the manifest"
    )
    for part in ["roles/learner.0/checkpoints", "ledger", "sockets", "logs", "weights"]:
        assert (run_dir / part / "state").read_text() == "keep"
    assert not (run_dir / "final").exists()


@pytest.mark.parametrize("target", ["{run}", "{parent}", "../roles/learner.0"])
def test_export_refuses_the_run_directory_and_what_holds_it(tmp_path: Path, target: str) -> None:
    run_dir = a_run(tmp_path)
    path = target.format(run=run_dir, parent=tmp_path)
    with pytest.raises(PermissionError, match=r"is the run directory .*, holds it, or is part"):
        export(run_dir, path, write_paths=[str(tmp_path)])
    assert (run_dir / "roles" / "learner.0" / "checkpoints" / "state").read_text() == "keep"


def test_export_writes_into_exports_by_default(tmp_path: Path) -> None:
    run_dir = a_run(tmp_path)
    path = export(run_dir, "final")
    assert path == str(run_dir / "exports" / "final")
    assert sorted(os.listdir(path)) == [EXPORT_MARKER, "model.safetensors"]
    assert os.stat(run_dir / "exports").st_mode & 0o777 == 0o700
    # A second export replaces the first whole, and leaves no temporary folder behind.
    assert export(run_dir, str(run_dir / "exports" / "final")) == path
    assert os.listdir(run_dir / "exports") == ["final"]


def test_export_never_follows_a_planted_tmp_link(tmp_path: Path) -> None:
    """A ``<path>.tmp`` link (or any other leftover name) beside the target is left alone."""
    run_dir = a_run(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (run_dir / "exports").mkdir()
    os.symlink(outside, run_dir / "exports" / "final.tmp")
    (run_dir / "exports" / ".final.tmp").mkdir()
    path = export(run_dir, "final")
    assert os.listdir(outside) == []
    assert os.path.islink(run_dir / "exports" / "final.tmp")
    assert sorted(os.listdir(path)) == [EXPORT_MARKER, "model.safetensors"]


def test_export_refuses_a_link_out_of_exports(tmp_path: Path) -> None:
    run_dir = a_run(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (run_dir / "exports").mkdir()
    os.symlink(outside, run_dir / "exports" / "link")
    with pytest.raises(PermissionError, match=r"it is outside .*/exports' and the configured"):
        export(run_dir, "link/final")
    os.symlink(run_dir / "roles", run_dir / "exports" / "state")
    with pytest.raises(PermissionError, match="part of the run's own state"):
        export(run_dir, "state/learner.0")
    assert os.listdir(outside) == []


def test_export_refuses_an_exports_folder_that_is_a_link(tmp_path: Path) -> None:
    run_dir = a_run(tmp_path)
    os.symlink(run_dir / "roles", run_dir / "exports")
    with pytest.raises(PermissionError) as caught:
        export(run_dir, "final")
    assert str(caught.value) == (
        f"learner: refusing to export into {str(run_dir / 'exports')!r}: it is a link or not a "
        "folder; remove it (the run recreates it)"
    )


def test_export_into_write_paths_replaces_only_an_earlier_export(tmp_path: Path) -> None:
    run_dir = a_run(tmp_path)
    models = tmp_path / "models"
    (models / "thesis").mkdir(parents=True)
    (models / "thesis" / "thesis.tex").write_text("precious")
    with pytest.raises(PermissionError, match=r"it is outside .* and the configured write_paths"):
        export(run_dir, str(models / "policy"))
    with pytest.raises(PermissionError, match=r"is outside .*; export to a name inside"):
        export(run_dir, str(models), write_paths=[str(models)])  # never the folder itself
    path = export(run_dir, str(models / "policy"), write_paths=[str(models)])
    assert sorted(os.listdir(path)) == [EXPORT_MARKER, "model.safetensors"]
    assert export(run_dir, str(models / "policy"), write_paths=[str(models)]) == path
    with pytest.raises(PermissionError) as caught:
        export(run_dir, str(models / "thesis"), write_paths=[str(models)])
    assert str(caught.value) == (
        f"refusing to export over {str(models / 'thesis')!r}: it holds something other than an "
        f"earlier export (no {EXPORT_MARKER} in it); remove it yourself or export to another name"
    )
    assert (models / "thesis" / "thesis.tex").read_text() == "precious"
    assert sorted(os.listdir(models)) == ["policy", "thesis"]


def test_export_writes_into_the_folder_it_resolved_never_through_a_link_swapped_in(
    tmp_path: Path,
) -> None:
    """A link swapped in between the check and the write (``writable`` then
    ``export_pretrained``) is refused naming it; nothing lands outside the run directory."""
    run_dir = a_run(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (run_dir / "exports" / "sub").mkdir(parents=True)
    target = writable("sub/final", "learner", str(run_dir), [])
    os.rename(run_dir / "exports" / "sub", run_dir / "exports" / "aside")
    os.symlink(outside, run_dir / "exports" / "sub")
    with pytest.raises(PermissionError) as caught:
        export_pretrained(FakeModel(), target)
    assert str(caught.value) == (
        f"learner: refusing to export: {run_dir}/exports/sub is a link; a run writes only into "
        "folders of its own, never through a link: remove it, or give another path"
    )
    assert os.listdir(outside) == []


class WatchingModel(FakeModel):
    """Saves as ``FakeModel`` does, then records what the outside folder holds at that moment:
    a write that went outside shows even when a failed export removes it afterwards."""

    def __init__(self, outside: Path) -> None:
        self.outside = outside
        self.seen: list[list[str]] = []

    def save_pretrained(self, path: str) -> None:
        super().save_pretrained(path)
        self.seen.append(os.listdir(self.outside))


def test_export_races_a_link_swapped_in_and_out_and_never_writes_outside(
    tmp_path: Path,
) -> None:
    """The issue's race: a thread swaps ``exports/sub`` between a folder and a link to an
    outside folder while exports run, 200 tries; every export lands inside the run directory
    or is refused, and nothing is ever written outside, not even for a moment."""
    run_dir = a_run(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    exports = run_dir / "exports"
    (exports / "sub").mkdir(parents=True)
    model = WatchingModel(outside)
    stop = threading.Event()
    swaps = 0

    def swap() -> None:
        nonlocal swaps
        while not stop.is_set():
            with contextlib.suppress(OSError):
                os.rename(exports / "sub", exports / "aside")
            with contextlib.suppress(OSError):
                os.symlink(outside, exports / "sub")
                swaps += 1
            if os.path.islink(exports / "sub"):
                os.unlink(exports / "sub")
            with contextlib.suppress(OSError):
                os.rename(exports / "aside", exports / "sub")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the threads take turns often: many interleavings
    swapper = threading.Thread(target=swap)
    swapper.start()
    written = refused = 0
    try:
        for _ in range(200):
            try:
                where = writable("sub/final", "learner", str(run_dir), [])
                export_pretrained(model, where)
                written += 1
            except PermissionError:
                refused += 1
    finally:
        stop.set()
        swapper.join()
        sys.setswitchinterval(interval)
    assert swaps > 0 and written > 0 and written + refused == 200
    assert [listing for listing in model.seen if listing] == []
    assert os.listdir(outside) == []
    assert sorted(os.listdir(tmp_path)) == ["outside", "run"]


def test_a_2100_level_export_path_is_a_clear_error(tmp_path: Path) -> None:
    run_dir = a_run(tmp_path)
    path = "/".join(["a"] * 2100)
    with pytest.raises(PermissionError) as caught:
        export(run_dir, path)
    assert str(caught.value) == (
        f"learner: refusing to write {path[:60]!r}...: it is 2100 folders deep, over the limit "
        "of 64; export to a shorter path"
    )
    assert not (run_dir / "exports" / "a").exists()
