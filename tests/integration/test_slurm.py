"""examples/slurm/asyncrl.sbatch under a real Slurm on this machine.

The fixture starts a one-machine cluster in a temporary folder: munged, slurmctld and one slurmd
per node name (n1 to n5: Slurm's multiple-slurmd form, each slurmd on its own port, every node on
this host at 127.0.0.1). Two jobs of the main job (examples/slurm/qwen.yaml), shortened, are
submitted together so that they overlap; the tests wait on each job's state with a deadline and
read its run's summary.json. One runs undisturbed on n1 and n2. The other loses its node rank 1
(n4) mid-run as Slurm sees a lost node (``scontrol update state=down``): Slurm requeues the job,
runs it again on two of the nodes left, and the script resumes the run.

Slurm comes from Debian's packages (``apt-get install -y slurm-wlm munge``; .ci/run installs them);
without them, or without root (slurmd starts jobs as their user), the tests skip saying so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.helpers.waiting import wait_until

# Each run starts 7 replicas over 2 nodes and stops them (about 140 s a run on a loaded 2-core
# machine); the requeued job runs twice, overlapping the other.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = os.path.join(ROOT, "examples", "slurm", "asyncrl.sbatch")
NODES = ("n1", "n2", "n3", "n4", "n5")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
INSTALL = "apt-get install -y slurm-wlm munge"
SHORT = [
    "run.config.bc_max_steps=10",
    "run.config.bc_eval_every=10",
    "run.config.rl_steps=12",
    "run.config.rl_eval_every=12",
    "run.config.prompts_per_step=4",
    "run.config.group_size=4",
]
STEPS = 22
"""Learner steps of the shortened job: 10 of BC, 12 of GRPO."""
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin")


def _missing() -> str:
    """Why the cluster cannot start here, or ""."""
    for name in DAEMONS:
        if _which(name) is None:
            return f"{name} is not installed: {INSTALL} (Debian's packages) to run this test"
    if os.geteuid() != 0:
        return "needs root: slurmd starts each job as its user and the daemons run as root here"
    return ""


class Cluster:
    """munged, slurmctld and one slurmd per node name, configured in ``self.dir``."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.host = socket.gethostname().split(".")[0]
        self.conf = os.path.join(directory, "slurm.conf")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
        self.env["SLURM_CONF"] = self.conf
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.jobs: list[str] = []

    def write_config(self) -> None:
        munge = os.path.join(self.dir, "munge")
        os.makedirs(munge, mode=0o700)
        with open(os.path.join(munge, "key"), "wb", opener=_private) as f:
            f.write(os.urandom(1024))
        for node in NODES:
            os.makedirs(os.path.join(self.dir, "spool", node))
        os.makedirs(os.path.join(self.dir, "state"))
        d = self.dir
        lines = [
            "ClusterName=asyncrltest",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={munge}/socket",
            "CredType=cred/munge",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdLogFile={d}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SelectType=select/linear",
            # A node taken down stays down: the requeued job must run on the others.
            "ReturnToService=0",
            "KillWait=5",
            "MinJobAge=600",
            "InactiveLimit=0",
        ]
        for node in NODES:
            lines.append(
                f"NodeName={node} NodeHostname={self.host} NodeAddr=127.0.0.1 "
                f"Port={_free_port()} CPUs=1 State=UNKNOWN"
            )
        lines.append(f"PartitionName=debug Nodes={','.join(NODES)} Default=YES State=UP")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def start(self) -> None:
        munge = os.path.join(self.dir, "munge")
        self._spawn(
            "munged",
            "--foreground",
            "--force",  # its socket's folder is private to root, which munged would refuse
            f"--key-file={munge}/key",
            f"--socket={munge}/socket",
            f"--pid-file={munge}/pid",
            f"--log-file={munge}/log",
            f"--seed-file={munge}/seed",
        )
        wait_until(
            lambda: os.path.exists(os.path.join(munge, "socket")),
            timeout=30,
            what="munged's socket",
            output=lambda: self.logs(),
        )
        self._spawn("slurmctld", "-D", "-i", "-f", self.conf)
        for node in NODES:
            self._spawn("slurmd", "-D", "-f", self.conf, "-N", node)
        wait_until(
            lambda: self.node_states() == {node: "idle" for node in NODES},
            timeout=60,
            what=f"nodes {', '.join(NODES)} idle",
            output=lambda: f"{self.node_states()}\n{self.logs()}",
        )

    def _spawn(self, name: str, *args: str) -> None:
        log = open(os.path.join(self.dir, f"{name}.out"), "ab")  # noqa: SIM115 (kept by the child)
        with log:
            self.daemons.append(
                subprocess.Popen(
                    [_which(name) or name, *args],
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )

    def slurm(self, *args: str) -> str:
        """Run a Slurm command; its output."""
        done = subprocess.run(
            [_which(args[0]) or args[0], *args[1:]],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"{' '.join(args)}: {done.stderr}"
        return done.stdout

    def node_states(self) -> dict[str, str]:
        try:
            out = self.slurm("sinfo", "-h", "-N", "-o", "%N %t")
        except AssertionError:
            return {}
        return dict(line.split() for line in out.splitlines() if line.strip())

    def submit(self, run_dir: str, master_port: int, *args: str) -> str:
        env = {
            **self.env,
            "PATH": os.path.dirname(sys.executable) + os.pathsep + self.env["PATH"],
            "VENV": "",
            "RUN_DIR": run_dir,
            "MASTER_PORT": str(master_port),
        }
        done = subprocess.run(
            [
                _which("sbatch") or "sbatch",
                "--parsable",
                f"--output={self.dir}/job-%j.out",
                SCRIPT,
                *args,
            ],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        job = done.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job(self, job: str) -> dict[str, str]:
        """The job's fields as ``scontrol show job`` prints them (JobState, Restarts, NodeList)."""
        out = self.slurm("scontrol", "show", "job", "-o", job)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def output(self, job: str) -> str:
        return _read(os.path.join(self.dir, f"job-{job}.out"))

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n{_read(os.path.join(self.dir, name))[-3000:]}"
            for name in sorted(os.listdir(self.dir))
            if name.endswith((".log", ".out"))
        )

    def stop(self) -> None:
        """Cancel every job, wait until Slurm has ended them, then stop the daemons."""
        if self.jobs:
            subprocess.run(
                [_which("scancel") or "scancel", *self.jobs],
                env=self.env,
                capture_output=True,
                timeout=60,
            )

            def ended() -> bool:
                try:
                    return not self.slurm("squeue", "-h", "-o", "%i").strip()
                except AssertionError:
                    return True

            try:
                wait_until(ended, timeout=60, what="the cancelled jobs to end")
            finally:
                self._stop_daemons()
        else:
            self._stop_daemons()

    def _stop_daemons(self) -> None:
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.daemons):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=20)


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    why = _missing()
    if why:
        pytest.skip(why)
    # Short: munged's socket path must fit a unix socket address.
    directory = tempfile.mkdtemp(prefix="slurm-")
    c = Cluster(directory)
    try:
        c.write_config()
        c.start()
        yield c
    finally:
        try:
            c.stop()
        finally:
            shutil.rmtree(directory, ignore_errors=True)


