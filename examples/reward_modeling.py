"""Train a reward model on preference pairs with RewardTrainer.

On the offline kit (no arguments: the kit's tiny Llama and its synthetic preferences):

    python examples/reward_modeling.py --output_dir runs/reward
    accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml examples/reward_modeling.py --output_dir runs/reward

On a Hub model and dataset (with LoRA):

    accelerate launch examples/reward_modeling.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/ultrafeedback_binarized \\
        --use_peft --lora_r 16 --per_device_train_batch_size 8 --learning_rate 1e-4 --bf16 \\
        --max_length 1024 --output_dir runs/qwen-rm

Every RewardConfig (and TrainingArguments) field is a flag: ``--help`` lists them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer, HfArgumentParser

from rlhf_trainers import RewardConfig, RewardTrainer


@dataclass
class ScriptArguments:
    """What to train on. Left empty, the offline kit's model and synthetic preferences are used."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Model path or Hub id (a causal LM gets a new scalar head)."}
    )
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Dataset path or Hub id (load_dataset); default: the offline kit's pairs."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str | None = field(
        default="test", metadata={"help": "Split to evaluate on (None: no eval)."}
    )
    num_train_pairs: int | None = field(
        default=None, metadata={"help": "Use only the first N training pairs."}
    )
    use_peft: bool = field(
        default=False, metadata={"help": "Train a LoRA adapter (and the score head) only."}
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_target_modules: str = field(default="all-linear", metadata={"help": "LoRA target modules."})
    normalize_with_policy: bool = field(
        default=False,
        metadata={
            "help": "After training, normalize rewards on samples of the reference policy (the model itself "
            "as a causal LM; needs a prompt column)."
        },
    )
    results_file: str | None = field(
        default=None, metadata={"help": "Write final metrics as JSON here (main process only)."}
    )


def load_data(script: ScriptArguments):
    """(train, eval, model path) from the arguments, or from the offline kit."""
    if script.dataset_name is None or script.model_name_or_path is None:
        from rlhf_trainers.testing import get_kit

        kit = get_kit()
    if script.model_name_or_path is None:
        script.model_name_or_path = str(kit.model_path("llama-sft"))
    if script.dataset_name is None:
        train, test = kit.preference_dataset("train"), kit.preference_dataset("test")
    else:
        from datasets import load_dataset

        data = load_dataset(script.dataset_name, script.dataset_config)
        train = data[script.dataset_train_split]
        test = data[script.dataset_test_split] if script.dataset_test_split in data else None
    if script.num_train_pairs is not None:
        train = train.select(range(min(script.num_train_pairs, len(train))))
    return train, test


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, RewardConfig))
    script, config = parser.parse_args_into_dataclasses()
    train, test = load_data(script)
    peft_config = None
    if script.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=script.lora_r, lora_alpha=script.lora_alpha, target_modules=script.lora_target_modules
        )
    tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
    trainer = RewardTrainer(
        model=script.model_name_or_path,
        args=config,
        train_dataset=train,
        eval_dataset=test,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.train()
    metrics = trainer.evaluate() if test is not None else {}
    if script.normalize_with_policy:
        from transformers import AutoModelForCausalLM

        policy = AutoModelForCausalLM.from_pretrained(script.model_name_or_path).to(
            trainer.accelerator.device
        )
        metrics["reward_gain"], metrics["reward_bias"] = trainer.normalize_rewards(policy, train, tokenizer)
    trainer.save_model(config.output_dir)
    if trainer.accelerator.is_main_process:
        print(json.dumps(metrics, indent=2))
        if script.results_file:
            metrics["world_size"] = trainer.accelerator.num_processes
            metrics["global_step"] = trainer.state.global_step
            metrics["preprocessing"] = {k: vars(v) for k, v in trainer.preprocessing_stats.items()}
            Path(script.results_file).write_text(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
