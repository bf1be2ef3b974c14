"""TRL 1.x's metric names (issue #48): GRPOTrainer and RLOOTrainer log TRL 1.16's GRPOTrainer /
RLOOTrainer keys beside their own, with the same values where both mean the same thing; every on-policy
trainer logs ``transformers.Trainer``'s end-of-run entry (``train_runtime``, ``train_loss``) to the
callbacks; ``evaluate()`` returns TRL's ``eval_*`` keys and Trainer's ``eval_runtime``. Every key these
runs log is explained in docs/metrics.md.

Two updates each on the offline kit, one process; the definitions against hand computations of TRL's
formulas on small tensors.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerCallback

from rlhf_trainers import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer
from rlhf_trainers.onpolicy.metrics import (
    Collectives,
    MicroBatchReductions,
    trl_clip_metrics,
    trl_sample_metrics,
)
from rlhf_trainers.testing import true_reward

DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"

#: TRL 1.16's training keys of GRPOTrainer and RLOOTrainer (one reward function, ``true_reward``, and a
#: KL term), what a dashboard built for TRL reads.
TRL_TRAIN_KEYS = (
    "loss",
    "grad_norm",
    "learning_rate",
    "num_tokens",
    "reward",
    "reward_std",
    "rewards/true_reward/mean",
    "rewards/true_reward/std",
    "frac_reward_zero_std",
    "entropy",
    "kl",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
    "clip_ratio/region_mean",
)
#: What ``evaluate()`` returns of TRL's keys (see docs/grpo.md for those it does not).
TRL_EVAL_KEYS = (
    "eval_runtime",
    "eval_samples_per_second",
    "eval_steps_per_second",
    "eval_num_tokens",
    "eval_reward",
    "eval_reward_std",
    "eval_rewards/true_reward/mean",
    "eval_rewards/true_reward/std",
    "eval_completions/mean_length",
    "eval_completions/min_length",
    "eval_completions/max_length",
    "eval_completions/clipped_ratio",
    "eval_completions/mean_terminated_length",
    "eval_completions/min_terminated_length",
    "eval_completions/max_terminated_length",
)
SUMMARY_KEYS = (
    "train_runtime",
    "train_samples_per_second",
    "train_steps_per_second",
    "total_flos",
    "train_loss",
)

COMMON = {
    "learning_rate": 1e-3,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "use_cpu": True,
    "seed": 0,
    "num_sample_generations": 0,
    "disable_tqdm": True,
}


class Heard(TrainerCallback):
    """The entries the callbacks receive in ``on_log``."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def _grpo(kit, tmp_path, heard: Heard) -> GRPOTrainer:
    # 2 generations of 2 optimizer steps each: a logged update spans several Trainer steps
    args = GRPOConfig(
        output_dir=str(tmp_path / "grpo"),
        **COMMON,
        num_generations=4,
        max_completion_length=8,
        per_device_train_batch_size=8,
        steps_per_generation=2,
        beta=0.04,
        max_steps=4,
    )
    return GRPOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=true_reward,
        args=args,
        train_dataset=kit.prompt_dataset("train", n=32),
        eval_dataset=kit.prompt_dataset("test", n=8),
        processing_class=kit.load_tokenizer(),
        callbacks=[heard],
    )


def _rloo(kit, tmp_path, heard: Heard) -> RLOOTrainer:
    args = RLOOConfig(
        output_dir=str(tmp_path / "rloo"),
        **COMMON,
        rloo_k=4,
        per_device_train_batch_size=8,
        num_ppo_epochs=2,
        num_mini_batches=2,
        response_length=8,
        temperature=1.0,
        max_steps=2,
    )
    return RLOOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=true_reward,
        args=args,
        train_dataset=kit.prompt_dataset("train", n=32),
        eval_dataset=kit.prompt_dataset("test", n=8),
        processing_class=kit.load_tokenizer(),
        callbacks=[heard],
    )


@pytest.fixture(scope="module", params=["grpo", "rloo"])
def run(request, kit, tmp_path_factory):
    """A trained GRPO or RLOO trainer, what its callbacks heard, its TrainOutput and its evaluation."""
    heard = Heard()
    build = _grpo if request.param == "grpo" else _rloo
    trainer = build(kit, tmp_path_factory.mktemp(request.param), heard)
    output = trainer.train()
    evaluation = trainer.evaluate()
    return request.param, trainer, heard, output, evaluation


def _updates(trainer) -> list[dict[str, float]]:
    return [h for h in trainer.state.log_history if "objective/scores" in h]


