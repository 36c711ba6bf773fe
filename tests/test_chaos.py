"""``asyncrl chaos`` without processes: durations, role checks, budgets, the draw of targets, and
the accounting over hand-written run files."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from asyncrl import cli
from asyncrl.chaos.accounting import (
    account,
    format_accounting,
    ledger_figures,
    percentile,
    read_steps,
    recoveries,
    run_figures,
)
from asyncrl.chaos.campaign import (
    ChaosPlan,
    Disruptor,
    aim_figures,
    budget_overrides,
    budgets,
    check_roles,
    format_aim,
    parse_duration,
    phase_began,
)
from asyncrl.manifest.load import parse_manifest
from asyncrl.supervision.supervisor import ProcessInfo

MANIFEST = """
run: {name: t, program: "p:main"}
roles:
  rollout: {class: "m:R", replicas: 2}
  reward: {class: "m:W"}
  learner: {class: "m:L", supervision: {max_restarts: 3, period_s: 30}}
"""


def write(path: str, data: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        if isinstance(data, list):
            f.writelines(
                (line if isinstance(line, str) else json.dumps(line)) + "\n" for line in data
            )
        else:
            json.dump(data, f)


def step(n: int, ids: list[list[Any]], phase: str = "rl", incarnation: int = 0) -> dict[str, Any]:
    return {
        "step": n,
        "version": n,
        "ids": ids,
        "skipped": 0,
        "incarnation": incarnation,
        "phase": phase,
    }


# -- durations, roles, budgets -------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("5s", 5.0), ("500ms", 0.5), ("2m", 120.0), ("1.5h", 5400.0), (" .25s ", 0.25)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["5", "s", "5 sec", "-1s", "1e3s", ""])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="write a number with a unit \\(ms, s, m or h\\)"):
        parse_duration(text)


def test_parse_duration_refuses_zero() -> None:
    with pytest.raises(ValueError, match="'0s'; it must be longer than 0"):
        parse_duration("0s")


def test_check_roles() -> None:
    manifest = parse_manifest(MANIFEST)
    assert check_roles(manifest, ["reward", "driver", "reward", " rollout"]) == [
        "reward",
        "driver",
        "rollout",
    ]
    with pytest.raises(ValueError) as exc:
        check_roles(manifest, ["rollout", "critic", "prompts"])
    assert str(exc.value) == (
        "--roles names 'critic', 'prompts', not in the manifest; "
        "choose among rollout, reward, learner, driver"
    )
    with pytest.raises(ValueError, match="--roles names no role"):
        check_roles(manifest, ["", " "])


def test_budgets_fit_the_schedule_and_user_sets_win() -> None:
    plain = parse_manifest(MANIFEST)
    plan = ChaosPlan(roles=("learner", "driver"), kill_every=5.0, stop_every=10.0)
    overrides = budget_overrides(plain, plan)
    assert overrides == [
        # learner: period 30 s, a kill every 5 s (6) and a freeze every 10 s (3), plus slack 5
        "roles.learner.supervision.max_restarts=14",
        "roles.learner.supervision.backoff_initial_s=0.05",
        "roles.learner.supervision.backoff_max_s=1.0",
        # driver: the default period of 60 s: 12 + 6 + 5
        "driver.supervision.max_restarts=23",
        "driver.supervision.backoff_initial_s=0.05",
        "driver.supervision.backoff_max_s=1.0",
    ]
    manifest = parse_manifest(
        MANIFEST, overrides=[*overrides, "roles.learner.supervision.max_restarts=99"]
    )
    assert budgets(manifest, plan.roles) == {
        "learner": {
            "max_restarts": 99,
            "period_s": 30.0,
            "backoff_initial_s": 0.05,
            "backoff_max_s": 1.0,
        },
        "driver": {
            "max_restarts": 23,
            "period_s": 60.0,
            "backoff_initial_s": 0.05,
            "backoff_max_s": 1.0,
        },
    }
    assert manifest.roles["rollout"].supervision.max_restarts == 5  # not targeted: untouched


# -- the draw ------------------------------------------------------------------------------


def proc(role: str, replica: int, pid: int, *, alive: bool = True, serving: bool = True) -> Any:
    return ProcessInfo(role, replica, "role", 0, pid, alive, serving)


def test_draw_takes_only_live_serving_targets_of_the_named_roles() -> None:
    table = [
        proc("rollout", 0, 101, serving=False),
        proc("rollout", 1, 102, alive=False),
        proc("reward", 0, 103),
        proc("learner", 0, 104),
        ProcessInfo("driver", 0, "driver", 0, 105, True, True),
    ]

    async def main() -> list[str]:
        chaos = Disruptor(ChaosPlan(roles=("rollout", "reward")), lambda: table)
        return [(await chaos._draw()).label for _ in range(20)]

    assert set(asyncio.run(main())) == {"reward[0]"}


def test_draw_is_seeded() -> None:
    table = [proc("rollout", i, 100 + i) for i in range(8)]

    async def draws(seed: int) -> list[int]:
        chaos = Disruptor(ChaosPlan(roles=("rollout",), seed=seed), lambda: table)
        return [(await chaos._draw()).replica for _ in range(30)]

    assert asyncio.run(draws(3)) == asyncio.run(draws(3))
    assert asyncio.run(draws(3)) != asyncio.run(draws(4))


def test_draw_waits_while_no_target_serves_and_while_the_run_ends() -> None:
    table = [proc("rollout", 0, 101, serving=False)]

    async def main() -> str:
        chaos = Disruptor(ChaosPlan(roles=("rollout",)), lambda: table)
        chaos.observe("exited", "driver[0]", 0)  # the program finished: the run is ending
        draw = asyncio.create_task(chaos._draw())
        await asyncio.sleep(0)
        table[0] = proc("rollout", 0, 101)
        chaos.observe("serving", "rollout[0]", 1)
        await asyncio.sleep(0)
        assert not draw.done()  # serving, but the run is ending
        chaos.observe("serving", "driver[0]", 1)  # a restarted driver: chaos resumes
        return str((await draw).label)

    assert asyncio.run(main()) == "rollout[0]"


def test_kill_and_freeze_real_processes() -> None:
    """SIGKILL and SIGSTOP/SIGCONT reach a real process, and each is recorded once."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:

        async def main() -> Disruptor:
            table = [proc("rollout", 0, sleeper.pid), proc("reward", 0, stopped.pid)]
            chaos = Disruptor(ChaosPlan(roles=("rollout", "reward"), stop_for=0.01), lambda: table)
            await chaos._kill(table[0])
            await chaos._freeze(table[1])
            return chaos

        chaos = asyncio.run(main())
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
        assert [k["label"] for k in chaos.kills] == ["rollout[0]"]
        assert [(s["label"], s["continued"]) for s in chaos.stops] == [("reward[0]", True)]
        with open(f"/proc/{stopped.pid}/stat") as f:
            assert f.read().split(") ")[1][0] in "SR"  # running again, not T (stopped)
    finally:
        for p in (sleeper, stopped):
            p.kill()
            p.wait()


