"""TRL 1.16's ready-made reward functions (``trl.rewards``) as ``rlhf_trainers.rewards`` provides them (#48).

The expected values are TRL's documented examples and the formulas of TRL's docstrings; each function is
checked on standard (string) and conversational (one assistant message) completions, alone and as a
trainer calls it. The math graders need math-verify (the ``math`` and ``test`` extras).
"""

from __future__ import annotations

import math
import pickle
import sys

import datasets
import pytest
import torch

from rlhf_trainers import GRPOConfig, GRPOTrainer
from rlhf_trainers.rewards import (
    RewardBatch,
    RewardFunctionSource,
    accuracy_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
)

THIRD = r"\frac{1}{3}"


def chat(*texts: str) -> list[list[dict[str, str]]]:
    return [[{"role": "assistant", "content": text}] for text in texts]


def as_format(texts: list[str], conversational: bool):
    return chat(*texts) if conversational else list(texts)


@pytest.fixture
def math_verify():
    return pytest.importorskip("math_verify")


class Columns:
    """A ``log_extra`` that records what it is given."""

    def __init__(self) -> None:
        self.columns: dict[str, list] = {}

    def __call__(self, name: str, values: list) -> None:
        self.columns[name] = values


# ---- accuracy ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("conversational", [True, False])
def test_accuracy_reward_on_trls_example(math_verify, conversational):
    completions = as_format(
        [rf"My answer is \boxed{{{THIRD}}}", r"My answer is \boxed{\frac{1}{2}}"], conversational
    )
    assert accuracy_reward(completions, [THIRD, THIRD]) == [1.0, 0.0]


def test_accuracy_reward_skips_an_unparseable_solution_and_logs_what_it_parsed(math_verify):
    log = Columns()
    completions = chat(r"\boxed{3}", "3", r"The answer is $3$", r"\boxed{3}")
    solution = ["3", "3", "$3$", "no number here"]
    # an answer needs LaTeX (a \boxed{} or $...$): a bare "3" is not taken; an unparseable gold gives None
    assert accuracy_reward(completions=completions, solution=solution, log_extra=log) == [1.0, 0.0, 1.0, None]
    assert log.columns == {
        "solution": solution,
        "gold_parsed": ["[3, '3']", "[3, '3']", "[3, '3']", "[unparseable]"],
        "answer_parsed": ["[3, '3']", "[unparseable]", "[3, '3']", "[skipped]"],
    }


def test_what_counts_as_an_answer(math_verify):
    """A marked LaTeX answer only (math-verify with TRL's settings): a box, or $...$ after "answer"."""
    graded = {
        r"\boxed{3}": 1.0,
        r"answer: $3$": 1.0,
        r"$5$, then \boxed{3}": 1.0,  # the box first
        r"$3$": 0.0,  # LaTeX without an anchor
        r"the final answer is 3": 0.0,  # not LaTeX
        r"\boxed{3} or maybe \boxed{2}": 0.0,  # two boxes: the set {2, 3}
    }
    assert accuracy_reward(list(graded), ["3"] * len(graded)) == list(graded.values())


@pytest.mark.parametrize("conversational", [True, False])
def test_reasoning_accuracy_reward_on_trls_example(math_verify, conversational):
    completions = as_format(
        [
            rf"<think> Reasoning content </think> The final answer is \boxed{{{THIRD}}}",
            r"<think> Reasoning content </think> The final answer is \boxed{\frac{1}{2}}",
            rf"<think> Reasoning content with partial answers \boxed{{{THIRD}}} but no final answer",
        ],
        conversational,
    )
    solutions = [THIRD] * 3
    assert reasoning_accuracy_reward(completions, solutions, reasoning_delimiters=["</think>"]) == [
        1.0,
        0.0,
        0.0,
    ]
    assert reasoning_accuracy_reward(completions, solutions) == [1.0, 0.0, 0.0]  # "</think>" by default


def test_reasoning_accuracy_reward_grades_after_the_delimiter(math_verify):
    log = Columns()
    completions = [
        r"<think>\boxed{3}</think> so \boxed{4}",  # the answer in the reasoning does not count
        r"plan </reason> \boxed{4}",  # another delimiter
        r"<think>a</think> b </think> \boxed{4}",  # after the last occurrence
        r"no delimiter \boxed{4}",  # incomplete reasoning: 0.0, even with an unparseable gold
    ]
    solution = ["4", "4", "4", "not math"]
    rewards = reasoning_accuracy_reward(
        completions, solution, reasoning_delimiters=["</reason>", "</think>"], log_extra=log
    )
    assert rewards == [1.0, 1.0, 1.0, 0.0]
    assert log.columns["gold_parsed"][3] == log.columns["answer_parsed"][3] == "[incomplete reasoning]"
    assert reasoning_accuracy_reward([r"<think>x</think> \boxed{4}"], ["not math"]) == [None]


