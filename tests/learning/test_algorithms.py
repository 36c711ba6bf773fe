"""The RL algorithms against values worked out by hand in each test.

Every case is in float64 so that the hand arithmetic can be checked to 1e-12; the arithmetic is
written out next to the expected values.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from asyncrl.roles.learning import algorithms as alg
from asyncrl.roles.learning.groups import group_advantages, grouped_advantages

NAN = math.nan
INF = math.inf
LN2 = math.log(2.0)
LN3 = math.log(3.0)


def f64(values: object) -> Tensor:
    return torch.tensor(values, dtype=torch.float64)


def close(actual: Tensor, expected: object) -> None:
    """Equal to 1e-12, in float64; a plain number or list is taken as float64."""
    if not isinstance(expected, Tensor):
        expected = f64(expected)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def exactly(message: str) -> str:
    """A ``pytest.raises(match=...)`` pattern for exactly this message."""
    return f"^{re.escape(message)}$"


def shape_error(first: str, a: tuple[int, ...], second: str, b: tuple[int, ...]) -> str:
    return exactly(f"{first} has shape {a} but {second} has shape {b}; they must match")


# --------------------------------------------------------------------------------------------
# masked_sum, masked_mean, masked_var, whiten

# Valid values 1, 2, 3 | 4, 5; padding holds garbage that must never leak.
VALUES = [[1.0, 2.0, 3.0, 100.0], [4.0, NAN, INF, 5.0]]
MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0]]


def test_masked_sum_and_mean_by_hand() -> None:
    values, mask = f64(VALUES), f64(MASK)
    close(alg.masked_sum(values, mask), 1 + 2 + 3 + 4 + 5)
    close(alg.masked_sum(values, mask, dim=-1), [1 + 2 + 3, 4 + 5])
    close(alg.masked_mean(values, mask), (1 + 2 + 3 + 4 + 5) / 5)
    close(alg.masked_mean(values, mask, dim=-1), [(1 + 2 + 3) / 3, (4 + 5) / 2])


def test_masked_var_by_hand() -> None:
    values, mask = f64(VALUES), f64(MASK)
    # mean 3; squared deviations 4, 1, 0, 1, 4 sum to 10.
    close(alg.masked_var(values, mask), 10 / 5)
    close(alg.masked_var(values, mask, unbiased=True), 10 / 4)


def test_masked_mean_and_var_of_nothing_are_zero_with_zero_gradient() -> None:
    values = f64([[NAN, 2.0], [INF, 3.0]]).requires_grad_()
    mask = torch.zeros(2, 2, dtype=torch.float64)
    mean = alg.masked_mean(values, mask)
    close(mean, 0.0)
    close(alg.masked_mean(values, mask, dim=-1), [0.0, 0.0])
    close(alg.masked_var(values, mask), 0.0)
    mean.backward()
    assert values.grad is not None
    close(values.grad, torch.zeros(2, 2, dtype=torch.float64))


def test_masked_var_of_one_element() -> None:
    values, mask = f64([[7.0, 1.0]]), f64([[1.0, 0.0]])
    close(alg.masked_var(values, mask), 0.0)
    close(alg.masked_var(values, mask, unbiased=True), 0.0)


def test_garbage_at_masked_positions_reaches_no_gradient() -> None:
    values = f64(VALUES).requires_grad_()
    mask = f64(MASK)
    (alg.masked_var(values, mask) + alg.whiten(values, mask).sum()).backward()
    assert values.grad is not None
    assert torch.isfinite(values.grad).all()
    assert values.grad[0, 3] == 0 and values.grad[1, 1] == 0 and values.grad[1, 2] == 0


def test_whiten_by_hand() -> None:
    values, mask = f64([[1.0, 2.0, 3.0, NAN]]), f64([[1.0, 1.0, 1.0, 0.0]])
    # mean 2, population variance (1 + 0 + 1) / 3 = 2/3, eps 1e-8.
    scale = 1 / math.sqrt(2 / 3 + 1e-8)
    close(alg.whiten(values, mask), [[-1 * scale, 0.0, 1 * scale, 0.0]])
    close(alg.whiten(values, mask, shift_mean=False), [[2 - scale, 2.0, 2 + scale, 0.0]])


def test_whiten_gives_zero_mean_unit_variance_over_the_mask() -> None:
    values, mask = f64(VALUES), f64(MASK)
    out = alg.whiten(values, mask, eps=0.0)
    close(alg.masked_mean(out, mask), 0.0)
    close(alg.masked_var(out, mask), 1.0)


def test_whiten_of_nothing_is_zero() -> None:
    out = alg.whiten(f64([[1.0, 2.0]]), torch.zeros(1, 2, dtype=torch.float64))
    close(out, [[0.0, 0.0]])


def test_masked_helpers_name_both_shapes() -> None:
    values, mask = torch.zeros(2, 3), torch.zeros(2, 4)
    for call in (alg.masked_sum, alg.masked_mean, alg.masked_var, alg.whiten):
        with pytest.raises(ValueError, match=shape_error("values", (2, 3), "mask", (2, 4))):
            call(values, mask)


# --------------------------------------------------------------------------------------------
# aggregate

# Row 0: valid 1, 2, 3 (sum 6). Row 1: valid 5, 6 (sum 11). Row 2: no valid token.
AGG_VALUES = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, NAN, 0.0], [9.0, 9.0, 9.0, 9.0]]
AGG_MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


def test_aggregate_modes_by_hand() -> None:
    values, mask = f64(AGG_VALUES), f64(AGG_MASK)
    close(alg.aggregate(values, mask, "token_mean"), (1 + 2 + 3 + 5 + 6) / 5)
    # The empty row is left out of every mean over sequences.
    close(alg.aggregate(values, mask, "seq_mean_token_mean"), ((6 / 3) + (11 / 2)) / 2)
    close(alg.aggregate(values, mask, "seq_mean_token_sum"), (6 + 11) / 2)
    close(
        alg.aggregate(values, mask, "seq_mean_token_sum_norm", norm_len=4),
        (6 / 4 + 11 / 4) / 2,
    )


def test_aggregate_gradients_by_hand() -> None:
    values = f64(AGG_VALUES).requires_grad_()
    mask = f64(AGG_MASK)
    alg.aggregate(values, mask, "seq_mean_token_mean").backward()
    assert values.grad is not None
    # Two sequences, each weighted 1/2, spread over its 3 and 2 tokens.
    third, half = 1 / 2 / 3, 1 / 2 / 2
    close(values.grad, [[third, third, third, 0.0], [half, half, 0.0, 0.0], [0.0] * 4])


@pytest.mark.parametrize(
    "mode",
    ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"],
)
def test_aggregate_of_an_all_masked_batch_is_zero(mode: alg.Aggregation) -> None:
    values = f64([[NAN, 1.0], [2.0, INF]]).requires_grad_()
    loss = alg.aggregate(values, torch.zeros(2, 2, dtype=torch.float64), mode, norm_len=4)
    close(loss, 0.0)
    loss.backward()
    assert values.grad is not None
    close(values.grad, torch.zeros(2, 2, dtype=torch.float64))


def test_aggregate_errors() -> None:
    values, mask = f64(AGG_VALUES), f64(AGG_MASK)
    with pytest.raises(
        ValueError, match=exactly("aggregation 'seq_mean_token_sum_norm' needs norm_len, got None")
    ):
        alg.aggregate(values, mask, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match=exactly("norm_len must be > 0, got 0")):
        alg.aggregate(values, mask, "seq_mean_token_sum_norm", norm_len=0)
    with pytest.raises(
        ValueError,
        match=exactly(
            "unknown aggregation mode 'sum'; expected one of "
            "('token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum', 'seq_mean_token_sum_norm')"
        ),
    ):
        alg.aggregate(values, mask, "sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=shape_error("values", (3, 4), "mask", (3, 3))):
        alg.aggregate(values, mask[:, :3], "token_mean")
    with pytest.raises(
        ValueError,
        match=exactly(
            "values must be a [B, T] tensor, got shape (4,); "
            "add a batch dimension with .unsqueeze(0) for a single sequence"
        ),
    ):
        alg.aggregate(values[0], mask[0], "token_mean")


# --------------------------------------------------------------------------------------------
# token_logprobs, entropy_from_logits


def test_token_logprobs_by_hand() -> None:
    # Logits ln 1, ln 2, ln 3: probabilities 1/6, 2/6, 3/6, at any offset.
    row = [0.0, LN2, LN3]
    logits = f64([[row, row], [[x + 1e4 for x in row], [x - 1e4 for x in row]]])
    ids = torch.tensor([[2, 0], [1, 2]])
    expected = [[math.log(3 / 6), math.log(1 / 6)], [math.log(2 / 6), math.log(3 / 6)]]
    close(alg.token_logprobs(logits, ids), expected)


def test_token_logprobs_matches_log_softmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64) * 10
    ids = torch.randint(0, 11, (3, 5), generator=gen)
    expected = torch.log_softmax(logits, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    close(alg.token_logprobs(logits, ids), expected)


def test_token_logprobs_errors() -> None:
    logits = torch.zeros(2, 3, 5)
    with pytest.raises(
        ValueError,
        match=exactly(
            "logits has shape (2, 3, 5) but token_ids has shape (2, 4); token_ids must be "
            "the logits' shape without the vocabulary dimension"
        ),
    ):
        alg.token_logprobs(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(
        ValueError, match=exactly("token_ids must be an integer tensor, got dtype torch.float32")
    ):
        alg.token_logprobs(logits, torch.zeros(2, 3))


def test_entropy_by_hand() -> None:
    # [0, ln 3]: p = (1/4, 3/4), H = -(1/4 ln 1/4 + 3/4 ln 3/4) = ln 4 - (3/4) ln 3.
    skewed = math.log(4) - 0.75 * LN3
    logits = f64(
        [
            [[0.0, 0.0, 0.0], [0.0, LN3, -INF]],
            [[1e4, 1e4, 1e4], [-1e4, -1e4 + LN3, -INF]],
        ]
    )
    close(alg.entropy_from_logits(logits), [[LN3, skewed], [LN3, skewed]])


def test_entropy_of_a_masked_vocabulary_has_a_finite_gradient() -> None:
    logits = f64([[[0.0, 0.0, -INF]]]).requires_grad_()
    entropy = alg.entropy_from_logits(logits)
    close(entropy, [[LN2]])
    entropy.sum().backward()
    assert logits.grad is not None
    # At the uniform distribution over the two live tokens the entropy is stationary.
    close(logits.grad, [[[0.0, 0.0, 0.0]]])


# --------------------------------------------------------------------------------------------
# kl_estimator


def test_kl_estimators_by_hand() -> None:
    # p = 1/2 under the policy, 1/4 under the reference: x = ln(1/4) - ln(1/2) = -ln 2.
    logp, ref = f64([[math.log(0.5)]]), f64([[math.log(0.25)]])
    close(alg.kl_estimator(logp, ref, "k1"), [[LN2]])
    close(alg.kl_estimator(logp, ref, "k2"), [[0.5 * LN2**2]])
    # exp(-ln 2) - (-ln 2) - 1 = 1/2 + ln 2 - 1.
    close(alg.kl_estimator(logp, ref, "k3"), [[0.5 + LN2 - 1]])


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_are_zero_at_equal_logprobs(kind: alg.KLKind) -> None:
    logp = f64([[-0.1, -2.0, -30.0], [0.0, -1e-9, -700.0]])
    close(alg.kl_estimator(logp, logp.clone(), kind), torch.zeros(2, 3, dtype=torch.float64))


logprob_lists = st.lists(
    st.tuples(
        st.floats(min_value=-1e4, max_value=0.0),
        st.one_of(
            st.floats(min_value=-1e4, max_value=0.0),
            st.floats(min_value=-1e-6, max_value=1e-6),
        ),
    ),
    min_size=1,
    max_size=16,
)


@settings(max_examples=300, deadline=None)
@given(pairs=logprob_lists, float32=st.booleans())
def test_k3_and_k2_are_never_negative(pairs: list[tuple[float, float]], float32: bool) -> None:
    # The second number is either a log-prob or a tiny offset from the first.
    dtype = torch.float32 if float32 else torch.float64
    logp = torch.tensor([[a for a, _ in pairs]], dtype=dtype)
    ref = torch.tensor([[b if b < -1e-6 else a + b for a, b in pairs]], dtype=dtype)
    assert (alg.kl_estimator(logp, ref, "k3") >= 0).all()
    assert (alg.kl_estimator(logp, ref, "k2") >= 0).all()


def test_kl_estimator_errors() -> None:
    logp = torch.zeros(2, 3)
    with pytest.raises(
        ValueError, match=exactly("unknown KL estimator 'k4'; expected one of ('k1', 'k2', 'k3')")
    ):
        alg.kl_estimator(logp, logp, "k4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=shape_error("logprobs", (2, 3), "ref_logprobs", (3, 2))):
        alg.kl_estimator(logp, torch.zeros(3, 2), "k3")


# --------------------------------------------------------------------------------------------
# gae


def test_gae_by_hand() -> None:
    gamma, lam = 0.9, 0.8
    rewards, values = f64([[0.0, 0.0, 1.0]]), f64([[0.5, 0.6, 0.7]])
    # Backwards from the last token, with no bootstrap after it:
    delta2 = 1.0 + gamma * 0.0 - 0.7  # 0.3
    adv2 = delta2  # 0.3
    delta1 = 0.0 + gamma * 0.7 - 0.6  # 0.03
    adv1 = delta1 + gamma * lam * adv2  # 0.03 + 0.72 * 0.3 = 0.246
    delta0 = 0.0 + gamma * 0.6 - 0.5  # 0.04
    adv0 = delta0 + gamma * lam * adv1  # 0.04 + 0.72 * 0.246 = 0.21712
    assert (adv0, adv1, adv2) == pytest.approx((0.21712, 0.246, 0.3), abs=1e-12)
    advantages, returns = alg.gae(rewards, values, torch.ones(1, 3, dtype=torch.float64), 0.9, 0.8)
    close(advantages, [[adv0, adv1, adv2]])
    close(returns, [[adv0 + 0.5, adv1 + 0.6, adv2 + 0.7]])


def test_gae_skips_masked_positions_and_keeps_rows_apart() -> None:
    # Row 0: prompt, t0, t1, tool output, t2, padding: the same three tokens as the case by
    # hand, with a masked position between t1 and t2 that must not count as a step.
    # Row 1: nothing valid. Row 2: gamma = lam = 1 reduces to reward - value.
    nan = NAN
    rewards = f64([[5.0, 0.0, 0.0, 7.0, 1.0, nan], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [0.0] * 6])
    values = f64([[9.0, 0.5, 0.6, nan, 0.7, 9.0], [1.0] * 6, [0.0] * 6])
    mask = f64([[0.0, 1.0, 1.0, 0.0, 1.0, 0.0], [0.0] * 6, [0.0] * 6])
    advantages, returns = alg.gae(rewards, values, mask, 0.9, 0.8)
    adv2 = 1.0 - 0.7
    adv1 = (0.9 * 0.7 - 0.6) + 0.72 * adv2
    adv0 = (0.9 * 0.6 - 0.5) + 0.72 * adv1
    close(advantages, [[0.0, adv0, adv1, 0.0, adv2, 0.0], [0.0] * 6, [0.0] * 6])
    close(returns, [[0.0, adv0 + 0.5, adv1 + 0.6, 0.0, 1.0, 0.0], [0.0] * 6, [0.0] * 6])


def test_gae_with_gamma_and_lambda_one_is_return_minus_value() -> None:
    rewards, values = f64([[0.5, 0.0, 2.0]]), f64([[1.0, 2.0, 3.0]])
    advantages, returns = alg.gae(rewards, values, torch.ones(1, 3, dtype=torch.float64), 1, 1)
    # Undiscounted returns to go: 2.5, 2, 2.
    close(advantages, [[2.5 - 1.0, 2.0 - 2.0, 2.0 - 3.0]])
    close(returns, [[2.5, 2.0, 2.0]])


def test_gae_errors() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=shape_error("rewards", (2, 3), "values", (2, 4))):
        alg.gae(x, torch.zeros(2, 4), x, 0.9, 0.9)
    with pytest.raises(ValueError, match=shape_error("rewards", (2, 3), "mask", (3,))):
        alg.gae(x, x, torch.zeros(3), 0.9, 0.9)
    with pytest.raises(
        ValueError,
        match=exactly(
            "rewards must be a [B, T] tensor, got shape (3,); "
            "add a batch dimension with .unsqueeze(0) for a single sequence"
        ),
    ):
        alg.gae(x[0], x[0], x[0], 0.9, 0.9)
    with pytest.raises(ValueError, match=exactly("gamma must be in [0, 1], got 1.5")):
        alg.gae(x, x, x, 1.5, 0.9)
    with pytest.raises(ValueError, match=exactly("lam must be in [0, 1], got -0.1")):
        alg.gae(x, x, x, 0.9, -0.1)


# --------------------------------------------------------------------------------------------
# grpo_advantages, rloo_advantages


def test_grpo_one_group_by_hand() -> None:
    rewards = f64([1.0, 0.0, 0.0, 1.0])
    # mean 1/2; population std sqrt((4 * 1/4) / 4) = 1/2.
    std = 0.5
    close(alg.grpo_advantages(rewards), [x / (std + 1e-6) for x in (0.5, -0.5, -0.5, 0.5)])
    close(alg.grpo_advantages(rewards, eps=0.5), [0.5, -0.5, -0.5, 0.5])
    close(alg.grpo_advantages(rewards, normalize_std=False), [0.5, -0.5, -0.5, 0.5])


def test_grpo_groups_in_any_order_and_of_any_size() -> None:
    # Group 42: rewards 1, 2, 3 (mean 2, population variance (1 + 0 + 1) / 3 = 2/3).
    # Group -3: rewards 10, 20 (mean 15, std 5). Group 7: one sample, advantage 0.
    rewards = f64([10.0, 1.0, 5.0, 2.0, 20.0, 3.0])
    ids = torch.tensor([-3, 42, 7, 42, -3, 42])
    s42 = math.sqrt(2 / 3) + 1e-6
    s3 = 5.0 + 1e-6
    close(alg.grpo_advantages(rewards, ids), [-5 / s3, -1 / s42, 0.0, 0.0, 5 / s3, 1 / s42])
    close(
        alg.grpo_advantages(rewards, ids, normalize_std=False),
        [-5.0, -1.0, 0.0, 0.0, 5.0, 1.0],
    )


def test_grpo_equal_rewards_and_single_samples_give_zero() -> None:
    close(alg.grpo_advantages(f64([3.0, 3.0, 3.0])), [0.0, 0.0, 0.0])
    close(alg.grpo_advantages(f64([3.0])), [0.0])
    close(alg.grpo_advantages(f64([3.0, 4.0]), torch.tensor([0, 1])), [0.0, 0.0])


def test_grpo_promotes_integer_rewards() -> None:
    out = alg.grpo_advantages(torch.tensor([1, 0]), normalize_std=False)
    assert out.dtype == torch.get_default_dtype()
    assert out.tolist() == [0.5, -0.5]


def test_grpo_tensors_and_lists_take_the_one_group_function() -> None:
    """``grpo_advantages`` on tensors, ``grouped_advantages`` on a batch's lists and
    ``group_advantages`` on one group are one computation: equal to the bit, in any order."""
    rewards = [0.1, 0.7, 0.1, 0.3, 2.0, 0.25, 0.25, 0.25, 1.0 / 3.0]
    keys = ["a", "b", "a", "b", "c", "d", "d", "d", "b"]
    for std in ("population", "unbiased"):
        for normalize in (True, False):
            kw: dict[str, Any] = {"normalize_std": normalize, "std": std}
            batch = grouped_advantages(keys, rewards, **kw)
            for key in set(keys):
                index = [i for i, k in enumerate(keys) if k == key]
                group = group_advantages([rewards[i] for i in index], **kw)
                assert [batch[i] for i in index] == group
                # Any order of the group's rewards gives each one the same advantage.
                backwards = group_advantages([rewards[i] for i in reversed(index)], **kw)
                assert backwards == group[::-1]
            ids = torch.tensor([ord(k) for k in keys])
            assert alg.grpo_advantages(f64(rewards), ids, **kw).tolist() == batch
            assert batch[4] == 0.0 and batch[5:8] == [0.0, 0.0, 0.0]  # one; uniform
    assert group_advantages([]) == [] and grouped_advantages([], []) == []
    with pytest.raises(ValueError, match=exactly("eps must be > 0, got 0.0")):
        group_advantages([1.0, 0.0], eps=0.0)
    with pytest.raises(ValueError, match=exactly("2 keys for 1 rewards; expected one each")):
        grouped_advantages(["a", "b"], [1.0])


def test_uniform_groups_get_exactly_zero_whatever_the_rounding() -> None:
    """Equal rewards whose mean is not exactly representable still give 0, in float32 too."""
    for n in range(1, 12):
        assert group_advantages([0.1] * n) == [0.0] * n
        assert group_advantages([0.1] * n, normalize_std=False, std="unbiased") == [0.0] * n
        out = alg.grpo_advantages(torch.full((n,), 0.1, dtype=torch.float32))
        assert out.dtype == torch.float32 and out.tolist() == [0.0] * n


def test_rloo_by_hand() -> None:
    # Group 0: 1, 2, 3 -> 1 - (2+3)/2, 2 - (1+3)/2, 3 - (1+2)/2. Group 5: 10, 20 -> -10, 10.
    # Group 9: one sample, no baseline, 0.
    rewards = f64([1.0, 10.0, 2.0, 4.0, 20.0, 3.0])
    ids = torch.tensor([0, 5, 0, 9, 5, 0])
    close(alg.rloo_advantages(rewards, ids), [-1.5, -10.0, 0.0, 0.0, 10.0, 1.5])
    close(alg.rloo_advantages(f64([1.0, 2.0, 3.0])), [-1.5, 0.0, 1.5])
    close(alg.rloo_advantages(f64([4.0])), [0.0])


@pytest.mark.parametrize("fn", [alg.grpo_advantages, alg.rloo_advantages])
def test_group_advantage_errors(fn: object) -> None:
    assert callable(fn)
    with pytest.raises(
        ValueError, match=exactly("rewards must be a 1-D tensor [N], got shape (2, 2)")
    ):
        fn(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=shape_error("rewards", (3,), "group_ids", (2,))):
        fn(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(
        ValueError, match=exactly("group_ids must be an integer tensor, got dtype torch.float32")
    ):
        fn(torch.zeros(3), torch.zeros(3))


# --------------------------------------------------------------------------------------------
# ppo_policy_loss


def ratios_to_logprobs(ratios: list[float]) -> tuple[Tensor, Tensor]:
    """Old log-probs of -1 and new ones log(ratio) above them."""
    old = torch.full((1, len(ratios)), -1.0, dtype=torch.float64)
    return (old + f64([[math.log(r) for r in ratios]])).requires_grad_(), old


def test_ppo_clip_on_both_signs_of_the_advantage() -> None:
    # clip_eps 0.2: the ratio is clamped to [0.8, 1.2]; per-token loss max(-A r, -A clamp(r)).
    logprobs, old = ratios_to_logprobs([1.5, 0.5, 0.5, 1.5, 1.1])
    advantages = f64([[1.0, 1.0, -1.0, -1.0, 2.0]])
    per_token = [
        max(-1.5, -1.2),  # A > 0, r above the range: clipped, -1.2
        max(-0.5, -0.8),  # A > 0, r below: unclipped, -0.5
        max(0.5, 0.8),  # A < 0, r below: clipped, 0.8
        max(1.5, 1.2),  # A < 0, r above: unclipped, 1.5
        -2.0 * 1.1,  # inside the range
    ]
    assert per_token == pytest.approx([-1.2, -0.5, 0.8, 1.5, -2.2])
    mask = torch.ones(1, 5, dtype=torch.float64)
    loss, stats = alg.ppo_policy_loss(logprobs, old, advantages, mask, 0.2)
    close(loss, sum(per_token) / 5)
    close(stats["clip_fraction"], 2 / 5)
    close(stats["dual_clip_fraction"], 0.0)
    close(stats["approx_kl"], sum(r - 1 - math.log(r) for r in (1.5, 0.5, 0.5, 1.5, 1.1)) / 5)
    assert not stats["approx_kl"].requires_grad
    loss.backward()
    assert logprobs.grad is not None
    # d(-A r)/d logp = -A r where unclipped, 0 where clipped.
    close(logprobs.grad, [[0.0, -0.5 / 5, 0.0, 1.5 / 5, -2.2 / 5]])


def test_ppo_dual_clip_active_and_inactive() -> None:
    logprobs, old = ratios_to_logprobs([4.0, 2.0, 4.0, 0.5])
    advantages = f64([[-1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.float64)
    # Without dual clip: max(4, 1.2) = 4, max(2, 1.2) = 2, max(-4, -1.2) = -1.2, max(.5, .8) = .8
    loss, stats = alg.ppo_policy_loss(logprobs, old, advantages, mask, 0.2)
    close(loss, (4.0 + 2.0 - 1.2 + 0.8) / 4)
    # dual_clip 3 caps A < 0 at 3|A| = 3: active on the first token (4 > 3) only; never for A > 0.
    loss, stats = alg.ppo_policy_loss(logprobs, old, advantages, mask, 0.2, dual_clip=3.0)
    close(loss, (3.0 + 2.0 - 1.2 + 0.8) / 4)
    close(stats["dual_clip_fraction"], 1 / 4)
    close(stats["clip_fraction"], 2 / 4)
    loss.backward()
    assert logprobs.grad is not None
    close(logprobs.grad, [[0.0, 2.0 / 4, 0.0, 0.0]])


def test_ppo_clip_higher() -> None:
    logprobs, old = ratios_to_logprobs([1.25, 0.75])
    advantages, mask = f64([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.float64)
    # Symmetric 0.2: max(-1.25, -1.2) = -1.2 and max(0.75, 0.8) = 0.8.
    loss, _ = alg.ppo_policy_loss(logprobs, old, advantages, mask, 0.2)
    close(loss, (-1.2 + 0.8) / 2)
    # Upper bound 1.28: the first ratio is inside it; the lower bound is unchanged.
    loss, stats = alg.ppo_policy_loss(logprobs, old, advantages, mask, 0.2, clip_eps_high=0.28)
    close(loss, (-1.25 + 0.8) / 2)
    close(stats["clip_fraction"], 1 / 2)


def test_ppo_aggregation_and_padding() -> None:
    # Row 0: two valid tokens at ratio 1; row 1: one valid token, then padding with -inf
    # log-probs and a nan advantage that must not reach the loss or the gradient.
    logprobs = f64([[-1.0, -2.0, -1.0], [-1.0, -INF, -INF]]).requires_grad_()
    old = f64([[-1.0, -2.0, -1.0], [-1.0, 0.0, -INF]])
    advantages = f64([[1.0, 3.0, 0.0], [-2.0, NAN, NAN]])
    mask = f64([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, stats = alg.ppo_policy_loss(logprobs, old, advantages, mask, 0.2, 2.0, "token_mean")
    close(loss, (-1.0 - 3.0 + 2.0) / 3)
    loss, _ = alg.ppo_policy_loss(logprobs, old, advantages, mask, 0.2, None, "seq_mean_token_mean")
    close(loss, ((-1.0 - 3.0) / 2 + 2.0) / 2)
    loss, _ = alg.ppo_policy_loss(
        logprobs, old, advantages, mask, 0.2, None, "seq_mean_token_sum_norm", norm_len=10
    )
    close(loss, ((-1.0 - 3.0) / 10 + 2.0 / 10) / 2)
    loss.backward()
    assert logprobs.grad is not None
    close(logprobs.grad, [[-1 / 10 / 2, -3 / 10 / 2, 0.0], [2 / 10 / 2, 0.0, 0.0]])
    close(stats["approx_kl"], 0.0)


def test_ppo_errors() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=shape_error("logprobs", (2, 3), "mask", (2, 4))):
        alg.ppo_policy_loss(x, x, x, torch.zeros(2, 4), 0.2)
    with pytest.raises(ValueError, match=shape_error("logprobs", (2, 3), "advantages", (2,))):
        alg.ppo_policy_loss(x, x, torch.zeros(2), x, 0.2)
    with pytest.raises(ValueError, match=exactly("clip_eps must be > 0, got 0.0")):
        alg.ppo_policy_loss(x, x, x, x, 0.0)
    with pytest.raises(ValueError, match=exactly("dual_clip must be > 1, got 1.0")):
        alg.ppo_policy_loss(x, x, x, x, 0.2, dual_clip=1.0)
    with pytest.raises(ValueError, match=exactly("clip_eps_high must be > 0, got -0.1")):
        alg.ppo_policy_loss(x, x, x, x, 0.2, clip_eps_high=-0.1)


# --------------------------------------------------------------------------------------------
# truncated_importance_weights, decoupled_ppo_policy_loss


def test_truncated_importance_weights_by_hand() -> None:
    behaviour = f64([[-1.0, -1.0, -1.0, -1.0]])
    logprobs = (behaviour + f64([[math.log(0.5), LN2, math.log(4.0), INF]])).requires_grad_()
    weights = alg.truncated_importance_weights(logprobs[:, :3], behaviour[:, :3], 3.0)
    close(weights, [[0.5, 2.0, 3.0]])
    assert not weights.requires_grad
    mask = f64([[1.0, 0.0, 1.0, 0.0]])
    close(alg.truncated_importance_weights(logprobs, behaviour, 3.0, mask=mask), [[0.5, 0, 3, 0]])
    with pytest.raises(ValueError, match=exactly("cap must be > 0, got 0.0")):
        alg.truncated_importance_weights(behaviour, behaviour, 0.0)
    with pytest.raises(
        ValueError, match=shape_error("logprobs", (1, 4), "behaviour_logprobs", (1, 3))
    ):
        alg.truncated_importance_weights(logprobs, behaviour[:, :3], 2.0)


def decoupled_case() -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Ratios new/proximal 1.5, 1.5, 1; weights proximal/behaviour 0.5, 2, 4; A = 1, -1, 1."""
    proximal = f64([[-1.0, -1.0, -1.0]])
    logprobs = (proximal + f64([[math.log(1.5), math.log(1.5), 0.0]])).requires_grad_()
    behaviour = proximal - f64([[math.log(0.5), LN2, math.log(4.0)]])
    advantages = f64([[1.0, -1.0, 1.0]])
    return logprobs, proximal, behaviour, advantages, torch.ones(1, 3, dtype=torch.float64)


