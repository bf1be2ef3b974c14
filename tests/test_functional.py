"""Unit tests of rlhf_trainers.functional against the numbers printed in the reference documents and
hand examples.

Reference documents (in ../shared/seeds/): "N implementation details of RLHF with PPO" (LHPD, also
N-impl below), the RLOO blog (RLOO), the NeMo RL PPO guide (NeMo).  Expected values are written out or computed by independent
reference code in this file, never by calling the function under test a second time.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as torch_f

from rlhf_trainers import functional as F

LHPD_REWARDS = [[1.2, 1.3, 1.4], [1.5, 1.6, 1.7], [1.8, 1.9, 2.0]]
# N-impl, "TensorFlow vs PyTorch note": whiten(rewards, shift_mean=False) with tf.nn.moments (biased)
# and with torch.var(unbiased=True).
LHPD_WHITEN_BIASED = [[0.0508, 0.4381, 0.8254], [1.2127, 1.6000, 1.9873], [2.3746, 2.7619, 3.1492]]
LHPD_WHITEN_TF = [
    [0.05080712, 0.4381051, 0.8254035],
    [1.2127019, 1.6000004, 1.9872988],
    [2.3745968, 2.7618952, 3.1491938],
]
LHPD_WHITEN_UNBIASED = [[0.1394, 0.5046, 0.8697], [1.2349, 1.6000, 1.9651], [2.3303, 2.6954, 3.0606]]


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


# ------------------------------------------------------------------------------------------------
# masked statistics
# ------------------------------------------------------------------------------------------------


def test_masked_mean_ignores_masked_entries_even_inf_and_nan():
    values = t([[1.0, 2.0, math.inf], [3.0, math.nan, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert F.masked_mean(values, mask).item() == pytest.approx((1 + 2 + 3 + 5) / 4)
    torch.testing.assert_close(F.masked_mean(values, mask, dim=1), t([1.5, 4.0]))
    assert F.masked_mean(values, mask, dim=1, keepdim=True).shape == (2, 1)


def test_masked_mean_without_mask_is_plain_mean():
    values = t([[1.0, 2.0], [3.0, 7.0]])
    assert F.masked_mean(values).item() == pytest.approx(3.25)
    torch.testing.assert_close(F.masked_mean(values, dim=0), t([2.0, 4.5]))


def test_masked_mean_empty_and_all_masked_rows_give_zero_not_nan():
    values = t([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[True, False], [False, False]])
    torch.testing.assert_close(F.masked_mean(values, mask, dim=1), t([1.0, 0.0]))
    assert F.masked_mean(values, torch.zeros_like(mask)).item() == 0.0
    assert F.masked_mean(torch.empty(0, 3)).item() == 0.0
    torch.testing.assert_close(F.masked_var(values, mask, dim=1), t([0.0, 0.0]))


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.long, torch.int32, torch.float32, torch.bfloat16])
def test_masks_of_any_dtype_treat_nonzero_as_valid(mask_dtype):
    values = t([1.0, 2.0, 3.0, 10.0])
    mask = torch.tensor([1, 1, 1, 0]).to(mask_dtype)
    assert F.masked_mean(values, mask).item() == pytest.approx(2.0)
    assert F.masked_var(values, mask).item() == pytest.approx(2 / 3)


def test_masked_var_default_is_biased_like_tf_moments():
    """N-impl "TensorFlow vs PyTorch note": var 0.0667 (biased, tf.nn.moments) vs 0.0750 (torch.var)."""
    rewards = t(LHPD_REWARDS, torch.float64)
    assert F.masked_var(rewards).item() == pytest.approx(0.0667, abs=1e-4)
    assert F.masked_var(rewards, unbiased=True).item() == pytest.approx(0.0750, abs=1e-4)
    assert F.masked_mean(rewards).item() == pytest.approx(1.6)
    torch.testing.assert_close(F.masked_var(rewards, dim=1), rewards.var(dim=1, unbiased=False))


def test_masked_var_unbiased_with_fewer_than_two_entries_is_zero():
    values = t([[4.0, 1.0, 2.0], [5.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0]])
    torch.testing.assert_close(F.masked_var(values, mask, unbiased=True, dim=1), t([0.0, 8.0]))
    torch.testing.assert_close(F.masked_var(values, mask, unbiased=False, dim=1), t([0.0, 4.0]))


def test_masked_moments_are_sum_sumsq_count_of_valid_entries():
    values = t([[1.0, 2.0, math.nan], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    total, total_sq, count = F.masked_moments(values, mask)
    assert total.dtype == torch.float64
    assert (total.item(), total_sq.item(), count.item()) == (12.0, 1 + 4 + 16 + 25, 4.0)
    total, _, count = F.masked_moments(values, mask, dim=1)
    torch.testing.assert_close(total, torch.tensor([3.0, 9.0], dtype=torch.float64))
    torch.testing.assert_close(count, torch.tensor([2.0, 2.0], dtype=torch.float64))


def test_whiten_lhpd_example_shift_mean_false_biased_variance():
    """N-impl: whiten_tf / whiten_pt(unbiased=False) print these numbers for the 3x3 rewards."""
    out = F.whiten(t(LHPD_REWARDS, torch.float64), shift_mean=False)
    torch.testing.assert_close(out, t(LHPD_WHITEN_BIASED, torch.float64), atol=1e-4, rtol=0)
    out32 = F.whiten(t(LHPD_REWARDS), shift_mean=False)
    torch.testing.assert_close(out32, t(LHPD_WHITEN_TF), atol=1e-5, rtol=0)


def test_whiten_lhpd_example_shift_mean_false_unbiased_variance():
    """N-impl: whiten_pt(unbiased=True) prints these numbers for the 3x3 rewards."""
    out = F.whiten(t(LHPD_REWARDS, torch.float64), shift_mean=False, unbiased=True)
    torch.testing.assert_close(out, t(LHPD_WHITEN_UNBIASED, torch.float64), atol=1e-4, rtol=0)


def test_whiten_shift_mean_true_gives_zero_mean_unit_variance():
    values = torch.tensor([3.0, -1.0, 4.0, 1.0, 5.0, 9.0], dtype=torch.float64)
    out = F.whiten(values)
    assert out.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert out.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)


def test_whiten_leaves_masked_entries_unchanged_and_excludes_them_from_statistics():
    values = t([[1.0, 2.0, 100.0], [3.0, -7.0, 4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    out = F.whiten(values, mask)
    assert out[0, 2].item() == 100.0 and out[1, 1].item() == -7.0
    valid = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = (valid - valid.mean()) * torch.rsqrt(valid.var(unbiased=False) + 1e-8)
    torch.testing.assert_close(out[mask.bool()], expected)


def test_whiten_all_masked_returns_values_unchanged():
    values = t([[1.0, 2.0], [3.0, 4.0]])
    out = F.whiten(values, torch.zeros(2, 2))
    torch.testing.assert_close(out, values)
    assert out.data_ptr() != values.data_ptr()


def test_whiten_single_valid_entry_is_finite():
    out = F.whiten(t([5.0, 1.0]), torch.tensor([1, 0]), unbiased=True)
    assert torch.isfinite(out).all() and out[0].item() == 0.0


class FakeTwoRanks:
    """all_reduce of a 2-rank job seen from rank 0: adds the other rank's packed moments."""

    def __init__(self, other_values, other_mask, dim=None):
        self.other = torch.stack(F.masked_moments(other_values, other_mask, dim=dim))
        self.calls = 0

    def __call__(self, packed):
        self.calls += 1
        assert packed.shape == self.other.shape, "moments must be packed into ONE tensor"
        return packed + self.other


def test_whiten_with_all_reduce_over_two_ranks_equals_whitening_the_whole_batch():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(6, 5, generator=gen) * 3 + 2
    mask = torch.rand(6, 5, generator=gen) > 0.3
    full = F.whiten(values, mask)
    reduce = FakeTwoRanks(values[3:], mask[3:])
    rank0 = F.whiten(values[:3], mask[:3], all_reduce=reduce)
    assert reduce.calls == 1
    torch.testing.assert_close(rank0, full[:3], atol=1e-5, rtol=1e-5)
    # without the reduction the statistics are per rank and differ
    assert not torch.allclose(F.whiten(values[:3], mask[:3]), full[:3], atol=1e-3)
    reduce = FakeTwoRanks(values[3:], mask[3:])
    rank0 = F.whiten(values[:3], mask[:3], shift_mean=False, unbiased=True, all_reduce=reduce)
    torch.testing.assert_close(rank0, F.whiten(values, mask, shift_mean=False, unbiased=True)[:3])