def _sets() -> list[str]:
    return [a for s in SHORT for a in ("--set", s)]


def _wait_ended(cluster: Cluster, job: str, timeout: float) -> dict[str, str]:
    wait_until(
        lambda: cluster.job(job)["JobState"] in ENDED,
        timeout=timeout,
        what=f"job {job} to end",
        output=lambda: f"{cluster.job(job)}\n{cluster.output(job)}\n{cluster.logs()}",
        interval=0.5,
    )
    return cluster.job(job)


def _check_completed(cluster: Cluster, job: str, fields: dict[str, str], run_dir: str) -> None:
    told = cluster.output(job)
    assert fields["JobState"] == "COMPLETED", f"{fields}\n{told}"
    assert fields["ExitCode"] == "0:0", told
    assert "run completed: the control-flow program finished" in told
    summary = _json(os.path.join(run_dir, "summary.json"))
    assert summary is not None, told
    assert summary["learner_steps"] == STEPS
    assert summary["phases"]["rl"]["end"] == STEPS
    assert summary["nodes"] == 2
    assert _json(os.path.join(run_dir, "report.json"))["status"] == "completed"


class Jobs:
    """The two runs, submitted together so that they overlap: ``done`` on n1 and n2 runs
    undisturbed; ``lost`` on n3 and n4 loses n4 mid-run. n5 is spare."""

    def __init__(self, cluster: Cluster) -> None:
        self.done_dir = os.path.join(cluster.dir, "done")
        self.done = cluster.submit(self.done_dir, _free_port(), *_sets())
        self.lost_dir = os.path.join(cluster.dir, "lost")
        self.lost = cluster.submit(self.lost_dir, _free_port(), *_sets())


