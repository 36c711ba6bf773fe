"""Logging: structlog, as JSON lines per process in the run directory and readable lines on the
console. Every line carries the role, replica, incarnation and pid of the process that wrote it.

The JSON file gets every line of asyncrl's own loggers (``asyncrl.*``, debug included) and the
other libraries' from info up. The console gets only what a person follows or must act on:
warnings, errors and lines of progress (an info line logged with ``extra=PROGRESS``; the
progress display and ``say`` print to stdout: ``asyncrl.observe.progress``).
``asyncrl run -v`` (``ASYNCRL_VERBOSE=1``) gives the console every line the file gets.
Third-party request logging (httpx, httpcore, aiohttp: a line per request) is kept to
warnings in both.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from typing import Any

import structlog

from asyncrl.safe_files import open_append

__all__ = [
    "CONSOLE_ENV",
    "PROGRESS",
    "QUIET_LOGGERS",
    "VERBOSE_ENV",
    "configure",
    "console_wanted",
    "get_logger",
    "verbose_wanted",
]

CONSOLE_ENV = "ASYNCRL_CONSOLE"
"""Set to ``0`` to keep a process's readable log lines off the console (its JSON file stays)."""
VERBOSE_ENV = "ASYNCRL_VERBOSE"
"""Set to ``1`` (``asyncrl run -v``) to give the console every line the JSON file gets, not
only warnings and errors; the run's processes inherit it."""
PROGRESS = {"progress": True}
"""``log.info(..., extra=PROGRESS)``: a line of a run's progress, on the console even when it
shows only warnings (stdlib loggers)."""
QUIET_LOGGERS = ("httpx", "httpcore", "httpx2", "httpcore2", "aiohttp")
"""Libraries that log a line per request at info: held at warning (``httpx2`` and
``httpcore2`` are the HTTP client of ``openai`` 3)."""


def console_wanted() -> bool:
    return os.environ.get(CONSOLE_ENV, "1") != "0"


def verbose_wanted() -> bool:
    return os.environ.get(VERBOSE_ENV, "0") not in ("", "0")


def configure(
    *,
    role: str,
    replica: int = 0,
    incarnation: int = 0,
    json_path: str | None = None,
    console: bool = True,
    verbose: bool | None = None,
    level: int = logging.INFO,
) -> None:
    """Route structlog and the stdlib loggers (the transport's) to a JSON file and the console.

    Args:
        role, replica, incarnation: bound to every line.
        json_path: the JSON-lines file (none when None).
        console: readable lines on stdout too.
        verbose: every line on the console, not only warnings and errors (default: the
            ``ASYNCRL_VERBOSE`` environment variable).
        level: the least level of other libraries' lines (asyncrl's own: debug).
    """
    if verbose is None:
        verbose = verbose_wanted()
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(
        role=role, replica=replica, incarnation=incarnation, pid=os.getpid()
    )
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(level)
    logging.getLogger("asyncrl").setLevel(logging.DEBUG)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)

    def formatter(renderer: Any) -> logging.Formatter:
        return structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=shared,
        )

    if json_path is not None:
        os.makedirs(os.path.dirname(json_path), exist_ok=True)
        file_handler = _NoFollowFileHandler(json_path)
        file_handler.setFormatter(formatter(structlog.processors.JSONRenderer()))
        root.addHandler(file_handler)
    if console:
        stream = logging.StreamHandler(sys.stdout)
        stream.setFormatter(formatter(structlog.dev.ConsoleRenderer(colors=False)))
        if not verbose:
            stream.addFilter(_attention)
        root.addHandler(stream)
    if not root.handlers:
        root.addHandler(logging.NullHandler())  # not logging's last-resort stderr printer


class _NoFollowFileHandler(logging.FileHandler):
    """A ``FileHandler`` that never writes through a link at its file's name (0600)."""

    def _open(self) -> io.TextIOWrapper:
        return io.TextIOWrapper(open_append(self.baseFilename), encoding="utf-8")


def _attention(record: logging.LogRecord) -> bool:
    """What the console shows without ``-v``: warnings, errors and lines of progress."""
    return record.levelno >= logging.WARNING or bool(getattr(record, "progress", False))


def get_logger(name: str = "asyncrl") -> Any:
    """A structlog logger; bind more context with ``.bind(key=value)``."""
    return structlog.stdlib.get_logger(name)
