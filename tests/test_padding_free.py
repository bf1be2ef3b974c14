"""Padding-free passes (``padding_free``): the real tokens of a batch packed (in one row, attention per
sequence, or in rows of the longest sequence), position ids restarting per sequence. The packed passes
must give the padded passes' log-probs, entropies, values and gradients (float32) for the kit's Llama,
GPT-2 and GPT-NeoX models, with and without a LoRA adapter, in both layouts, and whole PPO / RLOO runs the
same metrics; models that would let attention cross packed sequences keep the padded passes."""

from __future__ import annotations

import contextlib
import itertools
import logging

import pytest
import torch

from rlhf_trainers import packing as packing_module
from rlhf_trainers.onpolicy.forward import pack_sequences, sequence_inputs, trim_bounds
from rlhf_trainers.packing import (
    SEGMENT_ATTENTION,
    one_row_attention,
    one_row_matches,
    pack_rows,
    packed_score_head,
    padding_free_matches,
    segment_attention,
)
from rlhf_trainers.rewards import score_ids, score_texts
from tests import test_ppo, test_rloo

ARCHITECTURES = ("llama", "gpt2", "gpt_neox")
LAYOUTS = ("one_row", "rows")
#: float32: packed and padded passes differ by rounding only (measured: 0 to ~1e-6 on the kit models).
ATOL = 1e-5


def _lora():
    from peft import LoraConfig

    # init_lora_weights=False: a non-zero adapter, so the policy and its reference (adapter disabled) differ.
    return LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False, lora_dropout=0.0)


def _with_short_responses(trainer, samples):
    """The samples with each response cut at a random length (1 to R), as responses stopping at EOS."""
    R = samples.response.shape[1]
    lengths = torch.randint(
        1, R + 1, (samples.response.shape[0],), generator=torch.Generator().manual_seed(0)
    )
    mask = samples.response_mask & (torch.arange(R)[None, :] < lengths[:, None])
    samples.response_mask = mask
    samples.response = samples.response.masked_fill(~mask, trainer.processing_class.pad_token_id)
    samples.lengths = mask.sum(1)
    return samples


@contextlib.contextmanager
def _padded(trainer):
    """The trainer's passes padded within the block, whatever it resolved."""
    flags = (trainer.passes.pack_policy, trainer.passes.pack_ref, trainer.passes.pack_values)
    trainer.passes.pack_policy = trainer.passes.pack_ref = trainer.passes.pack_values = False
    try:
        yield
    finally:
        trainer.passes.pack_policy, trainer.passes.pack_ref, trainer.passes.pack_values = flags


QUERY_LENGTHS, RESPONSE_LENGTHS = [5, 2, 1, 3], [4, 1, 0, 2]  # row 2: no valid response token


def _small_batch():
    """4 left-padded prompts (5 columns) and right-padded responses (4 columns) of the lengths above."""
    torch.manual_seed(0)
    Q, R = 5, 4
    query = torch.randint(10, 50, (4, Q))
    response = torch.randint(10, 50, (4, R))
    query_mask = torch.arange(Q)[None, :] >= Q - torch.tensor(QUERY_LENGTHS)[:, None]
    response_mask = torch.arange(R)[None, :] < torch.tensor(RESPONSE_LENGTHS)[:, None]
    ids, mask, positions = sequence_inputs(query, query_mask, response, response_mask, 0)
    return query, response, response_mask, ids, mask, positions