def test_cosine_scaled_reward_on_trls_example_and_its_bounds(math_verify):
    reward = get_cosine_scaled_reward(max_len=100)
    completions = chat(rf"\boxed{{{THIRD}}}", r"\boxed{\frac{1}{2}}")
    assert reward(completions, [THIRD, THIRD], [[1] * 50, [1] * 50]) == pytest.approx([0.75, -0.75])
    # length 0: the correct answer's best, the wrong answer's worst; max_len and beyond: the other ends
    strings = [rf"\boxed{{{THIRD}}}", r"\boxed{\frac{1}{2}}"]
    assert reward(strings, [THIRD] * 2, [[], []]) == pytest.approx([1.0, -1.0])
    assert reward(strings, [THIRD] * 2, [[1] * 100, [1] * 250]) == pytest.approx([0.5, -0.5])
    assert reward(strings, ["not math", THIRD], [[1], torch.ones(30)]) == [
        None,
        pytest.approx(-0.5 - 0.25 * (1 + math.cos(0.3 * math.pi))),
    ]
    custom = get_cosine_scaled_reward(
        10, min_value_wrong=-2, max_value_wrong=0, min_value_correct=0, max_value_correct=2
    )
    assert custom(strings, [THIRD] * 2, [[1] * 5, [1] * 5]) == pytest.approx([1.0, -1.0])


def test_the_math_graders_say_how_to_install_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # an import of it raises ImportError
    for call in (
        lambda: accuracy_reward(["x"], ["1"]),
        lambda: reasoning_accuracy_reward(["x"], ["1"]),
        lambda: get_cosine_scaled_reward(10)(["x"], ["1"], [[1]]),
    ):
        with pytest.raises(ImportError, match=r'math-verify.*pip install "rlhf_trainers\[math\]"'):
            call()


def test_the_math_graders_refuse_bad_input(math_verify):
    with pytest.raises(ValueError, match=r"got 2 completions but 1 `solution` values"):
        accuracy_reward(["a", "b"], ["1"])
    with pytest.raises(TypeError, match=r"`completions` as a list"):
        accuracy_reward(r"\boxed{1}", ["1"])
    with pytest.raises(TypeError, match=r"`solution` as a list"):
        accuracy_reward([r"\boxed{1}"], "1")
    with pytest.raises(TypeError, match=r"reasoning_delimiters.*list of non-empty strings"):
        reasoning_accuracy_reward(["a"], ["1"], reasoning_delimiters="</think>")
    with pytest.raises(ValueError, match=r"1 completions but 2 `completion_ids`"):
        get_cosine_scaled_reward(10)(["a"], ["1"], [[1], [2]])
    with pytest.raises(ValueError, match=r"`max_len` must be an integer >= 1; got 0"):
        get_cosine_scaled_reward(0)


# ---- format, length, repetition ----------------------------------------------------------------------------


@pytest.mark.parametrize("conversational", [True, False])
def test_think_format_reward(conversational):
    texts = [
        "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",  # TRL's example: 1.0
        "<think>\nThis is my reasoning.\nThis is my answer.",  # TRL's example: 0.0, never closed
        "<think></think>",
        " <think>a</think> b",  # must start with <think>
        "<think>a</think><think>b</think>",  # a second <think>
        "answer <think>a</think>",
    ]
    assert think_format_reward(as_format(texts, conversational)) == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]


def test_soft_overlong_punishment():
    punish = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert punish([[1] * 90]) == [-0.5]  # TRL's example
    lengths = [0, 80, 81, 99, 100, 101, 500]
    expected = [0.0, 0.0, -1 / 20, -19 / 20, -1.0, -1.0, -1.0]
    assert punish(completion_ids=[[7] * n for n in lengths]) == pytest.approx(expected)
    assert get_soft_overlong_punishment(10, 0)([[1] * 10, [1] * 11]) == [0.0, -1.0]  # no soft zone
    assert punish([torch.ones(90, dtype=torch.long)]) == [-0.5]
    for bad in (
        {"max_completion_len": 0, "soft_punish_cache": 0},
        {"max_completion_len": 10, "soft_punish_cache": -1},
    ):
        with pytest.raises(ValueError, match="must be an integer"):
            get_soft_overlong_punishment(**bad)