def test_masked_mean_and_var_with_all_reduce_are_global():
    values = t([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    reduce = FakeTwoRanks(values[1:], mask[1:])
    assert F.masked_mean(values[:1], mask[:1], all_reduce=reduce).item() == pytest.approx(43 / 4)
    assert reduce.calls == 1
    reduce = FakeTwoRanks(values[1:], mask[1:])
    expected = torch.tensor([1.0, 2.0, 10.0, 30.0]).var(unbiased=True).item()
    assert F.masked_var(values[:1], mask[:1], unbiased=True, all_reduce=reduce).item() == pytest.approx(
        expected
    )
    # per-column statistics across ranks (dim=0)
    reduce = FakeTwoRanks(values[1:], mask[1:], dim=0)
    torch.testing.assert_close(
        F.masked_mean(values[:1], mask[:1], dim=0, all_reduce=reduce), t([5.5, 2.0, 30.0])
    )


def test_statistics_keep_input_dtype():
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        values = t(LHPD_REWARDS, dtype)
        assert F.masked_mean(values).dtype == dtype
        assert F.masked_var(values).dtype == dtype
        assert F.whiten(values).dtype == dtype
    assert F.masked_mean(torch.tensor([1, 2, 4])).dtype == torch.float32


def test_explained_variance_by_hand():
    """NeMo critic/explained_var = 1 - Var(R - V) / Var(R)."""
    returns = t([1.0, 2.0, 3.0, 4.0])
    assert F.explained_variance(returns, returns).item() == pytest.approx(1.0)
    assert F.explained_variance(torch.full((4,), 2.5), returns).item() == pytest.approx(0.0)
    values = returns + t([0.5, -0.5, 0.5, -0.5])  # Var(R - V) = 0.25, Var(R) = 1.25
    assert F.explained_variance(values, returns).item() == pytest.approx(0.8)
    # masked entries (garbage) are ignored
    ev = F.explained_variance(
        t([1.0, 2.0, 3.0, 4.0, 99.0]), t([1.0, 2.0, 3.0, 4.0, -5.0]), t([1, 1, 1, 1, 0])
    )
    assert ev.item() == pytest.approx(1.0)


def test_explained_variance_constant_returns_or_no_tokens_is_zero():
    assert F.explained_variance(t([1.0, 2.0]), t([3.0, 3.0])).item() == 0.0
    assert F.explained_variance(t([1.0, 2.0]), t([3.0, 4.0]), t([0, 0])).item() == 0.0


# ------------------------------------------------------------------------------------------------
# KL
# ------------------------------------------------------------------------------------------------


def test_kl_penalty_k1_reproduces_lhpd_per_token_kl():
    """N-impl "Per-token KL penalty": kl = new_logprobs - logprobs = [-0.3315, -0.0426, 0.6351]."""
    ref = t([-3.3213, -4.9980, -3.8690], torch.float64)
    lhpd_kl = t([-0.3315, -0.0426, 0.6351], torch.float64)
    new = ref + lhpd_kl
    torch.testing.assert_close(F.kl_penalty(new, ref, "k1"), lhpd_kl)
    # the score is added at the last token: rewards = [b*-0.3315, b*-0.0426, b*0.6351 + 0.4]
    beta = 0.15
    rewards = -beta * F.kl_penalty(new, ref)
    rewards[-1] += 0.4
    torch.testing.assert_close(
        rewards, t([-beta * -0.3315, -beta * -0.0426, -beta * 0.6351 + 0.4], torch.float64)
    )
    # and at the first update epoch the policy equals the reference: kl = [0, 0, 0]
    assert F.kl_penalty(ref, ref).abs().max().item() == 0.0


def test_kl_penalty_k1_rloo_blog_example():
    """RLOO blog: per_token_logprobs - reference_per_token_logprobs = [-1.0, 0.1, -0.3]."""
    kl = F.kl_penalty(t([-12.3, -8.3, -2.3]), t([-11.3, -8.4, -2.0]))
    torch.testing.assert_close(kl, t([-1.0, 0.1, -0.3]), atol=1e-5, rtol=0)


def test_kl_penalty_estimators_by_hand():
    logp = t([[-1.0, -2.0, -0.5]], torch.float64)
    ref = t([[-1.5, -1.0, -0.5]], torch.float64)
    d = [0.5, -1.0, 0.0]
    torch.testing.assert_close(F.kl_penalty(logp, ref, "k1"), t([d], torch.float64))
    torch.testing.assert_close(F.kl_penalty(logp, ref, "k2"), t([[0.5 * x * x for x in d]], torch.float64))
    torch.testing.assert_close(F.kl_penalty(logp, ref, "abs"), t([[abs(x) for x in d]], torch.float64))
    k3 = [math.exp(-x) - 1 + x for x in d]
    torch.testing.assert_close(F.kl_penalty(logp, ref, "k3"), t([k3], torch.float64))


def test_kl_penalty_all_estimators_zero_when_policies_equal():
    logp = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for estimator in F.KL_ESTIMATORS:
        assert F.kl_penalty(logp, logp.clone(), estimator).abs().max().item() == 0.0


def test_kl_penalty_k3_is_nonnegative_and_finite_for_extreme_log_ratios():
    logp = t([0.0, -1e4, -30.0, -1.0])
    ref = t([-1e4, 0.0, -1.0, -30.0])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        kl = F.kl_penalty(logp.to(dtype), ref.to(dtype), "k3")
        assert torch.isfinite(kl).all(), dtype
        assert (kl >= 0).all()
    # the clamp at 20 nats: exp(20) - 1 - 20
    kl = F.kl_penalty(t([0.0]), t([1e4]), "k3")
    assert kl.item() == pytest.approx(math.exp(20) - 21, rel=1e-5)


def test_kl_penalty_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="k1, k2, k3, abs"):
        F.kl_penalty(t([0.0]), t([0.0]), "kl")


def test_adaptive_kl_controller_update_sequence_by_hand():
    """N-impl "Adaptive KL": init_kl_coef=0.15, target=6, horizon=10000."""
    ctl = F.AdaptiveKLController(0.15, target=6, horizon=10000)
    n = 64 * 8  # one batch of 512 episodes
    ctl.update(12.0, n)  # 12 / 6 - 1 = 1 -> clipped to +0.2
    expected = 0.15 * (1 + 0.2 * 512 / 10000)
    assert ctl.value == pytest.approx(expected, rel=1e-12)
    ctl.update(6.6, n)  # 6.6 / 6 - 1 = 0.1: inside the clip range
    expected *= 1 + 0.1 * 512 / 10000
    assert ctl.value == pytest.approx(expected, rel=1e-12)
    ctl.update(torch.tensor(0.3), 256)  # 0.3 / 6 - 1 = -0.95 -> clipped to -0.2
    expected *= 1 - 0.2 * 256 / 10000
    assert ctl.value == pytest.approx(expected, rel=1e-12)


def test_adaptive_kl_controller_small_kl_decreases_and_on_target_keeps_value():
    ctl = F.AdaptiveKLController(0.15, 6.0, 10000)
    ctl.update(5.4, 100)  # -0.1
    assert ctl.value == pytest.approx(0.15 * (1 - 0.1 * 100 / 10000))
    assert ctl.value < 0.15
    before = ctl.value
    ctl.update(6.0, 1000)
    assert ctl.value == before


def test_adaptive_kl_controller_state_dict_round_trip():
    ctl = F.AdaptiveKLController(0.15, 6.0, 10000)
    ctl.update(9.0, 512)
    state = ctl.state_dict()
    restored = F.AdaptiveKLController(0.5, 1.0, 10)
    restored.load_state_dict(state)
    assert (restored.value, restored.target, restored.horizon) == (ctl.value, 6.0, 10000)
    ctl.update(1.0, 10)
    restored.update(1.0, 10)
    assert restored.value == ctl.value
    assert "AdaptiveKLController(value=" in repr(ctl)
    with pytest.raises(KeyError, match="value"):
        restored.load_state_dict({})


def test_fixed_kl_controller_never_changes():
    ctl = F.FixedKLController(0.05)
    ctl.update(100.0, 10_000)
    assert ctl.value == 0.05
    other = F.FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05
    assert repr(ctl) == "FixedKLController(value=0.05)"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0.1, 0.0, 10), "target must be > 0"),
        ((0.1, -1.0, 10), "got -1.0"),
        ((0.1, 6.0, 0), "horizon must be > 0"),
        ((-0.1, 6.0, 10), "init_kl_coef must be a finite number >= 0"),
    ],
)
def test_kl_controllers_validate_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        F.AdaptiveKLController(*args)


def test_kl_controllers_reject_bad_coef_and_nonfinite_kl():
    with pytest.raises(ValueError, match="kl_coef"):
        F.FixedKLController(-1.0)
    with pytest.raises(ValueError, match="non-finite"):
        F.AdaptiveKLController(0.1, 6.0, 10).update(float("nan"), 1)


