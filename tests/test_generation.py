"""Generation behind one interface (``rlhf_trainers.generation``): each backend through the protocol (draws,
stop handling, log-probs, padding to ``max_new_tokens``), the choice made once at construction and named
in the batch accounting, and reward normalization sampling through the same interface."""

from __future__ import annotations

import contextlib

import pytest
import torch

from rlhf_trainers import functional as F
from rlhf_trainers import generation
from rlhf_trainers.generation import (
    BuiltinSampling,
    GenerationBackend,
    SamplingSettings,
    TransformersGenerate,
    draw_inverse_cdf,
    draw_multinomial,
    make_generation_backend,
)
from rlhf_trainers.generation.factory import backend_summary
from rlhf_trainers.onpolicy.forward import policy_logits

BACKENDS = {"builtin": BuiltinSampling, "transformers": TransformersGenerate}


def _settings(tok, n=12, temperature=0.7, stop=True, logprobs=False) -> SamplingSettings:
    return SamplingSettings(
        max_new_tokens=n,
        pad_token_id=tok.pad_token_id,
        temperature=temperature,
        stop_token_ids=[tok.eos_token_id] if stop else [],
        return_logprobs=logprobs,
    )


def _after_stop(tokens: torch.Tensor, stop_id: int) -> torch.Tensor:
    """(B, n) True at the positions after a row's first stop token."""
    hits = tokens == stop_id
    after = torch.zeros_like(hits)
    after[:, 1:] = hits.cumsum(1)[:, :-1] > 0
    return after


@pytest.mark.parametrize("stop", [False, True])
def test_both_backends_draw_the_same_tokens_for_a_seed(policy, prompts, stop):
    # Both sample softmax(logits / T) with the same torch.multinomial calls in the same order.
    tok, ids, mask = prompts
    settings = _settings(tok, stop=stop)
    draws = {}
    for name, cls in BACKENDS.items():
        backend = cls(policy)
        assert isinstance(backend, GenerationBackend)
        torch.manual_seed(3)
        draws[name] = backend.sample(ids, mask, settings).tokens
        assert draws[name].shape == (ids.shape[0], 12)  # padded to max_new_tokens
    assert torch.equal(draws["builtin"], draws["transformers"])
    if stop:
        after = _after_stop(draws["builtin"], tok.eos_token_id)
        assert after.any()  # some rows stopped early: their padding path ran
        assert (draws["builtin"][after] == tok.pad_token_id).all()


def test_inverse_cdf_draws_follow_the_distribution_and_never_an_excluded_token():
    """The CPU switch ``inverse_cdf_sampling``'s draws: each token as often as its probability says (the
    same distribution as torch.multinomial's, to sampling error), never one of probability 0, and
    reproducible from torch's seed. Rows are drawn in blocks of 16; 4,000 rows cross many blocks."""
    probs = torch.tensor([0.05, 0.0, 0.25, 0.0, 0.6, 0.1, 0.0])
    rows = probs.expand(4000, -1).contiguous()
    torch.manual_seed(0)
    drawn = draw_inverse_cdf(rows)
    assert drawn.shape == (4000,) and drawn.dtype == torch.long
    share = torch.bincount(drawn, minlength=7).double() / 4000
    assert (share[probs == 0] == 0).all()
    # within 4.5 standard errors of each probability (sqrt(p (1 - p) / n) <= 0.0078)
    assert (share - probs.double()).abs().max() < 0.035, share
    torch.manual_seed(1)
    by_multinomial = torch.bincount(draw_multinomial(rows), minlength=7).double() / 4000
    assert (share - by_multinomial).abs().max() < 0.05
    torch.manual_seed(0)
    assert torch.equal(draw_inverse_cdf(rows), drawn)  # the seed decides the draws
    # unnormalized rows (a sum of float32 probabilities is 1 only to rounding) draw by their shares
    torch.manual_seed(0)
    assert torch.equal(draw_inverse_cdf(rows * 3), drawn)


