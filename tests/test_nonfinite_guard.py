"""NonFiniteStepGuard's cheap finiteness check and its gradient-norm shortcut (exact in both cases)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_trainers.reliability import NonFiniteStepGuard


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_gradients_finite_is_exact_even_when_the_sum_overflows(dtype):
    big = torch.finfo(dtype).max
    finite = [torch.randn(5).to(dtype), torch.full((4,), big, dtype=dtype)]  # the sum overflows
    assert NonFiniteStepGuard.gradients_finite(finite)
    for bad in (math.inf, -math.inf, math.nan):
        g = torch.zeros(6, dtype=dtype)
        g[3] = bad
        assert not NonFiniteStepGuard.gradients_finite([finite[0], g])
    both = torch.tensor([math.inf, -math.inf], dtype=dtype)  # sums to NaN, caught too
    assert not NonFiniteStepGuard.gradients_finite([both])
    assert NonFiniteStepGuard.gradients_finite([])


def _sgd_with_guard():
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    guard = NonFiniteStepGuard(max_consecutive=5)
    guard.attach(optimizer)
    return param, optimizer, guard


def test_a_finite_clipping_norm_spares_the_scan_for_one_step_only():
    param, optimizer, guard = _sgd_with_guard()
    param.grad = torch.tensor([1.0, math.nan, 1.0])
    guard.note_grad_norm(2.0)  # a finite norm is trusted (it is computed over the same gradients)
    optimizer.step()
    assert guard.skipped == 0 and torch.isnan(param).any()
    param.data.fill_(1.0)
    param.grad = torch.tensor([1.0, math.nan, 1.0])
    optimizer.step()  # the hint was consumed: this step scans and is skipped
    assert guard.skipped == 1 and torch.equal(param.detach(), torch.ones(3))


@pytest.mark.parametrize("norm", [math.nan, math.inf])
def test_a_nonfinite_clipping_norm_leaves_the_decision_to_the_scan(norm):
    param, optimizer, guard = _sgd_with_guard()
    param.grad = torch.tensor([1.0, math.inf, 1.0])
    guard.note_grad_norm(norm)
    optimizer.step()
    assert guard.skipped == 1 and guard.consecutive == 1 and torch.equal(param.detach(), torch.ones(3))
    param.grad = torch.full((3,), 1e30)
    guard.note_grad_norm(math.inf)  # finite gradients whose norm overflowed: the scan lets the step pass
    optimizer.step()
    assert guard.skipped == 1 and guard.consecutive == 0 and not torch.equal(param.detach(), torch.ones(3))
