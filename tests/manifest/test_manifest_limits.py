"""Manifests that cannot blow up: the limits of counts, names and environments, where they sit
exactly, that the names derived from the longest allowed ones fit, and that ``asyncrl run``
refuses a manifest over a limit at once, starting nothing and leaving nothing behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from asyncrl.manifest.limits import (
    MAX_ENV_STRING,
    MAX_ENV_TOTAL,
    MAX_REPLICAS,
    MAX_ROLE_NAME,
    MAX_RUN_NAME,
)
from asyncrl.manifest.load import ManifestError, parse_manifest
from asyncrl.transport.registry import LocalRegistry
from asyncrl.transport.shm import segment_name
from asyncrl.transport.sockets import IPC_PATH_MAX
from tests.conftest import ROOT

CORPUS = os.path.join(ROOT, "tests", "manifests", "broken")


def manifest(run: str = "demo", role: str = "learner", extra: str = "") -> str:
    return f"run: {{name: {run}, program: flow}}\nroles:\n  {role}: {{class: a:B{extra}}}\n"


def problems(text: str) -> list[str]:
    with pytest.raises(ManifestError) as info:
        parse_manifest(text)
    return info.value.problems


def test_each_count_is_accepted_up_to_its_limit_and_refused_past_it() -> None:
    assert parse_manifest(manifest(extra=f", replicas: {MAX_REPLICAS}")).roles["learner"]
    assert problems(manifest(extra=f", replicas: {MAX_REPLICAS + 1}")) == [
        f"roles.learner.replicas: expected an integer <= {MAX_REPLICAS}, got {MAX_REPLICAS + 1}; "
        "that is over the limit (see Limits in docs/manifest.md)"
    ]
    assert problems(manifest(extra=", supervision: {period_s: .nan}")) == [
        "roles.learner.supervision.period_s: expected a number > 0 and <= 604800, got nan"
    ]


def test_names_are_accepted_up_to_their_limits() -> None:
    longest = parse_manifest(manifest("r" * MAX_RUN_NAME, "n" * MAX_ROLE_NAME))
    assert longest.run.name == "r" * MAX_RUN_NAME
    assert problems(manifest("r" * (MAX_RUN_NAME + 1)))[0].startswith(
        f"run.name: {MAX_RUN_NAME + 1} characters, over the {MAX_RUN_NAME}"
    )
    assert problems(manifest(role="n" * (MAX_ROLE_NAME + 1)))[0].startswith(
        f"roles.{'n' * (MAX_ROLE_NAME + 1)}: the role name has {MAX_ROLE_NAME + 1} characters"
    )


def test_the_longest_run_name_makes_shared_memory_names_that_fit() -> None:
    name = segment_name("r" * MAX_RUN_NAME, pid=4_194_304, incarnation=10**12, seq=10**15)
    assert len(name.encode()) <= 255  # NAME_MAX


def test_the_longest_role_name_makes_socket_paths_that_fit() -> None:
    # The longest run directory whose sockets stay inside it (the registry moves them to a
    # short folder under the system's temporary directory past that), and one longer.
    base = tempfile.mkdtemp(prefix="arl-", dir="/tmp")
    try:
        run_dir = os.path.join(base, "d" * (IPC_PATH_MAX - 40 - len("/sockets") - len(base) - 1))
        for where, inside in ((run_dir, True), (run_dir + "d", False)):
            registry = LocalRegistry(where)
            assert (registry.socket_dir == os.path.join(where, "sockets")) is inside
            endpoint = registry.endpoint("n" * MAX_ROLE_NAME, MAX_REPLICAS - 1)
            assert len(endpoint.removeprefix("ipc://")) <= IPC_PATH_MAX
            shutil.rmtree(registry.socket_dir)
    finally:
        shutil.rmtree(base)


def test_an_environment_string_is_accepted_up_to_linux_limit() -> None:
    value = "x" * (MAX_ENV_STRING - len("BIG=") - 1)  # and its final NUL
    env = f"run: {{name: demo, program: flow, env: {{BIG: {value}}}}}\nroles: {{r: {{class: a:B}}}}"
    assert parse_manifest(env).run.env["BIG"] == value
    assert problems(env.replace("BIG: ", "BIG: y")) == [
        f"run.env.BIG: the variable has {MAX_ENV_STRING:,} bytes (BIG=value), over the "
        f"{MAX_ENV_STRING - 1:,} Linux allows one environment string (MAX_ARG_STRLEN, 128 KiB); "
        "pass a value this large by file: write it to a file and give its path, or put it in "
        "the role's config, which reaches the role by file"
    ]


def test_an_environment_too_large_together_is_refused_for_each_process_it_reaches() -> None:
    value = "x" * (MAX_ENV_STRING // 2)
    count = MAX_ENV_TOTAL // len(value) + 1
    env = ", ".join(f"V{i}: {value}" for i in range(count))
    text = f"run: {{name: demo, program: flow, env: {{{env}}}}}\nroles: {{r: {{class: a:B}}}}"
    total = sum(len(f"V{i}={value}") + 1 for i in range(count))
    found = problems(text)
    assert [p.partition(":")[0] for p in found] == ["driver", "roles.r"]
    assert found[1] == (
        "roles.r: the environment and arguments the manifest gives the process (run.env, "
        f"roles.r.env) have {total:,} bytes together, over the 1,048,576 allowed (Linux bounds "
        "a process's environment and arguments together, and it also inherits the agent's "
        "environment); pass large values by file"
    )


def test_weights_from_a_role_that_publishes_is_accepted() -> None:
    text = (
        "run: {name: demo, program: flow}\nroles:\n  learner: {class: a:B}\n"
        "  relay: {class: a:B, config: {weights_from: learner}}\n"
        "  rollout: {class: a:B, config: {weights_from: relay}}\n"
        "  plain: {class: a:B, config: {weights_from: ''}}\n"
    )
    assert list(parse_manifest(text).roles) == ["learner", "relay", "rollout", "plain"]


@pytest.mark.parametrize(
    "case", ["yaml_alias_bomb", "counts_over_limits", "reserved_role_names", "env_too_large"]
)
def test_asyncrl_run_refuses_it_at_once_and_leaves_nothing(case: str, tmp_path: object) -> None:
    run_dir = os.path.join(str(tmp_path), "run")
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", f"{case}.yaml", "--run-dir", run_dir],
        cwd=CORPUS,
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - start
    with open(os.path.join(CORPUS, f"{case}.expected"), encoding="utf-8") as f:
        expected = f.read()
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.replace(CORPUS, "{cwd}") == expected
    assert not os.path.exists(run_dir)
    assert took < 30  # the alias bomb once took the whole machine; it is 0.5 s unloaded


def overrides_of(case: str) -> list[str]:
    """The ``--set`` overrides a corpus case is loaded with (its ``# --set`` lines)."""
    with open(os.path.join(CORPUS, f"{case}.yaml"), encoding="utf-8") as f:
        return [line.removeprefix("# --set ").rstrip("\n") for line in f if line[:8] == "# --set "]


def test_a_set_key_path_is_accepted_up_to_the_depth_limit_and_refused_past_it() -> None:
    at_limit = ".".join(["k"] * 61)  # roles.r.config and 61 more: 64 parts
    loaded = parse_manifest(manifest(role="r"), overrides=[f"roles.r.config.{at_limit}=1"])
    config: object = loaded.roles["r"].config
    for _ in range(61):
        assert isinstance(config, dict)
        config = config["k"]
    assert config == 1
    with pytest.raises(ManifestError) as info:
        parse_manifest(manifest(role="r"), overrides=[f"roles.r.config.{at_limit}.k=1"])
    assert info.value.problems == [
        f"--set roles.r.config.{at_limit}.k=1: the key path has 65 parts, which nests its value "
        "deeper than the 64 levels of lists and mappings a manifest may have; set a key at most "
        "64 deep, or pass deep data by file"
    ]


@pytest.mark.parametrize("form", ["key path", "value", "file"])
def test_nesting_3000_deep_is_refused_with_a_message_never_a_recursion_error(form: str) -> None:
    text, overrides = manifest(role="r"), []
    if form == "key path":
        overrides = ["run.config." + ".".join(["d"] * 3000) + "=1"]
    elif form == "value":
        overrides = ["run.config.d=" + "[" * 3000 + "]" * 3000]
    else:
        text += "    config: {d: " + "[" * 3000 + "]" * 3000 + "}\n"
        text = text.replace("B}\n", "B,\n", 1).replace("r: {", "r:\n    {", 1)
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, overrides=overrides)
    (problem,) = info.value.problems
    if form == "key path":
        shown = overrides[0][:1000]
        assert problem == (
            f"--set {shown}... (6,012 characters): the key path has 3,002 parts, which nests its "
            "value deeper than the 64 levels of lists and mappings a manifest may have; set a "
            "key at most 64 deep, or pass deep data by file"
        )
    else:
        assert problem.endswith(
            "lists and mappings nested more than 64 deep (aliases expanded); flatten the value, "
            "or pass deep data by file"
        )


