"""TRL 1.16's GRPOConfig, RLOOConfig and RewardConfig fields against ours (issue #48).

Every TRL field (``tests/data/trl_1_16_fields.json``, written by ``tests/data/extract_trl_fields.py`` where TRL
is installed) must be a field of ours with TRL's default, or have its difference explained in
``rlhf_trainers.trl_compat.DIFFERENCES``; a field we do not implement is accepted at TRL's default and refused
otherwise (``REFUSED``). A new TRL field, or a default that changes on either side, fails here until it is
declared and explained. Also: the aliases, TRL 1.x's step semantics for RLOO, and ``log_completions``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback, TrainingArguments

import rlhf_trainers.trl_compat as trl_compat
from rlhf_trainers import GRPOConfig, GRPOTrainer, RewardConfig, RLOOConfig, RLOOTrainer
from rlhf_trainers.onpolicy import evaluation
from rlhf_trainers.testing import true_reward

DATA = json.loads((Path(__file__).parent / "data" / "trl_1_16_fields.json").read_text(encoding="utf-8"))
OURS = {"GRPOConfig": GRPOConfig, "RLOOConfig": RLOOConfig, "RewardConfig": RewardConfig}
COMMON = {"report_to": "none", "use_cpu": True, "save_strategy": "no", "disable_tqdm": True}


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return list(f.default) if isinstance(f.default, tuple) else f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "<required>"


def _defaults(cls: type) -> dict[str, object]:
    return {f.name: _default(f) for f in dataclasses.fields(cls)}


def _differences(name: str) -> tuple[dict[str, tuple[object, object]], list[str]]:
    """``{field: (TRL's default, ours)}`` where they differ, and the TRL fields we lack."""
    trl = DATA["classes"][name]
    ours = _defaults(OURS[name])
    base = _defaults(TrainingArguments)
    differ = {f: (v, ours[f]) for f, v in trl.items() if f in ours and ours[f] != v}
    # TrainingArguments defaults we override and TRL does not: TRL keeps TrainingArguments' there.
    differ.update({f: (base[f], v) for f, v in ours.items() if f in base and f not in trl and v != base[f]})
    missing = [f for f in trl if f not in ours]
    return differ, missing


def test_the_committed_list_is_trl_1_16():
    assert DATA["trl_version"] == "1.16.0"
    assert set(DATA["classes"]) == set(OURS)
    assert {"log_completions", "num_generations", "vllm_server_host"} <= set(DATA["classes"]["GRPOConfig"])


@pytest.mark.parametrize("name", sorted(OURS))
def test_every_trl_field_is_ours_with_its_default_or_explained(name):
    differ, missing = _differences(name)
    explained = trl_compat.DIFFERENCES[name]
    problems = [
        f"{f}: TRL's field is not a field of {name}; declare it in rlhf_trainers/trl_compat.py"
        for f in missing
    ]
    problems += [
        f"{f}: TRL's default {trl!r}, ours {ours!r}, unexplained (add it to trl_compat.DIFFERENCES[{name!r}])"
        for f, (trl, ours) in differ.items()
        if f not in explained
    ]
    problems += [
        f"{f}: explained in DIFFERENCES but the defaults agree now; drop the entry"
        for f in explained
        if f not in differ
    ]
    assert not problems, "\n".join(problems)


def test_every_refused_inert_or_alias_entry_is_a_trl_field():
    """The tables name TRL's fields only (a typo there would explain nothing)."""
    trl = set().union(*(DATA["classes"][c] for c in OURS))
    assert not (set(trl_compat.REFUSED) | set(trl_compat.INERT)) - trl
    for name, aliases in trl_compat.ALIASES.items():
        assert not set(aliases) - set(DATA["classes"][name]), name


def _other(value: object) -> object:
    """A value other than ``value`` (a field's default) of a plausible type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    return "other"


def _refused(name: str) -> list[str]:
    return [f for f in DATA["classes"][name] if f in trl_compat.REFUSED]


@pytest.mark.parametrize(
    "name, field", [(n, f) for n in sorted(OURS) for f in _refused(n)], ids=lambda v: str(v)
)
def test_a_refused_field_runs_at_trls_default_and_is_refused_otherwise(tmp_path, name, field):
    cls = OURS[name]
    default = _defaults(cls)[field]  # TRL's, or explained in DIFFERENCES
    cls(output_dir=str(tmp_path), **{field: default}, **COMMON)  # spelled out at the default: fine
    with pytest.raises(ValueError, match=rf"^{field}=.*\(TRL's field\) is not supported by {name}: "):
        cls(output_dir=str(tmp_path), **{field: _other(default)}, **COMMON)


def test_field_counts_add_up():
    """Each TRL field is accepted with TRL's meaning (same name, or an alias), inert, or refused."""
    for name in OURS:
        trl = DATA["classes"][name]
        refused = [f for f in trl if f in trl_compat.REFUSED]
        inert = [f for f in trl if f in trl_compat.INERT]
        accepted = [f for f in trl if f not in trl_compat.REFUSED and f not in trl_compat.INERT]
        assert len(refused) + len(inert) + len(accepted) == len(trl)
        assert accepted, name


def test_pad_to_multiple_of_accepts_auto_and_none_only(tmp_path):
    for cls in (GRPOConfig, RLOOConfig, RewardConfig):
        cls(output_dir=str(tmp_path), pad_to_multiple_of=None, **COMMON)
        with pytest.raises(ValueError, match=r"pad_to_multiple_of=8 \(TRL's field\) is not supported"):
            cls(output_dir=str(tmp_path), pad_to_multiple_of=8, **COMMON)


def test_the_aliases_set_our_fields(tmp_path):
    args = GRPOConfig(
        output_dir=str(tmp_path),
        entropy_coef=0.01,
        vllm_importance_sampling_clip_max=2.0,
        trust_remote_code=True,
        min_p=None,
        **COMMON,
    )
    assert args.entropy_coeff == 0.01 and args.vllm_importance_sampling_cap == 2.0
    assert args.model_init_kwargs == {"trust_remote_code": True} and args.min_p == 0.0
    assert dataclasses.replace(args).entropy_coeff == 0.01  # re-running the checks keeps the values
    assert (
        GRPOConfig(
            output_dir=str(tmp_path), vllm_importance_sampling_cap=2.5, **COMMON
        ).vllm_importance_sampling_clip_max
        == 2.5
    )
    with pytest.raises(ValueError, match=r"entropy_coef=0.01 .* loss_type='grpo'.*set entropy_coeff"):
        GRPOConfig(output_dir=str(tmp_path), entropy_coef=0.01, loss_type="grpo", **COMMON)
    with pytest.raises(ValueError, match=r"loss_type='cispo' \(TRL's\) is not implemented"):
        GRPOConfig(output_dir=str(tmp_path), loss_type="cispo", **COMMON)
    rloo = RLOOConfig(output_dir=str(tmp_path), reward_clip_range=[-2.0, 2.0], **COMMON)
    assert rloo.reward_clip == 2.0
    with pytest.raises(ValueError, match=r"only a symmetric range"):
        RLOOConfig(output_dir=str(tmp_path), reward_clip_range=[0.0, 1.0], **COMMON)
    reward = RewardConfig(output_dir=str(tmp_path), trust_remote_code=True, **COMMON)
    assert reward.model_init_kwargs == {"trust_remote_code": True}


# ---- RLOO: TRL 1.x's step semantics ---------------------------------------------------------------


def test_rloo_step_semantics_follow_the_names_used(tmp_path):
    out = str(tmp_path)
    blog = RLOOConfig(output_dir=out, rloo_k=4, **COMMON)
    assert (blog.trl_semantics, blog.num_ppo_epochs, blog.steps_per_update) == (False, 4, 1)
    trl = RLOOConfig(output_dir=out, num_generations=4, per_device_train_batch_size=8, max_steps=5, **COMMON)
    assert (trl.trl_semantics, trl.num_ppo_epochs, trl.num_mini_batches, trl.steps_per_update) == (
        True,
        1,
        1,
        1,
    )
    assert trl.steps_per_generation == 1
    bigger = RLOOConfig(
        output_dir=out, num_generations=2, gradient_accumulation_steps=2, steps_per_generation=4, num_iterations=2,
        max_steps=8, **COMMON,
    )  # fmt: skip
    assert (bigger.num_mini_batches, bigger.num_ppo_epochs, bigger.steps_per_update) == (2, 2, 4)
    with pytest.raises(ValueError, match=r"max_steps=6: with TRL 1.x's semantics .* use a multiple of 4"):
        dataclasses.replace(bigger, max_steps=6)
    explicit = RLOOConfig(output_dir=out, rloo_k=2, trl_semantics=True, **COMMON)
    assert (explicit.num_ppo_epochs, explicit.steps_per_update) == (1, 1)
    with pytest.raises(ValueError, match="steps_per_generation=2 with trl_semantics=False"):
        RLOOConfig(output_dir=out, steps_per_generation=2, trl_semantics=False, **COMMON)


class _CountOptimizerSteps(TrainerCallback):
    def __init__(self) -> None:
        self.steps = 0

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.steps += 1


def _rloo(kit, args: RLOOConfig, counter: _CountOptimizerSteps) -> RLOOTrainer:
    return RLOOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=true_reward,
        args=args,
        train_dataset=kit.prompt_dataset("train", n=32),
        processing_class=kit.load_tokenizer(),
        callbacks=[counter],
    )


def test_rloo_with_trl_names_takes_trls_optimizer_steps(kit, tmp_path):
    """TRL's RLOO documentation's config: max_steps counts optimizer steps (one pass per generation); with
    gradient_accumulation_steps=2 and steps_per_generation=4 one generation is 2 of them."""
    counter = _CountOptimizerSteps()
    args = RLOOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        num_generations=2,
        max_completion_length=6,
        max_steps=4,
        logging_steps=1,
        seed=0,
        num_sample_generations=0,
        **COMMON,
    )
    trainer = _rloo(kit, args, counter)
    trainer.train()
    assert trainer.num_updates == 2 and trainer.state.global_step == 4 and counter.steps == 4
    assert trainer.state.max_steps == 4