def test_inverse_cdf_draws_stay_on_nonzero_tokens_at_the_ends_and_refuse_nonfinite_rows(monkeypatch):
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0]])
    largest_below_one = 1.0 - 2.0**-53  # torch.rand's largest float64
    monkeypatch.setattr(
        torch, "rand", lambda *shape, **kw: torch.full(shape, largest_below_one, dtype=kw["dtype"])
    )
    assert draw_inverse_cdf(probs).tolist() == [2, 3]
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.zeros(shape, dtype=kw["dtype"]))
    assert draw_inverse_cdf(probs).tolist() == [1, 3]
    monkeypatch.undo()
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="inf or nan, or sums to zero"):
            draw_inverse_cdf(torch.tensor([[0.5, 0.5], [bad, 0.5]]))
    with pytest.raises(ValueError, match="sums to zero"):
        draw_inverse_cdf(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"shape \(B, V\); got \(3,\)"):
        draw_inverse_cdf(torch.ones(3))


def test_the_builtin_loop_with_inverse_cdf_draws_draws_other_tokens_than_generate(policy, prompts):
    """The price of the switch, stated in its help: for the same seed the loop no longer draws
    generate's tokens (it does with torch.multinomial, test_both_backends_draw_the_same_tokens_for_a_seed)."""
    tok, ids, mask = prompts
    settings = _settings(tok, stop=False)
    torch.manual_seed(3)
    inverse_cdf = BuiltinSampling(policy, draw=draw_inverse_cdf).sample(ids, mask, settings).tokens
    torch.manual_seed(3)
    generated = TransformersGenerate(policy).sample(ids, mask, settings).tokens
    assert inverse_cdf.shape == generated.shape and not torch.equal(inverse_cdf, generated)


@pytest.mark.parametrize("name", [*BACKENDS, "builtin, inverse-CDF draws"])
def test_logprobs_are_the_forward_pass_values_and_zero_after_a_stop(policy, prompts, name):
    tok, ids, mask = prompts
    torch.manual_seed(0)
    backend = (
        BuiltinSampling(policy, draw=draw_inverse_cdf) if name not in BACKENDS else BACKENDS[name](policy)
    )
    samples = backend.sample(ids, mask, _settings(tok, n=10, logprobs=True))
    tokens = samples.tokens
    assert samples.logprobs.shape == samples.entropy.shape == tokens.shape == (ids.shape[0], 10)
    assert samples.logprobs.dtype == samples.entropy.dtype == torch.float32
    after = _after_stop(tokens, tok.eos_token_id)
    assert after.any()
    keep = ~after
    full_mask = torch.cat([mask.bool(), keep], dim=1)
    full_ids = torch.cat([ids, tokens], dim=1).masked_fill(~full_mask, tok.pad_token_id)
    with torch.no_grad():
        logits = policy_logits(policy, full_ids, full_mask.long(), F.position_ids_from_mask(full_mask), 11)
    logprobs, entropy = F.logprobs_and_entropy_from_logits(logits[:, :-1], tokens, 0.7)
    torch.testing.assert_close(samples.logprobs[keep], logprobs[keep], atol=1e-5, rtol=0)
    torch.testing.assert_close(samples.entropy[keep], entropy[keep], atol=1e-4, rtol=0)
    assert (samples.logprobs[after] == 0).all() and (samples.entropy[after] == 0).all()


@pytest.mark.parametrize("name", list(BACKENDS))
def test_contexts_are_entered_around_each_call_and_the_mode_restored(kit, prompts, name):
    tok, ids, mask = prompts
    model = kit.load_model("llama-sft").train()
    seen = []

    @contextlib.contextmanager
    def context():
        seen.append(("enter", model.training))
        yield
        seen.append(("exit", model.training))

    backend = BACKENDS[name](model, contexts=(context, None))
    backend.sample(ids, mask, _settings(tok, n=3))
    backend.sample(ids, mask, _settings(tok, n=3))
    assert [event for event, _ in seen] == ["enter", "exit", "enter", "exit"]
    assert model.training  # sampled in eval mode, then restored


