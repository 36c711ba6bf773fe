"""Check raw data, as YAML loaded it, against a msgspec Struct, and report every problem at once.

``msgspec.convert`` stops at the first problem. A person fixing a configuration file wants them
all, each with its path in the file and what to do: ``roles.rollout.replicas: expected an integer
>= 1, got -2``. ``validate`` walks the data against the type (through ``msgspec.inspect``), so
the Struct definitions stay the one schema. It understands these keys of ``msgspec.Meta(extra=)``:

- ``expected``: the phrase after "expected" in a problem, where the constraint alone (a regular
  expression) would not tell a person what to write;
- ``coerce``: a function applied to the raw value first, which raises ``ValueError`` with the
  problem when it cannot;
- ``check``: a function of a well-typed value that returns a problem, or None.

Checks across the fields of one Struct (two keys that exclude each other) are passed in
``struct_checks``, keyed by Struct class.
"""

from __future__ import annotations

import difflib
import operator
import re
from collections.abc import Callable, Mapping
from typing import Any

import msgspec.inspect as mi

__all__ = ["TOP", "StructCheck", "at", "describe", "join", "validate"]

TOP = "(top level)"
"""The path of the whole document in a problem."""

StructCheck = Callable[[dict[Any, Any], str, list[str]], None]
"""Checks a Struct's raw mapping as a whole: (mapping, path, problems to append to)."""

_KINDS: dict[type, type | tuple[type, ...]] = {
    mi.IntType: int,
    mi.FloatType: (int, float),
    mi.StrType: str,
    mi.BoolType: bool,
    mi.StructType: dict,
    mi.DictType: dict,
    mi.ListType: list,
    mi.VarTupleType: list,
}
_BOUNDS: tuple[tuple[str, str, Callable[[Any, Any], bool]], ...] = (
    (">=", "ge", operator.ge),
    (">", "gt", operator.gt),
    ("<=", "le", operator.le),
    ("<", "lt", operator.lt),
)


def validate(
    value: Any,
    type_: Any,
    expected: str = "",
    struct_checks: Mapping[type, StructCheck] | None = None,
) -> tuple[Any, list[str]]:
    """Check ``value`` against ``type_``; return it cleaned, and the problems found.

    Cleaned means: unknown keys dropped and values coerced, ready for ``msgspec.convert`` when
    there are no problems. ``expected`` describes the top level in a problem about it.
    """
    walker = _Walker(struct_checks or {})
    clean = walker.walk(value, mi.type_info(type_), "", expected)
    return clean, walker.problems


def at(path: str) -> str:
    """A path as a problem shows it: the top level has a name of its own."""
    return path or TOP


