"""What a process's log configuration sends to the console and to its JSON file."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest

from asyncrl.observe import logs


@pytest.fixture
def restored() -> Iterator[None]:
    """Leave the root logger and the loggers' levels as they were."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    named = {n: logging.getLogger(n).level for n in ("asyncrl", *logs.QUIET_LOGGERS)}
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    for name, value in named.items():
        logging.getLogger(name).setLevel(value)


def emit() -> None:
    """One line of each kind, from asyncrl's loggers and from httpx's."""
    log = logging.getLogger("asyncrl.test")
    log.debug("a checkpoint written")
    log.info("a process started")
    log.info("held-out accuracy 0.5", extra=logs.PROGRESS)
    log.warning("the reward looks constant")
    logs.get_logger("asyncrl.test").info("structlog info")
    logging.getLogger("httpx").info("HTTP Request: POST /v1/chat/completions 200")
    logging.getLogger("httpx2").info("HTTP Request: POST /v1/chat/completions 200")  # openai 3
    logging.getLogger("httpx").warning("HTTP Request failed")


def events(path: str) -> list[tuple[str, str]]:
    with open(path) as f:
        return [(e["level"], e["event"]) for e in map(json.loads, f)]


def test_the_console_shows_progress_and_warnings_and_the_file_everything(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], restored: None
) -> None:
    path = os.path.join(tmp_path, "logs", "r.0.jsonl")
    logs.configure(role="r", json_path=path, console=True, verbose=False)
    emit()
    shown = capsys.readouterr().out.splitlines()
    assert [line.split("] ", 1)[1].split("  ")[0] for line in shown] == [
        "held-out accuracy 0.5",
        "the reward looks constant",
        "HTTP Request failed",
    ]
    assert events(path) == [
        ("debug", "a checkpoint written"),
        ("info", "a process started"),
        ("info", "held-out accuracy 0.5"),
        ("warning", "the reward looks constant"),
        ("info", "structlog info"),
        ("warning", "HTTP Request failed"),  # httpx's per-request info lines: held at warning
    ]


def test_verbose_shows_on_the_console_what_the_file_gets(
    tmp_path: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    restored: None,
) -> None:
    monkeypatch.setenv(logs.VERBOSE_ENV, "1")  # as asyncrl run -v sets it for the run
    path = os.path.join(tmp_path, "logs", "r.0.jsonl")
    logs.configure(role="r", json_path=path, console=True)
    emit()
    shown = [line.split("] ", 1)[1].split("  ")[0] for line in capsys.readouterr().out.splitlines()]
    assert shown == [event for _, event in events(path)]
    assert len(shown) == 6
