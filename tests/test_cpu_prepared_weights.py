"""What the CPU decoding steps derive from the weights alone (LoRA layers' merged copies, MKL-packed
weights) is made once per weight version inside ``keep_prepared_weights()`` (the trainers' evaluation),
and at every sampling call outside it, with the same samples either way (issue #47)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from rlhf_trainers.cpu import keep_prepared_weights, lean_llama_steps_prepacked_merged
from rlhf_trainers.cpu import lean_llama as cpu_lean
from rlhf_trainers.generation import BuiltinSampling, SamplingSettings

pytest.importorskip("peft")


@pytest.fixture
def builds(monkeypatch) -> dict[str, int]:
    """Counts of the LoRA merges and the MKL packings the lean steps make."""
    counts = {"merged": 0, "packed": 0}
    merge, pack = cpu_lean._merged_lora, cpu_lean._mkl_reorder

    def merging(module):
        result = merge(module)
        counts["merged"] += result is not None
        return result

    def packing(weight, rows):
        counts["packed"] += 1
        return pack(weight, rows)

    monkeypatch.setattr(cpu_lean, "_merged_lora", merging)
    monkeypatch.setattr(cpu_lean, "_mkl_reorder", packing)
    return counts


def _lora_policy(kit):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        kit.load_model("llama-sft"),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, lora_dropout=0.0),
    )
    return model.eval()


def _sample_twice(backend, prompts, seed=3):
    tok, ids, mask = prompts
    settings = SamplingSettings(max_new_tokens=6, pad_token_id=tok.pad_token_id, return_logprobs=True)
    samples = []
    for _ in range(2):
        torch.manual_seed(seed)
        samples.append(backend.sample(ids, mask, settings))
    return samples


def test_kept_weights_are_made_once_per_weight_version(kit, prompts, builds):
    if not cpu_lean.mkl_prepacked_linear_available():
        pytest.skip("this torch build has no MKL packed GEMM")
    model = _lora_policy(kit)
    backend = BuiltinSampling(model, fast_steps=lean_llama_steps_prepacked_merged)
    adapted = sum(1 for m in model.modules() if type(m) is cpu_lean._lora_linear_class())
    # Outside the context: every sampling call makes its own (as before), and frees them after.
    plain = _sample_twice(backend, prompts)
    per_call = dict(builds)
    assert per_call["merged"] == 2 * adapted and per_call["packed"] > 0 and per_call["packed"] % 2 == 0
    with keep_prepared_weights():
        kept = _sample_twice(backend, prompts)
        assert builds["merged"] == per_call["merged"] + adapted  # once for both calls
        assert builds["packed"] == per_call["packed"] * 3 // 2
        with torch.no_grad():  # an optimizer step: the weights change in place
            next(p for n, p in model.named_parameters() if "lora_B" in n).add_(0.5)
        stepped = _sample_twice(backend, prompts)
        assert builds["merged"] == per_call["merged"] + 2 * adapted  # made again, once
        assert builds["packed"] == per_call["packed"] * 2
    assert not cpu_lean._KEPT  # freed on exit
    for a, b in zip(plain, kept, strict=True):  # the same samples as per-call copies
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert torch.equal(stepped[0].tokens, stepped[1].tokens)  # the new weights' copies are used throughout
    fresh = _sample_twice(backend, prompts)
    assert torch.equal(fresh[0].tokens, stepped[0].tokens) and torch.equal(
        fresh[0].logprobs, stepped[0].logprobs
    )


def test_a_new_batch_size_repacks_and_keeps_the_merged_copies(kit, prompts, builds):
    if not cpu_lean.mkl_prepacked_linear_available():
        pytest.skip("this torch build has no MKL packed GEMM")
    model = _lora_policy(kit)
    backend = BuiltinSampling(model, fast_steps=lean_llama_steps_prepacked_merged)
    tok, ids, mask = prompts
    settings = SamplingSettings(max_new_tokens=4, pad_token_id=tok.pad_token_id)
    with keep_prepared_weights():
        backend.sample(ids, mask, settings)
        first = dict(builds)
        backend.sample(ids[:3], mask[:3], settings)  # the last, smaller chunk of an evaluation
    assert builds["merged"] == first["merged"]
    assert builds["packed"] == 2 * first["packed"]


def test_evaluate_prepares_the_weights_once_per_weight_version(kit, tmp_path, builds, monkeypatch):
    from peft import LoraConfig
    from test_rloo import _trainer

    if not cpu_lean.mkl_prepacked_linear_available():
        pytest.skip("this torch build has no MKL packed GEMM")
    trainer = _trainer(
        kit,
        tmp_path / "kept",
        eval_n=12,
        local_rollout_forward_batch_size=4,  # 3 sampling calls per evaluation
        rloo_k=2,
        response_length=6,
        max_steps=1,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
        mkl_prepacked_decoding=True,
    )
    adapted = sum(1 for m in trainer.policy.modules() if type(m) is cpu_lean._lora_linear_class())
    before = trainer.evaluate()
    assert builds["merged"] == adapted  # once for the 3 calls
    packed_once = builds["packed"]
    again = trainer.evaluate()
    assert _untimed(again) == _untimed(before)  # evaluation on the same weights: the same metrics
    trainer.train()  # the rollout samples on its own copies; the update changes the weights
    merged_so_far = builds["merged"]
    kept = trainer.evaluate()
    assert builds["merged"] == merged_so_far + adapted
    assert not cpu_lean._KEPT
    # The same numbers as with copies made at every sampling call (the context switched off).
    monkeypatch.setattr(trainer.sampler, "prepared_weights_kept", lambda: contextlib.nullcontext())
    builds["packed"] = 0
    assert _untimed(trainer.evaluate()) == _untimed(kept)
    assert builds["packed"] == 3 * packed_once


def test_a_nested_context_shares_the_outer_ones_copies(kit, prompts, builds):
    if not cpu_lean.mkl_prepacked_linear_available():
        pytest.skip("this torch build has no MKL packed GEMM")
    backend = BuiltinSampling(_lora_policy(kit), fast_steps=lean_llama_steps_prepacked_merged)
    tok, ids, mask = prompts
    settings = SamplingSettings(max_new_tokens=4, pad_token_id=tok.pad_token_id)
    with keep_prepared_weights():
        backend.sample(ids, mask, settings)
        first = dict(builds)
        with keep_prepared_weights():
            backend.sample(ids, mask, settings)
        assert len(cpu_lean._KEPT) == 1
        backend.sample(ids, mask, settings)
    assert builds == first and not cpu_lean._KEPT


def _untimed(metrics: dict) -> dict:
    """Evaluation metrics without Trainer's speed measurements (``eval_runtime``, ...)."""
    return {k: v for k, v in metrics.items() if not k.endswith(("_runtime", "_per_second"))}