def test_trl_training_keys_are_logged_at_every_update(run):
    _, trainer, heard, _, _ = run
    updates = _updates(trainer)
    assert len(updates) == 2
    for entry in updates:
        missing = [k for k in TRL_TRAIN_KEYS if k not in entry]
        assert not missing, (missing, sorted(entry))
        assert all(math.isfinite(entry[k]) for k in TRL_TRAIN_KEYS), entry
    # the callbacks heard the same entries
    assert [h for h in heard.logs if "objective/scores" in h] == [
        {k: v for k, v in h.items() if k != "step"} for h in updates
    ]


def test_trl_values_agree_with_ours_where_they_mean_the_same(run):
    algorithm, trainer, _, _, _ = run
    for entry in _updates(trainer):

        def same(a: str, b: float, entry: dict[str, float] = entry) -> None:
            assert entry[a] == pytest.approx(b, rel=1e-5, abs=1e-6), (a, entry[a], b)

        # no score shaping: the reward before shaping is the shaped score
        same("reward", entry["objective/raw_scores"])
        same("reward", entry["objective/scores"])
        same("rewards/true_reward/mean", entry["objective/scores/true_reward"])
        same("completions/mean_length", entry["val/response_length"])
        same("completions/clipped_ratio", 1.0 - entry["val/stop_token_rate"])
        same("loss", entry["loss/policy_avg"])
        # one process, micro-batches of one size: TRL's per-micro-batch token mean is ours
        same("entropy", entry["policy/entropy_avg"])
        assert (
            entry["completions/min_length"]
            <= entry["completions/mean_length"]
            <= entry["completions/max_length"]
        )
        assert (
            entry["completions/min_terminated_length"]
            <= entry["completions/mean_terminated_length"]
            <= entry["completions/max_terminated_length"]
        )
        assert entry["reward_std"] >= 0 and entry["rewards/true_reward/std"] >= 0
        # the low and high clips are disjoint (negative vs positive advantages); together they are where
        # the clip binds
        same("clip_ratio/region_mean", entry["clip_ratio/low_mean"] + entry["clip_ratio/high_mean"])
        same("clip_ratio/region_mean", entry["policy/clipfrac_avg"])
        for name in (
            "clip_ratio/low_mean",
            "clip_ratio/high_mean",
            "clip_ratio/low_min",
            "clip_ratio/high_max",
        ):
            assert 0.0 <= entry[name] <= 1.0, (name, entry[name])
        assert entry["clip_ratio/low_min"] <= entry["clip_ratio/low_mean"] + 1e-7
        assert entry["clip_ratio/high_max"] >= entry["clip_ratio/high_mean"] - 1e-7
        assert 0.0 <= entry["frac_reward_zero_std"] <= 1.0
        if algorithm == "grpo":
            same("frac_reward_zero_std", entry["objective/frac_reward_zero_std"])
            same("kl", entry["policy/kl_loss_avg"])  # the loss term's k3 estimate (beta)
        else:
            # the reward's KL per token: the per-completion sum over the mean completion length
            same("kl", entry["objective/kl"] / entry["val/response_length"])
    assert [e["episode"] for e in _updates(trainer)] == [trainer.batch_size, 2 * trainer.batch_size]


def test_learning_rate_and_num_tokens_are_logged_as_trl_logs_them(run):
    algorithm, trainer, _, _, _ = run
    updates = _updates(trainer)
    args = trainer.args
    total = trainer.num_updates * trainer.steps_per_update
    for entry in updates:
        # Trainer's learning_rate: the rate of the last optimizer step of the logged step (linear decay)
        last_step = entry["step"] - 1
        assert entry["learning_rate"] == pytest.approx(args.learning_rate * (1 - last_step / total))
        first_step = entry["step"] - trainer.steps_per_update
        assert entry["lr"] == pytest.approx(args.learning_rate * (1 - first_step / total))
    if algorithm == "grpo":
        assert trainer.steps_per_update == 2 and updates[0]["learning_rate"] != updates[0]["lr"]
    # prompt and completion tokens so far: more than the completions' tokens, growing by at least those
    completion_tokens = [e["completions/mean_length"] * trainer.batch_size for e in updates]
    assert updates[0]["num_tokens"] > completion_tokens[0]
    assert updates[1]["num_tokens"] - updates[0]["num_tokens"] > completion_tokens[1]
    assert updates[1]["num_tokens"] == trainer.state.num_input_tokens_seen