def test_decoupled_ppo_by_hand() -> None:
    logprobs, proximal, behaviour, advantages, mask = decoupled_case()
    # PPO token losses around the proximal policy: max(-1.5, -1.2) = -1.2 (clipped),
    # max(1.5, 1.2) = 1.5, and -1.0; weighted by 0.5, 2 and 4.
    loss, stats = alg.decoupled_ppo_policy_loss(
        logprobs, proximal, behaviour, advantages, mask, 0.2
    )
    close(loss, (0.5 * -1.2 + 2 * 1.5 + 4 * -1.0) / 3)
    close(stats["clip_fraction"], 1 / 3)
    close(stats["importance_weight_mean"], (0.5 + 2 + 4) / 3)
    close(stats["capped_fraction"], 0.0)
    close(stats["behaviour_kl"], sum(w - 1 - math.log(w) for w in (0.5, 2.0, 4.0)) / 3)
    close(stats["approx_kl"], (2 * (1.5 - 1 - math.log(1.5)) + 0.0) / 3)
    loss.backward()
    assert logprobs.grad is not None
    # w * d(-A r)/d logp = w * (-A r) where unclipped, 0 where clipped.
    close(logprobs.grad, [[0.0, 2 * 1.5 / 3, 4 * -1.0 / 3]])


