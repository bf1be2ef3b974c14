"""The fused lm head (``fused_lm_head``, ``functional.logprobs_and_entropy_from_hidden``): the same
log-probs, entropies and gradients as the logits path, without the (N, V) logits held for the backward
pass; used only for models whose logits are exactly ``lm_head(final hidden state)``."""

from __future__ import annotations

import pytest
import torch

from rlhf_trainers import functional as F
from rlhf_trainers.onpolicy.forward import fused_head_matches
from tests.test_rloo import _digest, _trainer


@pytest.mark.parametrize(("temperature", "with_bias"), [(1.0, False), (0.7, True)])
def test_fused_head_equals_the_logits_path_values_and_gradients(temperature, with_bias):
    torch.manual_seed(0)
    N, H, V = 37, 16, 101
    h = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, dtype=torch.float64, requires_grad=True) if with_bias else None
    tok = torch.randint(0, V, (N,))
    # Tiles that do not divide the rows or the vocabulary: the online logsumexp crosses tile edges.
    lp, ent = F.logprobs_and_entropy_from_hidden(
        h, w, tok, temperature, bias=b, row_chunk_size=10, vocab_chunk_size=17
    )
    logits = h @ w.t() + (b if b is not None else 0)
    lp_ref, ent_ref = F.logprobs_and_entropy_from_logits(
        logits, tok, temperature, entropy_dtype=torch.float64
    )
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-12)
    g = torch.randn(N, dtype=torch.float64)
    inputs = [h, w] + ([b] if b is not None else [])
    grads = torch.autograd.grad((lp * g).sum(), inputs)
    grads_ref = torch.autograd.grad((lp_ref * g).sum(), inputs)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    small = (h[:6].detach().requires_grad_(), w.detach().requires_grad_())
    assert torch.autograd.gradcheck(
        lambda h, w: F.logprobs_and_entropy_from_hidden(
            h, w, tok[:6], temperature, row_chunk_size=4, vocab_chunk_size=40
        )[0],
        small,
    )


