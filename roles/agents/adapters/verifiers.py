"""A ``verifiers`` environment (the package prime-rl uses) played by the policy through the
OpenAI-compatible endpoint.

``VerifiersRunner`` runs one rollout of the environment per call: the environment's own loop
(its turns, tools, stop conditions) calls an OpenAI client pointed at ``OpenAIServer``, which
sends each request to the rollout group and records the exact tokens; the environment's rubric
scores the rollout. The result is the server's ``Trajectory`` of the episode (the policy's tokens
masked in, everything between them masked out) with the rubric's reward, ready for the learner.

Each rollout is tied to its episode by the request's ``user`` field (sent through the
environment's sampling arguments), so concurrent rollouts never mix. Only the classic
``verifiers`` environments (``vf.SingleTurnEnv``, ``vf.MultiTurnEnv`` and those built on them,
``vf.ToolEnv`` among them) with chat messages are driven (the tests drive a ``vf.MultiTurnEnv``,
and a ``vf.ToolEnv`` whose tool the policy calls in its family's format: the endpoint parses
the call into ``tool_calls``, the environment runs the tool); their
``sampling_args`` ``max_tokens`` reaches the endpoint as ``max_completion_tokens``, which bounds
each completion (the server's own ``max_tokens`` when none is given).

Build the environment with ``make_env``: a verifiers ``Environment`` installs SIGINT and SIGTERM
handlers of its own when it is constructed (they exit the process at once), which would take
the run's graceful shutdown away from the driver; ``make_env`` puts the process's handlers back.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import msgspec

try:
    import verifiers
    from openai import AsyncOpenAI
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        f"{__name__} needs verifiers: pip install 'asyncrl[agents-adapters]'"
    ) from exc

from asyncrl.roles.agents.episodes import Trajectory
from asyncrl.roles.agents.openai_server import OpenAIServer

__all__ = ["VerifiersEpisode", "VerifiersRunner", "keep_signal_handlers", "make_env"]

T = TypeVar("T")
SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def keep_signal_handlers() -> Iterator[None]:
    """Restore the process's SIGINT and SIGTERM handlers on the way out, whatever the block
    installed (a verifiers ``Environment`` installs its own). A handler that was not set from
    Python (``getsignal`` gives None) cannot be put back, and is left as the block set it."""
    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def make_env(factory: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``factory(*args, **kwargs)`` (a verifiers environment's constructor or a function that
    builds one), with the process's signal handlers kept. Call it from the main thread: Python
    sets signal handlers only there, and verifiers' constructor fails elsewhere."""
    with keep_signal_handlers():
        return factory(*args, **kwargs)


class VerifiersEpisode(msgspec.Struct, kw_only=True):
    """One rollout of a verifiers environment.

    Attributes:
        trajectory: what the policy generated and what came between, exact to the token; its
            ``reward`` is the rubric's, its ``done`` whether the environment completed the
            rollout without truncating it.
        reward: the rubric's reward.
        metrics: the rubric's metrics (``num_turns`` for a multi-turn environment ...).
        stop_condition: the stop condition that ended the rollout (``max_turns_reached`` ...).
        error: the error that ended the rollout, empty when none did.
    """

    trajectory: Trajectory
    reward: float
    metrics: dict[str, float] = {}
    stop_condition: str = ""
    error: str = ""


class VerifiersRunner:
    """Runs a verifiers environment's rollouts against an ``OpenAIServer`` (see the module).

    Args:
        env: the verifiers environment (built by the program, with its dataset and rubric).
        server: the started endpoint in front of the rollout group.
        sampling_args: the environment's sampling arguments for every request
            (``temperature`` ...), besides its own.
    """

    def __init__(
        self,
        env: Any,
        server: OpenAIServer,
        *,
        sampling_args: Mapping[str, Any] | None = None,
    ) -> None:
        if not server.url:
            raise ValueError("VerifiersRunner needs a started OpenAIServer: await server.start()")
        self.env = env
        self.server = server
        self.sampling_args = dict(sampling_args or {})
        self._openai = AsyncOpenAI(base_url=server.url, api_key=server.api_key, max_retries=0)
        self.client = verifiers.OpenAIChatCompletionsClient(self._openai)

    def examples(self, n: int = -1) -> list[dict[str, Any]]:
        """The environment's first ``n`` dataset rows (all with -1), as ``run`` takes them."""
        return [dict(row) for row in self.env.get_dataset(n)]

    async def run(self, example: Mapping[str, Any], episode_id: str) -> VerifiersEpisode:
        """One rollout of ``example`` (a row of the environment's dataset) as ``episode_id``;
        the server forgets the episode's completions once its trajectory is built.

        Raises:
            RuntimeError: the rollout made no request to the endpoint (its error says why).
        """
        sampling = {**self.sampling_args, "user": episode_id}
        out = await self.env.run_rollout(
            dict(example), self.client, self.server.model_name, sampling
        )
        error = str(out.get("error") or "")
        if episode_id not in self.server.episodes:
            raise RuntimeError(
                f"verifiers episode {episode_id!r} made no request to {self.server.url} "
                f"(error: {error or 'none'}); check the environment's client and dataset"
            )
        reward = float(out.get("reward") or 0.0)
        done = bool(out.get("is_completed")) and not out.get("is_truncated")
        trajectory = self.server.trajectory(episode_id, reward=reward, done=done)
        self.server.close(episode_id)
        return VerifiersEpisode(
            trajectory=trajectory,
            reward=reward,
            metrics={k: float(v) for k, v in (out.get("metrics") or {}).items()},
            stop_condition=str(out.get("stop_condition") or ""),
            error=error,
        )

    async def close(self) -> None:
        await self._openai.close()

    async def __aenter__(self) -> VerifiersRunner:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
