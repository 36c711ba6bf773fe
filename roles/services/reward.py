"""The reward role: rule-based verifiers registered by name, or a reward model.

A verifier is a plain function ``(completion: str, answer: str) -> float``; ``@verifier("name")``
registers one. Built in:

- ``exact``: 1.0 when the completion, stripped, equals the answer exactly;
- ``numeric``: 1.0 when both parse as numbers that are equal within ``1e-6`` (so ``"052"``
  matches ``"52"``);
- ``format``: 1.0 when the completion matches the ``pattern`` of the role's config (a regular
  expression that must match the whole stripped completion).

A verifier of your own lives in a module of yours; list that module in the role's ``imports``
and the role imports it in ``setup``, before it looks the verifier up (the role runs in its own
process, which imports nothing of the program's)::

    # mytask/verify.py
    from asyncrl.roles.services.reward import verifier

    @verifier("last_line")
    def last_line(completion: str, answer: str, options: dict) -> float:
        return float(completion.strip().splitlines()[-1:] == [answer])

    # manifest
    reward:
      class: asyncrl.roles.services.reward:Reward
      config: {verifier: last_line, imports: [mytask.verify]}

With ``model_path`` set, the role scores with a sequence-classification model instead
(``AutoModelForSequenceClassification``, one logit: the reward).
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import msgspec

from asyncrl.errors import ConfigProblem
from asyncrl.observe.trace import span, traced
from asyncrl.role import Delivery, Role, endpoint
from asyncrl.roles.payloads import ScoreSamples

__all__ = [
    "VERIFIERS",
    "Reward",
    "ScoreRequest",
    "check_verifier",
    "import_verifiers",
    "verifier",
]

Verifier = Callable[[str, str, dict[str, Any]], float]
VERIFIERS: dict[str, Verifier] = {}


def verifier(name: str) -> Callable[[Verifier], Verifier]:
    """Register ``fn(completion, answer, options) -> reward`` under ``name``."""

    def register(fn: Verifier) -> Verifier:
        if name in VERIFIERS:
            raise ValueError(f"a verifier named {name!r} is already registered")
        VERIFIERS[name] = fn
        return fn

    return register


@verifier("exact")
def _exact(completion: str, answer: str, options: dict[str, Any]) -> float:
    return 1.0 if completion.strip() == answer.strip() else 0.0


def _number(text: str) -> float | None:
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@verifier("numeric")
def _numeric(completion: str, answer: str, options: dict[str, Any]) -> float:
    got, want = _number(completion), _number(answer)
    if got is None or want is None:
        return 0.0
    return 1.0 if abs(got - want) <= float(options.get("tolerance", 1e-6)) else 0.0


@verifier("format")
def _format(completion: str, answer: str, options: dict[str, Any]) -> float:
    pattern = options.get("pattern")
    if not pattern:
        raise ValueError("the 'format' verifier needs a 'pattern' in the reward config")
    return 1.0 if re.fullmatch(pattern, completion.strip()) else 0.0


class ScoreRequest(msgspec.Struct):
    """Completions to score, each with the answer its verifier checks against."""

    completions: list[str]
    answers: list[str]


def import_verifiers(modules: list[str], role: str = "reward") -> None:
    """Import ``modules``, whose ``@verifier`` decorators register their verifiers.

    Raises:
        ConfigProblem: a module does not import; the message names it and the error.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # any failure of user code at import is a configuration error
            raise ConfigProblem(
                f"{role}: cannot import {module!r}, named in imports ({type(exc).__name__}: "
                f"{exc}); check the module path and that it is importable from the run's "
                "working directory"
            ) from exc


def check_verifier(name: str, modules: list[str], role: str = "reward") -> None:
    """Raise ``ConfigProblem`` when no verifier is registered as ``name``, naming those that are
    and the modules imported to find it."""
    if name in VERIFIERS:
        return
    known = ", ".join(sorted(VERIFIERS))
    imported = ", ".join(repr(m) for m in modules) if modules else "none"
    raise ConfigProblem(
        f"{role}: unknown verifier {name!r}; registered: {known} (modules imported from "
        f"imports: {imported}); register it with @verifier({name!r}) in a module and list "
        "that module in the role's imports"
    )


