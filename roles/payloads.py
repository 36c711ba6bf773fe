"""The payloads roles exchange: prompts, generate requests, samples, scored samples, train
batches and step results.

This module imports neither torch nor transformers, so the prompt source, the reward role and the
driver's sample pipeline load without them (a restart of those processes then costs no torch
import). Payloads that carry tensors (``WeightsUpdate``) live with the role that needs torch
(``asyncrl.roles.generation.rollout``). The roles re-export what they use, so ``from
asyncrl.roles.generation.rollout import Sample`` keeps working.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec

__all__ = [
    "CriticStepResult",
    "GenerateBatch",
    "GenerateRequest",
    "LearnerStatus",
    "ProgramState",
    "Prompt",
    "RolloutStats",
    "Sample",
    "SamplingParams",
    "ScoreSamples",
    "Scored",
    "StepResult",
    "StopReason",
    "Stopped",
    "TrainBatch",
]


class StopReason(enum.StrEnum):
    """Why a sample stopped; travels as its string value in ``Sample.stop_reason``."""

    STOP = "stop"  # a stop token was sampled (it is the last of token_ids); finished
    LENGTH = "length"  # max_new_tokens were generated; finished
    INTERRUPTED = "interrupted"  # the caller's should_interrupt() said so; resumable
    CHUNK = "chunk"  # the engine's chunk budget for one call ran out; resumable


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to sample one completion.

    Attributes:
        temperature: divides the logits before sampling; 0 means greedy.
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose probability
            reaches top_p (1.0 keeps all).
        top_k: keep the k most likely tokens (0 keeps all).
        max_new_tokens: the most tokens the completion may have, counting those of a partial.
        stop_token_ids: tokens that end the completion; the stop token is kept as its last
            token. The engine knows no tokenizer: put the end-of-sequence id here.
        greedy: take the most likely token (the argmax, first one on ties); the other fields
            but max_new_tokens and stop_token_ids are then ignored.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop_token_ids: list[int] = []
    greedy: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature: expected a float >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: expected a float in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: expected an int >= 0 (0 keeps all), got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: expected an int >= 0, got {self.max_new_tokens}")


class Prompt(msgspec.Struct, kw_only=True):
    """A prompt: its stable id, its tokens, and opaque metadata for the reward verifier."""

    id: str
    token_ids: list[int]
    text: str = ""
    answer: str = ""


class Sample(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One sampled completion of a prompt, possibly unfinished; or one multi-turn episode.

    Attributes:
        prompt_id, sample_index: the stable id (``key``); a regenerated sample replaces a lost
            one with the same key.
        prompt_ids: the prompt's tokens (without any completion tokens).
        token_ids: the completion's tokens so far.
        logprobs: ``logprobs[i]`` is the behaviour log-prob of ``token_ids[i]``: the log-softmax
            of the raw logits (temperature 1, no top-k/top-p) under the weights of
            ``versions[i]``, which is what the learner recomputes.
        versions: the weights version that produced each token.
        finished: False for a partial rollout, resumable by sending it back as
            ``GenerateRequest.partial``.
        stop_reason: a ``StopReason`` value.
        loss_mask: an episode's (``asyncrl.roles.agents``): 1 for each of ``token_ids`` the
            policy generated (trained), 0 for each the environment wrote (never trained: the
            loss, the KL, the entropy, BC's likelihood, GAE and whitening all skip it). Empty:
            every token is the policy's, the single-turn case, trained exactly as before. An
            environment token's log-prob is 0 and its version that of the policy turn before
            it; neither is read.
        turn_starts: an episode's: where each segment (a policy turn, or an observation)
            starts in ``token_ids``.
        turn_rewards: an episode's: the environment's reward for each step (an episode
            scorer sums them; see ``asyncrl.roles.agents.episodes``).
        infra_failed: an episode's: why it failed through no fault of the policy (``timeout``:
            a step ran past its deadline; ``error``: the environment raised; ``lost``: its
            replica lost it past the runner's restarts), or empty. The sample pipeline never
            trains such a sample: it completes its group with a fresh episode or drops the
            group (``pipeline.infra_failed``), and the learner counts any it receives
            (``infra_failed_trained``, always 0).

    Fields left at their defaults are not encoded, so a single-turn sample's bytes on the wire
    and in a write-ahead log are what they were before episodes existed.
    """

    prompt_id: str
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finished: bool
    stop_reason: str
    loss_mask: list[int] = []
    turn_starts: list[int] = []
    turn_rewards: list[float] = []
    infra_failed: str = ""

    @property
    def key(self) -> tuple[str, int]:
        """The stable id: (prompt id, sample index)."""
        return (self.prompt_id, self.sample_index)

    @property
    def policy_versions(self) -> list[int]:
        """The versions of the policy's tokens (every token's, without a loss mask): what
        staleness is measured on."""
        if not self.loss_mask:
            return self.versions
        return [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]