# ------------------------------------------------------------------------------------------------
# GAE
# ------------------------------------------------------------------------------------------------


def gae_reference(rewards, values, mask, gamma, lam):
    """Plain-Python GAE over lists, skipping masked positions (NeMo carry-forward masking)."""
    advs, rets = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask, strict=True):
        lam_row = lam[len(advs)] if isinstance(lam, list) else lam
        n = len(r_row)
        adv, ret = [0.0] * n, [0.0] * n
        next_value, last = 0.0, 0.0
        for i in reversed(range(n)):
            if not m_row[i]:
                continue
            delta = r_row[i] + gamma * next_value - v_row[i]
            last = delta + gamma * lam_row * last
            adv[i], ret[i] = last, last + v_row[i]
            next_value = v_row[i]
        advs.append(adv)
        rets.append(ret)
    return advs, rets


def random_gae_inputs(seed, B=4, T=9):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64)
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = torch.rand(B, T, generator=gen) > 0.35
    mask[0] = torch.tensor([1, 0, 0, 1, 1, 0, 1, 0, 1][:T], dtype=torch.bool)  # holes in the middle
    mask[1] = False  # an all-masked row
    return rewards, values, mask


@pytest.mark.parametrize("seed", range(6))
def test_gae_matches_plain_python_reference_with_holes_in_mask(seed):
    rewards, values, mask = random_gae_inputs(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    gamma, lam = (torch.rand(2, generator=gen) * 0.5 + 0.5).tolist()
    adv, ret = F.gae_advantages(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64))


def test_gae_by_hand_three_tokens():
    """gamma=1, lam=0.5, r=[0, 0, 1], V=[0.5, 0.6, 0.7], last token terminal."""
    adv, ret = F.gae_advantages(
        t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), torch.ones(1, 3), gamma=1.0, lam=0.5
    )
    d2 = 1.0 - 0.7
    d1 = 0.0 + 0.7 - 0.6
    d0 = 0.0 + 0.6 - 0.5
    a2, a1 = d2, d1 + 0.5 * d2
    a0 = d0 + 0.5 * a1
    torch.testing.assert_close(adv, t([[a0, a1, a2]]))
    torch.testing.assert_close(ret, t([[a0 + 0.5, a1 + 0.6, a2 + 0.7]]))


def test_gae_lam1_gamma1_gives_reward_to_go_over_valid_tokens():
    rewards = t([[1.0, 2.0, 50.0, 3.0, 4.0]])
    values = t([[0.5, 1.0, -9.0, 2.0, 0.25]])
    mask = torch.tensor([[1, 1, 0, 1, 1]])
    adv, ret = F.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, t([[10.0, 9.0, 0.0, 7.0, 4.0]]))
    torch.testing.assert_close(adv, t([[9.5, 8.0, 0.0, 5.0, 3.75]]))


def test_gae_lam0_is_one_step_td_error():
    rewards = t([[0.1, 0.2, 0.3, 0.4]])
    values = t([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[1, 1, 0, 1]])
    gamma = 0.9
    adv, ret = F.gae_advantages(rewards, values, mask, gamma=gamma, lam=0.0)
    # the next VALID token of position 1 is position 3
    expected = [0.1 + gamma * 2.0 - 1.0, 0.2 + gamma * 4.0 - 2.0, 0.0, 0.4 - 4.0]
    torch.testing.assert_close(adv, t([expected]))
    torch.testing.assert_close(ret, t([[expected[0] + 1, expected[1] + 2, 0.0, expected[3] + 4]]))


def test_gae_padding_columns_with_garbage_change_nothing_on_valid_tokens():
    rewards, values, mask = random_gae_inputs(3, B=3, T=6)
    adv, ret = F.gae_advantages(rewards, values, mask, gamma=0.97, lam=0.9)
    insert_at = [0, 2, 2, 6]  # before, inside (twice) and after
    cols_r, cols_v, cols_m, keep = [], [], [], []
    for j in range(7):
        for _ in range(insert_at.count(j)):
            cols_r.append(torch.full((3,), math.nan, dtype=torch.float64))
            cols_v.append(torch.full((3,), math.inf, dtype=torch.float64))
            cols_m.append(torch.zeros(3, dtype=torch.bool))
            keep.append(False)
        if j < 6:
            cols_r.append(rewards[:, j])
            cols_v.append(values[:, j])
            cols_m.append(mask[:, j])
            keep.append(True)
    padded = (torch.stack(cols_r, 1), torch.stack(cols_v, 1), torch.stack(cols_m, 1))
    adv_p, ret_p = F.gae_advantages(*padded, gamma=0.97, lam=0.9)
    keep_t = torch.tensor(keep)
    torch.testing.assert_close(adv_p[:, keep_t], adv)
    torch.testing.assert_close(ret_p[:, keep_t], ret)
    assert (adv_p[:, ~keep_t] == 0).all() and (ret_p[:, ~keep_t] == 0).all()


def test_gae_decoupled_lambdas_match_plain_calls():
    """NeMo "VAPO Decoupled GAE": returns with lam_value, advantages with lam_policy."""
    rewards, values, mask = random_gae_inputs(7)
    adv, ret = F.gae_advantages(rewards, values, mask, 1.0, 0.95, lam_value=1.0, lam_policy=0.8)
    ref_adv, _ = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), 1.0, 0.8)
    _, ref_ret = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64))
    # lam_value alone: advantages keep lam
    adv, ret = F.gae_advantages(rewards, values, mask, 0.99, 0.9, lam_value=0.5)
    ref_adv, _ = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), 0.99, 0.9)
    _, ref_ret = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), 0.99, 0.5)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64))


def test_gae_length_adaptive_lambda_matches_per_row_reference():
    """NeMo: lambda_policy = 1 - 1 / (alpha * l), l = response length; takes priority over lam_policy."""
    rewards, values, mask = random_gae_inputs(11, B=4, T=9)
    mask[3] = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    alpha = 0.3
    lengths = mask.sum(1).tolist()
    lam_rows = [min(max(1 - 1 / max(alpha * n, 1.0), 0.0), 1.0) for n in lengths]
    assert lam_rows[3] == 0.0 and 0 < lam_rows[2] < 1  # alpha * l < 1 clamps lambda to 0
    adv, ret = F.gae_advantages(
        rewards, values, mask, 0.99, 0.95, lam_policy=0.5, length_adaptive_alpha=alpha, lam_value=0.9
    )
    ref_adv, _ = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), 0.99, lam_rows)
    _, ref_ret = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), 0.99, 0.9)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64))
    # and row by row against plain calls of the function with that row's lambda
    for i, lam_i in enumerate(lam_rows):
        adv_i, _ = F.gae_advantages(rewards[i : i + 1], values[i : i + 1], mask[i : i + 1], 0.99, lam_i)
        torch.testing.assert_close(adv[i : i + 1], adv_i)


def test_gae_dtypes_bf16_in_float32_out_float64_kept():
    rewards, values, mask = random_gae_inputs(2)
    adv, ret = F.gae_advantages(rewards.bfloat16(), values.bfloat16(), mask)
    assert adv.dtype == ret.dtype == torch.float32
    ref_adv, ref_ret = gae_reference(
        rewards.bfloat16().double().tolist(), values.bfloat16().double().tolist(), mask.tolist(), 1.0, 0.95
    )
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    adv, _ = F.gae_advantages(rewards.float(), values, mask)
    assert adv.dtype == torch.float64


def test_gae_rejects_bad_arguments():
    r = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="same shape"):
        F.gae_advantages(r, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"gamma must be a number in \[0, 1\], got 1.5"):
        F.gae_advantages(r, r, torch.ones(2, 3), gamma=1.5)
    with pytest.raises(ValueError, match="lam_value"):
        F.gae_advantages(r, r, torch.ones(2, 3), lam_value=-0.1)
    with pytest.raises(ValueError, match="length_adaptive_alpha"):
        F.gae_advantages(r, r, torch.ones(2, 3), length_adaptive_alpha=-1.0)
    adv, ret = F.gae_advantages(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0))
    assert adv.shape == ret.shape == (2, 0)


# ------------------------------------------------------------------------------------------------
# RLOO
# ------------------------------------------------------------------------------------------------


