"""The role manifest: typed values with defaults, one report of every problem, --set overrides."""

from __future__ import annotations

import os
import pathlib
import pickle
import re
import subprocess
import sys
from typing import ClassVar

import msgspec
import pytest

from asyncrl.errors import AsyncrlError
from asyncrl.manifest.load import (
    DriverSpec,
    Manifest,
    ManifestError,
    ModelSpec,
    Placement,
    RoleSpec,
    RunSpec,
    Supervision,
    load_manifest,
    parse_manifest,
    resolve_run_dir,
)
from asyncrl.manifest.model_section import inherited_config
from asyncrl.manifest.pipeline_section import PipelineSpec
from asyncrl.role import Delivery, Role, endpoint
from tests.conftest import ROOT

MINIMAL = """\
run:
  name: demo
  program: examples.demo.flow
roles:
  rollout:
    class: mypkg.rollout:Rollout
"""

FULL = """\
run:
  name: grpo-1
  run_dir: /tmp/runs/grpo-1
  program: examples/grpo/flow.py:train
  env: {HF_HOME: /data/hf}
driver:
  threads: 2
  env: {LOG_LEVEL: debug}
  supervision: {max_restarts: 0}
roles:
  rollout:
    class: mypkg.rollout:Rollout
    replicas: 4
    capacity: 8
    threads: 2
    placement: {node: 1, device: "cuda:0"}
    env: {VLLM_USE_V1: "1"}
    config: {model: tiny, sampling: {temperature: 0.7, top_p: 1}}
    supervision:
      strategy: one_for_all
      max_restarts: 3
      period_s: 30
      backoff_initial_s: 0.5
      backoff_max_s: 10.0
      heartbeat_interval_s: 0.5
      liveness: 5
      startup_timeout_s: 600
      shutdown_timeout_s: 2.5
  reward:
    command: ./reward-server --port 0 --name "exact match"
  learner:
    class: hf-learner
"""


# The pipeline section grows; its first nine keys are fixed.
_PIPELINE_KEYS = [f.encode_name for f in msgspec.structs.fields(PipelineSpec)]


def _problems(text: str, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, "m.yaml", overrides or [])
    return info.value.problems


def test_minimal_manifest_gets_every_default() -> None:
    manifest = parse_manifest(MINIMAL)
    assert manifest == Manifest(
        run=RunSpec(name="demo", run_dir="runs/demo", program="examples.demo.flow:main", env={}),
        driver=DriverSpec(threads=1, env={}, supervision=Supervision()),
        roles={
            "rollout": RoleSpec(
                cls="mypkg.rollout:Rollout",
                command=None,
                replicas=1,
                capacity=1,
                threads=1,
                placement=Placement(node=0, device="cpu"),
                env={},
                config={},
                supervision=Supervision(),
            )
        },
    )
    assert msgspec.structs.asdict(Supervision()) == {
        "strategy": "one_for_one",
        "max_restarts": 5,
        "period_s": 60.0,
        "backoff_initial_s": 0.1,
        "backoff_max_s": 5.0,
        "heartbeat_interval_s": 1.0,
        "liveness": 10,
        "hang_after_s": 300.0,
        "warn_after_s": 5.0,
        "startup_timeout_s": 120.0,
        "shutdown_timeout_s": 5.0,
        "standby": False,
        "regrow": True,
    }


def test_full_manifest_round_trips_to_typed_values() -> None:
    manifest = parse_manifest(FULL)
    assert manifest == Manifest(
        run=RunSpec(
            name="grpo-1",
            run_dir="/tmp/runs/grpo-1",
            program="examples/grpo/flow.py:train",
            env={"HF_HOME": "/data/hf"},
        ),
        driver=DriverSpec(
            threads=2, env={"LOG_LEVEL": "debug"}, supervision=Supervision(max_restarts=0)
        ),
        roles={
            "rollout": RoleSpec(
                cls="mypkg.rollout:Rollout",
                replicas=4,
                capacity=8,
                threads=2,
                placement=Placement(node=1, device="cuda:0"),
                env={"VLLM_USE_V1": "1"},
                config={"model": "tiny", "sampling": {"temperature": 0.7, "top_p": 1}},
                supervision=Supervision(
                    strategy="one_for_all",
                    max_restarts=3,
                    period_s=30.0,
                    backoff_initial_s=0.5,
                    backoff_max_s=10.0,
                    heartbeat_interval_s=0.5,
                    liveness=5,
                    startup_timeout_s=600.0,
                    shutdown_timeout_s=2.5,
                ),
            ),
            "reward": RoleSpec(command=("./reward-server", "--port", "0", "--name", "exact match")),
            "learner": RoleSpec(cls="hf-learner"),
        },
    )
    assert type(manifest.roles["rollout"].supervision.period_s) is float
    assert manifest.role_names() == ["rollout", "reward", "learner"]
    with pytest.raises(AttributeError):
        manifest.run.name = "other"  # type: ignore[misc]


def test_role_names_keep_the_order_of_the_file() -> None:
    text = "run: {name: r, program: p}\nroles:\n  zeta: {class: 'a:Z'}\n  alpha: {command: [x]}\n"
    assert parse_manifest(text).role_names() == ["zeta", "alpha"]


BAD = """\
run:
  name: my demo
  program: examples/demo/flow:main
  env: {SEED: 1}
driver:
  thread: 2
  supervision: {backoff_initial_s: 10}
roles:
  rollout:
    class: mypkg.rollout.Rollout
    replcas: 4
    replicas: -2
    capacity: "4"
    placement: {node: -1, device: "cuda 0"}
    supervision:
      strategy: one_for_none
      period_s: 0
      backoff_initial_s: 2.0
      backoff_max_s: 1.0
      liveness: true
      colour: blue
  reward:
    config: {scale: 0.5}
  ref:
    class: mypkg.ref:Reference
    command: "python 'ref.py"
  my role:
    command: []
    env: null
"""


