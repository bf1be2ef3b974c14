"""``onednn_linear`` (``rlhf_trainers.cpu_linear``): float32 ``F.linear`` on CPU through oneDNN inside the
trainers' updates, with the values and gradients of PyTorch's own linear up to float32 rounding, only
where it applies, and the same training as without it."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as TF

from rlhf_trainers import RLOOConfig, cpu_linear
from rlhf_trainers.cpu_linear import OneDNNLinear, onednn_linear_available
from tests.test_rloo import _digest, _trainer


def test_onednn_is_available_in_the_torch_build_ci_installs():
    # The x86 CPU wheels ship oneDNN; a build without it makes the trainers fall back (tested below).
    assert torch.backends.mkldnn.is_available()
    assert onednn_linear_available()


@pytest.fixture
def onednn_calls(monkeypatch) -> dict[str, int]:
    """Counts the oneDNN linear calls (``calls["n"]``) while the test runs."""
    calls = {"n": 0}
    real = cpu_linear._op

    def counting(*args):
        calls["n"] += 1
        return real(*args)

    monkeypatch.setattr(cpu_linear, "_op", counting)
    return calls


def _inputs(shape, out_features, bias, contiguous):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    if not contiguous:  # a transposed view, as attention outputs often are
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    w = torch.randn(out_features, shape[-1], generator=g, dtype=torch.float64)
    b = torch.randn(out_features, generator=g, dtype=torch.float64) if bias else None
    return x, w, b


@pytest.mark.parametrize(
    ("shape", "bias", "contiguous"),
    [((7, 48), True, True), ((3, 5, 48), False, True), ((4, 6, 48), True, False), ((1, 1, 48), False, True)],
)
def test_values_and_gradients_equal_pytorch_linear_up_to_float32_rounding(shape, bias, contiguous):
    x64, w64, b64 = _inputs(shape, 24, bias, contiguous)
    leaves = [t.float().requires_grad_() for t in (x64, w64, b64) if t is not None]
    x, w = leaves[0], leaves[1]
    b = leaves[2] if bias else None
    g = torch.randn(*shape[:-1], 24, generator=torch.Generator().manual_seed(1))
    with OneDNNLinear():
        y = TF.linear(x, w, b)
    assert type(y.grad_fn).__name__ == "_OneDNNLinearFunctionBackward"  # oneDNN ran, not PyTorch's linear
    grads = torch.autograd.grad((y * g).sum(), leaves)
    # The float64 reference: both libraries round float32 products and sums, neither more than ~1e-6.
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    y_ref = TF.linear(ref_leaves[0], ref_leaves[1], ref_leaves[2] if bias else None)
    ref_grads = torch.autograd.grad((y_ref * g.double()).sum(), ref_leaves)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-4)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_without_gradients_it_runs_oneDNN_directly(onednn_calls):
    x, w, b = (t.float() for t in _inputs((2, 3, 48), 24, True, True))
    with torch.no_grad(), OneDNNLinear():
        y = TF.linear(x, w, b)
    assert onednn_calls["n"] == 1 and y.grad_fn is None
    torch.testing.assert_close(y, TF.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["float64", "bfloat16", "autocast", "one_dim_input", "strided_weight"])
def test_what_it_does_not_apply_to_runs_pytorch_linear_unchanged(case):
    x, w, b = (t.float() for t in _inputs((3, 48), 24, True, True))
    if case == "float64":
        x, w, b = x.double(), w.double(), b.double()
    elif case == "bfloat16":
        x, w, b = x.bfloat16(), w.bfloat16(), b.bfloat16()
    elif case == "one_dim_input":
        x = x[0]
    elif case == "strided_weight":  # e.g. a transposed view: left to PyTorch
        w = w.t().contiguous().t()
    w.requires_grad_()
    with OneDNNLinear(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
        y = TF.linear(x, w, b)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
        want = TF.linear(x, w, b)
    assert "OneDNN" not in type(y.grad_fn).__name__
    assert y.dtype == want.dtype
    assert torch.equal(y, want)


def _rloo(kit, tmp_path, **kwargs):
    return _trainer(kit, tmp_path, response_length=8, max_steps=2, rollout_logprobs="forward", **kwargs)


def test_the_trainer_runs_its_updates_through_it_with_the_same_results(kit, tmp_path, onednn_calls):
    calls = onednn_calls
    runs = {}
    for name, on in (("onednn", True), ("torch", False)):
        calls["n"] = 0
        trainer = _rloo(kit, tmp_path / name, onednn_linear=on, onednn_linear_min_weights=0)
        assert trainer.uses_onednn_linear is on
        trainer.train()
        runs[name] = (_digest(trainer.policy), trainer.state.log_history, calls["n"])
    # oneDNN ran in the rollout and the training passes of every update, and only when asked for.
    assert runs["onednn"][2] > 0 and runs["torch"][2] == 0
    # The same training, up to float32 rounding: same sampled tokens, same weights and metrics.
    torch.testing.assert_close(runs["onednn"][0], runs["torch"][0], rtol=1e-4, atol=1e-5)
    for a, b in zip(runs["onednn"][1], runs["torch"][1], strict=True):
        for key in ("objective/kl", "policy/entropy_avg", "loss/policy_avg", "objective/scores"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), key
        if "policy/ratio_at_start_max" in a:
            assert abs(a["policy/ratio_at_start_max"] - 1) < 1e-4


def test_it_applies_only_where_it_pays_and_is_safe(kit, tmp_path, monkeypatch):
    # The kit's model is below the default size: per-operation overhead, not matmul speed, bounds it.
    largest = max(
        m.weight.numel() for m in kit.load_model("llama-sft").modules() if isinstance(m, torch.nn.Linear)
    )
    assert largest < RLOOConfig.onednn_linear_min_weights
    assert not _rloo(kit, tmp_path / "default").uses_onednn_linear
    assert _rloo(kit, tmp_path / "any", onednn_linear_min_weights=largest).uses_onednn_linear
    assert not _rloo(kit, tmp_path / "above", onednn_linear_min_weights=largest + 1).uses_onednn_linear
    assert not _rloo(kit, tmp_path / "bf16", onednn_linear_min_weights=0, bf16=True).uses_onednn_linear
    half = kit.load_model("llama-sft").to(torch.float64)
    assert not _rloo(kit, tmp_path / "f64", model=half, onednn_linear_min_weights=0).uses_onednn_linear
    # A torch build without oneDNN (or whose private op changed): PyTorch's linear, no error.
    monkeypatch.setattr("rlhf_trainers.onpolicy.trainer.onednn_linear_available", lambda: False)
    assert not _rloo(kit, tmp_path / "none", onednn_linear_min_weights=0).uses_onednn_linear


def test_gradient_checkpointing_keeps_pytorch_linear_and_trains(kit, tmp_path, onednn_calls):
    # torch.utils.checkpoint recomputes activations in the backward pass, outside the update's context,
    # and refuses saved tensors whose order differs from the forward's: such models keep PyTorch's linear.
    model = kit.load_model("llama-sft").train()
    ids = torch.randint(5, 600, (3, 12), generator=torch.Generator().manual_seed(0))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with OneDNNLinear(), pytest.raises(torch.utils.checkpoint.CheckpointError):
        model(input_ids=ids, labels=ids).loss.backward()
    calls = onednn_calls
    for name, kwargs in (("args", {"gradient_checkpointing": True}), ("model", {"model": model})):
        calls["n"] = 0
        trainer = _rloo(kit, tmp_path / name, onednn_linear_min_weights=0, **kwargs)
        trainer.train()
        assert calls["n"] == 0, name
        assert all(torch.isfinite(p).all() for p in trainer.policy.parameters())


def test_bad_min_weights_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match=r"onednn_linear_min_weights=-1: expected an integer >= 0"):
        RLOOConfig(output_dir=str(tmp_path), report_to="none", onednn_linear_min_weights=-1)


def test_the_fused_head_rebuilds_its_tiles_with_the_forward_passes_backend(onednn_calls):
    from rlhf_trainers import functional as F

    g = torch.Generator().manual_seed(3)
    h = torch.randn(6, 48, generator=g, requires_grad=True)
    w = torch.randn(40, 48, generator=g, requires_grad=True)
    tok = torch.randint(0, 40, (6,), generator=g)
    with OneDNNLinear():
        lp, _ = F.logprobs_and_entropy_from_hidden(h, w, tok, vocab_chunk_size=16)
    forward_calls = onednn_calls["n"]
    assert forward_calls == 3  # one per vocabulary tile
    grads = torch.autograd.grad(lp.sum(), [h, w])  # the backward pass runs after the context is left
    assert onednn_calls["n"] == 2 * forward_calls
    lp_ref, _ = F.logprobs_and_entropy_from_hidden(h, w, tok, vocab_chunk_size=16)
    for got, want in zip(grads, torch.autograd.grad(lp_ref.sum(), [h, w]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