def test_rloo_advantages_blog_example_matches_slow_loop_and_asserts():
    """RLOO blog: 3 prompts x 4 completions, completion j of prompt i at index j * 3 + i."""
    local_batch_size, rloo_k = 3, 4
    rlhf_reward = torch.tensor([1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 10]).float()
    slow = torch.zeros_like(rlhf_reward)
    for i in range(0, len(slow), local_batch_size):
        others = [
            rlhf_reward[j : j + local_batch_size] for j in range(0, len(slow), local_batch_size) if i != j
        ]
        slow[i : i + local_batch_size] = rlhf_reward[i : i + local_batch_size] - torch.stack(others).mean(0)
    advantages = F.rloo_advantages(rlhf_reward, rloo_k)
    torch.testing.assert_close(advantages, slow)
    assert abs(1 - (2 + 5 + 8) / 3 - advantages[0].item()) < 1e-6
    assert abs(6 - (3 + 2 + 9) / 3 - advantages[7].item()) < 1e-6
    assert rlhf_reward.tolist() == [1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # input untouched


def test_rloo_advantages_sum_to_zero_per_prompt():
    """sum_j (r_j - (S - r_j) / (k - 1)) = S - (k S - S) / (k - 1) = 0."""
    rewards = torch.randn(5 * 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    adv = F.rloo_advantages(rewards, 5).reshape(5, 7)
    torch.testing.assert_close(adv.sum(0), torch.zeros(7, dtype=torch.float64), atol=1e-12, rtol=0)


def test_rloo_advantages_with_trailing_dims_and_k2():
    rewards = t([[1.0, 2.0], [3.0, 5.0]])  # k=2, B=1, T=2
    torch.testing.assert_close(F.rloo_advantages(rewards, 2), t([[-2.0, -3.0], [2.0, 3.0]]))
    assert F.rloo_advantages(rewards.bfloat16(), 2).dtype == torch.bfloat16


def trainer_leave_one_out(values, valid, k):
    """The formula of rlhf_trainers.rloo.leave_one_out at the time rloo_advantages(valid=) was added,
    copied so that the two stay equal to the last bit."""
    v = values.reshape(k, -1).double()
    m = valid.reshape(k, -1).to(v.dtype)
    others = m.sum(0, keepdim=True) - m
    baseline = ((v * m).sum(0, keepdim=True) - v * m) / others.clamp_min(1)
    adv = torch.where((others > 0) & (m > 0), v - baseline, torch.zeros_like(v))
    return adv.reshape(-1).to(values.dtype)


def blog_leave_one_out_float32(rewards, k):
    """rloo_advantages(rewards, k) before valid= existed, for float32 rewards."""
    grouped = rewards.float().reshape(k, rewards.shape[0] // k, *rewards.shape[1:])
    baseline = (grouped.sum(0, keepdim=True) - grouped) / (k - 1)
    return (grouped - baseline).reshape(rewards.shape)


@pytest.mark.parametrize("seed", range(20))
def test_rloo_advantages_with_valid_equal_the_trainers_leave_one_out_bit_for_bit(seed):
    gen = torch.Generator().manual_seed(seed)
    k = int(torch.randint(2, 6, (), generator=gen))
    prompts = int(torch.randint(1, 9, (), generator=gen))
    rewards = torch.randn(k * prompts, generator=gen) * 10 ** float(torch.randint(-3, 4, (), generator=gen))
    # a fraction of invalid completions from none to all, so that prompts with 0, 1 and several valid
    # completions all occur across the seeds
    valid = torch.rand(k * prompts, generator=gen) < float(torch.rand((), generator=gen))
    adv = F.rloo_advantages(rewards, k, valid)
    assert adv.dtype == torch.float32
    assert torch.equal(adv, trainer_leave_one_out(rewards, valid, k))
    # 0/1 masks mean the same as bool ones
    assert torch.equal(F.rloo_advantages(rewards, k, valid.long()), adv)


def test_rloo_advantages_with_valid_by_hand():
    # k=3, B=2: prompt 0 has rewards 1, 2, 4 with the last invalid; prompt 1 has a single valid one
    rewards = t([1.0, 10.0, 2.0, 20.0, 4.0, 30.0])
    valid = torch.tensor([True, False, True, True, False, False])
    # prompt 0: baselines are the other valid reward (2 and 1); invalid and lone completions get 0
    torch.testing.assert_close(F.rloo_advantages(rewards, 3, valid), t([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]))
    # the invalid completions' rewards are never read: NaN or inf there change nothing
    dirty = torch.where(valid, rewards, t([math.nan, math.inf, 0.0, -math.inf, math.nan, math.nan]))
    assert torch.equal(F.rloo_advantages(dirty, 3, valid), F.rloo_advantages(rewards, 3, valid))


def test_rloo_advantages_with_all_valid_match_the_unmasked_formula():
    rewards = torch.randn(4 * 6, generator=torch.Generator().manual_seed(1))
    all_valid = torch.ones(24, dtype=torch.bool)
    torch.testing.assert_close(F.rloo_advantages(rewards, 4, all_valid), F.rloo_advantages(rewards, 4))
    rewards64 = rewards.double()
    torch.testing.assert_close(
        F.rloo_advantages(rewards64, 4, all_valid), F.rloo_advantages(rewards64, 4), atol=1e-12, rtol=0
    )


def test_rloo_advantages_without_valid_is_the_blog_formula_bit_for_bit():
    gen = torch.Generator().manual_seed(2)
    for shape in [(3 * 5,), (3 * 5, 4)]:
        rewards = torch.randn(*shape, generator=gen) * 100
        assert torch.equal(F.rloo_advantages(rewards, 3), blog_leave_one_out_float32(rewards, 3))


def test_rloo_advantages_valid_with_trailing_dims_masks_whole_rows():
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(3 * 4, 5, generator=gen)
    valid = torch.tensor([True, False, True, True, True, False, False, True, False, True, True, False])
    adv = F.rloo_advantages(rewards, 3, valid)
    for column in range(5):
        assert torch.equal(adv[:, column], F.rloo_advantages(rewards[:, column].contiguous(), 3, valid))
    assert torch.equal(adv[~valid], torch.zeros_like(adv[~valid]))


@pytest.mark.parametrize("valid_shape", [(5,), (6, 1), (3, 2)])
def test_rloo_advantages_rejects_a_valid_mask_of_the_wrong_shape(valid_shape):
    with pytest.raises(ValueError, match="valid must be"):
        F.rloo_advantages(torch.zeros(6), 2, torch.ones(valid_shape, dtype=torch.bool))


@pytest.mark.parametrize(
    ("n", "k", "match"), [(8, 1, "rloo_k must be an integer >= 2"), (7, 2, "divisible by rloo_k=2")]
)
def test_rloo_advantages_rejects_bad_k(n, k, match):
    with pytest.raises(ValueError, match=match):
        F.rloo_advantages(torch.zeros(n), k)


# ------------------------------------------------------------------------------------------------
# truncation, rejection sampling, positions
# ------------------------------------------------------------------------------------------------

PAD, STOP = 0, 13


def test_first_and_last_true_indices():
    bools = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 1]])
    torch.testing.assert_close(F.first_true_indices(bools), torch.tensor([1, 4, 0]))
    torch.testing.assert_close(F.last_true_indices(bools), torch.tensor([2, -1, 3]))
    torch.testing.assert_close(F.last_true_indices(bools.bool(), empty_value=0), torch.tensor([2, 0, 3]))
    assert F.first_true_indices(bools.bool(), dtype=torch.int32).dtype == torch.int32
    torch.testing.assert_close(
        F.first_true_indices(torch.zeros(2, 0, dtype=torch.bool)), torch.tensor([0, 0])
    )


def test_last_true_indices_reads_reward_at_last_real_token():
    """Left-padded query + right-padded response: the score is at the last non-pad token."""
    query_response = torch.tensor([[PAD, 5, 6, 7, STOP, PAD, PAD], [8, 9, 10, 11, 12, 12, 12]])
    idx = F.last_true_indices(query_response != PAD)
    torch.testing.assert_close(idx, torch.tensor([4, 6]))
    rewards = torch.arange(14.0).reshape(2, 7)
    torch.testing.assert_close(rewards[torch.arange(2), idx], t([4.0, 13.0]))


def test_truncate_response_keeps_stop_token_and_pads_everything_after():
    responses = torch.tensor([[5, STOP, 7, STOP, 9], [5, 6, 7, 8, 9], [STOP, 1, 2, 3, 4]])
    out = F.truncate_response(responses, STOP, PAD)
    torch.testing.assert_close(out, torch.tensor([[5, STOP, 0, 0, 0], [5, 6, 7, 8, 9], [STOP, 0, 0, 0, 0]]))
    assert responses[0].tolist() == [5, STOP, 7, STOP, 9]