def test_pack_sequences_keeps_each_real_token_once_with_its_own_positions():
    query_lengths, response_lengths = QUERY_LENGTHS, RESPONSE_LENGTHS
    _, response, response_mask, ids, mask, positions = _small_batch()
    packed = pack_sequences(ids, mask, positions, response_mask, pad_token_id=0)
    # Kept sequences of 9, 3 and 5 tokens, in rows as wide as the longest: [9] and [5, 3] (first fit).
    assert packed.input_ids.shape[1] == 9
    assert packed.input_ids.shape[0] == 2
    flat_ids, flat_pos = packed.input_ids.reshape(-1), packed.position_ids.reshape(-1)
    # Every real token of the kept rows once, in order, each sequence's positions 0, 1, ...
    for b in (0, 1, 3):
        real = ids[b][mask[b].bool()]
        n = len(real)
        starts = [i for i in range(flat_ids.numel() - n + 1) if torch.equal(flat_ids[i : i + n], real)]
        assert any(torch.equal(flat_pos[i : i + n], torch.arange(n)) for i in starts), b
    assert int((flat_ids != 0).sum()) == sum(
        q + r for q, r in zip(query_lengths, response_lengths, strict=True) if r
    )
    # A row's free tail is one sequence of its own (positions from 0), so transformers sees it apart.
    for row_ids, row_pos in zip(packed.input_ids, packed.position_ids, strict=True):
        tail = int((row_ids == 0).sum())
        if tail:
            assert torch.equal(row_pos[-tail:], torch.arange(tail))
    # The sources predict the targets: the token before each valid response token.
    predicted = response.reshape(-1)[packed.targets]
    assert packed.targets.numel() == int(response_mask.sum())
    nxt = flat_ids[packed.sources + 1]
    assert torch.equal(nxt, predicted)
    # Scattered back: zeros where no valid response token is.
    back = packed.scatter(torch.ones(packed.targets.numel()))
    assert torch.equal(back.bool(), response_mask)


def test_one_row_packing_keeps_every_real_token_once_and_no_padding():
    _, response, response_mask, ids, mask, positions = _small_batch()
    packed = pack_sequences(ids, mask, positions, response_mask, pad_token_id=0, one_row=True)
    # The kept sequences (9, 3 and 5 tokens) one after the other in batch order, not one padding position.
    assert packed.input_ids.shape == (1, 17)
    assert packed.segments == (9, 3, 5)
    kept = [0, 1, 3]
    assert torch.equal(packed.input_ids[0], torch.cat([ids[b][mask[b].bool()] for b in kept]))
    assert torch.equal(packed.position_ids[0], torch.cat([torch.arange(n) for n in (9, 3, 5)]))
    predicted = response.reshape(-1)[packed.targets]
    assert torch.equal(packed.input_ids[0][packed.sources + 1], predicted)
    # A batch without a real token: one padding position (a pass over nothing is no pass).
    empty = pack_rows(ids, torch.zeros_like(mask), positions, 0, one_row=True)
    assert empty.input_ids.shape == (1, 1) and empty.segments == (1,)


def test_segment_attention_is_causal_attention_within_each_sequence():
    torch.manual_seed(0)
    segments = (3, 1, 5)
    q, k, v = (
        torch.randn(1, 6, 9, 8),
        torch.randn(1, 2, 9, 8),
        torch.randn(1, 2, 9, 8),
    )  # 3 query heads per kv
    module = torch.nn.Module()
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    with one_row_attention([], segments):
        out, weights = segment_attention(module, *inputs, None, scaling=0.3)
    assert weights is None and out.shape == (1, 9, 6, 8) and out.is_contiguous()
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, upstream)
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    start = 0
    wants = []
    for n in segments:  # each sequence alone: its own keys, causal
        qq = reference[0][:, :, start : start + n]
        kk, vv = (t[:, :, start : start + n].repeat_interleave(3, dim=1) for t in reference[1:])
        scores = (qq @ kk.transpose(-1, -2)) * 0.3
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        wants.append((scores.softmax(-1) @ vv).transpose(1, 2))
        torch.testing.assert_close(out[:, start : start + n], wants[-1], rtol=0, atol=1e-6)
        start += n
    # and the gradients of the queries, keys and values
    for got, want in zip(grads, torch.autograd.grad(torch.cat(wants, 1), reference, upstream), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # Refused: outside a one-row pass, with a mask, lengths that are not this row's.
    with pytest.raises(RuntimeError, match="one_row_attention"):
        segment_attention(module, q, k, v, None)
    with one_row_attention([], segments), pytest.raises(ValueError, match="attention mask"):
        segment_attention(module, q, k, v, torch.ones(1, 1, 9, 9, dtype=torch.bool))
    with one_row_attention([], (4, 4)), pytest.raises(ValueError, match="do not describe"):
        segment_attention(module, q, k, v, None)


def _per_sequence_reference(q, k, v, segments, scale):
    """Causal attention of each sequence alone, (1, H, N, D) in, (1, N, H, D) out (SDPA per sequence)."""
    groups = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in segments:
        qq = q[:, :, start : start + n]
        kk, vv = (t[:, :, start : start + n].repeat_interleave(groups, dim=1) for t in (k, v))
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale)
            .transpose(1, 2)
            .float()
        )
        start += n
    return torch.cat(outs, 1)


