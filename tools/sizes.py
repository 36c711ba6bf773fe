"""Report what is long to read at once: modules over 600 lines of code in the packages, and
functions over 80 lines of code anywhere outside the tests.

    python tools/sizes.py

A line of code is a line that holds a token other than a comment or a docstring: blank lines,
comments and docstrings are not counted (they are a fifth of the package's lines, and a module
should not be cut short of them). Prints one warning per finding (``warning: path: N lines of
code`` or ``warning: path:line: name, N lines of code``) and exits 0: a long module is asking to
be split at a seam, or to say why it has none (STYLE.md), never to be cut to a count. Exits 2
when a file is not Python.
"""

from __future__ import annotations

import ast
import io
import os
import sys
import tokenize
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("asyncrl", "transport", "roles", "plugins")
"""The folders whose modules are reported past ``MAX_FILE_LINES``."""
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
SKIPPED = frozenset({"tests", "build", "runs", "__pycache__", "node_modules"})
"""Folders at any depth not searched for long functions (with every folder named ``.*`` or
``*.egg-info``)."""
_NOT_CODE = frozenset(
    {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENCODING,
        tokenize.ENDMARKER,
    }
)


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


def code_lines(source: str) -> set[int]:
    """The numbers of the lines of ``source`` that hold code: a token other than a comment,
    outside every docstring (a string standing alone as a statement: the docstring of a module,
    a class or a function, or of the attribute above it).

    Raises:
        SyntaxError: ``source`` is not Python.
    """
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docstrings.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstrings


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[int, str, int]]:
    """``(line, qualified name, lines of code)`` of each function in ``source`` with more than
    ``limit`` lines of code (its ``def`` line to its last, nested functions included; a nested
    function is also counted on its own).

    Raises:
        SyntaxError: ``source`` is not Python.
    """
    found: list[tuple[int, str, int]] = []
    code = code_lines(source)

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}."
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                span = range(child.lineno, (child.end_lineno or child.lineno) + 1)
                length = len(code.intersection(span))
                if length > limit:
                    found.append((child.lineno, name[:-1], length))
            visit(child, name)

    visit(ast.parse(source), "")
    return sorted(found)


def findings(root: str = ROOT) -> list[str]:
    """One line per module of ``PACKAGES`` over ``MAX_FILE_LINES`` lines of code and per
    function over ``MAX_FUNCTION_LINES`` outside the tests, files in sorted order."""
    out = []
    for path in python_files(root):
        with open(os.path.join(root, path), encoding="utf-8") as f:
            source = f.read()
        lines = len(code_lines(source))
        if path.split(os.sep)[0] in PACKAGES and lines > MAX_FILE_LINES:
            out.append(f"{path}: {lines} lines of code (over {MAX_FILE_LINES})")
        for line, name, length in long_functions(source):
            out.append(f"{path}:{line}: {name}, {length} lines of code (over {MAX_FUNCTION_LINES})")
    return out


def main() -> int:
    try:
        found = findings()
    except SyntaxError as exc:
        print(f"tools/sizes.py: {exc.filename}:{exc.lineno}: not Python: {exc.msg}")
        return 2
    for line in found:
        print(f"warning: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
