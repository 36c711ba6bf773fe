"""Reading a manifest's YAML and applying ``--set`` overrides, with every problem reported.

``load_yaml`` parses the text with PyYAML's safe loader and reports what plain YAML loaders let
through silently: a key given twice in one mapping, and tags that would build Python objects.
``apply_override`` applies one ``key=value``; ``credit`` names the override behind a problem,
since the file does not show that value. ``asyncrl.manifest`` validates what they return.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import yaml

from asyncrl._schema import TOP, describe

__all__ = ["apply_override", "credit", "load_yaml"]


class _Loader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no type hints
    """PyYAML's safe loader, reading exponent floats as YAML 1.2 does: ``lr: 3e-4`` is the
    number 0.0003, not the string "3e-4" (YAML 1.1 wants ``3.0e-4``), so a learning rate
    written the usual way reaches the role as a float."""


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
    """Parse ``text``; report syntax errors and duplicate keys. Returns (parsed, data)."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _find_duplicates(node, problems, set())
        return True, (None if node is None else loader.construct_document(node))
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


def apply_override(
    raw: Any, text: str, problems: list[str], created: list[tuple[str, str]]
) -> None:
    """Apply one ``key=value`` to ``raw``, creating mappings on the way; report a bad one.

    Each mapping created is added to ``created`` as (its path, ``text``).
    """
    label = f"--set {text}"
    key, sep, value_text = text.partition("=")
    parts = key.strip().split(".")
    if not sep:
        problems.append(f"{label}: no '=' in it; write key=value, e.g. roles.rollout.replicas=4")
        return
    if not all(parts):
        problems.append(f"{label}: empty key; write a dotted path, e.g. roles.rollout.replicas=4")
        return
    try:
        value = yaml.load(value_text, Loader=_Loader)  # a safe loader
    except yaml.YAMLError as exc:
        what = getattr(exc, "problem", None) or exc
        problems.append(f"{label}: the value is not valid YAML ({what}); quote it")
        return
    node = raw
    for depth, part in enumerate(parts):
        if not isinstance(node, dict):
            where = ".".join(parts[:depth]) or "the top level"
            problems.append(
                f"{label}: {where} is {describe(node)}, not a mapping; "
                "set keys only inside mappings"
            )
            return
        if depth == len(parts) - 1:
            node[part] = value
        else:
            if part not in node:
                created.append((".".join(parts[: depth + 1]), text))
            node = node.setdefault(part, {})
