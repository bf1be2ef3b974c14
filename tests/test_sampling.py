"""The builtin sampling loop (``rlhf_trainers.generation.builtin``), its lean decoding steps
(``rlhf_trainers.cpu``), ``generation_loop`` and ``rollout_logprobs``.

The loop (with its default draw, ``torch.multinomial``) must draw what ``generate(do_sample=True, top_k=0,
top_p=1)`` draws for the same seed, ignore the model's ``generation_config.json``, and return the log-probs
and entropies the trainer's forward pass computes for the same tokens, so the rollout can skip that pass."""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict

import pytest
import torch
from transformers import GenerationConfig

from rlhf_trainers import RLOOConfig, RLOOTrainer
from rlhf_trainers import functional as F
from rlhf_trainers.cpu import lean_llama_steps
from rlhf_trainers.generation import BuiltinSampling, SamplingSettings, sample_with_kv_cache
from rlhf_trainers.onpolicy.forward import policy_logits


def sample_completions(model, ids, mask, *, lean_decoding=True, **settings):
    """The builtin backend (with the lean steps unless told otherwise) through the protocol."""
    backend = BuiltinSampling(model, fast_steps=lean_llama_steps if lean_decoding else None)
    return backend.sample(ids, mask, SamplingSettings(**settings))


def _hf(policy, ids, mask, n, temperature, pad, eos, top_k=0, top_p=1.0, min_p=None):
    config = GenerationConfig(
        max_new_tokens=n,
        do_sample=True,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        pad_token_id=pad,
        eos_token_id=eos,
        use_cache=True,
    )
    return policy.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1] :]


@pytest.mark.parametrize(("temperature", "stop"), [(1.0, False), (0.7, True)])
def test_draws_are_those_of_generate_for_the_same_seed(policy, prompts, temperature, stop):
    tok, ids, mask = prompts
    eos = [tok.eos_token_id] if stop else []
    torch.manual_seed(3)
    expected = _hf(policy, ids, mask, 12, temperature, tok.pad_token_id, eos)
    torch.manual_seed(3)
    got = sample_completions(
        policy,
        ids,
        mask,
        max_new_tokens=12,
        temperature=temperature,
        pad_token_id=tok.pad_token_id,
        stop_token_ids=eos,
    )
    n = expected.shape[1]  # generate() stops when every row has stopped; the backend pads to 12
    assert torch.equal(got.tokens[:, :n], expected)
    assert got.tokens.shape[1] == 12 and (got.tokens[:, n:] == tok.pad_token_id).all()
    assert got.logprobs is None and got.entropy is None
    if stop:
        assert (got.tokens == tok.eos_token_id).any()  # some rows stopped: the padding path ran