def test_segment_attention_hands_a_gpu_half_precision_pass_to_one_varlen_call(monkeypatch):
    """Where the variable-length kernel applies (a GPU in fp16/bf16; forced here on CPU with a stand-in
    kernel, the real one is checked in tests/test_cuda.py), one call gets the whole row: (N, H, D) views in
    autocast's dtype, the cumulative lengths, the longest length and the scale; its output comes back as
    (1, N, H, D), equal to each sequence's attention alone."""
    calls = []

    def stand_in(q, k, v, cu, max_len, scale):
        calls.append((q.dtype, q.shape, k.shape, cu.tolist(), cu.dtype, max_len, scale))
        ends = cu.tolist()
        lengths = tuple(b - a for a, b in itertools.pairwise(ends))
        as_rows = (t.transpose(0, 1)[None] for t in (q, k, v))
        return _per_sequence_reference(*as_rows, lengths, scale)[0].to(q.dtype)

    monkeypatch.setattr(packing_module, "_varlen_applies", lambda query: True)
    monkeypatch.setattr(packing_module, "varlen_kernel", lambda: stand_in)
    torch.manual_seed(0)
    segments = (3, 1, 5)
    q, k, v = torch.randn(1, 6, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    with one_row_attention([], segments), torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = segment_attention(torch.nn.Module(), q, k, v, None, scaling=0.3)
    assert calls == [(torch.bfloat16, (9, 6, 8), (9, 2, 8), [0, 3, 4, 9], torch.int32, 5, 0.3)]
    assert out.shape == (1, 9, 6, 8) and out.dtype == torch.bfloat16
    want = _per_sequence_reference(*(t.bfloat16() for t in (q, k, v)), segments, 0.3)
    torch.testing.assert_close(out.float(), want, rtol=0, atol=2e-2)
    # Dropout in training keeps the per-sequence calls (the kernel is called without dropout).
    module = torch.nn.Module()
    module.training = True
    with one_row_attention([], segments):
        segment_attention(module, q, k, v, None, dropout=0.1, scaling=0.3)
    assert len(calls) == 1


@pytest.mark.parametrize("api", ["window_size", "is_causal"])
def test_varlen_kernel_speaks_both_torch_spellings_of_causal_gqa_and_scale(monkeypatch, api):
    """torch 2.10's ``varlen_attn`` takes ``is_causal`` and no ``scale``/``enable_gqa``; later ones take
    ``window_size=(-1, 0)``, ``scale`` and ``enable_gqa``. The wrapper passes what the installed one takes
    and does the rest itself (key/value heads repeated, the scale folded into the queries)."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    seen = {}
    if api == "window_size":

        def fake(
            query,
            key,
            value,
            cu_seq_q,
            cu_seq_k,
            max_q,
            max_k,
            *,
            window_size=(-1, -1),
            scale=None,
            enable_gqa=False,
        ):
            seen.update(window_size=window_size, scale=scale, gqa=enable_gqa, q=query, k=key)
            return query

    else:

        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
            seen.update(is_causal=is_causal, q=query, k=key)
            return query

    monkeypatch.setattr(varlen, "varlen_attn", fake)
    packing_module.varlen_kernel.cache_clear()
    try:
        kernel = packing_module.varlen_kernel()
        q, k = torch.ones(5, 4, 8), torch.ones(5, 2, 8)
        kernel(q, k, k, torch.tensor([0, 5], dtype=torch.int32), 5, 0.5)
    finally:
        packing_module.varlen_kernel.cache_clear()
    if api == "window_size":
        assert seen["window_size"] == (-1, 0) and seen["scale"] == 0.5 and seen["gqa"] is True
        assert seen["q"] is q and seen["k"].shape == (5, 2, 8)
    else:
        assert seen["is_causal"] is True and seen["k"].shape == (5, 4, 8)  # heads repeated
        # the kernel divides by sqrt(8): the queries carry 0.5 * sqrt(8) so that the product is 0.5
        torch.testing.assert_close(seen["q"], q * 0.5 * 8**0.5)


@pytest.mark.parametrize("autocast", [True, False])
def test_segment_attention_on_cpu_in_bf16_computes_in_float32(monkeypatch, autocast):
    """On a CPU in bf16 (autocast's, or bf16 inputs), each sequence's attention runs in float32 (PyTorch's
    CPU kernel is ~2.7x slower forward + backward in bf16: benchmarks/cpu_attention.py) and the output
    comes back in bf16: the float32 reference rounded once, gradients flowing to the inputs."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    torch.manual_seed(0)
    segments = (3, 1, 5)
    leaves = [torch.randn(1, 6, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)]
    leaves = [t.bfloat16().requires_grad_() for t in leaves]
    with one_row_attention([], segments), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, _ = segment_attention(torch.nn.Module(), *leaves, None, scaling=0.3)
    assert seen == [(torch.float32,) * 3 + (False,)] * len(segments)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 9, 6, 8)
    want = _per_sequence_reference(*(t.detach().float() for t in leaves), segments, 0.3)
    torch.testing.assert_close(out.float(), want, rtol=0, atol=8e-3)  # one bf16 rounding
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in leaves)


