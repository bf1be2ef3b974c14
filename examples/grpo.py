"""Train a policy with GRPO (GRPOTrainer): ``num_generations`` completions per prompt, advantages relative
to the prompt's group, TRL's GRPOConfig names and batch semantics (``max_steps`` counts optimizer steps).

On the offline kit (no model or dataset arguments: the kit's tiny SFT Llama, its synthetic prompts, and
its hidden sentiment reward ``rlhf_trainers.testing.true_reward`` as the reward function):

    python examples/grpo.py --output_dir runs/grpo --max_steps 32 --use_cpu
    accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml examples/grpo.py \\
        --output_dir runs/grpo --max_steps 32

On the kit the script uses settings that learn in seconds, unless the flag is given:
``--num_generations 4 --learning_rate 2e-3 --max_completion_length 12 --per_device_train_batch_size 16
--steps_per_generation 2 --num_iterations 2 --logging_steps 4`` (8 prompts x 4 completions per generation
and process, 4 optimizer steps per generation).

On a Hub model and prompt dataset with a reward model (LoRA on the policy; with ``--beta 0``, TRL's
default, no reference model is loaded at all):

    accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml examples/grpo.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --reward_model_name_or_path <a one-label sequence-classification model> \\
        --dataset_name trl-lib/tldr --dataset_train_split train \\
        --use_peft --lora_r 16 --learning_rate 1e-5 --num_generations 8 --per_device_train_batch_size 8 \\
        --gradient_accumulation_steps 4 --max_completion_length 128 --bf16 --output_dir runs/qwen-grpo

One process's generation is per_device_train_batch_size x steps_per_generation completions and must be a
multiple of ``--num_generations`` (a prompt's completions are generated on one process). Every
GRPOConfig (and TrainingArguments) field is a flag: ``--help`` lists them; docs/grpo.md explains them.

This file is the installed command ``rlhf-trainers grpo`` as a script; the code is in
``rlhf_trainers/scripts/grpo.py`` (see docs/cli.md).
"""

from rlhf_trainers.scripts.grpo import main

if __name__ == "__main__":
    main()
