"""Per-step metrics of a run: ``RUN_DIR/metrics.jsonl``, TensorBoard when it is installed, and
Weights & Biases when the manifest asks for it.

A long loop (the RL loop of ``asyncrl.roles.program.programs``) writes one JSON object per step
through ``MetricsLog``: ``step``, ``wall_s`` (seconds of the loop so far, across resumes), ``time``
(Unix time) and numbers, alone or in groups (``{"reward": {"mean": 0.41, "p50": 0.0}, ...}``). Each
line is flushed as it is written, so the file is current while the run goes and a crash cuts at
most its last line, which ``read_metrics`` leaves out. A resumed loop appends: the steps past
the one it resumes after are dropped first, so no step appears twice.

With TensorBoard installed (``pip install 'asyncrl[tensorboard]'``) every number is also a
scalar under ``RUN_DIR/tensorboard/``, tagged by its group (``reward/mean``), at its step,
through ``torch.utils.tensorboard.SummaryWriter``; a resumed loop purges the steps it will write
again. Without it, one log line says how to install it, and nothing else changes.

With ``run.metrics.wandb`` in the manifest (``asyncrl.observe.wandb_sink``) the same numbers
also go to a Weights & Biases run, under the same tags, at the same steps.

``IdleFractions`` gives each role's idle fraction over a step: the share of the time since the
step before in which its replicas had no call of the driver in flight
(``asyncrl.dispatch.dispatcher.Busy``), averaged over the replicas. ``ctx.idle()`` is it for a
control-flow program.

``latest()`` is the last record written in this process: the driver answers ``asyncrl status``
with its step and version.

``Restarts`` counts the restarts the supervisor logged so far (``RUN_DIR/logs/agent.jsonl``),
reading only what was appended since it last looked.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

from asyncrl.observe.wandb_sink import WandbSink, open_sink
from asyncrl.safe_files import open_append, write_atomic

__all__ = [
    "METRICS_FILE",
    "TENSORBOARD_DIR",
    "TENSORBOARD_INSTALL",
    "IdleFractions",
    "MetricsLog",
    "Restarts",
    "latest",
    "read_metrics",
    "scalars",
]

log = logging.getLogger("asyncrl.observe.metrics")

METRICS_FILE = "metrics.jsonl"
"""The per-step metrics, one JSON object a line, in the run directory."""
TENSORBOARD_DIR = "tensorboard"
"""Where the TensorBoard event files go, in the run directory."""
TENSORBOARD_INSTALL = "pip install 'asyncrl[tensorboard]'"
"""What installs the TensorBoard writer (and viewer)."""
_FLUSH_S = 10  # TensorBoard's writer flushes its queue at least this often
_latest: dict[str, Any] = {}  # the last record any MetricsLog of this process wrote


def latest() -> dict[str, Any]:
    """A copy of the last record written in this process by any ``MetricsLog``; {} before
    the first."""
    return dict(_latest)


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics file, in order; a line cut short by a crash is left out.

    Raises:
        OSError: the file cannot be read (``FileNotFoundError`` when it does not exist).
    """
    records: list[dict[str, Any]] = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if isinstance(record, dict):
                records.append(record)
    return records


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a record by TensorBoard tag (``reward/mean``), ``step`` and ``time`` left
    out; booleans, strings and numbers that are not finite are left out too."""
    out: dict[str, float] = {}
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{tag}/"))
        elif (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and tag not in ("step", "time")
        ):
            out[tag] = float(value)
    return out


def _finite(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None (JSON has no NaN)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLog:
    """``RUN_DIR/metrics.jsonl`` of one loop, mirrored to TensorBoard when it is installed.

    Use it as an async context manager: entering reads the file and opens the writers off the
    event loop (TensorBoard's writer imports torch: seconds), leaving closes them.

    Args:
        run_dir: the run directory.
        done: the steps the loop already took: records of later steps are dropped (a resumed
            loop writes them again); 0 starts the file afresh.
        tensorboard: mirror the numbers to TensorBoard when it is installed.

    Attributes:
        records: the records so far, those kept from before included.
        tensorboard: whether TensorBoard is written (known once entered).
    """

    def __init__(self, run_dir: str, *, done: int, tensorboard: bool = True) -> None:
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.done = done
        self.records: list[dict[str, Any]] = []
        self.tensorboard = tensorboard
        self._file: Any = None
        self._writer: Any = None
        self._wandb: WandbSink | None = None

    @property
    def wall_s(self) -> float:
        """The ``wall_s`` of the last step's record (0 when there is none)."""
        walls = (r.get("wall_s") for r in reversed(self.records) if "step" in r)
        return float(next(walls, 0.0) or 0.0)

    @property
    def last_step(self) -> int:
        steps = (int(r["step"]) for r in reversed(self.records) if "step" in r)
        return next(steps, 0)

    async def __aenter__(self) -> MetricsLog:
        await asyncio.to_thread(self._open)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)

    def _open(self) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        found = read_metrics(self.path) if os.path.exists(self.path) else []
        # A record of a change of the run's membership (a launch's node lost: it has no step)
        # is kept, as every step the loop already took.
        kept = [r for r in found if 0 < int(r.get("step", 0)) <= self.done or "membership" in r]
        if kept != found or not os.path.exists(self.path):
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        self.records = kept
        self._file = io.TextIOWrapper(open_append(self.path), encoding="utf-8")  # closed by close()
        if self.tensorboard:
            self._writer = _tensorboard_writer(
                os.path.join(self.run_dir, TENSORBOARD_DIR), self.done
            )
            self.tensorboard = self._writer is not None
        try:
            self._wandb = open_sink(self.run_dir)
        except Exception as exc:  # wandb's own errors (no API key, no network) are its own types
            log.warning(
                "no Weights & Biases run (run.metrics.wandb): %s: %s; the metrics still go to %s%s",
                type(exc).__name__,
                exc,
                METRICS_FILE,
                " and TensorBoard" if self._writer is not None else "",
            )

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (it has a ``step``) and flush it; numbers that are not finite are
        written as null."""
        record = _finite(record)
        self.records.append(record)
        _latest.clear()
        _latest.update(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._writer is not None:
            walltime = record.get("time") or time.time()
            for tag, value in scalars(record).items():
                self._writer.add_scalar(tag, value, int(record["step"]), walltime=walltime)
        if self._wandb is not None:
            self._wandb.log(scalars(record), int(record["step"]))

    def close(self) -> None:
        """Close the file, the TensorBoard writer (flushing it) and the W&B run; idempotent."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