def test_varlen_applies_only_on_a_gpu_in_half_precision():
    q = torch.randn(1, 2, 4, 8)
    assert not packing_module._varlen_applies(q)  # CPU
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not packing_module._varlen_applies(q)


def test_one_row_attention_switches_sdpa_and_eager_models_for_the_pass_only(kit):
    model = kit.load_model("llama")
    assert model.config._attn_implementation == "sdpa"
    with one_row_attention(model, (4,)):
        assert model.config._attn_implementation == SEGMENT_ATTENTION
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(KeyError), one_row_attention(model, (4,)):
        raise KeyError("a failure inside the pass")
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"
    with one_row_attention(model, (4,)):
        assert model.config._attn_implementation == SEGMENT_ATTENTION
    assert model.config._attn_implementation == "eager"


def test_pack_sequences_is_none_without_a_valid_response_token():
    ids = torch.ones(2, 5, dtype=torch.long)
    mask = torch.ones(2, 5, dtype=torch.long)
    assert pack_sequences(ids, mask, mask.cumsum(1) - 1, torch.zeros(2, 2, dtype=torch.bool), 0) is None


def _ppo(kit, tmp_path, arch, lora, **kwargs):
    extra = {"peft_config": _lora()} if lora else {}
    trainer = test_ppo._trainer(
        kit, tmp_path, model=arch, padding_free=True, response_length=8, kl_coef=0.1, **extra, **kwargs
    )
    # The value head starts at zero: give it weights, so the values (and their gradients) say something.
    torch.manual_seed(1)
    for name, param in trainer.value_model.named_parameters():
        if "score" in name:
            param.data.normal_(0, 0.5)
    return trainer


CASES = [(arch, lora, True, layout) for arch in ARCHITECTURES for lora in (False, True) for layout in LAYOUTS]
CASES += [(arch, False, False, layout) for arch in ARCHITECTURES for layout in LAYOUTS]  # fused_lm_head=False


def _count_segment_attention(monkeypatch) -> list[int]:
    """Calls of the registered segment attention (one per layer and sequence batch), counted."""
    from transformers import AttentionInterface

    packing_module._register_segment_attention()
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return segment_attention(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, SEGMENT_ATTENTION, counted)
    return calls


