"""Train a policy with PPO (PPOTrainer): a reward model and/or a reward function, a value model, KL to a
reference policy.

On the offline kit (no model or dataset arguments: the kit's tiny SFT Llama, its synthetic prompts, and
its hidden sentiment reward ``rlhf_trainers.testing.true_reward`` as the reward function):

    python examples/ppo.py --output_dir runs/ppo --max_steps 20 --use_cpu
    accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml examples/ppo.py \\
        --output_dir runs/ppo --max_steps 20

On the kit the script uses settings that learn in seconds, unless the flag is given:
``--learning_rate 2e-3 --response_length 12 --temperature 1.0 --per_device_train_batch_size 16
--num_mini_batches 2 --num_ppo_epochs 2``. The eval prompts' mean true reward goes from about 0 to
about 0.97 in 20 updates (10 s on 2 CPU cores). LoRA on the kit needs the output head adapted too:
``--use_peft --lora_target_modules q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head
--learning_rate 5e-3``.

On a Hub model, reward model and prompt dataset (with LoRA on the policy; the reference is the same
weights with the adapter disabled):

    accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml examples/ppo.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --reward_model_name_or_path <a one-label sequence-classification model> \\
        --dataset_name trl-lib/tldr --dataset_train_split train --dataset_test_split validation \\
        --use_peft --lora_r 16 --learning_rate 1e-5 --per_device_train_batch_size 8 \\
        --gradient_accumulation_steps 4 --response_length 128 --bf16 --output_dir runs/qwen-ppo

The prompts come from a ``prompt`` column (text or chat messages), a ``messages`` column or
``input_ids`` (``--prompt_column`` renames another column to ``prompt``); the other columns are passed to
reward functions. ``--dataset_name`` is a Hub id, a folder saved with ``Dataset.save_to_disk``, or a
.json/.jsonl/.csv/.parquet file.

Every PPOConfig (and TrainingArguments) field is a flag: ``--help`` lists them. The model (the policy at
the root of ``--output_dir``, the value model in ``value_model/``) is saved at the end.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer, HfArgumentParser

from rlhf_trainers import PPOConfig, PPOTrainer

#: PPOConfig values for the offline kit (tiny model, short synthetic task), used when the flag is not given.
KIT_DEFAULTS = {
    "learning_rate": 2e-3,
    "response_length": 12,
    "temperature": 1.0,
    "per_device_train_batch_size": 16,
    "num_mini_batches": 2,
    "num_ppo_epochs": 2,
}


@dataclass
class ScriptArguments:
    """What to train on. Left empty, the offline kit's model, prompts and hidden reward are used."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Policy (a causal LM): path or Hub id. Default: the kit's llama-sft."}
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Reward model (a one-label sequence-classification model, e.g. saved by "
            "examples/reward_modeling.py): path or Hub id. Its own tokenizer is used when its folder has one. "
            "None: the reward function true_reward only."
        },
    )
    use_true_reward: bool | None = field(
        default=None,
        metadata={
            "help": "Also score with rlhf_trainers.testing.true_reward (the kit's hidden sentiment rule). "
            "Default: only when there is no reward model."
        },
    )
    value_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Value model: path or Hub id. None: built per --value_model_init."},
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Prompt dataset: Hub id, save_to_disk folder, or .json/.jsonl/.csv/.parquet file. "
            "Default: the kit's prompts."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str | None = field(
        default="test", metadata={"help": "Split to evaluate on; skipped when the dataset has no such split."}
    )
    prompt_column: str = field(
        default="prompt", metadata={"help": "Column holding the prompts (renamed to 'prompt')."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N prompts."})
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Evaluate on only the first N prompts."}
    )
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter on the policy."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: str = field(
        default="all-linear",
        metadata={
            "help": "LoRA target modules: 'all-linear' (every linear layer but the output head) or a "
            "comma-separated list of module names, e.g. q_proj,v_proj,lm_head."
        },
    )
    eval_before_training: bool = field(
        default=True, metadata={"help": "Evaluate once before training (needs an eval split)."}
    )
    results_file: str | None = field(
        default=None, metadata={"help": "Write the eval metrics before/after as JSON here (main process)."}
    )


def _flag_given(name: str, argv: list[str]) -> bool:
    return any(arg == f"--{name}" or arg.startswith(f"--{name}=") for arg in argv)