class ScoreSamples(msgspec.Struct):
    """Samples to score by their tokens (decoded with the reward role's tokenizer), one answer
    each: what ``Reward.score_samples`` takes, from the driver or a dispatch shard."""

    samples: list[Sample]
    answers: list[str]


class GenerateRequest(msgspec.Struct, kw_only=True):
    """Generate (or resume) one sample.

    Attributes:
        prompt: the prompt.
        sample_index: which sample of the prompt this is (with the prompt id, its stable id).
        params: how to sample.
        partial: an unfinished sample of this same (prompt, index) to continue; its tokens,
            log-probs and versions are kept as they are.
        seed: the sampling seed. None derives one from the replica's seed and the stable id,
            so a re-run of the request samples the same tokens.
    """

    prompt: Prompt
    sample_index: int
    params: SamplingParams
    partial: Sample | None = None
    seed: int | None = None


class GenerateBatch(msgspec.Struct):
    """Requests to run together; the reply lists one Sample per request, in order."""

    requests: list[GenerateRequest]


class Scored(msgspec.Struct, kw_only=True):
    """A sample with what the learner needs besides its tokens.

    Attributes:
        advantage: GRPO: the sample's group advantage, computed as its group was released by
            split-mode reduction (``asyncrl.roles.sampling.pipeline``); None: the learner computes
            it over the groups of the batch (the same value, in one shot).
    """

    sample: Sample
    reward: float = 0.0
    ref_logprobs: list[float] = []
    values: list[float] = []
    advantage: float | None = None


class Stopped(msgspec.Struct, kw_only=True, frozen=True):
    """An RL loop that stopped before its last step (``ProgramState.stopped``), so that a
    driver restarted after it does not train on.

    Attributes:
        id: the loop's batch-id prefix (``RLLoop.id_prefix``), which tells the loops apart.
        step: the last step it took.
        reason: why it stopped (the loop's ``stop_reason``).
    """

    id: str
    step: int
    reason: str