def test_decoupled_ppo_importance_cap_truncates_or_masks() -> None:
    logprobs, proximal, behaviour, advantages, mask = decoupled_case()
    # Cap 3: only the third weight (4) is above it.
    loss, stats = alg.decoupled_ppo_policy_loss(
        logprobs, proximal, behaviour, advantages, mask, 0.2, importance_cap=3.0
    )
    close(loss, (0.5 * -1.2 + 2 * 1.5 + 3 * -1.0) / 3)
    close(stats["importance_weight_mean"], (0.5 + 2 + 3) / 3)
    close(stats["capped_fraction"], 1 / 3)
    # Masking drops the token from the sum but keeps it in the count.
    loss, stats = alg.decoupled_ppo_policy_loss(
        logprobs, proximal, behaviour, advantages, mask, 0.2, importance_cap=3.0, cap_mode="mask"
    )
    close(loss, (0.5 * -1.2 + 2 * 1.5 + 0.0) / 3)
    close(stats["importance_weight_mean"], (0.5 + 2 + 0) / 3)
    loss.backward()
    assert logprobs.grad is not None
    close(logprobs.grad, [[0.0, 2 * 1.5 / 3, 0.0]])


def test_decoupled_ppo_is_ppo_when_proximal_is_behaviour() -> None:
    gen = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 6, generator=gen, dtype=torch.float64) * 3
    new = old + torch.randn(3, 6, generator=gen, dtype=torch.float64) * 0.3
    advantages = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    mask = (torch.rand(3, 6, generator=gen) > 0.3).to(torch.float64)
    a, b = new.clone().requires_grad_(), new.clone().requires_grad_()
    ppo, ppo_stats = alg.ppo_policy_loss(a, old, advantages, mask, 0.2, 3.0, "seq_mean_token_mean")
    dec, dec_stats = alg.decoupled_ppo_policy_loss(
        b, old, old.clone(), advantages, mask, 0.2, 3.0, "seq_mean_token_mean", importance_cap=2.0
    )
    close(dec, ppo)
    for key in ppo_stats:
        close(dec_stats[key], ppo_stats[key])
    close(dec_stats["importance_weight_mean"], 1.0)
    close(dec_stats["behaviour_kl"], 0.0)
    ppo.backward()
    dec.backward()
    assert a.grad is not None and b.grad is not None
    close(b.grad, a.grad)


