"""Typed handles for the built-in roles, and the typed context a built-in program takes.

A control-flow program may call any role through its generic handle
(``ctx.roles["learner"].call("status", None)``), which is what a custom role needs. For the
built-in roles these clients say the same in types a checker sees:

    async def main(ctx: Context) -> dict[str, Any]:
        rl = RLContext(ctx)
        status = await rl.learner.status()            # LearnerStatus
        result = await rl.learner.train_step(batch)   # StepResult, re-sent if the learner died

Each client wraps one ``asyncrl.dispatch.handles.Handle`` (``.handle``) and adds nothing but types
and, where the role makes a repeat harmless, re-sending (``resend``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from asyncrl.dispatch.handles import DEFAULT_TIMEOUT_S, Context, Handle
from asyncrl.dispatch.watchdog import Watchdog
from asyncrl.errors import BrokenError, RemoteError, RoleDeadError, StallError
from asyncrl.manifest.pipeline_section import PipelineSpec
from asyncrl.roles.payloads import (
    CriticBatch,
    CriticStepResult,
    GenerateBatch,
    LearnerStatus,
    ProgramState,
    Prompt,
    RolloutStats,
    Sample,
    Scored,
    ScoreSamples,
    StepResult,
    TrainBatch,
)
from asyncrl.roles.program.settings import Settings
from asyncrl.roles.services.prompts import Take
from asyncrl.roles.services.reward import ScoreRequest
from asyncrl.roles.training.lead_refusal import refused_as_follower

if TYPE_CHECKING:
    from asyncrl.roles.generation.rollout import WeightsUpdate

__all__ = [
    "CriticClient",
    "LearnerClient",
    "PromptsClient",
    "RLContext",
    "ReferenceClient",
    "RewardClient",
    "RolloutClient",
    "lead",
    "resend",
    "to_lead",
]

log = logging.getLogger("asyncrl.programs")

LONG_S = 300.0
"""Timeout of calls that train, checkpoint or move weights: each may take minutes on a big model."""

LEAD_WAIT_S = 60.0
"""How long ``to_lead`` sends a call again to a replica that refuses it as not its group's lead
(``NotLeaderError``), waiting for its node's agent to restart it as the group's new lead."""


async def resend(
    handle: Handle,
    method: str,
    payload: Any,
    reply_type: Any = Any,
    *,
    timeout: float = LONG_S,
    first_pause_s: float = 0.05,
    max_pause_s: float = 1.0,
    replica: int | None = None,
) -> Any:
    """Call a once endpoint whose request is safe to send again, and send it again when the
    replica broke with it in flight (died, hung, restarted, or was not reachable yet) rather
    than fail the run; between tries it pauses, from ``first_pause_s`` doubling up to
    ``max_pause_s``, for ``timeout`` seconds in all.

    Use it only where the role makes a repeat harmless: ``train_step`` with a ``TrainBatch.id``
    (the learner answers a repeat with the step it took) or a ``CriticBatch.id``,
    ``checkpoint``. ``replica``: send it to that replica only (``Handle.call``), and not again
    once it left the run with its node (``Handle.members``; ``to_lead`` sends it on to the
    group's new lead).

    Raises:
        BrokenError: it still broke after ``timeout`` seconds.
        DeadlineExceededError, RemoteError: as ``Handle.call``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    pause = first_pause_s
    attempt = 1
    while True:
        try:
            where = {} if replica is None else {"replica": replica}
            return await handle.call(
                method, payload, reply_type, timeout=max(1.0, deadline - loop.time()), **where
            )
        except BrokenError as exc:
            if loop.time() + pause >= deadline:
                raise
            if replica is not None and replica not in handle.members:
                raise  # it left the run with its node: nothing there answers again
            attempt += 1
            log.warning(
                "%s.%s broke in flight (%s); sending it again in %.2f s (attempt %d)",
                handle.name,
                method,
                exc,
                pause,
                attempt,
            )
            await asyncio.sleep(pause)
            pause = min(2 * pause, max_pause_s)


def lead(handle: Handle) -> int:
    """The replica that leads ``handle``'s group now: the lowest still in the run. Replica 0
    until a node's loss takes it out (docs/multinode.md): the group then goes on led by the
    lowest replica left, which the others follow."""
    members = handle.members
    return members[0] if members else 0


async def to_lead(
    handle: Handle,
    method: str,
    payload: Any,
    reply_type: Any,
    *,
    timeout: float = LONG_S,
    again: bool = False,
    idempotent: bool = False,
    lead_wait_s: float = LEAD_WAIT_S,
) -> Any:
    """Call ``method`` on the group's lead (``lead``: replica 0, or the lowest replica left
    once a node's loss took it out), the one that takes the calls of a learner's or a critic's
    group of replicas and runs them on every rank in one order
    (``asyncrl.roles.training.lockstep``); with ``again`` (a once endpoint the role makes
    harmless to repeat), sent again when the replica broke with it in flight (``resend``): a
    broken group restarts whole, from its checkpoints, and answers a repeat with the step it
    took.

    A lead that leaves the run with its node while the call waits for it (``RoleDeadError``:
    it was never sent) passes the call to the new lead; one that leaves with the call in flight
    (``BrokenError``) does so only when a repeat is harmless (``again``, or an ``idempotent``
    endpoint). The new lead resumes from its own checkpoints and write-ahead log, so it
    answers a repeated step with the step the group took.

    Until its node's agent restarts it as the new group's rank 0, the new lead's old process,
    a follower, refuses the call (``NotLeaderError``), having run nothing: the call goes to the
    lead again, pausing from 0.05 s doubling up to 1 s between tries, for at most
    ``lead_wait_s`` seconds from the first refusal (and ``timeout`` in all).

    Raises:
        BrokenError: it broke (with ``again``: still, after ``timeout`` seconds).
        RoleDeadError: the group has no replica left, or the run is ending.
        StallError: the lead still refused the call as a follower ``lead_wait_s`` seconds
            after its first refusal (or at ``timeout``); its cause is the last refusal.
        DeadlineExceededError, RemoteError: as ``Handle.call``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    refused_at: float | None = None  # the lead's first refusal as a follower
    pause = 0.05
    while True:
        first = lead(handle)
        left = max(1.0, deadline - loop.time())
        try:
            if again:
                return await resend(
                    handle, method, payload, reply_type, timeout=left, replica=first
                )
            return await handle.call(method, payload, reply_type, timeout=left, replica=first)
        except RemoteError as exc:
            if not refused_as_follower(exc):
                raise
            now = loop.time()
            if refused_at is None:
                refused_at = now
                log.warning(
                    "%s[%d] refused %s as not its group's lead (%s); sending it again until "
                    "its node's agent restarts it as the group's lead",
                    handle.name,
                    first,
                    method,
                    exc,
                )
            if now + pause > min(deadline, refused_at + lead_wait_s):
                raise StallError(
                    f"{handle.name}[{first}], the lead of {handle.name}'s group (its replicas "
                    f"left: {handle.members}), still refused {method} as not the group's lead "
                    f"for {now - refused_at:.1f} s: its process is the follower it was "
                    f"before the lead moved, and its node's agent restarts it as the lead "
                    f"when it reads the node's membership.json; is that agent running?"
                ) from exc
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)
        except (BrokenError, RoleDeadError) as exc:
            harmless = isinstance(exc, RoleDeadError) or again or idempotent
            now_lead = lead(handle)
            if not harmless or now_lead == first or first in handle.members:
                raise
            log.warning(
                "%s[%d] left the run with its node (%s); %s goes to replica %d, which leads "
                "the group now",
                handle.name,
                first,
                exc,
                method,
                now_lead,
            )


class LearnerClient:
    """The learner (``asyncrl.roles.training.learner.Learner``).

    ``train_step`` and ``checkpoint`` go to the group's lead (``to_lead``: replica 0, or the
    lowest replica left after a node's loss), as the critic's calls do: with data-parallel or
    sharded replicas (``replicas`` > 1) the lead runs each on every
    rank in one order (``asyncrl.roles.training.lockstep``), and the other replicas refuse them.
    ``status``, ``logprobs``, ``export`` and ``weights`` come from the lead too: the other
    ranks may still be finishing a step that the lead has answered, and a status or a
    log-prob from one of them could be a step behind.
    """

    def __init__(self, handle: Handle) -> None:
        self.handle = handle

    async def status(self) -> LearnerStatus:
        """Its version, step, the program's kept position and its last step."""
        reply: LearnerStatus = await to_lead(
            self.handle, "status", None, LearnerStatus, timeout=DEFAULT_TIMEOUT_S, idempotent=True
        )
        return reply

    async def train_step(self, batch: TrainBatch, *, timeout: float = LONG_S) -> StepResult:
        """One step. A batch with an ``id`` is re-sent when the learner died with it in flight,
        and counted once (the learner answers a repeat with the step it took)."""
        result: StepResult = await to_lead(
            self.handle, "train_step", batch, StepResult, timeout=timeout, again=bool(batch.id)
        )
        return result

    async def checkpoint(self, keep: ProgramState) -> str:
        """Keep ``keep`` (merged into the position the learner holds) with a checkpoint
        written now, or a log entry under ``durable: wal``; return its path (the lead's,
        with replicas: each keeps it in its own checkpoints)."""
        path: str = await to_lead(self.handle, "checkpoint", keep, str, again=True)
        return path

    async def export(self, path: str) -> str:
        """Write the policy in Hugging Face format under ``path``: a name in ``RUN_DIR/exports``
        (a relative path goes there) or in a folder of the learner's ``write_paths``.
        The lead answers: the publisher, the one replica whose weights are whole when the
        replicas shard the model (``parallel: fsdp``); a relative path goes into the
        ``exports`` folder of the lead's node, which moves with the lead after a node's loss
        (docs/multinode.md)."""
        out: str = await to_lead(self.handle, "export", path, str, idempotent=True)
        return out

    async def weights(self) -> WeightsUpdate:
        """The current weights, with their version (tensors: loads torch in this process), from
        the lead, as ``export``."""
        from asyncrl.roles.generation.rollout import WeightsUpdate

        update: WeightsUpdate = await to_lead(
            self.handle, "weights", None, WeightsUpdate, idempotent=True
        )
        return update

    async def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Per-token log-probs of the samples' completions under the current policy."""
        out: list[list[float]] = await to_lead(
            self.handle, "logprobs", samples, list[list[float]], idempotent=True
        )
        return out


class RolloutClient:
    """The rollout replicas (``asyncrl.roles.generation.rollout.Rollout``)."""

    def __init__(self, handle: Handle) -> None:
        self.handle = handle

    async def generate(self, batch: GenerateBatch, *, timeout: float = LONG_S) -> list[Sample]:
        """One completion per request, in order, on whichever replica has room."""
        out: list[Sample] = await self.handle.call("generate", batch, list[Sample], timeout=timeout)
        return out

    async def generate_all(
        self, batches: list[GenerateBatch], *, timeout: float = LONG_S
    ) -> AsyncIterator[list[Sample]]:
        """Each batch's samples, as each batch completes, spread over the replicas."""
        async for _, samples in self.handle.map("generate", batches, list[Sample], timeout=timeout):
            yield samples

    async def sync(self) -> list[int]:
        """Every replica loads the newest published weights; their versions."""
        versions: list[int] = await self.handle.broadcast("sync", None, int, timeout=LONG_S)
        return versions

    async def stats(self) -> list[RolloutStats]:
        """What each replica's engine computed since it started, one per replica."""
        out: list[RolloutStats] = await self.handle.broadcast("stats", None, RolloutStats)
        return out


class RewardClient:
    """The reward role (``asyncrl.roles.services.reward.Reward``)."""

    def __init__(self, handle: Handle) -> None:
        self.handle = handle

    async def score(self, completions: list[str], answers: list[str]) -> list[float]:
        """One reward per completion text, checked against its answer."""
        request = ScoreRequest(completions, answers)
        out: list[float] = await self.handle.call("score", request, list[float])
        return out

    async def score_samples(self, samples: list[Sample], answers: list[str]) -> list[float]:
        """One reward per sample, decoded with the role's tokenizer."""
        request = ScoreSamples(samples, answers)
        out: list[float] = await self.handle.call("score_samples", request, list[float])
        return out


class PromptsClient:
    """The prompt source (``asyncrl.roles.services.prompts.PromptSource``)."""

    def __init__(self, handle: Handle) -> None:
        self.handle = handle

    async def take(self, cursor: int, n: int) -> list[Prompt]:
        """Prompts ``cursor`` to ``cursor + n`` (a pure function of the cursor)."""
        out: list[Prompt] = await self.handle.call("take", Take(cursor, n), list[Prompt])
        return out

    async def demonstrations(self, cursor: int, n: int) -> list[Sample]:
        """The same prompts with their answers as completions: demonstrations for BC."""
        out: list[Sample] = await self.handle.call("demonstrations", Take(cursor, n), list[Sample])
        return out


class CriticClient:
    """The critic (``asyncrl.roles.training.critic.Critic``): PPO's value model.

    Every call goes to the group's lead (``to_lead``), as the learner's steps do: with replicas
    (``replicas`` > 1, replicated or sharded with ``parallel: fsdp``) the lead runs each call on
    every rank in one order (``asyncrl.roles.training.lockstep``), and the other replicas refuse
    calls.
    """

    def __init__(self, handle: Handle) -> None:
        self.handle = handle

    async def values(self, samples: list[Sample], *, timeout: float = LONG_S) -> list[list[float]]:
        """A value per completion token of each sample."""
        out: list[list[float]] = await to_lead(
            self.handle, "values", samples, list[list[float]], timeout=timeout, idempotent=True
        )
        return out

    async def train_step(
        self, batch: list[Scored], *, id: str = "", timeout: float = LONG_S
    ) -> CriticStepResult:
        """``ppo_epochs x mini_batches`` value-loss steps on the scored samples; their
        metrics. With an ``id`` (the learner's batch id), a call that broke in flight is sent
        again, and the critic answers a repeat with the step it took."""
        out: CriticStepResult = await to_lead(
            self.handle,
            "train_step",
            CriticBatch(batch, id),
            CriticStepResult,
            timeout=timeout,
            again=bool(id),
        )
        return out


class ReferenceClient:
    """The reference policy (``asyncrl.roles.services.reference.Reference``) of the KL term."""

    def __init__(self, handle: Handle) -> None:
        self.handle = handle

    async def logprobs(
        self, samples: list[Sample], *, timeout: float = LONG_S
    ) -> list[list[float]]:
        """Per-token log-probs of the samples' completions under the reference policy."""
        out: list[list[float]] = await self.handle.call(
            "logprobs", samples, list[list[float]], timeout=timeout
        )
        return out

    async def set_weights(self, update: WeightsUpdate) -> list[int]:
        """Every replica takes these weights as the reference."""
        versions: list[int] = await self.handle.broadcast(
            "set_weights", update, int, timeout=LONG_S
        )
        return versions


class RLContext:
    """A built-in RL program's typed view of its run: a client per built-in role, the
    settings it shares with the learner (``settings``: ``asyncrl.roles.program.settings``), and
    the run's facts (``config``, ``pipeline``, ``run_dir``, ``watchdog``, ``incarnation``).

    ``prompts``, ``rollout`` and ``learner`` are required; ``reward`` is needed when used (a
    run whose rewards come from an environment has none); ``critic`` and ``reference`` are
    None when the run has none. ``ctx`` is the generic context underneath: a custom role is
    ``rl.ctx.roles[name]``, as in any program.

    Raises (on construction):
        KeyError: the run lacks a required role (the message lists the roles it has).
    """

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.learner = LearnerClient(ctx.roles["learner"])
        self.rollout = RolloutClient(ctx.roles["rollout"])
        self._reward = RewardClient(ctx.roles["reward"]) if "reward" in ctx.roles else None
        self.prompts = PromptsClient(ctx.roles["prompts"])
        self.critic = CriticClient(ctx.roles["critic"]) if "critic" in ctx.roles else None
        self.reference = (
            ReferenceClient(ctx.roles["reference"]) if "reference" in ctx.roles else None
        )
        self.settings = Settings.of(ctx)

    @property
    def reward(self) -> RewardClient:
        """The ``reward`` role's client.

        Raises:
            KeyError: the run has no ``reward`` role.
        """
        if self._reward is None:
            raise KeyError(
                f"this run has no 'reward' role (it has {sorted(self.ctx.roles)}): add one to "
                "the manifest's roles, or score samples another way (an environment's rewards)"
            )
        return self._reward

    @property
    def config(self) -> dict[str, Any]:
        return self.ctx.config

    @property
    def pipeline(self) -> PipelineSpec:
        return self.ctx.pipeline

    @property
    def run_dir(self) -> str:
        return self.ctx.run_dir

    @property
    def watchdog(self) -> Watchdog:
        return self.ctx.watchdog

    @property
    def incarnation(self) -> int:
        return self.ctx.incarnation