def test_the_factory_picks_a_backend_once_from_the_config(policy, tmp_path, monkeypatch):
    from rlhf_trainers import CPUOptions, RLOOConfig
    from rlhf_trainers.cpu import decoding as cpu_decoding
    from rlhf_trainers.cpu import decoding_speedups

    base = {"output_dir": str(tmp_path), "report_to": "none", "use_cpu": True}
    cpu = torch.device("cpu")

    def backend(options=None, synced_ranks=False, **fields):
        speedups = decoding_speedups(policy, options, device=cpu)
        return make_generation_backend(
            policy, RLOOConfig(**base, **fields), speedups=speedups, synced_ranks=synced_ranks
        )

    plain = make_generation_backend(policy)  # reward normalization: the builtin loop as it is
    assert type(plain) is BuiltinSampling and plain.name == "builtin" and plain.fast_steps is None
    assert make_generation_backend(policy, RLOOConfig(**base)).name == "builtin"  # no speedups given
    monkeypatch.setattr(cpu_decoding, "cpu_vendor", lambda: "GenuineIntel")
    builtin = backend()
    assert type(builtin) is BuiltinSampling and builtin.logprobs_for_rollout
    # On an Intel CPU with MKL's packed GEMM (x86 torch wheels): the lean steps on prepacked weights,
    # and inverse-CDF draws (on CPU only; torch.multinomial, generate's draws, where switched off).
    assert builtin.name == "builtin (lean Llama steps on MKL-prepacked weights, inverse-CDF draws)"
    assert builtin.fast_steps and builtin.draw is draw_inverse_cdf and builtin.drop_finished_rows
    assert plain.draw is draw_multinomial
    # Elsewhere (an AMD CPU, an unknown vendor) the default leaves the weights to MKL; True packs them.
    for vendor in ("AuthenticAMD", None):
        monkeypatch.setattr(cpu_decoding, "cpu_vendor", lambda vendor=vendor: vendor)
        default = backend()
        assert default.name == "builtin (lean Llama steps, inverse-CDF draws)", vendor
        forced = backend(CPUOptions(mkl_prepacked_decoding=True))
        assert forced.name == builtin.name, vendor
    unpacked = backend(CPUOptions(mkl_prepacked_decoding=False, inverse_cdf_sampling=False))
    assert unpacked.name == "builtin (lean Llama steps)" and unpacked.fast_steps is not None
    assert unpacked.draw is draw_multinomial
    no_lean = backend(CPUOptions(lean_decoding=False, inverse_cdf_sampling=False, drop_finished_rows=False))
    assert no_lean.name == "builtin" and no_lean.fast_steps is None and not no_lean.drop_finished_rows
    assert backend_summary(no_lean) == "builtin generation"
    assert backend_summary(unpacked) == "builtin generation, CPU speed-ups on (docs/cpu.md)"
    hf = backend(generation_loop="transformers")
    assert type(hf) is TransformersGenerate and hf.name == "transformers.generate"
    assert not hf.synced_ranks and not hf.logprobs_for_rollout
    # Multi-process ZeRO-3 without gathered weights: generate(synced_gpus=True) whatever the loop.
    synced = backend(synced_ranks=True)
    assert type(synced) is TransformersGenerate and synced.synced_ranks
    assert synced.name == "transformers.generate(synced_gpus)"

    class Unknown:
        generation_loop = "vllm"

    with pytest.raises(ValueError, match="generation_loop='vllm'"):
        make_generation_backend(policy, Unknown())


