# A custom rollout function (TRL's GRPO docs, "rollout_func"): the function makes the completions and
# returns their prompt ids, completion ids and log-probs, and a field (`env_reward`) that TRL forwards to
# the reward functions. TRL's example posts the prompts to a vLLM server; offline, _offline.generate
# samples from the trainer's own policy instead.
from _offline import MODEL, generate, load_dataset, output_dir, size

from rlhf_trainers import GRPOConfig, GRPOTrainer

dataset = load_dataset("trl-lib/tldr", split="train")
prompts_per_call = []


def rollout_func(prompts: list[str], trainer: GRPOTrainer) -> dict[str, list]:
    prompts_per_call.append(len(prompts))
    result = generate(trainer, prompts)  # TRL's example: requests.post(".../generate/", json=payload)
    texts = trainer.processing_class.batch_decode(result["completion_ids"], skip_special_tokens=True)
    # An "environment" scores each completion: completions close to 20 characters are better
    env_rewards = [-abs(20 - len(text)) / 20 for text in texts]
    return {
        "prompt_ids": result["prompt_ids"],
        "completion_ids": result["completion_ids"],
        "logprobs": result["logprobs"],
        "env_reward": env_rewards,  # forwarded to the reward functions
    }


def reward_from_env(completions, **kwargs):
    env_rewards = kwargs.get("env_reward", [])
    return [float(r) for r in env_rewards] if env_rewards else [0.0] * len(completions)


training_args = GRPOConfig(output_dir=output_dir("grpo_rollout_func"), **size("grpo"))
trainer = GRPOTrainer(
    model=MODEL,
    reward_funcs=reward_from_env,
    args=training_args,
    train_dataset=dataset,
    rollout_func=rollout_func,
)
trainer.train()
metrics = {"prompts_per_call": prompts_per_call}