@pytest.mark.parametrize(
    "filters", [{"top_k": 5}, {"top_p": 0.7}, {"min_p": 0.2}, {"top_k": 20, "top_p": 0.9, "min_p": 0.05}]
)
def test_top_k_top_p_min_p_draw_what_generate_draws(policy, prompts, filters):
    """The restricted draws are generate()'s for the same seed (its warpers in its order); the log-probs
    returned stay those of the unrestricted distribution, i.e. the trainer's forward pass."""
    tok, ids, mask = prompts
    torch.manual_seed(5)
    expected = _hf(policy, ids, mask, 10, 0.8, tok.pad_token_id, [], **filters)
    torch.manual_seed(5)
    got = sample_completions(
        policy,
        ids,
        mask,
        max_new_tokens=10,
        temperature=0.8,
        pad_token_id=tok.pad_token_id,
        return_logprobs=True,
        **filters,
    )
    assert torch.equal(got.tokens, expected)
    torch.manual_seed(5)
    unrestricted = sample_completions(
        policy, ids, mask, max_new_tokens=10, temperature=0.8, pad_token_id=tok.pad_token_id
    )
    assert not torch.equal(unrestricted.tokens, got.tokens)
    full_mask = torch.cat([mask.bool(), torch.ones_like(got.tokens, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        logits = policy_logits(
            policy, torch.cat([ids, got.tokens], 1), full_mask.long(), F.position_ids_from_mask(full_mask), 11
        )[:, :-1]
    expected_logprobs = F.logprobs_from_logits(logits, got.tokens, 0.8)
    torch.testing.assert_close(got.logprobs, expected_logprobs, atol=1e-5, rtol=0)


def test_logprobs_and_entropy_are_the_forward_pass_values(policy, prompts):
    tok, ids, mask = prompts
    torch.manual_seed(0)
    s = sample_completions(
        policy,
        ids,
        mask,
        max_new_tokens=10,
        temperature=0.7,
        pad_token_id=tok.pad_token_id,
        stop_token_ids=[tok.eos_token_id],
        return_logprobs=True,
    )
    R = s.tokens.shape[1]
    stopped = torch.isin(s.tokens, torch.tensor([tok.eos_token_id]))
    after = torch.zeros_like(stopped)
    after[:, 1:] = stopped.cumsum(1)[:, :-1] > 0
    assert after.any()
    rmask = ~after
    full_mask = torch.cat([mask.bool(), rmask], dim=1)
    full_ids = torch.cat([ids, s.tokens], dim=1).masked_fill(~full_mask, tok.pad_token_id)
    with torch.no_grad():
        logits = policy_logits(
            policy, full_ids, full_mask.long(), F.position_ids_from_mask(full_mask), R + 1
        )[:, :-1]
    logprobs, entropy = F.logprobs_and_entropy_from_logits(logits, s.tokens, 0.7)
    torch.testing.assert_close(s.logprobs[rmask], logprobs[rmask], atol=1e-5, rtol=0)
    # The entropy is a logged metric, summed over the vocabulary in another order: float32 rounding.
    torch.testing.assert_close(s.entropy[rmask], entropy[rmask], atol=1e-4, rtol=0)
    assert (s.logprobs[after] == 0).all() and (s.entropy[after] == 0).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingSettings(max_new_tokens=0, pad_token_id=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingSettings(max_new_tokens=2, temperature=0.0, pad_token_id=0)


# ---- lean decoding steps (LlamaForCausalLM through its modules) ------------------------------------


@pytest.fixture
def forward_calls(monkeypatch) -> dict[str, int]:
    """Counts calls of the forward of every causal LM class of the kit (class attribute: a patch on the
    instance would itself make the loop use the forward)."""
    from transformers import GPT2LMHeadModel, GPTNeoXForCausalLM, LlamaForCausalLM

    calls = {"n": 0}
    for cls in (LlamaForCausalLM, GPT2LMHeadModel, GPTNeoXForCausalLM):
        real = cls.forward

        def counting(self, *args, _real=real, **kwargs):
            calls["n"] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "forward", counting)
    return calls


def _both_ways(model, prompts, n=12, temperature=0.7, stop=True, seed=5):
    tok, ids, mask = prompts
    runs = []
    for lean in (True, False):
        torch.manual_seed(seed)
        settings = SamplingSettings(
            max_new_tokens=n,
            temperature=temperature,
            pad_token_id=tok.pad_token_id,
            stop_token_ids=[tok.eos_token_id] if stop else [],
            return_logprobs=True,
        )
        # The loop itself (no padding to n): its width is the number of steps it ran.
        runs.append(sample_with_kv_cache(model, ids, mask, settings, lean_llama_steps if lean else None))
    return runs


def _assert_same_samples(lean, plain):
    assert torch.equal(lean.tokens, plain.tokens)
    torch.testing.assert_close(lean.logprobs, plain.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(lean.entropy, plain.entropy, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("temperature", "stop"), [(1.0, False), (0.7, True)])
def test_lean_decoding_samples_what_the_forward_samples(policy, prompts, forward_calls, temperature, stop):
    lean, plain = _both_ways(policy, prompts, temperature=temperature, stop=stop)
    _assert_same_samples(lean, plain)
    # The lean run called the forward once (the prompt pass), the other once per sampled position.
    assert forward_calls["n"] == 1 + plain.tokens.shape[1]
    if stop:
        assert (plain.tokens == prompts[0].eos_token_id).any()  # rows stopped: their padding path ran


def test_lean_decoding_grouped_query_attention_and_rope_scaling(kit, prompts, forward_calls):
    # Fewer key/value heads than query heads and a scaled rotary embedding: both come from the model's
    # own modules and config.
    from transformers import LlamaConfig, LlamaForCausalLM

    base = kit.load_model("llama-sft").config.to_dict()
    config = LlamaConfig(
        **{
            **base,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        }
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    lean, plain = _both_ways(model, prompts, temperature=1.0, stop=False)
    _assert_same_samples(lean, plain)
    assert forward_calls["n"] == 1 + plain.tokens.shape[1]


def test_lean_decoding_under_a_lora_adapter_and_with_it_disabled(policy, prompts, forward_calls):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        copy.deepcopy(policy),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    ).eval()
    with torch.no_grad():  # a trained adapter: B = 0 at initialisation would make it a no-op
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    for context in (contextlib.nullcontext(), model.disable_adapter()):
        forward_calls["n"] = 0
        with context:
            lean, plain = _both_ways(model, prompts)
        _assert_same_samples(lean, plain)
        assert forward_calls["n"] == 1 + plain.tokens.shape[1]
    torch.manual_seed(5)
    with_adapter = _both_ways(model, prompts)[0]
    with model.disable_adapter():
        without = _both_ways(model, prompts)[0]
    assert not torch.equal(with_adapter.logprobs, without.logprobs)  # the adapter took part


@pytest.mark.parametrize("case", ["gpt2", "gpt_neox", "forward_hook", "forward_pre_hook", "instance_forward"])
def test_what_the_lean_steps_cannot_reproduce_runs_the_forward_every_step(kit, prompts, forward_calls, case):
    model = kit.load_model(case if case in ("gpt2", "gpt_neox") else "llama-sft").eval()
    seen = []
    if case == "forward_hook":  # e.g. an activation probe on a decoder layer: it must see every step
        model.model.layers[0].register_forward_hook(lambda *a: seen.append(1))
    elif case == "forward_pre_hook":
        model.register_forward_pre_hook(lambda *a: seen.append(1))
    elif case == "instance_forward":  # e.g. accelerate's mixed-precision wrapper around forward
        real = model.forward

        def wrapped(*args, **kwargs):
            seen.append(1)
            return real(*args, **kwargs)

        model.forward = wrapped
    lean, plain = _both_ways(model, prompts, stop=False)
    assert torch.equal(lean.tokens, plain.tokens)
    steps = plain.tokens.shape[1]
    assert forward_calls["n"] == 2 * steps  # the forward ran at every step, lean_decoding or not
    if case not in ("gpt2", "gpt_neox"):
        assert len(seen) == 2 * steps


def test_lean_decoding_runs_when_several_processes_train(policy, prompts, forward_calls, monkeypatch):
    # The exit-time abort of 2-process runs that once kept them on the forward was not the lean steps'
    # (rlhf_trainers.distributed_exit): they run under several processes too.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    lean, plain = _both_ways(policy, prompts, stop=False)
    assert torch.equal(lean.tokens, plain.tokens)
    assert forward_calls["n"] == 1 + plain.tokens.shape[1]


# ---- in the trainer ------------------------------------------------------------------------------


def _trainer(kit, tmp_path, model="llama-sft", **overrides) -> RLOOTrainer:
    """test_rloo's trainer (true reward, 8 completions, CPU) with 10-token responses at temperature 0.7."""
    from test_rloo import _trainer as rloo_trainer

    fields = {"rloo_k": 2, "response_length": 10, "temperature": 0.7, "max_steps": 1}
    fields.update(overrides)
    return rloo_trainer(kit, tmp_path, train_n=16, model=model, **fields)


def _seeded_rollout(trainer):
    torch.manual_seed(11)
    return trainer.rollout(trainer.producer.prompt_batch(0))


def test_rollout_from_generation_matches_the_forward_pass(kit, tmp_path):
    fwd = _trainer(kit, tmp_path, rollout_logprobs="forward")
    gen = _trainer(kit, tmp_path, rollout_logprobs="generation")
    assert not fwd.logprobs_from_generation and gen.logprobs_from_generation
    timings_f, timings_g = defaultdict(float), defaultdict(float)
    torch.manual_seed(11)
    a = fwd.rollout(fwd.producer.prompt_batch(0), timings_f)
    torch.manual_seed(11)
    b = gen.rollout(gen.producer.prompt_batch(0), timings_g)
    assert torch.equal(a.response, b.response)
    m = a.response_mask
    assert m.all(1).sum() < m.shape[0]  # some responses stopped early
    torch.testing.assert_close(b.logprobs[m], a.logprobs[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(b.entropy[m], a.entropy[m], atol=1e-4, rtol=0)
    torch.testing.assert_close(b.kl, a.kl, atol=1e-5, rtol=0)
    assert timings_f["timing/policy"] > 0 and timings_g["timing/policy"] == 0  # the pass was skipped


def test_auto_picks_generation_only_where_it_is_exact(kit, tmp_path):
    assert _trainer(kit, tmp_path).logprobs_from_generation
    assert not _trainer(kit, tmp_path, truncated_is_cap=2.0).logprobs_from_generation
    assert not _trainer(kit, tmp_path, generation_loop="transformers").logprobs_from_generation
    bf16_policy = kit.load_model("llama-sft").to(torch.bfloat16)
    assert not _trainer(kit, tmp_path, model=bf16_policy).logprobs_from_generation
    assert not _trainer(kit, tmp_path, disable_dropout=False).logprobs_from_generation


@pytest.mark.parametrize("loop", ["builtin", "transformers"])
def test_the_models_generation_config_does_not_change_the_draws(kit, tmp_path, loop):
    plain = _trainer(kit, tmp_path, generation_loop=loop)
    model = kit.load_model("llama-sft")
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.suppress_tokens = [kit.load_tokenizer().eos_token_id]
    tweaked = _trainer(kit, tmp_path, model=model, generation_loop=loop)
    a, b = _seeded_rollout(plain), _seeded_rollout(tweaked)
    assert torch.equal(a.response, b.response)
    assert (b.lengths < 10).any()  # EOS was sampled: suppress_tokens did not apply
    assert tweaked.policy.generation_config.repetition_penalty == 3.0  # set aside, then restored
    # What the settings would have done to a plain generate() call with the same seed.
    tok = tweaked.processing_class
    batch = tweaked.producer.prompt_batch(0)
    q = batch["input_ids"].repeat(2, 1)
    qm = batch["attention_mask"].repeat(2, 1)
    torch.manual_seed(11)
    leaked = tweaked.policy.generate(
        input_ids=q,
        attention_mask=qm,
        generation_config=GenerationConfig(
            max_new_tokens=10,
            do_sample=True,
            temperature=0.7,
            top_k=0,
            top_p=1.0,
            pad_token_id=tok.pad_token_id,
        ),
    )[:, q.shape[1] :]
    assert not torch.equal(leaked, a.response[:, : leaked.shape[1]])


def test_config_errors(tmp_path):
    base = {"output_dir": str(tmp_path), "report_to": "none"}
    with pytest.raises(ValueError, match="generation_loop='vllm'"):
        RLOOConfig(**base, generation_loop="vllm")
    with pytest.raises(ValueError, match="rollout_logprobs='scores'"):
        RLOOConfig(**base, rollout_logprobs="scores")
    with pytest.raises(ValueError, match="disable_dropout=False"):
        RLOOConfig(**base, rollout_logprobs="generation", disable_dropout=False)
    with pytest.raises(ValueError, match="truncated_is_cap"):
        RLOOConfig(**base, rollout_logprobs="generation", truncated_is_cap=2.0)


def _prepacked_steps_built(monkeypatch) -> list:
    """The LeanLlamaSteps objects the prepacked provider builds, kept."""
    from rlhf_trainers.cpu import LeanLlamaSteps

    built = []
    build = LeanLlamaSteps.build

    def keep(*args, **kwargs):
        steps = build(*args, **kwargs)
        built.append(steps)
        return steps

    monkeypatch.setattr(LeanLlamaSteps, "build", staticmethod(keep))
    return built


@pytest.mark.parametrize(("temperature", "stop"), [(1.0, False), (0.7, True)])
def test_mkl_prepacked_decoding_samples_what_the_forward_samples(
    policy, prompts, monkeypatch, temperature, stop
):
    from rlhf_trainers.cpu import lean_llama_steps_prepacked, mkl_prepacked_linear_available

    assert mkl_prepacked_linear_available()  # x86 torch wheels (CI's) have MKL's packed GEMM
    built = _prepacked_steps_built(monkeypatch)
    tok, ids, mask = prompts
    runs = []
    for provider in (lean_llama_steps_prepacked, None):
        torch.manual_seed(5)
        settings = SamplingSettings(
            max_new_tokens=12,
            temperature=temperature,
            pad_token_id=tok.pad_token_id,
            stop_token_ids=[tok.eos_token_id] if stop else [],
            return_logprobs=True,
        )
        runs.append(sample_with_kv_cache(policy, ids, mask, settings, provider))
    _assert_same_samples(*runs)
    # Every plain linear layer of the model (lm head included) was packed once, for the batch's 8 rows.
    (steps,) = built
    linears = [m for m in policy.modules() if type(m) is torch.nn.Linear]
    assert set(steps.packed) == set(linears) and steps.packed_rows == ids.shape[0] and steps.llama_mlp
    if stop:  # rows stopped and were dropped: the later steps multiplied by the weights themselves
        assert steps.rows < steps.packed_rows


def _with_and_without(provider, model, prompts, max_new_tokens: int) -> list:
    """The samples of ``model`` from ``prompts`` with the decoding steps of ``provider``, then with its
    forward, from the same seed."""
    tok, ids, mask = prompts
    runs = []
    for steps in (provider, None):
        torch.manual_seed(2)
        settings = SamplingSettings(
            max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, return_logprobs=True
        )
        runs.append(sample_with_kv_cache(model, ids, mask, settings, steps))
    return runs


def test_mkl_prepacked_decoding_leaves_lora_layers_to_their_own_forward(kit, prompts, monkeypatch):
    from peft import LoraConfig, get_peft_model

    from rlhf_trainers.cpu import lean_llama_steps_prepacked

    built = _prepacked_steps_built(monkeypatch)
    model = get_peft_model(
        kit.load_model("llama-sft"),
        LoraConfig(r=4, target_modules=["q_proj", "up_proj"], init_lora_weights=False, lora_dropout=0.0),
    ).eval()
    _assert_same_samples(*_with_and_without(lean_llama_steps_prepacked, model, prompts, max_new_tokens=8))
    packed = built[0].packed
    assert packed and not any("lora" in type(m).__module__ for m in packed)
    assert all(type(m) is torch.nn.Linear for m in packed)


def _adapted_policy(kit, **lora):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        kit.load_model("llama-sft"), LoraConfig(r=4, init_lora_weights=False, lora_dropout=0.1, **lora)
    )
    torch.manual_seed(0)
    with torch.no_grad():  # adapters far enough from their start that merging them matters
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_merged_adapter_decoding_samples_what_the_adapters_forward_samples(kit, prompts, monkeypatch, dora):
    """merged_adapter_decoding: the LoRA layers' decoding steps run on packed copies of their weights with
    the adapters merged (DoRA's magnitudes too), and sample what the adapter's own forward samples; the
    model is left unmerged."""
    from rlhf_trainers.cpu import lean_llama_steps_prepacked_merged

    built = _prepacked_steps_built(monkeypatch)
    model = _adapted_policy(kit, target_modules=["q_proj", "o_proj", "up_proj", "down_proj"], use_dora=dora)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    merged, plain = _with_and_without(lean_llama_steps_prepacked_merged, model, prompts, max_new_tokens=10)
    assert torch.equal(merged.tokens, plain.tokens)
    torch.testing.assert_close(merged.logprobs, plain.logprobs, atol=1e-4, rtol=0)
    lora = [m for m in model.modules() if "lora" in type(m).__module__ and hasattr(m, "base_layer")]
    steps = built[0]
    assert lora and set(lora) <= set(steps.packed) and not steps.merged
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert not any(getattr(m, "merged", False) for m in lora)


def test_merged_adapter_decoding_under_bf16_autocast_casts_the_merged_copies_once(kit, prompts):
    """Under CPU bf16 autocast the merged copies are bf16 (cast once per call) and a step's product through
    one equals the adapter's forward to bf16 rounding."""
    from rlhf_trainers.cpu import AutocastWeightCache, LeanLlamaSteps

    model = _adapted_policy(kit, target_modules=["q_proj", "gate_proj"])
    _, ids, mask = prompts
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), AutocastWeightCache():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        steps = LeanLlamaSteps.build(model, out, mask, 4, prepack=True, merge_adapters=True)
        lora = [m for m in model.modules() if "lora" in type(m).__module__ and hasattr(m, "base_layer")]
        assert set(steps.merged) == set(lora) and not any(m in steps.packed for m in lora)
        assert all(weight.dtype == torch.bfloat16 for weight, _ in steps.merged.values())
        for module in lora:
            x = torch.randn(ids.shape[0], 1, module.in_features)
            torch.testing.assert_close(
                steps._linear(module, x).float(), module(x).float(), rtol=3e-2, atol=3e-2
            )


def test_an_adapter_peft_cannot_merge_keeps_its_own_forward(kit):
    from rlhf_trainers.cpu import lean_llama as cpu_lean

    model = _adapted_policy(kit, target_modules=["q_proj"], alora_invocation_tokens=[5, 6])
    layers = [m for m in model.modules() if "lora" in type(m).__module__ and hasattr(m, "base_layer")]
    assert layers and all(cpu_lean._merged_lora(m) is None for m in layers)
    plain = _adapted_policy(kit, target_modules=["q_proj"])
    layer = next(m for m in plain.modules() if "lora" in type(m).__module__ and hasattr(m, "base_layer"))
    assert cpu_lean._merged_lora(layer) is not None
    assert cpu_lean._merged_lora(layer.train()) is None  # the adapter's dropout acts in training mode


def test_the_trainer_merges_lora_adapters_for_decoding_unless_asked_not_to(kit, tmp_path, monkeypatch):
    from peft import LoraConfig

    from rlhf_trainers.cpu import lean_llama_steps_prepacked, lean_llama_steps_prepacked_merged

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    on = _trainer(kit, tmp_path / "on", peft_config=lora, mkl_prepacked_decoding=True)
    assert on.generation_backend.fast_steps is lean_llama_steps_prepacked_merged
    assert "LoRA adapters merged" in on.generation_backend.name
    built = _prepacked_steps_built(monkeypatch)
    on.policy.train()  # as between updates: the rollout samples in eval mode all the same
    _seeded_rollout(on)
    adapted = [m for m in on.policy.modules() if "lora" in type(m).__module__ and hasattr(m, "base_layer")]
    assert built and len(adapted) == 2 * 2 and all(set(adapted) <= set(steps.packed) for steps in built)
    off = _trainer(
        kit, tmp_path / "off", peft_config=lora, merged_adapter_decoding=False, mkl_prepacked_decoding=True
    )
    assert off.generation_backend.fast_steps is lean_llama_steps_prepacked
    assert "merged" not in off.generation_backend.name


def test_the_trainer_decodes_on_prepacked_weights_on_intel_cpus_or_when_asked(kit, tmp_path, monkeypatch):
    from rlhf_trainers.cpu import decoding as cpu_decoding
    from rlhf_trainers.cpu import lean_llama_steps, lean_llama_steps_prepacked

    assert cpu_decoding.cpu_vendor() in ("GenuineIntel", "AuthenticAMD")  # x86 Linux (CI's): cpuinfo says
    monkeypatch.setattr(cpu_decoding, "cpu_vendor", lambda: "GenuineIntel")
    on = _trainer(kit, tmp_path / "on")
    assert on.generation_backend.fast_steps is lean_llama_steps_prepacked
    assert "MKL-prepacked weights" in on.generation_backend.name
    monkeypatch.setattr(cpu_decoding, "cpu_vendor", lambda: "AuthenticAMD")
    asked = _trainer(kit, tmp_path / "asked", mkl_prepacked_decoding=True)
    assert asked.generation_backend.fast_steps is lean_llama_steps_prepacked
    for name, extra in (
        ("default elsewhere", {}),
        ("off", {"mkl_prepacked_decoding": False}),
        ("onednn", {"onednn_linear": True, "onednn_linear_min_weights": 0, "mkl_prepacked_decoding": True}),
    ):
        trainer = _trainer(kit, tmp_path / name, **extra)
        assert trainer.generation_backend.fast_steps is lean_llama_steps, name
        assert "MKL-prepacked" not in trainer.generation_backend.name, name


# ---- shared prompt pass (rows that repeat a prompt: RLOO's and GRPO's groups) -----------------------


def test_shared_prompt_rows_groups_equal_prompts_whatever_sits_under_the_padding():
    from rlhf_trainers.generation import shared_prompt_rows

    ids = torch.tensor([[0, 5, 6], [1, 2, 3], [9, 5, 6], [1, 2, 3], [7, 7, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    first, inverse = shared_prompt_rows(ids, mask)
    assert len(first) == 3  # rows 0 and 2 differ only under the padding; 1 and 3 are equal
    assert torch.equal(ids[first][inverse] * mask, ids * mask)
    assert torch.equal(mask[first][inverse], mask)
    assert inverse[0] == inverse[2] and inverse[1] == inverse[3] and len(set(inverse.tolist())) == 3
    assert shared_prompt_rows(ids[:2], mask[:2]) is None  # all distinct: nothing to share
    assert shared_prompt_rows(ids[:1], mask[:1]) is None


@pytest.fixture
def prompt_pass_rows(monkeypatch) -> list[int]:
    """The batch size of every forward call of the kit's causal LM classes."""
    from transformers import GPT2LMHeadModel, GPTNeoXForCausalLM, LlamaForCausalLM

    rows: list[int] = []
    for cls in (LlamaForCausalLM, GPT2LMHeadModel, GPTNeoXForCausalLM):
        real = cls.forward

        def recording(self, *args, _real=real, **kwargs):
            rows.append(kwargs["input_ids"].shape[0])
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "forward", recording)
    return rows


@pytest.mark.parametrize(("name", "lean"), [("llama-sft", True), ("llama-sft", False), ("gpt2", False)])
def test_repeated_prompts_run_their_prompt_pass_once_and_sample_as_the_full_pass_does(
    kit, prompts, prompt_pass_rows, name, lean
):
    """Groups of k = 3 copies of 4 prompts (k-major, as a trainer repeats them): the prompt pass runs on 4
    rows, and the samples (tokens, log-probs, entropies) are those of the pass over all 12 rows."""
    model = kit.load_model(name).eval()
    tok, ids, mask = prompts
    ids, mask = ids[:4].repeat(3, 1), mask[:4].repeat(3, 1)
    settings = SamplingSettings(
        max_new_tokens=10,
        temperature=0.9,
        pad_token_id=tok.pad_token_id,
        stop_token_ids=[tok.eos_token_id],
        return_logprobs=True,
    )
    runs = []
    for share in (True, False):
        prompt_pass_rows.clear()
        torch.manual_seed(11)
        steps = lean_llama_steps if lean else None
        runs.append(
            sample_with_kv_cache(
                model, ids, mask, settings, steps, share_prompt_pass=share, drop_finished_rows=False
            )
        )
        assert prompt_pass_rows[0] == (4 if share else 12)
        assert all(n == 12 for n in prompt_pass_rows[1:])  # decoding steps (model forward) on every row
    shared, full = runs
    _assert_same_samples(shared, full)
    assert not torch.equal(shared.tokens[:4], shared.tokens[4:8])  # the copies drew their own tokens


@pytest.mark.parametrize(
    ("name", "steps_kind"),
    [("llama-sft", "lean"), ("llama-sft", "prepacked"), ("llama-sft", "forward"), ("gpt2", "forward")],
)
def test_dropping_stopped_rows_samples_what_the_full_batch_samples(
    kit, prompts, prompt_pass_rows, monkeypatch, name, steps_kind
):
    """With ``drop_finished_rows`` the decoding steps run on fewer rows once a quarter have stopped (the
    cache shrinks with them), and the samples (tokens, log-probs, entropies) are those of the loop that
    runs every row to the end: the draws still consume the random numbers of all rows."""
    from rlhf_trainers.cpu import lean_llama as cpu_lean

    model = kit.load_model(name).eval()
    tok, ids, mask = prompts
    provider = {
        "lean": lean_llama_steps,
        "prepacked": cpu_lean.lean_llama_steps_prepacked,
        "forward": None,
    }[steps_kind]
    selected: list[int] = []
    select = cpu_lean.LeanLlamaSteps.select_rows

    def recording(self, index):
        selected.append(int(index.numel()))
        return select(self, index)

    monkeypatch.setattr(cpu_lean.LeanLlamaSteps, "select_rows", recording)
    # Stop tokens that some rows sample early (the kit models rarely sample EOS): the third tokens of
    # three rows of a run from the same seed.
    torch.manual_seed(7)
    unstopped = sample_with_kv_cache(model, ids, mask, SamplingSettings(3, tok.pad_token_id, 1.3))
    settings = SamplingSettings(
        max_new_tokens=24,
        temperature=1.3,
        pad_token_id=tok.pad_token_id,
        stop_token_ids=sorted({tok.eos_token_id, *unstopped.tokens[:3, 2].tolist()}),
        return_logprobs=True,
    )
    runs, rows_per_step = [], []
    for drop in (True, False):
        prompt_pass_rows.clear()
        torch.manual_seed(7)
        runs.append(sample_with_kv_cache(model, ids, mask, settings, provider, drop_finished_rows=drop))
        rows_per_step.append(list(prompt_pass_rows))
    dropped, full = runs
    _assert_same_samples(dropped, full)
    B = ids.shape[0]
    lengths = (full.tokens != tok.pad_token_id).sum(1)
    assert lengths.min() < full.tokens.shape[1] - 2  # rows stopped early: there was something to drop
    if steps_kind == "forward":
        assert all(n == B for n in rows_per_step[1])  # the full loop: every step on all B rows
        assert min(rows_per_step[0]) < B  # later steps ran on the rows still sampling
        assert rows_per_step[0] == sorted(rows_per_step[0], reverse=True)
    else:
        assert selected and selected == sorted(selected, reverse=True) and selected[-1] < B


def test_dropping_stopped_rows_keeps_the_draws_of_generate(policy, prompts):
    # torch.multinomial, the default draw, consumes the random numbers of every row it is given: the loop
    # gives it all rows' probabilities, so its tokens stay generate()'s for the same seed.
    tok, ids, mask = prompts
    torch.manual_seed(21)
    expected = _hf(policy, ids, mask, 24, 1.3, tok.pad_token_id, [tok.eos_token_id])
    torch.manual_seed(21)
    settings = SamplingSettings(
        max_new_tokens=24, temperature=1.3, pad_token_id=tok.pad_token_id, stop_token_ids=[tok.eos_token_id]
    )
    got = sample_with_kv_cache(policy, ids, mask, settings, lean_llama_steps)
    assert (expected == tok.eos_token_id).sum() >= ids.shape[0] // 4  # enough rows stopped to drop
    assert torch.equal(got.tokens, expected)