@pytest.mark.parametrize(
    ("arch", "lora", "fused", "layout"),
    CASES,
    ids=[f"{a}-{'lora' if lora else 'full'}-{'fused' if f else 'logits'}-{la}" for a, lora, f, la in CASES],
)
def test_packed_passes_give_the_padded_ones(kit, tmp_path, arch, lora, fused, layout, monkeypatch):
    trainer = _ppo(kit, tmp_path, arch, lora, fused_lm_head=fused)
    assert trainer.passes.pack_policy and trainer.passes.pack_ref and trainer.passes.pack_values
    assert trainer.passes.pack_one_row  # every kit model takes the one-row layout
    trainer.passes.pack_one_row = layout == "one_row"
    segment_calls = _count_segment_attention(monkeypatch)
    assert trainer.passes.fused_policy == fused
    if not fused:  # the packed logits path computes the predicting positions' logits only
        from rlhf_trainers.onpolicy import forward

        calls = []
        packed_logits = forward.packed_logits
        monkeypatch.setattr(forward, "packed_logits", lambda m, p: calls.append(p) or packed_logits(m, p))
    with torch.no_grad():
        samples = trainer.producer.sample(trainer.producer.prompt_batch(0), trainer.completions_per_prompt)
    samples = _with_short_responses(trainer, samples)
    mask = samples.response_mask
    assert mask.sum(1).unique().numel() > 2  # lengths vary

    # Rollout passes: policy log-probs and entropy, reference log-probs, values.
    with torch.no_grad():
        packed = trainer.passes.logprobs(samples)
        with _padded(trainer):
            padded = trainer.passes.logprobs(samples)
    for name in ("logprobs", "entropy", "ref_logprobs", "values"):
        got, want = getattr(packed, name), getattr(padded, name)
        torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=ATOL, msg=name)
        assert not got[~mask].any(), name  # zeros where no valid token is
    if lora:  # the reference (adapter disabled) is another model than the policy
        assert (packed.ref_logprobs - packed.logprobs)[mask].abs().max() > 1e-3
    if not fused:
        assert calls

    # Training forward and one backward pass; one row without valid tokens (an invalid reward).
    rollout = trainer.producer.assemble(samples, trainer.producer.score(samples), packed)
    rollout.response_mask[2] = False
    rows = torch.arange(rollout.response.shape[0])
    weights = torch.randn(rollout.response.shape, generator=torch.Generator().manual_seed(2))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    results = {}
    for name in ("packed", "padded"):
        context = _padded(trainer) if name == "padded" else torch.enable_grad()
        with context:
            logprobs, values, entropy = trainer.loop.training_forward(trainer.model, rollout, rows)
        valid = rollout.response_mask
        loss = ((logprobs + 0.3 * values + 0.1 * entropy) * weights * valid).sum()
        results[name] = (logprobs, values, entropy, torch.autograd.grad(loss, params))
    valid = rollout.response_mask
    for i, name in enumerate(("logprobs", "values", "entropy")):
        got, want = results["packed"][i].detach(), results["padded"][i].detach()
        torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=ATOL, msg=name)
    for got, want in zip(results["packed"][3], results["padded"][3], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=ATOL)
    # The one-row passes ran through the segment attention, the rows layout never did.
    assert bool(segment_calls) == (layout == "one_row")


def test_a_model_that_lets_attention_cross_packed_sequences_stays_padded(kit, tmp_path, caplog):
    from transformers import AttentionInterface

    model = kit.load_model("llama-sft")
    assert padding_free_matches(model) and one_row_matches(model)

    def whole_row(module, query, key, value, attention_mask, scaling=None, **kwargs):
        # An attention of the model's own: causal over the whole row, blind to masks and positions.
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("test_whole_row", whole_row)
    model.config._attn_implementation = "test_whole_row"
    assert not padding_free_matches(model) and not one_row_matches(model)
    with caplog.at_level(logging.INFO, logger="rlhf_trainers.onpolicy.passes"):
        trainer = test_rloo._trainer(kit, tmp_path, model=model, padding_free=True)
    assert not trainer.passes.pack_policy and not trainer.passes.pack_ref
    assert "does not keep attention within packed sequences" in caplog.text
    assert trainer.passes.packed(*_inputs(trainer)) is None


def test_training_passes_under_gradient_checkpointing_keep_rows_of_the_longest_sequence(kit, tmp_path):
    # Checkpointing recomputes a layer's forward in the backward pass, outside the pass's
    # one_row_attention: the training passes keep the rows layout, the no-grad rollout passes one row.
    trainer = test_ppo._trainer(kit, tmp_path, padding_free=True, gradient_checkpointing=True)
    assert trainer.passes.pack_one_row
    inputs = _inputs(trainer)
    assert trainer.passes.packed(*inputs, training=True).segments is not None  # not enabled before train()
    trainer._enable_gradient_checkpointing()  # what train() does first
    assert trainer.passes.packed(*inputs).segments is not None
    assert trainer.passes.packed(*inputs, training=True).segments is None
    trainer.policy.gradient_checkpointing_disable()
    trainer.value_model.gradient_checkpointing_disable()
    assert trainer.passes.packed(*inputs, training=True).segments is not None


