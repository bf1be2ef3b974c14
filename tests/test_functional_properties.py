"""Property tests (hypothesis) of rlhf_trainers.functional.

Every property compares against an independent reference written here: the statistic of the
compacted valid entries, a plain-Python GAE loop, log_softmax + gather, the defining sums.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rlhf_trainers import functional as F

FAST = settings(max_examples=60, deadline=None)

DTYPES = [torch.float32, torch.float64, torch.bfloat16]
# bf16 keeps ~3 significant digits: compare it loosely
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-10, 1e-10), torch.bfloat16: (3e-2, 3e-2)}

finite = st.floats(min_value=-50, max_value=50, allow_nan=False, allow_infinity=False, width=32)
garbage = st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -7.0])


@st.composite
def masked_batch(draw, min_rows=1, max_rows=4, max_cols=8):
    """(values (B, T) float64, mask (B, T) bool) with arbitrary holes, possibly all-masked rows."""
    rows = draw(st.integers(min_rows, max_rows))
    cols = draw(st.integers(1, max_cols))
    values = draw(st.lists(finite, min_size=rows * cols, max_size=rows * cols))
    mask = draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols))
    return (
        torch.tensor(values, dtype=torch.float64).reshape(rows, cols),
        torch.tensor(mask).reshape(rows, cols),
    )


def with_garbage(values, mask, fill):
    return torch.where(mask, values, torch.full_like(values, fill))


def as_mask_dtype(mask, kind):
    return {"bool": mask, "long": mask.long(), "float": mask.float()}[kind]


# ------------------------------------------------------------------------------------------------
# masked statistics
# ------------------------------------------------------------------------------------------------


@FAST
@given(masked_batch(), st.sampled_from(DTYPES), garbage, st.sampled_from(["bool", "long", "float"]))
def test_masked_mean_var_equal_statistics_of_compacted_valid_entries(batch, dtype, fill, mask_kind):
    values, mask = batch
    values = values.to(dtype)
    dirty = with_garbage(values, mask, fill)
    m = as_mask_dtype(mask, mask_kind)
    atol, rtol = TOL[dtype]
    compact = values[mask].double()
    mean = F.masked_mean(dirty, m)
    var = F.masked_var(dirty, m)
    var_u = F.masked_var(dirty, m, unbiased=True)
    assert mean.dtype == var.dtype == dtype
    n = compact.numel()
    exp_mean = compact.mean().item() if n else 0.0
    exp_var = compact.var(unbiased=False).item() if n else 0.0
    exp_var_u = compact.var(unbiased=True).item() if n >= 2 else 0.0
    assert mean.double().item() == pytest.approx(exp_mean, abs=atol * 50, rel=rtol)
    assert var.double().item() == pytest.approx(exp_var, abs=atol * 2500, rel=rtol * 10)
    assert var_u.double().item() == pytest.approx(exp_var_u, abs=atol * 2500, rel=rtol * 10)


@FAST
@given(masked_batch(), garbage)
def test_masked_mean_var_per_row_ignore_masked_values_and_never_nan(batch, fill):
    values, mask = batch
    dirty = with_garbage(values, mask, fill)
    means = F.masked_mean(dirty, mask, dim=1)
    variances = F.masked_var(dirty, mask, dim=1, unbiased=True)
    assert torch.isfinite(means).all() and torch.isfinite(variances).all()
    for i in range(values.shape[0]):
        row = values[i][mask[i]]
        expected_mean = row.mean().item() if row.numel() else 0.0
        expected_var = row.var(unbiased=True).item() if row.numel() >= 2 else 0.0
        assert means[i].item() == pytest.approx(expected_mean, abs=1e-9)
        assert variances[i].item() == pytest.approx(expected_var, abs=1e-7, rel=1e-9)


@FAST
@given(masked_batch(), st.sampled_from(DTYPES), st.booleans(), st.booleans(), garbage)
def test_whiten_equals_whitening_the_compacted_entries_and_keeps_the_rest(
    batch, dtype, shift, unbiased, fill
):
    values, mask = batch
    values = values.to(dtype)
    dirty = with_garbage(values, mask, fill)
    out = F.whiten(dirty, mask, shift_mean=shift, unbiased=unbiased)
    assert out.dtype == dtype
    compact = values[mask].double()
    if compact.numel():
        mean = compact.mean()
        var = compact.var(unbiased=unbiased) if (compact.numel() >= 2 or not unbiased) else torch.tensor(0.0)
        expected = (compact - mean) * torch.rsqrt(var.double() + 1e-8)
        if not shift:
            expected = expected + mean
        atol, rtol = TOL[dtype]
        # whitened values can reach |x| ~ 1e4 when the variance is tiny: compare relative to the scale;
        # and the rounding of the mean in the input's dtype is amplified by rsqrt(var + eps) too (three
        # equal float32 values: their float32 mean is off by an ulp, x 1e4 after whitening).
        amplified = (mean.abs() * torch.rsqrt(var.double() + 1e-8)).item()
        scale = max(1.0, expected.abs().max().item(), amplified)
        torch.testing.assert_close(out[mask].double(), expected, atol=atol * scale * 10, rtol=rtol * 10)
    # masked entries untouched, bit for bit (NaN stays NaN)
    torch.testing.assert_close(out[~mask], dirty[~mask], equal_nan=True, atol=0, rtol=0)


@FAST
@given(masked_batch(min_rows=2), st.integers(1, 3), st.booleans())
def test_whiten_with_all_reduce_equals_whole_batch(batch, split, shift):
    values, mask = batch
    split = min(split, values.shape[0] - 1)
    other = torch.stack(F.masked_moments(values[split:], mask[split:]))

    def all_reduce(packed):
        return packed + other

    local = F.whiten(values[:split], mask[:split], shift_mean=shift, all_reduce=all_reduce)
    full = F.whiten(values, mask, shift_mean=shift)
    scale = max(1.0, full.abs().max().item())
    torch.testing.assert_close(local, full[:split], atol=1e-6 * scale, rtol=1e-6)


@FAST
@given(st.integers(1, 4), st.integers(0, 6), st.sampled_from(DTYPES))
def test_all_masked_inputs_give_zero_not_nan(rows, cols, dtype):
    values = torch.full((rows, cols), math.nan, dtype=dtype)
    mask = torch.zeros(rows, cols, dtype=torch.bool)
    assert F.masked_mean(values, mask).item() == 0.0
    assert F.masked_var(values, mask, unbiased=True).item() == 0.0
    assert (F.masked_mean(values, mask, dim=1) == 0).all()
    assert (F.masked_var(values, mask, dim=1) == 0).all()
    assert F.explained_variance(values, values, mask).item() == 0.0
    adv, ret = F.gae_advantages(values, values, mask)
    assert (adv == 0).all() and (ret == 0).all()
    loss, metrics = F.clipped_policy_loss(values, values, values, mask, dual_clip=3.0)
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())
    vloss, vmetrics = F.clipped_value_loss(values, values, values, mask)
    assert vloss.item() == 0.0 and all(v.item() == 0.0 for v in vmetrics.values())


# ------------------------------------------------------------------------------------------------
# KL
# ------------------------------------------------------------------------------------------------


@FAST
@given(st.lists(st.tuples(finite, finite), min_size=1, max_size=10))
def test_kl_estimators_k2_k3_abs_nonnegative_and_k1_antisymmetric(pairs):
    logp = torch.tensor([a for a, _ in pairs], dtype=torch.float64)
    ref = torch.tensor([b for _, b in pairs], dtype=torch.float64)
    for estimator in ("k2", "k3", "abs"):
        kl = F.kl_penalty(logp, ref, estimator)
        assert torch.isfinite(kl).all() and (kl >= 0).all()
    torch.testing.assert_close(F.kl_penalty(logp, ref), -F.kl_penalty(ref, logp))
    d = (logp - ref).clamp(-20, 20)
    torch.testing.assert_close(F.kl_penalty(logp, ref, "k3"), torch.exp(-d) - 1 + d)


# ------------------------------------------------------------------------------------------------
# GAE
# ------------------------------------------------------------------------------------------------


def python_gae(rewards, values, mask, gamma, lam):
    advs, rets = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask, strict=True):
        n = len(r_row)
        adv, ret = [0.0] * n, [0.0] * n
        next_value = last = 0.0
        for i in reversed(range(n)):
            if m_row[i]:
                last = r_row[i] + gamma * next_value - v_row[i] + gamma * lam * last
                adv[i], ret[i] = last, last + v_row[i]
                next_value = v_row[i]
        advs.append(adv)
        rets.append(ret)
    return torch.tensor(advs, dtype=torch.float64), torch.tensor(rets, dtype=torch.float64)


@st.composite
def gae_batch(draw):
    values, mask = draw(masked_batch(max_cols=10))
    rewards = draw(st.lists(finite, min_size=values.numel(), max_size=values.numel()))
    return torch.tensor(rewards, dtype=torch.float64).reshape(values.shape), values, mask


unit = st.floats(0.0, 1.0)


@FAST
@given(gae_batch(), unit, unit)
def test_gae_matches_plain_python_loop(batch, gamma, lam):
    rewards, values, mask = batch
    adv, ret = F.gae_advantages(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = python_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, ref_adv, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(ret, ref_ret, atol=1e-9, rtol=1e-9)


@FAST
@given(gae_batch())
def test_gae_gamma1_lam1_returns_are_reward_to_go(batch):
    rewards, values, mask = batch
    adv, ret = F.gae_advantages(rewards, values, mask, 1.0, 1.0)
    for i in range(rewards.shape[0]):
        acc = 0.0
        for j in reversed(range(rewards.shape[1])):
            if mask[i, j]:
                acc += rewards[i, j].item()
                assert ret[i, j].item() == pytest.approx(acc, abs=1e-9)
                assert adv[i, j].item() == pytest.approx(acc - values[i, j].item(), abs=1e-9)
            else:
                assert ret[i, j].item() == 0.0 and adv[i, j].item() == 0.0


@FAST
@given(gae_batch(), unit, unit, st.data())
def test_gae_inserting_padding_anywhere_changes_nothing_on_valid_tokens(batch, gamma, lam, data):
    rewards, values, mask = batch
    B, T = rewards.shape
    adv, ret = F.gae_advantages(rewards, values, mask, gamma, lam)
    pads = data.draw(st.lists(st.integers(0, T), max_size=5))
    fill = data.draw(garbage)
    order: list[int | None] = list(range(T))
    for pos in sorted(pads, reverse=True):
        order.insert(pos, None)

    def column(src, j, default):
        return src[:, j] if j is not None else torch.full((B,), default, dtype=src.dtype)

    r2 = torch.stack([column(rewards, j, fill) for j in order], 1)
    v2 = torch.stack([column(values, j, -fill) for j in order], 1)
    m2 = torch.stack([mask[:, j] if j is not None else torch.zeros(B, dtype=torch.bool) for j in order], 1)
    adv2, ret2 = F.gae_advantages(r2, v2, m2, gamma, lam)
    keep = torch.tensor([j is not None for j in order])
    torch.testing.assert_close(adv2[:, keep], adv, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(ret2[:, keep], ret, atol=1e-9, rtol=1e-9)
    assert (adv2[:, ~keep] == 0).all()


@FAST
@given(gae_batch(), unit, unit, unit, st.floats(0.0, 2.0))
def test_gae_decoupled_and_length_adaptive_match_plain_calls(batch, gamma, lam_v, lam_p, alpha):
    rewards, values, mask = batch
    adv, ret = F.gae_advantages(
        rewards, values, mask, gamma, 0.5, lam_value=lam_v, lam_policy=lam_p, length_adaptive_alpha=alpha
    )
    _, ref_ret = python_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam_v)
    torch.testing.assert_close(ret, ref_ret, atol=1e-9, rtol=1e-9)
    for i in range(rewards.shape[0]):
        n = int(mask[i].sum())
        lam_i = min(max(1 - 1 / max(alpha * n, 1.0), 0.0), 1.0) if alpha > 0 else lam_p
        ref_adv, _ = python_gae([rewards[i].tolist()], [values[i].tolist()], [mask[i].tolist()], gamma, lam_i)
        torch.testing.assert_close(adv[i : i + 1], ref_adv, atol=1e-9, rtol=1e-9)


@FAST
@given(gae_batch(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_gae_low_precision_inputs_give_float32_close_to_float64(batch, dtype):
    rewards, values, mask = batch
    r, v = rewards.to(dtype), values.to(dtype)
    adv, ret = F.gae_advantages(r, v, mask, 0.99, 0.95)
    assert adv.dtype == ret.dtype == torch.float32
    ref_adv, ref_ret = python_gae(r.double().tolist(), v.double().tolist(), mask.tolist(), 0.99, 0.95)
    torch.testing.assert_close(adv.double(), ref_adv, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(ret.double(), ref_ret, atol=1e-3, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# RLOO
# ------------------------------------------------------------------------------------------------


@st.composite
def rloo_batch(draw):
    k = draw(st.integers(2, 5))
    prompts = draw(st.integers(1, 4))
    trailing = draw(st.sampled_from([(), (3,)]))
    n = k * prompts * (trailing[0] if trailing else 1)
    rewards = torch.tensor(draw(st.lists(finite, min_size=n, max_size=n)), dtype=torch.float64)
    return rewards.reshape(k * prompts, *trailing), k, prompts


@FAST
@given(rloo_batch())
def test_rloo_advantages_sum_to_zero_per_prompt_and_match_leave_one_out(batch):
    rewards, k, prompts = batch
    adv = F.rloo_advantages(rewards, k)
    grouped = adv.reshape(k, prompts, *rewards.shape[1:])
    torch.testing.assert_close(grouped.sum(0), torch.zeros_like(grouped[0]), atol=1e-9, rtol=0)
    for j in range(k):
        for i in range(prompts):
            others = [rewards[jj * prompts + i] for jj in range(k) if jj != j]
            expected = rewards[j * prompts + i] - torch.stack(others).mean(0)
            torch.testing.assert_close(adv[j * prompts + i], expected)


@FAST
@given(rloo_batch(), st.data())
def test_rloo_advantages_invariant_to_a_constant_per_prompt(batch, data):
    rewards, k, prompts = batch
    shifts = torch.tensor(
        data.draw(st.lists(finite, min_size=prompts, max_size=prompts)), dtype=torch.float64
    )
    shift = shifts.reshape(1, prompts, *([1] * (rewards.dim() - 1))).expand(k, prompts, *rewards.shape[1:])
    shifted = rewards + shift.reshape(rewards.shape)
    torch.testing.assert_close(
        F.rloo_advantages(shifted, k), F.rloo_advantages(rewards, k), atol=1e-9, rtol=1e-9
    )


@FAST
@given(rloo_batch(), st.data(), garbage)
def test_rloo_advantages_with_valid_use_only_the_other_valid_completions(batch, data, fill):
    rewards, k, prompts = batch
    valid = torch.tensor(data.draw(st.lists(st.booleans(), min_size=k * prompts, max_size=k * prompts)))
    row_valid = valid.reshape(-1, *([1] * (rewards.dim() - 1))).expand(rewards.shape)
    adv = F.rloo_advantages(with_garbage(rewards, row_valid, fill), k, valid)
    for j in range(k):
        for i in range(prompts):
            row = j * prompts + i
            others = [rewards[jj * prompts + i] for jj in range(k) if jj != j and valid[jj * prompts + i]]
            if not valid[row] or not others:
                assert torch.equal(adv[row], torch.zeros_like(adv[row]))
            else:
                torch.testing.assert_close(adv[row], rewards[row] - torch.stack(others).mean(0))


# ------------------------------------------------------------------------------------------------
# truncation
# ------------------------------------------------------------------------------------------------

STOP, PAD = 3, 0


@st.composite
def responses(draw):
    rows = draw(st.integers(1, 4))
    cols = draw(st.integers(0, 10))
    ids = draw(st.lists(st.integers(0, 5), min_size=rows * cols, max_size=rows * cols))
    return torch.tensor(ids, dtype=torch.long).reshape(rows, cols)


@FAST
@given(responses(), st.integers(0, 12), st.sampled_from([PAD, STOP, 9]))
def test_truncate_response_is_idempotent_and_keeps_tokens_up_to_the_stop(ids, after, pad):
    out = F.truncate_response(ids, STOP, pad, truncate_after=after)
    again = F.truncate_response(out, STOP, pad, truncate_after=after)
    assert torch.equal(again, out)
    found = F.stop_token_found(ids, STOP, truncate_after=after)
    for i, row in enumerate(ids.tolist()):
        stops = [j for j, tok in enumerate(row) if tok == STOP and j >= after]
        assert bool(found[i]) == bool(stops)
        cut = stops[0] if stops else len(row) - 1
        assert out[i, : cut + 1].tolist() == row[: cut + 1]
        assert all(tok == pad for tok in out[i, cut + 1 :].tolist())


@FAST
@given(responses())
def test_first_and_last_true_indices_match_python(ids):
    hits = ids == STOP
    first = F.first_true_indices(hits)
    last = F.last_true_indices(hits.long())
    for i, row in enumerate(hits.tolist()):
        positions = [j for j, h in enumerate(row) if h]
        assert first[i].item() == (positions[0] if positions else len(row))
        assert last[i].item() == (positions[-1] if positions else -1)


@FAST
@given(responses())
def test_position_ids_count_previous_valid_tokens(ids):
    mask = ids != PAD
    pos = F.position_ids_from_mask(mask)
    for i, row in enumerate(mask.tolist()):
        assert pos[i].tolist() == [sum(row[:j]) for j in range(len(row))]


# ------------------------------------------------------------------------------------------------
# log-probabilities
# ------------------------------------------------------------------------------------------------


@FAST
@given(
    st.integers(1, 3),
    st.integers(1, 6),
    st.integers(1, 12),
    st.floats(0.3, 3.0),
    st.one_of(st.none(), st.integers(1, 20)),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)
def test_logprobs_from_logits_matches_log_softmax_gather(B, T, V, temperature, chunk, seed, sliced):
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(B, T + 2, V, generator=gen) * 5
    logits = full[:, 1:-1] if sliced else full[:, :T].contiguous()
    tokens = torch.randint(0, V, (B, T), generator=gen)
    out = F.logprobs_from_logits(logits, tokens, temperature, chunk_size=chunk)
    expected = torch.log_softmax(logits / temperature, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-6)
    assert (out <= 1e-6).all()
    entropy = F.entropy_from_logits(logits, chunk_size=chunk, temperature=temperature)
    torch.testing.assert_close(
        entropy, torch.distributions.Categorical(logits=logits / temperature).entropy(), atol=1e-4, rtol=1e-5
    )


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 5),
    st.integers(2, 9),
    st.floats(0.5, 2.0),
    st.integers(1, 7),
    st.integers(0, 2**31 - 1),
)
def test_logprobs_from_logits_gradients_match_autograd(B, T, V, temperature, chunk, seed):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(B, T, V, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    weights = torch.randn(B, T, generator=gen, dtype=torch.float64)
    ours = base.clone().requires_grad_()
    (F.logprobs_from_logits(ours, tokens, temperature, chunk_size=chunk) * weights).sum().backward()
    ref = base.clone().requires_grad_()
    (
        torch.log_softmax(ref / temperature, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1) * weights
    ).sum().backward()
    torch.testing.assert_close(ours.grad, ref.grad, atol=1e-12, rtol=1e-10)


# ------------------------------------------------------------------------------------------------
# losses
# ------------------------------------------------------------------------------------------------


@FAST
@given(masked_batch(), st.floats(-1.0, 1.0), st.floats(0.05, 0.5), st.sampled_from(F.LOSS_AGG_MODES))
def test_policy_loss_ignores_masked_tokens_and_matches_unclipped_at_ratio_one(batch, shift, clip, mode):
    adv, mask = batch
    lp = torch.full_like(adv, shift)
    loss, metrics = F.clipped_policy_loss(lp, lp, adv, mask, clip, loss_agg_mode=mode)
    # at ratio 1 nothing is clipped and the loss is -A aggregated over the valid tokens
    per_row = [adv[i][mask[i]] for i in range(adv.shape[0])]
    per_row = [row for row in per_row if row.numel()]
    if mode == "token-mean":
        expected = -torch.cat(per_row).mean().item() if per_row else 0.0
    elif mode == "seq-mean-token-mean":
        expected = -sum(row.mean().item() for row in per_row) / len(per_row) if per_row else 0.0
    elif mode == "seq-mean-token-sum":
        expected = -sum(row.sum().item() for row in per_row) / len(per_row) if per_row else 0.0
    else:  # seq-mean-token-sum-norm: each sequence's sum / T (the default max_length)
        T = adv.shape[1]
        expected = -sum(row.sum().item() / T for row in per_row) / len(per_row) if per_row else 0.0
    assert loss.item() == pytest.approx(expected, abs=1e-9)
    assert metrics["clipfrac"].item() == 0.0
    dirty_lp = torch.where(mask, lp, torch.full_like(lp, 1e4))
    dirty_adv = torch.where(mask, adv, torch.full_like(adv, math.nan))
    loss2, _ = F.clipped_policy_loss(dirty_lp, lp, dirty_adv, mask, clip, loss_agg_mode=mode)
    assert loss2.item() == pytest.approx(loss.item(), abs=1e-9)


@FAST
@given(
    st.floats(-5.0, 5.0),
    st.floats(-3.0, 3.0),
    st.floats(0.05, 0.9),
    st.floats(0.05, 2.0),
    st.one_of(st.none(), st.floats(1.1, 10.0)),
)
def test_policy_loss_per_token_matches_formula(adv, log_ratio, clip_low, clip_high, dual):
    assume(abs(adv) > 1e-6)
    loss, _ = F.clipped_policy_loss(
        torch.tensor([[log_ratio]], dtype=torch.float64),
        torch.zeros(1, 1, dtype=torch.float64),
        torch.tensor([[adv]], dtype=torch.float64),
        torch.ones(1, 1),
        clip_low,
        clip_high,
        dual,
    )
    ratio = math.exp(log_ratio)
    expected = max(-adv * ratio, -adv * min(max(ratio, 1 - clip_low), 1 + clip_high))
    if dual is not None and adv < 0:
        expected = min(expected, -adv * dual)
    assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


# ------------------------------------------------------------------------------------------------
# empty batches, all-masked rows, low precision, gradients (issue #8 fuzzing)
# ------------------------------------------------------------------------------------------------


@FAST
@given(st.integers(0, 6), st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from(F.LOSS_AGG_MODES))
def test_an_empty_batch_gives_empty_or_zero_results_of_the_right_dtype(T, dtype, mode):
    """B = 0 rows (a rank or a micro-batch left without sequences): no function raises or returns NaN."""
    empty = torch.zeros(0, T, dtype=dtype)
    mask = torch.zeros(0, T, dtype=torch.bool)
    for stat in (F.masked_mean(empty, mask), F.masked_var(empty, mask, unbiased=True)):
        assert stat.item() == 0.0 and stat.dtype == dtype
    assert F.masked_mean(empty, mask, dim=1).shape == (0,)
    assert F.whiten(empty, mask).shape == (0, T)
    assert F.explained_variance(empty, empty, mask).item() == 0.0
    adv, ret = F.gae_advantages(empty, empty, mask, 0.99, 0.95)
    assert adv.shape == ret.shape == (0, T) and adv.dtype == torch.float32
    for estimator in F.KL_ESTIMATORS:
        assert F.kl_penalty(empty, empty, estimator).shape == (0, T)
    loss, metrics = F.clipped_policy_loss(empty, empty, empty, mask, dual_clip=2.0, loss_agg_mode=mode)
    vloss, vmetrics = F.clipped_value_loss(empty, empty, empty, mask, loss_agg_mode=mode)
    for value in (loss, vloss, *metrics.values(), *vmetrics.values()):
        assert value.item() == 0.0
    assert F.rloo_advantages(torch.zeros(0, dtype=dtype), 2).shape == (0,)
    ids = torch.zeros(0, T, dtype=torch.long)
    assert F.truncate_response(ids, 3, 0).shape == (0, T)
    assert F.stop_token_found(ids, 3).shape == (0,)
    assert F.position_ids_from_mask(ids).shape == (0, T)
    logits = torch.zeros(0, T, 5, dtype=dtype)
    lp = F.logprobs_from_logits(logits, ids, 0.7, chunk_size=3, compute_dtype=torch.float32)
    assert lp.shape == (0, T) and lp.dtype == torch.float32
    assert F.entropy_from_logits(logits, chunk_size=3).shape == (0, T)


@st.composite
def loss_batch(draw, dtype=torch.float64):
    """(logprobs, old_logprobs, advantages or returns, mask) with holes and all-masked rows; log-ratios
    within [-3, 3] so that float32 and float64 agree to a few ulps of the loss."""
    values, mask = draw(masked_batch(max_rows=5, max_cols=8))
    n = values.numel()
    shift = draw(st.lists(st.floats(-3, 3), min_size=n, max_size=n))
    old = torch.tensor(draw(st.lists(st.floats(-20, 0), min_size=n, max_size=n)), dtype=dtype)
    old = old.reshape(values.shape)
    new = old + torch.tensor(shift, dtype=dtype).reshape(values.shape)
    return new, old, values.to(dtype), mask


@FAST
@given(loss_batch(), st.sampled_from(F.LOSS_AGG_MODES), st.sampled_from(["bool", "long", "float"]), garbage)
def test_an_all_masked_row_of_garbage_changes_neither_loss(batch, mode, mask_kind, fill):
    """A sequence without a valid token (filtered, or a rank's padding row) holding inf/NaN: policy and
    value losses and their metrics are those of the batch without it, for every aggregation mode."""
    new, old, adv, mask = batch
    base_p, metrics_p = F.clipped_policy_loss(new, old, adv, mask, 0.2, dual_clip=3.0, loss_agg_mode=mode)
    base_v, metrics_v = F.clipped_value_loss(adv, old, new, mask, 0.2, loss_agg_mode=mode)
    T = new.shape[1]

    def extend(x):
        return torch.cat([x, torch.full((1, T), fill, dtype=x.dtype)])

    m = as_mask_dtype(torch.cat([mask, torch.zeros(1, T, dtype=torch.bool)]), mask_kind)
    loss_p, more_p = F.clipped_policy_loss(
        extend(new), extend(old), extend(adv), m, 0.2, dual_clip=3.0, loss_agg_mode=mode
    )
    loss_v, more_v = F.clipped_value_loss(extend(adv), extend(old), extend(new), m, 0.2, loss_agg_mode=mode)
    assert loss_p.item() == pytest.approx(base_p.item(), abs=1e-9, rel=1e-9)
    assert loss_v.item() == pytest.approx(base_v.item(), abs=1e-9, rel=1e-9)
    for name in metrics_p:
        assert more_p[name].item() == pytest.approx(metrics_p[name].item(), abs=1e-6, rel=1e-5), name
    for name in metrics_v:
        assert more_v[name].item() == pytest.approx(metrics_v[name].item(), abs=1e-6, rel=1e-5), name


@FAST
@given(loss_batch(), st.one_of(st.none(), st.floats(0.05, 1.0)), st.sampled_from(F.LOSS_AGG_MODES))
def test_value_loss_matches_the_per_token_formula_and_clipping_never_lowers_it(batch, clip, mode):
    """0.5 * max((V - R)^2, (V_clip - R)^2) per valid token, aggregated; the clipped loss is >= the
    unclipped one, and equal when V stays within clip of the old values."""
    values, old, returns, mask = batch
    loss, metrics = F.clipped_value_loss(values, old, returns, mask, clip, loss_agg_mode=mode)
    unclipped, _ = F.clipped_value_loss(values, old, returns, mask, None, loss_agg_mode=mode)
    err = (values - returns) ** 2
    if clip is not None:
        v_clip = old + (values - old).clamp(-clip, clip)
        err = torch.maximum(err, (v_clip - returns) ** 2)
    per_token = torch.where(mask, 0.5 * err, torch.zeros_like(err))
    rows = [per_token[i][mask[i]] for i in range(mask.shape[0]) if mask[i].any()]
    if not rows:
        expected = 0.0
    elif mode == "token-mean":
        expected = torch.cat(rows).mean().item()
    elif mode == "seq-mean-token-mean":
        expected = sum(r.mean().item() for r in rows) / len(rows)
    elif mode == "seq-mean-token-sum":
        expected = sum(r.sum().item() for r in rows) / len(rows)
    else:  # seq-mean-token-sum-norm, default max_length T
        expected = sum(r.sum().item() / mask.shape[1] for r in rows) / len(rows)
    assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert loss.item() >= unclipped.item() - 1e-9
    assert 0.0 <= metrics["vf_clipfrac"].item() <= 1.0
    same, _ = F.clipped_value_loss(old, old, returns, mask, clip, loss_agg_mode=mode)
    plain, _ = F.clipped_value_loss(old, old, returns, mask, None, loss_agg_mode=mode)
    assert same.item() == pytest.approx(plain.item(), rel=1e-12, abs=1e-12)


@FAST
@given(
    loss_batch(), st.sampled_from([torch.float32, torch.bfloat16]), garbage, st.sampled_from(F.LOSS_AGG_MODES)
)
def test_gradients_are_finite_and_zero_on_masked_tokens_in_any_dtype(batch, dtype, fill, mode):
    """No NaN reaches the weights: with inf/NaN at masked positions of every input, the gradients of
    both losses are finite everywhere and exactly 0 on masked tokens (fp32 and bf16)."""
    new, old, adv, mask = batch
    logp = with_garbage(new, mask, fill).to(dtype).requires_grad_()
    values = with_garbage(adv, mask, -fill).to(dtype).requires_grad_()
    old_d, adv_d = with_garbage(old, mask, fill).to(dtype), with_garbage(adv, mask, fill).to(dtype)
    loss, _ = F.clipped_policy_loss(logp, old_d, adv_d, mask, 0.2, 0.3, 3.0, loss_agg_mode=mode)
    vloss, _ = F.clipped_value_loss(values, old_d, adv_d, mask, 0.2, loss_agg_mode=mode)
    (loss + vloss).backward()
    assert torch.isfinite(loss) and torch.isfinite(vloss)
    for grad in (logp.grad, values.grad):
        assert grad.dtype == dtype
        assert torch.isfinite(grad).all()
        assert (grad[~mask] == 0).all()


@FAST
@given(loss_batch(), st.floats(0.05, 0.5), st.one_of(st.none(), st.floats(1.5, 5.0)))
def test_bf16_losses_equal_float64_losses_of_the_rounded_inputs(batch, clip, dual):
    """bf16 inputs are upcast, not computed in bf16: the loss equals the float64 loss of the same
    bf16-rounded numbers up to float32 rounding (a bf16 computation would be off by ~1e-2)."""
    new, old, adv, mask = batch
    b = [x.to(torch.bfloat16) for x in (new, old, adv)]
    loss, metrics = F.clipped_policy_loss(*b, mask, clip, dual_clip=dual)
    ref, ref_metrics = F.clipped_policy_loss(*[x.double() for x in b], mask, clip, dual_clip=dual)
    assert loss.dtype == torch.float32
    scale = max(1.0, abs(ref.item()))
    assert loss.item() == pytest.approx(ref.item(), abs=1e-5 * scale)
    assert metrics["clipfrac"].item() == pytest.approx(ref_metrics["clipfrac"].item(), abs=1e-6)
    vloss, _ = F.clipped_value_loss(b[2], b[1], b[0], mask, clip)
    vref, _ = F.clipped_value_loss(b[2].double(), b[1].double(), b[0].double(), mask, clip)
    assert vloss.item() == pytest.approx(vref.item(), rel=1e-5, abs=1e-5)


@FAST
@given(
    st.integers(1, 3),
    st.integers(0, 5),
    st.integers(1, 12),
    st.floats(0.3, 3.0),
    st.one_of(st.none(), st.integers(1, 8)),
    st.integers(0, 2**31 - 1),
    st.floats(0.0, 0.8),
)
def test_bf16_logprobs_and_entropy_in_fp32_match_float64_with_filtered_vocab(
    B, T, V, temperature, chunk, seed, drop
):
    """bf16 logits with compute_dtype=float32 give the float64 log-probs of the same rounded logits;
    -inf entries (top-k/top-p filtered vocabulary) leave both finite, the entropy within [0, log V]."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=gen) * 4).to(torch.bfloat16)
    filtered = torch.rand(B, T, V, generator=gen) < drop
    tokens = torch.randint(0, V, (B, T), generator=gen)
    filtered.scatter_(-1, tokens.unsqueeze(-1), False)  # the sampled token itself was never filtered
    logits = logits.masked_fill(filtered, -math.inf)
    lp = F.logprobs_from_logits(logits, tokens, temperature, chunk_size=chunk, compute_dtype=torch.float32)
    ref = torch.log_softmax(logits.double() / temperature, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert lp.dtype == torch.float32 and lp.shape == (B, T)
    torch.testing.assert_close(lp.double(), ref, atol=1e-5, rtol=1e-5)
    ent = F.entropy_from_logits(
        logits, chunk_size=chunk, compute_dtype=torch.float32, temperature=temperature
    )
    assert torch.isfinite(ent).all()
    # float32 rounding of -sum p log p near a one-hot distribution (low temperature: logits / T up to ~50)
    # can leave it a few 1e-5 below 0; the same tolerance as the upper bound.
    assert (ent >= -1e-4).all() and (ent <= math.log(V) + 1e-4).all()


@FAST
@given(rloo_batch(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_rloo_advantages_keep_the_dtype_and_sum_to_zero_in_low_precision(batch, dtype):
    """Computed in float32 from the (rounded) inputs and cast back: per prompt they sum to 0 up to the
    output's rounding."""
    rewards, k, prompts = batch
    low = rewards.to(dtype)
    adv = F.rloo_advantages(low, k)
    assert adv.dtype == dtype and adv.shape == rewards.shape
    ref = F.rloo_advantages(low.double(), k)
    eps = torch.finfo(dtype).eps
    # The float32 arithmetic rounds at the size of the intermediate sum over the k rewards (up to k times
    # the largest reward), which can exceed the advantages themselves (rewards 11.6 and 8.6: advantages 3).
    scale = max(ref.abs().max().item(), k * low.double().abs().max().item()) + 1.0
    torch.testing.assert_close(adv.double(), ref, atol=eps * scale, rtol=eps)
    sums = adv.double().reshape(k, prompts, *rewards.shape[1:]).sum(0)
    assert sums.abs().max().item() <= k * eps * scale


@FAST
@given(masked_batch(), st.data(), garbage)
def test_explained_variance_of_the_valid_tokens(batch, data, fill):
    """1 - Var(R - V) / Var(R) over the valid tokens only; 0 (not NaN) for constant or no returns."""
    returns, mask = batch
    n = returns.numel()
    values = torch.tensor(data.draw(st.lists(finite, min_size=n, max_size=n)), dtype=torch.float64)
    values = values.reshape(returns.shape)
    ev = F.explained_variance(with_garbage(values, mask, fill), with_garbage(returns, mask, -fill), mask)
    r, v = returns[mask], values[mask]
    assert torch.isfinite(ev)
    if r.numel() == 0 or bool((r == r[0]).all()):
        assert ev.item() == 0.0
    else:
        expected = 1 - (r - v).var(unbiased=False).item() / r.var(unbiased=False).item()
        assert ev.item() == pytest.approx(expected, rel=1e-6, abs=1e-6)