def parse_args(argv: list[str] | None = None) -> tuple[ScriptArguments, PPOConfig]:
    """Parse the command line; on the kit (no --model_name_or_path) add KIT_DEFAULTS for the flags not given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser((ScriptArguments, PPOConfig))
    if "-h" not in argv and "--help" not in argv and not _flag_given("model_name_or_path", argv):
        argv = [f"--{k}={v}" for k, v in KIT_DEFAULTS.items() if not _flag_given(k, argv)] + argv
    script, config = parser.parse_args_into_dataclasses(args=argv)
    return script, config


def _target_modules(value: str) -> str | list[str]:
    return [m.strip() for m in value.split(",") if m.strip()] if "," in value else value


def _load_split(script: ScriptArguments, split: str):
    from datasets import load_dataset, load_from_disk

    name = script.dataset_name
    suffix = Path(name).suffix.lower().lstrip(".")
    if os.path.isfile(name) and suffix in ("json", "jsonl", "csv", "parquet"):
        builder = "json" if suffix == "jsonl" else suffix
        data = load_dataset(builder, data_files=name)
    elif os.path.isdir(name) and (Path(name) / "dataset_dict.json").is_file():
        data = load_from_disk(name)
    elif os.path.isdir(name) and (Path(name) / "state.json").is_file():
        return load_from_disk(name) if split == script.dataset_train_split else None
    else:
        data = load_dataset(name, script.dataset_config)
    return data[split] if split in data else None


def load_data(script: ScriptArguments):
    """(train, eval or None): the kit's prompts, or the dataset named on the command line."""
    if script.dataset_name is None:
        from rlhf_trainers.testing import get_kit

        kit = get_kit()
        train, test = kit.prompt_dataset("train"), kit.prompt_dataset("test")
    else:
        train = _load_split(script, script.dataset_train_split)
        if train is None:
            raise ValueError(f"{script.dataset_name} has no split {script.dataset_train_split!r}.")
        test = _load_split(script, script.dataset_test_split) if script.dataset_test_split else None
    if script.prompt_column != "prompt":
        train = train.rename_column(script.prompt_column, "prompt")
        test = test.rename_column(script.prompt_column, "prompt") if test is not None else None
    if script.max_train_samples is not None:
        train = train.select(range(min(script.max_train_samples, len(train))))
    if test is not None and script.max_eval_samples is not None:
        test = test.select(range(min(script.max_eval_samples, len(test))))
    return train, test


def main() -> None:
    script, config = parse_args()  # the config first: under ZeRO-3 the models are then partitioned on load
    if script.model_name_or_path is None:
        from rlhf_trainers.testing import get_kit

        script.model_name_or_path = str(get_kit().model_path("llama-sft"))
    train, test = load_data(script)

    reward_funcs = []
    use_true_reward = script.use_true_reward
    if use_true_reward is None:
        use_true_reward = script.reward_model_name_or_path is None
    if use_true_reward:
        from rlhf_trainers.testing import true_reward

        reward_funcs.append(true_reward)

    peft_config = None
    if script.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=script.lora_r,
            lora_alpha=script.lora_alpha,
            lora_dropout=script.lora_dropout,
            target_modules=_target_modules(script.lora_target_modules),
            task_type="CAUSAL_LM",
        )

    tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path, padding_side="left")
    if tokenizer.pad_token is None:
        # Many Hub causal LMs ship without a pad token. The seed pads with a dedicated one (distinct from
        # EOS), which needs new embeddings; reusing EOS, as TRL's examples do, is accepted by the trainer
        # (its masks come from lengths; val/num_eos_tokens then counts padding too).
        tokenizer.pad_token = tokenizer.eos_token

    trainer = PPOTrainer(
        model=script.model_name_or_path,
        reward_model=script.reward_model_name_or_path,
        value_model=script.value_model_name_or_path,
        reward_funcs=reward_funcs or None,
        args=config,
        processing_class=tokenizer,
        train_dataset=train,
        eval_dataset=test,
        peft_config=peft_config,
    )
    results = {"world_size": trainer.accelerator.num_processes}
    if test is not None and script.eval_before_training:
        results["before"] = trainer.evaluate()
    trainer.train()
    if test is not None:
        results["after"] = trainer.evaluate()
    results["global_step"] = trainer.state.global_step
    trainer.save_model(config.output_dir)
    if trainer.accelerator.is_main_process:
        print(json.dumps(results, indent=2))
        if script.results_file:
            Path(script.results_file).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
