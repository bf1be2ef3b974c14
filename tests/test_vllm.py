"""``use_vllm=True``: generation by a colocated vLLM engine (rlhf_trainers.generation.vllm_colocated).

These tests need vLLM. Where the test interpreter has none (the main environment: vLLM's CPU build pins
another transformers), ``tests/test_vllm_env.py`` runs this module in the vLLM environment that
:func:`rlhf_trainers.testing.vllm_env.vllm_python` builds, so the README's test command runs them on any
machine. The policy is the kit's ``llama-hd32-sft`` (head size 32: vLLM's CPU attention refuses 16).
"""

from __future__ import annotations

import pytest
import torch
from test_ppo import _config as ppo_config
from test_rloo import LEARN as RLOO_LEARN
from test_rloo import StopAt
from test_rloo import _config as rloo_config

from rlhf_trainers import PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer
from rlhf_trainers.onpolicy.forward import response_logprobs
from rlhf_trainers.testing import true_reward

pytestmark = pytest.mark.vllm

POLICY = "llama-hd32-sft"
#: LoRA on attention and on the lm head, which the kit model ties to its input embedding.
LORA_TARGETS = ["q_proj", "v_proj", "lm_head"]
LEARN = {k: v for k, v in RLOO_LEARN.items() if k != "rloo_k"}  # the kit-learning settings, both trainers
#: A learning run: 25 updates on 512 training prompts, evaluated on 96 held-out ones.
LEARNING_RUN = {"train_n": 512, "eval_n": 96, "max_steps": 25, **LEARN}


def _config(cls, tmp_path, **overrides):
    """The PPO/RLOO test modules' small config (rloo_k 4 for RLOO) with use_vllm=True."""
    if cls is RLOOConfig:
        overrides.setdefault("rloo_k", 4)
        return rloo_config(tmp_path, use_vllm=True, **overrides)
    return ppo_config(tmp_path, use_vllm=True, **overrides)


def _trainer(kit, tmp_path, trainer_cls=RLOOTrainer, *, train_n=64, eval_n=None, model=POLICY, **kwargs):
    config_cls = RLOOConfig if trainer_cls is RLOOTrainer else PPOConfig
    trainer_kwargs = {
        k: kwargs.pop(k) for k in list(kwargs) if k in ("reward_model", "peft_config", "callbacks")
    }
    # The hidden true reward: the reward, or, beside a reward model, logged only (weight 0).
    trainer_kwargs["reward_funcs"] = [true_reward]
    if "reward_model" in trainer_kwargs:
        kwargs["reward_weights"] = [1.0, 0.0]
    return trainer_cls(
        model=kit.load_model(model) if isinstance(model, str) else model,
        processing_class=kit.load_tokenizer(),
        args=_config(config_cls, tmp_path, **kwargs),
        train_dataset=kit.prompt_dataset("train", n=train_n),
        eval_dataset=kit.prompt_dataset("test", n=eval_n) if eval_n else None,
        **trainer_kwargs,
    )


