"""examples/slurm: the sbatch script parses, starts the launch docs/multinode.md describes on every
node of a (fake) Slurm job, and its manifests load for the nodes it runs them on."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess

import pytest

from asyncrl.manifest.load import load_manifest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "slurm", "asyncrl.sbatch")

# Stand-ins for Slurm, torchrun and asyncrl: each writes its arguments, one a line, to a file
# under $CALLS. srun runs its command once per node, with that node's SLURM_NODEID, as Slurm
# runs one task per node.
FAKES = {
    "scontrol": """\
printf '%s\\n' "$@" > "$CALLS/scontrol.$2"
[ "$1 $2" = "show hostnames" ] && printf 'gpu-a17\\ngpu-a18\\n'
[ "$1 $2 $3" = "show node gpu-a17" ] && [ -n "$NODE_ADDR" ] &&
    printf 'NodeName=gpu-a17 Arch=x86_64\\n   NodeAddr=%s NodeHostName=gpu-a17\\n' "$NODE_ADDR"
exit 0
""",
    "srun": """\
printf '%s\\n' "$@" > "$CALLS/srun"
while [ "${1#-}" != "$1" ]; do shift; done
for node in $(seq 0 $((SLURM_NNODES - 1))); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" || exit
done
""",
    "torchrun": 'printf \'%s\\n\' "$@" > "$CALLS/torchrun.$SLURM_NODEID"\n',
    "asyncrl": """\
printf '%s\\n' "$@" > "$CALLS/asyncrl"
mkdir -p "$3" && touch "$3/server.key_secret"
""",
}


def _fake_venv(tmp_path: str) -> str:
    """A virtual environment whose activation puts the fakes first on PATH."""
    bin_dir = os.path.join(tmp_path, "venv", "bin")
    os.makedirs(bin_dir)
    for name, body in FAKES.items():
        path = os.path.join(bin_dir, name)
        with open(path, "w") as f:
            f.write("#!/bin/sh\n" + body)
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    with open(os.path.join(bin_dir, "activate"), "w") as f:
        f.write(f'PATH="{bin_dir}:$PATH"; export PATH\n')
    return os.path.dirname(bin_dir)


def _submit(tmp_path: str, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    calls = os.path.join(tmp_path, "calls")
    os.makedirs(calls)
    environ = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "CALLS": calls,
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu-a[17-18]",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "0",
        "SLURM_SUBMIT_DIR": ROOT,
        "SLURM_CPUS_PER_TASK": "16",
        "VENV": _fake_venv(tmp_path),
        **env,
    }
    done = subprocess.run(
        ["bash", SCRIPT, *args], env=environ, capture_output=True, text=True, timeout=30
    )
    return done, calls


def _lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def test_the_script_parses() -> None:
    done = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_each_node_starts_torchrun_with_its_rank_and_the_first_host_as_master(
    tmp_path: str,
) -> None:
    run_dir = os.path.join(tmp_path, "run")
    done, calls = _submit(tmp_path, "--set", "run.config.rl_steps=5", RUN_DIR=run_dir)
    assert done.returncode == 0, done.stderr
    assert _lines(os.path.join(calls, "scontrol.hostnames")) == [
        "show",
        "hostnames",
        "gpu-a[17-18]",
    ]
    # The first node's address as Slurm knows it (NodeAddr); without one, its name.
    assert _lines(os.path.join(calls, "scontrol.node")) == ["show", "node", "gpu-a17"]
    assert _lines(os.path.join(calls, "srun"))[:4] == [
        "--nodes=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "--label",
    ]
    # The keys are made once, beside the run directory, before any node starts.
    assert _lines(os.path.join(calls, "asyncrl")) == ["keys", "generate", f"{run_dir}.keys"]
    for node in (0, 1):
        assert _lines(os.path.join(calls, f"torchrun.{node}")) == [
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node}",
            "--master-addr=gpu-a17",
            "--master-port=24242",
            "--max-restarts=3",
            "-m",
            "asyncrl.launch",
            "examples/slurm/qwen.yaml",
            "--run-dir",
            run_dir,
            "--set",
            f"security.curve_keys={run_dir}.keys",
            "--set",
            "run.config.rl_steps=5",
        ]
    assert "asyncrl: 2 nodes (gpu-a[17-18]), store on gpu-a17:24242" in done.stdout


def test_the_variables_override_the_defaults(tmp_path: str) -> None:
    done, calls = _submit(
        tmp_path,
        "--resume",
        MANIFEST="examples/arith/multinode.yaml",
        RUN_DIR="runs/mn",
        CURVE_KEYS="",
        NETWORK_ADDRESS="ib0",
        MASTER_PORT="29500",
        MAX_RESTARTS="7",
        NODE_ADDR="10.1.0.17",
    )
    assert done.returncode == 0, done.stderr
    assert not os.path.exists(os.path.join(calls, "asyncrl"))  # no keys made
    assert _lines(os.path.join(calls, "torchrun.1")) == [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--node-rank=1",
        "--master-addr=10.1.0.17",  # the first node's NodeAddr
        "--master-port=29500",
        "--max-restarts=7",
        "-m",
        "asyncrl.launch",
        "examples/arith/multinode.yaml",
        "--run-dir",
        os.path.join(ROOT, "runs", "mn"),  # relative to ASYNCRL_ROOT, made absolute
        "--set",
        "network.address=ib0",
        "--resume",
    ]


def _torchrun_launch(calls: str, node: int) -> list[str]:
    """What node ``node``'s torchrun runs after ``-m asyncrl.launch MANIFEST``."""
    args = _lines(os.path.join(calls, f"torchrun.{node}"))
    return args[args.index("asyncrl.launch") + 2 :]