BAD_REPORT = """\
manifest examples/bad.yaml has 22 problems:
  run.name: expected a name of letters, digits, '_' and '-' that does not start with '-', got 'my demo'
  run.program: expected 'module:function' or 'path/to/file.py:function', got 'examples/demo/flow:main'; a file path must end in '.py'
  run.env.SEED: expected a string, got 1; quote it: '1'
  driver.thread: unknown key; did you mean 'threads'?
  driver.supervision.backoff_max_s: expected a number >= backoff_initial_s (10), got 5.0 (the default); raise it or lower backoff_initial_s
  roles.rollout.class: expected 'module:Class' or a registered role name, got 'mypkg.rollout.Rollout'; did you mean 'mypkg.rollout:Rollout'?
  roles.rollout.replcas: unknown key; did you mean 'replicas'?
  roles.rollout.replicas: expected an integer >= 1, got -2
  roles.rollout.capacity: expected an integer from 1 to 65536, got '4'; write it as a plain number, such as 4
  roles.rollout.placement.node: expected an integer >= 0, got -1
  roles.rollout.placement.device: expected 'cpu', 'cuda', 'cuda:N' or another plugin's device string, got 'cuda 0'
  roles.rollout.supervision.strategy: expected one of 'one_for_all', 'one_for_one', 'rest_for_one', got 'one_for_none'; did you mean 'one_for_one'?
  roles.rollout.supervision.period_s: expected a number > 0, got 0
  roles.rollout.supervision.liveness: expected an integer from 1 to 1000, got true
  roles.rollout.supervision.colour: unknown key; expected one of 'strategy', 'max_restarts', 'period_s', 'backoff_initial_s', 'backoff_max_s', 'heartbeat_interval_s', 'liveness', 'hang_after_s', 'warn_after_s', 'startup_timeout_s', 'shutdown_timeout_s', 'standby', 'regrow'
  roles.rollout.supervision.backoff_max_s: expected a number >= backoff_initial_s (2.0), got 1.0; raise it or lower backoff_initial_s
  roles.reward: neither 'class' nor 'command' is given; add 'class: module:Class' for a Python role or 'command: [program, args...]' for an external one
  roles.ref.command: cannot split "python 'ref.py" into arguments (No closing quotation); close the quote or give a list
  roles.ref: both 'class' and 'command' are given; keep exactly one
  roles['my role']: invalid key; use a name of letters, digits, '_' and '-' that does not start with '-'
  roles['my role'].command: expected a non-empty list of strings, or one string, got an empty list
  roles['my role'].env: expected a mapping, got null; write {} for an empty mapping, or remove the key"""  # noqa: E501


def test_every_problem_in_one_report() -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(BAD, "examples/bad.yaml")
    error = info.value
    assert isinstance(error, AsyncrlError)
    assert error.source == "examples/bad.yaml"
    assert str(error) == BAD_REPORT
    assert len(error.problems) == 22
    assert str(error).splitlines()[1:] == ["  " + p for p in error.problems]


def test_one_problem_is_counted_in_the_singular() -> None:
    text = MINIMAL.replace(
        "class: mypkg.rollout:Rollout", "class: mypkg.rollout:Rollout\n    replicas: 0"
    )
    with pytest.raises(ManifestError) as info:
        parse_manifest(text)
    assert str(info.value) == (
        "manifest <string> has 1 problem:\n"
        "  roles.rollout.replicas: expected an integer >= 1, got 0"
    )


def test_missing_sections_and_keys() -> None:
    assert _problems("driver: {threads: 1}\n") == [
        "run: missing required key; expected a mapping with the keys 'name', 'program'",
        "roles: missing required key; expected a mapping of role names to roles, at least one",
    ]
    assert _problems("run: {}\nroles: {}\n") == [
        "run.name: missing required key; expected a name of letters, digits, '_' and '-' that "
        "does not start with '-'",
        "run.program: missing required key; "
        "expected 'module:function' or 'path/to/file.py:function'",
        "roles: expected a mapping of role names to roles, at least one, got an empty mapping",
    ]
    assert _problems("run: [a]\nroles:\n") == [
        "run: expected a mapping with the keys 'name', 'program', got a list",
        "roles: expected a mapping of role names to roles, at least one, got null",
    ]


def test_unknown_keys_suggest_the_nearest_one() -> None:
    text = MINIMAL + "    supervison: {}\nrols: {}\n"
    assert _problems(text) == [
        "roles.rollout.supervison: unknown key; did you mean 'supervision'?",
        "rols: unknown key; did you mean 'roles'?",
    ]
    assert _problems(MINIMAL + "    xyz: 1\n") == [
        "roles.rollout.xyz: unknown key; expected one of 'class', 'command', 'replicas', "
        "'capacity', 'threads', 'placement', 'env', 'config', 'supervision', 'endpoints'"
    ]


def test_yaml_syntax_error_names_line_and_column() -> None:
    text = "run:\n  name: demo\n   program: x\n"
    assert _problems(text) == [
        "line 3, column 11: mapping values are not allowed here; fix the YAML syntax there"
    ]
    text = "run:\n  name: demo\n  env: {A: 1\nroles: {}\n"
    assert _problems(text) == [
        "line 4, column 6: expected ',' or '}', but got ':' "
        "(while parsing a flow mapping at line 3); fix the YAML syntax there"
    ]


def test_unsafe_yaml_tags_are_refused() -> None:
    assert _problems("run: !!python/object/apply:os.system [ls]\n") == [
        "line 1, column 6: the tag '!!python/object/apply:os.system' is not plain YAML (tags "
        "that build Python objects are refused); remove the tag and write the value itself"
    ]


def test_duplicate_keys_are_problems() -> None:
    text = MINIMAL + "  rollout:\n    class: other:Rollout\n"
    assert _problems(text) == [
        "line 7, column 3: duplicate key 'rollout', first given at line 5; remove one of them"
    ]


def test_top_level_must_be_a_mapping() -> None:
    assert _problems("- run\n- roles\n") == [
        "(top level): expected a mapping with the sections 'run', 'roles' and, optionally, "
        "'driver', 'model' and 'pipeline', got a list"
    ]
    assert _problems("# nothing yet\n") == [
        "(top level): the manifest is empty; expected a mapping with the sections 'run', "
        "'roles' and, optionally, 'driver', 'model' and 'pipeline'"
    ]


TWO_ROLES = "run: {name: x, program: a:b}\nroles: {r: {class: a:B}}\n"


def test_the_model_section_is_typed_and_optional() -> None:
    assert parse_manifest(TWO_ROLES).model == ModelSpec(path="", config={}, tokenizer="")
    text = TWO_ROLES + "model: {config: &m {model_type: gpt2, n_layer: 2}, tokenizer: tok}\n"
    assert parse_manifest(text).model == ModelSpec(
        config={"model_type": "gpt2", "n_layer": 2}, tokenizer="tok"
    )
    overridden = parse_manifest(TWO_ROLES, overrides=["model.path=ckpt/step-50"])
    assert overridden.model == ModelSpec(path="ckpt/step-50")


