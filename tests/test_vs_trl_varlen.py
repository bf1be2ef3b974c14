"""benchmarks/vs_trl.py without models or TRL: the variable-length mode's prompts (``--stop-at-eos``), the
FLOPs of real tokens only and the rate over the measured updates; that both sides of a comparison run the
same job (models, prompts, settings) and the report's ratios are ours / TRL of the medians over repeats;
and the runs it refuses because they cannot be matched."""

from __future__ import annotations

import json
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


def _stub_runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """vs_trl.main() without models, TRL or subprocesses: every worker returns a made-up result whose
    rates depend on its side, algorithm and repeat; returns the specs the workers were given, in order."""
    specs: list[dict[str, Any]] = []

    def run_worker(python: str, spec: dict[str, Any], log_dir: Path, name: str) -> dict[str, Any]:
        specs.append(json.loads(json.dumps(spec)))
        impl, algo, rep = spec["impl"], spec["algo"], int(name.rsplit("-", 1)[1])
        batch = spec["settings"]["batch"]
        return {
            "impl": impl,
            "algo": algo,
            "label": f"{impl} {algo.upper()}",
            "versions": {"trl": "1.0", "vllm": "0.1"} if impl == "trl" else {"vllm": "0.1"},
            "settings": spec["settings"],
            "phases_median": {"policy": 0.1, "ref": 0.1, "total": 1.0},
            "sequence_lengths": [[[10, 8]] * batch] * 3,
            "update_seconds": [5.0, 1.0, 1.0],
            "seconds_per_update_median": 1.0,
            "tokens_per_update_median": 18.0 * batch,
            "response_length_stats": {"mean": 8.0, "min": 8, "max": 8, "at_limit": 0.0, "prompt_mean": 10.0},
            **RATES[(impl, algo, rep)],
            "rss_before_train_mib": 50.0,
            "rss_after_imports_mib": 10.0,
            "rss_after_loading_mib": 20.0,
            "parameters_mib": {"policy": 1.0},
            "gradients_mib": 1.0,
            "optimizer_state_mib": 2.0,
            "loadavg_start": [1.0, 1.0, 1.0],
            "loadavg_end": [1.0, 1.0, 1.0],
            "torch_threads": 1,
        }

    def prepare(work: Path, sizes: list[str], gguf: str | None, counts: tuple[int, ...] = ()) -> dict:
        folders = {s: {"policy": str(work / s / "policy"), "reward": str(work / s / "reward")} for s in sizes}
        return {"prompts": str(work / "prompts.json"), **folders}

    monkeypatch.setattr(vs_trl, "run_worker", run_worker)
    monkeypatch.setattr(vs_trl, "prepare_in_subprocess", prepare)
    monkeypatch.setattr(
        vs_trl,
        "interpreters",
        lambda args: {(i, a): f"python-{i}" for i in ("ours", "trl") for a in vs_trl.ALGOS},
    )
    monkeypatch.setattr(
        vs_trl,
        "matmul_in_subprocess",
        lambda sizes, repeats, threads=0, dtype="float32": {
            "best_median_flops_per_s": 1e9,
            "sizes": {str(n): {} for n in sizes},
        },
    )
    monkeypatch.setattr(vs_trl, "model_shapes", lambda info: {"policy": SHAPE, "reward": SHAPE})
    monkeypatch.setattr(vs_trl, "git_state", lambda: {"commit": "c"})
    return specs


#: Made-up (impl, algo, repeat) rates of the stub workers: medians over the two repeats are ours PPO
#: 4.0 episodes/s, 40 tokens/s, 110 MiB; ours RLOO 8.0, 40, 90 MiB; TRL 2.0, 40, 200 MiB on both.
RATES = {
    **{
        ("ours", algo, rep): {
            "episodes_per_sec": eps,
            "tokens_per_sec": [30.0, 50.0][rep],
            "peak_rss_mib": {"ppo": 100.0, "rloo": 80.0, "grpo": 80.0}[algo] + 20.0 * rep,
        }
        for algo, (eps0, eps1) in {"ppo": (3.0, 5.0), "rloo": (6.0, 10.0), "grpo": (6.0, 10.0)}.items()
        for rep, eps in enumerate((eps0, eps1))
    },
    **{
        ("trl", algo, rep): {"episodes_per_sec": 2.0, "tokens_per_sec": 40.0, "peak_rss_mib": 200.0}
        for algo in vs_trl.ALGOS
        for rep in (0, 1)
    },
}


