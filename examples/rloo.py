"""Train a policy with RLOO (RLOOTrainer): ``rloo_k`` completions per prompt, each one's baseline the mean
reward of the others; a reward model and/or a reward function, KL to a reference policy, no value model.

On the offline kit (no model or dataset arguments: the kit's tiny SFT Llama, its synthetic prompts, and
its hidden sentiment reward ``rlhf_trainers.testing.true_reward`` as the reward function):

    python examples/rloo.py --output_dir runs/rloo --max_steps 20 --use_cpu
    accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml examples/rloo.py \\
        --output_dir runs/rloo --max_steps 20

On the kit the script uses settings that learn in seconds, unless the flag is given:
``--rloo_k 4 --learning_rate 2e-3 --response_length 12 --temperature 1.0 --per_device_train_batch_size 16
--num_mini_batches 2 --num_ppo_epochs 2`` (8 prompts x 4 completions per update and process). The eval
prompts' mean true reward goes from about 0 to about 0.95 in 20 updates (9 s on 2 CPU cores).

On a Hub model, reward model and prompt dataset (with LoRA on the policy; the reference is the same
weights with the adapter disabled, so only one copy of the base model is in memory):

    accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml examples/rloo.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --reward_model_name_or_path <a one-label sequence-classification model> \\
        --dataset_name trl-lib/tldr --dataset_train_split train --dataset_test_split validation \\
        --use_peft --lora_r 16 --learning_rate 1e-5 --rloo_k 4 --per_device_train_batch_size 8 \\
        --gradient_accumulation_steps 4 --response_length 128 --bf16 --output_dir runs/qwen-rloo

The rollout of one process is per_device_train_batch_size x gradient_accumulation_steps x
num_mini_batches completions and must be a multiple of ``--rloo_k`` (all k completions of a prompt are
generated on the same process). Under bf16, see docs/rloo.md for ``--truncated_is_cap`` and the
``policy/seq_ratio_at_start_*`` metrics.

The prompts come from a ``prompt`` column (text or chat messages), a ``messages`` column or
``input_ids`` (``--prompt_column`` renames another column to ``prompt``); the other columns are passed to
reward functions. ``--dataset_name`` is a Hub id, a folder saved with ``Dataset.save_to_disk``, or a
.json/.jsonl/.csv/.parquet file.

Every RLOOConfig (and TrainingArguments) field is a flag: ``--help`` lists them. The policy is saved at
the root of ``--output_dir`` at the end.

This file is the installed command ``rlhf-trainers rloo`` as a script: ``rlhf-trainers rloo --output_dir
runs/rloo --max_steps 20 --use_cpu`` does the same, and so does ``accelerate launch -m rlhf_trainers.cli
rloo ...``. The code is in ``rlhf_trainers/scripts/rloo.py`` (see docs/cli.md).
"""

from rlhf_trainers.scripts.rloo import main

if __name__ == "__main__":
    main()
