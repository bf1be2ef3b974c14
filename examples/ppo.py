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

This file is the installed command ``rlhf-trainers ppo`` as a script: ``rlhf-trainers ppo --output_dir
runs/ppo --max_steps 20 --use_cpu`` does the same, and so does ``accelerate launch -m rlhf_trainers.cli
ppo ...``. The code is in ``rlhf_trainers/scripts/ppo.py`` (see docs/cli.md).
"""

from rlhf_trainers.scripts.ppo import main

if __name__ == "__main__":
    main()