def test_model_section_problems_are_reported_with_their_paths() -> None:
    text = TWO_ROLES + "model: {pth: ckpt, tokenizer: 3}\n"
    assert _problems(text) == [
        "model.pth: unknown key; did you mean 'path'?",
        "model.tokenizer: expected a string, got 3; quote it: '3'",
    ]
    text = TWO_ROLES + "model: {path: ckpt, config: {model_type: gpt2}}\n"
    assert _problems(text) == [
        "model: both 'path' and 'config' are given; keep one (a checkpoint to load, or a "
        "config for random weights)"
    ]
    assert _problems(TWO_ROLES + "model: ckpt\n") == [
        "model: expected a mapping with the keys 'path', 'config' and 'tokenizer', such as "
        "{path: checkpoints/base, tokenizer: checkpoints/base}, got 'ckpt'"
    ]


class _PolicyConfig(msgspec.Struct, forbid_unknown_fields=True):
    model_path: str = ""
    model_config: dict[str, object] = {}
    tokenizer_path: str = ""
    lr: float = 1e-3


class _TokenizerOnly(msgspec.Struct):
    inherits: ClassVar[tuple[str, ...]] = ("tokenizer_path",)
    model_path: str = ""  # a model of its own: not the policy
    tokenizer_path: str = ""


MODEL = {"path": "ckpt", "config": {}, "tokenizer": "tok"}


def test_a_role_inherits_the_model_fields_its_config_declares_and_leaves_unset() -> None:
    assert inherited_config({"lr": 0.1}, _PolicyConfig, MODEL) == {
        "lr": 0.1,
        "model_path": "ckpt",
        "tokenizer_path": "tok",
    }
    # Its own value wins; an empty value in the section fills nothing.
    assert inherited_config({"tokenizer_path": "mine"}, _PolicyConfig, MODEL) == {
        "tokenizer_path": "mine",
        "model_path": "ckpt",
    }
    assert inherited_config({}, _PolicyConfig, {"path": "", "config": {}, "tokenizer": ""}) == {}
    # A role without a Config, or one that declares none of the fields, gets nothing.
    assert inherited_config({"a": 1}, None, MODEL) == {"a": 1}
    assert inherited_config({}, Placement, MODEL) == {}


def test_model_path_and_model_config_are_one_choice() -> None:
    built = {"model_config": {"model_type": "gpt2"}}
    assert inherited_config(built, _PolicyConfig, MODEL) == {**built, "tokenizer_path": "tok"}
    random_weights = {"path": "", "config": {"model_type": "gpt2"}, "tokenizer": ""}
    assert inherited_config({"model_path": "own"}, _PolicyConfig, random_weights) == {
        "model_path": "own"
    }
    assert inherited_config({}, _PolicyConfig, random_weights) == {
        "model_config": {"model_type": "gpt2"}
    }


def test_a_config_that_lists_inherits_takes_only_those_fields() -> None:
    assert inherited_config({}, _TokenizerOnly, MODEL) == {"tokenizer_path": "tok"}
    assert msgspec.convert(inherited_config({}, _TokenizerOnly, MODEL), _TokenizerOnly) == (
        _TokenizerOnly(model_path="", tokenizer_path="tok")
    )


def test_pipeline_section_problems_are_reported_with_their_paths() -> None:
    text = (
        "run: {name: x, program: a:b}\nroles: {r: {class: a:B}}\n"
        "pipeline: {mode: asink, eta: -1, straggler: {policy: emit, k_min: 1}, bogus: 1}\n"
    )
    assert _problems(text) == [
        "pipeline.mode: expected 'sync' or 'async', got 'asink'",
        "pipeline.eta: expected an integer >= 0, got -1",
        "pipeline.straggler.k_min: expected an integer >= 2, got 1",
        "pipeline.straggler.deadline_s: policy 'emit' needs a deadline > 0 (seconds from a "
        "group's admission to its release); set it, or use policy 'wait'",
        "pipeline.bogus: unknown key; expected one of 'mode', 'eta', 'over_eta', 'correction', "
        "'importance_cap', 'overprovision', 'group_affinity', 'straggler', 'running_stats'"
        + "".join(f", {key!r}" for key in _PIPELINE_KEYS[9:]),
    ]


def test_pipeline_section_defaults_to_sync_and_takes_overrides() -> None:
    text = "run: {name: x, program: a:b}\nroles: {r: {class: a:B}}\n"
    assert parse_manifest(text).pipeline.mode == "sync"
    m = parse_manifest(
        text,
        overrides=[
            "pipeline.mode=async",
            "pipeline.straggler.policy=drop",
            "pipeline.straggler.deadline_s=1.5",
        ],
    )
    assert (m.pipeline.mode, m.pipeline.window_eta, m.pipeline.straggler.policy) == (
        "async",
        2,
        "drop",
    )
    assert m.pipeline.straggler.deadline_s == 1.5


SHARDED = (
    "run: {name: x, program: a:b}\nroles: {rollout: {class: a:B, replicas: 4}, reward: "
    "{class: a:R}}\npipeline: {mode: async, shards: 2}\n"
)


def test_pipeline_shards_adds_the_dispatch_shards_role() -> None:
    m = parse_manifest(SHARDED)
    assert m.pipeline.shards == 2
    assert list(m.roles) == ["rollout", "reward", "shards"]
    shards = m.roles["shards"]
    assert (shards.cls, shards.replicas, shards.capacity, shards.config) == (
        "asyncrl.roles.sampling.shard:DispatchShard",
        2,
        1024,
        {},
    )
    # What roles.shards gives is its own; the key fills in only what it leaves out.
    given = parse_manifest(
        SHARDED,
        overrides=[
            "roles.shards.capacity=8",
            "roles.shards.config.timeout_s=30",
            "roles.shards.class=my.pkg:Shard",
        ],
    ).roles["shards"]
    assert (given.cls, given.replicas, given.capacity, given.config) == (
        "my.pkg:Shard",
        2,
        8,
        {"timeout_s": 30},
    )
    # No shards, no role: the driver dispatches.
    assert list(parse_manifest(SHARDED, overrides=["pipeline.shards=0"]).roles) == [
        "rollout",
        "reward",
    ]
    assert (
        parse_manifest("run: {name: x, program: a:b}\nroles: {r: {class: a:B}}\n").pipeline.shards
        == 0
    )


