"""Recovery of the stateful processes, end to end on the arithmetic example (shortened).

- A program that raises fails the run once, with its traceback; it is never restarted.
- A program that cannot be imported is a configuration error (exit 78), not a crash.
- SIGKILL of the driver in the middle of RL: the program resumes at the learner's step, and
  nothing is trained twice or skipped.
- The learner killed inside a checkpoint write and after a durable step but before its reply:
  the run completes, no step is repeated or lost, and no sample is consumed twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT
from tests.helpers.records import records
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SHORT = {
    "bc_max_steps": 60,
    "bc_eval_every": 30,
    "rl_steps": 24,
    "rl_eval_every": 12,
    "prompts_per_step": 8,
    "group_size": 4,
}
BATCH = SHORT["prompts_per_step"] * SHORT["group_size"]
FAST = {"backoff_initial_s": 0.05, "backoff_max_s": 0.5, "max_restarts": 10, "period_s": 60}


def arith_manifest(
    run_dir: str,
    *,
    learner_env: dict[str, str] | None = None,
    mode: str = "sync",
    learner_config: dict[str, Any] | None = None,
) -> str:
    with open(os.path.join(ROOT, "examples/arith/bc_grpo.yaml")) as f:
        manifest = yaml.safe_load(f)
    manifest["run"]["config"].update(SHORT)
    manifest["pipeline"]["mode"] = mode
    for role in manifest["roles"].values():
        role["supervision"] = dict(FAST)
    manifest["driver"] = {"supervision": dict(FAST)}
    if learner_env:
        manifest["roles"]["learner"]["env"] = learner_env
    manifest["roles"]["learner"]["config"].update(learner_config or {})
    path = os.path.join(run_dir, "arith.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(manifest, f)
    return path


_STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_run_outlives_its_test() -> Iterator[None]:
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()  # the agent's janitor takes its processes with it
            proc.communicate()


def start(manifest: str, run_dir: str, *extra: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "run",
            manifest,
            "--run-dir",
            run_dir,
            "--allow-nonempty",
            *extra,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "ASYNCRL_CONSOLE": "0"},
    )
    _STARTED.append(proc)
    return proc


def finish(proc: subprocess.Popen[str], timeout: float = 600) -> str:
    """Wait for the run; return its console, and on failure the end of every process's
    stderr, so that a failure explains itself."""
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        run_dir = proc.args[proc.args.index("--run-dir") + 1] if "--run-dir" in proc.args else ""
        logs = os.path.join(str(run_dir), "logs")
        for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
            if name.endswith(".stderr"):
                with open(os.path.join(logs, name), errors="replace") as f:
                    out += f"\n--- {name} ---\n" + "".join(f.readlines()[-30:])
    return out


def steps(run_dir: str) -> list[dict[str, Any]]:
    return records(os.path.join(run_dir, "ledger", "learner.0.steps.jsonl"))


def read_json(run_dir: str, name: str) -> dict[str, Any]:
    with open(os.path.join(run_dir, name)) as f:
        result: dict[str, Any] = json.load(f)
    return result


def agent_events(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "logs", "agent.jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_exact(run_dir: str) -> dict[str, Any]:
    """Every learner step once, in order; no sample id consumed twice; the RL phase consumed
    exactly rl_steps full batches; return the summary."""
    log = steps(run_dir)
    numbers = [r["step"] for r in log]
    assert numbers == list(range(1, len(numbers) + 1)), numbers
    ids = [tuple(i) for r in log for i in r["ids"]]
    assert len(ids) == len(set(ids)), "a sample was consumed twice"
    rl = [r for r in log if r["phase"] == "rl"]
    assert len(rl) == SHORT["rl_steps"]
    assert all(len(r["ids"]) == BATCH for r in rl)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary: dict[str, Any] = json.load(f)
    assert summary["learner_steps"] == len(log)
    assert summary["samples_consumed"] == SHORT["rl_steps"] * BATCH
    pipe = summary["pipeline"]
    lost = (
        pipe["admitted_samples"]
        - pipe["consumed_samples"]
        - pipe.get("wasted_samples", 0)
        - pipe["in_flight_at_end"]
    )
    assert lost == 0, pipe
    with open(os.path.join(run_dir, "history.jsonl")) as f:
        history = [json.loads(line) for line in f]
    assert [h["step"] for h in history if h["phase"] == "rl"] == list(
        range(1, SHORT["rl_steps"] + 1)
    )
    return summary


def test_a_program_error_fails_the_run_once(run_dir: str) -> None:
    with open(os.path.join(run_dir, "flow.py"), "w") as f:
        f.write(
            textwrap.dedent(
                """
                async def main(ctx):
                    raise RuntimeError("the program's own bug")
                """
            )
        )
    manifest = os.path.join(run_dir, "m.yaml")
    with open(manifest, "w") as f:
        f.write(
            textwrap.dedent(
                f"""
                run: {{name: progerr, program: {run_dir}/flow.py:main}}
                roles:
                  echo:
                    class: asyncrl.roles.services.prompts:PromptSource
                    config: {{generator: examples.arith.data:rl_prompts,
                              tokenizer_path: examples/arith/tokenizer}}
                """
            )
        )
    proc = start(manifest, run_dir)
    out = finish(proc, 120)
    assert proc.returncode == 1, out
    assert "run failed: the control-flow program raised (or the run stalled)" in out
    assert "RuntimeError: the program's own bug" in out
    report = read_json(run_dir, "report.json")
    assert report["status"] == "failed"
    assert report["restarts"].get("driver", 0) == 0
    driver = read_json(run_dir, "driver.json")
    assert driver["finished"] is False and "the program's own bug" in driver["error"]


def test_a_program_that_does_not_import_is_a_configuration_error(run_dir: str) -> None:
    manifest = os.path.join(run_dir, "m.yaml")
    with open(manifest, "w") as f:
        f.write(
            textwrap.dedent(
                """
                run: {name: noprog, program: "nosuchpkg.flow:main"}
                roles:
                  prompts:
                    class: asyncrl.roles.services.prompts:PromptSource
                    config: {generator: examples.arith.data:rl_prompts,
                             tokenizer_path: examples/arith/tokenizer}
                """
            )
        )
    proc = start(manifest, run_dir)
    out = finish(proc, 120)
    assert proc.returncode == 1, out
    report = read_json(run_dir, "report.json")
    assert report["reason"] == "driver[0] has a configuration error"
    assert report["failure"]["code"] == 78
    assert report["restarts"].get("driver", 0) == 0
    assert any("nosuchpkg" in line for line in report["failure"]["stderr_tail"])


def _driver_pid(run_dir: str) -> int:
    started = [
        e for e in agent_events(run_dir) if e["event"] == "started" and e["process"] == "driver[0]"
    ]
    return int(started[-1]["pid"])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_driver_killed_mid_rl_resumes_without_replaying(run_dir: str, mode: str) -> None:
    """In async mode groups past the cursor may have been consumed already: the resumed
    pipeline skips them rather than generating and consuming them again."""
    proc = start(arith_manifest(run_dir, mode=mode), run_dir)
    bc_steps = SHORT["bc_max_steps"]
    wait_until(
        lambda: len(steps(run_dir)) >= bc_steps + 5, proc=proc, what="RL step 5", timeout=300
    )
    os.kill(_driver_pid(run_dir), signal.SIGKILL)
    out = finish(proc)
    assert proc.returncode == 0, out
    summary = assert_exact(run_dir)
    assert summary["driver_incarnation"] == 1
    report = read_json(run_dir, "report.json")
    assert report["restarts"]["driver"] == 1
    # The resumed program did not run BC again: the learner took exactly bc + rl steps.
    assert summary["learner_steps"] == bc_steps + SHORT["rl_steps"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_learner_killed_in_a_checkpoint_write_and_before_a_reply(run_dir: str, mode: str) -> None:
    """In async mode the rollouts keep generating, within the staleness bound, while the
    learner is away."""
    faults = {
        # incarnation 0 dies writing its 20th checkpoint (half written, not renamed), so
        # that step was never acknowledged and is trained again; incarnation 1 dies after
        # its 30th durable step, before replying, and the re-sent batch gets that step back.
        "kill_at": {"point": "checkpoint_write", "every": 20, "incarnations": 1},
        "kill_before_reply": {"method": "train_step", "every": 30, "incarnations": 2},
    }
    manifest = arith_manifest(
        run_dir,
        learner_env={"ASYNCRL_FAULTS": json.dumps(faults)},
        mode=mode,
        learner_config={"durable": "checkpoint"},
    )
    proc = start(manifest, run_dir)
    out = finish(proc)
    assert proc.returncode == 0, out
    summary = assert_exact(run_dir)
    report = read_json(run_dir, "report.json")
    assert report["restarts"]["learner"] == 2
    assert report["restarts"].get("driver", 0) == 0
    assert summary["learner_steps"] == SHORT["bc_max_steps"] + SHORT["rl_steps"]
    # Incarnation 1 resumed from step 19, the checkpoint before the torn one; its log says so.
    with open(os.path.join(run_dir, "logs", "learner.0.jsonl")) as f:
        cut = [json.loads(line) for line in f if "step log: cut" in line]
    assert cut and "restored step 19" in cut[0]["event"]


@pytest.mark.parametrize(
    "point",
    [
        # During an asynchronous save (its files written, no marker yet): the step was
        # acknowledged long before, and the log replays it and those after it.
        "checkpoint_write",
        # The step trained, nothing logged: never acknowledged, so trained again once.
        "mid_step",
    ],
)
def test_learner_with_a_write_ahead_log_killed_anywhere_loses_nothing(
    run_dir: str, point: str
) -> None:
    """``durable: wal`` (the default): a learner killed in its 3rd save (or 20th step), then
    again after logging its 30th step but before replying, resumes from its newest complete
    checkpoint plus the logged steps: every step once, no sample lost or counted twice."""
    faults = {
        "kill_at": {"point": point, "every": 3 if point == "checkpoint_write" else 20},
        "kill_before_reply": {"method": "train_step", "every": 30, "incarnations": 2},
    }
    manifest = arith_manifest(
        run_dir,
        learner_env={"ASYNCRL_FAULTS": json.dumps(faults)},
        learner_config={"durable": "wal", "checkpoint_every": 7},
    )
    proc = start(manifest, run_dir)
    out = finish(proc)
    assert proc.returncode == 0, out
    summary = assert_exact(run_dir)
    report = read_json(run_dir, "report.json")
    assert report["restarts"]["learner"] == 2
    assert summary["learner_steps"] == SHORT["bc_max_steps"] + SHORT["rl_steps"]
    with open(os.path.join(run_dir, "logs", "learner.0.jsonl")) as f:
        replays = [json.loads(line)["event"] for line in f if "replayed" in line]
    assert replays, "a restarted learner replayed no logged step"


def test_a_run_that_stops_progressing_fails_saying_on_what_it_waits(run_dir: str) -> None:
    with open(os.path.join(run_dir, "flow.py"), "w") as f:
        f.write(
            textwrap.dedent(
                """
                import asyncio

                async def main(ctx):
                    await ctx.roles["prompts"].call("take", {"cursor": 0, "n": 1})
                    await asyncio.Event().wait()  # a bug: waits on nothing that will happen
                """
            )
        )
    manifest = os.path.join(run_dir, "m.yaml")
    with open(manifest, "w") as f:
        f.write(
            textwrap.dedent(
                f"""
                run: {{name: stall, program: {run_dir}/flow.py:main}}
                pipeline: {{stall_timeout_s: 2}}
                roles:
                  prompts:
                    class: asyncrl.roles.services.prompts:PromptSource
                    config: {{generator: examples.arith.data:rl_prompts,
                              tokenizer_path: examples/arith/tokenizer}}
                """
            )
        )
    proc = start(manifest, run_dir)
    out = finish(proc, 120)
    assert proc.returncode == 1, out
    report = read_json(run_dir, "report.json")
    assert report["status"] == "failed" and report["restarts"].get("driver", 0) == 0
    assert any("the run stalled: no progress for" in x for x in report["failure"]["stderr_tail"])
    assert "no progress for" in read_json(run_dir, "driver.json")["error"]


STOPPABLE = """
import asyncio
import os


