"""Reading a manifest's YAML and applying ``--set`` overrides, with every problem reported.

``load_yaml`` parses the text with PyYAML's safe loader and reports what plain YAML loaders let
through silently: a key given twice in one mapping, tags that would build Python objects, and
documents too large to hold: aliases expand to copies of what they name, so a few hundred bytes
of nested aliases can stand for gigabytes, and an alias inside what it names never ends. Before
anything is built, the document is measured as expanded against ``asyncrl.manifest.limits``: its
bytes, its values and its nesting depth.
``apply_override`` applies one ``key=value``, measured the same way at the depth of its key path;
``merged_problem`` measures the manifest once every override is applied, since overrides under
the limits alone may be over them together; ``credit`` names the override behind a problem,
since the file does not show that value. ``asyncrl.manifest.load`` validates what they return.
Every recursion here has a fixed bound whatever the input (the loader refuses nesting past
``_COMPOSE_DEPTH`` before anything is measured; the merged manifest is measured without
recursion): deep nesting is a problem, never a ``RecursionError``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import yaml

from asyncrl.manifest._schema import TOP, describe, join
from asyncrl.manifest.limits import MAX_DEPTH, MAX_MANIFEST_BYTES, MAX_VALUES

__all__ = ["apply_override", "credit", "load_yaml", "merged_problem"]


class _Loader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no type hints
    """PyYAML's safe loader, reading exponent floats as YAML 1.2 does: ``lr: 3e-4`` is the
    number 0.0003, not the string "3e-4" (YAML 1.1 wants ``3.0e-4``), so a learning rate
    written the usual way reaches the role as a float."""


class _TooLarge(Exception):
    """A document over a limit: what is wrong, and where (its path and place in the text)."""

    def __init__(self, what: str, path: str = "", mark: Any = None) -> None:
        super().__init__(what)
        self.what, self.path, self.mark = what, path, mark

    def __str__(self) -> str:
        line = f"line {self.mark.line + 1}, column {self.mark.column + 1}" if self.mark else ""
        if self.path and line:
            return f"{self.path} ({line}): {self.what}"
        return f"{self.path or line or TOP}: {self.what}"


class _BoundedLoader(_Loader):
    """The manifest's loader, which refuses to compose lists and mappings nested far deeper than
    ``MAX_DEPTH``: PyYAML composes them recursively, and Python's stack is finite. What is
    composed is measured afterwards (``_Expansion``), which names the path of a value nested
    deeper than ``MAX_DEPTH``."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > _COMPOSE_DEPTH:
                raise _TooLarge(_DEEP, "", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_COMPOSE_DEPTH = 4 * MAX_DEPTH  # some 3 Python frames a level: far from the recursion limit
_DEEP = (
    f"lists and mappings nested more than {MAX_DEPTH} deep (aliases expanded); flatten the "
    "value, or pass deep data by file"
)


def _compose(text: str, level: int = 0) -> tuple[_BoundedLoader, Any, tuple[int, int, int]]:
    """The node graph of ``text``, after checking its size as written and as expanded, and its
    measure (values, bytes, depth) as expanded. ``level``: how deep in a manifest the document
    goes (a ``--set`` value goes as deep as its key path has parts), which counts in its depth.

    Raises ``_TooLarge`` with the problem, and ``yaml.YAMLError`` on bad syntax.
    """
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_MANIFEST_BYTES:
        raise _TooLarge(
            f"{size:,} bytes, over the {MAX_MANIFEST_BYTES:,} a manifest may have; pass large "
            "data by file (a path in the role's config)"
        )
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        found = (0, 0, 0) if node is None else _Expansion().measure(node, level, "")
        return loader, node, found
    except BaseException:
        loader.dispose()
        raise


class _Expansion:
    """Measures a node graph as its aliases expand: each alias counts as a full copy of the
    node it names. Each node is measured once (a memo), so a bomb is measured in the time of
    its text, not of its expansion."""

    def __init__(self) -> None:
        self.memo: dict[int, tuple[int, int, int]] = {}  # id: (values, bytes, depth)
        self.open: set[int] = set()  # the nodes being measured: one met again is its own part

    def measure(self, node: Any, level: int, path: str) -> tuple[int, int, int]:
        """(values, bytes, depth) of ``node`` at nesting ``level`` and ``path`` (where a problem
        is reported); raises ``_TooLarge``."""
        key = id(node)
        if key in self.open:
            raise _TooLarge(
                f"this {_kind(node)} contains itself through an alias (an alias inside the "
                "anchor it names), so it never ends; write the value out",
                path,
                node.start_mark,
            )
        found = self.memo.get(key)
        if found is None:
            found = self._measure(node, level, path)
        values, size, depth = found
        if level + depth > MAX_DEPTH:
            # Named by its nearest key: a path of 64 list indexes would tell nobody anything.
            raise _TooLarge(_DEEP, re.sub(r"(\[\d+\])+$", "", path), node.start_mark)
        if values > MAX_VALUES or size > MAX_MANIFEST_BYTES:
            what = f"{values:,} values" if values > MAX_VALUES else f"{size:,} bytes"
            limit = f"{MAX_VALUES:,} values" if values > MAX_VALUES else f"{MAX_MANIFEST_BYTES:,}"
            raise _TooLarge(
                f"this {_kind(node)} expands to {what} (each alias counts as a copy of what it "
                f"names), over the {limit} a manifest may have; write fewer aliases, or pass "
                "large data by file",
                path,
                node.start_mark,
            )
        return found

    def _measure(self, node: Any, level: int, path: str) -> tuple[int, int, int]:
        if isinstance(node, yaml.ScalarNode):
            found = (1, len(node.value) + 1, 0)
        else:
            self.open.add(id(node))
            if isinstance(node, yaml.MappingNode):
                children = [
                    (part, path if part is key else join(path, _key(key)))
                    for key, item in node.value
                    for part in (key, item)
                ]
            else:
                children = [(item, f"{path}[{i}]") for i, item in enumerate(node.value)]
            values, size, depth = 1, 2, 0
            for child, where in children:
                v, b, d = self.measure(child, level + 1, where)
                values, size, depth = values + v, size + b, max(depth, d)
                if values > MAX_VALUES or size > MAX_MANIFEST_BYTES:
                    break  # over already: measure() says so, with this node's place
            found = (values, size, depth + 1)
            self.open.discard(id(node))
        self.memo[id(node)] = found
        return found


def _key(node: Any) -> Any:
    return node.value if isinstance(node, yaml.ScalarNode) else "<key>"


def _kind(node: Any) -> str:
    if isinstance(node, yaml.MappingNode):
        return "mapping"
    return "list" if isinstance(node, yaml.SequenceNode) else "value"


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def credit(problem: str, overrides: Sequence[str], created: Sequence[tuple[str, str]]) -> str:
    """Name the ``--set`` behind a problem, since the file does not show that value.

    ``created`` holds (path, override) for each mapping an override created.
    """
    for path, override in created:
        if problem.startswith(path + ":"):
            return f"{problem} (from --set {override}, which created it)"
    keys = [(o.partition("=")[0].strip(), o) for o in overrides if "=" in o]
    found = [
        (key, o) for key, o in keys if key and problem.startswith((key + ":", key + ".", key + "["))
    ]
    if not found:
        return problem
    _, override = max(reversed(found), key=lambda f: len(f[0]))  # the last of the deepest
    return f"{problem} (from --set {override})"


def load_yaml(text: str, problems: list[str]) -> tuple[bool, Any]:
    """Parse ``text``; report syntax errors, duplicate keys and a document over the limits of
    ``asyncrl.manifest.limits``. Returns (parsed, data)."""
    loader = None
    try:
        loader, node, _ = _compose(text)
        if node is not None:
            _find_duplicates(node, problems, set())
        return True, (None if node is None else loader.construct_document(node))
    except _TooLarge as exc:
        problems.append(str(exc))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else TOP
        what = exc.problem or exc.context
        context = ""
        if exc.context and exc.problem:
            cm = exc.context_mark
            line = f" at line {cm.line + 1}" if cm and mark and cm.line != mark.line else ""
            context = f" ({exc.context}{line})"
        tag = re.match(r"could not determine a constructor for the tag '(.*)'", what or "")
        if tag:
            tag_name = tag[1].replace("tag:yaml.org,2002:", "!!")
            problems.append(
                f"{where}: the tag {tag_name!r} is not plain YAML (tags that build Python "
                "objects are refused); remove the tag and write the value itself"
            )
        elif "'\\t'" in (what or ""):
            problems.append(
                f"{where}: a tab character, which YAML does not allow in indentation; "
                "indent with spaces"
            )
        else:
            problems.append(f"{where}: {what}{context}; fix the YAML syntax there")
    except yaml.YAMLError as exc:
        problems.append(f"{TOP}: {exc}; fix the YAML syntax")
    finally:
        if loader is not None:
            loader.dispose()
    return False, None


def _find_duplicates(node: Any, problems: list[str], seen: set[int]) -> None:
    """Report keys given twice in one mapping, which YAML loaders silently resolve to the last."""
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for key, item in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                mark = key.start_mark
                if (key.tag, key.value) in first:
                    problems.append(
                        f"line {mark.line + 1}, column {mark.column + 1}: duplicate key "
                        f"{key.value!r}, first given at line {first[key.tag, key.value]}; "
                        "remove one of them"
                    )
                first.setdefault((key.tag, key.value), mark.line + 1)
            _find_duplicates(key, problems, seen)
            _find_duplicates(item, problems, seen)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _find_duplicates(item, problems, seen)


def apply_override(raw: Any, text: str, problems: list[str], created: list[tuple[str, str]]) -> int:
    """Apply one ``key=value`` to ``raw``, creating mappings on the way; report a bad one.

    Each mapping created is added to ``created`` as (its path, ``text``). The value is measured
    as expanded, at the depth of its key path: a key path of more than ``MAX_DEPTH`` parts, or
    a value nested deeper than what is left, is refused before anything is built. Returns the
    bytes of the value as expanded (0 for an override refused).
    """
    label = f"--set {_shown(text)}"
    key, sep, value_text = text.partition("=")
    parts = key.strip().split(".")
    if not sep:
        problems.append(f"{label}: no '=' in it; write key=value, e.g. roles.rollout.replicas=4")
        return 0
    if not all(parts):
        problems.append(f"{label}: empty key; write a dotted path, e.g. roles.rollout.replicas=4")
        return 0
    if len(parts) > MAX_DEPTH:
        problems.append(
            f"{label}: the key path has {len(parts):,} parts, which nests its value deeper than "
            f"the {MAX_DEPTH} levels of lists and mappings a manifest may have; set a key at "
            f"most {MAX_DEPTH} deep, or pass deep data by file"
        )
        return 0
    try:
        loader, value_node, (_, size, _) = _compose(value_text, len(parts))  # a safe loader
        try:
            value = None if value_node is None else loader.construct_document(value_node)
        finally:
            loader.dispose()
    except _TooLarge as exc:
        where = f"with its key path of {len(parts)} parts, " if exc.what == _DEEP else ""
        problems.append(f"{label}: {where}{exc.what}")
        return 0
    except yaml.YAMLError as exc:
        what = getattr(exc, "problem", None) or exc
        problems.append(f"{label}: the value is not valid YAML ({what}); quote it")
        return 0
    node = raw
    for depth, part in enumerate(parts):
        if not isinstance(node, dict):
            where = ".".join(parts[:depth]) or "the top level"
            problems.append(
                f"{label}: {where} is {describe(node)}, not a mapping; "
                "set keys only inside mappings"
            )
            return 0
        if depth == len(parts) - 1:
            node[part] = value
        else:
            if part not in node:
                created.append((".".join(parts[: depth + 1]), text))
            node = node.setdefault(part, {})
    return size


_SHOWN = 1000


def _shown(text: str) -> str:
    """An override as a problem shows it: one longer than ``_SHOWN`` characters is cut."""
    if len(text) <= _SHOWN:
        return text
    return f"{text[:_SHOWN]}... ({len(text):,} characters)"


def merged_problem(raw: Any, sizes: Sequence[tuple[str, int]]) -> str | None:
    """Why the manifest ``raw``, with every ``--set`` override applied, is over a limit of
    ``asyncrl.manifest.limits`` as expanded (its bytes, values or depth), or None.

    Each override is measured alone as it is read; together they may still be over: twelve
    values of 1 MB each. ``raw`` is what YAML built, in which an alias is the same object as
    its anchor: each object is measured once (a memo) and counted at every place it appears,
    without recursion, so a graph of any depth or expansion is measured in the time of its
    distinct objects. ``sizes`` holds (override, bytes of its value) for each override applied.
    """
    values, size, depth = _measure_objects(raw)
    if values <= MAX_VALUES and size <= MAX_MANIFEST_BYTES and depth <= MAX_DEPTH:
        return None
    if depth > MAX_DEPTH:
        what = f"nests lists and mappings {depth} deep, over the {MAX_DEPTH} levels"
    elif values > MAX_VALUES:
        what = f"expands to {values:,} values, over the {MAX_VALUES:,}"
    else:
        what = f"expands to {size:,} bytes, over the {MAX_MANIFEST_BYTES:,}"
    largest = sorted(sizes, key=lambda s: -s[1])[:3]
    named = ", ".join(f"--set {_shown(o.partition('=')[0])}=... ({b:,} bytes)" for o, b in largest)
    return (
        f"{TOP}: the manifest with its {len(sizes)} --set override"
        f"{'' if len(sizes) == 1 else 's'} applied {what} a manifest may have (each alias "
        f"counts as a copy of what it names; each override is under the limit alone, not "
        f"together; the largest: {named}); set fewer or smaller values, or pass large data "
        "by file"
    )


def _measure_objects(root: Any) -> tuple[int, int, int]:
    """(values, bytes, depth) of ``root`` as expanded: a scalar counts the characters of its
    text and one more, a list or mapping 2 and its items (and keys); an object met again counts
    again. Iterative, with a memo by object: neither the stack nor the time grows with the
    expansion."""
    memo: dict[int, tuple[int, int, int]] = {}
    opened: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        obj, children_done = stack.pop()
        if not isinstance(obj, dict | list) or id(obj) in memo:
            continue
        items = [x for kv in obj.items() for x in kv] if isinstance(obj, dict) else obj
        if not children_done:
            if id(obj) in opened:  # inside itself: YAML refuses that, but never loop on it
                return 1, 2, MAX_DEPTH + 1
            opened.add(id(obj))
            stack.append((obj, True))
            stack.extend((x, False) for x in items if isinstance(x, dict | list))
            continue
        values, size, depth = 1, 2, 0
        for x in items:
            v, b, d = memo.get(id(x), (0, 0, 0)) if isinstance(x, dict | list) else _scalar(x)
            values, size, depth = values + v, size + b, max(depth, d)
        memo[id(obj)] = (values, size, depth + 1)
    return memo[id(root)] if isinstance(root, dict | list) else _scalar(root)


def _scalar(value: Any) -> tuple[int, int, int]:
    text = value if isinstance(value, str) else "null" if value is None else str(value)
    return 1, len(text) + 1, 0