@pytest.mark.parametrize("bad", ["-1", "two", "true", "1.5", "4097", "1000000"])
def test_a_bad_pipeline_shards_is_refused_naming_the_key(bad: str) -> None:
    # Above 4096 (the shards' role's replicas limit) it is the key one wrote that is refused.
    shown = {"two": "'two'"}.get(bad, bad)
    assert _problems(SHARDED, [f"pipeline.shards={bad}"]) == [
        "pipeline.shards: expected an integer from 0 to 4096, the dispatch shards to run (0: "
        f"none, the driver dispatches every sample), got {shown} (from --set "
        f"pipeline.shards={bad})"
    ]


def test_pipeline_shards_refuses_a_shard_role_of_another_size_not_the_prompt_schedule() -> None:
    assert _problems(SHARDED, ["roles.shards.replicas=3"]) == [
        "roles.shards.replicas: 3, but pipeline.shards is 2: the dispatch shards' role has one "
        "replica a shard; remove roles.shards.replicas or set it to 2 (from --set "
        "roles.shards.replicas=3)"
    ]
    scheduled = [
        "pipeline.drop_uniform=true",
        "pipeline.schedule.probe=2",
        "pipeline.schedule.skip_uniform=true",
    ]
    pipeline = parse_manifest(SHARDED, overrides=scheduled).pipeline
    schedule = pipeline.schedule
    assert (pipeline.shards, schedule.probe, schedule.skip_uniform) == (2, 2, True)
    # A bool is the replicas check's own to refuse, once (YAML's true is no count of shards).
    assert _problems(SHARDED, ["roles.shards.replicas=true"]) == [
        "roles.shards.replicas: expected an integer from 1 to 4096, got true (from --set "
        "roles.shards.replicas=true)"
    ]


def test_pipeline_shards_needs_as_many_rollout_replicas_and_a_reward_role() -> None:
    # The main job has one rollout replica: two shards are refused at load, not in their setup.
    main = (pathlib.Path(__file__).parents[2] / "examples" / "arith" / "bc_grpo.yaml").read_text()
    assert _problems(main, ["pipeline.shards=2"]) == [
        "pipeline.shards: 2 dispatch shards need at least as many replicas of roles.rollout, "
        "which has 1: set pipeline.shards to at most 1, or roles.rollout.replicas to at least 2 "
        "(from --set pipeline.shards=2)"
    ]
    # Its prompt schedule (probes, uniform skips) as shipped.
    parse_manifest(main, overrides=["pipeline.shards=2", "roles.rollout.replicas=2"])
    # Every problem at once: no rollout role of the configured name, no reward role, too few.
    text = (
        "run: {name: x, program: a:b}\nroles: {actor: {class: a:B}}\n"
        "pipeline: {mode: async, shards: 3}\n"
    )
    assert _problems(text) == [
        "roles.shards.config.rollout: the run has no role 'rollout' (roles: actor, shards); 3 "
        "dispatch shards split the replicas of a rollout role: add it, or name it in "
        "roles.shards.config.rollout",
        "roles.shards.config.reward: the run has no role 'reward' (roles: actor, shards); the "
        "dispatch shards score each sample with it: add it, name the reward role in "
        "roles.shards.config.reward, or give roles.shards.config.score",
    ]
    assert _problems(text, ["roles.shards.config.rollout=actor"]) == [
        "pipeline.shards: 3 dispatch shards need at least as many replicas of roles.actor, "
        "which has 1: set pipeline.shards to at most 1, or roles.actor.replicas to at least 3",
        "roles.shards.config.reward: the run has no role 'reward' (roles: actor, shards); the "
        "dispatch shards score each sample with it: add it, name the reward role in "
        "roles.shards.config.reward, or give roles.shards.config.score",
    ]
    # A scorer of the shard's own needs no reward role; a named rollout role with enough.
    fine = ["roles.shards.config.rollout=actor", "roles.actor.replicas=3"]
    parse_manifest(text, overrides=[*fine, "roles.shards.config.score=m:score"])


@pytest.mark.parametrize(
    ("program", "normalized"),
    [
        ("flow", "flow:main"),
        ("examples.demo.flow:train", "examples.demo.flow:train"),
        ("examples/demo/flow.py", "examples/demo/flow.py:main"),
        ("../my flows/flow.py:run_it", "../my flows/flow.py:run_it"),
    ],
)
def test_program_forms(program: str, normalized: str) -> None:
    text = MINIMAL.replace("examples.demo.flow", f"'{program}'")
    assert parse_manifest(text).run.program == normalized


def test_bad_program_and_class_syntax() -> None:
    text = MINIMAL.replace("examples.demo.flow", "'flow.main()'").replace(
        "mypkg.rollout:Rollout", "'mypkg:'"
    )
    assert _problems(text) == [
        "run.program: expected 'module:function' or 'path/to/file.py:function', got 'flow.main()'",
        "roles.rollout.class: expected 'module:Class' or a registered role name, got 'mypkg:'",
    ]


def test_command_string_is_split_and_null_class_counts_as_absent() -> None:
    text = "run: {name: r, program: p}\nroles:\n"
    text += "  ext: {class: null, command: 'bin/role --x \"a b\"'}\n"
    assert parse_manifest(text).roles["ext"].command == ("bin/role", "--x", "a b")
    text = "run: {name: r, program: p}\nroles:\n  ext: {command: [bin/role, 3]}\n"
    assert _problems(text) == ["roles.ext.command[1]: expected a string, got 3; quote it: '3'"]


def test_exponent_numbers_are_numbers_and_nan_is_refused() -> None:
    text = MINIMAL + "    supervision: {period_s: 1e3, liveness: .nan}\n"
    assert _problems(text) == [
        "roles.rollout.supervision.liveness: expected an integer from 1 to 1000, got nan",
    ]
    text = MINIMAL + "    supervision: {period_s: 1e3}\n"
    assert parse_manifest(text).roles["rollout"].supervision.period_s == 1000.0


