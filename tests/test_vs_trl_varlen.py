"""benchmarks/vs_trl.py's variable-length mode (``--stop-at-eos``, issue #24) without models or TRL: the
prompts it writes, the FLOPs of real tokens only, the rate over the measured updates, and its report."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import flops  # noqa: E402
import vs_trl  # noqa: E402

SHAPE = {"body_linear_params": 1000, "lm_head_params": 300, "hidden_size": 16, "num_layers": 2}


class TemplateStub:
    """A tokenizer whose chat template only wraps the user's message."""

    def apply_chat_template(
        self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool
    ) -> str:
        assert not tokenize and add_generation_prompt
        return f"<user>{messages[0]['content']}<assistant>"


def test_every_four_consecutive_prompts_ask_for_each_length_once() -> None:
    prompts = vs_trl.varlen_prompts(TemplateStub(), 40)
    assert len(prompts) == len(set(prompts)) == 40
    for start in range(0, 40, 4):
        styles = [next(s for s in vs_trl.VARLEN_STYLES if s in p) for p in prompts[start : start + 4]]
        assert sorted(styles) == sorted(vs_trl.VARLEN_STYLES)
    assert all(p.startswith("<user>Tell me about ") and p.endswith("<assistant>") for p in prompts)


@pytest.mark.parametrize(("impl", "algo"), sorted(flops.PASSES))
def test_rows_of_equal_length_give_the_fixed_length_flops(impl: str, algo: str) -> None:
    fixed = flops.update_flops(impl, algo, SHAPE, SHAPE, 3, 10.0, 8, 2)
    rows = flops.update_flops(impl, algo, SHAPE, SHAPE, 0, 0.0, 0, 2, rows=[(10, 8)] * 3)
    assert rows == pytest.approx(fixed)


def test_short_responses_count_only_their_own_tokens() -> None:
    mixed = flops.update_flops("trl", "rloo", SHAPE, SHAPE, 0, 0.0, 0, 1, rows=[(10, 2), (10, 64)])
    short = flops.update_flops("trl", "rloo", SHAPE, SHAPE, 1, 10.0, 2, 1)
    long = flops.update_flops("trl", "rloo", SHAPE, SHAPE, 1, 10.0, 64, 1)
    padded = flops.update_flops("trl", "rloo", SHAPE, SHAPE, 2, 10.0, 64, 1)
    assert mixed["total"] == pytest.approx(short["total"] + long["total"])
    assert mixed["total"] < padded["total"]


def varlen_result(impl: str = "ours") -> dict[str, Any]:
    return {
        "impl": impl,
        "algo": "rloo",
        "label": f"{impl} RLOO",
        "size": "135m",
        "repeat": 0,
        "settings": {"batch": 2, "response_length": 64, "epochs": 2, "fixed_length": False},
        "phases_median": {"policy": 0.0, "ref": 1.0},
        "sequence_lengths": [[[10, 64], [10, 64]], [[10, 3], [12, 40]], [[10, 5], [12, 64]]],
        "update_seconds": [100.0, 2.0, 3.0],
        "seconds_per_update_median": 2.5,
        "tokens_per_update_median": 70.0,
        "response_length_stats": {"mean": 28.0, "min": 3, "max": 64, "at_limit": 0.25, "prompt_mean": 11.0},
    }


def test_the_rate_sums_the_measured_updates_real_tokens_over_their_seconds() -> None:
    result = varlen_result()
    vs_trl.add_flops(result, {"policy": SHAPE, "reward": SHAPE}, 1e6)
    measured = ([(10, 3), (12, 40)], [(10, 5), (12, 64)])  # updates 2-3; the first (100 s) is left out
    each = [
        flops.update_flops("ours", "rloo", SHAPE, SHAPE, 0, 0.0, 0, 2, policy_forward=False, rows=rows)
        for rows in measured
    ]
    each = [f["total"] for f in each]
    assert result["model_flops_per_sec"] == pytest.approx(sum(each) / 5.0)
    assert result["model_flops_per_update"]["total"] == pytest.approx(sum(each) / 2)
    assert result["fraction_of_matmul_rate"] == pytest.approx(sum(each) / 5.0 / 1e6)
    assert "policy" not in result["model_flops_per_update"]  # ours took its log-probs from sampling