def test_decoupled_ppo_padding_reaches_neither_loss_nor_gradient() -> None:
    logprobs, proximal, behaviour, advantages, mask = decoupled_case()
    pad = f64([[NAN]])
    logprobs = torch.cat([logprobs.detach(), f64([[-INF]])], 1).requires_grad_()
    proximal = torch.cat([proximal, f64([[0.0]])], 1)
    behaviour = torch.cat([behaviour, f64([[-INF]])], 1)
    advantages = torch.cat([advantages, pad], 1)
    mask = torch.cat([mask, f64([[0.0]])], 1)
    loss, stats = alg.decoupled_ppo_policy_loss(
        logprobs, proximal, behaviour, advantages, mask, 0.2, importance_cap=3.0
    )
    close(loss, (0.5 * -1.2 + 2 * 1.5 + 3 * -1.0) / 3)
    close(stats["behaviour_kl"], sum(w - 1 - math.log(w) for w in (0.5, 2.0, 4.0)) / 3)
    loss.backward()
    assert logprobs.grad is not None
    close(logprobs.grad, [[0.0, 2 * 1.5 / 3, 3 * -1.0 / 3, 0.0]])


def test_decoupled_ppo_sends_no_gradient_to_the_proximal_policy() -> None:
    logprobs, proximal, behaviour, advantages, mask = decoupled_case()
    proximal.requires_grad_()
    loss, _ = alg.decoupled_ppo_policy_loss(logprobs, proximal, behaviour, advantages, mask, 0.2)
    loss.backward()
    assert proximal.grad is None


