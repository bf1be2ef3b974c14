"""benchmarks/learning_vs_trl_real.py and the parts of benchmarks/vs_trl_worker.py it adds: the reward
function's column check, the datasets both sides train on, that both sides of a seed train the same job,
and the summary (no models, no TRL)."""

from __future__ import annotations

import json
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


def test_both_sides_train_the_same_job_and_the_report_holds_the_summary(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """main() without models, TRL or subprocesses: every worker returns a made-up learning curve."""
    specs: list[dict[str, Any]] = []
    curves = {  # (impl, seed): success at each evaluation (the reward is half of it)
        ("ours", 0): [0.0, 0.25],
        ("ours", 1): [0.0, 0.75],
        ("trl", 0): [0.0, 0.0],
        ("trl", 1): [0.5, 0.5],
    }

    def run_worker(python: str, spec: dict[str, Any], log_dir: Path, name: str) -> dict[str, Any]:
        specs.append(json.loads(json.dumps(spec)))
        success = curves[(spec["impl"], spec["settings"]["seed"])]
        return _run(spec["impl"], spec["settings"]["seed"], success, [x / 2 for x in success])

    assets = {"policy": str(tmp_path / "policy"), "rows": str(tmp_path / "rows.json"), "train_rows": 9}
    monkeypatch.setattr(driver, "run_worker", run_worker)
    monkeypatch.setattr(driver, "run_prepare", lambda cmd: {**assets, "test_rows": 3})
    monkeypatch.setattr(driver, "interpreters", lambda args: {"ours": "python-ours", "trl": "python-trl"})
    monkeypatch.setattr(driver, "plot", lambda report, path: None)  # matplotlib: the `demo` extra
    monkeypatch.setattr(driver, "git_state", lambda: {"commit": "c"})
    argv = ["--seeds", "0,1", "--updates", "4", "--batch", "8", "--rloo-k", "2", "--work-dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["learning_vs_trl_real.py", *argv, "--out", str(tmp_path / "out")])
    driver.main()

    # seed 1: TRL first
    assert [(s["impl"], s["settings"]["seed"]) for s in specs] == [
        ("ours", 0),
        ("trl", 0),
        ("trl", 1),
        ("ours", 1),
    ]
    # each seed's two runs: the same policy, task rows and settings, only the side differs
    for ours, trl in zip(specs[0::2], specs[1::2], strict=True):
        assert {**ours, "impl": None} == {**trl, "impl": None}
    settings = specs[0]["settings"]
    assert (settings["batch"], settings["rloo_k"], settings["updates"]) == (8, 2, 4)
    assert settings["lr_scheduler_type"] == "constant" and settings["fixed_length"] is False
    assert specs[0]["task"]["rows"] == assets["rows"] and specs[0]["policy"] == assets["policy"]

    report = json.loads((tmp_path / "out" / f"{driver.NAME}.json").read_text())
    assert (tmp_path / "out" / f"{driver.NAME}.md").is_file()
    assert report["settings"] == {k: v for k, v in settings.items() if k != "seed"}
    assert report["trl_versions"] == ["1.16.0"] and len(report["results"]) == 4
    summary = report["summary"]
    assert summary["rloo ours"]["success"]["gains"] == [0.25, 0.75]
    assert summary["rloo trl"]["success"]["gains"] == [0.0, 0.0]
    assert summary["rloo ours - trl mean gain"] == pytest.approx({"success": 0.5, "reward": 0.25})