def test_repetition_penalty_reward():
    penalty = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    assert penalty([[1, 2, 3, 4], [5, 5, 5, 5, 5]]) == [0.0, -0.75]  # TRL's example
    # 3-grams of [1, 2, 1, 2, 1, 2]: 4, of which 2 distinct; fewer tokens than n: 0.0
    assert get_repetition_penalty_reward()([[1, 2, 1, 2, 1, 2], [1, 1], []]) == [-0.5, 0.0, 0.0]
    assert get_repetition_penalty_reward(1, -2.0)([torch.tensor([3, 3, 4, 4])]) == [-1.0]
    with pytest.raises(ValueError, match=r"max_penalty.*got 0.5"):
        get_repetition_penalty_reward(max_penalty=0.5)
    with pytest.raises(ValueError, match=r"`ngram_size` must be an integer >= 1; got 0"):
        get_repetition_penalty_reward(ngram_size=0)


def test_the_factories_return_picklable_functions_with_trls_names():
    made = {
        "cosine_scaled_reward": get_cosine_scaled_reward(64),
        "soft_overlong_punishment_reward": get_soft_overlong_punishment(64, 16),
        "repetition_penalty_reward": get_repetition_penalty_reward(),
    }
    for name, func in made.items():
        assert func.__name__ == name and RewardFunctionSource(func).name == name
        copy = pickle.loads(pickle.dumps(func))
        if name != "cosine_scaled_reward":
            assert copy([[1, 1, 1, 1] * 20]) == func([[1, 1, 1, 1] * 20])


# ---- as the trainers call them ---------------------------------------------------------------------------


def test_called_as_a_trainer_calls_them(math_verify):
    """Through :class:`RewardFunctionSource` (keyword arguments, dataset columns, ``log_extra``)."""
    batch = RewardBatch(
        prompts=[[{"role": "user", "content": "1/3?"}], [{"role": "user", "content": "1/3?"}]],
        completions=[rf"<think>ok</think>\boxed{{{THIRD}}}", r"\boxed{\frac{1}{2}}"],
        columns={"solution": [THIRD, THIRD], "difficulty": [1, 2]},
    )
    assert RewardFunctionSource(accuracy_reward).score(batch).tolist() == [1.0, 0.0]
    assert RewardFunctionSource(think_format_reward).score(batch).tolist() == [1.0, 0.0]
    assert batch.log.columns["solution"] == [THIRD, THIRD] and len(batch.log.columns["gold_parsed"]) == 2
    no_solution = RewardBatch(prompts=["q"], completions=[r"\boxed{1}"])
    with pytest.raises(ValueError, match=r"accuracy_reward.*requires the argument\(s\) \['solution'\]"):
        RewardFunctionSource(accuracy_reward).score(no_solution)


def test_grpo_trains_with_accuracy_reward(kit, tmp_path, math_verify):
    """TRL's GRPO quickstart shape: conversational prompts with a ``solution`` column, ``accuracy_reward``
    (and the soft overlong punishment, which reads ``completion_ids``) imported from here."""
    n = 16
    prompts = kit.prompt_dataset("train", n=n)["prompt"]
    solutions = [str(i) if i % 4 else "no math" for i in range(n)]  # every 4th gold is unparseable
    data = datasets.Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": p}] for p in prompts], "solution": solutions}
    )
    args = GRPOConfig(
        output_dir=str(tmp_path / "grpo"),
        per_device_train_batch_size=8,
        num_generations=2,
        max_completion_length=8,
        learning_rate=1e-3,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        num_sample_generations=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=[accuracy_reward, get_soft_overlong_punishment(8, 4)],
        args=args,
        train_dataset=data,
        processing_class=kit.load_tokenizer(),
    )
    trainer.train()
    assert trainer.state.global_step == 1
    rollout = trainer._last_rollout
    gold = rollout.reward_columns["solution"]
    assert len(gold) == len(rollout.completions) and set(gold) <= set(solutions)
    expected = accuracy_reward(rollout.completions, gold)
    scores = rollout.per_source["accuracy_reward"].cpu()
    assert [None if math.isnan(s) else s for s in scores.tolist()] == expected
    assert rollout.reward_columns["gold_parsed"] == [
        "[unparseable]" if g == "no math" else f"[{g}, '{g}']" for g in gold
    ]
    logged = next(h for h in trainer.state.log_history if "rewards/accuracy_reward/mean" in h)
    finite = scores[~scores.isnan()]  # the rows whose solution parses
    assert finite.numel() and logged["rewards/accuracy_reward/mean"] == pytest.approx(float(finite.mean()))
    assert "rewards/soft_overlong_punishment_reward/mean" in logged
    assert logged["grad_norm"] > 0 and logged["rollout/invalid_rewards"] == 0
