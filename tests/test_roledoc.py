"""docs/roles.md lists every setting of every built-in role, as tools/roledoc.py writes it."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from types import ModuleType
from typing import Any, ClassVar, Literal

import msgspec
import pytest

from asyncrl.manifest.load import parse_manifest
from asyncrl.manifest.model_section import inherited_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "roledoc", os.path.join(ROOT, "tools", "roledoc.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["roledoc"] = module
    spec.loader.exec_module(module)
    return module


roledoc = _tool()


def _doc() -> str:
    with open(roledoc.DOC, encoding="utf-8") as f:
        return f.read()


def test_the_page_is_what_the_tool_writes_from_the_config_classes() -> None:
    assert roledoc.rewrite(_doc()) == _doc(), "run .venv/bin/python tools/roledoc.py"


@pytest.mark.parametrize("name", list(roledoc.ROLES))
def test_every_field_of_every_built_in_role_has_a_row(name: str) -> None:
    config = roledoc.load(roledoc.ROLES[name]).Config
    section = _doc().split(f"### {name}: ", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ", section, re.M)
    assert rows == [f.encode_name for f in msgspec.structs.fields(config)]


def test_the_learner_and_critic_epochs_are_listed() -> None:
    assert "| `ppo_epochs` | integer | `1` | passes over each batch (>= 1)." in _doc()
    assert "| `dropout` | boolean | `false` |" in _doc()


class _Documented(msgspec.Struct):
    """A config.

    Attributes:
        path: where it is; a longer
            explanation on the next line.
        lo, hi: the bounds ``[lo, hi]``; a | b.
        kind: which one.
        ratio: a number or null.
    """

    inherits: ClassVar[tuple[str, ...]] = ()
    path: str = ""
    lo: int = 0
    hi: int = 10
    kind: Literal["a", "b", "c"] = "a"
    ratio: float | None = None
    names: list[str] = []


def test_types_defaults_and_docstring_entries_are_rendered() -> None:
    fields = {f.name: f for f in msgspec.structs.fields(_Documented)}
    assert roledoc.attributes(_Documented.__doc__ or "") == {
        "path": "where it is; a longer explanation on the next line.",
        "lo": "the bounds ``[lo, hi]``; a | b.",
        "hi": "the bounds ``[lo, hi]``; a | b.",
        "kind": "which one.",
        "ratio": "a number or null.",
    }
    assert [roledoc.type_name(f.type) for f in fields.values()] == [
        "string",
        "integer",
        "integer",
        "`a`, `b` or `c`",
        "number or null",
        "list of strings",
    ]
    assert [roledoc.default_text(f) for f in fields.values()] == [
        '`""`',
        "`0`",
        "`10`",
        "`a`",
        "`null`",
        "`[]`",
    ]
    assert roledoc.type_name(tuple[float, float]) == "2 numbers"
    assert roledoc.type_name(dict[str, Any]) == "mapping"


class _FakeRole:
    """A role whose config forgot to describe a field."""

    Config = _Documented


def test_a_field_without_an_entry_stops_the_tool_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(roledoc, "load", lambda target: _FakeRole)
    with pytest.raises(ValueError) as info:
        roledoc.role_section("fake", "mypkg:Fake")
    assert str(info.value) == (
        "mypkg:Fake: the field 'names' of its Config has no entry in the Config's Attributes: "
        "docstring; describe it there"
    )


def test_the_example_at_the_top_of_the_page_is_a_valid_manifest() -> None:
    (example,) = re.findall(r"```yaml\n(model:.*?)```", _doc(), re.S)
    manifest = parse_manifest("run: {name: x, program: a:b}\n" + example)
    model = msgspec.to_builtins(manifest.model)
    for name, role in manifest.roles.items():
        config_type = roledoc.load(role.cls or "").Config
        config = msgspec.convert(inherited_config(role.config, config_type, model), config_type)
        assert roledoc.ROLES[name] == role.cls
        assert getattr(config, "tokenizer_path", "examples/arith/tokenizer") == (
            "examples/arith/tokenizer"
        )