def test_truncate_response_only_counts_stop_tokens_at_or_after_truncate_after():
    """N-impl rejection sampling: the period must appear at or after position truncate_after."""
    responses = torch.tensor([[STOP, 4, STOP, 6, 7], [STOP, 4, 5, 6, 7], [1, 2, 3, 4, STOP]])
    out = F.truncate_response(responses, STOP, PAD, truncate_after=2)
    torch.testing.assert_close(
        out, torch.tensor([[STOP, 4, STOP, 0, 0], [STOP, 4, 5, 6, 7], [1, 2, 3, 4, STOP]])
    )
    found = F.stop_token_found(responses, STOP, truncate_after=2)
    torch.testing.assert_close(found, torch.tensor([True, False, True]))
    torch.testing.assert_close(F.stop_token_found(responses, STOP), torch.tensor([True, True, True]))


def test_truncate_response_with_several_stop_ids_and_pad_equal_to_stop():
    responses = torch.tensor([[1, 2, 3, 4], [1, 4, 2, 2]])
    out = F.truncate_response(responses, [3, 4], pad_token_id=9)
    torch.testing.assert_close(out, torch.tensor([[1, 2, 3, 9], [1, 4, 9, 9]]))
    same = F.truncate_response(responses, 2, pad_token_id=2)
    torch.testing.assert_close(same, torch.tensor([[1, 2, 2, 2], [1, 4, 2, 2]]))
    torch.testing.assert_close(F.truncate_response(same, 2, pad_token_id=2), same)


def test_apply_rejection_penalty_replace_and_subtract():
    """N-impl: continuations without the period get a fixed reward of -1; TRL subtracts a penalty."""
    scores = t([0.5, 2.0, -3.0])
    found = torch.tensor([True, False, False])
    torch.testing.assert_close(F.apply_rejection_penalty(scores, found, -1.0), t([0.5, -1.0, -1.0]))
    torch.testing.assert_close(
        F.apply_rejection_penalty(scores, found.long(), 1.0, "subtract"), t([0.5, 1.0, -4.0])
    )
    assert scores.tolist() == [0.5, 2.0, -3.0]
    with pytest.raises(ValueError, match="replace, subtract"):
        F.apply_rejection_penalty(scores, found, 1.0, "clip")


def test_position_ids_from_mask_lhpd_example():
    """N-impl "Adjust position indices": query [pad, pad, 23073], response [11, 339, 561]."""
    pad_id = 50257
    query_response = torch.tensor([[pad_id, pad_id, 23073, 11, 339, 561]])
    pos = F.position_ids_from_mask(query_response != pad_id)
    assert pos.dtype == torch.long
    assert pos.tolist() == [[0, 0, 0, 1, 2, 3]]
    assert F.position_ids_from_mask(torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])).tolist() == [
        [0, 1, 2],
        [0, 0, 1],
    ]


# ------------------------------------------------------------------------------------------------
# log-probabilities, entropy
# ------------------------------------------------------------------------------------------------


def reference_logprobs(logits, tokens, temperature=1.0):
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_from_logits_matches_log_softmax_gather(chunk_size, temperature):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen) * 4
    tokens = torch.randint(0, 11, (3, 5), generator=gen)
    before = logits.clone()
    out = F.logprobs_from_logits(logits, tokens, temperature, chunk_size=chunk_size)
    torch.testing.assert_close(out, reference_logprobs(logits, tokens, temperature), atol=1e-6, rtol=0)
    torch.testing.assert_close(logits, before, atol=0, rtol=0)  # temperature did not scale in place


def test_logprobs_from_logits_gradient_matches_autograd_reference():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2, 6, 9, generator=gen)
    tokens = torch.randint(0, 9, (2, 6), generator=gen)
    weights = torch.randn(2, 6, generator=gen)
    logits = base.clone().requires_grad_()
    (F.logprobs_from_logits(logits, tokens, 0.8, chunk_size=5) * weights).sum().backward()
    ref_logits = base.clone().requires_grad_()
    (reference_logprobs(ref_logits, tokens, 0.8) * weights).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, atol=1e-6, rtol=0)


def test_logprobs_from_logits_passes_gradcheck_in_float64():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 3), generator=gen)
    assert torch.autograd.gradcheck(lambda x: F.logprobs_from_logits(x, tokens, 1.3, chunk_size=2), (logits,))


def test_logprobs_from_logits_noncontiguous_slice_of_logits():
    """The trainer slices logits[:, context_length - 1 : -1]; that must work and not be copied whole."""
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(2, 8, 7, generator=gen, requires_grad=True)
    sliced = full[:, 2:-1]
    assert not sliced.is_contiguous()
    tokens = torch.randint(0, 7, (2, 5), generator=gen)
    out = F.logprobs_from_logits(sliced, tokens, chunk_size=2)
    torch.testing.assert_close(out, reference_logprobs(sliced, tokens), atol=1e-6, rtol=0)
    out.sum().backward()
    ref = full.detach().clone().requires_grad_()
    reference_logprobs(ref[:, 2:-1], tokens).sum().backward()
    torch.testing.assert_close(full.grad, ref.grad, atol=1e-6, rtol=0)


def test_logprobs_from_logits_bf16_with_float32_compute():
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, 4, 50, generator=gen) * 5).bfloat16()
    tokens = torch.randint(0, 50, (2, 4), generator=gen)
    out = F.logprobs_from_logits(logits, tokens, chunk_size=3, compute_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference_logprobs(logits.float(), tokens), atol=1e-5, rtol=0)
    plain = F.logprobs_from_logits(logits, tokens)
    assert plain.dtype == torch.bfloat16
    torch.testing.assert_close(plain.float(), out, atol=0.1, rtol=0.02)
    leaf = logits.clone().requires_grad_()
    F.logprobs_from_logits(leaf, tokens, compute_dtype=torch.float32).sum().backward()
    assert leaf.grad.dtype == torch.bfloat16


def test_logprobs_from_logits_rejects_bad_arguments():
    logits, tokens = torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        F.logprobs_from_logits(logits, tokens, 0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        F.logprobs_from_logits(logits, tokens, chunk_size=0)
    with pytest.raises(ValueError, match="tokens must have the shape"):
        F.logprobs_from_logits(logits, tokens[:, :2])


def test_entropy_from_logits_matches_categorical_and_handles_filtered_vocab():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 10, generator=gen) * 3
    expected = torch.distributions.Categorical(logits=logits / 0.9).entropy()
    out = F.entropy_from_logits(logits, chunk_size=5, temperature=0.9)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    filtered = logits.clone()
    filtered[..., 5:] = -math.inf  # top-k filtering leaves -inf logits
    filtered.requires_grad_()
    out = F.entropy_from_logits(filtered, chunk_size=2)
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(filtered.grad).all()
    torch.testing.assert_close(
        out, torch.distributions.Categorical(logits=logits[..., :5]).entropy(), atol=1e-5, rtol=0
    )
    assert F.entropy_from_logits(torch.zeros(2, 3, 8)).sub(math.log(8)).abs().max() < 1e-6


# ------------------------------------------------------------------------------------------------
# policy loss
# ------------------------------------------------------------------------------------------------


def test_ppo_gradient_equals_reinforce_gradient_rloo_blog_example():
    """RLOO blog: logits [[1, 2, 1, 1]], action 1, advantage 1 -> both print
    logits.grad = [[-0.1749, 0.5246, -0.1749, -0.1749]] for the (non-negated) objectives."""
    action = torch.tensor([1])
    advantage = torch.tensor([[1.0]])
    logits = torch.tensor([[[1.0, 2.0, 1.0, 1.0]]], requires_grad=True)
    logprob = F.logprobs_from_logits(logits, action.unsqueeze(0))
    loss, metrics = F.clipped_policy_loss(logprob, logprob.detach(), advantage, torch.ones(1, 1))
    loss.backward()
    blog = torch.tensor([[-0.1749, 0.5246, -0.1749, -0.1749]])
    # our loss is the negated objective: its gradient is minus the blog's printout
    torch.testing.assert_close(logits.grad[0], -blog, atol=1e-4, rtol=0)
    logits2 = torch.tensor([[1.0, 2.0, 1.0, 1.0]], requires_grad=True)
    reinforce = torch_f.log_softmax(logits2, dim=-1).gather(1, action.unsqueeze(-1)).squeeze(-1) * 1.0
    reinforce.mean().backward()
    torch.testing.assert_close(logits.grad[0], -logits2.grad, atol=1e-7, rtol=0)
    assert metrics["clipfrac"].item() == 0.0 and metrics["ratio_mean"].item() == 1.0


def _lp(ratios):
    return torch.log(t([ratios], torch.float64))


def test_policy_loss_clipping_by_hand_positive_advantage():
    old = torch.zeros(1, 3, dtype=torch.float64)
    adv = torch.ones(1, 3, dtype=torch.float64)
    loss, metrics = F.clipped_policy_loss(_lp([0.5, 1.0, 1.5]), old, adv, torch.ones(1, 3))
    # per token max(-r, -clip(r, 0.8, 1.2)) = [-0.5, -1.0, -1.2]; only ratio 1.5 is clipped
    assert loss.item() == pytest.approx((-0.5 - 1.0 - 1.2) / 3)
    assert metrics["clipfrac"].item() == pytest.approx(1 / 3)