def test_the_script_asks_slurm_to_requeue_the_job_and_append_its_output() -> None:
    with open(SCRIPT) as f:
        directives = re.findall(r"^#SBATCH (\S+)$", f.read(), re.M)
    assert "--requeue" in directives
    assert "--open-mode=append" in directives


def test_a_requeued_job_resumes_the_run_its_first_try_started(tmp_path: str) -> None:
    run_dir = os.path.join(tmp_path, "run")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "manifest.json"), "w") as f:
        f.write("{}")
    done, calls = _submit(
        tmp_path,
        "--overwrite",
        "--set",
        "run.config.rl_steps=5",
        RUN_DIR=run_dir,
        SLURM_RESTART_COUNT="2",
    )
    assert done.returncode == 0, done.stderr
    for node in (0, 1):
        # --overwrite would delete what the first try trained; --resume continues it.
        assert _torchrun_launch(calls, node) == [
            "--run-dir",
            run_dir,
            "--set",
            f"security.curve_keys={run_dir}.keys",
            "--set",
            "run.config.rl_steps=5",
            "--resume",
        ]
    assert f"asyncrl: job 4242 requeued (2), resuming the run in {run_dir}" in done.stdout


def test_a_job_requeued_before_its_run_saved_a_manifest_starts_it(tmp_path: str) -> None:
    run_dir = os.path.join(tmp_path, "run")  # the first try never got as far as the manifest
    done, calls = _submit(
        tmp_path, "--set", "run.config.rl_steps=5", RUN_DIR=run_dir, SLURM_RESTART_COUNT="1"
    )
    assert done.returncode == 0, done.stderr
    assert _torchrun_launch(calls, 1) == [
        "--run-dir",
        run_dir,
        "--set",
        f"security.curve_keys={run_dir}.keys",
        "--set",
        "run.config.rl_steps=5",
    ]
    assert "resuming the run" not in done.stdout


def test_outside_slurm_the_script_says_so(tmp_path: str) -> None:
    done = subprocess.run(
        ["bash", SCRIPT],
        env={"PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode != 0
    assert "run this script with sbatch" in done.stderr


def _default_manifest() -> str:
    with open(SCRIPT) as f:
        (path,) = re.findall(r"^MANIFEST=\$\{MANIFEST:-(.+)\}$", f.read(), re.M)
    return path


def test_the_default_manifest_is_the_qwen_job_over_two_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)  # where the script starts the run
    path = _default_manifest()
    manifest = load_manifest(path, ["security.curve_keys=/keys"], nodes=2)
    assert manifest.roles["rollout"].placement.node == 1
    assert manifest.roles["relay"].placement.node == 1
    assert manifest.roles["learner"].placement.nodes == [0, 1]
    # It is examples/qwen/bc_grpo.yaml but for its placements: the two cannot drift apart.
    spread = load_manifest(
        "examples/qwen/bc_grpo.yaml",
        [
            "run.name=qwen-multinode",
            "run.config.relays=[relay]",
            "roles.rollout.replicas=2",
            "roles.rollout.placement={node: 1}",
            "roles.relay={class: 'asyncrl.roles.services.relay:Relay', placement: {node: 1}, "
            "config: {source: learner}}",
            "roles.learner.replicas=2",
            "roles.learner.placement={nodes: [0, 1]}",
            "roles.learner.supervision={strategy: one_for_all}",
            "security.curve_keys=/keys",
        ],
        nodes=2,
    )
    assert manifest == spread


def test_the_gpu_recipe_in_the_readme_loads_for_two_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)
    with open(os.path.join(ROOT, "examples", "slurm", "README.md")) as f:
        blocks = re.findall(r"```sh\n(.*?)```", f.read(), re.S)
    (command,) = [b for b in blocks if "run.plugin=cuda" in b]
    words = shlex.split(command.replace("\\\n", " "))
    assert words[:3] == ["sbatch", "--nodes=2", "--gpus-per-node=2"]
    overrides = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    manifest = load_manifest(_default_manifest(), overrides, nodes=2)
    assert manifest.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert manifest.roles["rollout"].placement.device == "cuda:1"
    assert manifest.roles["learner"].placement.device == "cuda:0"
    assert manifest.roles["learner"].placement.nodes == [0, 1]
