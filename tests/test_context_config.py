"""A program reads the manifest's model section and each role's config, typed (``Context``)."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest

from asyncrl.dispatch.handles import Context
from asyncrl.errors import ConfigProblem
from asyncrl.manifest.model_section import ModelSpec
from asyncrl.roles.services.reward import Reward

ROLES = {
    "reward": {"class": "asyncrl.roles.services.reward:Reward", "config": {"verifier": "exact"}},
    "judge": {
        "class": "asyncrl.roles.services.reward:Reward",
        "config": {"verifier": "numeric", "tokenizer_path": "own/tokenizer"},
    },
    "echo": {"class": "", "config": {"x": 1}},
}
MODEL = {"config": {"model_type": "gpt2"}, "tokenizer": "examples/arith/tokenizer"}


class Settings(msgspec.Struct):
    tokenizer_path: str = ""
    model_config: dict[str, Any] = {}
    verifier: str = ""


def context(**kwargs: Any) -> Context:
    dispatcher = SimpleNamespace(groups={}, busy=lambda: {})
    return Context(cast(Any, dispatcher), run="t", run_dir=".", log=None, **kwargs)


def test_the_model_section_is_typed() -> None:
    ctx = context(model=MODEL, roles=ROLES)
    assert ctx.model == ModelSpec(config={"model_type": "gpt2"}, tokenizer=MODEL["tokenizer"])
    assert context().model == ModelSpec()


def test_a_role_config_is_its_config_class_with_the_model_section_filled_in() -> None:
    ctx = context(model=MODEL, roles=ROLES)
    reward = ctx.role_config("reward")
    assert isinstance(reward, Reward.Config)
    assert reward.verifier == "exact" and reward.tokenizer_path == MODEL["tokenizer"]
    # A role's own setting wins over the model section.
    assert ctx.role_config("judge").tokenizer_path == "own/tokenizer"
    assert ctx.role_config("judge", Settings) == Settings(
        tokenizer_path="own/tokenizer", model_config={"model_type": "gpt2"}, verifier="numeric"
    )
    assert ctx.role_config("echo") == {"x": 1}  # an external command role: its mapping


def test_an_unknown_role_or_a_bad_config_says_what_is_wrong() -> None:
    ctx = context(model=MODEL, roles=ROLES)
    with pytest.raises(
        KeyError,
        match="no role 'critic' in this run's manifest; the roles are: echo, judge, reward",
    ):
        ctx.role_config("critic")

    class Strict(msgspec.Struct):
        x: str

    with pytest.raises(
        ConfigProblem, match=r"roles.echo.config: Expected `str`, got `int` - at `\$.x`"
    ):
        ctx.role_config("echo", Strict)
    broken = context(roles={"r": {"class": "no.such.module:Role", "config": {}}})
    with pytest.raises(
        ConfigProblem, match=re.escape("roles.r.class 'no.such.module:Role' cannot be imported")
    ):
        broken.role_config("r")


def test_the_ppo_program_refuses_a_critic_whose_returns_differ_from_the_learners() -> None:
    from asyncrl.roles.program.programs import check_critic

    roles = {
        "learner": {"class": "asyncrl.roles.training.learner:Learner", "config": {"gamma": 0.9}},
        "critic": {"class": "asyncrl.roles.training.critic:Critic", "config": {}},
    }
    with pytest.raises(ValueError, match=r"gamma: learner 0\.9, critic 1\.0"):
        check_critic(context(roles=roles))
    roles["critic"]["config"] = {"gamma": 0.9}
    check_critic(context(roles=roles))


def test_a_role_is_reached_one_way_by_any_manifest_name_and_shadows_no_fact() -> None:
    """``ctx.roles[name]``: a role named like a fact of the context (``config``, ``model``,
    ``run``) or with a name that is no Python identifier is reached there, and the facts stay
    the run's."""
    names = ("config", "model", "run", "my-env")
    groups = {name: SimpleNamespace(name=name, replicas=[0]) for name in names}
    dispatcher = SimpleNamespace(groups=groups, busy=lambda: {})
    ctx = Context(
        cast(Any, dispatcher), run="t", run_dir=".", log=None, config={"steps": 3}, model=MODEL
    )
    assert [ctx.roles[name].name for name in names] == list(names)
    assert (
        ctx.config == {"steps": 3} and ctx.run == "t" and ctx.model.tokenizer == MODEL["tokenizer"]
    )
    assert sorted(ctx.roles) == ["config", "model", "my-env", "run"] and "critic" not in ctx.roles
    with pytest.raises(KeyError) as missing:
        ctx.roles["critic"]
    assert missing.value.args[0] == (
        "no role 'critic' in this run; the roles are: config, model, my-env, run"
    )
    # No second way: neither an attribute nor an item of the context is a role.
    with pytest.raises(AttributeError):
        print(cast(Any, ctx).config_role)
    with pytest.raises(TypeError):
        cast(Any, ctx)["config"]