@pytest.mark.parametrize(
    "argv",
    [
        ["--sizes", "135m", "--algos", "ppo,rloo", "--stop-at-eos"],
        ["--sizes", "tiny", "--algos", "rloo,grpo", "--vllm"],
    ],
    ids=["stop-at-eos", "vllm"],
)
def test_both_sides_run_the_same_job_and_the_report_holds_the_ratios_of_the_medians(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    specs = _stub_runs(monkeypatch)
    out, work = tmp_path / "out", tmp_path / "work"
    common = ["--updates", "3", "--repeats", "2", "--batch", "8", "--rloo-k", "2", "--num-generations", "2"]
    monkeypatch.setattr(
        sys, "argv", ["vs_trl.py", *argv, *common, "--work-dir", str(work), "--out", str(out)]
    )
    vs_trl.main()

    size, algos = argv[1], argv[3].split(",")
    assert [(s["algo"], s["impl"]) for s in specs] == [
        (algo, impl)
        for algo in algos
        for impl in ("ours", "trl", "trl", "ours")  # repeat 1: TRL first
    ]
    # each pair of runs: the same models, prompts and settings, only the side differs
    for ours, trl in zip(specs[0::2], specs[1::2], strict=True):
        assert {**ours, "impl": None} == {**trl, "impl": None}
    settings = specs[0]["settings"]
    assert all(s["settings"] == settings for s in specs)
    given = {"batch": 8, "rloo_k": 2, "num_generations": 2, "updates": 3}
    assert {key: settings[key] for key in given} == given
    if "--stop-at-eos" in argv:
        assert settings["fixed_length"] is False
        # one prompt per prompt of an update: PPO's 8, RLOO's 8 / rloo_k
        assert [s["prompts"] for s in specs[::4]] == [
            str(vs_trl.varlen_prompt_file(work, "135m", 8)),
            str(vs_trl.varlen_prompt_file(work, "135m", 4)),
        ]
    else:
        assert settings["fixed_length"] is True and settings["use_vllm"] is True
        assert all(s["prompts"] == str(work / "prompts.json") for s in specs)

    report = json.loads((out / "vs_trl.json").read_text())
    assert (out / "vs_trl.md").is_file()
    assert report["settings"] == {k: v for k, v in settings.items() if k != "updates"}
    assert report["updates"] == {size: 3} and report["trl_versions"] == ["1.0"]
    assert len(report["results"]) == 4 * len(algos)
    for r in report["results"]:
        assert r["size"] == size and r["fraction_of_matmul_rate"] == pytest.approx(
            r["model_flops_per_sec"] / 1e9
        )
    expected = {
        f"{size} {algo}": {
            "episodes_per_sec_ours_over_trl": {"ppo": 4.0, "rloo": 8.0, "grpo": 8.0}[algo] / 2.0,
            "tokens_per_sec_ours_over_trl": 1.0,
            "peak_rss_ours_over_trl": {"ppo": 110.0, "rloo": 90.0, "grpo": 90.0}[algo] / 200.0,
        }
        for algo in algos
    }
    if "ppo" in algos and "rloo" in algos:
        expected[f"{size} ours"] = {"rloo_peak_rss_over_ppo": 90.0 / 110.0}
    assert report["ratios"].keys() == expected.keys()
    for pair, values in expected.items():
        assert report["ratios"][pair] == pytest.approx(values), pair
    assert report["unmatched_settings"] and all(isinstance(n, str) for n in report["unmatched_settings"])


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