def test_train_logs_trainers_final_entry_and_callbacks_hear_it(run):
    _, trainer, heard, output, _ = run
    final = trainer.state.log_history[-2]  # (the last entry is the evaluation's)
    assert "eval_reward" in trainer.state.log_history[-1]
    assert set(SUMMARY_KEYS) <= set(final), sorted(final)
    assert final["step"] == trainer.state.global_step
    summary = heard.logs[-2]
    heard_keys = [k for k in SUMMARY_KEYS if k != "total_flos"]  # (Trainer's printer callback pops it)
    assert {k: summary[k] for k in heard_keys} == {k: final[k] for k in heard_keys}
    assert final["train_loss"] == pytest.approx(output.training_loss)
    losses = [e["loss/policy_avg"] for e in _updates(trainer)]
    assert final["train_loss"] == pytest.approx(sum(losses) / len(losses))
    assert final["train_runtime"] == output.metrics["train_runtime"] > 0
    assert final["train_steps_per_second"] == output.metrics["train_steps_per_second"] > 0
    assert output.metrics["interrupted"] is False


def test_evaluate_returns_trls_keys(run):
    _, trainer, _, _, evaluation = run
    missing = [k for k in TRL_EVAL_KEYS if k not in evaluation]
    assert not missing, (missing, sorted(evaluation))
    assert evaluation["eval_reward"] == pytest.approx(evaluation["eval_objective/scores"])
    assert evaluation["eval_rewards/true_reward/mean"] == pytest.approx(
        evaluation["eval_objective/scores/true_reward"]
    )
    assert evaluation["eval_completions/mean_length"] == pytest.approx(evaluation["eval_val/response_length"])
    assert evaluation["eval_completions/clipped_ratio"] == pytest.approx(
        1 - evaluation["eval_val/stop_token_rate"]
    )
    assert evaluation["eval_num_tokens"] == trainer.state.num_input_tokens_seen
    assert evaluation["eval_runtime"] > 0
    # no loss on evaluation batches: one completion per prompt has no group baseline (docs/grpo.md)
    assert "eval_loss" not in evaluation


def _documented_names(key: str) -> set[str]:
    """How docs/metrics.md may write a logged key: as it is, or without the ``eval_`` prefix; with
    ``<source>`` for the reward source's name."""
    key = re.sub(r"(rewards|objective/scores)/true_reward", r"\1/<source>", key)
    return {key, key.removeprefix("eval_")}


def test_docs_explain_every_key_these_runs_log(run):
    _, trainer, _, _, evaluation = run
    keys = ({k for h in trainer.state.log_history for k in h} | set(evaluation)) - {"step"}
    text = DOCS.read_text(encoding="utf-8")
    missing = sorted(k for k in keys if not any(f"`{n}`" in text for n in _documented_names(k)))
    assert not missing, f"docs/metrics.md does not explain these logged keys: {missing}"


def test_ppo_keeps_its_names_and_logs_the_final_entry(kit, tmp_path):
    heard = Heard()
    trainer = PPOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=true_reward,
        args=PPOConfig(
            output_dir=str(tmp_path / "ppo"),
            **COMMON,
            per_device_train_batch_size=8,
            response_length=8,
            max_steps=1,
        ),
        train_dataset=kit.prompt_dataset("train", n=16),
        processing_class=kit.load_tokenizer(),
        callbacks=[heard],
    )
    output = trainer.train()
    update, final = trainer.state.log_history
    assert "objective/scores" in update and "lr" in update
    assert not {"reward", "entropy", "learning_rate", "num_tokens", "clip_ratio/low_mean"} & set(update)
    assert set(SUMMARY_KEYS) <= set(final) and final["train_loss"] == pytest.approx(output.training_loss)
    assert heard.logs[-1]["train_runtime"] == final["train_runtime"]


# ---- the definitions, by hand ---------------------------------------------------------------------


def _one_process() -> Collectives:
    return Collectives(SimpleNamespace(num_processes=1, device=torch.device("cpu")))


