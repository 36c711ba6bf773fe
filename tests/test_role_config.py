"""A role refuses the config keys its Config does not declare, by their path in the manifest,
with the keys it accepts: a misspelt setting is never silently ignored."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pytest

from asyncrl.errors import ConfigProblem
from asyncrl.role import Role, RoleContext


class Sampling(msgspec.Struct):
    temperature: float = 1.0
    top_p: float = 1.0


class Plain(Role):
    """No Config."""


class Open(Role):
    class Config(msgspec.Struct):  # no forbid_unknown_fields: msgspec alone would ignore keys
        temperature: float = 1.0
        sampling: Sampling | None = None
        named: int = msgspec.field(default=0, name="alias")


class Strict(Role):
    class Config(msgspec.Struct, forbid_unknown_fields=True):
        steps: int = 1


@dataclasses.dataclass
class DataConfig:
    lr: float = 1e-3


class WithDataclass(Role):
    Config = DataConfig


def refused(cls: type[Role], config: Any, name: str = "r") -> str:
    with pytest.raises(ConfigProblem) as info:
        cls(RoleContext(name=name, config=config))
    return str(info.value)


def test_a_role_without_config_refuses_every_key_and_takes_none() -> None:
    assert refused(Plain, {"bogus": 1, "other": 2}, "counter") == (
        "roles.counter.config.bogus: unknown key; Plain has no Config, so it takes no config "
        "keys; remove it, or declare a Config class in Plain with this field\n"
        "  roles.counter.config.other: unknown key; Plain has no Config, so it takes no config "
        "keys; remove it, or declare a Config class in Plain with this field"
    )
    assert Plain(RoleContext(config={})).config == {}
    assert Plain(RoleContext(config=None)).config is None


def test_an_unknown_key_is_named_by_its_path_with_the_keys_accepted() -> None:
    assert refused(Open, {"temprature": 0.5}, "rollout") == (
        "roles.rollout.config.temprature: unknown key; did you mean 'temperature'? Open "
        "accepts 'temperature', 'sampling', 'alias'"
    )
    assert refused(Open, {"sampling": {"top_k": 3}}, "rollout") == (
        "roles.rollout.config.sampling.top_k: unknown key; did you mean 'top_p'? Sampling "
        "accepts 'temperature', 'top_p'"
    )
    assert refused(Strict, {"step": 2}) == (
        "roles.r.config.step: unknown key; did you mean 'steps'? Strict accepts 'steps'"
    )
    assert refused(WithDataclass, {"lr": 0.1, "wd": 0.1}) == (
        "roles.r.config.wd: unknown key; WithDataclass accepts 'lr'"
    )


def test_declared_keys_are_decoded_as_before() -> None:
    role = Open(RoleContext(config={"alias": 3, "sampling": {"top_p": 0.5}, "temperature": 0}))
    assert role.config == Open.Config(temperature=0.0, sampling=Sampling(top_p=0.5), named=3)
    assert Strict(RoleContext(config=Strict.Config(steps=4))).config.steps == 4
    assert WithDataclass(RoleContext(config={"lr": 0.1})).config == DataConfig(lr=0.1)
    with pytest.raises(msgspec.ValidationError, match="Expected `int`, got `str`"):
        Strict(RoleContext(config={"steps": "x"}))
