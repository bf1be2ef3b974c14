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


class _ZeroOptimizer:
    """What the guard reads of a DeepSpeed ZeRO optimizer: its overflow flag and norm settings."""

    def __init__(self, compute_grad_norm: bool = True) -> None:
        self.overflow = False
        self.compute_grad_norm = compute_grad_norm
        self.check_grad_overflow = False


class _Engine:
    """What the guard reads of a ``DeepSpeedEngine``: steps taken, whether the last one applied."""

    def __init__(self, optimizer, fp16: bool = False, scheduler=None) -> None:
        self.optimizer, self.fp16, self.lr_scheduler = optimizer, fp16, scheduler
        self.global_steps, self.applied = 0, False

    def fp16_enabled(self) -> bool:
        return self.fp16

    def was_step_applied(self) -> bool:
        return self.applied

    def step(self, finite: bool) -> None:
        self.global_steps += 1
        self.applied = finite


def test_under_deepspeed_the_engines_skipped_steps_are_counted_and_limited():
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]), lambda s: 1.0
    )
    engine = _Engine(_ZeroOptimizer(), scheduler=scheduler)
    guard = NonFiniteStepGuard(max_consecutive=2)
    assert guard.attach_engine(engine) == "engine"
    assert engine.optimizer.check_grad_overflow is False  # the global norm already finds a NaN
    assert guard.after_engine_step() is False  # no step taken since attaching: nothing counted
    engine.step(finite=True)
    assert guard.after_engine_step() is False and guard.skipped == 0
    for expected in (1, 2):
        engine.step(finite=False)
        assert guard.after_engine_step() is True
        assert (guard.skipped, guard.consecutive) == (expected, expected)
    assert scheduler.last_epoch == 2  # the engine's schedule moved on over both skipped steps
    assert guard.after_engine_step() is False and guard.skipped == 2  # read once per step
    engine.step(finite=True)
    guard.after_engine_step()
    assert (guard.skipped, guard.consecutive) == (2, 0)
    for _ in range(2):
        engine.step(finite=False)
        guard.after_engine_step()
    engine.step(finite=False)
    with pytest.raises(FloatingPointError, match=r"3 consecutive optimizer steps.*max_nonfinite_steps=2"):
        guard.after_engine_step()
    guard.detach()
    engine.step(finite=False)
    assert guard.after_engine_step() is False and guard.skipped == 5


def test_under_deepspeed_the_guard_picks_what_decides_the_step():
    # ZeRO-1/2 without a gradient norm: its own scan of the partitions is turned on
    engine = _Engine(_ZeroOptimizer(compute_grad_norm=False))
    assert NonFiniteStepGuard(3).attach_engine(engine) == "engine"
    assert engine.optimizer.check_grad_overflow is True
    # fp16: the loss scaler's skips are its calibration, not counted
    assert NonFiniteStepGuard(3).attach_engine(_Engine(_ZeroOptimizer(), fp16=True)) == "loss_scaler"
    # no ZeRO: a torch optimizer on whole gradients gets the step-pre-hook
    param = torch.nn.Parameter(torch.ones(2))
    sgd = torch.optim.SGD([param], lr=0.1)
    guard = NonFiniteStepGuard(3)
    assert guard.attach_engine(_Engine(sgd)) == "optimizer"
    param.grad = torch.tensor([1.0, math.nan])
    sgd.step()
    assert guard.skipped == 1 and torch.equal(param.detach(), torch.ones(2))
    assert NonFiniteStepGuard(3).attach_engine(_Engine(object())) == "none"