def _tensorboard_writer(logdir: str, done: int) -> Any:
    """TensorBoard's ``SummaryWriter`` on ``logdir``, or None (and one log line) when TensorBoard
    is not installed. A resumed loop (``done`` steps taken) purges the later steps."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.info(
            "TensorBoard is not installed, so %s is not written; install it with: %s",
            logdir,
            TENSORBOARD_INSTALL,
        )
        return None
    return SummaryWriter(logdir, purge_step=done + 1 if done else None, flush_secs=_FLUSH_S)


class Restarts:
    """The restarts the supervisor logged so far in ``RUN_DIR/logs/agent.jsonl``.

    Each call reads only the complete lines appended since the last; a file that shrank (a new
    run in the directory) is read again from its start.
    """

    EVENT = "restarting"
    """The supervisor's log event of one restart."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, "logs", "agent.jsonl")
        self.count = 0
        self._offset = 0

    def __call__(self) -> int:
        """The count of restarts so far."""
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._offset:
                    self.count = self._offset = 0
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return self.count
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self._offset += end
        for line in data[:end].splitlines():
            try:
                event = json.loads(line).get("event")
            except (ValueError, AttributeError):
                continue
            if event == self.EVENT:
                self.count += 1
        return self.count


class IdleFractions:
    """Each role's idle fraction since the previous call (the first: since it was made).

    Args:
        busy: per role, the seconds its replicas were busy so far (summed) and its replica
            count (``asyncrl.dispatch.dispatcher.Dispatcher.busy``).
        clock: seconds, the clock ``busy`` counts in (a test may pass a fake one).
    """

    def __init__(
        self,
        busy: Callable[[], dict[str, tuple[float, int]]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.busy = busy
        self.clock = clock
        self._then = clock()
        self._before = {name: b for name, (b, _) in busy().items()}

    def __call__(self) -> dict[str, float]:
        """Per role: 1 - (busy seconds of its replicas) / (replicas x seconds elapsed), in
        [0, 1], rounded to 4 places; an empty dict when no time passed."""
        now, busy = self.clock(), self.busy()
        elapsed, self._then = now - self._then, now
        before, self._before = self._before, {name: b for name, (b, _) in busy.items()}
        if elapsed <= 0:
            return {}
        return {
            name: round(min(1.0, max(0.0, 1.0 - (b - before.get(name, 0.0)) / (n * elapsed))), 4)
            for name, (b, n) in busy.items()
            if n
        }