def join(path: str, key: Any) -> str:
    """The path of ``key`` inside ``path``: ``roles.rollout``, or ``roles['my role']``."""
    if isinstance(key, str) and re.fullmatch(r"\w[\w-]*", key):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def describe(value: Any) -> str:
    """A short description of a raw value for a problem: ``-2``, ``'x'``, ``null``, ``a list``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= 60 else repr(value[:57]) + "..."
    if isinstance(value, dict | list):
        kind = "mapping" if isinstance(value, dict) else "list"
        return f"an empty {kind}" if not value else f"a {kind}"
    return f"a {type(value).__name__} ({value})"


def _expected(t: mi.Type, value: Any = None) -> str:
    """What ``t`` wants, as a phrase after "expected". For a number out of range, only the
    bound it breaks: ``an integer >= 1`` for -2, ``an integer <= 4096`` for 1000000000."""
    if isinstance(t, mi.Metadata):
        return str((t.extra or {}).get("expected") or _expected(t.type, value))
    if isinstance(t, mi.IntType | mi.FloatType):
        noun = "an integer" if isinstance(t, mi.IntType) else "a number"
        bounds = [(op, name, getattr(t, name), ok) for op, name, ok in _BOUNDS]
        bounds = [b for b in bounds if b[2] is not None]
        broken = [b for b in bounds if _number(value) and value == value and not b[3](value, b[2])]
        lower = [b for b in bounds if b[1] in ("ge", "gt")]
        upper = [b for b in bounds if b[1] in ("le", "lt")]
        if broken:
            bounds = broken
        elif len(lower) == len(upper) == 1 and lower[0][1] == "ge" and upper[0][1] == "le":
            return f"{noun} from {lower[0][2]} to {upper[0][2]}"
        return f"{noun} " + " and ".join(f"{op} {bound}" for op, _, bound, _ in bounds)
    if isinstance(t, mi.UnionType):
        return " or ".join(_expected(x) for x in t.types if not isinstance(x, mi.NoneType))
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(repr(v) for v in t.values)
    a = "a non-empty" if getattr(t, "min_length", None) else "a"
    if isinstance(t, mi.StructType) and _required(t):
        return "a mapping with the keys " + ", ".join(repr(k) for k in _required(t))
    if isinstance(t, mi.StructType | mi.DictType):
        return f"{a} mapping"
    if isinstance(t, mi.ListType | mi.VarTupleType):
        return f"{a} list"
    if isinstance(t, mi.StrType) and t.max_length is not None:
        return f"{a} string of at most {t.max_length} characters"
    return {mi.StrType: f"{a} string", mi.BoolType: "true or false"}.get(type(t), "a value")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _required(t: mi.StructType) -> list[str]:
    return [f.encode_name for f in t.fields if f.required]


def _fix(t: mi.Type, value: Any, explained: bool = False) -> str:
    """A hint for a value of the wrong kind, starting with '; ', or ''. ``explained``: the
    type's own phrase (``expected``) says what its bounds are for, so a number over one is not
    sent to the limits."""
    may_be_empty = (isinstance(t, mi.DictType) and not t.min_length) or (
        isinstance(t, mi.StructType) and not _required(t)
    )
    if value is None and may_be_empty:
        return "; write {} for an empty mapping, or remove the key"
    if value is None and isinstance(t, mi.StrType) and not t.min_length and not t.pattern:
        return '; write "" for an empty string, or remove the key'
    if isinstance(value, str) and isinstance(t, mi.IntType | mi.FloatType):
        try:
            number = int(value) if isinstance(t, mi.IntType) else float(value)
        except ValueError:
            return ""
        return f"; write it as a plain number, such as {number!r}"
    if isinstance(t, mi.StrType) and isinstance(value, int | float):
        return f"; quote it: '{describe(value)}'"
    numeric = isinstance(t, mi.IntType | mi.FloatType)
    if numeric and not explained and _number(value) and value == value:
        over = [(name, ok) for _, name, ok in _BOUNDS if name in ("le", "lt")]
        if any(getattr(t, n) is not None and not ok(value, getattr(t, n)) for n, ok in over):
            return "; that is over the limit (see Limits in docs/manifest.md)"
    if isinstance(t, mi.StrType) and isinstance(value, str) and len(value) > (t.max_length or 1e9):
        return f" ({len(value)} characters); shorten it"
    if isinstance(value, str) and isinstance(t, mi.LiteralType):
        close = difflib.get_close_matches(value, [str(v) for v in t.values], n=1)
        return f"; did you mean {close[0]!r}?" if close else ""
    return ""


def _fits(t: mi.Type, value: Any) -> bool:
    """Whether a raw value has the kind of ``t`` and meets its constraints."""
    if isinstance(t, mi.LiteralType):
        return value in t.values
    kind = _KINDS.get(type(t))
    if kind is not None and not isinstance(value, kind):
        return False
    if isinstance(t, mi.IntType | mi.FloatType):
        return (
            not isinstance(value, bool)
            and value == value  # not NaN
            and all(
                getattr(t, name) is None or ok(value, getattr(t, name)) for _, name, ok in _BOUNDS
            )
        )
    # The patterns are anchored for msgspec's re.search; fullmatch also refuses a final newline.
    if isinstance(t, mi.StrType) and t.pattern and not re.fullmatch(t.pattern.strip("^$"), value):
        return False
    if isinstance(t, mi.StrType | mi.DictType | mi.ListType | mi.VarTupleType):
        most = t.max_length
        return len(value) >= (t.min_length or 0) and (most is None or len(value) <= most)
    return True


class _Walker:
    """One walk over a document: the struct checks to apply and the problems found so far."""

    def __init__(self, struct_checks: Mapping[type, StructCheck]) -> None:
        self.struct_checks = struct_checks
        self.problems: list[str] = []

    def walk(self, value: Any, t: mi.Type, path: str, expected: str = "") -> Any:
        if isinstance(t, mi.Metadata):
            return self._walk_annotated(value, t, path, expected)
        if isinstance(t, mi.UnionType):
            if value is None and any(isinstance(x, mi.NoneType) for x in t.types):
                return None
            (option,) = (x for x in t.types if not isinstance(x, mi.NoneType))
            return self.walk(value, option, path, expected)
        if isinstance(t, mi.AnyType):
            return value
        if not _fits(t, value):
            got = f"{describe(value)}{_fix(t, value, bool(expected))}"
            wanted = expected or _expected(t, value)
            self.problems.append(f"{at(path)}: expected {wanted}, got {got}")
            return value
        if isinstance(t, mi.StructType):
            return self._walk_struct(value, t, path)
        if isinstance(t, mi.DictType):
            out = {}
            for key, item in value.items():
                key_walk = _Walker({})
                key_walk.walk(key, t.key_type, path)
                if key_walk.problems:
                    self.problems.append(
                        f"{join(path, key)}: invalid key; use {_expected(t.key_type)}"
                    )
                out[key] = self.walk(item, t.value_type, join(path, key))
            return out
        if isinstance(t, mi.ListType | mi.VarTupleType):
            return [self.walk(x, t.item_type, f"{path}[{i}]") for i, x in enumerate(value)]
        return value

    def _walk_annotated(self, value: Any, t: mi.Metadata, path: str, expected: str) -> Any:
        extra = t.extra or {}
        if "coerce" in extra:
            try:
                value = extra["coerce"](value)
            except ValueError as exc:
                self.problems.append(f"{at(path)}: {exc}")
                return value
        before = len(self.problems)
        value = self.walk(value, t.type, path, extra.get("expected", expected))
        if "check" in extra and len(self.problems) == before:
            problem = extra["check"](value)
            if problem:
                self.problems.append(f"{at(path)}: {problem}")
        return value

    def _walk_struct(self, value: dict[Any, Any], t: mi.StructType, path: str) -> dict[str, Any]:
        fields = {f.encode_name: f for f in t.fields}
        out = {}
        for key, item in value.items():
            field = fields.get(key) if isinstance(key, str) else None
            if field is not None:
                out[key] = self.walk(item, field.type, join(path, key))
                continue
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            fix = (
                f"did you mean {close[0]!r}?"
                if close
                else "expected one of " + ", ".join(map(repr, fields))
            )
            self.problems.append(f"{join(path, key)}: unknown key; {fix}")
        for f in t.fields:
            if f.required and f.encode_name not in value:
                missing = join(path, f.encode_name)
                self.problems.append(
                    f"{missing}: missing required key; expected {_expected(f.type)}"
                )
        if t.cls in self.struct_checks:
            self.struct_checks[t.cls](value, path, self.problems)
        return out
