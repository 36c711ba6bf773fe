"""``asyncrl run``: the saved manifest, a run directory already used, ``--overwrite`` and
``--resume``; ``asyncrl keys generate``."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncrl import cli
from asyncrl.manifest.load import load_manifest
from asyncrl.supervision.leases import LEASE_DIR_ENV, lease_path, write_lease
from asyncrl.supervision.rundir import (
    RUN_MARKER,
    RunDirError,
    claim_run_dir,
    clear_run,
    load_saved_manifest,
    manifest_differences,
    prepare_run_dir,
    run_markers,
    save_manifest,
)
from tests.conftest import ROOT

HELLO = os.path.join(ROOT, "examples", "hello", "manifest.yaml")


def error(capsys: pytest.CaptureFixture[str]) -> str:
    return capsys.readouterr().err


# -- the run directory ---------------------------------------------------------------------


def test_saved_manifest_round_trips(tmp_path: Any) -> None:
    manifest = load_manifest(HELLO, ["roles.splitter.replicas=3", "run.config.x=[1, 2]"])
    path = save_manifest(manifest, str(tmp_path))
    assert path == os.path.join(tmp_path, "manifest.json")
    assert sorted(os.listdir(tmp_path)) == [RUN_MARKER, "manifest.json"]  # no temporary file
    assert load_saved_manifest(str(tmp_path)) == manifest
    assert manifest_differences(manifest, load_manifest(HELLO)) == [
        "run.config.x",
        "roles.splitter.replicas",
    ]


def test_run_markers(tmp_path: Any) -> None:
    assert run_markers(str(tmp_path)) == []
    assert run_markers(os.path.join(tmp_path, "missing")) == []
    os.makedirs(os.path.join(tmp_path, "roles", "learner.0", "checkpoints"))
    with open(os.path.join(tmp_path, "report.json"), "w") as f:
        f.write("{}")
    assert run_markers(str(tmp_path)) == ["report.json", "roles"]


def test_clear_run_empties_the_directory_but_never_a_project(tmp_path: Any) -> None:
    run = claim_run_dir(os.path.join(tmp_path, "run"))
    os.makedirs(os.path.join(run, "checkpoints", "step-1"))
    with open(os.path.join(run, "report.json"), "w") as f:
        f.write("{}")
    os.symlink(str(tmp_path), os.path.join(run, "weights"))  # a launch's shared weight store
    clear_run(run)
    assert os.listdir(run) == [RUN_MARKER]  # the record stays: the directory is still a run's
    assert os.listdir(tmp_path) == ["run"]  # the link went, not what it points at
    project = os.path.join(tmp_path, "project")
    os.makedirs(os.path.join(project, ".git"))
    with pytest.raises(RunDirError, match="it is a git checkout, not a run directory"):
        clear_run(project)
    assert os.listdir(project) == [".git"]
    with pytest.raises(RunDirError, match="it holds the current directory"):
        clear_run(os.path.dirname(os.getcwd()))


def test_save_manifest_never_writes_through_a_planted_temporary_name(tmp_path: Any) -> None:
    """A link at the name the manifest used to be staged at (``manifest.json.<pid>.tmp``),
    pointing out of the run directory, is neither followed nor reused."""
    run, outside = str(tmp_path / "run"), tmp_path / "outside.txt"
    outside.write_text("precious")
    os.makedirs(run)
    planted = os.path.join(run, f"manifest.json.{os.getpid()}.tmp")
    os.symlink(outside, planted)
    save_manifest(load_manifest(HELLO), run)
    assert outside.read_text() == "precious"
    assert os.path.islink(planted)
    assert sorted(os.listdir(run)) == [RUN_MARKER, "manifest.json", os.path.basename(planted)]


def test_claim_makes_the_run_directory_private_and_marks_it(tmp_path: Any) -> None:
    run = str(tmp_path / "run")
    os.makedirs(os.path.join(run, "logs"), mode=0o777)
    os.chmod(run, 0o777)
    os.chmod(os.path.join(run, "logs"), 0o777)  # left so by an earlier version under umask 000
    assert claim_run_dir(run) == run
    assert os.stat(run).st_mode & 0o777 == 0o700
    assert os.stat(os.path.join(run, "logs")).st_mode & 0o777 == 0o700
    assert os.path.isfile(os.path.join(run, RUN_MARKER))


def test_overwrite_refuses_a_folder_that_is_not_a_run(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder with a ``roles/`` (which a run writes) and a thesis (which none does) is no
    run, and nothing in it is deleted."""
    run = str(tmp_path)
    os.makedirs(os.path.join(run, "roles"))
    with open(os.path.join(run, "thesis.tex"), "w") as f:
        f.write("precious")
    assert cli.main(["run", HELLO, "--run-dir", run, "--overwrite"]) == 2
    assert error(capsys) == (
        f"asyncrl: error: refusing to overwrite {run}: it has no run marker (.asyncrl-run) and "
        "holds thesis.tex, which no run writes, so it may not be a run directory; delete it "
        "yourself if it is yours to delete, or give another --run-dir\n"
    )
    assert sorted(os.listdir(run)) == ["roles", "thesis.tex"]
    os.unlink(os.path.join(run, "thesis.tex"))
    assert cli.main(["run", HELLO, "--run-dir", run, "--overwrite"]) == 2
    assert error(capsys) == (
        f"asyncrl: error: refusing to overwrite {run}: it has no run marker (.asyncrl-run) and "
        "none of the manifest.json, report.json, driver.json, logs a run leaves, so it may not "
        "be a run directory; delete it yourself if it is yours to delete, or give another "
        "--run-dir\n"
    )
    assert os.listdir(run) == ["roles"]


