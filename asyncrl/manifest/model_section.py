"""The manifest's ``model`` section: one model and one tokenizer that every role inherits.

A run usually trains one policy, and several roles load it (rollout, learner, reference) or its
tokenizer (prompt source, reward, learner). Rather than repeat the path in each role's
``config``, the manifest says it once:

    model:
      path: checkpoints/qwen-0.5b     # or config: {model_type: gpt2, ...} for random weights
      tokenizer: checkpoints/qwen-0.5b

The convention is by field name, so the runtime needs to know nothing of particular roles. Each
value fills the field of the same meaning in a role's ``Config`` (``FIELDS``): ``path`` fills
``model_path``, ``config`` fills ``model_config`` and ``tokenizer`` fills ``tokenizer_path``,
in every role whose ``Config`` declares that field and whose ``config`` does not set it.
``model_path`` and ``model_config`` are one choice (a checkpoint, or a config for random
weights): a role that sets either of them gets neither. A ``Config`` that should take only some
of these (a reward role's ``model_path`` is a reward model, not the policy) lists the fields it
takes in a class variable ``inherits``.

The node agent validates the section with the manifest, without importing anything; each role
process fills its own config (``inherited_config``) from its ``Config`` class before
validating it. External ``command`` roles get their ``config`` as written: the agent does not
know their fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

__all__ = ["FIELDS", "ModelSpec", "inherited_config", "inherited_fields", "model_problem"]

FIELDS: dict[str, str] = {
    "path": "model_path",
    "config": "model_config",
    "tokenizer": "tokenizer_path",
}
"""Each key of the ``model`` section, and the ``Config`` field it fills."""

_ONE_CHOICE = ("model_path", "model_config")


class ModelSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The model and tokenizer the roles inherit (the manifest's ``model`` section).

    Attributes:
        path: a checkpoint (a local directory or a hub name) loaded with ``from_pretrained``;
            fills ``model_path``.
        config: or a transformers config as a mapping (``model_type`` plus fields), for a
            model built with random weights; fills ``model_config``.
        tokenizer: the tokenizer's directory or hub name; fills ``tokenizer_path``.
    """

    path: str = ""
    config: dict[str, Any] = {}
    tokenizer: str = ""


def model_problem(value: Mapping[Any, Any], path: str) -> str | None:
    """The cross-key problem of a raw ``model`` section at ``path``, or None."""
    if value.get("path") and value.get("config"):
        return (
            f"{path}: both 'path' and 'config' are given; keep one (a checkpoint to load, or a "
            "config for random weights)"
        )
    return None


def inherited_fields(config_type: type) -> set[str]:
    """The fields of ``config_type`` that the model section may fill: those of ``FIELDS`` it
    declares, or of its class variable ``inherits`` when it has one."""
    fields = set(getattr(config_type, "__struct_fields__", ()))
    if not fields:
        hints = getattr(config_type, "__annotations__", {})
        fields = {name for name in hints if not name.startswith("_")}
    taken = getattr(config_type, "inherits", None)
    wanted = set(FIELDS.values()) if taken is None else set(taken)
    return fields & wanted


def inherited_config(
    config: Mapping[str, Any], config_type: type | None, model: Mapping[str, Any]
) -> dict[str, Any]:
    """``config`` with the fields it leaves unset filled from the ``model`` section.

    Args:
        config: the role's ``config`` mapping from the manifest.
        config_type: the role's ``Config`` class (a msgspec Struct or any annotated class);
            None: nothing is filled.
        model: the manifest's ``model`` section, as a mapping (``ModelSpec`` as builtins).

    Returns:
        A new mapping: ``config`` plus each field ``config_type`` declares (and takes, when it
        lists ``inherits``) that ``config`` does not set and the section gives a value for.
        A config that sets ``model_path`` or ``model_config`` gets neither.
    """
    out = dict(config)
    if config_type is None:
        return out
    declared = inherited_fields(config_type)
    chosen = any(name in config for name in _ONE_CHOICE)
    for key, field in FIELDS.items():
        value = model.get(key)
        if not value or field not in declared or field in config:
            continue
        if chosen and field in _ONE_CHOICE:
            continue
        out[field] = value
    return out
