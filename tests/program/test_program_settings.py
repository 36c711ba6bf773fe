"""The algorithm, learning rate and seed live in one place, the learner's config; a program that
gives other values overrides it with one warning per setting and value (``settings``)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest

from asyncrl.dispatch.handles import Context
from asyncrl.roles.payloads import SamplingParams
from asyncrl.roles.program.clients import RLContext
from asyncrl.roles.program.programs import RLLoop, rl_loop
from asyncrl.roles.program.run import Run
from asyncrl.roles.program.settings import LearnerSettings, Settings
from asyncrl.roles.training.learner_config import LearnerConfig
from asyncrl.transport import run
from tests.program.test_programs_run import RL, Recording, demo_sample
from tests.program.test_step_report import PROMPTS, FakeRL, G, feed, score

LEARNER = "asyncrl.roles.training.learner:Learner"


def context(learner: dict[str, Any] | None) -> Context:
    dispatcher = SimpleNamespace(groups={}, busy=lambda: {})
    roles = {} if learner is None else {"learner": {"class": LEARNER, "config": learner}}
    return Context(cast(Any, dispatcher), run="t", run_dir=".", log=None, roles=roles)


def test_the_driver_reads_the_learners_defaults_without_the_learner() -> None:
    """The driver does not import the learner (torch); its defaults must be the learner's."""
    config = LearnerConfig()
    assert msgspec.structs.asdict(LearnerSettings()) == {
        "algorithm": config.algorithm,
        "lr": config.lr,
        "seed": config.seed,
    }


def test_settings_are_read_from_the_learners_config_in_the_manifest() -> None:
    settings = Settings.of(context({"lr": 3e-4, "seed": 7, "grad_clip": 0.5}))
    assert settings.learner == LearnerSettings(algorithm="grpo", lr=3e-4, seed=7)
    assert settings.configured == {"lr", "seed"} and settings.seed == 7
    unknown = Settings.of(context(None))  # a context built without the manifest's roles
    assert unknown.learner is None and unknown.seed == 0


def test_an_override_warns_once_per_setting_and_value_naming_both() -> None:
    warned: list[str] = []
    settings = Settings(LearnerSettings(lr=1e-3), frozenset({"lr", "algorithm"}), warned.append)
    # Nothing given: the learner's own, its rate sent as it is (a batch's rate stays on).
    assert settings.lr(0.0, "RLLoop.lr") == 1e-3
    assert settings.algorithm("", "RLLoop.algorithm") == "grpo"
    assert settings.lr(1e-3, "RLLoop.lr") == 1e-3 and warned == []  # the same value: one place
    for _ in range(3):  # every step of a loop
        assert settings.lr(3e-3, "RLLoop.lr") == 3e-3
    assert settings.algorithm("rloo", "RLLoop.algorithm") == "rloo"
    assert settings.algorithm("bc", "TrainBatch.algorithm") == "bc"  # what a BC step is
    assert warned == [
        "RLLoop.lr 0.003 overrides the learner's lr 0.001 (roles.learner.config.lr) in the "
        "steps it sends; give it in one place to use one value (the learner's config, or "
        "RLLoop.lr)",
        "RLLoop.algorithm 'rloo' overrides the learner's algorithm 'grpo' "
        "(roles.learner.config.algorithm) in the steps it sends; give it in one place to use "
        "one value (the learner's config, or RLLoop.algorithm)",
    ]


def test_a_setting_the_learners_config_leaves_at_its_default_is_the_programs() -> None:
    warned: list[str] = []
    settings = Settings(LearnerSettings(), frozenset(), warned.append)
    assert settings.lr(3e-3, "RLLoop.lr") == 3e-3
    assert settings.algorithm("ppo", "RLLoop.algorithm") == "ppo" and warned == []
    unknown = Settings(None)  # nothing known of the learner: the program's, or the learner's
    assert (unknown.lr(0.0, "RLLoop.lr"), unknown.algorithm("", "RLLoop.algorithm")) == (0.0, "")


def test_rl_loop_sends_the_override_and_warns_once_over_its_steps(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    learner = Recording()
    rl = FakeRL(str(tmp_path), learner)
    rl.settings = Settings(LearnerSettings(lr=1e-3), frozenset({"lr"}))
    params = SamplingParams(max_new_tokens=2)
    loop = RLLoop(steps=3, prompts_per_step=PROMPTS, group_size=G, params=params, lr=3e-3)
    with caplog.at_level(logging.WARNING, logger="asyncrl.programs"):
        out = run(rl_loop(cast(RLContext, rl), loop, feed=feed, score=score, display=False))
    assert out["steps"] == 3
    assert [(b.algorithm, b.lr) for b in learner.batches] == [("grpo", 3e-3)] * 3
    assert [r.getMessage() for r in caplog.records if "overrides" in r.getMessage()] == [
        "RLLoop.lr 0.003 overrides the learner's lr 0.001 (roles.learner.config.lr) in the "
        "steps it sends; give it in one place to use one value (the learner's config, or "
        "RLLoop.lr)"
    ]


def test_a_bc_step_without_a_rate_sends_the_learners(tmp_path: Any) -> None:
    """So that a BC phase's own rate does not stay on into the steps after it."""
    learner = Recording()
    rl = RL(str(tmp_path), learner)
    rl.settings = Settings(LearnerSettings(lr=1e-3), frozenset({"lr"}), lambda _: None)

    async def main() -> None:
        r = await Run.open(cast(RLContext, rl), phases=["bc"])
        await r.bc_step([demo_sample()], lr=5e-3)
        await r.bc_step([demo_sample()])

    run(main())
    assert [(b.algorithm, b.lr) for b in learner.batches] == [("bc", 5e-3), ("bc", 1e-3)]