def test_policy_loss_clipping_by_hand_negative_advantage():
    old = torch.zeros(1, 3, dtype=torch.float64)
    adv = -torch.ones(1, 3, dtype=torch.float64)
    loss, metrics = F.clipped_policy_loss(_lp([0.5, 1.0, 1.5]), old, adv, torch.ones(1, 3))
    # per token max(r, clip(r)) = [0.8, 1.0, 1.5]; only ratio 0.5 is clipped
    assert loss.item() == pytest.approx((0.8 + 1.0 + 1.5) / 3)
    assert metrics["clipfrac"].item() == pytest.approx(1 / 3)
    assert metrics["dual_clipfrac"].item() == 0.0


def test_policy_loss_clipped_tokens_get_no_gradient():
    logprobs = _lp([0.5, 1.5]).requires_grad_()
    loss, _ = F.clipped_policy_loss(
        logprobs, torch.zeros(1, 2, dtype=torch.float64), t([[-1.0, 1.0]], torch.float64), torch.ones(1, 2)
    )
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.zeros(1, 2, dtype=torch.float64))


def test_policy_loss_asymmetric_clip():
    """DAPO / NeMo ratio_clip_min=0.2, ratio_clip_max=0.28."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    adv = torch.ones(1, 3, dtype=torch.float64)
    loss, metrics = F.clipped_policy_loss(_lp([1.25, 1.3, 0.7]), old, adv, torch.ones(1, 3), 0.2, 0.28)
    assert loss.item() == pytest.approx((-1.25 - 1.28 - 0.7) / 3)
    assert metrics["clipfrac"].item() == pytest.approx(1 / 3)
    loss_neg, _ = F.clipped_policy_loss(_lp([1.25, 1.3, 0.7]), old, -adv, torch.ones(1, 3), 0.2, 0.28)
    assert loss_neg.item() == pytest.approx((1.25 + 1.3 + 0.8) / 3)


def test_policy_loss_dual_clip_caps_negative_advantage_with_large_ratio():
    """NeMo ratio_clip_c: for A < 0 the loss is min(max(pg1, pg2), -A * c)."""
    old = torch.zeros(1, 3, dtype=torch.float64)
    adv = t([[-2.0, -2.0, 1.0]], torch.float64)
    logprobs = _lp([5.0, 1.1, 5.0]).requires_grad_()
    loss, metrics = F.clipped_policy_loss(logprobs, old, adv, torch.ones(1, 3), dual_clip=3.0)
    # token 0: max(10, 2.4) = 10 -> capped at 6; token 1: 2.2 (< 6); token 2 (A > 0): max(-5, -1.2) = -1.2
    assert loss.item() == pytest.approx((6.0 + 2.2 - 1.2) / 3)
    assert metrics["dual_clipfrac"].item() == pytest.approx(1 / 3)
    loss.backward()
    assert logprobs.grad[0, 0].item() == 0.0  # the capped token no longer pushes the ratio
    off, _ = F.clipped_policy_loss(_lp([5.0, 1.1, 5.0]), old, adv, torch.ones(1, 3))
    assert off.item() == pytest.approx((10.0 + 2.2 - 1.2) / 3)


def test_policy_loss_masked_tokens_contribute_nothing_even_with_garbage():
    logprobs = t([[-1.0, 80.0, -2.0]]).requires_grad_()
    old = t([[-1.2, -80.0, -2.0]])
    adv = t([[1.0, math.inf, -1.0]])
    mask = torch.tensor([[1, 0, 1]])
    loss, metrics = F.clipped_policy_loss(logprobs, old, adv, mask)
    r0 = math.exp(0.2)
    assert loss.item() == pytest.approx((-min(r0, 1.2) + 1.0) / 2, rel=1e-6)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[0, 1].item() == 0.0
    assert all(torch.isfinite(v) for v in metrics.values())
    assert metrics["ratio_max"].item() == pytest.approx(r0, rel=1e-6)
    assert metrics["ratio_min"].item() == pytest.approx(1.0)


def test_policy_loss_aggregation_modes_by_hand():
    # ratio 1 everywhere: per-token loss = -A
    adv = t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [7.0, 8.0, 9.0]], torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    lp = torch.zeros(3, 3, dtype=torch.float64)
    token_mean, _ = F.clipped_policy_loss(lp, lp, adv, mask, loss_agg_mode="token-mean")
    assert token_mean.item() == pytest.approx(-(1 + 2 + 3 + 4) / 4)
    seq_mean, _ = F.clipped_policy_loss(lp, lp, adv, mask, loss_agg_mode="seq-mean-token-mean")
    assert seq_mean.item() == pytest.approx(-((1 + 2 + 3) / 3 + 4) / 2)
    seq_sum, _ = F.clipped_policy_loss(lp, lp, adv, mask, loss_agg_mode="seq-mean-token-sum")
    assert seq_sum.item() == pytest.approx(-((1 + 2 + 3) + 4) / 2)
    # a global denominator (gradient accumulation): the sum divided by it
    scaled, _ = F.clipped_policy_loss(lp, lp, adv, mask, denominator=20)
    assert scaled.item() == pytest.approx(-10 / 20)
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean, seq-mean-token-sum"):
        F.clipped_policy_loss(lp, lp, adv, mask, loss_agg_mode="sum")


def test_policy_loss_all_masked_is_zero_and_metrics_zero():
    lp = torch.randn(2, 3)
    loss, metrics = F.clipped_policy_loss(lp, lp, torch.ones(2, 3), torch.zeros(2, 3))
    assert loss.item() == 0.0
    assert all(v.item() == 0.0 for v in metrics.values())
    for mode in F.LOSS_AGG_MODES:
        assert (
            F.clipped_policy_loss(lp, lp, torch.ones(2, 3), torch.zeros(2, 3), loss_agg_mode=mode)[0].item()
            == 0.0
        )


def test_gradients_stay_finite_with_garbage_at_masked_positions():
    values = t([[1.0, 3.0, 4.0, math.inf]]).requires_grad_()
    F.whiten(values, torch.tensor([[1, 1, 1, 0]])).mul(t([[1.0, 2.0, 5.0, 3.0]])).sum().backward()
    compact = t([1.0, 3.0, 4.0]).requires_grad_()
    (
        (compact - compact.mean()) * torch.rsqrt(compact.var(unbiased=False) + 1e-8) * t([1.0, 2.0, 5.0])
    ).sum().backward()
    torch.testing.assert_close(values.grad[0, :3], compact.grad)
    assert values.grad[0, 3].item() == 3.0  # masked entries pass through unchanged (identity)
    mask = torch.tensor([[1, 1, 0]])
    logprobs = t([[-1.0, -2.0, math.nan]]).requires_grad_()
    weights = t([[1.0, 0.5, math.nan]])
    loss, _ = F.clipped_policy_loss(
        logprobs, t([[-1.1, -2.0, 0.0]]), t([[1.0, -1.0, 1.0]]), mask, importance_weights=weights
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    values = t([[1.0, 3.0, math.nan]]).requires_grad_()
    vloss, _ = F.clipped_value_loss(values, t([[1.0, 2.0, math.nan]]), t([[0.0, 0.0, math.inf]]), mask)
    vloss.backward()
    assert torch.isfinite(vloss) and torch.isfinite(values.grad).all()


def test_policy_loss_importance_weights_and_sequence_level_advantages():
    lp = torch.zeros(2, 2)
    weights = t([[0.5, 2.0], [1.0, 0.0]])
    adv = t([[1.0], [3.0]])  # (B, 1) broadcast over tokens, as RLOO's per-sequence advantages
    loss, _ = F.clipped_policy_loss(lp, lp, adv, torch.ones(2, 2), importance_weights=weights)
    assert loss.item() == pytest.approx(-(0.5 + 2.0 + 3.0 + 0.0) / 4)


def test_policy_loss_metrics_by_hand():
    lp = t([[0.1, -0.2, 0.0, 5.0]], torch.float64)
    old = torch.zeros(1, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    _, m = F.clipped_policy_loss(lp, old, torch.ones(1, 4), mask)
    ratios = torch.exp(t([0.1, -0.2, 0.0], torch.float64))
    assert m["approxkl"].item() == pytest.approx(0.5 * (0.01 + 0.04) / 3, rel=1e-6)
    assert m["ratio_mean"].item() == pytest.approx(ratios.mean().item(), rel=1e-6)
    assert m["ratio_var"].item() == pytest.approx(ratios.var(unbiased=False).item(), rel=1e-5)
    assert m["ratio_max"].item() == pytest.approx(math.exp(0.1), rel=1e-6)
    assert m["ratio_min"].item() == pytest.approx(math.exp(-0.2), rel=1e-6)
    assert m["clipfrac"].item() == 0.0
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clip_low": 0.0}, "clip_low must be in"),
        ({"clip_low": 1.0}, "clip_low must be in"),
        ({"clip_high": -0.1}, "clip_high must be > 0"),
        ({"dual_clip": 1.0}, "dual_clip"),
    ],
)
def test_policy_loss_validates_clip_arguments(kwargs, match):
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=match):
        F.clipped_policy_loss(lp, lp, lp, torch.ones(1, 2), **kwargs)


# ------------------------------------------------------------------------------------------------
# value loss
# ------------------------------------------------------------------------------------------------


def test_value_loss_clipped_by_hand():
    values = t([[1.0, 2.0, 3.0]]).requires_grad_()
    old = t([[0.5, 2.0, 3.5]])
    returns = t([[2.0, 1.0, 3.0]])
    loss, m = F.clipped_value_loss(values, old, returns, torch.ones(1, 3), 0.2)
    # token 0: (1-2)^2 = 1, clipped V = 0.5+0.2 -> 1.69; token 1: 1 and 1 (V == old);
    # token 2: 0 and clipped V = 3.5-0.2 -> 0.09
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0 + 0.09) / 3)
    assert m["vf_clipfrac"].item() == pytest.approx(2 / 3)
    assert m["values_mean"].item() == pytest.approx(2.0)
    assert (m["values_min"].item(), m["values_max"].item()) == (1.0, 3.0)
    assert m["returns_mean"].item() == pytest.approx(2.0)
    loss.backward()
    assert values.grad[0, 0].item() == 0.0  # the clipped term wins and is constant in V


def test_value_loss_unclipped_and_masked():
    values = t([[1.0, 2.0, math.nan]])
    returns = t([[2.0, 4.0, 0.0]])
    loss, m = F.clipped_value_loss(values, values, returns, torch.tensor([[1, 1, 0]]), None)
    assert loss.item() == pytest.approx(0.5 * (1 + 4) / 2)
    assert m["vf_clipfrac"].item() == 0.0
    seq, _ = F.clipped_value_loss(
        values, values, returns, torch.tensor([[1, 1, 0]]), None, loss_agg_mode="seq-mean-token-sum"
    )
    assert seq.item() == pytest.approx(0.5 * 5)
    with pytest.raises(ValueError, match="cliprange_value must be > 0"):
        F.clipped_value_loss(values, values, returns, torch.ones(1, 3), 0.0)


# ------------------------------------------------------------------------------------------------
# reward scaling, shaping, normalization
# ------------------------------------------------------------------------------------------------


def test_scale_rewards_clamps_then_maps_linearly():
    """NeMo reward_scaling: source [0, 1] -> target [-1, 1]."""
    scores = t([-0.5, 0.0, 0.25, 1.0, 2.0])
    torch.testing.assert_close(F.scale_rewards(scores, 0.0, 1.0, -1.0, 1.0), t([-1.0, -1.0, -0.5, 1.0, 1.0]))
    torch.testing.assert_close(F.scale_rewards(torch.tensor([0, 5, 10]), 0, 10, 0, 1), t([0.0, 0.5, 1.0]))
    with pytest.raises(ValueError, match="source_max must be > source_min"):
        F.scale_rewards(scores, 1.0, 1.0, -1.0, 1.0)


def test_overlong_penalty_by_hand():
    """DAPO / NeMo: max_response_length=20, buffer 4 -> ramp from length 16 to 20, capped at -penalty."""
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    out = F.overlong_penalty(lengths, 20, 4, 1.0)
    torch.testing.assert_close(out, t([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(F.overlong_penalty(lengths, 20, 4, 2.0), t([0.0, 0.0, -0.5, -1.0, -2.0, -2.0]))
    with pytest.raises(ValueError, match="buffer_length"):
        F.overlong_penalty(lengths, 20, 30, 1.0)
    with pytest.raises(ValueError, match="penalty"):
        F.overlong_penalty(lengths, 20, 4, -1.0)


def test_normalize_rewards_gain_bias_lhpd_formula():
    """N-impl "Reward model normalization": g = sigma_T / sigma_D, b = mu_T - g * mu_D."""
    scores = t([1.0, 2.0, 3.0, 4.0], torch.float64)
    gain, bias = F.normalize_rewards_gain_bias(scores)
    sigma = math.sqrt(1.25)  # population std of 1..4
    assert gain == pytest.approx(1 / sigma)
    assert bias == pytest.approx(-2.5 / sigma)
    normalized = scores * gain + bias
    assert normalized.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert normalized.std(unbiased=False).item() == pytest.approx(1.0)
    gain, bias = F.normalize_rewards_gain_bias(scores, target_mean=3.0, target_std=0.5)
    shifted = scores * gain + bias
    assert shifted.mean().item() == pytest.approx(3.0) and shifted.std(
        unbiased=False
    ).item() == pytest.approx(0.5)


def test_normalize_rewards_gain_bias_with_all_reduce_and_degenerate_scores():
    scores = t([1.0, 2.0, 3.0, 4.0])
    reduce = FakeTwoRanks(scores[2:], None)
    assert F.normalize_rewards_gain_bias(scores[:2], all_reduce=reduce) == pytest.approx(
        F.normalize_rewards_gain_bias(scores)
    )
    with pytest.raises(ValueError, match="all equal"):
        F.normalize_rewards_gain_bias(t([2.0, 2.0, 2.0]))
    with pytest.raises(ValueError, match="no scores"):
        F.normalize_rewards_gain_bias(torch.zeros(0))


# ------------------------------------------------------------------------------------------------
# module-wide contracts
# ------------------------------------------------------------------------------------------------


def test_functions_do_not_modify_their_inputs():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 4, generator=gen)
    y = torch.randn(3, 4, generator=gen)
    m = torch.rand(3, 4, generator=gen) > 0.3
    logits = torch.randn(3, 4, 6, generator=gen)
    tokens = torch.randint(0, 6, (3, 4), generator=gen)
    ids = torch.randint(0, 5, (3, 4), generator=gen)
    inputs = [x, y, m, logits, tokens, ids]
    snapshot = [i.clone() for i in inputs]
    F.masked_mean(x, m)
    F.masked_var(x, m, unbiased=True)
    F.whiten(x, m, shift_mean=False)
    F.explained_variance(x, y, m)
    for est in F.KL_ESTIMATORS:
        F.kl_penalty(x, y, est)
    F.gae_advantages(x, y, m, 0.9, 0.8, length_adaptive_alpha=0.5)
    F.rloo_advantages(x, 3)
    F.truncate_response(ids, 2, 0, 1)
    F.logprobs_from_logits(logits, tokens, 0.5, chunk_size=2, compute_dtype=torch.float64)
    F.entropy_from_logits(logits, chunk_size=5, temperature=2.0)
    F.clipped_policy_loss(x, y, x, m, dual_clip=2.0, importance_weights=y.abs())
    F.clipped_value_loss(x, y, x, m)
    F.scale_rewards(x, -1, 1, 0, 1)
    for before, after in zip(snapshot, inputs, strict=True):
        assert torch.equal(before, after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_every_function_accepts_fp32_fp64_bf16_and_stays_finite(dtype):
    gen = torch.Generator().manual_seed(10)
    x64 = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    y64 = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(4, 5, generator=gen) > 0.3
    mask[1] = False
    x, y = x64.to(dtype), y64.to(dtype)
    loose = {"atol": 5e-2, "rtol": 5e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    same_dtype = {
        "masked_mean": (F.masked_mean(x, mask, dim=1), F.masked_mean(x64, mask, dim=1)),
        "masked_var": (F.masked_var(x, mask, dim=1), F.masked_var(x64, mask, dim=1)),
        "whiten": (F.whiten(x, mask), F.whiten(x64, mask)),
        "kl_k3": (F.kl_penalty(x, y, "k3"), F.kl_penalty(x64, y64, "k3")),
        "rloo": (F.rloo_advantages(x, 2), F.rloo_advantages(x64, 2)),
        "scale": (F.scale_rewards(x, -1.0, 1.0, 0.0, 1.0), F.scale_rewards(x64, -1.0, 1.0, 0.0, 1.0)),
    }
    for name, (low, ref) in same_dtype.items():
        assert low.dtype == dtype, name
        assert torch.isfinite(low).all(), name
        torch.testing.assert_close(low.double(), ref.to(dtype).double(), **loose, msg=name)
    at_least_fp32 = torch.float64 if dtype == torch.float64 else torch.float32
    adv, ret = F.gae_advantages(x, y, mask, 0.99, 0.95)
    loss, metrics = F.clipped_policy_loss(x, y, x, mask, dual_clip=2.0)
    vloss, vmetrics = F.clipped_value_loss(x, y, x, mask)
    ev = F.explained_variance(x, y, mask)
    for name, out in {"adv": adv, "ret": ret, "loss": loss, "vloss": vloss, "ev": ev}.items():
        assert out.dtype == at_least_fp32 and torch.isfinite(out).all(), name
    assert all(torch.isfinite(v) for v in [*metrics.values(), *vmetrics.values()])
    logits = torch.randn(2, 3, 7, generator=gen).to(dtype)
    tokens = torch.randint(0, 7, (2, 3), generator=gen)
    assert F.logprobs_from_logits(logits, tokens).dtype == dtype
    assert F.entropy_from_logits(logits, compute_dtype=torch.float32).dtype == torch.float32


def test_all_lists_public_names():
    """The package re-exports every public name of its modules, and only those."""
    modules = {name: obj for name, obj in vars(F).items() if isinstance(obj, types.ModuleType)}
    assert set(modules) == {
        "advantages",
        "kl",
        "logprob_kernels",
        "losses",
        "registry",
        "responses",
        "reward_shaping",
        "stats",
        "_common",
    }
    defined_in_modules = {
        name
        for name, obj in vars(F).items()
        if not name.startswith("_") and getattr(obj, "__module__", "").startswith(F.__name__ + ".")
    }
    constants = {
        "ADVANTAGE_ESTIMATORS",
        "POLICY_LOSSES",
        "IMPORTANCE_SAMPLING_MODES",
        "KL_ESTIMATORS",
        "LOSS_AGG_MODES",
        "REJECTION_MODES",
        "SCALE_REWARDS",
    }
    assert set(F.__all__) == defined_in_modules | constants
    assert set(F.__all__) == {name for module in modules.values() for name in getattr(module, "__all__", [])}
    for name in F.__all__:
        owner = next(m for m in modules.values() if name in getattr(m, "__all__", []))
        assert getattr(F, name) is getattr(owner, name), name
    for name in defined_in_modules:
        assert getattr(F, name).__doc__, name


@pytest.mark.parametrize(
    ("dtype", "compute_dtype"),
    [(torch.float32, None), (torch.bfloat16, torch.float32), (torch.bfloat16, None)],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [None, 3])
def test_logprobs_and_entropy_in_one_pass_match_the_separate_functions(
    dtype, compute_dtype, temperature, chunk_size
):
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(3, 8, 11, generator=g) * 3).to(dtype)
    full[0, 2, 4] = -math.inf  # a filtered vocabulary entry (never sampled below)
    tokens = torch.randint(5, 11, (3, 6), generator=g)
    fused_leaf = full.detach().clone().requires_grad_()
    plain_leaf = full.detach().clone().requires_grad_()
    kwargs = {"chunk_size": chunk_size, "compute_dtype": compute_dtype}
    # the trainers' non-contiguous slice of the logits
    lp, ent = F.logprobs_and_entropy_from_logits(fused_leaf[:, 1:-1], tokens, temperature, **kwargs)
    ref_lp = F.logprobs_from_logits(plain_leaf[:, 1:-1], tokens, temperature, **kwargs)
    ref_ent = F.entropy_from_logits(
        full[:, 1:-1], chunk_size=chunk_size, compute_dtype=torch.float32, temperature=temperature
    )
    assert lp.dtype == ref_lp.dtype and torch.equal(lp, ref_lp)
    assert ent.dtype == torch.float32 and ent.requires_grad and torch.isfinite(ent).all()
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    exact = torch.distributions.Categorical(logits=full[:, 1:-1].double() / temperature).entropy()
    torch.testing.assert_close(ent.double(), exact, atol=1e-4 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    weights = torch.randn(lp.shape, generator=g)
    (lp.float() * weights).sum().backward()
    (ref_lp.float() * weights).sum().backward()
    assert torch.equal(fused_leaf.grad, plain_leaf.grad)


def test_logprobs_and_entropy_from_logits_empty_and_bad_arguments():
    lp, ent = F.logprobs_and_entropy_from_logits(torch.zeros(0, 4, 5), torch.zeros(0, 4, dtype=torch.long))
    assert lp.shape == ent.shape == (0, 4)
    with pytest.raises(ValueError, match="entropy_dtype"):
        F.logprobs_and_entropy_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 2), entropy_dtype=torch.long)
    with pytest.raises(ValueError, match="tokens must have the shape"):
        F.logprobs_and_entropy_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 3))


# ---- truncated importance sampling (vLLM's sampling distribution vs the trained one) ---------------


def test_truncated_importance_weights_by_hand():
    # Two sequences; the second has one padding token. log pi - log q per token: [ln 2, ln 0.5, ln 4] and
    # [ln 0.25, ln 8, (pad)]; cap 3.
    ln = math.log
    logprobs = torch.tensor([[ln(0.2), ln(0.1), ln(0.4)], [ln(0.05), ln(0.8), 123.0]])
    sampling = torch.tensor([[ln(0.1), ln(0.2), ln(0.1)], [ln(0.2), ln(0.1), -7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    cases = {
        "token_truncate": [[2.0, 0.5, 3.0], [0.25, 3.0, 0.0]],
        "token_mask": [[2.0, 0.5, 0.0], [0.25, 0.0, 0.0]],
        # sequence ratios: 2 * 0.5 * 4 = 4 and 0.25 * 8 = 2 (the pad token ignored)
        "sequence_truncate": [[3.0], [2.0]],
        "sequence_mask": [[0.0], [2.0]],
    }
    for mode, expected in cases.items():
        weights = F.truncated_importance_weights(logprobs, sampling, mask, 3.0, mode)
        torch.testing.assert_close(weights, torch.tensor(expected), rtol=1e-5, atol=1e-6, msg=mode)
        assert weights.dtype == torch.float32 and not weights.requires_grad


def test_truncated_importance_weights_are_one_when_the_distributions_agree():
    logprobs = torch.randn(4, 6).log_softmax(-1)
    mask = torch.rand(4, 6) > 0.3
    for mode in F.IMPORTANCE_SAMPLING_MODES:
        weights = F.truncated_importance_weights(logprobs, logprobs.clone(), mask, 2.0, mode)
        expected = mask.float() if mode.startswith("token") else torch.ones(4, 1)
        torch.testing.assert_close(weights, expected)


def test_truncated_importance_weights_refuse_bad_arguments():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unknown importance sampling mode 'token'"):
        F.truncated_importance_weights(x, x, x, 2.0, "token")
    with pytest.raises(ValueError, match="cap must be > 0"):
        F.truncated_importance_weights(x, x, x, 0.0, "token_truncate")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_is_differentiable_in_both_kernels(temperature):
    """An entropy bonus needs d entropy / d logits: the chunked kernels (logits and fused head) give
    autograd's gradient of g . log p[token] + g_H . H exactly (float64), and with the entropy alone."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (3, 5))
    g, g_h = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)

    def reference(x):
        log_p = torch.log_softmax(x / temperature, -1)
        return log_p.gather(-1, tokens[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)

    logits = (torch.randn(3, 5, 50, dtype=torch.float64) * 2).requires_grad_()
    lp, h = F.logprobs_and_entropy_from_logits(
        logits, tokens, temperature, chunk_size=4, entropy_dtype=torch.float64
    )
    (ours,) = torch.autograd.grad((lp * g + h * g_h).sum(), logits)
    rlp, rh = reference(logits)
    (expected,) = torch.autograd.grad((rlp * g + rh * g_h).sum(), logits)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)

    hidden = torch.randn(15, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, dtype=torch.float64, requires_grad=True)
    flat = tokens.reshape(-1)
    lp, h = F.logprobs_and_entropy_from_hidden(
        hidden, weight, flat, temperature, row_chunk_size=4, vocab_chunk_size=7
    )
    for weights in ((g.reshape(-1), g_h.reshape(-1)), (None, g_h.reshape(-1))):
        loss = (h * weights[1]).sum() + ((lp * weights[0]).sum() if weights[0] is not None else 0)
        ours = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
        log_p = torch.log_softmax(hidden @ weight.t() / temperature, -1)
        ref = (-(log_p.exp() * log_p).sum(-1) * weights[1]).sum()
        if weights[0] is not None:
            ref = ref + (log_p.gather(-1, flat[:, None]).squeeze(-1) * weights[0]).sum()
        expected = torch.autograd.grad(ref, (hidden, weight))
        for a, b in zip(ours, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
