"""Offline stand-ins for what TRL's documented scripts load from the Hugging Face Hub.

The scripts of this folder are TRL 1.16's documentation examples with two kinds of change: the
``from trl ...`` imports read ``from rlhf_trainers ...`` (``run_script.py --trl`` turns them back, and
nothing else), and the Hub model id and ``load_dataset("trl-lib/...")`` come from here, since this machine
has no Hub (and :func:`generate`, where TRL's ``rollout_func`` example asks a vLLM server). The datasets have the columns and formats of TRL's datasets of the same name (conversational
prompts, a ``solution`` column, implicit-prompt preferences, ...), filled with small arithmetic and
writing tasks a 135M-parameter model can learn from within a few steps.

This module imports nothing but the standard library and ``datasets``, so that both TRL's benchmark
environment and ours run it. The environment chooses the scale:

- ``TRL_SCRIPTS_MODEL``: the policy (and reward-model base) folder. Required.
- ``TRL_SCRIPTS_TOOL_MODEL``: the policy of the scripts with tools or environments: the same model with a
  chat template that renders tools, tool calls and tool results (SmolLM2's and the kit's do not; the
  tests save the kit's with ``rlhf_trainers.agents.install_tool_chat_template``). Default: the model.
- ``TRL_SCRIPTS_SCALE``: ``"kit"`` (default: two steps of short completions, for the tests) or
  ``"real"`` (``benchmarks/trl_scripts_real.py``: SmolLM2-135M-Instruct).
- ``TRL_SCRIPTS_STEPS``: ``max_steps`` (default 2 at ``kit`` scale, 12 at ``real``).
- ``TRL_SCRIPTS_OUTPUT``: the folder every script's ``output_dir`` is placed in (default: a temp folder).
"""

from __future__ import annotations

import os
import random
import tempfile
from typing import Any

import datasets

__all__ = ["MODEL", "TOOL_MODEL", "generate", "load_dataset", "output_dir", "size"]

MODEL: str = os.environ.get("TRL_SCRIPTS_MODEL", "")
if not MODEL:
    raise SystemExit("set TRL_SCRIPTS_MODEL to the model folder the scripts train (no Hub here)")
TOOL_MODEL: str = os.environ.get("TRL_SCRIPTS_TOOL_MODEL", "") or MODEL
SCALE: str = os.environ.get("TRL_SCRIPTS_SCALE", "kit")
if SCALE not in ("kit", "real"):
    raise SystemExit(f"TRL_SCRIPTS_SCALE={SCALE!r}: must be 'kit' or 'real'")
STEPS: int = int(os.environ.get("TRL_SCRIPTS_STEPS", "2" if SCALE == "kit" else "12"))

_TOPICS = ["the sea", "a red bicycle", "winter mornings", "a quiet library", "the moon", "fresh bread",
           "a mountain trail", "an old clock", "city lights", "a small garden", "rain on a window",
           "a paper boat"]  # fmt: skip


def output_dir(name: str) -> str:
    """Where the script called `name` writes (``output_dir`` of its config)."""
    root = os.environ.get("TRL_SCRIPTS_OUTPUT") or tempfile.mkdtemp(prefix="trl-scripts-")
    return os.path.join(root, name)


def size(kind: str) -> dict[str, Any]:
    """The config fields that size a script for this machine, the same for TRL and ours.

    `kind` is ``"grpo"``, ``"rloo"``, ``"agent"`` (tool episodes) or ``"reward"``. Both sides get float32 (``bf16=False``: TRL's
    default is bf16), no gradient checkpointing (TRL's default is on) and no saving, so the comparison
    is of the trainers, not of their defaults (docs/coming-from-trl.md lists those).
    """
    real = SCALE == "real"
    common: dict[str, Any] = dict(
        max_steps=STEPS, logging_steps=1, report_to="none", seed=0, bf16=False, save_strategy="no",
        gradient_checkpointing=False,
    )  # fmt: skip
    if kind in ("grpo", "rloo"):
        common.update(
            per_device_train_batch_size=16 if real else 8,
            num_generations=4,
            max_completion_length=64 if real else 8,
            learning_rate=1e-5 if real else 1e-4,
            temperature=1.0,  # TRL's default; RLOOConfig's own default is 0.7
        )
        if kind == "rloo":
            common["beta"] = 0.05
        return common
    if kind == "agent":  # multi-turn episodes: room for a call, its result and an answer
        common.update(
            per_device_train_batch_size=8 if real else 16,
            gradient_accumulation_steps=2 if real else 1,  # 16 episodes per step either way
            num_generations=4,
            max_completion_length=128,
            learning_rate=1e-5 if real else 1e-4,
            temperature=1.0,
        )
        return common
    if kind == "reward":
        common.update(per_device_train_batch_size=16 if real else 8, learning_rate=5e-5 if real else 1e-3)
        return common
    raise ValueError(f"kind={kind!r}: must be 'grpo', 'rloo', 'agent' or 'reward'")


