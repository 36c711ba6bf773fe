"""Report what is too long to read at once: files over 600 lines in the packages, and functions over
80 lines anywhere outside the tests.

    python tools/sizes.py

Prints one line per finding (``path: N lines`` or ``path:line: name, N lines``) and exits with
status 1 if there is any, 0 if there is none. A function's length runs from its ``def`` line to
its last line, nested functions included; a nested function is also counted on its own.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("asyncrl", "transport", "roles", "plugins")
"""The folders whose files must stay under ``MAX_FILE_LINES``."""
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
SKIPPED = frozenset({"tests", "build", "runs", "__pycache__", "node_modules"})
"""Folders at any depth not searched for long functions (with every folder named ``.*`` or
``*.egg-info``)."""


def python_files(root: str = ROOT) -> Iterator[str]:
    """Every ``.py`` file under ``root`` outside the skipped folders, as a path relative to
    ``root``, in sorted order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in SKIPPED and not d.startswith(".") and not d.endswith(".egg-info")
        )
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(dirpath, name), root)


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[int, str, int]]:
    """``(line, qualified name, length)`` of each function in ``source`` longer than ``limit``
    lines.

    Raises:
        SyntaxError: ``source`` is not Python.
    """
    found: list[tuple[int, str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}."
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > limit:
                    found.append((child.lineno, name[:-1], length))
            visit(child, name)

    visit(ast.parse(source), "")
    return sorted(found)


def findings(root: str = ROOT) -> list[str]:
    """One line per file over ``MAX_FILE_LINES`` in ``PACKAGES`` and per function over
    ``MAX_FUNCTION_LINES`` outside the tests, files in sorted order."""
    out = []
    for path in python_files(root):
        with open(os.path.join(root, path), encoding="utf-8") as f:
            source = f.read()
        lines = len(source.splitlines())
        if path.split(os.sep)[0] in PACKAGES and lines > MAX_FILE_LINES:
            out.append(f"{path}: {lines} lines (over {MAX_FILE_LINES})")
        for line, name, length in long_functions(source):
            out.append(f"{path}:{line}: {name}, {length} lines (over {MAX_FUNCTION_LINES})")
    return out


def main() -> int:
    found = findings()
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