def test_clip_ratios_follow_trls_definition():
    ratio = torch.tensor([[0.7, 1.0, 1.3, 9.0], [0.5, 1.5, 1.0, 1.0]])
    advantages = torch.tensor([[-1.0], [1.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    got = trl_clip_metrics(ratio.log(), advantages, mask, clip_low=0.2, clip_high=0.28)
    # row 0 (A < 0): 0.7 is low-clipped; 1.3 is above 1.28 but the advantage is negative; 9.0 is masked.
    # row 1 (A > 0): 1.5 is high-clipped; 0.5 is below 0.8 but the advantage is positive.
    assert got["clip_ratio/low_mean"].tolist() == [1.0, 7.0]
    assert got["clip_ratio/high_mean"].tolist() == [1.0, 7.0]
    assert got["clip_ratio/region_mean"].tolist() == [2.0, 7.0]
    assert float(got["clip_ratio/low_min"]) == 0.0  # row 1 has no low-clipped token
    assert float(got["clip_ratio/high_max"]) == pytest.approx(0.25)  # row 1: 1 of 4 tokens
    # one ratio per sequence (RLOO's default): shares of sequences
    seq = trl_clip_metrics(
        torch.tensor([[0.5], [1.5], [0.5]]).log(),
        torch.tensor([[-1.0], [1.0], [1.0]]),
        torch.tensor([[True], [True], [False]]),
        clip_low=0.2,
        clip_high=0.2,
    )
    assert seq["clip_ratio/low_mean"].tolist() == [1.0, 2.0]
    assert seq["clip_ratio/high_mean"].tolist() == [1.0, 2.0]
    assert float(seq["clip_ratio/low_min"]) == 0.0 and float(seq["clip_ratio/high_max"]) == 1.0


def test_micro_batch_reductions_average_the_micro_batches_global_means():
    for per_micro_batch, expected_mean in ((True, (1 / 4 + 6 / 6) / 2), (False, 7 / 10)):
        reductions = MicroBatchReductions(per_micro_batch)
        reductions.add("entropy", torch.tensor([1.0, 4.0]), step=0)
        reductions.add("entropy", torch.tensor([6.0, 6.0]), step=0)
        reductions.add("clip_ratio/low_min", torch.tensor(0.5), step=0)
        reductions.add("clip_ratio/low_min", torch.tensor(0.0), step=0)
        reductions.add("clip_ratio/low_min", torch.tensor(math.nan), step=1)  # no sequence: left out
        reductions.add("clip_ratio/low_min", torch.tensor(0.25), step=1)
        got = reductions.reduce(_one_process())
        assert got["entropy"] == pytest.approx(expected_mean)
        if per_micro_batch:  # micro-batches 0.5, 0.0, (none), 0.25
            assert got["clip_ratio/low_min"] == pytest.approx(0.75 / 3)
        else:  # steps: min(0.5, 0.0) = 0 and min(0.25) = 0.25
            assert got["clip_ratio/low_min"] == pytest.approx((0.0 + 0.25) / 2)
    assert MicroBatchReductions.handles("kl") and not MicroBatchReductions.handles("loss")


def test_sample_metrics_follow_trls_definitions():
    nan = math.nan
    total = torch.tensor([1.0, nan, 3.0, 0.0])
    per_source = {"f": torch.tensor([1.0, nan, 3.0, 0.0]), "g": torch.tensor([nan, nan, 2.0, 4.0])}
    lengths = torch.tensor([4, 8, 2, 8])
    found_stop = torch.tensor([True, False, True, False])
    prompts = torch.tensor([3, 3, 5, 5])
    metrics, tokens = trl_sample_metrics(total, per_source, lengths, found_stop, prompts, _one_process())
    assert metrics["reward"] == pytest.approx(4 / 3)
    assert metrics["reward_std"] == pytest.approx(torch.tensor([1.0, 3.0, 0.0]).std().item())  # unbiased
    assert metrics["rewards/g/mean"] == pytest.approx(3.0)
    assert metrics["rewards/g/std"] == pytest.approx(math.sqrt(2))
    assert metrics["completions/mean_length"] == 5.5
    assert (metrics["completions/min_length"], metrics["completions/max_length"]) == (2, 8)
    assert metrics["completions/clipped_ratio"] == 0.5
    assert metrics["completions/mean_terminated_length"] == 3.0
    assert (metrics["completions/min_terminated_length"], metrics["completions/max_terminated_length"]) == (
        2,
        4,
    )
    assert tokens == 22 + 16
    # rows left out (evaluation's repeated rows); no completion terminated: TRL's 0
    metrics, _ = trl_sample_metrics(
        total,
        per_source,
        lengths,
        found_stop,
        prompts,
        _one_process(),
        keep=torch.tensor([0, 1, 0, 1]).bool(),
    )
    assert (
        metrics["completions/mean_terminated_length"] == 0.0 and metrics["completions/clipped_ratio"] == 1.0
    )
    assert metrics["reward"] == 0.0 and math.isnan(metrics["reward_std"])  # one completion with a reward