def test_clear_run_takes_a_run_directory_of_an_earlier_version(tmp_path: Any) -> None:
    """No marker, but only what a run writes, with its manifest and logs: a run of a version
    that wrote no marker, cleared by --overwrite; the manifest and plots beside it stay."""
    run = str(tmp_path)
    for folder in ["roles/learner.0", "logs", "ledger", "sockets", "plots"]:
        os.makedirs(os.path.join(run, folder))
    for name in ["manifest.json", "manifest.yaml"]:
        write(os.path.join(run, name), "{}")
    assert clear_run(run) == ["manifest.yaml", "plots"]
    assert sorted(os.listdir(run)) == ["manifest.yaml", "plots"]


def test_clear_run_with_the_marker_clears_what_a_run_writes_and_keeps_the_rest(
    tmp_path: Any,
) -> None:
    """Under the marker, what a run made (a launch's node folders, cleared by their own
    markers, and a write's temporary names too) is removed, and what it did not is kept and
    returned: a folder named as a node's but without a marker, a note."""
    run = claim_run_dir(str(tmp_path / "run"))
    os.makedirs(os.path.join(claim_run_dir(os.path.join(run, "node-1")), "logs"))
    os.makedirs(os.path.join(run, "node-2"))
    for name in ["notes.txt", "report.json", ".manifest.json.k2j4x9_q.tmp"]:
        with open(os.path.join(run, name), "w") as f:
            f.write("written into the run directory")
    assert clear_run(run) == ["node-2", "notes.txt"]
    assert sorted(os.listdir(run)) == [RUN_MARKER, "node-2", "notes.txt"]


def test_a_folder_of_the_users_used_as_a_run_directory_keeps_its_files(tmp_path: Any) -> None:
    """The issue's case: a run in a folder that holds a thesis, then ``--overwrite`` there.
    The run's own files go; the thesis stays, whatever the marker says."""
    folder = str(tmp_path / "thesis")
    os.makedirs(folder)
    with open(os.path.join(folder, "thesis.tex"), "w") as f:
        f.write("precious")
    with pytest.raises(RunDirError, match="is not empty"):
        prepare_run_dir(folder)
    save_manifest(load_manifest(HELLO), prepare_run_dir(folder, allow_nonempty=True))
    assert RUN_MARKER in os.listdir(folder)
    with pytest.raises(RunDirError, match="already holds a run"):
        prepare_run_dir(folder)
    prepare_run_dir(folder, overwrite=True)
    assert sorted(os.listdir(folder)) == [RUN_MARKER, "thesis.tex"]
    with open(os.path.join(folder, "thesis.tex")) as f:
        assert f.read() == "precious"


