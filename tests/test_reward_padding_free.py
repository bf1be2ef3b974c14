"""RewardTrainer's padding-free passes (RewardConfig.padding_free): the same losses, rewards, gradients and
logged metrics as padded passes, on pairs whose sides have very different lengths."""

from __future__ import annotations

import logging

import datasets
import pytest
import torch

from rlhf_trainers import RewardConfig, RewardTrainer
from rlhf_trainers.compat import enable_activation_checkpointing
from rlhf_trainers.reward import packed as packed_module
from rlhf_trainers.reward.packed import RewardPacking


def _config(tmp_path, **overrides) -> RewardConfig:
    fields = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 16,
        "learning_rate": 3e-3,
        "num_train_epochs": 1,
        "logging_steps": 2,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
        "max_length": 64,
        "disable_tqdm": True,
    }
    fields.update(overrides)
    return RewardConfig(**fields)


def _uneven_pairs(kit, n: int) -> datasets.Dataset:
    """Kit preference pairs whose chosen side is short and rejected side long on even rows, the other way
    round on odd rows: padded batches of them are mostly padding."""
    rows = kit.preference_dataset("train").select(range(n)).to_list()
    out = []
    for i, row in enumerate(rows):
        short, long = row["chosen"][:4], row["rejected"] * 3
        chosen, rejected = (short, long) if i % 2 == 0 else (row["chosen"] * 3, row["rejected"][:4])
        out.append({"prompt": row["prompt"], "chosen": chosen, "rejected": rejected})
    return datasets.Dataset.from_list(out)


def _trainer(kit, tmp_path, model: str, n: int = 16, **overrides) -> RewardTrainer:
    peft_config = overrides.pop("peft_config", None)
    return RewardTrainer(
        model=str(kit.model_path(model)),
        args=_config(tmp_path, **overrides),
        train_dataset=_uneven_pairs(kit, n),
        eval_dataset=_uneven_pairs(kit, n),
        peft_config=peft_config,
    )


def _loss_rewards_grads(trainer: RewardTrainer, packing: RewardPacking | None):
    trainer.packing = packing
    model = trainer.model
    model.train()
    model.zero_grad()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    loss, out = trainer.compute_loss(model, batch, return_outputs=True)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    rewards = torch.stack([out["rewards_chosen"], out["rewards_rejected"]], 1).detach()
    return loss.detach(), rewards, grads, batch


def _assert_same(padded, packed) -> None:
    loss_a, rewards_a, grads_a, _ = padded
    loss_b, rewards_b, grads_b, _ = packed
    torch.testing.assert_close(loss_b, loss_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rewards_b, rewards_a, atol=1e-5, rtol=1e-5)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_a.items():
        scale = float(grad.abs().max()) + 1e-8
        diff = float((grads_b[name] - grad).abs().max())
        assert diff <= 1e-5 * max(scale, 1.0), (name, diff, scale)


def _both_layouts(packing: RewardPacking) -> list[RewardPacking]:
    """The trainer's layout and the other one: one row of all real tokens, and rows of the longest
    sequence (whose attention is kept apart by the mask built from the position ids)."""
    return [packing, RewardPacking(one_row=not packing.one_row, fill_id=packing.fill_id)]


@pytest.mark.parametrize("model", ["llama-seqcls", "gpt2-seqcls"])
def test_packed_batch_equals_padded_batch(kit, tmp_path, model):
    trainer = _trainer(kit, tmp_path, model)
    assert trainer.packing is not None, "padding_free is on by default for a model that packs"
    layouts = _both_layouts(trainer.packing)
    padded = _loss_rewards_grads(trainer, None)
    mask = padded[3]["attention_mask"]
    assert mask.float().mean() < 0.6, "the batch is mostly padding"
    for layout in layouts:
        _assert_same(padded, _loss_rewards_grads(trainer, layout))


def test_gradient_checkpointing_keeps_rows_and_matches(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, "llama-seqcls")
    enable_activation_checkpointing(trainer.model, {"use_reentrant": False})
    packing = RewardPacking(one_row=True, fill_id=trainer.packing.fill_id)
    calls = []
    real_pack_rows = packed_module.pack_rows

    def spy(*args, **kwargs):
        calls.append(kwargs["one_row"])
        return real_pack_rows(*args, **kwargs)

    packed_module.pack_rows = spy
    try:
        packed = _loss_rewards_grads(trainer, packing)
    finally:
        packed_module.pack_rows = real_pack_rows
    assert calls == [False], "a training pass under gradient checkpointing takes rows, not one row"
    _assert_same(_loss_rewards_grads(trainer, None), packed)


def test_lora_packed_equals_padded(kit, tmp_path):
    from peft import LoraConfig

    trainer = _trainer(
        kit, tmp_path, "llama-seqcls", peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    )
    assert trainer.packing is not None, "LoRA (and the head in modules_to_save) keeps the packed passes"
    with torch.no_grad():  # a non-zero adapter, so that it takes part in the outputs
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    layouts = _both_layouts(trainer.packing)
    padded = _loss_rewards_grads(trainer, None)
    for layout in layouts:
        packed = _loss_rewards_grads(trainer, layout)
        assert any("lora_" in name for name in packed[2])
        _assert_same(padded, packed)


def _train_and_evaluate(kit, tmp_path, padding_free: bool) -> tuple[list[dict], dict]:
    trainer = _trainer(kit, tmp_path / str(padding_free), "llama-seqcls", n=48, padding_free=padding_free)
    assert (trainer.packing is not None) == padding_free
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return logs, trainer.evaluate()


def test_short_run_logs_and_evaluation_match_padded(kit, tmp_path):
    padded_logs, padded_eval = _train_and_evaluate(kit, tmp_path, padding_free=False)
    packed_logs, packed_eval = _train_and_evaluate(kit, tmp_path, padding_free=True)
    assert len(packed_logs) == len(padded_logs) == 3
    for a, b in zip(padded_logs, packed_logs, strict=True):
        for key in ("loss", "accuracy", "margin", "mean_reward"):
            assert b[key] == pytest.approx(a[key], abs=1e-4, rel=1e-4), (key, a, b)
    for key in ("eval_loss", "eval_accuracy", "eval_margin", "eval_mean_reward"):
        assert packed_eval[key] == pytest.approx(padded_eval[key], abs=1e-4, rel=1e-4), key


def test_model_without_packing_falls_back_to_padded_with_a_log(kit, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(packed_module, "packing_layout", lambda model: None)
    with caplog.at_level(logging.INFO, logger="rlhf_trainers.reward.packed"):
        trainer = _trainer(kit, tmp_path, "llama-seqcls")
    assert trainer.packing is None
    assert "does not keep attention within packed sequences" in caplog.text
    trainer.evaluate()  # the padded passes still work


def test_padding_free_false_keeps_padded_passes(kit, tmp_path):
    trainer = _trainer(kit, tmp_path, "llama-seqcls", padding_free=False)
    assert trainer.packing is None
