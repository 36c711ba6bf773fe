"""The settings a program shares with the learner: the algorithm, the learning rate, the seed.

They live in one place, the learner's config (``roles.learner.config``: ``algorithm``, ``lr``,
``seed``), and a program reads them from there (``run.rl.settings``). A step carries the
learner's algorithm and learning rate unless the program gives its own (``RLLoop.algorithm``,
``RLLoop.lr``, ``Run.bc_step(lr=...)``, a ``TrainBatch`` sent through ``Run.train_step``):

- the program gives none: the step carries the learner's. The learning rate is sent as the
  learner's own value, not left at 0, since the learner keeps the last rate a batch gave
  (``TrainBatch.lr``): a BC phase's rate must not stay on into the RL phase after it;
- the program gives the learner's value, or the learner's config leaves the setting at its
  default: the program's value stands, without a word (a setting made once is in one place);
- the program gives a value that differs from one the learner's config sets: it overrides the
  learner's in the steps it sends, with a warning naming both values, the first time in the
  driver's run (not at every step).

A behaviour-cloning step's ``bc`` is what the step is, not a choice of RL algorithm, and never
an override.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import msgspec

if TYPE_CHECKING:
    from asyncrl.dispatch.handles import Context

__all__ = ["LEARNER", "LearnerSettings", "Settings"]

log = logging.getLogger("asyncrl.programs")

LEARNER = "learner"
"""The learner's role name, whose config holds the settings."""


class LearnerSettings(msgspec.Struct, frozen=True):
    """The learner's shared settings, with ``LearnerConfig``'s defaults (a test checks that they
    agree; the driver reads them without importing the learner, which imports torch).

    Attributes:
        algorithm: ``grpo``, ``rloo``, ``ppo`` or ``bc``: a batch's, when it names none.
        lr: AdamW's peak learning rate.
        seed: the seed of the model's initialisation, torch's RNG and the mini-batch shuffle.
    """

    algorithm: Literal["grpo", "rloo", "ppo", "bc"] = "grpo"
    lr: float = 1e-3
    seed: int = 0


class Settings:
    """The learner's settings as its config gives them, and the values a program's steps carry.

    Args:
        learner: the learner's settings; None when the run's manifest does not describe the
            learner (a context built without it): every step then carries what the program
            gives, and the learner fills in the rest.
        configured: the settings the learner's config sets (the others are its defaults).
        warn: where an override is reported.
    """

    def __init__(
        self,
        learner: LearnerSettings | None,
        configured: frozenset[str] = frozenset(),
        warn: Callable[[str], None] = log.warning,
    ) -> None:
        self.learner = learner
        self.configured = configured
        self._warn = warn
        self._warned: set[tuple[str, Any]] = set()

    @classmethod
    def of(cls, ctx: Context) -> Settings:
        """The settings of the run's ``learner`` role, from the manifest.

        Raises:
            ConfigProblem: its config gives one of them a value of the wrong type.
        """
        try:
            raw = ctx.role_config(LEARNER, dict)
        except KeyError:
            return cls(None)
        return cls(ctx.role_config(LEARNER, LearnerSettings), frozenset(raw) & _NAMES)

    @property
    def seed(self) -> int:
        """The learner's seed (0, its default, when the manifest does not describe it)."""
        return self.learner.seed if self.learner is not None else LearnerSettings().seed

    def algorithm(self, given: str, where: str) -> str:
        """The algorithm of steps for which the program gives ``given`` ("" for none), set by
        ``where`` (named in a warning); "" when neither gives one (the learner's own)."""
        if given == "bc":
            return given
        return str(self._resolve("algorithm", given or None, where) or "")

    def lr(self, given: float, where: str) -> float:
        """The learning rate of steps for which the program gives ``given`` (0 for none), set by
        ``where``; 0 when neither gives one (the learner's own)."""
        return float(self._resolve("lr", given or None, where) or 0.0)

    def _resolve(self, name: str, given: Any, where: str) -> Any:
        if self.learner is None:
            return given
        own = getattr(self.learner, name)
        if given is None or given == own:
            return own
        if name in self.configured and (name, given) not in self._warned:
            self._warned.add((name, given))
            self._warn(
                f"{where} {given!r} overrides the learner's {name} {own!r} "
                f"(roles.{LEARNER}.config.{name}) in the steps it sends; give it in one place "
                f"to use one value (the learner's config, or {where})"
            )
        return given


_NAMES = frozenset(f.name for f in msgspec.structs.fields(LearnerSettings))