def _arithmetic(rng: random.Random) -> tuple[int, int, int]:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return a, b, a + b


def _deepmath(rng: random.Random, n: int) -> dict[str, list[Any]]:
    """TRL's DeepMath-103K: a conversational ``prompt`` and a LaTeX ``solution``."""
    prompts, solutions = [], []
    for _ in range(n):
        a, b, total = _arithmetic(rng)
        question = f"What is {a} + {b}? Put your final answer within \\boxed{{}}."
        prompts.append([{"role": "user", "content": question}])
        solutions.append(f"${total}$")
    return {"prompt": prompts, "solution": solutions}


def _boxed_arithmetic(rng: random.Random, n: int) -> dict[str, list[Any]]:
    """Standard prompts with a ``ground_truth`` column (TRL's reward-function Example 3)."""
    prompts, truths = [], []
    for _ in range(n):
        a, b, total = _arithmetic(rng)
        prompts.append(f"Problem: What is {a} + {b}? Write the answer as \\boxed{{answer}}. Solution:")
        truths.append(str(total))
    return {"prompt": prompts, "ground_truth": truths}


def _math_and_code(rng: random.Random, n: int) -> dict[str, list[Any]]:
    """Standard prompts of two tasks (TRL's multi-task Example 4): a ``task`` column."""
    prompts, tasks = [], []
    for i in range(n):
        if i % 2 == 0:
            a, b, _ = _arithmetic(rng)
            prompts.append(f"What is {a}+{b}?")
            tasks.append("math")
        else:
            op = rng.choice(["sum", "product", "difference"])
            prompts.append(f"Write a Python function that returns the {op} of two numbers.")
            tasks.append("code")
    return {"prompt": prompts, "task": tasks}


#: The conversation before every question of ``offline/arithmetic-tools`` at ``real`` scale: two worked
#: examples (a call, its result, the answer), one per tool. SmolLM2-135M-Instruct wrote no call in 16 samples
#: of the bare question with the tools offered, and 8 in 16 after one worked product; with only the
#: product worked, its sums called made-up names (``add``, ``Add``), never ``async_add``.
_WORKED_TOOL_CALL: list[dict[str, Any]] = [
    {"role": "user", "content": "What is 23 * 41? Use the tools."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "multiply", "arguments": {"a": 23, "b": 41}}}
        ],
    },
    {"role": "tool", "name": "multiply", "content": "943"},
    {"role": "assistant", "content": "The answer is 943."},
    {"role": "user", "content": "What is 58 + 67? Use the tools."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "async_add", "arguments": {"a": 58, "b": 67}}}
        ],
    },
    {"role": "tool", "name": "async_add", "content": "125"},
    {"role": "assistant", "content": "The answer is 125."},
]


def _arithmetic_tools(rng: random.Random, n: int) -> dict[str, list[Any]]:
    """Conversational questions a calculator answers, products and sums in turn, with an ``answer``
    column: the task of TRL's tools example. Two-digit numbers at ``real`` scale, after one worked example
    (:data:`_WORKED_TOOL_CALL`); one-digit at ``kit`` scale, the bare questions the kit agent
    (``rlhf_trainers.testing.agent_kit``) was taught to call on."""
    prompts, answers = [], []
    low, high = (12, 99) if SCALE == "real" else (2, 9)
    before = _WORKED_TOOL_CALL if SCALE == "real" else []
    for i in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        op, value = ("*", a * b) if i % 2 == 0 else ("+", a + b)
        prompts.append([*before, {"role": "user", "content": f"What is {a} {op} {b}? Use the tools."}])
        answers.append(str(value))
    return {"prompt": prompts, "answer": answers}


def _tldr(rng: random.Random, n: int) -> dict[str, list[Any]]:
    """TRL's tldr: standard ``prompt`` and ``completion`` strings."""
    prompts, completions = [], []
    for _ in range(n):
        topic = rng.choice(_TOPICS)
        prompts.append(f"Write one sentence about {topic}.")
        completions.append(f" A sentence about {topic}.")
    return {"prompt": prompts, "completion": completions}