def test_the_report_states_the_variable_length_job() -> None:
    notes = vs_trl.unmatched_notes(["ppo", "rloo"], fixed_length=False)
    assert vs_trl.VARLEN_NOTE in notes
    assert not any(n.startswith(vs_trl.FIXED_LENGTH_NOTES_START) for n in notes)
    assert any(n.startswith("Fixed-length responses:") for n in vs_trl.unmatched_notes(["rloo"]))
    results = [varlen_result("ours"), varlen_result("trl")]
    for r in results:
        vs_trl.add_flops(r, {"policy": SHAPE, "reward": SHAPE}, 1e6)
        r.update(
            episodes_per_sec=1.0,
            tokens_per_sec=30.0,
            peak_rss_mib=100.0,
            rss_before_train_mib=50.0,
            loadavg_start=(1.0, 1.0, 1.0),
            loadavg_end=(1.0, 1.0, 1.0),
            rss_after_imports_mib=10.0,
            rss_after_loading_mib=20.0,
            parameters_mib={"policy": 1.0},
            gradients_mib=1.0,
            optimizer_state_mib=2.0,
            torch_threads=1,
        )
    report = {
        "settings": {**results[0]["settings"], "mini_batches": 1, "rloo_k": 2},
        "results": results,
        "unmatched_settings": notes,
        "ratios": vs_trl.ratios(results),
        "settings_text": "settings",
    }
    text = "\n".join(vs_trl.table(report))
    assert "| 135m | ours RLOO | 70 | 28.0 | 3 | 64 | 25 % | 11.0 |" in text
    report.update(machine="m", torch="t", transformers="x", trl_versions=["1"], updates={"135m": 3})
    report["matmul"] = {"sizes": {"1024": {}}}
    assert "response_length 64 (at most; responses stop at EOS)" in vs_trl.settings_text(report)


def test_a_vllm_report_describes_vllm_generation_on_both_sides_not_the_builtin_loop() -> None:
    builtin = vs_trl.unmatched_notes(["rloo"], fixed_length=False)
    notes = vs_trl.unmatched_notes(["rloo", "grpo"], fixed_length=False, vllm=True)
    assert vs_trl.SAMPLER_NOTE in builtin and vs_trl.SAMPLER_NOTE not in notes
    assert not any(n.startswith(vs_trl.BUILTIN_GENERATION_NOTES_START) for n in notes)
    assert all(n in notes for n in vs_trl.VLLM_NOTES)
    assert any("reload_weights" in n for n in notes)  # the one change on TRL's side is stated
    assert any("bfloat16" in n for n in notes)  # and the engines' precisions
    result = {**varlen_result(), "versions": {"vllm": "0.32.0"}, "torch_threads": 1}
    result["model_flops_per_sec"], result["fraction_of_matmul_rate"] = 2.0, 0.5
    report = {
        "settings": {**result["settings"], "mini_batches": 1, "rloo_k": 2, "use_vllm": True},
        "results": [result],
        "machine": "m",
        "torch": "t",
        "transformers": "x",
        "trl_versions": ["1"],
        "updates": {"135m": 3},
        "matmul": {"sizes": {"1024": {}}},
    }
    assert "generation: vLLM 0.32.0 colocated on both sides" in vs_trl.settings_text(report)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--algos", "ppo", "--vllm"], "TRL's PPO (1.12) has no vLLM path"),
        (["--algos", "grpo", "--vllm", "--trl-generation", "continuous_batching"], "choose one generation"),
    ],
)
def test_vllm_runs_that_cannot_be_matched_are_refused(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["vs_trl.py", "--sizes", "135m", *argv])
    with pytest.raises(SystemExit, match=re.escape(message)):
        vs_trl.main()