def test_one_row_layout_only_where_its_attention_is_fast(monkeypatch):
    """CPU: always (per-sequence SDPA). A GPU: only where the variable-length kernel runs (fp16/bf16, a
    head size it takes, a torch that has it, an Ampere+ device); other accelerators never."""
    from rlhf_trainers.packing import one_row_fits

    assert one_row_fits("cpu", torch.float32) and one_row_fits("cpu", torch.bfloat16, 12)
    assert not one_row_fits("cuda", torch.float32, 64)  # fp32 on a GPU: no flash kernel
    monkeypatch.setattr(packing_module, "varlen_kernel", lambda: object())
    monkeypatch.setattr(packing_module, "_flash_capable", lambda device: True)
    assert one_row_fits("cuda:0", torch.bfloat16, 64) and one_row_fits("cuda", torch.float16)
    assert not one_row_fits("cuda", torch.bfloat16, 12) and not one_row_fits("cuda", torch.bfloat16, 512)
    assert not one_row_fits("mps", torch.bfloat16, 64)
    monkeypatch.setattr(packing_module, "_flash_capable", lambda device: False)  # e.g. a V100
    assert not one_row_fits("cuda", torch.bfloat16, 64)
    monkeypatch.setattr(packing_module, "varlen_kernel", lambda: None)  # torch < 2.10
    monkeypatch.setattr(packing_module, "_flash_capable", lambda device: True)
    assert not one_row_fits("cuda", torch.bfloat16, 64)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_attention_head_size_is_read_from_each_config(kit, arch):
    model = kit.load_model(arch)
    config = model.config
    assert packing_module.attention_head_size(model) == config.hidden_size // config.num_attention_heads


def test_trainer_packs_rows_where_the_one_row_layout_would_be_slow(kit, tmp_path, monkeypatch, caplog):
    """Where ``one_row_fits`` says no (a GPU without the variable-length kernel, e.g. fp32), the packed
    passes of a batch go in rows of the longest sequence, with an info line; packing stays on."""
    from rlhf_trainers.onpolicy import passes as setup_module

    asked = []

    def fits(device, dtype, head_size=None):
        asked.append((torch.device(device).type, dtype, head_size))
        return False

    monkeypatch.setattr(setup_module, "one_row_fits", fits)
    with caplog.at_level(logging.INFO, logger="rlhf_trainers.onpolicy.passes"):
        trainer = test_ppo._trainer(kit, tmp_path, padding_free=True)
    assert trainer.passes.pack_policy and trainer.passes.pack_ref and trainer.passes.pack_values
    assert not trainer.passes.pack_one_row and "rows of the longest sequence" in caplog.text
    head = packing_module.attention_head_size(trainer.policy)
    assert ("cpu", torch.float32, head) in asked
    packed = trainer.passes.packed(*_inputs(trainer))
    assert packed is not None and packed.segments is None


def _inputs(trainer):
    with torch.no_grad():
        samples = trainer.producer.sample(trainer.producer.prompt_batch(0), trainer.completions_per_prompt)
    first, end = trim_bounds(samples.query_mask, samples.response_mask)
    ids, mask, positions = trainer.passes.sequence_inputs(
        samples.query[:, first:],
        samples.query_mask[:, first:],
        samples.response[:, :end],
        samples.response_mask[:, :end],
    )
    return ids, mask, positions, samples.response_mask[:, :end]


def test_on_by_default_and_off_when_asked(kit, tmp_path):
    trainer = test_ppo._trainer(kit, tmp_path / "on")
    assert trainer.passes.pack_policy and trainer.passes.pack_ref and trainer.passes.pack_values
    trainer = test_ppo._trainer(kit, tmp_path / "off", padding_free=False)
    assert not (trainer.passes.pack_policy or trainer.passes.pack_ref or trainer.passes.pack_values)