def _forward_logprobs(trainer, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    mask = torch.ones_like(ids, dtype=torch.bool)
    positions = torch.arange(ids.shape[1])[None, :]
    with torch.no_grad():
        logprobs, _ = response_logprobs(
            trainer.policy,
            ids,
            mask,
            positions,
            torch.tensor([completion]),
            trainer.passes.logprob_options(),
            fused_head=trainer.passes.fused_policy,
        )
    return logprobs[0].float()


def _one_step_trainer_and_completion(kit, tmp_path):
    """An RLOO trainer whose one update moves the policy visibly (lr 3e-2), and a fixed prompt and
    completion (token ids) to score before and after it."""
    trainer = _trainer(kit, tmp_path, learning_rate=3e-2, max_steps=1)
    tok = kit.load_tokenizer()
    prompt = tok("the movie was", add_special_tokens=False)["input_ids"]
    completion = tok(" really great and warm .", add_special_tokens=False)["input_ids"]
    return trainer, prompt, completion


# ---- the engine follows the policy ----------------------------------------------------------------


def test_weight_sync_makes_vllm_score_like_the_updated_policy(kit, tmp_path):
    """After an update, vLLM's log-probs of a fixed completion equal the trainer's forward pass (fp32)
    and differ from the ones before the update: the weights reached the engine (the tied embedding too)."""
    trainer, prompt, completion = _one_step_trainer_and_completion(kit, tmp_path)
    backend = trainer.generation_backend
    before_vllm = backend.completion_logprobs([prompt], [completion])[0]
    before_forward = _forward_logprobs(trainer, prompt, completion)
    torch.testing.assert_close(before_vllm, before_forward, atol=1e-4, rtol=0)
    embedding_before = trainer.policy.get_input_embeddings().weight.detach().clone()

    trainer.train()
    assert not torch.equal(trainer.policy.get_input_embeddings().weight, embedding_before)
    assert backend.is_stale()
    after_vllm = backend.completion_logprobs([prompt], [completion])[0]
    assert not backend.is_stale()
    after_forward = _forward_logprobs(trainer, prompt, completion)
    torch.testing.assert_close(after_vllm, after_forward, atol=1e-4, rtol=0)
    assert (after_vllm - before_vllm).abs().max() > 1e-2
    assert trainer.state.log_history[0]["timing/weight_sync"] >= 0


@pytest.mark.parametrize(
    "adapter",
    [
        {"target_modules": LORA_TARGETS},
        {"target_modules": ["q_proj", "o_proj", "embed_tokens"], "use_dora": True},
    ],
    ids=["lora-tied-head", "dora-tied-embedding"],
)
def test_lora_adapter_is_merged_into_the_engine(kit, tmp_path, adapter):
    """The adapter reaches the engine merged into the base weights, the one on the tied lm head or input
    embedding too (the engine is built untied for it), DoRA's magnitudes included: after an update vLLM
    scores like the trainer."""
    from peft import LoraConfig

    peft_config = LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM", **adapter)
    trainer = _trainer(kit, tmp_path, learning_rate=5e-2, max_steps=1, peft_config=peft_config)
    tok = kit.load_tokenizer()
    prompt = tok("my day was", add_special_tokens=False)["input_ids"]
    completion = tok(" so sweet and kind .", add_special_tokens=False)["input_ids"]
    before = trainer.generation_backend.completion_logprobs([prompt], [completion])[0]
    trainer.train()
    after = trainer.generation_backend.completion_logprobs([prompt], [completion])[0]
    torch.testing.assert_close(after, _forward_logprobs(trainer, prompt, completion), atol=1e-4, rtol=0)
    assert (after - before).abs().max() > 1e-2


# ---- sampling -------------------------------------------------------------------------------------


def test_sampling_follows_the_settings_and_the_torch_seed(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, response_length=10, temperature=0.7)
    batch = trainer.producer.prompt_batch(0)

    def sample(seed):
        torch.manual_seed(seed)
        return trainer.producer.sample(batch, copies=4, with_logprobs=True)

    # On CPU the engine's KV blocks are 32 tokens with the prefix cache on, so that a group's copies of a
    # prompt (below: 4) share its whole blocks (vLLM's CPU default, 128, left prompts this short unshared);
    # the copies' draws stay independent (checked below).
    cache = trainer.generation_backend.llm.llm_engine.vllm_config.cache_config
    assert (cache.block_size, cache.enable_prefix_caching) == (32, True)
    first, again, other = sample(1), sample(1), sample(2)
    assert torch.equal(first.response, again.response)  # reproducible from torch's seed
    assert not torch.equal(first.response, other.response)
    b = batch["input_ids"].shape[0]
    copies = first.response.reshape(4, b, -1)
    assert any(not torch.equal(copies[0, i], copies[j, i]) for i in range(b) for j in range(1, 4))
    assert first.response.shape == (4 * b, 10)
    eos = kit.load_tokenizer().eos_token_id
    pad = kit.load_tokenizer().pad_token_id
    for row, length in zip(first.response, first.lengths, strict=True):
        if length < 10:
            assert row[length - 1] == eos  # stopped at the stop token, kept it
            assert (row[length:] == pad).all()
        assert (row[: length - 1] != eos).all()
    # vLLM's log-probs are those of softmax(logits / temperature), as the trainer's forward computes them.
    passes = trainer.passes.logprobs(first)
    mask = first.response_mask
    torch.testing.assert_close(first.generation_logprobs[mask], passes.logprobs[mask], atol=1e-4, rtol=0)


def test_top_k_top_p_restrict_vllms_draws_and_its_processed_logprobs(kit, tmp_path):
    """With top-k / top-p, vLLM's processed log-probs are those of the restricted, renormalized
    distribution: at least the trained (unrestricted) ones on every sampled token, so the importance
    weights pi_train / pi_vllm are at most 1 (docs/generation.md)."""
    trainer = _trainer(kit, tmp_path, response_length=10, temperature=0.7, top_k=5, top_p=0.6)
    torch.manual_seed(1)
    samples = trainer.producer.sample(trainer.producer.prompt_batch(0), copies=4, with_logprobs=True)
    passes = trainer.passes.logprobs(samples)
    mask = samples.response_mask
    gap = (samples.generation_logprobs - passes.logprobs)[mask]
    assert gap.min() > -1e-4 and gap.mean() > 0.1, (gap.min(), gap.mean())


def test_building_the_engine_leaves_the_process_as_it_was(kit):
    """vLLM seeds the global generators and, on CPU, replaces torch.set_num_threads; both are undone."""
    import random

    from rlhf_trainers.generation.vllm_colocated import VLLMColocated

    torch.manual_seed(123)
    random.seed(5)
    state, python_state = torch.random.get_rng_state(), random.getstate()
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    backend = VLLMColocated(kit.load_model(POLICY), weights_version=lambda: 0, max_model_len=64, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert random.getstate() == python_state
    assert torch.set_num_threads is set_num_threads
    assert torch.get_num_threads() == threads
    assert backend.syncs == 1 and not backend.is_stale()


def test_a_rollout_larger_than_one_engine_step_samples(kit):
    """More prompt tokens than the engine schedules in one step (here 64 prompts of ~200 tokens): the
    prompts are prefilled whole over several steps, never in chunks (a chunked seeded request made vLLM's
    CPU worker fail with "CPU Generator does not use offset")."""
    from rlhf_trainers.generation import SamplingSettings
    from rlhf_trainers.generation.vllm_colocated import VLLMColocated

    tok = kit.load_tokenizer()
    backend = VLLMColocated(kit.load_model(POLICY), weights_version=lambda: 0, max_model_len=256)
    text = " ".join(kit.corpus(40))
    ids = tok([text] * 64, return_tensors="pt", truncation=True, max_length=200)
    assert ids["input_ids"].numel() > 8192
    settings = SamplingSettings(max_new_tokens=8, pad_token_id=tok.pad_token_id, return_logprobs=True)
    samples = backend.sample(ids["input_ids"], ids["attention_mask"], settings)
    assert samples.tokens.shape == (64, 8)
    assert len({tuple(row.tolist()) for row in samples.tokens}) > 1  # per-request seeds


# ---- learning -------------------------------------------------------------------------------------


def _learns(trainer, min_gain):
    before = trainer.evaluate()["eval_objective/scores/true_reward"]
    trainer.train()
    after = trainer.evaluate()["eval_objective/scores/true_reward"]
    assert after - before >= min_gain, (before, after)
    logged = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in h]
    assert logged, "no mismatch metrics logged"
    # fp32: vLLM samples from the trained distribution up to kernel rounding.
    assert max(h["sampling/sampling_logp_difference/max"] for h in logged) < 1e-3
    assert all(abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3 for h in logged)
    return before, after


def test_rloo_learns_with_a_reward_function(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, rloo_k=4, **LEARNING_RUN)
    _learns(trainer, 0.5)


def test_vllms_logprobs_as_the_old_ones_spare_the_policy_pass_and_training_learns(kit, tmp_path):
    """rollout_logprobs='generation' (verl's bypass mode): the rollout's log-probs are vLLM's, so the rollout
    runs no forward pass of the policy and the loss no separate importance weights (the clipped ratio is
    taken against vLLM's distribution); the mismatch metrics come from the first mini-batch's training
    pass, small in fp32; PPO (with its value model) learns. (RLOO in this mode: the 2-rank DDP launch
    below.)"""
    trainer = _trainer(kit, tmp_path, PPOTrainer, rollout_logprobs="generation", **LEARNING_RUN)
    assert trainer.vllm_logprobs_are_old
    calls = []
    hook = trainer.policy.register_forward_hook(lambda *_: calls.append(1))
    try:
        rollout = trainer.rollout(trainer.producer.prompt_batch(0))
    finally:
        hook.remove()
    assert not calls, "the rollout ran the policy's forward pass"
    mask = rollout.response_mask
    assert mask.any()
    assert torch.equal(rollout.logprobs[mask], rollout.generation_logprobs[mask])
    assert rollout.entropy is None and rollout.sampling_weights is None

    before = trainer.evaluate()["eval_objective/scores/true_reward"]
    trainer.train()
    after = trainer.evaluate()["eval_objective/scores/true_reward"]
    assert after - before >= 0.5, (before, after)
    logged = [h for h in trainer.state.log_history if "timing/step" in h]
    assert all(h["timing/policy"] == 0.0 for h in logged)
    assert all("sampling/importance_sampling_ratio/mean" not in h for h in logged)
    # fp32: the first mini-batch's training pass scores vLLM's samples as vLLM did, up to kernel rounding
    assert all(0 < h["sampling/sampling_logp_difference/max"] < 1e-3 for h in logged)
    assert all(h["policy/ratio_at_start"] < 1e-3 for h in logged)


def grpo_trainer(kit, tmp_path, **overrides):
    """A GRPOTrainer with use_vllm on the kit's learning task (48 optimizer steps, 512 prompts, 96 held out);
    ``overrides`` go to its GRPOConfig (e.g. vllm_mode='server')."""
    from rlhf_trainers import GRPOConfig, GRPOTrainer

    settings = dict(
        output_dir=str(tmp_path / "grpo"),
        use_vllm=True,
        num_generations=4,
        per_device_train_batch_size=16,
        steps_per_generation=2,
        num_iterations=2,
        max_completion_length=12,
        learning_rate=2e-3,
        max_steps=48,
        logging_steps=4,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        num_sample_generations=0,
        disable_tqdm=True,
    )
    return GRPOTrainer(
        model=kit.load_model(POLICY),
        reward_funcs=true_reward,
        args=GRPOConfig(**{**settings, **overrides}),
        train_dataset=kit.prompt_dataset("train", n=512),
        eval_dataset=kit.prompt_dataset("test", n=96),
        processing_class=kit.load_tokenizer(),
    )


def test_grpo_learns_with_vllm(kit, tmp_path):
    """GRPOTrainer on the same engine: use_vllm works as for PPO and RLOO (TRL's names, a step is an
    optimizer step; the vLLM importance weights reach GRPO's loss)."""
    _learns(grpo_trainer(kit, tmp_path), 0.3)


def test_ppo_learns_with_a_reward_model(kit, tmp_path, reward_model_dir):
    trainer = _trainer(kit, tmp_path, PPOTrainer, reward_model=str(reward_model_dir), **LEARNING_RUN)
    rm_before = trainer.evaluate()["eval_objective/scores/reward_model"]
    _learns(trainer, 0.5)
    assert trainer.evaluate()["eval_objective/scores/reward_model"] > rm_before


def test_ppo_learns_with_lora(kit, tmp_path):
    """A LoRA adapter, on the tied lm head too (the engine then holds the merged head as a weight of its
    own), learns; vLLM samples from the merged policy at every update. (Without an adapter on the tiny
    model's lm head LoRA barely moves it, with either generation backend.)"""
    from peft import LoraConfig

    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    trainer = _trainer(kit, tmp_path, PPOTrainer, peft_config=peft_config, **LEARNING_RUN)
    _learns(trainer, 0.5)


# ---- resume ---------------------------------------------------------------------------------------


def test_resumed_run_logs_the_same_metrics_as_an_uninterrupted_one(kit, tmp_path):
    """vLLM's samples follow torch's generator, which the checkpoint restores: a run interrupted after
    update 2 and resumed logs updates 3 and 4 as the uninterrupted run does."""
    settings = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "learning_rate": 5e-3, "seed": 3}
    full = _trainer(kit, tmp_path / "full", PPOTrainer, **settings)
    full.train()
    interrupted = _trainer(kit, tmp_path / "part", PPOTrainer, callbacks=[StopAt(2)], **settings)
    interrupted.train()
    assert interrupted.state.global_step == 2
    resumed = _trainer(kit, tmp_path / "part", PPOTrainer, **settings)
    resumed.train(resume_from_checkpoint=True)

    def update(trainer, step):
        return next(h for h in trainer.state.log_history if h.get("step") == step and "objective/kl" in h)

    for step in (3, 4):
        a, b = update(full, step), update(resumed, step)
        for key in (
            "objective/scores",
            "objective/kl",
            "val/response_length",
            "loss/policy_avg",
            "loss/value_avg",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (step, key, a[key], b[key])


# ---- faults ---------------------------------------------------------------------------------------


def test_an_interrupted_weight_sync_is_redone_in_full(kit, tmp_path, monkeypatch):
    """A sync that fails half-way (here: the weight stream raises after half of the tensors) is an error
    naming the sync, and the engine never samples from the mix of old and new weights it was left with: the
    next generation syncs every weight again, after which vLLM scores like the trainer's forward."""
    from rlhf_trainers.generation import GenerationError, vllm_colocated

    trainer, prompt, completion = _one_step_trainer_and_completion(kit, tmp_path)
    backend = trainer.generation_backend
    before = backend.completion_logprobs([prompt], [completion])[0]
    trainer.train()  # the policy moved; the engine still holds the weights of before
    assert backend.is_stale()

    streamed = []
    full_stream = vllm_colocated.inference_weights

    def half_then_fail(model):
        weights = list(full_stream(model))
        for name, tensor in weights[: len(weights) // 2]:
            streamed.append(name)
            yield name, tensor
        raise OSError("the connection to the engine dropped")

    monkeypatch.setattr(vllm_colocated, "inference_weights", half_then_fail)
    query = torch.tensor([prompt])
    with pytest.raises(GenerationError, match=r"(?s)while syncing the policy's weights.*dropped"):
        trainer.sampler.generate(query, torch.ones_like(query))
    assert streamed and backend.is_stale()  # half of the weights went in; the engine still counts as stale
    monkeypatch.setattr(vllm_colocated, "inference_weights", full_stream)
    after = backend.completion_logprobs([prompt], [completion])[0]
    torch.testing.assert_close(after, _forward_logprobs(trainer, prompt, completion), atol=1e-4, rtol=0)
    assert (after - before).abs().max() > 1e-2


def test_an_engine_dying_mid_run_saves_the_last_complete_update(kit, tmp_path):
    """vLLM failing at the third update's generation: the error names the engine and the cause, the second
    update is in checkpoint-2 (save_strategy='no' notwithstanding: save_on_interrupt), and a resumed run
    trains the remaining updates from it."""
    from transformers import TrainerCallback

    from rlhf_trainers.generation import GenerationError

    class KillEngineAfter(TrainerCallback):
        def __init__(self, step):
            self.step = step

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == self.step:

                def dead(*args, **kwargs):
                    raise RuntimeError("EngineCore encountered an issue (simulated: worker killed)")

                trainer.generation_backend.llm.generate = dead

    settings = {"max_steps": 4, "learning_rate": 5e-3, "seed": 3}
    trainer = _trainer(kit, tmp_path, callbacks=[KillEngineAfter(2)], **settings)
    with pytest.raises(GenerationError) as raised:
        trainer.train()
    message = str(raised.value)
    assert "vLLM engine failed while generating" in message and "worker killed" in message
    assert "step 2" in message and "resume_from_checkpoint" in message
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").is_file()
    resumed = _trainer(kit, tmp_path, **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4


def test_fewer_completions_than_prompts_is_an_error(kit, tmp_path):
    """An engine that answers fewer requests than it was sent (it dropped some) is an error naming what was
    asked and returned, not a batch silently short of rows; nothing completed, so nothing is saved."""
    from rlhf_trainers.generation import GenerationError

    trainer = _trainer(kit, tmp_path, max_steps=1)
    llm = trainer.generation_backend.llm
    generate = llm.generate
    llm.generate = lambda *args, **kwargs: generate(*args, **kwargs)[:-1]
    with pytest.raises(GenerationError, match=r"(?s)returned 7 completions for 8 prompts.*nothing to save"):
        trainer.train()


# ---- memory over a run ----------------------------------------------------------------------------


def test_memory_does_not_grow_over_a_run_with_vllm(tmp_path):
    """A shorter form of ``benchmarks/long_run_memory.py --vllm`` (200 updates, within 5 %): 60 RLOO updates
    that sync the weights into the engine and generate with it every update, a checkpoint every 15; the
    second half's peak RSS within 10 % of the first half's."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "long_run_memory.py"
    cmd = [
        sys.executable,
        str(script),
        "--trainer",
        "rloo",
        "--vllm",
        "--updates",
        "60",
        "--save-steps",
        "15",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=900, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "long_run_memory_rloo_vllm.json").read_text())
    assert report["vllm"] and len(report["rss_mib"]) == 60
    assert report["ratio"] < 1.10, report


# ---- several processes -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("trainer", "deepspeed", "lora"),
    # DDP with LoRA and ZeRO-3 with full weights: the sync's two sources (the adapter merged in, the
    # shards gathered); a full-weight DDP launch (the single-process sync under DDP's wrapper, also
    # the LoRA launch's path) was dropped to keep CI's time.
    # the DDP launch also takes vLLM's log-probs as the rollout's (rollout_logprobs='generation': its
    # mismatch metrics are reduced over the ranks inside the update), the ZeRO-3 one recomputes them
    [
        ("rloo", None, True),
        pytest.param("ppo", "zero3", False, marks=pytest.mark.deepspeed),
    ],
    ids=["rloo-ddp-lora-vllm-logprobs", "ppo-zero3"],
)
def test_one_engine_per_process_learns_and_the_ranks_agree(tmp_path, trainer, deepspeed, lora):
    """2 CPU ranks, each with its own engine synced from its own policy (ZeRO-3: the shards gathered
    module by module; LoRA: the adapter merged into the synced weights): the task is learned, both ranks end
    with the same weights, the engines sample from the trained weights at every update, and the launch
    exits cleanly (vLLM's shutdown at exit used to fail after the process group was torn down)."""
    from distributed import check_launch, deepspeed_available, read_rank_results, run_script

    if deepspeed and not deepspeed_available():
        pytest.fail("DeepSpeed is not installed in the vLLM test environment")
    updates = 15
    out = tmp_path / "run"
    args = ["--output_dir", out, "--trainer", trainer, "--max_steps", updates, "--num_eval_prompts", 64]
    if lora:  # the adapter learns at a higher rate than full weights (tests/test_rloo_distributed.py)
        args += ["--lora", "--learning_rate", "5e-3"]
    vllm_logprobs = deepspeed is None
    if vllm_logprobs:
        args += ["--rollout_logprobs", "generation"]
    # accelerate launch: vLLM's engine and its shutdown at exit in fresh interpreters of the vLLM env
    run_script("vllm_distributed.py", args, deepspeed=deepspeed, timeout=900, launcher="accelerate")
    results = read_rank_results(out)
    check_launch(results, deepspeed, updates)
    rank0, rank1 = results
    assert rank0["policy_digest"] == rank1["policy_digest"] != rank0["policy_before"]
    before = rank0["metrics_before"]["eval_objective/scores"]
    after = rank0["metrics"]["eval_objective/scores"]
    assert after - before >= 0.3, (before, after)
    for r in results:
        # At construction, before every update after the first, before the last evaluation; DDP's start
        # (parameters broadcast in place) may add one.
        assert updates + 1 <= r["syncs"] <= updates + 2, r["syncs"]
        assert max(r["logp_diff_max"]) < 1e-3
        if vllm_logprobs:  # no policy forward pass, no separate importance weights
            assert set(r["policy_seconds"]) == {0.0} and "is_ratio_mean" not in r
            assert min(r["logp_diff_max"]) > 0  # measured in the first mini-batch's training pass
        else:
            assert all(abs(x - 1) < 1e-3 for x in r["is_ratio_mean"])


# ---- bad input ------------------------------------------------------------------------------------


def test_an_engine_without_memory_is_refused_at_construction_naming_the_memory_settings(
    kit, tmp_path, monkeypatch
):
    """vLLM failing to start for lack of memory (its KV cache does not fit; simulated, since the kit model
    fits anywhere): the error carries vLLM's message and names the memory settings, not the head size."""
    import vllm

    def no_memory(*args, **kwargs):
        raise ValueError("No available memory for the cache blocks. Try increasing the KV cache space.")

    monkeypatch.setattr(vllm, "LLM", no_memory)
    with pytest.raises(RuntimeError) as raised:
        _trainer(kit, tmp_path)
    message = str(raised.value)
    assert "No available memory for the cache blocks" in message
    assert "ran out of memory" in message and "vllm_kv_cache_space_gib" in message
    assert "head size (its CPU attention" not in message


def test_a_head_size_vllm_cannot_run_is_refused_at_construction(kit, tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)head size 16.*use_vllm=False"):
        _trainer(kit, tmp_path, model="llama-sft")


def test_a_context_longer_than_the_engine_is_refused_at_construction(kit, tmp_path):
    with pytest.raises(ValueError, match="exceeds the vLLM engine's context of 10 tokens"):
        _trainer(kit, tmp_path, vllm_max_model_length=10)
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        _trainer(kit, tmp_path, vllm_max_model_length=1000)
