"""Checking the keys of a role's ``config`` against its ``Config`` class.

msgspec ignores keys a Struct does not declare unless the Struct says
``forbid_unknown_fields``, and a role without a ``Config`` gets its ``config`` as a plain dict it
never reads: either way a misspelt setting (``temprature: 0``) was accepted and silently had no
effect. ``Role.__init__`` refuses such keys with ``unknown_config_keys``, which names each by its
path in the manifest (``roles.rollout.config.sampling.temprature``) with the keys accepted there.

Importing this module imports neither torch nor user code.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any

import msgspec

__all__ = ["unknown_config_keys"]


def unknown_config_keys(
    config: Mapping[Any, Any], config_type: Any, path: str, role: str
) -> list[str]:
    """Each key of the raw ``config`` that ``config_type`` does not declare, with its path
    (``<path>.<key>``) and the keys accepted there; fields that hold a Struct (or
    ``Struct | None``) are checked the same way, a level down.

    Args:
        config: the role's raw ``config`` mapping.
        config_type: the role's ``Config`` (a msgspec Struct, a dataclass or an annotated
            class); None, for a role without one, accepts no key at all.
        path: where ``config`` is in the manifest, ``roles.<name>.config``.
        role: the name of the class the problems blame.

    Returns:
        One problem per unknown key; empty when every key is declared.
    """
    if config_type is None:
        return [
            f"{path}.{key}: unknown key; {role} has no Config, so it takes no config keys; "
            f"remove it, or declare a Config class in {role} with this field"
            for key in config
        ]
    accepted = _accepted_keys(config_type)
    if accepted is None:
        return []
    problems = []
    for key, value in config.items():
        where = f"{path}.{key}"
        if key not in accepted:
            close = difflib.get_close_matches(str(key), list(accepted), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            known = ", ".join(repr(k) for k in accepted) or "none"
            problems.append(f"{where}: unknown key; {hint}{role} accepts {known}")
            continue
        nested = _nested_struct(accepted[key])
        if nested is not None and isinstance(value, Mapping):
            problems += unknown_config_keys(value, nested, where, nested.__name__)
    return problems


def _hints(cls: type) -> dict[str, Any]:
    """The type hints of ``cls``, or {} when they cannot be resolved (a forward reference to a
    name that does not exist at module level): only the nesting check needs them."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # any error of evaluating a user's annotations
        return {}


def _accepted_keys(config_type: Any) -> dict[str, Any] | None:
    """The keys ``config_type`` accepts, each with its type hint (None when unknown); None when
    its keys cannot be known (not a class, or a class without annotations)."""
    if not isinstance(config_type, type):
        return None
    hints = _hints(config_type)
    if issubclass(config_type, msgspec.Struct):
        return {f.encode_name: hints.get(f.name) for f in msgspec.structs.fields(config_type)}
    if dataclasses.is_dataclass(config_type):
        return {f.name: hints.get(f.name) for f in dataclasses.fields(config_type)}
    names = [
        n for n, t in hints.items() if n[:1] != "_" and typing.get_origin(t) is not typing.ClassVar
    ]
    return {n: hints[n] for n in names} or None


def _nested_struct(hint: Any) -> type | None:
    """The Struct a field holds, directly or as ``Struct | None``; None for anything else."""
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
        return hint
    options = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(options) == 1 and typing.get_origin(hint) in (typing.Union, types.UnionType):
        return _nested_struct(options[0])
    return None
