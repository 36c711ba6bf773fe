"""Logging: structlog, as JSON lines per process in the run directory and readable lines on the
console. Every line carries the role, replica, incarnation and pid of the process that wrote it.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from typing import Any

import structlog

from asyncrl.safe_files import open_append

__all__ = ["CONSOLE_ENV", "configure", "console_wanted", "get_logger"]

CONSOLE_ENV = "ASYNCRL_CONSOLE"
"""Set to ``0`` to keep a process's readable log lines off the console (its JSON file stays)."""


def console_wanted() -> bool:
    return os.environ.get(CONSOLE_ENV, "1") != "0"


def configure(
    *,
    role: str,
    replica: int = 0,
    incarnation: int = 0,
    json_path: str | None = None,
    console: bool = True,
    level: int = logging.INFO,
) -> None:
    """Route structlog and the stdlib loggers (the transport's) to a JSON file and the console."""
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
        root.addHandler(stream)
    if not root.handlers:
        root.addHandler(logging.NullHandler())  # not logging's last-resort stderr printer


class _NoFollowFileHandler(logging.FileHandler):
    """A ``FileHandler`` that never writes through a link at its file's name (0600)."""

    def _open(self) -> io.TextIOWrapper:
        return io.TextIOWrapper(open_append(self.baseFilename), encoding="utf-8")


def get_logger(name: str = "asyncrl") -> Any:
    """A structlog logger; bind more context with ``.bind(key=value)``."""
    return structlog.stdlib.get_logger(name)
