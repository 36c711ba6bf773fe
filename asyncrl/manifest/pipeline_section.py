"""The manifest's ``pipeline`` section: the asynchrony settings (mode, staleness bound η,
over-provisioning) and the straggler policy, as the run's roles and driver read them.

The pacing these settings drive is ``asyncrl.roles.sampling.pacing``.

``pipeline.shards: K`` (K >= 1) runs the pipeline's per-sample work in K dispatch shards
(docs/scaling.md, "Beyond one driver"): ``shard_role`` adds their role, ``shards``, to the
manifest's roles (a supervised role like any other: its ``class``, ``replicas`` and
``capacity`` filled in where ``roles.shards`` does not give them), and ``shards_problems``
says what does not go with them.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, TypeGuard

import msgspec

from asyncrl.manifest.limits import MAX_COUNT, MAX_RATIO, MAX_REPLICAS, MAX_SECONDS

__all__ = [
    "SHARD_CAPACITY",
    "SHARD_CLASS",
    "SHARD_ROLE",
    "Mode",
    "OverEta",
    "PipelineSpec",
    "ScheduleSpec",
    "StragglerSpec",
    "schedule_problem",
    "shard_role",
    "shards_problems",
    "straggler_problem",
]

SHARD_ROLE = "shards"
"""The role ``pipeline.shards`` adds: the dispatch shards, one replica a shard."""

SHARD_CLASS = "asyncrl.roles.sampling.shard:DispatchShard"
"""Its class, unless ``roles.shards`` names another (a subclass, or a role of one's own)."""

SHARD_CAPACITY = 1024
"""Groups one shard works on at once, unless ``roles.shards.capacity`` says: the driver's
pacer bounds the groups in flight (η), so a shard's credit need only stay out of its way."""


class Mode(enum.StrEnum):
    """``sync``: one batch in flight and a barrier before each learner step. ``async``: up to
    ``eta`` versions of generation ahead of the learner, no barrier."""

    SYNC = "sync"
    ASYNC = "async"


class OverEta(enum.StrEnum):
    """What becomes of a sample whose staleness still exceeds η when it is consumed."""

    DROP = "drop"  # discarded, counted as waste; its admission slot is refilled
    CORRECT = "correct"  # trained on, with the learner's off-policy correction


class StragglerSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """When a GRPO group is released if some of its samples are late.

    Attributes:
        policy: ``wait`` for every sample; ``emit`` the group at its deadline with at least
            ``k_min`` samples, its statistics taken over those that arrived; or ``drop`` it at
            its deadline and admit a fresh prompt instead.
        deadline_s: seconds from a group's admission to its deadline; 0 means none (only
            ``wait`` allows that).
        k_min: for ``emit``, the fewest samples a released group may have (at least 2: one
            sample has no group baseline).
    """

    policy: Annotated[
        str,
        msgspec.Meta(pattern="^(wait|emit|drop)$", extra={"expected": "'wait', 'emit' or 'drop'"}),
    ] = "wait"
    deadline_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)] = 0.0
    k_min: Annotated[int, msgspec.Meta(ge=2, le=MAX_COUNT)] = 2


class ScheduleSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The ``schedule`` of the ``pipeline`` section: which prompts are generated, learned from
    what was scored (``asyncrl.roles.sampling.schedule``; off unless asked for).

    Attributes:
        skip_uniform: defer a prompt whose last groups were uniform: generate it again with
            probability ``explore ** streak`` (its uniform groups in a row), else skip it this
            epoch.
        explore: that probability's starting base; it adapts after every batch.
        target_uniform: the share of generated groups that ``explore`` aims to leave uniform.
        probe: generate this many samples of each group first, and the rest only if they
            disagree (0: off).
        retire_after: retire a prompt whose last this many groups were all solved (uniform at
            the best reward seen): never generated again (0: never).
        confidence: with ``probe``, a probe whose rewards agree drops its group only when each
            of its samples was drawn with at least this probability (the product of its
            tokens' probabilities, from the log-probs the rollout reports): a confident policy
            repeats itself, so its group would be uniform. 0: agreement alone drops the
            group. Needed (> 0) with ``probe: 1``, whose one sample always agrees with itself.
    """

    skip_uniform: bool = False
    explore: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    target_uniform: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.3
    probe: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] = 0
    retire_after: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] = 0
    confidence: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0

    def __post_init__(self) -> None:
        if self.probe == 1 and not self.confidence:
            raise ValueError(
                "probe: 1 needs confidence > 0 (one sample always agrees with itself, so every "
                "group would be dropped after its probe); set confidence (e.g. 0.9) or probe >= 2"
            )


class PipelineSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The manifest's ``pipeline`` section: how samples flow from rollout to the learner.

    Attributes:
        mode: ``sync`` (the baseline) or ``async``; both run the same code.
        eta: the staleness bound η, in learner versions (async mode; sync mode is 0).
        over_eta: ``drop`` or ``correct`` a sample still over η when consumed.
        correction: the learner's off-policy correction of stale tokens: ``clip`` (PPO's
            clipped importance ratio against the behaviour policy: a token the policy has
            moved away from by more than the clip range stops pushing further), ``decoupled``
            PPO (trust region around the learner's current, proximal policy; the behaviour
            policy corrected by an importance weight capped at ``importance_cap``) or ``tis``
            (policy gradient with truncated importance weights).
        importance_cap: the cap on importance weights of ``decoupled`` and ``tis``.
        overprovision: samples admitted beyond what η allows (async mode), so that drops and
            stragglers do not leave the learner waiting.
        group_affinity: keep a GRPO group's samples on one rollout replica (for engines with
            prefix caching); an idle replica still steals them.
        group_calls: send the samples of a group that start together as one ``generate``
            call (``asyncrl.roles.sampling.coalesce``): one dispatch instead of one a sample,
            the group on one replica, no stealing within it.
        straggler: when a group with late samples is released.
        running_stats: keep streaming, version-tagged reward statistics for the metrics.
        drop_uniform: dynamic sampling (DAPO): drop a group whose rewards are all equal (it
            carries no GRPO signal) and admit another prompt in its place, so that batches keep
            their size; past a cap of drops per batch, such groups are kept
            (docs/algorithms.md).
        uniform_drops_per_group: that cap, per group of a batch (4: a batch of 32 groups
            drops at most 128; the batches in flight share theirs). A lower cap wastes fewer
            samples and keeps more groups that teach nothing.
        schedule: prompt scheduling from what was scored: deferral of prompts whose groups
            were uniform, and probing of new ones (``ScheduleSpec``; needs ``drop_uniform``).
        infra_failed: what becomes of a group one of whose samples failed through no fault of
            the policy (``Sample.infra_failed``: an environment's step timed out or raised, or
            its replica lost the episode): ``replace`` (the default) runs one fresh sample of
            the same prompt in its place, once (the failed one counted as waste; a second
            failure drops the group); ``drop`` drops the whole group at once, as waste. Either
            way no such sample is trained on.
        stall_timeout_s: seconds without any call completing after which the driver fails the
            run, saying what it waited for and on whom (0: never). Raise it when one learner
            step or one generation legitimately takes longer.
        shards: dispatch shards (docs/scaling.md): 0, the driver dispatches every sample
            itself; K >= 1, the built-in programs grant each admitted group to one of K
            shard processes (the role ``shards``, which this key adds), which generate,
            score (through the ``reward`` role) and reduce it; η, the data cursor and the
            learner stay the driver's.
    """

    mode: Annotated[
        str, msgspec.Meta(pattern="^(sync|async)$", extra={"expected": "'sync' or 'async'"})
    ] = "sync"
    eta: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] = 2
    over_eta: Annotated[
        str, msgspec.Meta(pattern="^(drop|correct)$", extra={"expected": "'drop' or 'correct'"})
    ] = "correct"
    correction: Annotated[
        str,
        msgspec.Meta(
            pattern="^(clip|decoupled|tis)$", extra={"expected": "'clip', 'decoupled' or 'tis'"}
        ),
    ] = "clip"
    importance_cap: Annotated[float, msgspec.Meta(gt=0, le=MAX_RATIO)] = 2.0
    overprovision: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] = 0
    group_affinity: bool = False
    straggler: StragglerSpec = msgspec.field(default_factory=StragglerSpec)
    running_stats: bool = False
    drop_uniform: bool = False
    uniform_drops_per_group: Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)] = 4
    schedule: ScheduleSpec = msgspec.field(default_factory=ScheduleSpec)
    stall_timeout_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)] = 600.0
    group_calls: bool = False
    infra_failed: Annotated[
        str,
        msgspec.Meta(pattern="^(replace|drop)$", extra={"expected": "'replace' or 'drop'"}),
    ] = "replace"
    shards: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            le=MAX_REPLICAS,  # one shard is one replica of the role this key adds
            extra={
                "expected": f"an integer from 0 to {MAX_REPLICAS}, the dispatch shards to run "
                "(0: none, the driver dispatches every sample)"
            },
        ),
    ] = 0

    def __post_init__(self) -> None:
        problem = straggler_problem(self.straggler.policy, self.straggler.deadline_s)
        if problem:
            raise ValueError(f"straggler.deadline_s: {problem}")
        problem = schedule_problem(
            self.schedule.skip_uniform or self.schedule.probe, self.drop_uniform
        )
        if problem:
            raise ValueError(f"schedule: {problem}")

    @property
    def window_eta(self) -> int:
        """η as the pacer applies it: 0 in sync mode."""
        return self.eta if self.mode == Mode.ASYNC else 0

    @property
    def window_overprovision(self) -> int:
        """Over-provisioning as the pacer applies it: none in sync mode."""
        return self.overprovision if self.mode == Mode.ASYNC else 0


