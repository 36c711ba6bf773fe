"""What a run did to its samples and steps, read back from the files it left: the accounting that
``asyncrl chaos`` prints.

Everything here is a pure function of files in run directories, so it is tested with files
written by hand. The files, each optional:

- ``ledger/<role>.<replica>.steps.jsonl``: one line per learner step (in a launch over several
  nodes, node R's learners keep theirs in ``node-R/ledger/``, which is read too),
  ``{"step", "version", "ids": [[prompt_id, sample_index], ...], "skipped", "incarnation",
  "phase"}``;
- ``summary.json``: the program's summary, with ``accuracy_final``, ``learner_steps``,
  ``samples_consumed`` and ``pipeline`` (``admitted_samples``, ``generated_samples``,
  ``consumed_samples``, ``wasted_samples``, ``in_flight_at_end``, ...);
- ``report.json``: the supervisor's report (status, restarts per role, failed exits, the
  processes still restarting when the run ended);
- ``driver.json``: the driver's record (``dispatch``: per role ``served`` and ``retries``);
- ``chaos.json``: written by ``asyncrl chaos`` beside them: wall time, kills, stops and the
  supervisor's ``exited``/``serving`` events with their times; for a campaign over nodes,
  ``node_events`` (each loss, restart and return to service of a node, with its Unix time);
- ``metrics.jsonl``: the program's steps (``step``, ``time``) and node 0's membership changes
  (``{"time", "membership": {"event": "node_lost" | "node_back", "node", ...}}``).

A figure whose file or field is missing is ``None`` (printed as ``unknown``), and the reason is
kept under ``unknown``: never a made-up 0.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
from typing import Any

from asyncrl.observe.metrics import read_metrics

__all__ = [
    "CHAOS_FILE",
    "account",
    "format_accounting",
    "format_node_summary",
    "ledger_figures",
    "node_figures",
    "percentile",
    "read_steps",
    "recoveries",
    "run_figures",
]

CHAOS_FILE = "chaos.json"
"""What ``asyncrl chaos`` saw of one run (wall time, kills, stops, supervisor events)."""

LEDGER_DIR = "ledger"
STEPS_SUFFIX = ".steps.jsonl"


_COUNTERS = frozenset(
    {"admitted_groups", "admitted_samples", "generated_samples", "consumed_samples"}
    | {"wasted_samples"}
)
"""The pipeline's counters (the pipeline leaves out the ones still at 0, so missing is 0).
``in_flight_at_end`` and ``scored_samples`` the built-in programs write even at 0 (the latter
since the pipeline counts it; an earlier run's summary has none): missing, they are unknown."""


def _read_json(path: str) -> Any:
    """The JSON in ``path``, or ``None`` when it is missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _step_logs(run_dir: str) -> list[tuple[str, str]]:
    """``(key, path)`` of every step log of the run: ``RUN_DIR/ledger/<name>`` keyed by its
    ``<role>.<replica>``, and each ``RUN_DIR/node-R/ledger/<name>`` (a launch over several
    nodes) keyed ``node-R/<role>.<replica>``."""
    folders = [("", os.path.join(run_dir, LEDGER_DIR))]
    with contextlib.suppress(OSError):
        folders += [
            (f"{name}/", os.path.join(run_dir, name, LEDGER_DIR))
            for name in sorted(os.listdir(run_dir))
            if name.startswith("node-") and name[5:].isdigit()
        ]
    found = []
    for prefix, folder in folders:
        try:
            names = sorted(n for n in os.listdir(folder) if n.endswith(STEPS_SUFFIX))
        except OSError:
            continue
        found += [(prefix + n[: -len(STEPS_SUFFIX)], os.path.join(folder, n)) for n in names]
    return found


def read_steps(run_dir: str) -> dict[str, list[dict[str, Any]]] | None:
    """The learner's step records by ``<role>.<replica>`` (``node-R/<role>.<replica>`` for a
    log in node R's folder of a launch over several nodes), in file order.

    ``None`` when the run has no ``ledger/`` step log at all. A line that is not a JSON object
    with an integer ``step`` (a learner killed mid-write leaves a partial last line) is skipped
    and counted under the key ``""`` as ``{"bad_line": n}`` records.
    """
    logs = _step_logs(run_dir)
    if not logs:
        return None
    out: dict[str, list[dict[str, Any]]] = {}
    for key, path in logs:
        name = key + STEPS_SUFFIX
        records: list[dict[str, Any]] = []
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                    out.setdefault("", []).append({"bad_line": n, "file": name})
                    continue
                records.append(record)
        out[key] = records
    return out


def ledger_figures(steps: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Repeated and skipped steps, and samples consumed more than once, from the step records.

    - ``steps_repeated``: step numbers recorded more than once by the same learner replica;
    - ``steps_skipped``: numbers in ``1..max(step)`` a replica never recorded;
    - ``duplicates_consumed``: sample ids consumed more than once, in any steps of any replica
      (BC demonstrations that are re-used carry distinct ids, so every id counts); the ranks
      of a data-parallel group each record every step of the group, so an id that replicas of
      one role record in the same step number is one consumption;
    - ``duplicate_consumptions``: the consumptions beyond the first, summed over those ids;
    - ``ids_consumed`` / ``ids_consumed_rl``: distinct ids consumed, in all steps / in steps
      whose phase is ``rl`` (``None`` when no record names its phase);
    - ``learner_steps``: the highest step recorded by any replica.
    """
    counts: collections.Counter[tuple[Any, ...]] = collections.Counter()
    rl_ids: set[tuple[Any, ...]] = set()
    phased = False
    repeated = skipped = top = records_n = 0
    bad = len(steps.get("", []))
    # (role, step number, repeat) -> the ids its replicas consumed in it, with how often: the
    # ranks of a data-parallel group record the same step each, so the most any of them
    # recorded counts; a step a replica records again (a repeat) is counted on its own.
    consumed: dict[tuple[str, int, int], collections.Counter[tuple[Any, ...]]] = {}
    for key, records in steps.items():
        if key == "":
            continue
        role = key.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        numbers = collections.Counter(int(r["step"]) for r in records)
        repeated += sum(1 for c in numbers.values() if c > 1)
        highest = max(numbers, default=0)
        skipped += sum(1 for s in range(1, highest + 1) if s not in numbers)
        top = max(top, highest)
        records_n += len(records)
        seen: collections.Counter[int] = collections.Counter()
        for record in records:
            phase = record.get("phase") or ""
            phased = phased or bool(phase)
            step = int(record["step"])
            ids: collections.Counter[tuple[Any, ...]] = collections.Counter()
            for sample_id in record.get("ids") or []:
                ident = tuple(sample_id) if isinstance(sample_id, list) else (sample_id,)
                ids[ident] += 1
                if phase == "rl":
                    rl_ids.add(ident)
            where = (role, step, seen[step])
            seen[step] += 1
            consumed[where] = consumed.get(where, collections.Counter()) | ids
    for ids in consumed.values():
        counts.update(ids)
    return {
        "learner_steps": top,
        "step_records": records_n,
        "bad_lines": bad,
        "steps_repeated": repeated,
        "steps_skipped": skipped,
        "duplicates_consumed": sum(1 for c in counts.values() if c > 1),
        "duplicate_consumptions": sum(c - 1 for c in counts.values() if c > 1),
        "ids_consumed": len(counts),
        "ids_consumed_rl": len(rl_ids) if phased else None,
    }


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``; ``None`` if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def recoveries(chaos: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """Time to recover from each failure the supervisor reported: from its ``exited`` event to
    the next ``serving`` event of the same process, in ms, with p50/p99/max overall and per
    role. A failure never followed by ``serving`` counts as ``restarting_at_end`` when it was
    its process's last and the supervisor reported the process still restarting when the run
    ended (``restarting``: a kill in the run's last moments), else as ``unrecovered``."""
    events = chaos.get("events") or []
    exits = report.get("exits") or []
    by_role: dict[str, list[float]] = collections.defaultdict(list)
    last: dict[str, int] = {}
    for failure in exits:
        label = f"{failure['role']}[{failure['replica']}]"
        last[label] = max(last.get(label, -1), failure["incarnation"])
    cut_short = {(label, last[label]) for label in report.get("restarting") or [] if label in last}
    unrecovered = at_end = 0
    for failure in exits:
        label = f"{failure['role']}[{failure['replica']}]"
        incarnation = failure["incarnation"]
        exited = next(
            (
                e["t"]
                for e in events
                if e["kind"] == "exited" and e["label"] == label and e["incarnation"] == incarnation
            ),
            None,
        )
        serving = next(
            (
                e["t"]
                for e in events
                if e["kind"] == "serving"
                and e["label"] == label
                and e["incarnation"] > incarnation
                and exited is not None
                and e["t"] >= exited
            ),
            None,
        )
        if serving is None and (label, incarnation) in cut_short:
            at_end += 1
            continue
        if exited is None or serving is None:
            unrecovered += 1
            continue
        by_role[failure["role"]].append((serving - exited) * 1e3)
    every = [ms for times in by_role.values() for ms in times]
    return {
        "recoveries": len(every),
        "unrecovered": unrecovered,
        "restarting_at_end": at_end,
        "recover_ms_p50": percentile(every, 50),
        "recover_ms_p99": percentile(every, 99),
        "recover_ms_max": max(every, default=None),
        "recover_ms_by_role": {
            role: {
                "n": len(times),
                "p50": percentile(times, 50),
                "p99": percentile(times, 99),
                "max": max(times),
            }
            for role, times in sorted(by_role.items())
        },
    }


def node_figures(chaos: dict[str, Any], metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """What losing nodes cost, from the ``node_events`` of a campaign over nodes
    (``chaos.json``) and the run's ``metrics.jsonl`` lines (node 0's membership changes and the
    program's steps, each with its Unix ``time``):

    - ``node_losses``: nodes the campaign lost (SIGKILLed whole);
    - ``node_rejoins``: torchruns started again whose node node 0 then recorded back
      (``node_back``);
    - ``node_loss_to_step_s``: per loss that node 0 marked (its first ``node_lost`` change of
      that node at or after the kill), the seconds from the kill to the first step completed
      after the mark; ``node_losses_unmarked``: losses never marked (the run ended first);
    - ``rejoin_to_serving_s``: per restart, the seconds to the campaign's ``serving`` event of
      that node (every replica it brought back connected to the driver with credit);
    - ``..._p50``: their medians (nearest rank), ``None`` when there is none.
    """
    events = [e for e in chaos.get("node_events") or [] if isinstance(e, dict)]
    changes = sorted(
        (float(line["time"]), line["membership"])
        for line in metrics
        if isinstance(line.get("membership"), dict) and isinstance(line.get("time"), int | float)
    )
    steps = sorted(
        float(line["time"])
        for line in metrics
        if "step" in line and "membership" not in line and isinstance(line.get("time"), int | float)
    )

    def change(kind: str, node: int, since: float) -> float | None:
        return next(
            (
                t
                for t, c in changes
                if c.get("event") == kind and c.get("node") == node and t >= since
            ),
            None,
        )

    to_step: list[float] = []
    to_serving: list[float] = []
    unmarked = rejoins = 0
    for n, event in enumerate(events):
        node, at = int(event.get("node", -1)), float(event.get("time", 0.0))
        later = events[n + 1 :]
        if event.get("event") == "lost":
            marked = change("node_lost", node, at)
            if marked is None:
                unmarked += 1
                continue
            step = next((t for t in steps if t > marked), None)
            if step is not None:
                to_step.append(step - at)
        elif event.get("event") == "restarted":
            if change("node_back", node, at) is not None:
                rejoins += 1
            for other in later:
                if other.get("node") != node or other.get("event") == "lost":
                    if other.get("node") == node:
                        break  # lost again before it served
                    continue
                if other.get("event") == "serving":
                    to_serving.append(float(other["time"]) - at)
                    break
    return {
        "node_losses": sum(1 for e in events if e.get("event") == "lost"),
        "node_losses_unmarked": unmarked,
        "node_rejoins": rejoins,
        "node_loss_to_step_s": to_step,
        "node_loss_to_step_s_p50": percentile(to_step, 50),
        "rejoin_to_serving_s": to_serving,
        "rejoin_to_serving_s_p50": percentile(to_serving, 50),
    }


def format_node_summary(acc: dict[str, Any]) -> str:
    """The accounting of a campaign over nodes (``account`` with ``node_figures``, ``node_plan``
    and ``exit_codes``) as a person reads it: a few lines, ``unknown`` where a figure is."""

    def seconds(key: str) -> str:
        each = ", ".join(f"{v:.1f}" for v in acc.get(key) or [])
        return f"{_show(acc.get(key + '_p50'))}" + (f" (each {each})" if each else "")

    def pair(a: str, b: str) -> str:
        return f"{_show(acc.get(a))} / {_show(acc.get(b))}"

    plan = acc.get("node_plan") or {}
    node = plan.get("kill_node", "?")
    codes = acc.get("exit_codes") or {}
    statuses = ", ".join(f"node {n} {c}" for n, c in codes.items()) or "unknown"
    rows = [
        (f"launch over {plan.get('nodes', '?')} nodes completed", acc.get("completed")),
        ("  exit statuses", statuses),
        (f"node {node} lost", acc.get("node_losses")),
        ("  never marked lost", acc.get("node_losses_unmarked")),
        (f"node {node} back", acc.get("node_rejoins")),
        ("loss to next step p50 (s)", seconds("node_loss_to_step_s")),
        ("rejoin to serving p50 (s)", seconds("rejoin_to_serving_s")),
        ("samples lost", acc.get("samples_lost")),
        ("samples consumed twice", acc.get("duplicates_consumed")),
        ("learner steps repeated/skipped", pair("steps_repeated", "steps_skipped")),
        ("learner steps", acc.get("learner_steps")),
        ("  pipeline and log agree", acc.get("consistent")),
        ("accuracy undisturbed/chaos", pair("accuracy_undisturbed", "accuracy_chaos")),
        ("program time undisturbed/chaos", pair("program_s_undisturbed", "program_s_chaos")),
        ("slowdown (program time)", acc.get("slowdown")),
    ]
    lines = [f"{label:<32}{_show(value)}" for label, value in rows]
    unknown = acc.get("unknown") or {}
    if unknown:
        lines.append("unknown figures, and why:")
        lines += [f"  {key}: {why}" for key, why in unknown.items()]
    return "\n".join(lines)


def _count(events: list[dict[str, Any]]) -> dict[str, int]:
    counts = collections.Counter(e["role"] for e in events)
    return {"total": len(events), **dict(sorted(counts.items()))}


def run_figures(run_dir: str) -> dict[str, Any]:
    """Everything one run directory tells about the run; missing figures are ``None``, with the
    reason under ``unknown``."""
    unknown: dict[str, str] = {}
    out: dict[str, Any] = {}
    report = _read_json(os.path.join(run_dir, "report.json"))
    summary = _read_json(os.path.join(run_dir, "summary.json"))
    driver = _read_json(os.path.join(run_dir, "driver.json"))
    chaos = _read_json(os.path.join(run_dir, CHAOS_FILE))
    _report_figures(report, out, unknown)
    _chaos_figures(chaos, report, out, unknown)
    summary = _pipeline_figures(summary, driver, out, unknown)
    _ledger_figures(run_dir, summary, out, unknown)
    _episode_figures(run_dir, summary, out, unknown)
    _dispatch_figures(driver, out, unknown)
    out["unknown"] = unknown
    return out


# Each of the following adds its figures to ``out``, and why any is None to ``unknown``.


def _report_figures(report: Any, out: dict[str, Any], unknown: dict[str, str]) -> None:
    """From the supervisor's report: status, reason, restarts per role."""
    if isinstance(report, dict):
        out["status"] = report.get("status")
        out["completed"] = report.get("status") == "completed"
        out["reason"] = report.get("reason")
        out["restarts"] = dict(report.get("restarts") or {})
    else:
        out.update(status=None, completed=None, reason=None, restarts=None)
        unknown["completed"] = unknown["restarts"] = "no report.json"


def _chaos_figures(chaos: Any, report: Any, out: dict[str, Any], unknown: dict[str, str]) -> None:
    """From what ``asyncrl chaos`` saw: wall time, kills, stops and (with the report) the times
    to recover."""
    if isinstance(chaos, dict):
        out["wall_s"] = chaos.get("wall_s")
        out["program_s"] = chaos.get("program_s")
        out["kills"] = _count(chaos.get("kills") or [])
        out["stops"] = _count(chaos.get("stops") or [])
        if isinstance(report, dict):
            out.update(recoveries(chaos, report))
    else:
        out.update(wall_s=None, program_s=None, kills=None, stops=None)
        unknown["kills"] = unknown["wall_s"] = f"no {CHAOS_FILE}"
    for key in ("recover_ms_p50", "recover_ms_p99", "recover_ms_max", "recover_ms_by_role"):
        if key not in out:
            out[key] = None
            unknown[key] = f"needs report.json and {CHAOS_FILE}"


def _pipeline_figures(
    summary: Any, driver: Any, out: dict[str, Any], unknown: dict[str, str]
) -> dict[str, Any]:
    """From the program's summary (or the driver's result): the accuracy and the pipeline's
    counters, and the samples lost by them. Returns the summary, ``{}`` when there is none."""
    pipeline = summary.get("pipeline") if isinstance(summary, dict) else None
    if not isinstance(summary, dict):
        unknown["summary"] = "no summary.json (the program did not write one)"
    found: dict[str, Any] = summary if isinstance(summary, dict) else {}
    out["accuracy"] = found.get("accuracy_final")
    if out["accuracy"] is None and isinstance(driver, dict):
        result = driver.get("result")
        if isinstance(result, dict):
            out["accuracy"] = result.get("accuracy_final")
    if out["accuracy"] is None:
        unknown["accuracy"] = "neither summary.json nor driver.json's result has accuracy_final"
    out["samples_consumed_program"] = found.get("samples_consumed")
    pipe: dict[str, Any] = pipeline if isinstance(pipeline, dict) else {}
    if not pipe:
        unknown["pipeline"] = "summary.json has no pipeline counters"
    for key, name in (
        ("admitted_groups", "prompts_admitted"),
        ("admitted_samples", "samples_admitted"),
        ("generated_samples", "samples_generated"),
        ("scored_samples", "samples_scored"),
        ("consumed_samples", "samples_consumed"),
        ("wasted_samples", "samples_wasted"),
        ("in_flight_at_end", "in_flight_at_end"),
    ):
        out[name] = pipe.get(key)
        if out[name] is None and pipe and key in _COUNTERS:
            out[name] = 0  # a counter the run never incremented
        elif out[name] is None and pipe:
            unknown[name] = f"summary.json's pipeline has no {key}"
    parts = [out[k] for k in ("samples_admitted", "samples_consumed", "samples_wasted")]
    parts.append(out["in_flight_at_end"])
    if all(isinstance(p, int | float) for p in parts):
        admitted, consumed, wasted, in_flight = parts
        out["samples_lost"] = admitted - consumed - wasted - in_flight
    else:
        out["samples_lost"] = None
        unknown["samples_lost"] = (
            "needs the pipeline's admitted_samples, consumed_samples, wasted_samples and "
            "in_flight_at_end in summary.json"
        )
    return found


_LEDGER_KEYS = (
    "learner_steps",
    "steps_repeated",
    "steps_skipped",
    "duplicates_consumed",
    "duplicate_consumptions",
    "ids_consumed",
    "ids_consumed_rl",
)


def _ledger_figures(
    run_dir: str, summary: dict[str, Any], out: dict[str, Any], unknown: dict[str, str]
) -> None:
    """From the learner's step log: steps repeated or skipped, duplicates, and whether what the
    learner trained on agrees with the pipeline's count (already in ``out``)."""
    steps = read_steps(run_dir)
    if steps is None:
        for key in _LEDGER_KEYS:
            out[key] = None
        unknown["ledger"] = f"no {LEDGER_DIR}/*{STEPS_SUFFIX} (the learner kept no step log)"
        out["ledger_bad_lines"] = None
    else:
        figures = ledger_figures(steps)
        for key in _LEDGER_KEYS:
            out[key] = figures[key]
        out["ledger_bad_lines"] = figures["bad_lines"]
    if out["learner_steps"] is None and summary.get("learner_steps") is not None:
        out["learner_steps"] = summary["learner_steps"]
    # The pipeline counts what the program handed to the learner; the ledger, what the learner
    # trained on. In the RL phase they must agree.
    ledger_rl = out["ids_consumed_rl"]
    if steps is not None and ledger_rl is None:
        ledger_rl = out["ids_consumed"]
        out["consumed_basis"] = "all steps (the step log names no phase)"
    else:
        out["consumed_basis"] = "rl steps"
    out["samples_consumed_ledger"] = ledger_rl
    if out["samples_consumed"] is not None and ledger_rl is not None:
        out["consistent"] = out["samples_consumed"] == ledger_rl
    else:
        out["consistent"] = None
        unknown["consistent"] = "needs the pipeline's consumed_samples and the learner's step log"


_EPISODE_COUNTERS = (
    ("episode_restarts", "episode_restarts"),
    ("episode_replays", "episode_replays"),
    ("env_timeouts", "env_timeouts"),
    ("env_errors", "env_errors"),
    ("infra_failed", "infra_failed"),
    ("quarantined", "quarantined"),
    ("quarantine_released", "quarantine_released"),
    ("quarantine_restarts", "quarantine_restarts"),
)


def _episode_figures(
    run_dir: str, summary: dict[str, Any], out: dict[str, Any], unknown: dict[str, str]
) -> None:
    """For a run whose samples are multi-turn episodes (its pipeline counted ``episodes``):
    ``episodes_lost`` (its samples lost), ``episodes_counted_twice`` (consumptions beyond an
    id's first), ``env_tokens_trained`` (the learner's count of environment tokens in its loss,
    summed over ``metrics.jsonl``), and the restarts, replays, timeouts and errors of the
    environment, its ``infra_failed`` episodes (never trained) and ``infra_failed_trained``
    (the learner's count of such episodes it received, summed over ``metrics.jsonl``: 0), and
    ``quarantined``, ``quarantine_released`` and ``quarantine_restarts`` (times an environment
    replica was quarantined for failing its steps, let back after serving a probe, and
    restarted by its supervisor on the quarantine's request).
    ``None`` for a single-turn run."""
    pipeline = summary.get("pipeline")
    keys = ("episodes_lost", "episodes_counted_twice", "env_tokens_trained", "infra_failed_trained")
    if not (isinstance(pipeline, dict) and "episodes" in pipeline):
        for key in (*keys, *(name for _, name in _EPISODE_COUNTERS)):
            out[key] = None
        unknown["episodes"] = "not an episode run (its pipeline counted no episodes)"
        return
    out["episodes_lost"] = out["samples_lost"]
    out["episodes_counted_twice"] = out["duplicate_consumptions"]
    for key, name in _EPISODE_COUNTERS:
        out[name] = int(pipeline.get(key, 0))
    try:
        lines = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    except OSError:
        lines = []
    trained = [
        float(learner["env_tokens_trained"])
        for line in lines
        if isinstance(learner := line.get("learner"), dict) and "env_tokens_trained" in learner
    ]
    out["env_tokens_trained"] = sum(trained) if trained else None
    if not trained:
        unknown["env_tokens_trained"] = "metrics.jsonl has no learner env_tokens_trained"
    infra = [
        float(learner["infra_failed_trained"])
        for line in lines
        if isinstance(learner := line.get("learner"), dict) and "infra_failed_trained" in learner
    ]
    out["infra_failed_trained"] = int(sum(infra)) if infra else None
    if not infra:
        unknown["infra_failed_trained"] = "metrics.jsonl has no learner infra_failed_trained"


def _dispatch_figures(driver: Any, out: dict[str, Any], unknown: dict[str, str]) -> None:
    """From the driver's record: calls served and retried, per role."""
    dispatch = driver.get("dispatch") if isinstance(driver, dict) else None
    if isinstance(dispatch, dict):
        out["dispatch"] = {
            role: {
                "served": sum((counts.get("served") or {}).values()),
                "retries": counts.get("retries", 0),
            }
            for role, counts in dispatch.items()
            if isinstance(counts, dict)
        }
    else:
        out["dispatch"] = None
        unknown["dispatch"] = "no driver.json with dispatch counts"


_TOP = (
    "completed",
    "kills",
    "stops",
    "restarts",
    "samples_lost",
    "duplicates_consumed",
    "duplicate_consumptions",
    "steps_repeated",
    "steps_skipped",
    "learner_steps",
    "recoveries",
    "unrecovered",
    "restarting_at_end",
    "recover_ms_p50",
    "recover_ms_p99",
    "recover_ms_max",
    "recover_ms_by_role",
    "prompts_admitted",
    "samples_admitted",
    "samples_generated",
    "samples_scored",
    "samples_consumed",
    "samples_wasted",
    "in_flight_at_end",
    "samples_consumed_program",
    "samples_consumed_ledger",
    "consumed_basis",
    "consistent",
    "episodes_lost",
    "episodes_counted_twice",
    "env_tokens_trained",
    "episode_restarts",
    "episode_replays",
    "env_timeouts",
    "env_errors",
    "infra_failed",
    "infra_failed_trained",
    "quarantined",
    "quarantine_released",
    "quarantine_restarts",
    "dispatch",
)


_UNDISTURBED = (
    "completed",
    "status",
    "samples_lost",
    "duplicates_consumed",
    "steps_repeated",
    "steps_skipped",
    "learner_steps",
    "samples_consumed",
    "samples_consumed_ledger",
    "consistent",
    "restarts",
    "dispatch",
)


def account(chaos_dir: str, undisturbed_dir: str | None) -> dict[str, Any]:
    """The accounting of a chaos run in ``chaos_dir`` next to an undisturbed run of the same
    manifest in ``undisturbed_dir`` (``None``: there was none).

    The chaos run's figures are at the top level (see ``run_figures``), with
    ``accuracy_undisturbed``, ``accuracy_chaos``, ``wall_s_undisturbed``, ``wall_s_chaos``,
    ``program_s_undisturbed``, ``program_s_chaos`` (start to the driver's exit), ``slowdown``
    (of the program time, or of the wall time where that is unknown) and the undisturbed run's
    own figures under ``undisturbed``. Every missing figure is ``None`` and its reason is under
    ``unknown``.
    """
    chaos = run_figures(chaos_dir)
    unknown = {k: v for k, v in chaos["unknown"].items()}
    out: dict[str, Any] = {key: chaos.get(key) for key in _TOP}
    if "recoveries" not in chaos:
        out["recoveries"] = out["unrecovered"] = out["restarting_at_end"] = None
    out["status"] = chaos["status"]
    out["reason"] = chaos["reason"]
    out["accuracy_chaos"] = chaos["accuracy"]
    out["wall_s_chaos"] = chaos["wall_s"]
    if undisturbed_dir is None:
        base: dict[str, Any] = {}
        unknown["undisturbed"] = "no undisturbed run (--no-baseline)"
    else:
        base = run_figures(undisturbed_dir)
        out["undisturbed"] = {key: base.get(key) for key in _UNDISTURBED}
        for key, why in base["unknown"].items():
            unknown[f"undisturbed.{key}"] = why
    out["accuracy_undisturbed"] = base.get("accuracy")
    out["wall_s_undisturbed"] = base.get("wall_s")
    a, b = out["accuracy_chaos"], out["accuracy_undisturbed"]
    out["accuracy_delta"] = a - b if a is not None and b is not None else None
    out["program_s_chaos"] = chaos.get("program_s")
    out["program_s_undisturbed"] = base.get("program_s")
    # The slowdown of the program (start to the driver's exit), which leaves out how long the
    # shutdown took; the full wall times are beside it.
    w, u = out["program_s_chaos"], out["program_s_undisturbed"]
    if w is None or not u:
        w, u = out["wall_s_chaos"], out["wall_s_undisturbed"]
    out["slowdown"] = w / u if w is not None and u else None
    out["unknown"] = unknown
    return out


def _show(value: Any) -> str:
    if value is None:
        return "unknown"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_show(v)}" for k, v in value.items()) or "none"
    return str(value)


def format_accounting(acc: dict[str, Any]) -> str:
    """The accounting as a person reads it: one figure a line, ``unknown`` where it is."""
    rows = [
        ("chaos run completed", acc.get("completed")),
        ("  how it ended", acc.get("reason")),
        ("kills", acc.get("kills")),
        ("stops (SIGSTOP/SIGCONT)", acc.get("stops")),
        ("restarts", acc.get("restarts")),
        ("time to recover p50 (ms)", acc.get("recover_ms_p50")),
        ("time to recover p99 (ms)", acc.get("recover_ms_p99")),
        ("time to recover max (ms)", acc.get("recover_ms_max")),
        ("failures never recovered", acc.get("unrecovered")),
        ("failures restarting at the end", acc.get("restarting_at_end")),
        ("prompts admitted", acc.get("prompts_admitted")),
        ("samples generated", acc.get("samples_generated")),
        ("samples scored", acc.get("samples_scored")),
        ("samples consumed (pipeline)", acc.get("samples_consumed")),
        ("samples consumed (learner log)", acc.get("samples_consumed_ledger")),
        ("  pipeline and log agree", acc.get("consistent")),
        ("samples wasted", acc.get("samples_wasted")),
        ("samples lost", acc.get("samples_lost")),
        ("samples consumed twice", acc.get("duplicates_consumed")),
        *(
            []
            if acc.get("episode_restarts") is None  # not an episode run
            else [
                ("episodes lost", acc.get("episodes_lost")),
                ("episodes counted twice", acc.get("episodes_counted_twice")),
                ("environment tokens trained", acc.get("env_tokens_trained")),
                ("episodes restarted (reset)", acc.get("episode_restarts")),
                ("episodes replayed", acc.get("episode_replays")),
                ("environment timeouts", acc.get("env_timeouts")),
                ("environment errors", acc.get("env_errors")),
                ("episodes infra-failed", acc.get("infra_failed")),
                ("infra-failed episodes trained", acc.get("infra_failed_trained")),
                ("env replicas quarantined", acc.get("quarantined")),
                ("  let back after a probe", acc.get("quarantine_released")),
                ("  restarted by their supervisor", acc.get("quarantine_restarts")),
            ]
        ),
        ("learner steps", acc.get("learner_steps")),
        ("learner steps repeated", acc.get("steps_repeated")),
        ("learner steps skipped", acc.get("steps_skipped")),
        ("accuracy, undisturbed", acc.get("accuracy_undisturbed")),
        ("accuracy, chaos", acc.get("accuracy_chaos")),
        ("wall time undisturbed (s)", acc.get("wall_s_undisturbed")),
        ("wall time chaos (s)", acc.get("wall_s_chaos")),
        ("program time undisturbed (s)", acc.get("program_s_undisturbed")),
        ("program time chaos (s)", acc.get("program_s_chaos")),
        ("slowdown (program time)", acc.get("slowdown")),
    ]
    lines = [f"{label:<32}{_show(value)}" for label, value in rows]
    for role, figures in (acc.get("recover_ms_by_role") or {}).items():
        lines.append(
            f"  recover {role:<22}n {figures['n']}, p50 {figures['p50']:.0f} ms, "
            f"max {figures['max']:.0f} ms"
        )
    unknown = acc.get("unknown") or {}
    if unknown:
        lines.append("unknown figures, and why:")
        lines += [f"  {key}: {why}" for key, why in unknown.items()]
    return "\n".join(lines)