def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class Reward(Role):
    """Scores completions with a named verifier, or with a reward model."""

    class Config(msgspec.Struct, forbid_unknown_fields=True):
        """The reward role's settings (``roles.<name>.config`` in the manifest).

        Attributes:
            verifier: the name of the registered verifier that scores completions: ``exact``,
                ``numeric``, ``format`` or one that a module of ``imports`` registers.
            imports: modules imported at setup, before the verifier is looked up; their
                ``@verifier("name")`` decorators register verifiers of your own.
            options: passed to the verifier as its third argument (``tolerance`` of
                ``numeric``, ``pattern`` of ``format``).
            model_path: a sequence-classification reward model (one logit) to score with
                instead of a verifier; empty: the verifier scores. Never taken from the
                manifest's ``model`` section: the policy is not a reward model.
            tokenizer_path: the tokenizer that decodes sampled tokens for ``score_samples``
                (the policy's tokenizer); the manifest's ``model.tokenizer`` when not set.
        """

        # What the manifest's ``model`` section fills: the tokenizer only.
        inherits: ClassVar[tuple[str, ...]] = ("tokenizer_path",)

        verifier: str = "exact"
        imports: list[str] = []
        options: dict[str, Any] = {}
        model_path: str = ""
        tokenizer_path: str = ""

    @classmethod
    def preload(cls, config: Mapping[str, Any]) -> None:
        imports = config.get("imports")
        if isinstance(imports, list) and all(isinstance(m, str) for m in imports):
            import_verifiers(imports)
        if config.get("tokenizer_path") or config.get("model_path"):
            from transformers import AutoTokenizer  # noqa: F401

    async def setup(self) -> None:
        self.model: Any = None
        self.decoder: Any = None
        if self.config.imports:
            # In the worker thread: a user's module may import heavy libraries.
            await self.ctx.offload(import_verifiers, self.config.imports, self.ctx.name)
        if self.config.tokenizer_path:
            # In the worker thread: importing transformers takes seconds.
            self.decoder = await self.ctx.offload(_tokenizer, self.config.tokenizer_path)
        if self.config.model_path:
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.config.model_path)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                self.config.model_path, num_labels=1
            ).eval()
        else:
            check_verifier(self.config.verifier, self.config.imports, self.ctx.name)

    @endpoint(Delivery.IDEMPOTENT)
    async def score(self, request: ScoreRequest) -> list[float]:
        if len(request.completions) != len(request.answers):
            raise ValueError(
                f"score got {len(request.completions)} completions and "
                f"{len(request.answers)} answers; give one answer per completion"
            )
        if self.model is not None:
            return await self.ctx.offload(
                traced("scoring", self._model_scores), request.completions
            )
        fn = VERIFIERS[self.config.verifier]
        options = self.config.options
        with span("scoring", completions=len(request.completions)):
            pairs = zip(request.completions, request.answers, strict=True)
            return [fn(c, a, options) for c, a in pairs]

    @endpoint(Delivery.IDEMPOTENT)
    async def score_samples(self, request: ScoreSamples) -> list[float]:
        """Score sampled completions by their tokens; needs ``tokenizer_path``."""
        if self.decoder is None:
            raise ValueError("score_samples needs tokenizer_path in the reward config")
        texts = [
            self.decoder.decode(s.token_ids, skip_special_tokens=True) for s in request.samples
        ]
        return await self.score(ScoreRequest(texts, request.answers))

    def _model_scores(self, completions: list[str]) -> list[float]:
        import torch

        batch = self.tokenizer(completions, return_tensors="pt", padding=True)
        with torch.inference_mode():
            logits = self.model(**batch).logits
        return [float(x) for x in logits[:, 0]]