async def main(ctx):
    if ctx.incarnation == 0:
        open(os.path.join(ctx.run_dir, "ready"), "w").close()
        await asyncio.Event().wait()
    return "resumed"
"""


def test_a_stopped_driver_never_reads_as_success(run_dir: str) -> None:
    """A STOP from a peer without the run's control secret is refused; a SIGTERM from outside
    stops the driver before its program finished, which is a crash to restart, never a
    completed run."""
    import msgspec
    import zmq

    with open(os.path.join(run_dir, "flow.py"), "w") as f:
        f.write(STOPPABLE)
    manifest = os.path.join(run_dir, "m.yaml")
    with open(manifest, "w") as f:
        f.write(
            textwrap.dedent(
                f"""
                run: {{name: stopped, program: {run_dir}/flow.py:main}}
                driver: {{supervision: {json.dumps(FAST)}}}
                roles:
                  prompts:
                    class: asyncrl.roles.services.prompts:PromptSource
                    config: {{generator: examples.arith.data:rl_prompts,
                              tokenizer_path: examples/arith/tokenizer}}
                """
            )
        )
    proc = start(manifest, run_dir)
    wait_until(
        lambda: os.path.exists(os.path.join(run_dir, "ready")),
        proc=proc,
        what="the program",
        timeout=60,
    )
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.connect(f"ipc://{run_dir}/sockets/driver.0")
        dealer.send(msgspec.msgpack.encode([1, 9]))  # a bare STOP, from no supervisor
        driver_log = os.path.join(run_dir, "logs", "driver.0.jsonl")

        def refused() -> bool:
            with open(driver_log) as f:
                return "refused STOP" in f.read()

        wait_until(refused, proc=proc, what="the driver to refuse the STOP", timeout=30)
    finally:
        dealer.close(linger=0)
        context.term()
    os.kill(_driver_pid(run_dir), signal.SIGTERM)
    out = finish(proc, 120)
    assert proc.returncode == 0, out
    report = read_json(run_dir, "report.json")
    assert report["status"] == "completed"
    assert report["restarts"]["driver"] == 1
    assert report["exits"][0]["code"] == 75  # stopped before it finished: EXIT_STOPPED
    driver = read_json(run_dir, "driver.json")
    assert driver["finished"] is True and driver["result"] == "resumed"


def test_a_killed_run_resumes_with_resume(run_dir: str) -> None:
    """SIGKILL of `asyncrl run` itself in the middle of RL (the janitor takes every process
    with it); `asyncrl run --resume` finishes the run with every step once."""
    proc = start(arith_manifest(run_dir), run_dir)
    bc_steps = SHORT["bc_max_steps"]
    wait_until(
        lambda: len(steps(run_dir)) >= bc_steps + 5, proc=proc, what="RL step 5", timeout=300
    )
    proc.kill()
    proc.communicate()
    resumed = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "run", "--resume", run_dir],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "ASYNCRL_CONSOLE": "0"},
    )
    _STARTED.append(resumed)
    out = finish(resumed)
    assert resumed.returncode == 0, out
    summary = assert_exact(run_dir)
    assert summary["learner_steps"] == bc_steps + SHORT["rl_steps"]
