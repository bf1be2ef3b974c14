"""No deprecation noise from our own code: short runs of each trainer (PPO, RLOO, GRPO, reward), the builtin
generation loop (lean steps and the model's own forward with its KV cache), ``generate``, LoRA, gradient
checkpointing and the example scripts, with every FutureWarning / DeprecationWarning recorded and every
warning logged by transformers or peft captured. A run fails on any of them that is not in
:data:`THIRD_PARTY` (each listed with the reason it is not ours to fix).

transformers logs many of its notes once per process (``warning_once``, an ``lru_cache``): its cache is
cleared before each run, so a note an earlier test in the same worker already logged is logged again.
"""

from __future__ import annotations

import contextlib
import logging
import re
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import fields

import pytest
import transformers
from transformers.utils import logging as hf_logging

from rlhf_trainers import (
    CPUOptions,
    GRPOConfig,
    GRPOTrainer,
    PPOConfig,
    PPOTrainer,
    RewardConfig,
    RewardTrainer,
    RLOOConfig,
    RLOOTrainer,
)
from rlhf_trainers.testing import true_reward

#: (message pattern, why it is not ours): warnings that third-party code raises on its own. Empty today;
#: DeepSpeed's "Setting accelerator to CPU" (its own logger, at import) is neither a Python warning nor
#: transformers' and is not seen here.
THIRD_PARTY: tuple[tuple[str, str], ...] = ()

LOGGERS = ("transformers", "peft")
CATEGORIES = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)


def _checkpointing() -> dict[str, bool]:
    """Gradient checkpointing on, by the name the installed transformers' TrainingArguments has (the old
    name ``gradient_checkpointing`` is deprecated where ``activation_checkpointing`` exists)."""
    names = {f.name for f in fields(transformers.TrainingArguments)}
    return {
        "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": True
    }


def _ours(stack: list[traceback.FrameSummary]) -> str:
    """The frames of this package and the examples in a warning's stack (where our code was)."""
    frames = [f for f in stack if "rlhf_trainers" in f.filename or "/examples/" in f.filename]
    return (
        " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in reversed(frames))
        or "no frame of ours"
    )


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"[{record.name}] {record.getMessage()} at {_ours(traceback.extract_stack())}")


@contextlib.contextmanager
def deprecation_noise() -> Iterator[list[str]]:
    """Collects, into the yielded list, every deprecation warning and every transformers/peft log warning
    raised inside the block, with where our code was when it came."""
    found: list[str] = []
    handler = _Capture()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    hf_logging.warning_once.cache_clear()
    loggers = [logging.getLogger(name) for name in LOGGERS]
    for logger in loggers:
        logger.addHandler(handler)

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, CATEGORIES):
            found.append(
                f"{category.__name__}: {message} ({filename}:{lineno}) at {_ours(traceback.extract_stack())}"
            )

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            yield found
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
        found.extend(handler.records)
        found[:] = [w for w in found if not any(re.search(p, w) for p, _ in THIRD_PARTY)]


def _onpolicy(kit, tmp_path, trainer_class, config_class, model="llama-sft", train=True, **kwargs):
    peft_config = kwargs.pop("peft_config", None)
    cpu_options = kwargs.pop("cpu_options", None)
    config = config_class(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        num_sample_generations=0,
        disable_tqdm=True,
        **kwargs,
    )
    trainer = trainer_class(
        model=kit.load_model(model),
        processing_class=kit.load_tokenizer(),
        args=config,
        train_dataset=kit.prompt_dataset("train", n=16),
        eval_dataset=kit.prompt_dataset("test", n=8),
        reward_funcs=true_reward,
        peft_config=peft_config,
        cpu_options=cpu_options,
    )
    trainer.train()
    trainer.evaluate()
    trainer.save_model(str(tmp_path / "saved"))


def _lora(task_type: str | None = None):
    from peft import LoraConfig

    extra = {"task_type": task_type} if task_type else {}
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, **extra)