@pytest.mark.parametrize("algorithm", ["ppo", "rloo"])
def test_whole_runs_give_the_same_metrics_and_model(kit, tmp_path, algorithm, monkeypatch):
    from rlhf_trainers.onpolicy import passes as rollout_module

    shared = []  # whether some packed row held several sequences, per packing

    def spy(ids, mask, positions, response_mask, pad, **kwargs):
        packed = pack_sequences(ids, mask, positions, response_mask, pad, **kwargs)
        # the default layout: all of a pass's sequences in one row
        assert packed is None or packed.segments is not None
        shared.append(packed is not None and packed.input_ids.shape[0] < int(response_mask.any(1).sum()))
        return packed

    monkeypatch.setattr(rollout_module, "pack_sequences", spy)
    module = test_ppo if algorithm == "ppo" else test_rloo
    extra = {"rloo_k": 4} if algorithm == "rloo" else {}
    runs = {}
    for packed in (True, False):
        trainer = module._trainer(
            kit,
            tmp_path / str(packed),
            padding_free=packed,
            response_length=16,
            max_steps=2,
            num_mini_batches=2,
            per_device_train_batch_size=16,
            rollout_logprobs="forward",
            **extra,
        )
        trainer.train()
        runs[packed] = (module._digest(trainer.policy), trainer.state.log_history)
    assert any(shared)  # some rows held several sequences (else packing would change nothing)
    lengths = [h["val/response_length"] for h in runs[True][1] if "val/response_length" in h]
    assert all(0 < n < 16 for n in lengths)  # responses stop at EOS: the batches have padding
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-4, atol=1e-5)
    compared = 0
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        for key, value in a.items():
            if key.startswith(("objective/", "loss/", "policy/", "val/", "critic/")):
                assert value == pytest.approx(b[key], rel=1e-3, abs=1e-5), key
                compared += 1
    assert compared > 20


def test_token_budget_counts_real_tokens_when_packed(kit, tmp_path, monkeypatch):
    """With ``padding_free`` a ``max_tokens_per_microbatch`` budget holds each micro-batch's real tokens
    (what the packed pass costs), and the update is still that of the fixed micro-batches."""
    common = {
        "max_steps": 1,
        "max_grad_norm": 0.0,
        "optim": "sgd",
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 4,
        "rloo_k": 4,
        "padding_free": True,
        "rollout_logprobs": "forward",
    }
    start = test_rloo._digest(test_rloo._trainer(kit, tmp_path / "start").policy)
    fixed = test_rloo._trainer(kit, tmp_path / "fixed", **common)
    budget = test_rloo._trainer(kit, tmp_path / "budget", max_tokens_per_microbatch=40, **common)
    seen: list[tuple[int, int, int]] = []
    forward = budget.loop.training_forward

    def recording(model, rollout, rows, bounds=None):
        first, end = bounds
        real = int(rollout.query_mask[rows].sum() + rollout.response_mask[rows].sum())
        seen.append((len(rows), real, (rollout.query.shape[1] - first) + end))
        return forward(model, rollout, rows, bounds)

    monkeypatch.setattr(budget.loop, "training_forward", recording)
    fixed.train()
    budget.train()
    assert all(real <= 40 or n == 1 for n, real, _ in seen), seen
    assert any(n * width > 40 for n, _, width in seen)  # a padded budget would have split these
    assert sum(n for n, _, _ in seen) == 16
    step_fixed = test_rloo._digest(fixed.policy) - start
    step_budget = test_rloo._digest(budget.policy) - start
    assert step_fixed.abs().max() > 1e-6
    torch.testing.assert_close(step_budget, step_fixed, rtol=1e-3, atol=1e-8)


def _reward_model(kit, name):
    if name != "gpt_neox":
        return kit.load_model(name)
    from transformers import AutoModelForSequenceClassification

    # The kit has no GPT-NeoX reward model: one from the causal model's config, with a random head.
    config = kit.load_model("gpt_neox").config
    config.num_labels = 1
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(config)


@pytest.mark.parametrize("name", ["llama-seqcls", "gpt2-seqcls", "gpt_neox"])
def test_packed_reward_scores_equal_padded_ones(kit, name, monkeypatch):
    model = _reward_model(kit, name).eval()
    pad = kit.load_tokenizer().pad_token_id
    model.config.pad_token_id = pad
    assert packed_score_head(model) is not None and padding_free_matches(model)
    # Rollout-shaped rows: left-padded prompts, then responses right-padded after their stop.
    generator = torch.Generator().manual_seed(0)
    B, Q, R = 12, 7, 10
    ids = torch.randint(pad + 1, pad + 200, (B, Q + R), generator=generator)
    prompt = torch.randint(1, Q + 1, (B,), generator=generator)
    response = torch.randint(1, R + 1, (B,), generator=generator)
    columns = torch.arange(Q + R)[None, :]
    real = (columns >= Q - prompt[:, None]) & (columns < Q + response[:, None])
    ids = ids.masked_fill(~real, pad)
    layouts = []
    original = packing_module.pack_rows

    def spy(*args, one_row=False, **kwargs):
        layouts.append(one_row)
        return original(*args, one_row=one_row, **kwargs)

    monkeypatch.setattr(packing_module, "pack_rows", spy)
    packed = score_ids(model, ids, pad, batch_size=5, padding_free=True)
    padded = score_ids(model, ids, pad, batch_size=5)
    assert padded.std() > 1e-3  # the rows score differently
    torch.testing.assert_close(packed, padded, rtol=0, atol=ATOL)
    assert layouts == [True] * 3  # 12 rows in chunks of 5, one row each (a CPU)
    # Where the one-row layout is slow (a GPU without the variable-length kernel): rows, same scores.
    monkeypatch.setattr(packing_module, "one_row_fits", lambda *args: False)
    torch.testing.assert_close(score_ids(model, ids, pad, batch_size=5, padding_free=True), padded)
    assert layouts == [True] * 3 + [False] * 3