def test_fused_head_gradients_with_several_row_chunks_and_with_no_rows():
    # d weight is written by the first row chunk and added to by the others; with no rows it is zero.
    torch.manual_seed(1)
    h = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 8, dtype=torch.float64, requires_grad=True)
    tok = torch.randint(0, 30, (9,))
    lp, _ = F.logprobs_and_entropy_from_hidden(h, w, tok, row_chunk_size=2, vocab_chunk_size=7)
    (grad_w,) = torch.autograd.grad(lp.sum(), [w])
    want = torch.autograd.grad(torch.log_softmax(h @ w.t(), -1).gather(1, tok[:, None]).sum(), [w])[0]
    torch.testing.assert_close(grad_w, want, rtol=0, atol=1e-12)
    w.grad = None
    lp, _ = F.logprobs_and_entropy_from_hidden(h[:0], w, tok[:0])
    lp.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_the_backward_pass_takes_more_rows_per_tile_within_the_forwards_memory_bound(monkeypatch):
    # The backward's tiles hold as many logits as the forward's (row_chunk x vocab_chunk) but more rows
    # (the weight gradient's product then has a deeper inner dimension); the gradients stay exact.
    from rlhf_trainers.functional import logprob_kernels

    torch.manual_seed(2)
    N, H, V, rows, columns = 37, 8, 5000, 4, 4096
    h = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    tok = torch.randint(0, V, (N,))
    tiles: list[tuple[int, int]] = []
    tile = logprob_kernels._hidden_tile

    def recording(h, weight, bias, v0, v1, dtype, temperature):
        tiles.append((h.shape[0], v1 - v0))
        return tile(h, weight, bias, v0, v1, dtype, temperature)

    monkeypatch.setattr(logprob_kernels, "_hidden_tile", recording)
    lp, _ = F.logprobs_and_entropy_from_hidden(h, w, tok, 0.7, row_chunk_size=rows, vocab_chunk_size=columns)
    forward_tiles, tiles[:] = list(tiles), []
    g = torch.randn(N, dtype=torch.float64)
    grads = torch.autograd.grad((lp * g).sum(), [h, w])
    assert max(r for r, _ in forward_tiles) == rows
    assert max(r for r, _ in tiles) > rows  # 8 rows x 2048 columns
    assert max(r * c for r, c in tiles) <= rows * columns
    lp_ref = torch.log_softmax(h @ w.t() / 0.7, -1).gather(1, tok[:, None]).squeeze(1)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-12)
    for got, want in zip(grads, torch.autograd.grad((lp_ref * g).sum(), [h, w]), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_head_under_bf16_autocast_is_autocasts_lm_head_in_both_passes(with_bias):
    """Under CPU bf16 autocast with float32 parameters (``bf16=True``), the fused head's products are
    autocast's: the lm head in bf16 forward and backward, the gradients stored in float32. Its values and
    gradients match the unfused head under autocast (a bf16 linear, the log-softmax in float32) to bf16
    accuracy, and the weight's and bias's gradients come back in float32."""
    torch.manual_seed(3)
    N, H, V = 23, 32, 300
    h = torch.randn(N, H, requires_grad=True)
    w = (0.2 * torch.randn(V, H)).requires_grad_()
    b = torch.randn(V, requires_grad=True) if with_bias else None
    tok = torch.randint(0, V, (N,))
    g = torch.randn(N)
    inputs = [h, w] + ([b] if b is not None else [])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = F.logprobs_and_entropy_from_hidden(
            h, w, tok, 0.7, bias=b, row_chunk_size=10, vocab_chunk_size=64, compute_dtype=torch.float32
        )
        logits = torch.nn.functional.linear(h, w, b)
    assert logits.dtype == torch.bfloat16 and lp.dtype == torch.float32
    lp_ref, ent_ref = F.logprobs_and_entropy_from_logits(logits, tok, 0.7, compute_dtype=torch.float32)
    # the same bf16 logits: the values agree to float32 rounding of the softmax
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-4)
    grads = torch.autograd.grad((lp * g).sum(), inputs)
    grads_ref = torch.autograd.grad((lp_ref * g).sum(), inputs)
    for got, want in zip(grads, grads_ref, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("with_entropy", [False, True])
def test_kept_logits_skip_the_backward_matmul_with_the_same_values_and_gradients(monkeypatch, with_entropy):
    # keep_logits_bytes >= N x V floats: the forward keeps the logits it computed and the backward rebuilds
    # no tile (no lm-head matmul); log-probs bit for bit, gradients as the rebuilding path's.
    from rlhf_trainers.functional import logprob_kernels

    torch.manual_seed(4)
    N, H, V = 29, 8, 300
    h = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, dtype=torch.float64, requires_grad=True)
    tok = torch.randint(0, V, (N,))
    g, g_ent = torch.randn(N, dtype=torch.float64), torch.randn(N, dtype=torch.float64)
    calls: list[int] = []
    tile = logprob_kernels._hidden_tile

    def counting(*args):
        calls.append(1)
        return tile(*args)

    monkeypatch.setattr(logprob_kernels, "_hidden_tile", counting)
    results = {}
    for name, budget in (("kept", N * V * 8), ("rebuilt", N * V * 8 - 1)):
        lp, ent = F.logprobs_and_entropy_from_hidden(
            h,
            w,
            tok,
            0.7,
            bias=b,
            row_chunk_size=8,
            vocab_chunk_size=64,
            with_entropy=with_entropy,
            keep_logits_bytes=budget,
        )
        forward_calls, calls[:] = len(calls), []
        loss = (lp * g).sum() + ((ent * g_ent).sum() if with_entropy else 0)
        results[name] = (lp, ent, torch.autograd.grad(loss, [h, w, b]), forward_calls, len(calls))
        calls[:] = []
    kept, rebuilt = results["kept"], results["rebuilt"]
    assert kept[3] == rebuilt[3] == 4 * 5  # the forward's tiles: 4 row chunks x 5 vocabulary chunks
    assert kept[4] == 0 and rebuilt[4] > 0
    assert torch.equal(kept[0], rebuilt[0])
    if with_entropy:
        assert torch.equal(kept[1], rebuilt[1])
    for got, want in zip(kept[2], rebuilt[2], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    logits = (h @ w.t() + b) / 0.7
    lp_ref = torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1)
    loss_ref = (lp_ref * g).sum()
    if with_entropy:
        p = torch.softmax(logits, -1)
        loss_ref = loss_ref + (-(p * torch.log_softmax(logits, -1)).sum(-1) * g_ent).sum()
    for got, want in zip(kept[2], torch.autograd.grad(loss_ref, [h, w, b]), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_kept_logits_only_when_a_gradient_is_needed():
    # Without a gradient (the rollout's no-grad passes) nothing is kept, whatever the budget.
    torch.manual_seed(5)
    h, w, tok = torch.randn(6, 4), torch.randn(20, 4), torch.randint(0, 20, (6,))
    saved: list[torch.Size] = []

    def pack(t):
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.logprobs_and_entropy_from_hidden(h, w, tok, keep_logits_bytes=1 << 20)
        assert (6, 20) not in saved
        F.logprobs_and_entropy_from_hidden(h, w.requires_grad_(), tok, keep_logits_bytes=1 << 20)
        assert (6, 20) in saved
    with pytest.raises(ValueError, match="keep_logits_bytes"):
        F.logprobs_and_entropy_from_hidden(h, w, tok, keep_logits_bytes=-1)


def test_fused_head_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="same H"):
        F.logprobs_and_entropy_from_hidden(
            torch.zeros(3, 4), torch.zeros(10, 5), torch.zeros(3, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="leading shape"):
        F.logprobs_and_entropy_from_hidden(
            torch.zeros(3, 4), torch.zeros(10, 4), torch.zeros(2, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        F.logprobs_and_entropy_from_hidden(
            torch.zeros(3, 4), torch.zeros(10, 4), torch.zeros(3, dtype=torch.long), vocab_chunk_size=0
        )


def _saved_vocab_activations(trainer, vocab: int) -> int:
    """Elements of the tensors with a vocabulary-sized last dimension, other than weights, that the
    training forward of one micro-batch saves for its backward pass (the logits, if kept)."""
    rollout = trainer.rollout(next(iter(trainer.get_train_dataloader())))
    idx = torch.arange(4)
    sizes = []

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == vocab and not isinstance(t, torch.nn.Parameter):
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs, _, _ = trainer.loop.training_forward(trainer.model, rollout, idx)
    logprobs.sum().backward()
    return sum(sizes)


def test_the_trainer_uses_it_for_the_kit_model_and_keeps_no_logits_for_backward(kit, tmp_path):
    fused = _trainer(kit, tmp_path / "fused", response_length=8, fused_lm_head_kept_logits_mib=0)
    plain = _trainer(kit, tmp_path / "plain", response_length=8, fused_lm_head=False)
    kept = _trainer(kit, tmp_path / "kept", response_length=8)  # the default budget: 256 MiB
    assert fused.passes.fused_policy and fused.passes.fused_ref
    assert not plain.passes.fused_policy and not plain.passes.fused_ref
    vocab = fused.policy.get_output_embeddings().weight.shape[0]
    logits_elems = 4 * 8 * vocab
    # The logits path saves the (4, 8, V) logits for its backward pass (and more: the log-softmax's
    # chunks); the fused head saves none, or within its budget the logits of the valid response
    # positions once (at most the (4, 8, V) of the micro-batch).
    assert _saved_vocab_activations(plain, vocab) >= logits_elems
    assert _saved_vocab_activations(fused, vocab) == 0
    assert 0 < _saved_vocab_activations(kept, vocab) <= logits_elems


def test_the_kept_logits_budget_is_checked_at_construction():
    from rlhf_trainers import PPOConfig

    with pytest.raises(ValueError, match="fused_lm_head_kept_logits_mib=-1"):
        PPOConfig(output_dir="unused", fused_lm_head_kept_logits_mib=-1)


def test_training_with_and_without_it_gives_the_same_model(kit, tmp_path):
    runs = {}
    for name, fused in (("fused", True), ("plain", False)):
        trainer = _trainer(kit, tmp_path / name, fused_lm_head=fused, max_steps=2, rollout_logprobs="forward")
        trainer.train()
        runs[name] = (_digest(trainer.policy), trainer.state.log_history)
    torch.testing.assert_close(runs["fused"][0], runs["plain"][0], rtol=1e-4, atol=1e-5)
    for a, b in zip(runs["fused"][1], runs["plain"][1], strict=True):
        for key in ("objective/kl", "policy/entropy_avg", "loss/policy_avg"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), key


def test_models_whose_logits_are_not_the_plain_lm_head_keep_the_logits_path(kit, tmp_path):
    model = kit.load_model("llama-sft")
    assert fused_head_matches(model)
    forward = model.forward

    def scaled(*args, **kwargs):  # a model that scales its logits (as Cohere's or Granite's do)
        out = forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    model.forward = scaled
    assert not fused_head_matches(model)
    trainer = _trainer(kit, tmp_path, model=model)
    assert not trainer.passes.fused_policy


def test_the_probe_leaves_every_submodule_in_its_own_mode(kit):
    model = kit.load_model("llama-sft").train()
    frozen = model.get_input_embeddings().eval()
    assert fused_head_matches(model)
    assert model.training and not frozen.training
    assert all(m.training for m in model.modules() if m is not frozen)


def test_a_hook_on_the_lm_head_turns_the_fused_path_off_so_the_hook_runs(kit, tmp_path):
    trainer = _trainer(kit, tmp_path)
    assert trainer.passes.fused_policy
    with_grad = []
    head = trainer.policy.get_output_embeddings()
    head.register_forward_hook(lambda m, i, o: with_grad.append(torch.is_grad_enabled()))
    trainer.train()
    # The sampling loop calls the lm head without gradients anyway; the training passes (with
    # gradients) reach the hook only because the fused path stood aside.
    assert any(with_grad)
