"""What the supervisor reports: how each process ended, each process as it is now, and how the
run ended, with the text a person reads at the end of a run."""

from __future__ import annotations

import io
import json
import os
import signal
from typing import Any, Literal

import msgspec

from asyncrl.exits import EXIT_PROGRAM
from asyncrl.manifest.spec import EXIT_CONFIG

__all__ = [
    "SUMMARY_FILE",
    "ExitInfo",
    "ProcessInfo",
    "RunReport",
    "exit_reason",
    "format_report",
    "stderr_tail",
    "summary_table",
]

SUMMARY_FILE = "summary.json"
"""What a program built on ``asyncrl.roles.program.run.Run`` writes when it finishes."""

STDERR_TAIL_LINES = 20


class ExitInfo(msgspec.Struct, frozen=True):
    """How one incarnation of a process ended."""

    role: str
    replica: int
    incarnation: int
    pid: int
    code: int | None
    signal: str | None
    reason: str
    stderr_tail: list[str] = []

    def describe(self) -> str:
        how = f"killed by {self.signal}" if self.signal else f"exit code {self.code}"
        return f"{self.role}[{self.replica}] incarnation {self.incarnation} (pid {self.pid}): {how}"


class ProcessInfo(msgspec.Struct, frozen=True):
    """One supervised process as it is now (for fault injection and status displays)."""

    role: str
    replica: int
    kind: str
    incarnation: int
    pid: int | None
    alive: bool
    serving: bool
    standby_pid: int | None = None

    @property
    def label(self) -> str:
        return f"{self.role}[{self.replica}]"


class RunReport(msgspec.Struct):
    """How the run ended, for the summary and for tests.

    Attributes:
        wall_s: seconds from the agent's start of the run to its end.
        restarting: this node's processes (``role[replica]``) whose restart the end of the
            run cut short, as they were when the end was decided: waiting out their backoff,
            or started again and not serving yet.
    """

    status: Literal["completed", "failed", "interrupted"]
    reason: str
    failure: ExitInfo | None = None
    restarts: dict[str, int] = {}
    exits: list[ExitInfo] = []
    served: dict[str, int] = {}
    restarting: list[str] = []
    wall_s: float = 0.0


def exit_reason(code: int, *, hung: str = "", driver: bool = False) -> str:
    """Why a process ended with ``code`` (negative: the signal that killed it), as its
    ``ExitInfo.reason`` says it. ``hung``: why its supervisor killed it as hung, if it did;
    ``driver``: it is the driver, whose ``EXIT_PROGRAM`` is the program's failure."""
    if hung:
        return f"hung ({hung}) and was killed"
    if code == EXIT_CONFIG:
        return "configuration error"
    if code == EXIT_PROGRAM and driver:
        return "the control-flow program raised, or the run stalled"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def format_report(report: RunReport) -> str:
    """The report as a person reads it: how the run ended, and what failed if it did."""
    lines = [f"run {report.status}: {report.reason}"]
    failure = report.failure
    if failure is not None:
        lines.append(f"  failed process: {failure.describe()}")
        lines.append(f"  reason: {failure.reason}")
        lines.append(f"  restarts of {failure.role}: {report.restarts.get(failure.role, 0)}")
        if failure.stderr_tail:
            lines.append("  last lines of its stderr:")
            lines += [f"    | {line}" for line in failure.stderr_tail]
    return "\n".join(lines)


def stderr_tail(path: str, incarnation: int) -> list[str]:
    """The last ``STDERR_TAIL_LINES`` lines that ``incarnation`` of a process wrote to its
    stderr log ``path`` (after the ``--- incarnation N ---`` line each one starts with);
    [] when the log cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    marker = f"--- incarnation {incarnation} ---"
    if marker in lines:
        lines = lines[lines.index(marker) + 1 :]
    return lines[-STDERR_TAIL_LINES:]


def summary_table(report: RunReport, run_dir: str, *, width: int = 100) -> str:
    """The table a person reads at the end of a run: how it ended, each ``X_before_rl`` of
    ``summary.json`` beside its ``X_final`` (held-out accuracy, success), the run's wall time
    (``report.wall_s``), the samples trained on and generated, and the restarts. A run whose
    program wrote no ``summary.json`` gets the rows the agent knows (status, wall, restarts)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    found: Any = {}
    try:
        with open(os.path.join(run_dir, SUMMARY_FILE)) as f:
            found = json.load(f)
    except (OSError, ValueError):
        pass
    summary: dict[str, Any] = found if isinstance(found, dict) else {}
    table = Table(title="run summary", box=box.SIMPLE, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("status", report.status)
    for key, before in summary.items():
        name = key.removesuffix("_before_rl")
        after = summary.get(f"{name}_final")
        if name != key and isinstance(before, float | int) and isinstance(after, float | int):
            label = name.replace("_", " ")
            table.add_row(
                label, f"{before:.3f} before RL, {after:.3f} after ({after - before:+.3f})"
            )
    table.add_row("wall", _duration(report.wall_s))
    if "samples_consumed" in summary:
        pipeline = summary.get("pipeline") or {}
        samples = f"{int(summary['samples_consumed']):,} trained on"
        generated = int(pipeline.get("generated_samples", 0))
        if generated:
            wasted = int(pipeline.get("wasted_samples", 0))
            samples += f", {generated:,} generated ({wasted / generated:.1%} wasted)"
        table.add_row("samples", samples)
    restarts = {role: n for role, n in report.restarts.items() if n}
    parts = ", ".join(f"{role} {n}" for role, n in restarts.items())
    table.add_row("restarts", f"{sum(restarts.values())}" + (f" ({parts})" if parts else ""))
    out = io.StringIO()
    Console(file=out, width=width, color_system=None, emoji=False).print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()).strip("\n")


def _duration(seconds: float) -> str:
    """``3 min 20 s``, or ``12.3 s`` under a minute."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    return f"{minutes // 60} h {minutes % 60} min {secs} s"