def _preference_pair(rng: random.Random) -> tuple[str, str, str]:
    """A question, the right answer, and a worse one: a wrong sum or no answer at all."""
    a, b, total = _arithmetic(rng)
    wrong = total + rng.choice([-3, -2, -1, 1, 2, 3])
    worse = rng.choice([f"{a} + {b} = {wrong}.", "I am not sure.", "I cannot help with that."])
    return f"What is {a} + {b}?", f"{a} + {b} = {total}.", worse


def _ultrafeedback(rng: random.Random, n: int) -> dict[str, list[Any]]:
    """TRL's ultrafeedback_binarized: conversational, implicit prompt (the user turn in each side)."""
    chosen, rejected = [], []
    for _ in range(n):
        question, good, bad = _preference_pair(rng)
        user = {"role": "user", "content": question}
        chosen.append([user, {"role": "assistant", "content": good}])
        rejected.append([user, {"role": "assistant", "content": bad}])
    return {"chosen": chosen, "rejected": rejected}


def _standard_preference(rng: random.Random, n: int) -> dict[str, list[Any]]:
    """Standard preference with an explicit prompt: ``prompt``, ``chosen``, ``rejected`` strings."""
    rows = [_preference_pair(rng) for _ in range(n)]
    return {"prompt": [q + " " for q, _, _ in rows], "chosen": [c for _, c, _ in rows],
            "rejected": [r for _, _, r in rows]}  # fmt: skip


def _implicit_preference(rng: random.Random, n: int) -> dict[str, list[Any]]:
    """Standard preference with an implicit prompt: whole texts in ``chosen`` and ``rejected``."""
    rows = [_preference_pair(rng) for _ in range(n)]
    return {"chosen": [f"{q} {c}" for q, c, _ in rows], "rejected": [f"{q} {r}" for q, _, r in rows]}


_BUILDERS = {
    "trl-lib/DeepMath-103K": _deepmath,
    "trl-lib/tldr": _tldr,
    "trl-lib/ultrafeedback_binarized": _ultrafeedback,
    "offline/boxed-arithmetic": _boxed_arithmetic,
    "offline/arithmetic-tools": _arithmetic_tools,
    "offline/math-and-code": _math_and_code,
    "offline/standard-preference": _standard_preference,
    "offline/implicit-preference": _implicit_preference,
}


def load_dataset(name: str, split: str = "train") -> datasets.Dataset:
    """The offline stand-in of Hub dataset `name` (``split`` "train": 512 rows, "test": 64)."""
    if name not in _BUILDERS:
        raise ValueError(f"no offline stand-in for {name!r}; known: {', '.join(_BUILDERS)}")
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r}: must be 'train' or 'test'")
    rng = random.Random(f"{name}:{split}")
    return datasets.Dataset.from_dict(_BUILDERS[name](rng, 512 if split == "train" else 64))


def generate(trainer: Any, prompts: list[Any]) -> dict[str, list[Any]]:
    """What TRL's ``rollout_func`` example gets from its vLLM server: for each prompt (text, or chat
    messages rendered with the chat template), its token ids, one completion sampled from the trainer's
    policy at ``temperature`` (at most ``max_completion_length`` tokens, ending at the EOS token) and the
    completion tokens' log-probs. Runs transformers' ``generate`` on the policy of TRL's trainer
    (``trainer.model``) or ours (``trainer.model.policy``)."""
    import torch

    tokenizer, args = trainer.processing_class, trainer.args
    model = trainer.accelerator.unwrap_model(trainer.model)
    model = getattr(model, "policy", model)  # ours holds the policy (and PPO's value model) in one module
    texts = [
        tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
        if isinstance(p, list)
        else p
        for p in prompts
    ]
    prompt_ids = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    width = max(len(ids) for ids in prompt_ids)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompt_ids], device=model.device)
    attention_mask = (
        torch.arange(width)[None, :] >= torch.tensor([width - len(i) for i in prompt_ids])[:, None]
    ).long()
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask.to(model.device),
            do_sample=True,
            temperature=args.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.max_completion_length,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
    tokens = out.sequences[:, width:]
    logits = torch.stack(out.logits, dim=1).float() / args.temperature
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None])[..., 0]
    completion_ids, completion_logprobs = [], []
    for row, row_logprobs in zip(tokens.tolist(), logprobs.tolist()):
        end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        completion_ids.append(row[:end])
        completion_logprobs.append(row_logprobs[:end])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": completion_logprobs}