def test_decoupled_ppo_errors() -> None:
    x = torch.zeros(1, 3)
    with pytest.raises(
        ValueError, match=shape_error("logprobs", (1, 3), "behaviour_logprobs", (1, 2))
    ):
        alg.decoupled_ppo_policy_loss(x, x, torch.zeros(1, 2), x, x, 0.2)
    with pytest.raises(ValueError, match=exactly("importance_cap must be > 0, got -1.0")):
        alg.decoupled_ppo_policy_loss(x, x, x, x, x, 0.2, importance_cap=-1.0)
    with pytest.raises(
        ValueError, match=exactly("unknown cap_mode 'clip'; expected one of ('truncate', 'mask')")
    ):
        alg.decoupled_ppo_policy_loss(x, x, x, x, x, 0.2, cap_mode="clip")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# GSPO: the sequence-level importance ratio


def test_sequence_log_ratio_by_hand() -> None:
    log_ratio = f64([[0.3, -0.1, 0.4, NAN], [0.2, INF, -INF, -0.6]]).requires_grad_()
    mask = f64([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0]])
    out = alg.sequence_log_ratio(log_ratio, mask)
    # Row 0: (0.3 - 0.1 + 0.4) / 3 = 0.2; row 1: (0.2 - 0.6) / 2 = -0.2; 0 where masked.
    close(out, [[0.2, 0.2, 0.2, 0.0], [-0.2, 0.0, 0.0, -0.2]])
    out[:, 0].sum().backward()
    assert log_ratio.grad is not None
    close(log_ratio.grad, [[1 / 3, 1 / 3, 1 / 3, 0.0], [1 / 2, 0.0, 0.0, 1 / 2]])