class ProgramState(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """The program's position, kept with the learner's steps (``TrainBatch.keep``) and
    checkpoints (``checkpoint``), and read back from its ``status`` by a restarted program.

    A message gives only what it changes; the learner merges it into what it holds
    (``merged``): a field left None (or empty) keeps the value held. On the wire, in the
    write-ahead log and in checkpoints it is a map of the fields given, the keys of the plain
    map it once was, so records written before it decode into it (keys it does not know are
    ignored).

    Attributes:
        cursor: the first prompt (or demonstration) index not yet consumed or wasted.
        resume: the sample pipeline's resume state (``Batch.resume``).
        phase: the ``Run``'s current phase.
        phase_start: the learner step at which that phase began.
        phases: each ended phase's values (``Run.end_phase``), by phase.
        stopped: an RL loop that stopped before its last step.
        program: the program's own state (``RLLoop.keep``), merged key by key.
    """

    cursor: int | None = None
    resume: dict[str, Any] | None = None
    phase: str | None = None
    phase_start: int | None = None
    phases: dict[str, dict[str, Any]] = {}
    stopped: Stopped | None = None
    program: dict[str, Any] = {}

    def merged(self, newer: ProgramState) -> ProgramState:
        """This state with what ``newer`` gives on top: its fields that are not None, and
        its ``phases`` and ``program`` entries key by key."""
        given = {
            name: value
            for name in ("cursor", "resume", "phase", "phase_start", "stopped")
            if (value := getattr(newer, name)) is not None
        }
        return msgspec.structs.replace(
            self,
            **given,
            phases={**self.phases, **newer.phases},
            program={**self.program, **newer.program},
        )


class TrainBatch(msgspec.Struct, kw_only=True):
    """One learner step's worth of data.

    Attributes:
        samples: scored samples (GRPO, PPO) or demonstrations (BC: only their tokens matter).
        algorithm: ``grpo``, ``ppo`` or ``bc``; empty for the configured one.
        demos: demonstrations for the optional BC term of GRPO and PPO.
        keep: the program's position after this step, kept with it (``ProgramState``: only
            what changed; the learner merges it into what it holds).
        lr: the peak learning rate from this step on, until a later batch gives another (the
            schedule still scales it); 0 keeps the peak in force: the config's ``lr`` until a
            batch that takes a step gives one (``Learner.train`` says what persists).
        correction: the off-policy correction of the policy loss (GRPO, PPO): ``clip`` (PPO's
            clipped ratio against the behaviour log-probs, the importance ratio of stale tokens
            clipped), ``decoupled`` (PPO's trust region around the proximal policy, the
            learner's at the start of the batch; the behaviour policy corrected by an
            importance weight capped at ``importance_cap``) or ``tis`` (policy gradient with
            truncated importance weights ``min(pi / behaviour, importance_cap)``). For samples
            generated by the current weights all three give the same gradient. With one
            optimizer step per batch (the learner's ``ppo_epochs`` and ``mini_batches`` at 1)
            the proximal policy is the current one, so the trust region of ``decoupled`` acts
            only from a batch's second optimizer step on.
        importance_cap: the cap of ``decoupled`` and ``tis``.
        id: the batch's stable id, chosen by the caller (e.g. ``"rl-17"``). A batch re-sent
            with the id of the learner's last step is answered with that step's result and not
            trained again: re-send it when a ``train_step`` call failed without a reply. Empty:
            no such check (the ledger still skips consumed samples).
    """

    samples: list[Scored]
    algorithm: str = ""
    demos: list[Sample] = []
    keep: ProgramState = ProgramState()
    lr: float = 0.0
    correction: Literal["clip", "decoupled", "tis"] = "clip"
    importance_cap: float = 2.0
    id: str = ""


class StepResult(msgspec.Struct, kw_only=True):
    """What one ``train_step`` did.

    Attributes:
        version: the policy version after the step.
        step: the learner's step count after it.
        consumed: samples trained on.
        skipped: samples of the batch already consumed before (by the ledger).
        metrics: losses, gradient norm, learning rate, reward mean, staleness.
        replayed: the batch's id was the last step's: this is that step's result, re-sent.
    """

    version: int
    step: int
    consumed: int
    skipped: int
    metrics: dict[str, float]
    replayed: bool = False


class LearnerStatus(msgspec.Struct, kw_only=True):
    """What the learner's ``status`` endpoint says.

    Attributes:
        version: the policy version it serves (one per acknowledged step).
        step: learner steps taken.
        consumed: samples trained on so far (each counted once).
        keep: the program's position, as the steps and checkpoints so far left it
            (``ProgramState``, merged from each ``TrainBatch.keep`` and ``checkpoint``).
        last: the last step: its batch ``id`` and its ``result`` (a ``StepResult`` as a dict).
        durable: every acknowledged step is on disk before its reply (``durable: wal`` or
            ``checkpoint``).
        replayed: the logged steps it replayed when it last started.
        restored_step: the step of the checkpoint it loaded when it last started (-1: none).
        advantages: how it computes GRPO advantages (``normalize_std``, ``std``), so a
            program's sample pipeline computes them the same way.
    """

    version: int
    step: int
    consumed: int = 0
    keep: ProgramState = ProgramState()
    last: dict[str, Any] = {}
    durable: bool = False
    advantages: dict[str, Any] = {}
    replayed: int = 0
    restored_step: int = -1


class CriticBatch(msgspec.Struct):
    """One critic step's batch.

    Attributes:
        samples: scored samples with the values recorded when they were scored.
        id: the batch's stable id, chosen by the caller (the learner's batch id): a batch
            re-sent with the id of the critic's last step is answered with that step's result
            and not trained again. Empty: no such check.
    """

    samples: list[Scored]
    id: str = ""


class CriticStepResult(msgspec.Struct, kw_only=True):
    """What one critic ``train_step`` did; each loss figure is the mean over its optimizer
    steps.

    Attributes:
        step: the critic's step count (batches trained on) after it.
        optimizer_steps: the optimizer steps it took (``ppo_epochs x mini_batches``).
        value_loss: PPO's clipped value loss.
        value_clip_fraction: the share of tokens where the clipped value's error set the loss.
        grad_norm: the gradient's norm before clipping.
        replayed: the batch's id was the last step's: this is that step's result, re-sent.
    """

    step: int
    optimizer_steps: int
    value_loss: float
    value_clip_fraction: float
    grad_norm: float
    replayed: bool = False


class RolloutStats(msgspec.Struct, kw_only=True):
    """What a rollout replica's engine computed since it started (its ``stats`` endpoint); a
    restarted replica counts from 0.

    Attributes:
        forward_passes: model forwards (prefills, decode steps and scores).
        prefill_tokens: real (not padding) tokens fed to generation prefills.
        tokens_generated: tokens sampled and recorded in a sample.
        weight_switches: pending weights loaded into the model.
    """

    forward_passes: int = 0
    prefill_tokens: int = 0
    tokens_generated: int = 0
    weight_switches: int = 0