def _count_packed_scoring(monkeypatch) -> list:
    """The (B, T) shapes of the chunks that the reward model source scores packed, from now on."""
    from rlhf_trainers import packing
    from rlhf_trainers.rewards import model as reward_model_module

    calls = []
    original = packing.packed_pooled_scores

    def counted(*args, **kwargs):
        calls.append(tuple(args[1].shape))
        return original(*args, **kwargs)

    monkeypatch.setattr(reward_model_module, "packed_pooled_scores", counted)
    return calls


def test_packed_text_scores_equal_padded_ones(kit, monkeypatch):
    """A reward model with its own tokenizer scores the texts (retokenized, right-padded, EOS appended)
    packed as it scores them padded; texts of very different lengths, so the padding is substantial."""
    calls = _count_packed_scoring(monkeypatch)
    model, tokenizer = kit.load_model("gpt2-alt-seqcls").eval(), kit.load_tokenizer("alt")
    assert packed_score_head(model) is not None and padding_free_matches(model)
    words = "the movie was great and the plot was dull , honestly the actors were fine".split()
    texts = [" ".join(words[: 1 + (7 * i) % len(words)]) for i in range(11)]
    lengths = {len(tokenizer(t)["input_ids"]) for t in texts}
    assert max(lengths) - min(lengths) >= 8
    packed = score_texts(model, tokenizer, texts, batch_size=4, padding_free=True)
    assert len(calls) == 3  # 11 texts in chunks of 4
    padded = score_texts(model, tokenizer, texts, batch_size=4)
    assert len(calls) == 3
    assert padded.std() > 1e-3
    torch.testing.assert_close(packed, padded, rtol=0, atol=ATOL)


def test_the_trainer_scores_texts_with_another_tokenizer_packed(kit, tmp_path, monkeypatch):
    """The reward model with its own tokenizer (the text path) takes the packed path inside the trainer,
    with the same scores as the padded path."""
    calls = _count_packed_scoring(monkeypatch)
    trainer = test_rloo._trainer(
        kit,
        tmp_path,
        reward_model=kit.load_model("gpt2-alt-seqcls"),
        reward_processing_class=kit.load_tokenizer("alt"),
        rloo_k=2,
    )
    sources = trainer.reward_sources
    assert not sources.same_tokenizer and sources.padding_free
    with torch.no_grad():
        samples = _with_short_responses(trainer, trainer.producer.sample(trainer.producer.prompt_batch(0), 2))
        packed = trainer.producer.score(samples).total
        assert sources.model_source._pack_reward is True and calls
        calls.clear()
        sources.model_source._pack_reward = False
        padded = trainer.producer.score(samples).total
    assert not calls
    torch.testing.assert_close(packed, padded, rtol=0, atol=ATOL)


def test_the_trainer_scores_with_the_reward_model_packed(kit, tmp_path):
    trainer = test_rloo._trainer(kit, tmp_path, reward_model=kit.load_model("llama-seqcls"), rloo_k=2)
    sources = trainer.reward_sources
    assert sources.same_tokenizer and sources.padding_free
    with torch.no_grad():
        samples = _with_short_responses(trainer, trainer.producer.sample(trainer.producer.prompt_batch(0), 2))
        packed = trainer.producer.score(samples).total
        assert sources.model_source._pack_reward is True
        sources.model_source._pack_reward = False
        padded = trainer.producer.score(samples).total
    torch.testing.assert_close(packed, padded, rtol=0, atol=ATOL)