def write(path: str, text: str = "written") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def a_run_writes(run: str) -> None:
    """What a run leaves: its manifest, report, agent log, role state, sockets."""
    save_manifest(load_manifest(HELLO), run)
    for name in ["report.json", "logs/agent.jsonl", "roles/learner.0/state.json", "sockets/x"]:
        write(os.path.join(run, name))


def test_overwrite_keeps_the_manifest_the_run_was_started_from(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's first case: ``asyncrl run RD/manifest.yaml --run-dir RD`` twice, the second
    with ``--overwrite``: the manifest beside the run stays, the run's files go."""
    run = str(tmp_path / "rd")
    manifest = os.path.join(run, "manifest.yaml")
    os.makedirs(run)
    with open(HELLO) as src:
        write(manifest, src.read())
    assert cli.main(["run", manifest, "--run-dir", run, "--overwrite"]) == 2
    assert error(capsys) == (
        f"asyncrl: error: {run} is not empty (it holds manifest.yaml) and holds no run; give "
        "an empty or new --run-dir, or add --allow-nonempty to write the run beside what is "
        "there ('--overwrite' later removes only what the runs made, never those)\n"
    )
    assert os.listdir(run) == ["manifest.yaml"]
    prepare_run_dir(run, allow_nonempty=True)
    a_run_writes(run)
    prepare_run_dir(run, overwrite=True)
    assert sorted(os.listdir(run)) == [RUN_MARKER, "manifest.yaml"]
    assert load_manifest(manifest) == load_manifest(HELLO)
    prepare_run_dir(run, overwrite=True)  # the next identical command finds it still
    assert sorted(os.listdir(run)) == [RUN_MARKER, "manifest.yaml"]


def test_overwrite_never_deletes_the_users_files_in_a_results_folder(tmp_path: Any) -> None:
    """The issue's second case: a results folder holding ``logs/app.log``,
    ``plots/fig1.png`` and ``final/paper.pdf``; a run into it (``--allow-nonempty``) writes
    its own files beside them, some into the user's ``logs/``; ``--overwrite`` removes the
    run's files at the top and the folders it made, and keeps every one of the user's."""
    run = str(tmp_path / "results")
    users = ["logs/app.log", "plots/fig1.png", "final/paper.pdf"]
    for name in users:
        write(os.path.join(run, name), "the user's")
    with pytest.raises(RunDirError, match="is not empty"):
        prepare_run_dir(run)
    prepare_run_dir(run, allow_nonempty=True)
    a_run_writes(run)
    with pytest.raises(RunDirError, match="already holds a run"):
        prepare_run_dir(run)
    prepare_run_dir(run, overwrite=True)
    assert sorted(os.listdir(run)) == [RUN_MARKER, "final", "logs", "plots"]
    for name in users:
        with open(os.path.join(run, name)) as f:
            assert f.read() == "the user's"
    a_run_writes(run)  # the second run, and a third with --overwrite: the same
    prepare_run_dir(run, overwrite=True)
    assert sorted(os.listdir(run)) == [RUN_MARKER, "final", "logs", "plots"]
    assert sorted(os.listdir(os.path.join(run, "plots"))) == ["fig1.png"]
    assert sorted(os.listdir(os.path.join(run, "final"))) == ["paper.pdf"]


def test_a_folder_a_user_makes_after_the_run_is_not_the_runs(tmp_path: Any) -> None:
    """Only what the runs made goes: a ``plots/`` or ``final/`` made beside a run later is
    kept, and so is a note."""
    run = prepare_run_dir(str(tmp_path / "rd"))
    a_run_writes(run)
    for name in ["plots/fig2.png", "final/paper.pdf", "notes.txt"]:
        write(os.path.join(run, name), "the user's")
    assert prepare_run_dir(run, overwrite=True) == run
    assert sorted(os.listdir(run)) == [RUN_MARKER, "final", "notes.txt", "plots"]


@pytest.mark.parametrize("name", ["logs", "sockets", "ledger", "exports"])
def test_a_link_planted_in_the_run_directory_is_an_error_naming_it(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """A ``logs`` link made the agent's log land in an outside 0777 folder, a ``sockets`` link
    gave a traceback: now the run stops before it starts, naming the link, and nothing is
    written outside."""
    run, outside = str(tmp_path / "rd"), str(tmp_path / "outside")
    os.makedirs(outside)
    os.chmod(outside, 0o777)
    prepare_run_dir(run)
    os.symlink(outside, os.path.join(run, name))
    assert cli.main(["run", HELLO, "--run-dir", run, "--overwrite"]) == 2
    assert error(capsys) == (
        f"asyncrl: error: {run}/{name} is a link (to {outside}); a run writes only into "
        f"folders it made itself, never through a link: remove the link (the run makes {name} "
        "again), or give another --run-dir\n"
    )
    assert os.listdir(outside) == []
    write(os.path.join(run, "manifest.json"), "{}")  # a run to resume: the same
    with pytest.raises(RunDirError, match=f"{name} is a link"):
        prepare_run_dir(run, resume=True)


def test_a_link_deep_in_the_runs_folders_is_an_error_naming_it(tmp_path: Any) -> None:
    run, outside = str(tmp_path / "rd"), str(tmp_path / "outside")
    os.makedirs(outside)
    a_run_writes(prepare_run_dir(run))
    os.symlink(outside, os.path.join(run, "roles", "learner.0", "checkpoints"))
    with pytest.raises(RunDirError) as planted:
        prepare_run_dir(run, resume=True)
    assert str(planted.value) == (
        f"{run}/roles/learner.0/checkpoints is a link (to {outside}); a run writes only into "
        "folders it made itself, never through a link: remove the link, or give another "
        "--run-dir"
    )


def test_a_node_folder_may_share_its_hosts_weights_and_nothing_else(tmp_path: Any) -> None:
    """A launch's node folder links its ``weights`` to its host's first node's
    (``asyncrl.supervision.hosts.share``): that link is the run's own; a ``weights`` link
    anywhere else is planted."""
    run = prepare_run_dir(str(tmp_path / "rd"))
    node = prepare_run_dir(os.path.join(run, "node-1"))
    os.makedirs(os.path.join(run, "weights"))
    os.symlink(os.path.join(run, "weights"), os.path.join(node, "weights"))
    assert claim_run_dir(node) == node
    os.unlink(os.path.join(node, "weights"))
    os.symlink(str(tmp_path), os.path.join(node, "weights"))
    with pytest.raises(RunDirError, match=r"node-1/weights is a link \(to "):
        claim_run_dir(node)


def test_a_link_planted_in_the_users_logs_folder_is_an_error_naming_it(tmp_path: Any) -> None:
    """A ``logs/`` of the user's (there before the run) is checked too: a link at the name of
    the janitor's log is refused before anything is written through it."""
    run, outside = str(tmp_path / "rd"), tmp_path / "outside.jsonl"
    outside.write_text("")
    write(os.path.join(run, "logs", "app.log"), "the user's")
    os.symlink(outside, os.path.join(run, "logs", "janitor.log"))
    with pytest.raises(RunDirError) as planted:
        prepare_run_dir(run, allow_nonempty=True)
    assert str(planted.value) == (
        f"{run}/logs/janitor.log is a link (to {outside}); a run writes only into folders it "
        "made itself, never through a link: remove the link, or give another --run-dir"
    )
    assert outside.read_text() == ""


def hold(monkeypatch: pytest.MonkeyPatch, tmp_path: Any, run_dir: str) -> None:
    """A live run's lease on ``run_dir``: this test process is its agent and janitor."""
    folder = str(tmp_path / "leases")
    monkeypatch.setenv(LEASE_DIR_ENV, folder)
    write_lease(lease_path("live", folder), "live", os.getpid(), "/sockets", run_dir)


def test_a_live_run_or_a_folder_that_holds_one_is_refused(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    parent = str(tmp_path / "runs")
    live = os.path.join(parent, "live")
    save_manifest(load_manifest(HELLO), live)
    hold(monkeypatch, tmp_path, live)
    assert cli.main(["run", HELLO, "--run-dir", live, "--overwrite"]) == 2
    assert error(capsys) == (
        f"asyncrl: error: {live} is in use by a running run ('live', agent pid {os.getpid()}); "
        f"stop it first (asyncrl status {live} shows it)\n"
    )
    assert cli.main(["run", "--resume", live]) == 2
    assert "is in use by a running run" in error(capsys)
    with pytest.raises(RunDirError) as refused:
        prepare_run_dir(parent, overwrite=True)
    assert str(refused.value) == (
        f"{parent} is in use by a running run ('live' in {live}, agent pid {os.getpid()}); "
        f"stop it first (asyncrl status {live} shows it)"
    )
    assert sorted(os.listdir(live)) == [RUN_MARKER, "manifest.json"]
    assert prepare_run_dir(os.path.join(live + "-other"), overwrite=True) == live + "-other"


@pytest.mark.parametrize("inside", ["sockets", "sockets/two", "logs", "roles/learner.0"])
def test_a_run_inside_a_live_runs_own_folders_is_refused(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, inside: str
) -> None:
    """A second run could start inside a live run's ``sockets/``: now its socket folder and
    every folder of its own are refused, and a run beside it in a folder of its own is not."""
    live = str(tmp_path / "live")
    save_manifest(load_manifest(HELLO), live)
    folder = str(tmp_path / "leases")
    monkeypatch.setenv(LEASE_DIR_ENV, folder)
    sockets = os.path.join(live, "sockets")
    write_lease(lease_path("live", folder), "live", os.getpid(), sockets, live)
    there = os.path.join(live, inside)
    with pytest.raises(RunDirError) as refused:
        prepare_run_dir(there)
    assert str(refused.value) == (
        f"{there} is inside {os.path.join(live, inside.split('/')[0])}, a folder of a running "
        f"run ('live' in {live}, agent pid {os.getpid()}) that only that run writes; give a "
        "--run-dir outside it"
    )
    assert not os.path.exists(there)
    assert prepare_run_dir(os.path.join(live, "node-1")) == os.path.join(live, "node-1")


def test_launch_takes_the_run_directory_as_asyncrl_run_does(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``asyncrl.launch --overwrite`` refuses a live run's directory; ``--resume`` makes
    an earlier version's run directory private and marks it."""
    from asyncrl.supervision.multinode import _claim, _parser

    old = str(tmp_path / "old")
    os.makedirs(os.path.join(old, "logs"), mode=0o777)
    os.chmod(old, 0o777)
    with open(os.path.join(old, "manifest.json"), "w") as f:
        f.write("{}")
    assert _claim(_parser().parse_args([HELLO, "--resume"]), old, True) == ""
    assert os.stat(old).st_mode & 0o777 == 0o700
    assert os.path.isfile(os.path.join(old, RUN_MARKER))
    hold(monkeypatch, tmp_path, old)
    assert _claim(_parser().parse_args([HELLO, "--overwrite"]), old, True) == (
        f"{old} is in use by a running run ('live', agent pid {os.getpid()}); "
        f"stop it first (asyncrl status {old} shows it)"
    )
    assert sorted(os.listdir(old)) == [RUN_MARKER, "logs", "manifest.json"]


# -- the command line, without processes ---------------------------------------------------


def test_run_refuses_a_used_run_dir(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run = str(tmp_path)
    with open(os.path.join(run, "report.json"), "w") as f:
        f.write("{}")
    assert cli.main(["run", HELLO, "--run-dir", run]) == 2
    assert error(capsys) == (
        f"asyncrl: error: {run} already holds a run (report.json); use 'asyncrl run --resume "
        f"{run}' to continue it or add --overwrite to delete it and start afresh\n"
    )
    assert os.listdir(run) == ["report.json"]  # untouched


def test_run_needs_a_manifest_or_resume(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run"]) == 2
    assert error(capsys) == (
        "asyncrl: error: give a MANIFEST to run, or --resume RUN_DIR to continue a run\n"
    )


def test_resume_refusals(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run = str(tmp_path)
    assert cli.main(["run", "--resume", run]) == 2
    assert "holds no saved manifest (manifest.json)" in error(capsys)
    assert cli.main(["run", "--resume", os.path.join(run, "nope")]) == 2
    assert error(capsys) == (
        f"asyncrl: error: cannot resume {run}/nope: no such directory; check the path\n"
    )
    save_manifest(load_manifest(HELLO, ["roles.splitter.replicas=3"]), run)
    assert cli.main(["run", "--resume", run, "--overwrite"]) == 2
    assert "--resume continues a run and --overwrite deletes it" in error(capsys)
    assert cli.main(["run", "--resume", run, "--set", "run.name=x"]) == 2
    assert error(capsys) == (
        "asyncrl: error: --set cannot change a resumed run; it runs the manifest saved in "
        f"{run}/manifest.json (edit that file to change it)\n"
    )
    assert cli.main(["run", HELLO, "--resume", run]) == 2
    assert error(capsys) == (
        f"asyncrl: error: {HELLO} differs from the manifest {run} was started with (at "
        "roles.splitter.replicas); a resumed run keeps its manifest: drop MANIFEST, or start "
        "a new run with --overwrite\n"
    )
    assert cli.main(["run", "--resume", run, "--run-dir", "/elsewhere"]) == 2
    assert "--run-dir /elsewhere differs from --resume" in error(capsys)


# -- real runs -----------------------------------------------------------------------------


def asyncrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_run_saves_its_manifest_and_resume_runs_it_again(run_dir: str) -> None:
    first = asyncrl("run", HELLO, "--run-dir", run_dir, "--set", "roles.splitter.replicas=3")
    assert first.returncode == 0, first.stdout + first.stderr
    saved = load_saved_manifest(run_dir)
    assert saved.roles["splitter"].replicas == 3
    again = asyncrl("run", HELLO, "--run-dir", run_dir)
    assert again.returncode == 2
    assert f"{run_dir} already holds a run" in again.stderr
    resumed = asyncrl("run", "--resume", run_dir)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    # the --set of the first run holds without being given again
    assert "splitter: 3 replica(s), restarts 0" in resumed.stdout
    assert f"run directory: {run_dir}" in resumed.stdout
    with open(os.path.join(run_dir, "driver.json")) as f:
        assert json.load(f)["finished"] is True


@pytest.mark.slow
def test_overwrite_starts_afresh(run_dir: str) -> None:
    with open(os.path.join(run_dir, "report.json"), "w") as f:
        f.write("{}")  # a run of a version that wrote no marker
    os.makedirs(os.path.join(run_dir, "checkpoints"))
    stale = os.path.join(run_dir, "checkpoints", "step-00000009")
    with open(stale, "w") as f:
        f.write("old")
    out = asyncrl("run", HELLO, "--run-dir", run_dir, "--overwrite")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not os.path.exists(stale)
    with open(os.path.join(run_dir, "driver.json")) as f:
        assert json.load(f)["result"] == [["the", 4], ["dog", 3], ["fox", 3]]
    assert load_saved_manifest(run_dir) == load_manifest(HELLO)


@pytest.mark.slow
def test_a_run_under_umask_000_leaves_nothing_that_others_may_read(run_dir: str) -> None:
    """The run directory and everything the run writes into it is its user's alone."""
    os.rmdir(run_dir)
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", HELLO, "--run-dir", run_dir],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.umask(0),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    shared = []
    for folder, dirs, files in os.walk(run_dir):
        for name in [folder, *(os.path.join(folder, n) for n in dirs + files)]:
            mode = os.lstat(name).st_mode
            if not stat.S_ISLNK(mode) and mode & 0o077:
                shared.append((os.path.relpath(name, run_dir), oct(mode & 0o777)))
    assert shared == []
    assert {"logs", "roles", "specs", "registry", RUN_MARKER} <= set(os.listdir(run_dir))


# -- asyncrl keys generate -------------------------------------------------------------------


def test_keys_generate_writes_private_key_pairs_and_keeps_them(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncrl.transport import load_keys

    directory = str(tmp_path / "keys")
    names = ["server.key", "server.key_secret", "client.key", "client.key_secret"]
    assert cli.main(["keys", "generate", directory]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:4] == [f"wrote {os.path.join(directory, name)}" for name in names]
    assert out[4:] == [
        f"Copy {directory} to the same path on every node of the run, keeping the secret files "
        f"private (rsync -a {directory}/ NODE:{directory}/), and name it in the manifest:",
        "  security:",
        f"    curve_keys: {directory}",
    ]
    assert sorted(os.listdir(directory)) == sorted(names)  # no staging directory left
    modes = {name: os.stat(os.path.join(directory, name)).st_mode & 0o777 for name in names}
    assert modes == {
        "server.key": 0o644,
        "server.key_secret": 0o600,
        "client.key": 0o644,
        "client.key_secret": 0o600,
    }
    assert os.stat(directory).st_mode & 0o777 == 0o700
    keys = load_keys(directory)
    assert keys.server_public != keys.client_public
    assert keys.authorized_clients == frozenset({keys.client_public})

    assert cli.main(["keys", "generate", directory]) == 2
    assert error(capsys) == (
        f"asyncrl: error: {directory} already holds Curve keys (server.key, server.key_secret, "
        "client.key, client.key_secret); add --force to replace them (then copy the directory "
        "to every node again)\n"
    )
    assert load_keys(directory) == keys  # refused: nothing was touched

    assert cli.main(["keys", "generate", directory, "--force"]) == 0
    capsys.readouterr()
    replaced = load_keys(directory)
    assert replaced.server_public != keys.server_public
    assert replaced.client_secret != keys.client_secret


def test_run_refuses_a_manifest_that_places_roles_off_node_0(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = os.path.join(ROOT, "examples", "arith", "multinode.yaml")
    assert cli.main(["run", manifest, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"manifest {manifest} has 3 problems:\n")
    assert (
        "  roles.relay.placement.node: node 1, but 'asyncrl run' runs on one machine (node 0); "
        "launch on several nodes with 'torchrun --nnodes=N ... -m asyncrl.launch MANIFEST'"
    ) in err
    assert not os.path.exists(tmp_path / "run")


def test_run_names_a_node_whose_rollouts_have_no_relay(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = os.path.join(ROOT, "examples", "arith", "multinode3.yaml")
    lead_on_1 = "roles.learner.placement.node=1"
    argv = ["run", manifest, "--run-dir", str(tmp_path / "run"), "--set", lead_on_1]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "  roles.rollout.placement: node 0 runs rollout[0] (weights_from: learner) but neither "
        "learner's replica 0"
    ) in err
    assert "place a relay there (roles.relay0: {class: asyncrl.roles.services.relay:Relay" in err
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.slow
def test_two_real_runs_into_a_results_folder_keep_the_users_files(run_dir: str) -> None:
    """The issue's case end to end: a first run into a results folder (``--allow-nonempty``),
    a second with ``--overwrite``; the user's files stay, the second run's result is there."""
    users = {
        "manifest.yaml": Path(HELLO).read_text(),
        "logs/app.log": "the user's",
        "plots/fig1.png": "the user's",
        "final/paper.pdf": "the user's",
    }
    for name, text in users.items():
        write(os.path.join(run_dir, name), text)
    manifest = os.path.join(run_dir, "manifest.yaml")
    refused = asyncrl("run", manifest, "--run-dir", run_dir)
    assert refused.returncode == 2 and "is not empty" in refused.stderr
    first = asyncrl("run", manifest, "--run-dir", run_dir, "--allow-nonempty")
    assert first.returncode == 0, first.stdout + first.stderr
    again = asyncrl("run", manifest, "--run-dir", run_dir, "--overwrite")
    assert again.returncode == 0, again.stdout + again.stderr
    for name, text in users.items():
        with open(os.path.join(run_dir, name)) as f:
            assert f.read() == text
    with open(os.path.join(run_dir, "driver.json")) as f:
        assert json.load(f)["result"] == [["the", 4], ["dog", 3], ["fox", 3]]