RUNS = {
    # the builtin loop's lean Llama steps (its prompt pass reads the model output's cache)
    "ppo-builtin": lambda kit, tmp: _onpolicy(kit, tmp, PPOTrainer, PPOConfig, response_length=8),
    # the builtin loop through the model's forward with its KV cache, gradient checkpointing
    "rloo-forward-steps-checkpointing": lambda kit, tmp: _onpolicy(
        kit,
        tmp,
        RLOOTrainer,
        RLOOConfig,
        response_length=8,
        cpu_options=CPUOptions(lean_decoding=False),
        **_checkpointing(),
    ),
    # GPT-2 (not Llama: the forward's steps) through generate()
    "rloo-gpt2-generate": lambda kit, tmp: _onpolicy(
        kit, tmp, RLOOTrainer, RLOOConfig, model="gpt2", response_length=8, generation_loop="transformers"
    ),
    "grpo-lora-checkpointing": lambda kit, tmp: _onpolicy(
        kit,
        tmp,
        GRPOTrainer,
        GRPOConfig,
        max_completion_length=8,
        num_generations=4,
        beta=0.04,
        peft_config=_lora(),
        **_checkpointing(),
    ),
    "ppo-lora": lambda kit, tmp: _onpolicy(
        kit, tmp, PPOTrainer, PPOConfig, response_length=8, peft_config=_lora()
    ),
}


@pytest.mark.parametrize("run", sorted(RUNS))
def test_trainer_runs_raise_no_deprecation_warning(kit, tmp_path, run):
    with deprecation_noise() as found:
        RUNS[run](kit, tmp_path)
    assert not found, "\n".join(found)


def test_reward_trainer_with_lora_and_checkpointing_raises_no_deprecation_warning(kit, tmp_path):
    config = RewardConfig(
        output_dir=str(tmp_path / "rm"),
        per_device_train_batch_size=8,
        max_length=64,
        max_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        **_checkpointing(),
    )
    with deprecation_noise() as found:
        trainer = RewardTrainer(
            model=str(kit.model_path("llama-sft")),
            args=config,
            train_dataset=kit.preference_dataset("train").select(range(16)),
            eval_dataset=kit.preference_dataset("test").select(range(8)),
            peft_config=_lora("SEQ_CLS"),
        )
        trainer.train()
        trainer.evaluate()
        trainer.save_model(str(tmp_path / "saved"))
        # The adapter folder as an on-policy trainer's reward model (loaded through peft, merged).
        PPOTrainer(
            model=kit.load_model("llama-sft"),
            reward_model=str(tmp_path / "saved"),
            processing_class=kit.load_tokenizer(),
            args=PPOConfig(
                output_dir=str(tmp_path / "ppo"), response_length=8, use_cpu=True, report_to="none"
            ),
            train_dataset=kit.prompt_dataset("train", n=16),
        )
    assert not found, "\n".join(found)


QUIET = ["--use_cpu", "true", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]


def test_example_scripts_raise_no_deprecation_warning(kit, tmp_path):
    """examples/rlvr.py (LoRA on by default: the FutureWarning about ``is_gradient_checkpointing`` that
    peft's wrapping raised) and examples/ppo.py's code (``rlhf_trainers.scripts.ppo``) on the kit."""
    from test_rlvr import _load_example

    from rlhf_trainers.scripts import ppo as ppo_script

    rlvr = _load_example()
    rlvr_argv = ["--trainer", "rloo", "--model_name_or_path", str(kit.model_path("llama-sft"))]
    rlvr_argv += ["--output_dir", str(tmp_path / "rlvr"), "--max_steps", "1", "--num_eval_prompts", "4"]
    rlvr_argv += ["--per_device_train_batch_size", "8", "--response_length", "6", *QUIET]
    ppo_argv = ["--output_dir", str(tmp_path / "ppo"), "--max_steps", "1", "--num_sample_generations", "0"]
    ppo_argv += ["--per_device_train_batch_size", "8", "--num_mini_batches", "1", "--num_ppo_epochs", "1"]
    ppo_argv += ["--max_eval_samples", "8", *QUIET]
    with deprecation_noise() as found:
        rlvr.main(rlvr_argv)
        ppo_script.main(ppo_argv)
    assert not found, "\n".join(found)


def test_the_check_sees_a_deprecation_warning_and_a_transformers_note():
    """The capture itself: a FutureWarning and a once-per-process transformers note logged before."""
    logger = hf_logging.get_logger("transformers.test_warnings")
    logger.warning_once("an earlier note")
    with deprecation_noise() as found:
        warnings.warn("old name", FutureWarning, stacklevel=1)
        logger.warning_once("an earlier note")
    assert len(found) == 2, found
    assert found[0].startswith("FutureWarning: old name") and "an earlier note" in found[1]
