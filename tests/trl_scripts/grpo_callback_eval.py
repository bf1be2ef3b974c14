# A callback and an evaluation dataset (transformers' Trainer API as TRL's GRPOTrainer takes it): the
# callback sees every log, evaluation runs during training and `trainer.evaluate()` after it.
from _offline import MODEL, load_dataset, output_dir, size
from transformers import TrainerCallback

from rlhf_trainers import GRPOConfig, GRPOTrainer
from rlhf_trainers.rewards import accuracy_reward

train_dataset = load_dataset("trl-lib/DeepMath-103K", split="train")
eval_dataset = load_dataset("trl-lib/DeepMath-103K", split="test").select(range(8))


class RewardLogger(TrainerCallback):
    """Collects the mean reward of every training log and the metrics of every evaluation."""

    def __init__(self):
        self.rewards = []
        self.evaluations = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.rewards.append(logs["reward"])

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.evaluations.append(metrics)


training_args = GRPOConfig(
    output_dir=output_dir("grpo_callback_eval"), eval_strategy="steps", eval_steps=2, **size("grpo")
)
callback = RewardLogger()
trainer = GRPOTrainer(
    model=MODEL,
    reward_funcs=accuracy_reward,
    args=training_args,
    train_dataset=train_dataset,
    eval_dataset=eval_dataset,
    callbacks=[callback],
)
trainer.train()
print(f"evaluations during training: {len(callback.evaluations)}")
metrics = trainer.evaluate()
print(f"rewards seen by the callback: {callback.rewards}")
print(f"final evaluation: {metrics}")