def straggler_problem(policy: object, deadline_s: object) -> str | None:
    """Why a straggler policy and deadline do not go together, or None."""
    if policy in ("emit", "drop") and not deadline_s:
        return (
            f"policy {policy!r} needs a deadline > 0 (seconds from a group's admission to "
            "its release); set it, or use policy 'wait'"
        )
    return None


def schedule_problem(scheduled: object, drop_uniform: object) -> str | None:
    """Why a prompt schedule cannot run with this ``drop_uniform``, or None."""
    if scheduled and not drop_uniform:
        return (
            "skip_uniform and probe learn from the groups that dynamic sampling drops; set "
            "pipeline.drop_uniform: true, or turn them off"
        )
    return None


def _shard_count(raw: Any) -> int:
    """``pipeline.shards`` of a raw manifest when it is a valid count, else 0."""
    pipeline = raw.get("pipeline") if isinstance(raw, dict) else None
    shards = pipeline.get("shards") if isinstance(pipeline, dict) else None
    if isinstance(shards, int) and not isinstance(shards, bool) and 0 < shards <= MAX_REPLICAS:
        return shards
    return 0


def shard_role(raw: Any) -> None:
    """Add the dispatch shards' role to a raw manifest whose ``pipeline.shards`` is K >= 1:
    ``roles.shards`` with ``class: SHARD_CLASS``, ``replicas: K`` and ``capacity:
    SHARD_CAPACITY``, each where ``roles.shards`` does not give it (its placement,
    supervision, config and the rest are the manifest's own). Nothing else changes."""
    shards = _shard_count(raw)
    roles = raw.get("roles") if shards else None
    if not isinstance(roles, dict):
        return
    role = roles.setdefault(SHARD_ROLE, {})
    if not isinstance(role, dict):
        return
    if role.get("command") is None:
        role.setdefault("class", SHARD_CLASS)
    role.setdefault("replicas", shards)
    role.setdefault("capacity", SHARD_CAPACITY)


def shards_problems(raw: Any) -> list[str]:
    """What does not go with ``pipeline.shards: K`` in a raw manifest, each with its path:
    ``roles.shards.replicas`` other than K (one replica is one shard); no rollout role for the
    shards to split (``roles.shards.config.rollout``, default ``rollout``) or fewer than K of
    its replicas (each shard owns at least one); no reward role (``config.reward``, default
    ``reward``) when ``config.score`` does not name a scorer. Values of the wrong type are
    left to their own key's check."""
    shards = _shard_count(raw)
    roles = raw.get("roles") if shards else None
    role = roles.get(SHARD_ROLE) if isinstance(roles, dict) else None
    if not isinstance(roles, dict) or not isinstance(role, dict):
        return []
    problems = []
    replicas = role.get("replicas")
    if _is_count(replicas) and replicas != shards:
        problems.append(
            f"roles.{SHARD_ROLE}.replicas: {replicas}, but pipeline.shards is {shards}: the "
            f"dispatch shards' role has one replica a shard; remove roles.{SHARD_ROLE}.replicas "
            f"or set it to {shards}"
        )
    config = role.get("config")
    config = config if isinstance(config, dict) else {}
    where = f"roles.{SHARD_ROLE}.config"
    known = ", ".join(str(name) for name in roles) or "none"
    rollout_name = config.get("rollout", "rollout")
    rollout = roles.get(rollout_name) if isinstance(rollout_name, str) else None
    if isinstance(rollout_name, str) and rollout is None:
        problems.append(
            f"{where}.rollout: the run has no role {rollout_name!r} (roles: {known}); "
            f"{shards} dispatch shards split the replicas of a rollout role: add it, or name "
            f"it in {where}.rollout"
        )
    owned = rollout.get("replicas", 1) if isinstance(rollout, dict) else None
    if _is_count(owned) and owned < shards:
        problems.append(
            f"pipeline.shards: {shards} dispatch shards need at least as many replicas of "
            f"roles.{rollout_name}, which has {owned}: set pipeline.shards to at most {owned}, "
            f"or roles.{rollout_name}.replicas to at least {shards}"
        )
    reward_name = config.get("reward", "reward")
    if not config.get("score") and isinstance(reward_name, str) and reward_name not in roles:
        problems.append(
            f"{where}.reward: the run has no role {reward_name!r} (roles: {known}); the "
            f"dispatch shards score each sample with it: add it, name the reward role in "
            f"{where}.reward, or give {where}.score"
        )
    return problems


def _is_count(value: object) -> TypeGuard[int]:
    """An integer, not a bool (YAML's true is one in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)
