"""``onednn_linear`` (``rlhf_trainers.cpu``): the float32 ``F.linear`` calls of the sampling loop's
decoding steps on CPU go through oneDNN inside the trainers' updates, with PyTorch's results up to float32
rounding; every other call (training and scoring passes, autograd, autocast, other dtypes) is left to
PyTorch, and training is the same as without it."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as TF

from rlhf_trainers import CPUOptions
from rlhf_trainers.cpu import AutocastWeightCache, OneDNNLinear, onednn_linear_available
from rlhf_trainers.cpu import decoding as cpu_decoding
from rlhf_trainers.cpu import linear as cpu_linear
from tests.test_rloo import _digest, _trainer


@pytest.fixture
def onednn_calls(monkeypatch) -> dict[str, int]:
    """Counts the oneDNN linear calls (``calls["n"]``) while the test runs."""
    calls = {"n": 0}
    # The availability probe (one oneDNN product, cached per process) must not count: run it first, since
    # which tests ran before in this process (pytest-xdist) decides whether it already ran.
    onednn_linear_available()
    real = cpu_linear._op

    def counting(*args):
        calls["n"] += 1
        return real(*args)

    monkeypatch.setattr(cpu_linear, "_op", counting)
    return calls


def test_onednn_is_available_in_the_torch_build_ci_installs():
    # The x86 CPU wheels ship oneDNN; a build without it makes the trainers fall back (tested below).
    assert torch.backends.mkldnn.is_available()
    assert onednn_linear_available()


def _inputs(shape, out_features=24, bias=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(out_features, shape[-1], generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    return x, w, b


@pytest.mark.parametrize(("shape", "bias"), [((8, 1, 48), True), ((3, 1, 48), False), ((2, 4, 1, 48), True)])
def test_a_decoding_step_runs_through_onednn_with_pytorchs_values(shape, bias, onednn_calls):
    x, w, b = _inputs(shape, bias=bias)
    with torch.no_grad(), OneDNNLinear():
        y = TF.linear(x, w, b)
    assert onednn_calls["n"] == 1
    want = TF.linear(x.double(), w.double(), b.double() if bias else None)
    assert y.dtype == torch.float32 and y.shape == want.shape
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "case",
    ["several_positions", "two_dim", "autograd", "float64", "bfloat16", "autocast", "strided_weight"],
)
def test_everything_else_runs_pytorchs_linear_unchanged(case, onednn_calls):
    # Training and scoring passes (several positions per row, or gradients) stay on PyTorch's linear: oneDNN
    # keeps generated code for every new row count, and theirs vary with every micro-batch.
    x, w, b = _inputs((3, 5, 48) if case == "several_positions" else (3, 1, 48))
    if case == "two_dim":
        x = x[:, 0]
    elif case == "float64":
        x, w, b = x.double(), w.double(), b.double()
    elif case == "bfloat16":
        x, w, b = x.bfloat16(), w.bfloat16(), b.bfloat16()
    elif case == "strided_weight":
        w = w.t().contiguous().t()
    elif case == "autograd":
        w.requires_grad_()
    with OneDNNLinear(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
        y = TF.linear(x, w, b)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
        want = TF.linear(x, w, b)
    assert onednn_calls["n"] == 0
    assert y.dtype == want.dtype and torch.equal(y, want)
    if case == "autograd":
        assert y.grad_fn is not None


def test_memory_stays_bounded_because_only_decoding_shapes_reach_onednn(onednn_calls):
    # Row counts of training passes change every micro-batch; none of them may reach oneDNN, whose code
    # for each shape stays resident (~0.5 MiB each, measured: docs/benchmarks.md).
    w = torch.randn(64, 32)
    with torch.no_grad(), OneDNNLinear():
        for rows in range(2, 40):
            TF.linear(torch.randn(rows, 7, 32), w)
        assert onednn_calls["n"] == 0
        TF.linear(torch.randn(8, 1, 32), w)
    assert onednn_calls["n"] == 1


def _rloo(kit, tmp_path, **kwargs):
    return _trainer(kit, tmp_path, response_length=8, max_steps=2, rollout_logprobs="forward", **kwargs)


def _uses_onednn(trainer) -> bool:
    """Whether the trainer's generation backend runs under oneDNN's linear (decided at construction, and
    named in the batch accounting)."""
    on = OneDNNLinear in trainer.generation_backend.contexts
    assert ("oneDNN linear" in trainer.generation_backend.name) is on
    if on:  # the batch accounting says so in plain words
        assert "CPU speed-ups on" in trainer.batch_accounting()
    return on


def test_the_trainer_samples_through_it_with_the_same_results(kit, tmp_path, onednn_calls):
    runs = {}
    for name, on in (("onednn", True), ("torch", False)):
        onednn_calls["n"] = 0
        trainer = _rloo(kit, tmp_path / name, onednn_linear=on, onednn_linear_min_weights=0)
        assert _uses_onednn(trainer) is on
        trainer.train()
        runs[name] = (_digest(trainer.policy), trainer.state.log_history, onednn_calls["n"])
    # Each generation's decoding steps went through oneDNN (15 linear layers per step in the kit's 2-layer
    # Llama, lm head included, up to 7 steps: a generation ends early when every row has stopped), plus the
    # lm head of each prompt pass (its last position only); nothing without the option.
    calls = runs["onednn"][2]
    assert calls > 2 and (calls - 2) % 15 == 0 and (calls - 2) // 15 <= 2 * 7
    assert runs["torch"][2] == 0
    # The same training, up to float32 rounding: same sampled tokens, same weights and metrics.
    torch.testing.assert_close(runs["onednn"][0], runs["torch"][0], rtol=1e-4, atol=1e-5)
    for a, b in zip(runs["onednn"][1], runs["torch"][1], strict=True):
        for key in ("objective/kl", "policy/entropy_avg", "loss/policy_avg", "objective/scores"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), key


def test_it_applies_only_where_it_pays_and_is_safe(kit, tmp_path, monkeypatch):
    # The kit's model is below the default size: per-operation overhead, not matmul speed, bounds it.
    largest = max(
        m.weight.numel() for m in kit.load_model("llama-sft").modules() if isinstance(m, torch.nn.Linear)
    )
    assert largest < CPUOptions.onednn_linear_min_weights
    # Opt-in: faster than MKL on some CPUs, slower on others (docs/cpu.md).
    assert not CPUOptions.onednn_linear
    assert not _uses_onednn(_rloo(kit, tmp_path / "default", onednn_linear_min_weights=0))
    on = {"onednn_linear": True}
    assert not _uses_onednn(_rloo(kit, tmp_path / "small", **on))
    assert _uses_onednn(_rloo(kit, tmp_path / "any", onednn_linear_min_weights=largest, **on))
    assert not _uses_onednn(_rloo(kit, tmp_path / "above", onednn_linear_min_weights=largest + 1, **on))
    assert not _uses_onednn(_rloo(kit, tmp_path / "bf16", onednn_linear_min_weights=0, bf16=True, **on))
    f64 = kit.load_model("llama-sft").to(torch.float64)
    assert not _uses_onednn(_rloo(kit, tmp_path / "f64", model=f64, onednn_linear_min_weights=0, **on))
    # A torch build without oneDNN (or whose private op changed): PyTorch's linear, no error.
    monkeypatch.setattr(cpu_decoding, "onednn_linear_available", lambda: False)
    assert not _uses_onednn(_rloo(kit, tmp_path / "none", onednn_linear_min_weights=0, **on))


def test_bad_min_weights_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match=r"onednn_linear_min_weights=-1: expected an integer >= 0"):
        CPUOptions(onednn_linear_min_weights=-1)


# --- AutocastWeightCache: frozen weights cast once per sampling call under CPU autocast ---------------


def test_autocast_weight_cache_gives_autocasts_results_casting_a_frozen_weight_once():
    """Under CPU bf16 autocast a frozen float32 weight is cast once per context and the copy reused: the
    outputs are autocast's bit for bit; a weight that requires a gradient (autocast caches those itself),
    a call outside autocast and a non-linear op pass through untouched."""
    torch.manual_seed(0)
    frozen = torch.nn.Linear(16, 8).requires_grad_(False)
    trained = torch.nn.Linear(16, 8)
    x = torch.randn(3, 1, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = [frozen(x), trained(x)]
        cache = AutocastWeightCache()
        with cache:
            got = [frozen(x), trained(x), frozen(x)]
    assert got[0].dtype == torch.bfloat16
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[0]) and torch.equal(got[1], want[1])
    # one copy each of the frozen weight and bias, none of the trained layer's
    assert sorted(c[0].shape for c in cache._copies.values()) == [torch.Size([8]), torch.Size([8, 16])]
    assert all(c[1].dtype == torch.bfloat16 for c in cache._copies.values())
    with AutocastWeightCache() as outside:
        assert torch.equal(frozen(x), TF.linear(x, frozen.weight, frozen.bias))
    assert not outside._copies


def test_the_trainer_samples_through_the_cache_in_cpu_bf16_only(kit, tmp_path):
    """A CPU run in bf16 samples inside the cache (named in the generation backend); float32 does not."""
    bf16 = _rloo(kit, tmp_path / "bf16", bf16=True)
    assert AutocastWeightCache in bf16.generation_backend.contexts
    assert "frozen weights cast once per call" in bf16.generation_backend.name
    fp32 = _rloo(kit, tmp_path / "fp32")
    assert AutocastWeightCache not in fp32.generation_backend.contexts
