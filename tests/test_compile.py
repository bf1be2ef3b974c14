"""``torch_compile=True`` on the on-policy trainers: the models' repeated blocks (decoder layers) compiled
for the engine's scoring and training passes only (:mod:`rlhf_trainers.compilation`), never for sampling,
and never left compiled on the user's models; the same updates as eager runs.

Most tests compile with a counting backend (registered below: it records each graph and runs it eager), so
they prove which calls went through compiled code without the inductor's C++ compilation; one slow test
runs the inductor end to end."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo import register_backend

from rlhf_trainers.compilation import CompiledBlocks, repeated_blocks
from tests import test_ppo, test_rloo

#: Graphs compiled by the "rlhf_test_counting" backend, their calls, and the calls with gradients on
#: (training passes).
CALLS = {"graphs": 0, "calls": 0, "training_calls": 0}


@register_backend(name="rlhf_test_counting")
def _counting_backend(graph_module, example_inputs):
    CALLS["graphs"] += 1

    def run(*args):
        CALLS["calls"] += 1
        CALLS["training_calls"] += torch.is_grad_enabled()
        return graph_module.forward(*args)

    return run


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch (no graph cached by an earlier test's models)."""
    torch._dynamo.reset()
    CALLS.update(graphs=0, calls=0, training_calls=0)
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("name", "block"),
    [("llama-sft", "LlamaDecoderLayer"), ("gpt2", "GPT2Block"), ("gpt_neox", "GPTNeoXLayer")],
)
def test_the_repeated_blocks_are_the_decoder_layers(kit, name, block):
    model = kit.load_model(name)
    blocks = repeated_blocks(model)
    assert blocks and {type(b).__name__ for b in blocks} == {block}
    assert len(blocks) == model.config.num_hidden_layers


def test_the_repeated_blocks_of_a_lora_model_and_a_value_model(kit, tmp_path):
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(kit.load_model("llama-sft"), LoraConfig(r=4, target_modules="all-linear"))
    assert [type(b).__name__ for b in repeated_blocks(lora)] == ["LlamaDecoderLayer"] * 2
    trainer = test_ppo._trainer(kit, tmp_path)
    assert len(repeated_blocks(trainer.value_model)) == trainer.value_model.config.num_hidden_layers


def test_compiled_blocks_run_compiled_only_inside_active(kit):
    model = kit.load_model("llama-sft").eval()
    compiled = CompiledBlocks([model], backend="rlhf_test_counting")
    ids = torch.randint(3, 50, (2, 7))
    with torch.no_grad():
        eager = model(ids).logits
        assert CALLS["calls"] == 0
        with compiled.active():
            inside = model(ids).logits
            calls = CALLS["calls"]
            assert calls > 0
            with compiled.paused():
                model(ids)
            assert CALLS["calls"] == calls  # paused: eager
        model(ids)
        assert CALLS["calls"] == calls  # outside: eager again
    torch.testing.assert_close(inside, eager)
    with pytest.raises(RuntimeError, match="inside"), compiled.active():
        raise RuntimeError("inside")
    assert all(block._compiled_call_impl is None for block in compiled.blocks)


def _counted_run(module, kit, tmp_path, compile_backend, **overrides):
    """A short run (compiled with ``compile_backend``, or eager for None): the trained trainer, and the
    compiled-graph calls made during each sampling call."""
    settings = dict(
        response_length=12,
        max_steps=2,
        num_mini_batches=2,
        per_device_train_batch_size=8,
        rollout_logprobs="forward",
    )
    settings.update(overrides)
    if compile_backend:
        settings.update(torch_compile=True, torch_compile_backend=compile_backend)
    trainer = module._trainer(kit, tmp_path, **settings)
    backend = trainer.generation_backend
    sample = backend.sample
    during_sampling = []

    def counted_sample(*args, **kwargs):
        before = CALLS["calls"]
        out = sample(*args, **kwargs)
        during_sampling.append(CALLS["calls"] - before)
        return out

    backend.sample = counted_sample
    trainer.train()
    return trainer, during_sampling


@pytest.mark.parametrize(
    ("algorithm", "extra"),
    [
        ("ppo", {}),
        ("rloo", {"rloo_k": 4}),
        ("ppo-lora", {}),
        ("ppo-rows", {"gradient_checkpointing": True}),
    ],
)
def test_a_compiled_run_gives_the_eager_runs_updates(kit, tmp_path, algorithm, extra):
    """The scoring and training passes go through the compiled blocks (packed in one row, or in rows under
    gradient checkpointing; LoRA with its reference pass through the disabled adapter); sampling does not;
    the updates are the eager run's; afterwards the models are eager (a user's generate() is not
    compiled) and accelerate compiled nothing of its own."""
    from peft import LoraConfig

    module = test_rloo if algorithm == "rloo" else test_ppo
    if algorithm == "ppo-lora":
        extra = {"peft_config": LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)}
    runs = {}
    for backend in ("rlhf_test_counting", None):
        trainer, during_sampling = _counted_run(module, kit, tmp_path / str(backend), backend, **extra)
        runs[backend] = (module._digest(trainer.policy), trainer.state.log_history)
        if backend:
            assert CALLS["graphs"] > 0 and CALLS["calls"] > CALLS["training_calls"] > 0
            assert during_sampling and not any(during_sampling)
            assert trainer._compiled is not None and len(trainer._compiled)
            assert all(block._compiled_call_impl is None for block in trainer._compiled.blocks)
            assert not isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    torch.testing.assert_close(runs["rlhf_test_counting"][0], runs[None][0], rtol=1e-4, atol=1e-5)
    compared = 0
    for a, b in zip(runs["rlhf_test_counting"][1], runs[None][1], strict=True):
        for key, value in a.items():
            if key.startswith(("objective/", "loss/", "policy/", "critic/")):
                assert value == pytest.approx(b[key], rel=1e-3, abs=1e-5), key
                compared += 1
    assert compared > 10


def test_evaluation_passes_are_compiled_and_its_sampling_is_not(kit, tmp_path):
    trainer, during_sampling = _counted_run(
        test_ppo,
        kit,
        tmp_path,
        "rlhf_test_counting",
        reward_model=kit.load_model("llama-seqcls"),
        max_steps=1,
    )
    before = CALLS["calls"]
    trainer.evaluate(kit.prompt_dataset("test", n=8))
    assert CALLS["calls"] > before  # the reward model's scoring pass
    assert not any(during_sampling)


@pytest.mark.slow
def test_the_inductor_compiles_a_ppo_run_that_matches_eager(kit, tmp_path):
    """The default backend end to end (C++ kernels generated and built on this machine)."""
    runs = {}
    for backend in ("inductor", None):
        trainer, _ = _counted_run(test_ppo, kit, tmp_path / str(backend), backend)
        runs[backend] = (test_ppo._digest(trainer.policy), trainer.state.log_history)
    torch.testing.assert_close(runs["inductor"][0], runs[None][0], rtol=1e-4, atol=1e-5)
    for a, b in zip(runs["inductor"][1], runs[None][1], strict=True):
        for key in ("loss/policy_avg", "loss/value_avg", "objective/kl"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-2, abs=1e-5), key
