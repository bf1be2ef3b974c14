"""One small training run on the offline kit, for tests/test_reliability.py (a fresh process per run).

    python reliability_run.py TRAINER OUTPUT_DIR MODE [STEP [PHASE SIGNAL]]

TRAINER is ppo, rloo, reward or ppo-agent (PPO with tools on the kit agent). MODE is:

- ``full``: train max_steps (4) with a checkpoint every 2 steps;
- ``kill-in-save``: the same, but the process SIGKILLs itself while writing the checkpoint of update
  STEP (after the weights and optimizer are written, before the RNG and trainer state are);
- ``signal``: the process sends itself SIGTERM during the update STEP (from inside the loss) and must
  return from ``train()`` cleanly with that step's checkpoint written; under ``accelerate launch`` only
  rank 1 sends it, and every rank must stop after the same step. ``signal STEP PHASE SIGNAL`` picks the
  moment and the signal: PHASE ``update`` (the default), ``rollout`` (inside the rollout of update STEP;
  PPO/RLOO) or ``save`` (while the checkpoint of update STEP is being written), SIGNAL ``TERM`` (the
  default) or ``INT`` (what Ctrl-C sends);
- ``resume``: ``train(resume_from_checkpoint=True)`` in OUTPUT_DIR;
- ``generation-failure``: the generation backend of the last rank raises ``GenerationError`` from the
  generation of update STEP on (an engine that died); ``train()``'s error is written to the result
  (``error``) instead of ending the process.

Each mode that returns writes ``OUTPUT_DIR/log_history.json`` (``trainer.state.log_history``, rank 0)
and ``OUTPUT_DIR/result-rank<R>.json`` (global step, whether train() was interrupted, world size).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import transformers

from rlhf_trainers import PPOConfig, PPOTrainer, RewardConfig, RewardTrainer, RLOOConfig, RLOOTrainer
from rlhf_trainers.testing import get_kit, true_reward

COMMON = {
    "max_steps": 4,
    "save_strategy": "steps",
    "save_steps": 2,
    "logging_steps": 1,
    "report_to": "none",
    "use_cpu": True,
    "seed": 5,
    "disable_tqdm": True,
}
ONPOLICY = {
    "per_device_train_batch_size": 8,
    "num_mini_batches": 2,
    "num_ppo_epochs": 2,
    "response_length": 8,
    "temperature": 1.0,
    "learning_rate": 1e-3,
    "num_sample_generations": 0,
}


def build(kind: str, output_dir: str):
    kit = get_kit()
    if kind == "reward":
        args = RewardConfig(
            output_dir=output_dir, per_device_train_batch_size=8, learning_rate=1e-3, max_length=64, **COMMON
        )
        return RewardTrainer(
            model=str(kit.model_path("llama-sft")),
            args=args,
            train_dataset=kit.preference_dataset("train", n=64),
        )
    if kind == "ppo-agent":
        return _agent(kit, output_dir)
    config, trainer = (PPOConfig, PPOTrainer) if kind == "ppo" else (RLOOConfig, RLOOTrainer)
    extra = {"rloo_k": 2} if kind == "rloo" else {}
    return trainer(
        model=kit.load_model("llama-sft"),
        processing_class=kit.load_tokenizer(),
        args=config(output_dir=output_dir, **COMMON, **ONPOLICY, **extra),
        train_dataset=kit.prompt_dataset("train", n=64),
        reward_funcs=true_reward,
    )


def _agent(kit, output_dir: str) -> PPOTrainer:
    """PPO with tools on the kit agent (it calls the calculator in about half of its episodes)."""
    import random
    import re

    import datasets

    from rlhf_trainers.testing import agent_kit

    rng = random.Random(0)
    rows = [agent_kit.kit_question(rng, i) for i in range(64)]
    dataset = datasets.Dataset.from_dict({"prompt": [p for p, _ in rows], "answer": [a for _, a in rows]})

    def correctness(completions, answer, **kwargs):
        found = [re.findall(r"-?\d+", c[-1]["content"]) for c in completions]
        return [1.0 if f and f[-1] == a else 0.0 for f, a in zip(found, answer, strict=True)]

    fields = {**ONPOLICY, "response_length": 128, "max_prompt_length": None, "learning_rate": 1e-4}
    return PPOTrainer(
        model=str(agent_kit.kit_agent_folder(kit)),
        args=PPOConfig(output_dir=output_dir, **COMMON, **fields),
        train_dataset=dataset,
        reward_funcs=correctness,
        tools=[agent_kit.multiply, agent_kit.async_add],
    )


def main() -> None:
    kind, output_dir, mode = sys.argv[1:4]
    step = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    phase, signame = (sys.argv[5], sys.argv[6]) if len(sys.argv) > 6 else ("update", "TERM")
    sig = getattr(signal, f"SIG{signame}")
    trainer = build(kind, output_dir)
    if mode == "kill-in-save":
        save_rng = trainer._save_rng_state

        def killing_save_rng_state(folder):
            if trainer.state.global_step == step:
                os.kill(os.getpid(), signal.SIGKILL)
            return save_rng(folder)

        trainer._save_rng_state = killing_save_rng_state
    if mode == "signal" and phase == "rollout":
        # Sampling is the rollout's first step: the signal arrives while the rollout runs.
        sample_responses = trainer.producer.sample

        def signalling_rollout(*args, **kwargs):
            if trainer.state.global_step == step - 1 and not getattr(trainer, "_sent", False):
                trainer._sent = True
                os.kill(os.getpid(), sig)
            return sample_responses(*args, **kwargs)

        trainer.producer.sample = signalling_rollout
    if mode == "signal" and phase == "save":
        save_rng = trainer._save_rng_state

        def signalling_save_rng_state(folder):
            if trainer.state.global_step == step:
                os.kill(os.getpid(), sig)
            return save_rng(folder)

        trainer._save_rng_state = signalling_save_rng_state
    if mode == "signal" and phase == "update":
        compute = trainer.compute_loss if kind == "reward" else trainer.compute_policy_loss

        def signalling(*args, **kwargs):
            # global_step counts finished steps: this is the loss of update `step`.
            last_rank = trainer.accelerator.process_index == trainer.accelerator.num_processes - 1
            if trainer.state.global_step == step - 1 and last_rank and not getattr(trainer, "_sent", False):
                trainer._sent = True
                os.kill(os.getpid(), sig)
            return compute(*args, **kwargs)

        if kind == "reward":
            trainer.compute_loss = signalling
        else:
            trainer.compute_policy_loss = signalling
    if mode == "generation-failure":
        from rlhf_trainers.generation import GenerationError

        backend = trainer.generation_backend
        sample = backend.sample
        last_rank = trainer.accelerator.process_index == trainer.accelerator.num_processes - 1

        def failing_sample(*args, **kwargs):
            if last_rank and trainer.state.global_step >= step - 1:
                raise GenerationError("the engine died (simulated)")
            return sample(*args, **kwargs)

        backend.sample = failing_sample
    error = None
    try:
        output = trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    except Exception as err:
        if mode != "generation-failure":
            raise
        output, error = trainer.state, f"{type(err).__name__}: {err}"
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    if rank == 0:
        with open(os.path.join(output_dir, "log_history.json"), "w") as fh:
            json.dump(trainer.state.log_history, fh)
    result = {
        "global_step": trainer.state.global_step,
        "interrupted": trainer.interrupted,
        "world_size": world,
        "error": error,
    }
    with open(os.path.join(output_dir, f"result-rank{rank}.json"), "w") as fh:
        json.dump({"rank": rank, **result}, fh)
    print("transformers", transformers.__version__, "done", output.global_step)


if __name__ == "__main__":
    main()
