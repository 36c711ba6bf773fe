"""What the supervisor reports: how each process ended, each process as it is now, and how the
run ended, with the text a person reads at the end of a run."""

from __future__ import annotations

import os
import signal
from typing import Literal

import msgspec

from asyncrl.exits import EXIT_PROGRAM
from asyncrl.manifest.spec import EXIT_CONFIG

__all__ = ["ExitInfo", "ProcessInfo", "RunReport", "exit_reason", "format_report", "stderr_tail"]

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
