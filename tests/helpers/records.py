"""Reading a JSON-lines file that a running process may be appending to."""

import json
from typing import Any


def complete_lines(path: str) -> list[str]:
    """The lines of ``path`` that a writer has finished, read in one pass; none if it is missing.

    One read of the whole file, then a split: iterating over a file being appended to can yield
    the head of a line at end of file and its tail on the next read, as two lines.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return []
    return [line + "\n" for line in text.split("\n")[:-1]]


def records(path: str) -> list[dict[str, Any]]:
    """The JSON objects of the finished lines of ``path``."""
    return [json.loads(line) for line in complete_lines(path)]