def test_twelve_set_values_under_the_limit_alone_are_refused_together() -> None:
    bombs = overrides_of("set_twelve_alias_bombs")
    assert len(bombs) == 12
    for bomb in bombs:  # each alone is accepted, ~1.1 MB as expanded
        parse_manifest(manifest(), overrides=[bomb])
    parse_manifest(manifest(), overrides=bombs[:3])  # 3.4 MB together: still under
    with pytest.raises(ManifestError) as info:
        parse_manifest(manifest(), overrides=bombs)
    (problem,) = info.value.problems
    assert problem.startswith(
        "(top level): the manifest with its 12 --set overrides applied expands to 13,495,066 "
        "bytes, over the 4,194,304 a manifest may have"
    )
    # An override that replaces a large value makes the manifest smaller, not larger.
    replaced = [bomb.replace("run.config.x", "run.config.x0.y", 1) for bomb in bombs[1:]]
    with pytest.raises(ManifestError):  # into the list run.config.x0: not a mapping
        parse_manifest(manifest(), overrides=bombs[:1] + replaced)
    same_key = [bomb.replace(bomb.partition("=")[0], "run.config.x") for bomb in bombs]
    assert len(parse_manifest(manifest(), overrides=same_key).run.config["x"]) == 4


@pytest.mark.parametrize("case", ["set_twelve_alias_bombs", "set_key_path_too_deep"])
def test_asyncrl_run_refuses_set_overrides_over_the_limits(case: str, tmp_path: object) -> None:
    run_dir = os.path.join(str(tmp_path), "run")
    sets = [arg for override in overrides_of(case) for arg in ("--set", override)]
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "run", f"{case}.yaml", "--run-dir", run_dir, *sets],
        cwd=CORPUS,
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - start
    with open(os.path.join(CORPUS, f"{case}.expected"), encoding="utf-8") as f:
        expected = f.read()
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == expected
    assert not os.path.exists(run_dir)
    assert took < 30  # 0.6 s unloaded


def test_asyncrl_run_refuses_a_set_key_path_3000_deep_without_a_traceback(tmp_path: object) -> None:
    run_dir = os.path.join(str(tmp_path), "run")
    key = "run.config." + ".".join(["d"] * 3000)
    command = ["run", "set_key_path_too_deep.yaml", "--run-dir", run_dir, "--set", f"{key}=1"]
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", *command],
        cwd=CORPUS,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == (
        "manifest set_key_path_too_deep.yaml has 1 problem:\n"
        f"  --set {key[:1000]}... (6,012 characters): the key path has 3,002 parts, which nests "
        "its value deeper than the 64 levels of lists and mappings a manifest may have; set a "
        "key at most 64 deep, or pass deep data by file\n"
    )
    assert not os.path.exists(run_dir)
