"""Train a reward model on preference pairs with RewardTrainer.

On the offline kit (no arguments: the kit's tiny Llama and its synthetic preferences):

    python examples/reward_modeling.py --output_dir runs/reward
    accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml examples/reward_modeling.py --output_dir runs/reward

On a Hub model and dataset (with LoRA):

    accelerate launch examples/reward_modeling.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/ultrafeedback_binarized \\
        --use_peft --lora_r 16 --per_device_train_batch_size 8 --learning_rate 1e-4 --bf16 \\
        --max_length 1024 --output_dir runs/qwen-rm

The data is a ``--dataset_name`` (a Hub id, a ``save_to_disk`` folder, or a .json/.jsonl/.csv/.parquet
file) with the columns prompt, chosen, rejected (or chosen, rejected as full texts). Every RewardConfig
(and TrainingArguments) field is a flag: ``--help`` lists them.

This file is the installed command ``rlhf-trainers reward`` as a script: ``rlhf-trainers reward
--output_dir runs/reward`` does the same, and so does ``accelerate launch -m rlhf_trainers.cli reward
...``. The code is in ``rlhf_trainers/scripts/reward.py`` (see docs/cli.md).
"""

from rlhf_trainers.scripts.reward import main

if __name__ == "__main__":
    main()
