"""TFStyleAdam against LHPD's TensorFlow pseudocode and against PyTorch's Adam.

Seed: "The N Implementation Details of RLHF with PPO", section "PyTorch Adam optimizer numerical
issues w.r.t RLHF".
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rlhf_trainers.optim import TFStyleAdam


def _tf_adam_reference(param: torch.Tensor, grads: list[torch.Tensor], lr, beta1, beta2, eps):
    """LHPD's "tensorflow adam implementation" pseudocode, step by step, in float64."""
    p = param.clone().double()
    exp_avg = torch.zeros_like(p)
    exp_avg_sq = torch.zeros_like(p)
    for step, g in enumerate(grads, start=1):
        g = g.double()
        exp_avg = beta1 * exp_avg + (1 - beta1) * g
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
        lr_t = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        denom = exp_avg_sq.sqrt() + eps
        p = p - lr_t * exp_avg / denom
    return p


def _run(optimizer_cls, grads, init, **kwargs):
    p = torch.nn.Parameter(init.clone())
    opt = optimizer_cls([p], **kwargs)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def test_matches_seed_tensorflow_pseudocode():
    torch.manual_seed(0)
    init = torch.randn(7, 5, dtype=torch.float64)
    grads = [torch.randn(7, 5, dtype=torch.float64) * 10 ** (-k) for k in range(6)]
    ours = _run(TFStyleAdam, grads, init, lr=1e-3, betas=(0.9, 0.999), eps=1e-5)
    ref = _tf_adam_reference(init, grads, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-5)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-14)


def test_equals_pytorch_adam_with_step_dependent_eps():
    """LHPD: the two are equivalent when eps_hat = eps * sqrt(1 - beta2^t)."""
    torch.manual_seed(1)
    init = torch.randn(11, dtype=torch.float64)
    grads = [torch.randn(11, dtype=torch.float64) * 1e-4 for _ in range(8)]
    eps_hat, beta2 = 1e-5, 0.999
    ours = _run(TFStyleAdam, grads, init, lr=1e-2, betas=(0.9, beta2), eps=eps_hat)

    p = torch.nn.Parameter(init.clone())
    torch_adam = torch.optim.Adam([p], lr=1e-2, betas=(0.9, beta2), eps=eps_hat)
    for t, g in enumerate(grads, start=1):
        torch_adam.param_groups[0]["eps"] = eps_hat / math.sqrt(1 - beta2**t)
        p.grad = g.clone()
        torch_adam.step()
    torch.testing.assert_close(ours, p.detach(), rtol=1e-12, atol=1e-15)


def test_pytorch_adam_is_more_aggressive_early_with_the_same_eps():
    """LHPD's finding: with the same eps, PyTorch's first updates are larger.

    At step 1 with gradient g and |g| << eps, PyTorch moves lr * g / (|g| + eps) while TF moves
    lr * sqrt(1 - b2) / (1 - b1) * (1 - b1) g / (sqrt(1 - b2) |g| + eps) = lr * sqrt(1 - b2) g / (...).
    """
    init = torch.zeros(1, dtype=torch.float64)
    g = torch.full((1,), 1e-6, dtype=torch.float64)
    lr, eps, b1, b2 = 1e-3, 1e-5, 0.9, 0.999
    tf_step = -_run(TFStyleAdam, [g], init, lr=lr, betas=(b1, b2), eps=eps).item()
    pt_step = -_run(torch.optim.Adam, [g], init, lr=lr, betas=(b1, b2), eps=eps).item()
    assert pt_step == pytest.approx(lr * 1e-6 / (1e-6 + eps), rel=1e-9)
    assert tf_step == pytest.approx(
        lr * math.sqrt(1 - b2) * 1e-6 / (math.sqrt(1 - b2) * 1e-6 + eps), rel=1e-9
    )
    assert pt_step > 25 * tf_step  # ~29x more aggressive on this first step

    # With large gradients eps is negligible and both take (almost) the same step of size lr.
    big = torch.ones(1, dtype=torch.float64)
    tf_big = -_run(TFStyleAdam, [big], init, lr=lr, betas=(b1, b2), eps=eps).item()
    pt_big = -_run(torch.optim.Adam, [big], init, lr=lr, betas=(b1, b2), eps=eps).item()
    assert tf_big == pytest.approx(pt_big, rel=1e-3)
    assert tf_big == pytest.approx(lr, rel=1e-3)


def test_resume_from_state_dict_continues_identically():
    torch.manual_seed(2)
    model = torch.nn.Linear(4, 3)
    data = [torch.randn(8, 4) for _ in range(6)]

    def train(model, opt, batches):
        for x in batches:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    straight = copy.deepcopy(model)
    opt_straight = TFStyleAdam(straight.parameters(), lr=1e-2, eps=1e-5, weight_decay=0.01)
    train(straight, opt_straight, data)

    first = copy.deepcopy(model)
    opt_first = TFStyleAdam(first.parameters(), lr=1e-2, eps=1e-5, weight_decay=0.01)
    train(first, opt_first, data[:3])
    state = copy.deepcopy(opt_first.state_dict())
    resumed = copy.deepcopy(first)
    opt_resumed = TFStyleAdam(resumed.parameters(), lr=1e-2, eps=1e-5, weight_decay=0.01)
    opt_resumed.load_state_dict(state)
    train(resumed, opt_resumed, data[3:])

    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bf16_parameters_keep_fp32_moments_and_move():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = TFStyleAdam([p], lr=1e-2, eps=1e-5)
    p.grad = torch.full_like(p, 0.5)
    opt.step()
    state = opt.state[p]
    assert state["exp_avg"].dtype == torch.float32
    assert p.dtype == torch.bfloat16
    assert torch.all(p < 1.0)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"lr": -1.0}, "lr must be >= 0"),
        ({"eps": -1e-8}, "eps must be >= 0"),
        ({"betas": (1.0, 0.999)}, "betas must each be in [0, 1)"),
        ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
    ],
)
def test_bad_arguments_say_what_was_given(kwargs, fragment):
    with pytest.raises(ValueError, match=__import__("re").escape(fragment)):
        TFStyleAdam([torch.nn.Parameter(torch.zeros(1))], **kwargs)
