"""The RL algorithms as pure torch functions: advantages, losses, estimators and reductions.

Nothing here owns a process, a device or a model: every function takes tensors and returns
tensors, so the learner calls them and a test checks them against hand-computed values.

Conventions:

- A batch of sequences is a ``[B, T]`` tensor of per-token values with a float ``mask`` of the
  same shape: 1 for completion tokens that count, 0 for prompt tokens and padding.
- Per-sample quantities (a GRPO group's rewards) are 1-D tensors ``[N]``.
- Losses are returned as 0-dim tensors that carry gradients; statistics are detached 0-dim
  tensors, so reading them never forces a device synchronisation until someone calls ``.item()``.
- Functions that take a ``mask`` never let a masked position reach a result or a gradient:
  prompt and padding positions may hold garbage, even ``inf`` or ``nan``.
- A shape mismatch raises ``ValueError`` naming both shapes; a bad hyper-parameter raises
  ``ValueError`` naming the parameter and its value.

This module gathers the public names of four, each about one idea, so that
``from asyncrl.roles import algorithms as alg`` reaches every function:

- ``asyncrl.roles.learning.masked``: masked sums, means, variance, whitening and the aggregations.
- ``asyncrl.roles.learning.estimators``: the chosen tokens' log-probs, the entropy, the KL
estimators.
- ``asyncrl.roles.learning.advantages``: GAE, GRPO and RLOO advantages, per-token rewards; GRPO's
  group by group through ``asyncrl.roles.learning.groups.group_advantages``, the function the sample
  pipeline calls too.
- ``asyncrl.roles.learning.losses``: PPO's clipped surrogate (token- or sequence-level ratio,
  GSPO-token), decoupled PPO, truncated importance weights, the value loss.
"""

from __future__ import annotations

from asyncrl.roles.learning.advantages import (
    StdKind,
    gae,
    grpo_advantages,
    rloo_advantages,
    token_rewards,
)
from asyncrl.roles.learning.estimators import (
    KLKind,
    entropy_from_logits,
    kl_estimator,
    token_logprobs,
)
from asyncrl.roles.learning.losses import LOG_RATIO_CLAMP as LOG_RATIO_CLAMP
from asyncrl.roles.learning.losses import (
    Importance,
    ImportanceCapMode,
    Stats,
    decoupled_ppo_policy_loss,
    ppo_policy_loss,
    sequence_log_ratio,
    sequence_token_log_ratio,
    truncated_importance_weights,
    value_loss,
)
from asyncrl.roles.learning.masked import (
    Aggregation,
    aggregate,
    aggregate_weight,
    masked_mean,
    masked_sum,
    masked_var,
    whiten,
)

__all__ = [
    "Aggregation",
    "Importance",
    "ImportanceCapMode",
    "KLKind",
    "Stats",
    "StdKind",
    "aggregate",
    "aggregate_weight",
    "decoupled_ppo_policy_loss",
    "entropy_from_logits",
    "gae",
    "grpo_advantages",
    "kl_estimator",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "ppo_policy_loss",
    "rloo_advantages",
    "sequence_log_ratio",
    "sequence_token_log_ratio",
    "token_logprobs",
    "token_rewards",
    "truncated_importance_weights",
    "value_loss",
    "whiten",
]