def test_overrides_parse_yaml_scalars() -> None:
    manifest = parse_manifest(
        MINIMAL,
        overrides=[
            "roles.rollout.replicas=4",
            "run.name=x",
            "roles.rollout.config.flag=true",
            "roles.rollout.config.sizes=[1, 2]",
            "roles.rollout.config.scale=0.5",
            "roles.rollout.config.label=a=b",
            "roles.rollout.config.empty=",
            "roles.rollout.command=null",
        ],
    )
    assert manifest.run.name == "x"
    assert manifest.run.run_dir == "runs/x"
    assert manifest.roles["rollout"].replicas == 4
    assert manifest.roles["rollout"].config == {
        "flag": True,
        "sizes": [1, 2],
        "scale": 0.5,
        "label": "a=b",
        "empty": None,
    }


def test_overrides_create_mappings_and_the_last_one_wins() -> None:
    manifest = parse_manifest(
        MINIMAL,
        overrides=[
            "roles.reward.class=mypkg.reward:Reward",
            "roles.reward.config.scale=0.5",
            "roles.reward.placement.device=cuda:1",
            "roles.rollout.threads=2",
            "roles.rollout.threads=3",
        ],
    )
    assert manifest.role_names() == ["rollout", "reward"]
    assert manifest.roles["reward"] == RoleSpec(
        cls="mypkg.reward:Reward", config={"scale": 0.5}, placement=Placement(device="cuda:1")
    )
    assert manifest.roles["rollout"].threads == 3


def test_override_problems_are_reported_with_the_others() -> None:
    overrides = [
        "roles.rollout.replicas",
        "=3",
        "roles..x=1",
        "roles.rollout.class.x=1",
        "run.env.X=[1,2",
        "roles.rollout.threads=0",
        "roles.rollout.capacity=1",
        "roles.rollout.capacity=-1",
    ]
    assert _problems(MINIMAL + "    replicas: 0\n", overrides) == [
        "--set roles.rollout.replicas: no '=' in it; "
        "write key=value, e.g. roles.rollout.replicas=4",
        "--set =3: empty key; write a dotted path, e.g. roles.rollout.replicas=4",
        "--set roles..x=1: empty key; write a dotted path, e.g. roles.rollout.replicas=4",
        "--set roles.rollout.class.x=1: roles.rollout.class is 'mypkg.rollout:Rollout', not a "
        "mapping; set keys only inside mappings",
        "--set run.env.X=[1,2: the value is not valid YAML (expected ',' or ']', but got "
        "'<stream end>'); quote it",
        "roles.rollout.replicas: expected an integer >= 1, got 0",
        "roles.rollout.threads: expected an integer >= 1, got 0 "
        "(from --set roles.rollout.threads=0)",
        "roles.rollout.capacity: expected an integer >= 1, got -1 "
        "(from --set roles.rollout.capacity=-1)",
    ]


def test_override_problems_are_reported_even_when_the_yaml_is_broken() -> None:
    assert _problems("run: [\n", ["x"]) == [
        "line 2, column 1: expected the node content, but found '<stream end>' "
        "(while parsing a flow node); fix the YAML syntax there",
        "--set x: no '=' in it; write key=value, e.g. roles.rollout.replicas=4",
    ]


def test_overrides_must_be_a_list_not_one_string() -> None:
    with pytest.raises(TypeError, match="overrides is a list of 'key=value' strings"):
        parse_manifest(MINIMAL, overrides="run.name=x")


def test_load_manifest_reads_the_file(tmp_path: pathlib.Path) -> None:
    path = str(tmp_path / "m.yaml")
    with open(path, "w") as f:
        f.write(MINIMAL)
    assert load_manifest(path, ["roles.rollout.replicas=2"]).roles["rollout"].replicas == 2
    with open(path, "a") as f:
        f.write("    replicas: -2\n")
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert str(info.value).splitlines()[0] == f"manifest {path} has 1 problem:"
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ManifestError) as info:
        load_manifest(missing)
    assert info.value.problems == [
        "(top level): cannot read the file (No such file or directory); check the path"
    ]
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_resolve_run_dir(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cwd = os.getcwd()
    assert resolve_run_dir(parse_manifest(MINIMAL)) == os.path.join(cwd, "runs", "demo")
    manifest = parse_manifest(MINIMAL, overrides=["run.run_dir=out/../elsewhere"])
    assert resolve_run_dir(manifest) == os.path.join(cwd, "elsewhere")
    manifest = parse_manifest(MINIMAL, overrides=["run.run_dir=/srv/runs/a"])
    assert resolve_run_dir(manifest) == "/srv/runs/a"


def test_manifest_error_pickles() -> None:
    error = ManifestError("m.yaml", ["run: missing required key; add it", "roles: x"])
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.source, copy.problems) == (
        ManifestError,
        str(error),
        "m.yaml",
        error.problems,
    )


def test_public_names_resolve() -> None:
    import asyncrl.manifest.load

    assert sorted(asyncrl.manifest.load.__all__) == asyncrl.manifest.load.__all__
    assert [n for n in asyncrl.manifest.load.__all__ if not hasattr(asyncrl.manifest.load, n)] == []


def test_importing_the_manifest_module_imports_no_torch() -> None:
    code = "import sys, asyncrl.manifest.load; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "False\n"


def _doc() -> str:
    with open(os.path.join(ROOT, "docs", "manifest.md")) as f:
        return f.read()


def test_the_complete_example_in_the_docs_is_valid() -> None:
    example = re.search(r"## A complete example\n.*?```yaml\n(.*?)```", _doc(), re.S)
    assert example is not None
    manifest = parse_manifest(example.group(1))
    assert manifest.role_names() == ["prompts", "rollout", "reward", "learner"]


