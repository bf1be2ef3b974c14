"""benchmarks/learning_vs_trl_real.py and the parts of benchmarks/vs_trl_worker.py it adds: the reward
function's column check, the datasets both sides train on, and the summary (no models, no TRL)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import learning_vs_trl_real as driver  # noqa: E402
import vs_trl_worker as worker  # noqa: E402


def test_task_module_loads_by_path_and_the_reward_sees_the_columns() -> None:
    module = worker.load_task_module(str(driver.TASK_PY))
    rows = module.task_rows("addition", "test", n=2)
    seen: set[str] = set()
    reward = worker.checked_reward_function(module, "addition", ["answer"], seen)
    answers = [r["answer"] for r in rows]
    completions = [str(answers[0]), "no idea"]
    got = reward(prompts=[r["prompt"] for r in rows], completions=completions, answer=answers)
    assert got == module.reward_function("addition")(
        prompts=[r["prompt"] for r in rows], completions=completions, answer=answers
    )
    assert got[0] == 1.0 and got[1] == 0.0
    assert {"prompts", "completions", "answer"} <= seen
    # A trainer that drops the dataset's columns must fail the run, not train on a constant reward.
    with pytest.raises(RuntimeError, match="answer"):
        reward(prompts=[r["prompt"] for r in rows], completions=completions)


def test_prompt_dataset_keeps_chat_prompts_and_columns() -> None:
    rows = [{"prompt": [{"role": "user", "content": "What is 1 + 2?"}], "answer": 3}]
    dataset = worker.prompt_dataset(rows)
    assert dataset.column_names == ["prompt", "answer"]
    assert dataset[0]["prompt"][0]["content"] == "What is 1 + 2?" and dataset[0]["answer"] == 3
    assert worker.prompt_dataset(["a", "b"]).column_names == ["prompt"]


def _run(impl: str, seed: int, success: list[float], reward: list[float]) -> dict[str, Any]:
    return {
        "impl": impl,
        "algo": "rloo",
        "settings": {"seed": seed},
        "versions": {"trl": "1.16.0"} if impl == "trl" else {},
        "train_wall_s": 100.0,
        "eval_wall_s": 20.0,
        "final_kl": 1.5,
        "reward_kwargs_seen": ["answer", "completions", "prompts"],
        "evals": [
            {"update": i, "episodes": 16 * i, "success": s, "reward": r}
            for i, (s, r) in enumerate(zip(success, reward, strict=True))
        ],
    }


def test_summary_compares_gains_at_equal_episodes() -> None:
    results = [
        _run("ours", 0, [0.0, 0.25], [0.1, 0.4]),
        _run("ours", 1, [0.0, 0.75], [0.2, 0.3]),
        _run("trl", 0, [0.0, 0.0], [0.1, 0.2]),
        _run("trl", 1, [0.5, 0.5], [0.2, 0.2]),
    ]
    summary = driver.summarize(results)
    ours, trl = summary["rloo ours"], summary["rloo trl"]
    assert ours["success"]["gains"] == [0.25, 0.75] and ours["success"]["mean_gain"] == 0.5
    assert ours["success"]["mean_curve"] == [0.0, 0.5]
    assert trl["reward"]["gains"] == pytest.approx([0.1, 0.0])
    assert summary["rloo ours - trl mean gain"]["success"] == pytest.approx(0.5)
    assert summary["rloo ours - trl mean gain"]["reward"] == pytest.approx(0.2 - 0.05)
    assert ours["train_wall_s_mean"] == 80.0


def test_table_lists_both_measures_and_what_differs() -> None:
    results = [_run("ours", 0, [0.0, 0.5], [0.1, 0.4]), _run("trl", 0, [0.0, 0.25], [0.1, 0.3])]
    report = {"results": results, "trl_versions": ["1.16.0"], "settings_text": "settings"}
    report["summary"] = driver.summarize(results)
    text = "\n".join(driver.table(report))
    assert "| ours RLOO | 0 | held-out success (strict) | 0.000 | 0.500 | +0.500 | +0.500 |" in text
    assert "| TRL 1.16.0 RLOO | 0 | held-out reward (shaped) | 0.100 | 0.300 | +0.200 | +0.200 |" in text
    assert "ours - TRL mean gain = +0.250 (success)" in text
    assert all(note in text for note in driver.NOTES)