def test_phase_began_waits_for_a_complete_line_of_the_phase(tmp_path: Any) -> None:
    """No history file, then a BC entry, then half a line of RL, then the whole line: it
    returns on the read after the whole line, and not before."""
    path = os.path.join(tmp_path, "history.jsonl")
    steps = [
        '{"phase": "bc", "step": 0, "accuracy": 0.1}\n',
        '{"phase": "rl", "st',
        'ep": 1, "reward": 0.5}\n',
    ]
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        assert len(waits) < len(steps), "still waiting after the phase's line was complete"
        with open(path, "a") as f:
            f.write(steps[len(waits)])
        waits.append(seconds)

    asyncio.run(phase_began(str(tmp_path), "rl", poll_s=0.5, sleep=sleep))
    assert waits == [0.5, 0.5, 0.5]


def test_a_plan_aimed_at_a_phase_disrupts_nothing_before_it(tmp_path: Any) -> None:
    """``from_phase`` and ``after``: the schedule starts ``after`` once the phase's first
    entry is in the history, and ``aimed_at_s`` says when; until then no process is hit."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    path = os.path.join(tmp_path, "history.jsonl")
    try:

        async def main() -> Disruptor:
            table = [proc("rollout", 0, sleeper.pid)]
            plan = ChaosPlan(roles=("rollout",), kill_every=0.01, from_phase="rl", after=0.05)
            killed = asyncio.Event()

            def say(text: str) -> None:
                if "SIGKILL" in text:
                    killed.set()

            chaos = Disruptor(plan, lambda: table, say, run_dir=str(tmp_path))
            task = asyncio.create_task(chaos.run())
            await asyncio.sleep(0.5)  # two reads of a history without the phase
            assert (chaos.kills, chaos.aimed_at_s, sleeper.poll()) == ([], None, None)
            with open(path, "w") as f:
                f.write('{"phase": "rl", "step": 1}\n')
            began = chaos.now()
            await asyncio.wait_for(killed.wait(), 30)
            task.cancel()
            assert chaos.aimed_at_s is not None and chaos.aimed_at_s >= began + 0.05
            assert chaos.kills[0]["t"] >= chaos.aimed_at_s + 0.01
            return chaos

        chaos = asyncio.run(main())
        assert [k["label"] for k in chaos.kills] == ["rollout[0]"]
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()


# -- the accounting ------------------------------------------------------------------------


def test_ledger_figures_count_repeats_gaps_and_duplicates() -> None:
    steps = {
        "learner.0": [
            step(1, [["bc-a#0", 0], ["bc-b#0", 0]], phase="bc"),
            step(2, [["p1", 0], ["p1", 1]]),
            step(3, [["p2", 0]]),
            # the learner restarted from its step-2 checkpoint and trained step 3 again
            step(3, [["p2", 0]], incarnation=1),
            step(5, [["p3", 0], ["p1", 1]], incarnation=1),  # step 4 never happened
        ]
    }
    assert ledger_figures(steps) == {
        "learner_steps": 5,
        "step_records": 5,
        "bad_lines": 0,
        "steps_repeated": 1,
        "steps_skipped": 1,
        "duplicates_consumed": 2,  # p2#0 and p1#1
        "duplicate_consumptions": 2,
        "ids_consumed": 6,
        "ids_consumed_rl": 4,
    }


def test_ledger_figures_across_replicas_and_without_phases() -> None:
    steps = {
        "learner.0": [step(1, [["a", 0]], phase=""), step(2, [["b", 0]], phase="")],
        "learner.1": [step(1, [["c", 0]], phase=""), step(2, [["a", 0]], phase="")],
    }
    figures = ledger_figures(steps)
    assert figures["steps_repeated"] == 0  # the same step numbers on two replicas are not repeats
    assert figures["duplicates_consumed"] == 1  # but one id trained by both is a duplicate
    assert figures["ids_consumed"] == 3
    assert figures["ids_consumed_rl"] is None


def test_ledger_figures_count_a_data_parallel_groups_step_once() -> None:
    """The ranks of a data-parallel learner each record every step of the group, on one node
    or in node folders: the same ids in the same step number are one consumption. An id in
    two steps, or twice in one step, is still a duplicate."""
    steps = {
        "learner.0": [step(1, [["a", 0], ["b", 0]]), step(2, [["c", 0], ["a", 0]])],
        "node-1/learner.1": [step(1, [["a", 0], ["b", 0]]), step(2, [["c", 0], ["a", 0]])],
        "critic.0": [step(1, [["d", 0], ["d", 0]])],
    }
    figures = ledger_figures(steps)
    assert figures["steps_repeated"] == 0
    assert figures["duplicates_consumed"] == 2  # a#0 in steps 1 and 2; d#0 twice in one step
    assert figures["duplicate_consumptions"] == 2
    assert figures["ids_consumed"] == 4


def test_read_steps_skips_a_partial_last_line(tmp_path: Any) -> None:
    path = os.path.join(tmp_path, "ledger", "learner.0.steps.jsonl")
    write(path, [step(1, [["a", 0]]), step(2, [["b", 0]]), '{"step": 3, "ids": [["c"'])
    steps = read_steps(str(tmp_path))
    assert steps is not None
    assert [r["step"] for r in steps["learner.0"]] == [1, 2]
    assert steps[""] == [{"bad_line": 3, "file": "learner.0.steps.jsonl"}]
    assert read_steps(os.path.join(tmp_path, "nowhere")) is None


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(n) for n in range(1, 101)], 99) == 99.0
    assert percentile([5.0], 99) == 5.0


def test_recoveries_time_exit_to_next_serving() -> None:
    chaos = {
        "events": [
            {"t": 1.0, "kind": "serving", "label": "rollout[0]", "incarnation": 0},
            {"t": 2.0, "kind": "exited", "label": "rollout[0]", "incarnation": 0},
            {"t": 2.5, "kind": "serving", "label": "rollout[0]", "incarnation": 1},
            {"t": 3.0, "kind": "exited", "label": "reward[0]", "incarnation": 0},
            {"t": 4.5, "kind": "serving", "label": "reward[0]", "incarnation": 1},
            {"t": 5.0, "kind": "exited", "label": "reward[0]", "incarnation": 1},
        ]
    }
    report = {
        "exits": [
            {"role": "rollout", "replica": 0, "incarnation": 0},
            {"role": "reward", "replica": 0, "incarnation": 0},
            {"role": "reward", "replica": 0, "incarnation": 1},  # never served again
        ]
    }
    out = recoveries(chaos, report)
    assert out["recoveries"] == 2
    assert out["unrecovered"] == 1
    assert out["recover_ms_p50"] == 500.0
    assert out["recover_ms_max"] == 1500.0
    assert out["recover_ms_by_role"] == {
        "reward": {"n": 1, "p50": 1500.0, "p99": 1500.0, "max": 1500.0},
        "rollout": {"n": 1, "p50": 500.0, "p99": 500.0, "max": 500.0},
    }


def test_a_failure_still_restarting_when_the_run_ended_is_counted_apart() -> None:
    """reward[0]'s last failure came in the run's last moments: the supervisor reports it
    still restarting. rollout[0]'s first failure never recovered, though the process is also
    restarting at the end (after a second failure): only its last failure is cut short."""
    chaos = {
        "events": [
            {"t": 1.0, "kind": "exited", "label": "rollout[0]", "incarnation": 0},
            {"t": 2.0, "kind": "exited", "label": "rollout[0]", "incarnation": 1},
            {"t": 3.0, "kind": "exited", "label": "reward[0]", "incarnation": 0},
            {"t": 3.5, "kind": "serving", "label": "reward[0]", "incarnation": 1},
            {"t": 4.0, "kind": "exited", "label": "reward[0]", "incarnation": 1},
        ]
    }
    exits = [("rollout", 0), ("rollout", 1), ("reward", 0), ("reward", 1)]
    report = {
        "exits": [{"role": r, "replica": 0, "incarnation": n} for r, n in exits],
        "restarting": ["rollout[0]", "reward[0]", "prompts[0]"],
    }
    out = recoveries(chaos, report)
    assert (out["recoveries"], out["unrecovered"], out["restarting_at_end"]) == (1, 1, 2)
    report["restarting"] = []
    out = recoveries(chaos, report)
    assert (out["recoveries"], out["unrecovered"], out["restarting_at_end"]) == (1, 3, 0)


def make_run(
    run_dir: str,
    *,
    accuracy: float,
    wall_s: float,
    pipeline: dict[str, int] | None,
    steps: list[Any] | None,
    kills: int = 0,
) -> None:
    write(
        os.path.join(run_dir, "report.json"),
        {
            "status": "completed",
            "reason": "the control-flow program finished",
            "restarts": {"rollout": kills},
            "exits": [{"role": "rollout", "replica": 0, "incarnation": n} for n in range(kills)],
        },
    )
    events = []
    for n in range(kills):
        events += [
            {"t": 10.0 * n, "kind": "exited", "label": "rollout[0]", "incarnation": n},
            {
                "t": 10.0 * n + 0.2 * (n + 1),
                "kind": "serving",
                "label": "rollout[0]",
                "incarnation": n + 1,
            },
        ]
    write(
        os.path.join(run_dir, "chaos.json"),
        {
            "wall_s": wall_s,
            "program_s": wall_s - 2.0,  # the shutdown took 2 s
            "kills": [{"role": "rollout", "label": "rollout[0]"}] * kills,
            "stops": [],
            "events": events,
        },
    )
    summary: dict[str, Any] = {
        "accuracy_final": accuracy,
        "learner_steps": 4,
        "samples_consumed": 6,
    }
    if pipeline is not None:
        summary["pipeline"] = pipeline
    write(os.path.join(run_dir, "summary.json"), summary)
    write(
        os.path.join(run_dir, "driver.json"),
        {
            "finished": True,
            "dispatch": {"rollout": {"served": {"0": 5, "1": 4}, "retries": kills}},
        },
    )
    if steps is not None:
        write(os.path.join(run_dir, "ledger", "learner.0.steps.jsonl"), steps)


PIPELINE = {
    "admitted_groups": 4,
    "admitted_samples": 8,
    "generated_samples": 9,
    "consumed_samples": 6,
    "wasted_samples": 1,
    "in_flight_at_end": 0,
}
STEPS = [
    step(1, [["d#1", 0]], phase="bc"),
    step(2, [["p0", 0], ["p0", 1]]),
    step(3, [["p1", 0], ["p1", 1]]),
    step(4, [["p2", 0], ["p2", 1]]),
]


def test_account_of_a_clean_chaos_run(tmp_path: Any) -> None:
    make_run(
        os.path.join(tmp_path, "undisturbed"),
        accuracy=0.9,
        wall_s=10.0,
        pipeline=PIPELINE,
        steps=STEPS,
    )
    make_run(
        os.path.join(tmp_path, "chaos"),
        accuracy=0.85,
        wall_s=15.0,
        pipeline=PIPELINE,
        steps=STEPS,
        kills=3,
    )
    acc = account(os.path.join(tmp_path, "chaos"), os.path.join(tmp_path, "undisturbed"))
    assert acc["completed"] is True
    assert acc["kills"] == {"total": 3, "rollout": 3}
    assert acc["restarts"] == {"rollout": 3}
    assert acc["samples_lost"] == 1  # 8 admitted - 6 consumed - 1 wasted - 0 in flight
    assert acc["duplicates_consumed"] == 0
    assert acc["steps_repeated"] == 0
    assert acc["steps_skipped"] == 0
    assert acc["recover_ms_p50"] == pytest.approx(400.0)
    assert acc["recover_ms_max"] == pytest.approx(600.0)
    assert acc["samples_consumed"] == 6
    assert acc["samples_consumed_ledger"] == 6
    assert acc["consistent"] is True
    assert acc["accuracy_undisturbed"] == 0.9
    assert acc["accuracy_chaos"] == 0.85
    assert acc["accuracy_delta"] == pytest.approx(-0.05)
    assert acc["slowdown"] == 13.0 / 8.0  # of the program time, not of the wall time
    assert (acc["wall_s_chaos"], acc["wall_s_undisturbed"]) == (15.0, 10.0)
    assert acc["prompts_admitted"] == 4
    assert acc["samples_generated"] == 9
    assert acc["samples_scored"] is None
    assert acc["unknown"]["samples_scored"] == "summary.json's pipeline has no scored_samples"
    assert acc["dispatch"] == {"rollout": {"served": 9, "retries": 3}}
    assert acc["undisturbed"]["completed"] is True
    json.dumps(acc)  # --json prints it as is


def test_account_of_a_damaged_run(tmp_path: Any) -> None:
    damaged = [
        *STEPS[:3],
        step(3, [["p1", 0], ["p1", 1]], incarnation=1),
        step(5, [["p3", 0], ["p3", 1]]),
    ]
    make_run(
        os.path.join(tmp_path, "chaos"),
        accuracy=0.5,
        wall_s=15.0,
        pipeline=PIPELINE,
        steps=damaged,
        kills=1,
    )
    acc = account(os.path.join(tmp_path, "chaos"), None)
    assert acc["steps_repeated"] == 1
    assert acc["steps_skipped"] == 1
    assert acc["duplicates_consumed"] == 2
    assert acc["samples_consumed_ledger"] == 6  # distinct rl ids: p0, p1, p3 x 2
    assert acc["consistent"] is True
    assert acc["accuracy_undisturbed"] is None
    assert acc["slowdown"] is None
    assert acc["unknown"]["undisturbed"] == "no undisturbed run (--no-baseline)"


def test_missing_files_are_unknown_never_zero(tmp_path: Any) -> None:
    pipeline = {k: v for k, v in PIPELINE.items() if k != "in_flight_at_end"}
    make_run(
        os.path.join(tmp_path, "chaos"), accuracy=0.5, wall_s=1.0, pipeline=pipeline, steps=None
    )
    acc = account(os.path.join(tmp_path, "chaos"), None)
    for key in (
        "samples_lost",
        "duplicates_consumed",
        "steps_repeated",
        "steps_skipped",
        "consistent",
    ):
        assert acc[key] is None, key
    assert acc["learner_steps"] == 4  # from summary.json, since there is no step log
    assert acc["unknown"]["ledger"] == ("no ledger/*.steps.jsonl (the learner kept no step log)")
    assert "in_flight_at_end" in acc["unknown"]["samples_lost"]
    empty = run_figures(os.path.join(tmp_path, "nothing"))
    assert empty["completed"] is None
    assert empty["kills"] is None
    assert empty["accuracy"] is None
    assert empty["recover_ms_p50"] is None
    text = format_accounting(account(os.path.join(tmp_path, "nothing"), None))
    assert "samples lost                    unknown" in text
    assert "chaos run completed             unknown" in text


def test_the_accounting_says_where_the_disruption_was_aimed(tmp_path: Any) -> None:
    """chaos.json's plan and ``aimed_at_s`` give the aim's figures; a phase that never began
    is named as the reason nothing was disrupted."""
    path = os.path.join(tmp_path, "chaos.json")
    write(path, {"plan": {"from_phase": "rl", "after": 2.0}, "aimed_at_s": 7.5})
    figures = aim_figures(str(tmp_path))
    assert figures == {"from_phase": "rl", "after_s": 2.0, "disrupted_from_s": 7.5}
    assert format_aim(figures) == "disruption aimed at 2 s after phase rl: began at 7.5 s"
    write(path, {"plan": {"from_phase": "grpo", "after": 0.0}, "aimed_at_s": None})
    figures = aim_figures(str(tmp_path))
    assert figures["not_disrupted"] == (
        "phase grpo never began before the schedule started: nothing was disrupted"
    )
    assert format_aim(figures) == (
        "disruption aimed at phase grpo: phase grpo never began before the schedule started: "
        "nothing was disrupted"
    )
    write(path, {"plan": {"from_phase": None, "after": 0.0}, "aimed_at_s": 0.0})
    assert format_aim(aim_figures(str(tmp_path))) == (
        "disruption aimed at the run's start: began at 0.0 s"
    )


def test_inconsistent_counts_are_flagged(tmp_path: Any) -> None:
    pipeline = {**PIPELINE, "consumed_samples": 8, "wasted_samples": 0}
    make_run(
        os.path.join(tmp_path, "chaos"), accuracy=0.5, wall_s=1.0, pipeline=pipeline, steps=STEPS
    )
    acc = account(os.path.join(tmp_path, "chaos"), None)
    assert (acc["samples_consumed"], acc["samples_consumed_ledger"]) == (8, 6)
    assert acc["consistent"] is False
    assert acc["samples_lost"] == 0


# -- the command line ----------------------------------------------------------------------


def chaos_cli(tmp_path: Any, *args: str) -> int:
    path = os.path.join(tmp_path, "m.yaml")
    with open(path, "w") as f:
        f.write(MANIFEST)
    return cli.main(["chaos", path, "--run-dir", os.path.join(tmp_path, "run"), *args])


def test_chaos_refuses_unknown_roles(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert chaos_cli(tmp_path, "--roles", "rollout,critic") == 2
    assert capsys.readouterr().err == (
        "asyncrl: error: --roles names 'critic', not in the manifest; "
        "choose among rollout, reward, learner, driver\n"
    )


def test_chaos_refuses_a_bad_duration(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        chaos_cli(tmp_path, "--kill-every", "5")
    assert exc.value.code == 2
    assert (
        "argument --kill-every: not a duration: '5'; write a number with a unit (ms, s, m or h)"
        in capsys.readouterr().err
    )


def test_chaos_refuses_a_used_run_dir(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    write(os.path.join(tmp_path, "run", "chaos", "report.json"), {"status": "completed"})
    assert chaos_cli(tmp_path, "--no-baseline") == 2
    err = capsys.readouterr().err
    run = os.path.join(tmp_path, "run", "chaos")
    assert err.endswith(
        f"asyncrl: error: {run} already holds a run (report.json); "
        "add --overwrite to delete it and start afresh\n"
    )
    # by default every role and the driver are hit; each gets a budget for a kill every 5 s
    assert "chaos: SIGKILL every 5 s, among the replicas of rollout, reward, learner, driver" in err
    assert "  rollout: 17 restarts in 60 s, backoff 0.05 s doubling to 1 s" in err
    assert "  learner: 11 restarts in 30 s, backoff 0.05 s doubling to 1 s" in err
    assert "  driver: 17 restarts in 60 s, backoff 0.05 s doubling to 1 s" in err


def test_chaos_needs_something_to_do(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert chaos_cli(tmp_path, "--kill-every", "off") == 2
    assert capsys.readouterr().err == (
        "asyncrl: error: nothing to do: give --kill-every or --stop-every\n"
    )


def test_chaos_on_named_roles_raises_only_their_budgets(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    write(os.path.join(tmp_path, "run", "chaos", "report.json"), {"status": "completed"})
    args = ["--no-baseline", "--roles", "reward", "--kill-every", "10s", "--stop-every", "20s"]
    assert chaos_cli(tmp_path, *args) == 2
    err = capsys.readouterr().err
    assert (
        "chaos: SIGKILL every 10 s, SIGSTOP for 5 s every 20 s, among the replicas of reward" in err
    )
    assert "  reward: 14 restarts in 60 s" in err  # 6 kills + 3 freezes + 5
    assert "rollout:" not in err


def test_pipeline_counters_left_out_at_zero_count_as_zero(tmp_path: Any) -> None:
    """The pipeline's metrics are a Counter: a counter never incremented is absent, not unknown;
    ``in_flight_at_end`` is no counter, so its absence stays unknown."""
    pipeline = {k: v for k, v in PIPELINE.items() if k != "wasted_samples"}
    make_run(
        os.path.join(tmp_path, "chaos"), accuracy=0.5, wall_s=1.0, pipeline=pipeline, steps=STEPS
    )
    acc = account(os.path.join(tmp_path, "chaos"), None)
    assert acc["samples_wasted"] == 0
    assert acc["samples_lost"] == 2
    del pipeline["in_flight_at_end"]
    make_run(
        os.path.join(tmp_path, "chaos"), accuracy=0.5, wall_s=1.0, pipeline=pipeline, steps=STEPS
    )
    acc = account(os.path.join(tmp_path, "chaos"), None)
    assert acc["in_flight_at_end"] is None
    assert acc["samples_lost"] is None


def test_an_episode_run_reports_episodes_lost_counted_twice_and_env_tokens_trained(
    tmp_path: Any,
) -> None:
    run_dir = os.path.join(tmp_path, "episodes")
    episodes = {
        **PIPELINE,
        "wasted_samples": 2,
        "episodes": 9,
        "episode_restarts": 3,
        "infra_failed": 2,
        "quarantined": 3,
        "quarantine_released": 1,
        "quarantine_restarts": 2,
    }
    steps = [*STEPS, step(5, [["p2", 1], ["p3", 0]])]  # p2/1 trained a second time
    make_run(run_dir, accuracy=0.5, wall_s=5.0, pipeline=episodes, steps=steps, kills=2)
    lines = [
        {"step": 1, "learner": {"env_tokens_trained": 0.0, "infra_failed_trained": 0.0}},
        "a torn line",
        {"step": 2, "learner": {"env_tokens_trained": 4.0, "infra_failed_trained": 1.0}},
        {"step": 3, "learner": {}},
    ]
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    acc = account(run_dir, None)
    assert acc["episodes_lost"] == 0  # 8 admitted - 6 consumed - 2 wasted - 0 in flight
    assert acc["episodes_counted_twice"] == 1
    assert acc["env_tokens_trained"] == 4.0
    assert (acc["episode_restarts"], acc["episode_replays"], acc["env_errors"]) == (3, 0, 0)
    assert (acc["infra_failed"], acc["infra_failed_trained"]) == (2, 1)
    assert (acc["quarantined"], acc["quarantine_released"], acc["quarantine_restarts"]) == (3, 1, 2)
    text = format_accounting(acc)
    assert "episodes counted twice          1" in text
    assert "environment tokens trained      4.0" in text
    assert "infra-failed episodes trained   1" in text
    assert (
        "env replicas quarantined        3\n  let back after a probe        1\n"
        "  restarted by their supervisor 2\n"
    ) in text

    single = os.path.join(tmp_path, "single")
    make_run(single, accuracy=0.5, wall_s=5.0, pipeline=PIPELINE, steps=STEPS)
    plain = account(single, None)
    assert plain["episodes_lost"] is None and plain["env_tokens_trained"] is None
    assert plain["quarantined"] is None
    assert plain["unknown"]["episodes"].startswith("not an episode run")
    assert "episodes lost" not in format_accounting(plain)