def test_the_model_section_in_the_docs_fills_the_built_in_roles_as_its_table_says() -> None:
    from asyncrl.supervision.process import load_role_class

    section = _doc().split("## model\n", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    manifest = parse_manifest("run: {name: x, program: a:b}\n" + example)
    model = msgspec.to_builtins(manifest.model)
    filled = {}
    for name, role in manifest.roles.items():
        config_type = load_role_class(role.cls or "").Config
        config = inherited_config(role.config, config_type, model)
        filled[name] = sorted(set(config) - set(role.config))
        msgspec.convert(config, config_type)  # what the role's process does with it
    assert filled == {
        "prompts": ["tokenizer_path"],
        "rollout": ["model_path"],
        "reward": ["tokenizer_path"],
        "learner": ["model_path", "tokenizer_path"],
    }
    rows = [
        "| `PromptSource` | `tokenizer_path` |",
        "| `Rollout`, `Reference`, `Critic` | `model_path` (or `model_config`) |",
        "| `Learner` | `model_path` (or `model_config`) and `tokenizer_path` |",
        "| `Reward` | `tokenizer_path` |",
    ]
    assert [row for row in rows if row in section] == rows
    for cls in ("services.reference:Reference", "training.critic:Critic"):
        config_type = load_role_class(f"asyncrl.roles.{cls}").Config
        assert inherited_config({}, config_type, model) == {"model_path": "checkpoints/qwen-0.5b"}


def test_the_sizing_section_quotes_the_arith_example_as_it_is() -> None:
    from asyncrl.roles.generation.rollout import Rollout

    section = _doc().split("## Sizing capacity, max_batch and threads\n", 1)[1]
    text = " ".join(section.split("\n## ", 1)[0].split())
    manifest = load_manifest(os.path.join(ROOT, "examples", "arith", "bc_grpo.yaml"))
    rollout, learner = manifest.roles["rollout"], manifest.roles["learner"]
    prompts, group = manifest.run.config["prompts_per_step"], manifest.run.config["group_size"]
    default = {f.name: f.default for f in msgspec.structs.fields(Rollout.Config)}["max_batch"]
    assert "max_batch" not in rollout.config
    batch, eta = prompts * group, manifest.pipeline.eta
    times = "\N{MULTIPLICATION SIGN}"
    quoted = [
        f"`prompts_per_step` {prompts} {times} `group_size` {group} = {batch} samples",
        f"{'one' if rollout.replicas == 1 else rollout.replicas} rollout replica with "
        f"`capacity: {rollout.capacity}`, "
        f"`max_batch` {default} (the default) and `threads: {rollout.threads}`; the learner "
        f"with `threads: {learner.threads}`; η = {eta}.",
        f"admits up to ({eta} + 1) {times} {batch} = {(eta + 1) * batch} samples",
        f"a step is {batch // default} turns of {default}.",
    ]
    assert [q for q in quoted if q not in text] == []


def test_the_error_report_in_the_docs_is_what_the_code_prints() -> None:
    section = _doc().split("## What an error report looks like\n", 1)[1]
    bad, command, report = re.findall(r"```\w*\n(.*?)```", section, re.S)[:3]
    overrides = re.findall(r"--set (\S+)", command)
    with pytest.raises(ManifestError) as info:
        parse_manifest(bad, "bad.yaml", overrides)
    assert str(info.value) + "\n" == report


def test_a_missing_executable_is_a_problem_naming_the_role(tmp_path: pathlib.Path) -> None:
    """The agent starts commands from its current directory, with the role's PATH."""
    tool = tmp_path / "bin" / "tool"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    plain = tmp_path / "plain.sh"
    plain.write_text("#!/bin/sh\n")
    plain.chmod(0o644)
    text = (
        "run: {name: r, program: p}\nroles:\n"
        "  gone: {command: no-such-asyncrl-tool --flag}\n"
        "  rel: {command: [./bin/tool]}\n"
        "  missing: {command: [bin/nope, x]}\n"
        "  plain: {command: [./plain.sh]}\n"
        "  folder: {command: [bin]}\n"
        "  onpath: {command: [tool], env: {PATH: bin}}\n"
        "  absent: {command: [tool]}\n"
    )
    with pytest.raises(ManifestError) as info:
        parse_manifest(text, "m.yaml", cwd=str(tmp_path))
    assert info.value.problems == [
        "roles.gone.command[0]: no executable 'no-such-asyncrl-tool' found on PATH; install it, "
        f"give its path (such as './no-such-asyncrl-tool' for one in {tmp_path}), or add its "
        "folder to PATH in run.env or the role's env",
        f"roles.missing.command[0]: no executable 'bin/nope' ({tmp_path}/bin/nope): the file "
        "does not exist; fix the path (a relative path is taken from the directory the run "
        "starts in) or give it as an absolute path",
        f"roles.plain.command[0]: './plain.sh' ({tmp_path}/plain.sh) is not executable; make it "
        "executable (chmod +x) or start it through its interpreter, such as [python3, "
        "./plain.sh]",
        "roles.folder.command[0]: no executable 'bin' found on PATH; install it, give its path "
        f"(such as './bin' for one in {tmp_path}), or add its folder to PATH in run.env or the "
        "role's env",
        "roles.absent.command[0]: no executable 'tool' found on PATH; install it, give its path "
        f"(such as './tool' for one in {tmp_path}), or add its folder to PATH in run.env or the "
        "role's env",
    ]
    # Without a directory to resolve from, commands are not looked up.
    assert parse_manifest(text).roles["gone"].command == ("no-such-asyncrl-tool", "--flag")


def test_load_manifest_looks_commands_up_from_the_current_directory(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("run: {name: r, program: p}\nroles:\n  ext: {command: ./role.sh}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ManifestError) as info:
        load_manifest(str(path), ["roles.more.command=xyz-asyncrl-absent"])
    assert info.value.problems == [
        f"roles.ext.command[0]: no executable './role.sh' ({tmp_path}/role.sh): the file does "
        "not exist; fix the path (a relative path is taken from the directory the run starts "
        "in) or give it as an absolute path",
        "roles.more.command[0]: no executable 'xyz-asyncrl-absent' found on PATH; install it, "
        f"give its path (such as './xyz-asyncrl-absent' for one in {tmp_path}), or add its "
        "folder to PATH in run.env or the role's env (from --set "
        "roles.more.command=xyz-asyncrl-absent)",
    ]
    (tmp_path / "role.sh").write_text("#!/bin/sh\n")
    (tmp_path / "role.sh").chmod(0o755)
    assert load_manifest(str(path)).roles["ext"].command == ("./role.sh",)
    assert load_manifest(str(path), ["roles.x.command=no-such"], check_files=False)


def test_endpoints_declare_delivery_classes() -> None:
    text = (
        "run: {name: r, program: p}\nroles:\n"
        "  ext: {command: [python3], endpoints: {score: idempotent, train: once, w.set: latest}}\n"
    )
    assert parse_manifest(text).roles["ext"].endpoints == {
        "score": "idempotent",
        "train": "once",
        "w.set": "latest",
    }
    assert parse_manifest(MINIMAL).roles["rollout"].endpoints == {}
    bad = text.replace("train: once", "train: onse, _describe: once, x: [once]")
    assert _problems(bad) == [
        "roles.ext.endpoints.train: expected one of 'idempotent', 'latest', 'once', got 'onse'; "
        "did you mean 'once'?",
        "roles.ext.endpoints._describe: invalid key; use a method name of letters, digits, '_', "
        "'.' and '-' that starts with a letter (names starting with '_' belong to the runtime)",
        "roles.ext.endpoints.x: expected one of 'idempotent', 'latest', 'once', got a list",
    ]


# -- from a manifest to processes: the spec travels in a file ------------------------------------

BIG = "x" * 200_000  # over Linux's 128 KiB limit on one environment string

READ_SPEC = (
    "from asyncrl.manifest.spec import load_spec_from_env\n"
    "s = load_spec_from_env()\n"
    "print(s.kind, s.name, s.incarnation, len(s.config['blob']), sorted(s.groups))\n"
)
READ_CONFIG = (
    "import json, os\n"
    "c = json.load(open(os.environ['ASYNCRL_CONFIG_FILE']))\n"
    "print('command', len(c['blob']), 'ASYNCRL_CONFIG' in os.environ)\n"
)


def test_a_large_config_reaches_every_process_through_a_spec_file(run_dir: str) -> None:
    from asyncrl.manifest.spec import SPEC_FILE_ENV
    from asyncrl.supervision.agent import build_children

    text = (
        "run: {name: big, program: a:b}\n"
        "roles:\n"
        "  role: {class: a:B}\n"
        f"  ext: {{command: [{sys.executable}, -c, {READ_CONFIG!r}]}}\n"
    )
    manifest = parse_manifest(
        text,
        overrides=[
            f"run.config.blob={BIG}",
            f"roles.role.config.blob={BIG}",
            f"roles.ext.config.blob={BIG}",
        ],
    )
    children = build_children(manifest, run_dir, parent_pid=os.getpid())
    outputs = []
    for child in children:
        argv, env = child.argv_env(1)
        assert max(len(k) + len(v) for k, v in env.items()) < 1024
        if child.kind != "command":
            argv = [
                sys.executable,
                "-c",
                READ_SPEC,
            ]  # the spec as asyncrl.supervision.process reads it
            path = env[SPEC_FILE_ENV]
            assert path == os.path.join(run_dir, "specs", f"{child.name}.0.1.json")
            assert os.stat(path).st_mode & 0o777 == 0o600
        out = subprocess.run(
            argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=60, cwd=ROOT
        )
        assert out.returncode == 0, out.stderr
        outputs.append(out.stdout)
    assert outputs == [
        "role role 1 200000 ['ext', 'role']\n",  # roles see every group too
        "command 200000 False\n",
        "driver driver 1 200000 ['ext', 'role']\n",
    ]
    assert os.stat(os.path.join(run_dir, "specs")).st_mode & 0o777 == 0o700
    # The next incarnation replaces the previous one's files.
    for child in children:
        child.argv_env(2)
    assert sorted(os.listdir(os.path.join(run_dir, "specs"))) == [
        "driver.0.2.json",
        "ext.0.2.config.json",
        "role.0.2.json",
    ]


def test_a_command_gets_a_small_config_in_its_environment_and_the_driver_its_classes(
    run_dir: str,
) -> None:
    from asyncrl.supervision.agent import build_children

    text = (
        "run: {name: r, program: a:b}\n"
        "roles: {ext: {command: x, config: {k: 1}, endpoints: {score: idempotent}}}\n"
    )
    (child, driver) = build_children(parse_manifest(text), run_dir, parent_pid=1)
    _, env = child.argv_env(0)
    assert env["ASYNCRL_CONFIG"] == '{"k": 1}'
    with open(env["ASYNCRL_CONFIG_FILE"]) as f:
        assert f.read() == '{"k": 1}'
    # The declared delivery classes reach the driver with the group.
    from asyncrl.manifest.spec import load_spec_from_env

    spec = load_spec_from_env(driver.argv_env(0)[1])
    assert spec.groups["ext"].delivery == {"score": "idempotent"}


def test_load_spec_from_env_reads_the_file_its_variable_names(tmp_path: pathlib.Path) -> None:
    from asyncrl.manifest.spec import ProcessSpec, load_spec_from_env, write_spec

    spec = ProcessSpec(kind="role", name="r", endpoint="ipc://x", run="n", run_dir=str(tmp_path))
    path = write_spec(spec)
    assert load_spec_from_env({"ASYNCRL_SPEC_FILE": path}) == spec
    for environ in ({}, {"ASYNCRL_SPEC": msgspec.json.encode(spec).decode()}):
        with pytest.raises(SystemExit) as info:
            load_spec_from_env(environ)
        assert str(info.value) == (
            "asyncrl.supervision.process is started by the supervisor, with ASYNCRL_SPEC_FILE set"
        )
    gone = str(tmp_path / "gone.json")
    with pytest.raises(SystemExit) as info:
        load_spec_from_env({"ASYNCRL_SPEC_FILE": gone})
    assert str(info.value) == (
        f"asyncrl.supervision.process: cannot read the spec file {gone!r} named by "
        "ASYNCRL_SPEC_FILE "
        "(No such file or directory); it is written by the node agent, which must still be "
        "running"
    )


@pytest.mark.slow
def test_a_run_with_a_large_config_completes(run_dir: str) -> None:
    """The whole path: ``asyncrl run`` starts the roles and the driver with 200 KB configs."""
    with open(os.path.join(ROOT, "examples", "hello", "manifest.yaml")) as f:
        text = f.read()
    text = text.replace("{lowercase: true}", f"{{lowercase: true, blob: {BIG}}}")
    blob_splitter = "tests.manifest.test_manifest:BlobSplitter"
    text = text.replace("examples.hello.roles:Splitter", blob_splitter)
    text = text.replace("  program:", f"  config: {{blob: {BIG}}}\n  program:")
    path = os.path.join(run_dir, "manifest.yaml")
    with open(path, "w") as f:
        f.write(text)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "run",
            path,
            "--run-dir",
            run_dir,
            "--allow-nonempty",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert 'result: [["the", 4], ["dog", 3], ["fox", 3]]' in out.stdout


@pytest.mark.slow
def test_a_config_key_a_role_does_not_declare_fails_the_run_as_a_configuration_error(
    run_dir: str,
) -> None:
    """The example's counter has no Config: a key given to it stops the run at once (exit 78,
    not restarted), naming the key by its path, instead of being ignored."""
    with open(os.path.join(ROOT, "examples", "hello", "manifest.yaml")) as f:
        text = f.read()
    text = text.replace(
        "class: examples.hello.roles:Counter",
        "class: examples.hello.roles:Counter\n    config: {bogus: 1}",
    )
    path = os.path.join(run_dir, "manifest.yaml")
    with open(path, "w") as f:
        f.write(text)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.cli",
            "run",
            path,
            "--run-dir",
            run_dir,
            "--allow-nonempty",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0, out.stdout
    assert "counter[0] has a configuration error" in out.stdout + out.stderr
    assert (
        "| configuration error: roles.counter.config.bogus: unknown key; Counter has no Config, "
        "so it takes no config keys; remove it, or declare a Config class in Counter with this "
        "field"
    ) in out.stdout + out.stderr
    assert "restarts of counter: 0" in out.stdout + out.stderr


class Line(msgspec.Struct):
    id: int
    text: str


class Words(msgspec.Struct):
    id: int
    words: list[str]


class BlobSplitter(Role):
    """The hello example's splitter (examples.hello.roles, which tests may not import), with a
    config key that holds a large value."""

    class Config(msgspec.Struct):
        lowercase: bool = True
        blob: str = ""

    @endpoint(Delivery.IDEMPOTENT)
    async def split(self, line: Line) -> Words:
        text = line.text.lower() if self.config.lowercase else line.text
        return Words(line.id, text.split())


PLACED = """\
run: {name: demo, program: flow}
roles:
  rollout:
    class: mypkg:Rollout
    replicas: 3
    placement: {nodes: [1, 0]}
  learner:
    class: mypkg:Learner
    placement: {node: 1}
"""


def test_placement_nodes_spread_replicas_round_robin() -> None:
    manifest = parse_manifest(PLACED)
    rollout = manifest.roles["rollout"].placement
    assert [rollout.node_of(i) for i in range(3)] == [1, 0, 1]
    assert [manifest.roles["learner"].placement.node_of(i) for i in range(2)] == [1, 1]
    assert parse_manifest(PLACED, nodes=2) == manifest


def test_a_node_the_launch_does_not_have_is_a_problem_with_its_path() -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(PLACED, "m.yaml", ["roles.rollout.placement.nodes=[0, 3]"], nodes=2)
    assert info.value.problems == [
        "roles.rollout.placement.nodes[1]: node 3 but the launch has 2 nodes (--nnodes); place "
        "the role on nodes 0 to 1, or launch with --nnodes=4 "
        "(from --set roles.rollout.placement.nodes=[0, 3])",
    ]


def test_asyncrl_run_refuses_roles_off_node_0_and_names_the_launcher() -> None:
    with pytest.raises(ManifestError) as info:
        parse_manifest(PLACED, "m.yaml", nodes=1)
    fix = (
        "but 'asyncrl run' runs on one machine (node 0); launch on several nodes with 'torchrun "
        "--nnodes=N ... -m asyncrl.launch MANIFEST' (docs/multinode.md), or place the role on "
        "node 0"
    )
    assert info.value.problems == [
        f"roles.rollout.placement.nodes[0]: node 1, {fix}",
        f"roles.learner.placement.node: node 1, {fix}",
    ]


def test_run_manifest_refuses_roles_off_node_0_before_starting_anything(
    tmp_path: pathlib.Path,
) -> None:
    import asyncio

    from asyncrl.supervision.agent import run_manifest

    manifest = parse_manifest(PLACED)
    with pytest.raises(ManifestError) as info:
        asyncio.run(run_manifest(manifest, str(tmp_path / "run")))
    assert [p.split(":")[0] for p in info.value.problems] == [
        "roles.rollout.placement.nodes[0]",
        "roles.learner.placement.node",
    ]
    assert not (tmp_path / "run").exists()


def test_placement_node_and_nodes_exclude_each_other_and_nodes_are_listed_once() -> None:
    text = PLACED.replace("{nodes: [1, 0]}", "{node: 2, nodes: [1, 1, -1]}")
    assert _problems(text) == [
        "roles.rollout.placement.nodes[2]: expected an integer >= 0, got -1",
        "roles.rollout.placement.nodes: both 'node' and 'nodes' are given; keep 'node' for one "
        "node or 'nodes' to spread the replicas over several",
        "roles.rollout.placement.nodes[1]: node 1 is listed twice; list each node once (the "
        "replicas go round-robin over the list)",
    ]


def test_a_saved_manifest_with_nodes_loads_again(tmp_path: pathlib.Path) -> None:
    from asyncrl.supervision.rundir import load_saved_manifest, save_manifest

    manifest = parse_manifest(PLACED)
    save_manifest(manifest, str(tmp_path))
    assert load_saved_manifest(str(tmp_path)) == manifest


def test_network_and_security_sections(tmp_path: pathlib.Path) -> None:
    text = PLACED + "network: {address: eth0}\nsecurity: {curve_keys: keys}\n"
    manifest = parse_manifest(text)
    assert manifest.network.address == "eth0"
    assert manifest.security.curve_keys == "keys"
    (tmp_path / "m.yaml").write_text(text)
    loaded = load_manifest(str(tmp_path / "m.yaml"), check_files=False)
    assert loaded.security.curve_keys == str(tmp_path / "keys")
    assert parse_manifest(PLACED).security.curve_keys == ""
    assert _problems(PLACED + "network: {adress: eth0}\n") == [
        "network.adress: unknown key; did you mean 'address'?"
    ]


def test_run_plugin_reaches_every_process_as_asyncrl_plugin() -> None:
    text = "run: {name: p, program: a:b, plugin: cuda, env: {X: '1'}}\nroles: {r: {class: a:B}}\n"
    manifest = parse_manifest(text)
    assert manifest.run.plugin == "cuda"
    assert manifest.run.env == {"ASYNCRL_PLUGIN": "cuda", "X": "1"}
    # An explicit ASYNCRL_PLUGIN in run.env wins over the field.
    text = text.replace("X: '1'", "ASYNCRL_PLUGIN: cpu")
    assert parse_manifest(text).run.env == {"ASYNCRL_PLUGIN": "cpu"}