def test_rloo_with_the_blogs_names_counts_updates(kit, tmp_path):
    counter = _CountOptimizerSteps()
    args = RLOOConfig(
        output_dir=str(tmp_path / "blog"),
        per_device_train_batch_size=4,
        rloo_k=2,
        num_ppo_epochs=2,
        num_mini_batches=2,
        response_length=6,
        max_steps=2,
        seed=0,
        num_sample_generations=0,
        **COMMON,
    )
    trainer = _rloo(kit, args, counter)
    trainer.train()
    assert trainer.state.global_step == 2 and counter.steps == 2 * 2 * 2


# ---- log_completions ------------------------------------------------------------------------------


def test_log_completions_prints_trls_table_at_logging_steps(kit, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich's width: the column names unwrapped
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        logging_steps=2,
        seed=0,
        num_sample_generations=0,
        log_completions=True,
        num_completions_to_print=3,
        **COMMON,
    )
    trainer = GRPOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=true_reward,
        args=args,
        train_dataset=kit.prompt_dataset("train", n=32),
        processing_class=kit.load_tokenizer(),
    )
    trainer.train()
    printed = capsys.readouterr().out
    assert printed.count("Step 2") == 1 and "Step 1" not in printed  # logging step 2 only
    for column in ("Prompt", "Completion", "true_reward", "Advantage"):
        assert column in printed
    table = evaluation.completions_table(trainer)
    assert len(table["prompt"]) == 3 and set(table) == {"prompt", "completion", "true_reward", "advantage"}