@pytest.mark.parametrize("loop", ["builtin", "transformers"])
def test_the_trainer_builds_its_backend_once_and_names_it(kit, tmp_path, monkeypatch, loop):
    from test_rloo import _trainer

    import rlhf_trainers.onpolicy.sampling as engine
    from rlhf_trainers.cpu import decoding as cpu_decoding

    built = []
    real = engine.make_generation_backend

    def counting(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(engine, "make_generation_backend", counting)
    monkeypatch.setattr(cpu_decoding, "cpu_vendor", lambda: "GenuineIntel")  # prepacked by default there
    trainer = _trainer(
        kit, tmp_path, train_n=16, rloo_k=2, response_length=6, max_steps=2, generation_loop=loop
    )
    calls = []
    real_sample = trainer.generation_backend.sample

    def sample(*args, **kwargs):
        calls.append(1)
        return real_sample(*args, **kwargs)

    trainer.generation_backend.sample = sample
    trainer.train()
    assert len(built) == 1 and trainer.generation_backend is built[0]
    assert len(calls) >= 2  # every rollout sampled through it
    expected = (
        "builtin (lean Llama steps on MKL-prepacked weights, inverse-CDF draws)"
        if loop == "builtin"
        else "transformers.generate"
    )
    assert trainer.generation_backend.name == expected
    # The batch accounting says it plainly: the loop, and whether CPU speed-ups are on (the name lists them).
    plain = "builtin generation, CPU speed-ups on (docs/cpu.md)" if loop == "builtin" else expected
    assert trainer.batch_accounting().endswith(f"; generation: {plain}.")
    assert "MKL" not in trainer.batch_accounting() and "inverse-CDF" not in trainer.batch_accounting()


def test_reward_normalization_samples_through_the_interface(kit, monkeypatch):
    from rlhf_trainers.generation import sample_completions

    policy = kit.load_model("llama-sft")
    tok = kit.load_tokenizer()
    prompts = list(kit.prompt_dataset("train", n=6)["prompt"])
    calls = []
    real = generation.BuiltinSampling.sample

    def spy(self, query_ids, query_mask, settings):
        calls.append(settings)
        return real(self, query_ids, query_mask, settings)

    def no_generate(*args, **kwargs):
        raise AssertionError("reward normalization sampled with its own generate() call")

    monkeypatch.setattr(generation.BuiltinSampling, "sample", spy)
    monkeypatch.setattr(type(policy), "generate", no_generate)
    torch.manual_seed(0)
    completions = sample_completions(policy, tok, prompts, response_length=8, temperature=0.9, batch_size=4)
    assert len(completions) == 6 and len(calls) == 2  # two batches of at most 4 prompts
    assert calls[0] == SamplingSettings(
        max_new_tokens=8, pad_token_id=tok.pad_token_id, temperature=0.9, stop_token_ids=[tok.eos_token_id]
    )


def test_the_vllm_weight_sync_streams_the_merged_weights(kit):
    """``VLLMColocated.sync_weights`` hands the engine a stream: each merged LoRA weight (a new tensor) is
    made when the engine reads it, so at most the one being read and the next are alive, never all of them
    (a list of them was a second copy of every adapted matrix). vLLM is replaced by a recording stand-in
    that loads like vLLM's in-process worker: one weight at a time, nothing kept."""
    import weakref

    from peft import LoraConfig, get_peft_model

    from rlhf_trainers.generation.vllm_colocated import VLLMColocated

    model = get_peft_model(
        kit.load_model("llama-sft"),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    owned = {p.untyped_storage().data_ptr() for p in model.parameters()}
    made: list[weakref.ref] = []  # the engine's tensors that are not the model's own (merged weights)
    alive_at_each_read: list[int] = []
    names: list[str] = []

    class Worker:
        def reload_weights(self, weights_iterator):
            for name, tensor in weights_iterator:
                names.append(name)
                if tensor.untyped_storage().data_ptr() not in owned:
                    made.append(weakref.ref(tensor))
                del tensor
                alive_at_each_read.append(sum(ref() is not None for ref in made))

        def get_model(self):
            return torch.nn.Module()

    class Engine:
        def collective_rpc(self, method, args=()):
            return [method(Worker(), *args)]

        def reset_prefix_cache(self):
            return True

    backend = object.__new__(VLLMColocated)  # the sync alone, without building an engine
    backend.model, backend.llm, backend.dtype = model, Engine(), torch.float32
    backend.weights_version = lambda: 0
    backend.sync_seconds, backend.syncs = 0.0, 0
    backend.sync_weights()

    layers = model.get_base_model().config.num_hidden_layers
    assert len(made) == 4 * layers >= 8  # every adapted projection arrived merged, as a tensor of its own
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert max(alive_at_each_read) <= 2, alive_at_each_read
    assert backend.syncs == 1