def gspo_case() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Row 0: token ratios 2, 0.5, 1.21 (A = 1); row 1: 1.44, 1 (A = -1), then padding."""
    old = f64([[-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0]])
    ratios = [[2.0, 0.5, 1.21], [1.44, 1.0, 1.0]]
    logprobs = old + f64([[math.log(r) for r in row] for row in ratios])
    logprobs[1, 2] = -INF
    advantages = f64([[1.0, 1.0, 1.0], [-1.0, -1.0, NAN]])
    mask = f64([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return logprobs.requires_grad_(), old, advantages, mask


def test_gspo_clips_the_sequence_ratio_by_hand() -> None:
    logprobs, old, advantages, mask = gspo_case()
    # s_0 = (2 * 0.5 * 1.21) ** (1/3) = 1.0656 > 1.05: clipped for A > 0, loss -1.05 on each of
    # its tokens; s_1 = (1.44 * 1) ** (1/2) = 1.2, A < 0: max(1.2, 1.05) = 1.2, unclipped.
    s0, s1 = 1.21 ** (1 / 3), 1.2
    assert s0 > 1.05
    loss, stats = alg.ppo_policy_loss(
        logprobs, old, advantages, mask, 0.05, None, "seq_mean_token_mean", importance="sequence"
    )
    close(loss, (-1.05 + s1) / 2)
    close(stats["clip_fraction"], 3 / 5)
    # approx_kl stays the token-level estimate.
    ratios = (2.0, 0.5, 1.21, 1.44, 1.0)
    close(stats["approx_kl"], sum(r - 1 - math.log(r) for r in ratios) / 5)
    loss.backward()
    assert logprobs.grad is not None
    # Row 0 is clipped: no gradient. Row 1: d s_1 / d logp_t = s_1 / 2, times 1/2 (two rows).
    close(logprobs.grad, [[0.0, 0.0, 0.0], [s1 / 4, s1 / 4, 0.0]])
    # token_mean weighs each sequence's loss by its length.
    loss, _ = alg.ppo_policy_loss(
        logprobs, old, advantages, mask, 0.05, None, "token_mean", importance="sequence"
    )
    close(loss, (3 * -1.05 + 2 * s1) / 5)
    # Token level: max(-2, -1.05), max(-.5, -.95), max(-1.21, -1.05); max(1.44, 1.05), 1.
    loss, _ = alg.ppo_policy_loss(logprobs, old, advantages, mask, 0.05, None, "token_mean")
    close(loss, (-1.05 - 0.5 - 1.05 + 1.44 + 1.0) / 5)
    assert s0 != pytest.approx(1.0)


def test_gspo_in_decoupled_ppo_is_gspo_when_proximal_is_behaviour() -> None:
    logprobs, old, advantages, mask = gspo_case()
    ppo, _ = alg.ppo_policy_loss(
        logprobs, old, advantages, mask, 0.05, None, "seq_mean_token_mean", importance="sequence"
    )
    dec, stats = alg.decoupled_ppo_policy_loss(
        logprobs,
        old,
        old.clone(),
        advantages,
        mask,
        0.05,
        None,
        "seq_mean_token_mean",
        importance="sequence",
    )
    close(dec, ppo)
    close(stats["clip_fraction"], 3 / 5)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_token_and_sequence_importance_coincide_on_one_token_sequences(aggregation: str) -> None:
    """One valid token per row (padding around it): the sequence ratio is the token's."""
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 3, generator=gen, dtype=torch.float64) * 2
    new = old + torch.randn(4, 3, generator=gen, dtype=torch.float64) * 0.4
    behaviour = old - torch.rand(4, 3, generator=gen, dtype=torch.float64) * 0.5
    advantages = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    mask = torch.zeros(4, 3, dtype=torch.float64)
    mask[torch.arange(4), torch.tensor([0, 2, 1, 2])] = 1.0
    agg: alg.Aggregation = aggregation  # type: ignore[assignment]
    for loss_fn in (
        lambda x, level: alg.ppo_policy_loss(
            x, old, advantages, mask, 0.1, 2.0, agg, importance=level
        ),
        lambda x, level: alg.decoupled_ppo_policy_loss(
            x, old, behaviour, advantages, mask, 0.1, 2.0, agg, importance=level
        ),
    ):
        a, b = new.clone().requires_grad_(), new.clone().requires_grad_()
        token, token_stats = loss_fn(a, "token")
        sequence, sequence_stats = loss_fn(b, "sequence")
        close(sequence, token)
        for key in token_stats:
            close(sequence_stats[key], token_stats[key])
        token.backward()
        sequence.backward()
        assert a.grad is not None and b.grad is not None
        assert a.grad.abs().sum() > 0
        close(b.grad, a.grad)