def _fake_trainer(report_to, unique=False):
    rollout = types.SimpleNamespace(
        prompts=["a", "a", "b"],
        completions=["x", "y", "z"],
        per_source={"f": torch.tensor([1.0, 0.0, 0.5])},
        response_mask=torch.ones(3, 2, dtype=torch.bool),
    )
    return types.SimpleNamespace(
        _last_rollout=rollout,
        _last_advantages=types.SimpleNamespace(advantages=torch.tensor([[0.5], [-0.5], [0.0]])),
        args=types.SimpleNamespace(
            num_completions_to_print=None, seed=0, report_to=report_to, log_unique_prompts=unique
        ),
        state=types.SimpleNamespace(global_step=7),
        is_world_process_zero=lambda: True,
    )


def test_log_completions_prints_plain_text_without_rich(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "rich.console", None)  # import fails: the plain table
    evaluation.log_completions(_fake_trainer([]))
    printed = capsys.readouterr().out
    assert printed.startswith("Step 7") and "f=0.50  advantage=0.00" in printed and "Completion: z" in printed


def test_log_completions_logs_a_table_to_wandb_when_it_runs(capsys, monkeypatch):
    logged = []
    fake = types.SimpleNamespace(
        run=object(), Table=lambda columns, data: (columns, data), log=lambda payload: logged.append(payload)
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    evaluation.log_completions(_fake_trainer(["wandb"], unique=True))
    columns, data = logged[0]["completions"]
    assert columns == ["step", "prompt", "completion", "f", "advantage"]
    assert data == [[7, "a", "x", 1.0, 0.5], [7, "b", "z", 0.5, 0.0]]  # one row per prompt


def test_rloo_built_without_args_as_trl_1x_does_counts_optimizer_steps(kit, tmp_path, monkeypatch):
    """TRL 1.x's call, ``RLOOTrainer(model, reward_funcs=..., train_dataset=...)``: TRL's step semantics."""
    monkeypatch.chdir(tmp_path)  # the default output_dir is relative
    trainer = RLOOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=true_reward,
        train_dataset=kit.prompt_dataset("train", n=32),
        processing_class=kit.load_tokenizer(),
    )
    assert trainer.args.trl_semantics and trainer.args.num_ppo_epochs == 1 and trainer.steps_per_update == 1