@pytest.fixture(scope="module")
def jobs(cluster: Cluster) -> Jobs:
    return Jobs(cluster)


def test_a_lost_node_requeues_the_job_which_resumes_the_run(cluster: Cluster, jobs: Jobs) -> None:
    job, run_dir = jobs.lost, jobs.lost_dir
    history = os.path.join(run_dir, "history.jsonl")
    # Mid-run: past BC, into GRPO.
    wait_until(
        lambda: '"phase": "rl"' in _read(history),
        timeout=300,
        what="the run's first GRPO step",
        output=lambda: f"{cluster.job(job)}\n{cluster.output(job)}",
        interval=0.5,
    )
    first = cluster.job(job)
    assert (first["JobState"], first["NodeList"]) == ("RUNNING", "n[3-4]")
    lost = "n4"  # node rank 1
    cluster.slurm("scontrol", "update", f"nodename={lost}", "state=down", "reason=lost")
    # Slurm holds a requeued job for 2 minutes (its begin time); let it start at once.
    wait_until(
        lambda: cluster.job(job)["Restarts"] == "1" and cluster.job(job)["JobState"] == "PENDING",
        timeout=120,
        what=f"job {job} requeued after {lost} went down",
        output=lambda: f"{cluster.job(job)}\n{cluster.output(job)}\n{cluster.logs()}",
        interval=0.5,
    )
    cluster.slurm("scontrol", "update", f"jobid={job}", "starttime=now")
    fields = _wait_ended(cluster, job, timeout=400)
    _check_completed(cluster, job, fields, run_dir)
    assert fields["Restarts"] == "1"
    # On two of the nodes left: n3 and n5, or n1 and n2 once the other job has ended.
    again = cluster.slurm("scontrol", "show", "hostnames", fields["NodeList"]).split()
    assert len(again) == 2 and lost not in again, again
    told = cluster.output(job)
    resumed = f"asyncrl: job {job} requeued (1), resuming the run in {run_dir}"
    assert resumed in told
    # BC ended before the loss; the resumed run goes on in GRPO instead of starting over.
    assert "BC plateau: held-out" in told.split(resumed)[0]
    assert "BC plateau: held-out" not in told.split(resumed)[1], told
    assert cluster.node_states()[lost] == "down"


def test_a_submitted_job_runs_the_main_job_over_two_nodes(cluster: Cluster, jobs: Jobs) -> None:
    job, run_dir = jobs.done, jobs.done_dir
    fields = _wait_ended(cluster, job, timeout=400)
    _check_completed(cluster, job, fields, run_dir)
    assert fields["Restarts"] == "0"
    assert fields["NodeList"] == "n[1-2]"
    told = cluster.output(job)
    assert "asyncrl: 2 nodes (n[1-2]), store on 127.0.0.1:" in told
    assert "resuming the run" not in told
