"""The weights an inference engine receives from a PEFT policy (``generation.weights``): a plain transformers
model loaded with them computes what the PEFT model computes, for every kind of adapter PEFT can merge
(LoRA, rsLoRA, DoRA, ``lora_bias``, LoRA on an embedding, on a tied lm head), and an adapter it cannot
merge is refused with its reason. vLLM samples from exactly these weights (``use_vllm=True``)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

peft = pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from rlhf_trainers.generation.weights import (  # noqa: E402
    AdapterNotMergeableError,
    inference_weights,
    untied_by_adapters,
)


def _adapted(kit, name: str, **lora) -> torch.nn.Module:
    model = kit.load_model(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notes on tied embeddings and fan_in_fan_out
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **lora))
    torch.manual_seed(0)
    with torch.no_grad():  # every trained tensor away from its initial value (DoRA's magnitudes included)
        for p in peft_model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.2)
    return peft_model.eval()


def _engine_model(peft_model: torch.nn.Module) -> torch.nn.Module:
    """A plain transformers model holding what the engine would: inference_weights' tensors, the config
    untied where untied_by_adapters says so."""
    root = peft_model.get_base_model()
    config = copy.deepcopy(root.config)
    if untied_by_adapters(peft_model):
        config.tie_word_embeddings = False
    fresh = AutoModelForCausalLM.from_config(config)
    missing, unexpected = fresh.load_state_dict(dict(inference_weights(peft_model)), strict=False)
    tied_head = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert set(missing) <= tied_head, missing
    assert not unexpected, unexpected
    return fresh.eval()


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


CASES = {
    "lora on every linear layer": ("llama", {"target_modules": "all-linear"}),
    "rslora": ("llama", {"target_modules": "all-linear", "use_rslora": True}),
    "dora": ("llama", {"target_modules": "all-linear", "use_dora": True}),
    "lora on the input embedding of a tied model": ("llama", {"target_modules": ["q_proj", "embed_tokens"]}),
    "lora on the tied lm head": ("llama", {"target_modules": ["v_proj", "lm_head"]}),
    "lora_bias on gpt2's Conv1D layers": ("gpt2", {"target_modules": ["c_attn", "c_fc"], "lora_bias": True}),
    "gpt_neox, untied": ("gpt_neox", {"target_modules": ["query_key_value", "dense_4h_to_h"]}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_weights_compute_what_the_adapted_model_computes(kit, case):
    name, lora = CASES[case]
    peft_model = _adapted(kit, name, **lora)
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    want = _logits(peft_model, ids)
    base_only = _logits(kit.load_model(name).eval(), ids)
    assert (want - base_only).abs().max() > 1e-2  # the adapter does change the outputs
    got = _logits(_engine_model(peft_model), ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # float32 rounding of another order


def test_an_adapter_on_a_tied_embedding_unties_the_engine_weights(kit):
    tied = _adapted(kit, "llama", target_modules=["embed_tokens"])
    assert untied_by_adapters(tied)
    weights = dict(inference_weights(tied))
    # The model reads tokens through the adapted embedding and scores them with the shared base weight.
    base = tied.get_base_model().model.embed_tokens.base_layer.weight
    assert torch.equal(weights["lm_head.weight"], base)
    assert not torch.equal(weights["model.embed_tokens.weight"], base)
    assert not untied_by_adapters(_adapted(kit, "llama", target_modules=["q_proj"]))


def test_an_adapter_peft_cannot_merge_is_refused_with_the_reason(kit):
    model = _adapted(kit, "llama", target_modules=["q_proj"], alora_invocation_tokens=[5, 6])
    with pytest.raises(
        AdapterNotMergeableError,
        match=r"q_proj: .*ALoraLinearVariant.*cannot be merged.*aLoRA does not support.*sample without",
    ):
        dict(inference_weights(model))


def test_several_active_adapters_are_merged_and_a_variant_among_several_is_refused(kit):
    model = _adapted(kit, "llama", target_modules=["q_proj", "v_proj"])
    second = LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, target_modules=["q_proj"])
    model.add_adapter("second", second)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "second" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.base_model.set_adapter(["default", "second"])
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(_engine_model(model), ids), _logits(model, ids), rtol=1e-4, atol=1e-4)

    dora = _adapted(kit, "llama", target_modules=["q_proj"], use_dora=True)
    dora.add_adapter("second", LoraConfig(r=2, init_lora_weights=False, target_modules=["q_proj"]))
    dora.base_model.set_adapter(["default", "second"])
    with pytest.raises(AdapterNotMergeableError, match=r"include a LoRA variant \(DoraLinearVariant\)"):
        dict(inference_weights(dora))


def test_the_model_is_left_as_it_was(kit):
    model = _adapted(kit, "llama", target_modules="all-linear", use_dora=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dict(inference_weights(model))
    dict(inference_weights(model))  # twice: no state carried from one merge to the next
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(getattr(m, "merged", False) for m in model.modules())