def gspo_written_out(
    logprobs: Tensor,
    old: Tensor,
    weight: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float,
    aggregation: alg.Aggregation,
) -> Tensor:
    """GSPO as published: the sequence ratio differentiated through its mean, each token's
    clipped loss times ``weight``."""
    log_ratio = torch.where(mask > 0, logprobs - old, torch.zeros_like(logprobs))
    s = alg.sequence_log_ratio(log_ratio, mask).clamp(-20, 20).exp()
    per_token = torch.maximum(-advantages * s, -advantages * s.clamp(1 - clip_eps, 1 + clip_eps))
    per_token = torch.where(mask > 0, per_token * weight, torch.zeros_like(per_token))
    return alg.aggregate(per_token, mask, aggregation)


def gspo_random_case(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Rows of 4, 2 and 3 valid tokens (right padding holds garbage); per-row advantages and
    behaviour log-probs one constant below the old ones in each row."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(3, 4, generator=gen, dtype=torch.float64) * 2
    new = old + torch.randn(3, 4, generator=gen, dtype=torch.float64) * 0.1
    mask = f64([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    new = torch.where(mask > 0, new, torch.full_like(new, -INF))
    row_adv = torch.randn(3, 1, generator=gen, dtype=torch.float64)
    advantages = row_adv.expand(3, 4) * mask
    behaviour = old - torch.rand(3, 1, generator=gen, dtype=torch.float64) * 0.3
    return new, old, behaviour, advantages, mask


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_token_is_gspo_when_the_factors_are_constant_over_each_sequence(
    aggregation: str, seed: int
) -> None:
    """Advantages and decoupled PPO's behaviour weights constant over each sequence: GSPO-token
    takes GSPO's loss and gradient (to 1e-12 in float64), clipped rows included."""
    new, old, behaviour, advantages, mask = gspo_random_case(seed)
    agg: alg.Aggregation = aggregation  # type: ignore[assignment]
    eps = 0.03  # some rows clip, some do not
    weight = (old - behaviour).exp()
    for ours, factor in (
        (
            lambda x: alg.ppo_policy_loss(
                x, old, advantages, mask, eps, None, agg, importance="sequence"
            ),
            torch.ones_like(old),
        ),
        (
            lambda x: alg.decoupled_ppo_policy_loss(
                x, old, behaviour, advantages, mask, eps, None, agg, importance="sequence"
            ),
            weight,
        ),
    ):
        a, b = new.clone().requires_grad_(), new.clone().requires_grad_()
        loss, _ = ours(a)
        expected = gspo_written_out(b, old, factor, advantages, mask, eps, agg)
        close(loss, expected)
        loss.backward()
        expected.backward()
        assert a.grad is not None and b.grad is not None
        assert a.grad.abs().sum() > 0
        close(a.grad, b.grad)


def test_gspo_token_puts_each_tokens_own_factor_on_its_gradient() -> None:
    """Per-token advantages (PPO's GAE) and per-token behaviour weights reach their own token's
    gradient: d loss / d logp_t = w_t * (-A_t) * s_i / (B * |y_i|) under seq_mean_token_mean,
    where differentiating s_i through its mean would give every token the row's mean."""
    old = f64([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    logprobs = (old + f64([[0.01, -0.02, 0.04], [0.02, 0.0, 0.0]])).requires_grad_()
    mask = f64([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages = f64([[1.0, -2.0, 0.5], [3.0, 1.0, 0.0]])
    s0, s1 = math.exp(0.03 / 3), math.exp(0.02 / 2)  # inside the clip range 0.2
    loss, _ = alg.ppo_policy_loss(
        logprobs, old, advantages, mask, 0.2, None, "seq_mean_token_mean", importance="sequence"
    )
    close(loss, (-(1.0 - 2.0 + 0.5) * s0 / 3 - (3.0 + 1.0) * s1 / 2) / 2)
    loss.backward()
    assert logprobs.grad is not None
    close(
        logprobs.grad,
        [[-1.0 * s0 / 6, 2.0 * s0 / 6, -0.5 * s0 / 6], [-3.0 * s1 / 4, -1.0 * s1 / 4, 0.0]],
    )
    # Decoupled PPO: the behaviour weight w_t = prox / mu stays on its token.
    x = logprobs.detach().clone().requires_grad_()
    behaviour = old - f64([[0.0, LN2, 0.0], [0.0, 0.0, 0.0]])  # w = 1, 2, 1; 1, 1
    ones = f64([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    loss, _ = alg.decoupled_ppo_policy_loss(
        x, old, behaviour, ones, mask, 0.2, None, "seq_mean_token_mean", importance="sequence"
    )
    loss.backward()
    assert x.grad is not None
    close(x.grad, [[-s0 / 6, -2 * s0 / 6, -s0 / 6], [-s1 / 4, -s1 / 4, 0.0]])


def test_sequence_importance_errors() -> None:
    x = torch.zeros(1, 3)
    with pytest.raises(
        ValueError, match=exactly("unknown importance 'seq'; expected one of ('token', 'sequence')")
    ):
        alg.ppo_policy_loss(x, x, x, x, 0.2, importance="seq")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=shape_error("log_ratio", (1, 3), "mask", (1, 2))):
        alg.sequence_log_ratio(x, torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"^log_ratio must be a \[B, T\] tensor, got shape"):
        alg.sequence_log_ratio(torch.zeros(3), torch.zeros(3))


# --------------------------------------------------------------------------------------------
# value_loss


def test_value_loss_by_hand() -> None:
    values = f64([[1.0, 1.0, 0.6, NAN]]).requires_grad_()
    old_values = f64([[0.5, 0.5, 0.5, NAN]])
    returns = f64([[1.2, 0.0, 1.0, INF]])
    mask = f64([[1.0, 1.0, 1.0, 0.0]])
    # clip_eps 0.2: V_clipped = 0.7, 0.7, 0.6.
    # Token 0: (1 - 1.2)^2 = 0.04 vs (0.7 - 1.2)^2 = 0.25 -> 0.25, clipped.
    # Token 1: (1 - 0)^2 = 1 vs (0.7 - 0)^2 = 0.49 -> 1.
    # Token 2: inside the range, (0.6 - 1)^2 = 0.16 both ways.
    loss, stats = alg.value_loss(values, old_values, returns, mask, 0.2)
    close(loss, 0.5 * (0.25 + 1.0 + 0.16) / 3)
    close(stats["value_clip_fraction"], 1 / 3)
    loss.backward()
    assert values.grad is not None
    # d/dV 0.5 (V - R)^2 / 3 = (V - R) / 3 where the unclipped error counts; 0 where clipped.
    close(values.grad, [[0.0, 1.0 / 3, (0.6 - 1.0) / 3, 0.0]])


def test_value_loss_without_clipping_and_with_another_aggregation() -> None:
    values = f64([[1.0, 1.0, 0.6, 5.0]])
    old_values = f64([[0.5, 0.5, 0.5, 0.0]])
    returns = f64([[1.2, 0.0, 1.0, 0.0]])
    mask = f64([[1.0, 1.0, 1.0, 0.0]])
    loss, stats = alg.value_loss(values, old_values, returns, mask, None)
    close(loss, 0.5 * (0.04 + 1.0 + 0.16) / 3)
    close(stats["value_clip_fraction"], 0.0)
    loss, _ = alg.value_loss(values, old_values, returns, mask, 0.2, "seq_mean_token_sum")
    close(loss, 0.5 * (0.25 + 1.0 + 0.16))


def test_value_loss_errors() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=shape_error("values", (2, 3), "returns", (3, 2))):
        alg.value_loss(x, x, torch.zeros(3, 2), x, 0.2)
    with pytest.raises(ValueError, match=exactly("clip_eps must be > 0, got 0")):
        alg.value_loss(x, x, x, x, 0)


def test_public_names_resolve() -> None:
    assert sorted(alg.__all__) == alg.__all__
    assert [n for n in alg.__all__ if not hasattr(alg, n)] == []


# --------------------------------------------------------------------------------------------
# Conventions: GRPO's std, a group of one, the log-ratio clamp; micro-batch weights; rewards


def test_grpo_unbiased_std_by_hand() -> None:
    # Group 0: 1, 0, 0 -> mean 1/3, squared deviations 4/9 + 1/9 + 1/9 = 2/3; unbiased variance
    # (2/3) / 2 = 1/3. Group 1: one sample, advantage 0 under either convention.
    rewards = f64([1.0, 0.0, 0.0, 5.0])
    ids = torch.tensor([0, 0, 0, 1])
    sd = math.sqrt(1 / 3) + 1e-6
    close(
        alg.grpo_advantages(rewards, ids, std="unbiased"),
        [(2 / 3) / sd, -1 / 3 / sd, -1 / 3 / sd, 0],
    )
    population = alg.grpo_advantages(rewards, ids, normalize_std=False)
    close(alg.grpo_advantages(rewards, ids, normalize_std=False, std="unbiased"), population)
    close(alg.grpo_advantages(rewards, ids), [x / (math.sqrt(2 / 9) + 1e-6) for x in population])
    with pytest.raises(
        ValueError,
        match=exactly("unknown std 'sample'; expected one of ('population', 'unbiased')"),
    ):
        alg.grpo_advantages(rewards, std="sample")  # type: ignore[arg-type]


def test_a_huge_log_ratio_is_clamped_to_20() -> None:
    """A very stale token (log-ratio 100) with a negative advantage and no dual clip: the loss
    is -A * exp(20), finite, and the clamped token sends no gradient."""
    # float32, as the learner computes: exp(100) would overflow it to inf.
    logprobs = torch.tensor([[0.0, 100.0]]).requires_grad_()
    old = torch.tensor([[0.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0]])
    loss, stats = alg.ppo_policy_loss(logprobs, old, adv, mask, 0.2)
    # Token 0: ratio 1, loss -1. Token 1: ratio exp(20), loss -(-1) * exp(20); mean of the two.
    assert float(loss.detach()) == pytest.approx((-1.0 + math.exp(20.0)) / 2, rel=1e-6)
    loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad.tolist() == [[-0.5, 0.0]]
    assert all(math.isfinite(float(v)) for v in stats.values())
    # Decoupled PPO: a log importance weight of 100 is clamped the same way.
    current = logprobs.detach().clone().requires_grad_()
    loss, _ = alg.decoupled_ppo_policy_loss(current, current.detach(), old - 100.0, adv, mask, 0.2)
    loss.backward()
    assert current.grad is not None
    assert float(loss.detach()) == pytest.approx(math.exp(20.0) * (-1.0 + 1.0) / 2, abs=1e-6)
    assert bool(torch.isfinite(current.grad).all())
    assert current.grad.tolist()[0] == pytest.approx([-0.5 * math.exp(20.0), 0.5 * math.exp(20.0)])


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_aggregate_weight_splits_a_batch_exactly(mode: alg.Aggregation) -> None:
    # Rows with 3, 0 (empty) and 2 valid tokens, split as [row 0] and [rows 1, 2].
    values = f64([[1.0, 2.0, 3.0], [9.0, 9.0, 9.0], [0.0, 4.0, 5.0]])
    mask = f64([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    whole = alg.aggregate(values, mask, mode)
    total = alg.aggregate_weight(mask, mode)
    parts = [slice(0, 1), slice(1, 3)]
    split = sum(
        alg.aggregate(values[p], mask[p], mode) * alg.aggregate_weight(mask[p], mode) / total
        for p in parts
    )
    close(split, whole)
    assert int(total) == (5 if mode == "token_mean" else 2)


def test_token_rewards_by_hand() -> None:
    # Row 0: reward 1 on its last valid token (column 1; column 2 is padding); row 1: empty.
    mask = f64([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    logp = f64([[-1.0, -2.0, NAN], [0.0, 0.0, 0.0], [0.0, -0.5, -0.5]])
    ref = f64([[-1.5, -1.0, NAN], [0.0, 0.0, 0.0], [0.0, -0.5, -1.5]])
    rewards = f64([1.0, 7.0, 2.0])
    close(alg.token_rewards(rewards, mask), [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    # k1 = logp - ref: 0.5, -1.0 | - | 0.0, 1.0; times kl_coef 0.5 subtracted.
    close(
        alg.token_rewards(rewards, mask, logp, ref, kl_coef=0.5, kl_kind="k1"),
        [[-0.25, 1.0 + 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 2.0 - 0.5]],
    )
