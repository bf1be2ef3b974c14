"""rlhf_trainers.rewards.rlvr (verifiable-reward tasks) and examples/rlvr.py: the reward and success functions on
hand-written completions (empty, extra text, cut off without EOS, whitespace and periods, chat messages),
deterministic disjoint splits, the module's standard-library-only import, and PPO/RLOO on the kit's tiny
Llama with the task's columns reaching the reward function."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_trainers import PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer
from rlhf_trainers.rewards import REWARD_FUNC_ARGS
from rlhf_trainers.rewards.rlvr import (
    TASKS,
    count_words,
    reward_function,
    reward_source,
    success,
    success_function,
    success_source,
    task_dataset,
    task_rows,
)

REPO_ROOT = Path(__file__).resolve().parent.parent

# ---- grading ------------------------------------------------------------------------------------

# (completion, strict success, training reward) for the prompt "What is 7 + 12?" (answer 19).
ADDITION_CASES = [
    ("19", 1.0, 1.0),
    (" 19", 1.0, 1.0),
    ("19.", 1.0, 1.0),
    ("  19.\n", 1.0, 1.0),
    ("19...", 1.0, 1.0),
    ("", 0.0, 0.0),  # empty
    ("   ", 0.0, 0.0),
    ("18", 0.0, 0.0),  # wrong
    ("190", 0.0, 0.0),
    ("1.9", 0.0, 0.0),
    ("-19", 0.0, 0.0),
    ("7 + 12 = 19", 0.0, 0.5),  # extra text around the right number
    ("The answer is 19.", 0.0, 0.5),
    ("19 apples", 0.0, 0.5),
    ("The answer is 7 + 12 = 1", 0.0, 0.0),  # cut off at the length limit (no EOS)
    ("To add 7 and 12 we", 0.0, 0.0),  # cut off before any answer
    ("nineteen", 0.0, 0.0),
    ("19<|im_end|>", 1.0, 1.0),  # a special token left in the text is ignored
]

# (completion, num_words, strict success, training reward)
WORD_COUNT_CASES = [
    ("Vast, blue, deep water.", 4, 1.0, 1.0),
    ("  Vast blue deep water  ", 4, 1.0, 1.0),
    ("Vast blue deep water...\n", 4, 1.0, 1.0),
    ("Sun-kissed golden sand.", 3, 1.0, 1.0),  # a hyphenated word is one word
    ("Calm - vast - blue", 3, 1.0, 1.0),  # punctuation alone is no word
    ("", 4, 0.0, 0.0),  # empty
    ("...", 3, 0.0, 0.0),
    ("Vast blue water.", 4, 0.0, 0.375),  # one short: 0.5 * (1 - 1/4)
    ("Vast blue deep cold water.", 4, 0.0, 0.375),  # one too many
    ('Here are 4 words: "vast blue deep water"', 4, 0.0, 0.0),  # extra text: 8 words, |8 - 4| / 4 = 1
    ("The ocean is a vast body of salt water that covers", 6, 0.0, 1 / 12),  # cut off (no EOS): 11 words
    ("Vast blue deep<|im_end|>", 3, 1.0, 1.0),
]


@pytest.mark.parametrize(("completion", "strict", "reward"), ADDITION_CASES)
def test_addition_grading(completion, strict, reward):
    assert success("addition", [completion], answer=[19]) == [strict]
    assert reward_function("addition")(prompts=["p"], completions=[completion], answer=[19]) == [reward]


@pytest.mark.parametrize(("completion", "n", "strict", "reward"), WORD_COUNT_CASES)
def test_word_count_grading(completion, n, strict, reward):
    assert success("word_count", [completion], num_words=[n]) == [strict]
    assert reward_function("word_count")(prompts=["p"], completions=[completion], num_words=[n]) == [
        pytest.approx(reward)
    ]


def test_chat_message_completions_are_graded_on_their_content():
    messages = [[{"role": "assistant", "content": " 19."}], [{"role": "assistant", "content": "20"}]]
    assert success("addition", messages, answer=[19, 19]) == [1.0, 0.0]
    assert reward_function("addition")(prompts=None, completions=messages, answer=[19, 19]) == [1.0, 0.0]
    words = [[{"role": "assistant", "content": "Vast blue sea."}]]
    assert success("word_count", words, num_words=[3]) == [1.0]


def test_success_function_is_success_under_the_name_success():
    f = success_function("addition")
    assert f.__name__ == "success"
    assert f(prompts=["a", "b"], completions=["19", "7 + 12 = 19"], answer=[19, 19], other=[0, 0]) == [
        1.0,
        0.0,
    ]


@pytest.mark.parametrize("task", TASKS)
def test_graders_are_reward_sources(task):
    """``reward_source``/``success_source`` give the graders behind the RewardSource protocol: the same
    values as the functions, as float32 tensors, named as the functions."""
    import torch

    from rlhf_trainers.rewards import RewardBatch, RewardSource

    rows = task_rows(task, "test", n=4)
    completions = ["19", "seven plus twelve", "Warm busy fragrant kitchen.", ""]
    column = "answer" if task == "addition" else "num_words"
    batch = RewardBatch(
        prompts=[r["prompt"] for r in rows],
        completions=completions,
        columns={column: [r[column] for r in rows]},
    )
    for source, func in (
        (reward_source(task), reward_function(task)),
        (success_source(task), success_function(task)),
    ):
        assert isinstance(source, RewardSource) and source.name == func.__name__
        expected = func(prompts=list(batch.prompts), completions=completions, **batch.columns)
        torch.testing.assert_close(source.score(batch), torch.tensor(expected, dtype=torch.float32))


def test_grading_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown RLVR task 'nope'"):
        reward_function("nope")
    with pytest.raises(ValueError, match="'answer' is required"):
        success("addition", ["19"])
    with pytest.raises(ValueError, match="2 completions but 1 values of 'num_words'"):
        success("word_count", ["a", "b"], num_words=[1])
    assert count_words("a b  c\n-d") == 4


# ---- data ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_rows_are_deterministic_disjoint_and_graded_by_their_columns(task):
    train, test = task_rows(task, "train"), task_rows(task, "test")
    assert train == task_rows(task, "train") and test == task_rows(task, "test")
    prompts = {json.dumps(r["prompt"]) for r in train}
    assert not prompts & {json.dumps(r["prompt"]) for r in test}
    assert len(task_rows(task, "test", n=len(test) + 3)) == len(test) + 3  # repeats the pool
    for row in test:
        (message,) = row["prompt"]
        assert message["role"] == "user"
        if task == "addition":
            a, b = map(int, re.match(r"What is (\d+) \+ (\d+)\?", message["content"]).groups())
            assert row["answer"] == a + b
        else:
            assert f"exactly {row['num_words']} words" in message["content"]
    dataset = task_dataset(task, "test", n=5)
    assert len(dataset) == 5 and dataset[0] == test[0]
    with pytest.raises(ValueError, match="unknown split"):
        task_rows(task, "validation")


def test_module_imports_only_the_standard_library():
    """Another virtual environment (TRL's, in benchmarks/) loads rlvr.py by path."""
    path = REPO_ROOT / "rlhf_trainers" / "rewards" / "rlvr.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('rlvr', {str(path)!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "heavy = {'torch', 'transformers', 'datasets', 'numpy', 'rlhf_trainers'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
        "print(module.success('addition', ['19'], answer=[19]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[1.0]"


# ---- the trainers get the task's columns ----------------------------------------------------------


def _recording(func, calls):
    def record(prompts, completions, **columns):
        # the dataset's columns (the trainers also pass completion_ids, trainer_state, log_*: TRL's arguments)
        data = {k: list(v) for k, v in columns.items() if k not in REWARD_FUNC_ARGS}
        calls.append((list(prompts), list(completions), data))
        return func(prompts=prompts, completions=completions, **columns)

    record.__name__ = "recorded_reward"
    return record


@pytest.mark.parametrize(
    ("trainer_class", "config_class"), [(PPOTrainer, PPOConfig), (RLOOTrainer, RLOOConfig)]
)
def test_trainers_pass_the_answer_column_to_the_reward_function(kit, tmp_path, trainer_class, config_class):
    calls = []
    extra = {"rloo_k": 2} if trainer_class is RLOOTrainer else {}
    config = config_class(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_mini_batches=1,
        num_ppo_epochs=1,
        response_length=6,
        learning_rate=1e-3,
        max_steps=2,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        reward_weights=[1.0, 0.0],
        num_sample_generations=0,
        **extra,
    )
    trainer = trainer_class(
        model=kit.load_model("llama-sft"),
        processing_class=kit.load_tokenizer(),
        args=config,
        train_dataset=task_dataset("addition", "train", n=32),
        eval_dataset=task_dataset("addition", "test", n=4),
        reward_funcs=[_recording(reward_function("addition"), calls), success_function("addition")],
    )
    trainer.train()
    assert trainer.state.global_step == 2
    assert len(calls) == 2
    for prompts, completions, columns in calls:
        assert len(prompts) == len(completions) == len(columns["answer"]) == 8
        for prompt, answer in zip(prompts, columns["answer"], strict=True):
            a, b = map(int, re.search(r"What is (\d+) \+ (\d+)\?", str(prompt)).groups())
            assert answer == a + b
    logged = [entry for entry in trainer.state.log_history if "objective/scores/success" in entry]
    assert logged and all(0.0 <= entry["objective/scores/success"] <= 1.0 for entry in logged)
    metrics = trainer.evaluate()
    assert 0.0 <= metrics["eval_objective/scores/success"] <= 1.0


def _load_example():
    spec = importlib.util.spec_from_file_location("rlvr_example", REPO_ROOT / "examples" / "rlvr.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("trainer", ["ppo", "rloo", "grpo"])
def test_example_writes_the_curve_on_the_kit_model(kit, tmp_path, trainer):
    """examples/rlvr.py end to end on the kit's tiny Llama (its chat template), LoRA on: 2 updates,
    evaluated before and after each, the curve JSON written."""
    example = _load_example()
    curve_file = tmp_path / "curve.json"
    argv = [
        "--trainer",
        trainer,
        "--task",
        "word_count",
        "--model_name_or_path",
        str(kit.model_path("llama-sft")),
        "--output_dir",
        str(tmp_path / "out"),
        "--curve_file",
        str(curve_file),
        "--max_steps",
        "2",
        "--eval_steps",
        "1",
        "--num_eval_prompts",
        "4",
        "--per_device_train_batch_size",
        "8",
        "--max_completion_length" if trainer == "grpo" else "--response_length",  # GRPOConfig: TRL's names
        "6",
        "--use_cpu",
        "true",
        "--disable_tqdm",
        "true",
    ]
    results = example.main(argv)
    written = json.loads(curve_file.read_text())
    assert written == json.loads(json.dumps(results))
    assert (written["trainer"], written["task"], written["updates"]) == (trainer, "word_count", 2)
    assert [point["update"] for point in written["curve"]] == [0, 1, 2]
    assert [point["episode"] for point in written["curve"]] == [0, 8, 16]  # 8 completions per update
    assert all(0.0 <= point["success"] <= 1.0 for point in written["curve"])
    assert written["settings"]["lora_r"] == 16  # LoRA on by default
    assert (tmp_path / "out" / "adapter_config.json").is_file()
