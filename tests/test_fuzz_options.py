"""Fuzzing the engine options of issues #23 and #24 together (issue #25): random valid combinations of the
loss, advantage, KL, sampling, filtering and batching options, each trained for one generation of the
GRPO trainer on the kit, must give finite losses and metrics and move the weights; random invalid values
must be refused at construction with a message naming the field.

The combinations come from a seeded generator, so a failure names its case (``case<i>``) and re-runs the
same. Each case is a tiny run (about a second), kept out of the bad-input table because it trains.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from test_grpo import _digest, _trainer

from rlhf_trainers import GRPOConfig, RLOOConfig

#: The values each option may take in a valid combination.
CHOICES: dict[str, list[Any]] = {
    "loss_type": ["dapo", "grpo", "dr_grpo", "bnpo"],
    "scale_rewards": ["group", "batch", "none"],
    "advantage_estimator": ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"],
    "beta": [0.0, 0.04],
    "kl_loss_estimator": ["k1", "k2", "k3", "low_var_kl"],
    "epsilon_high": [None, 0.28],
    "importance_sampling_level": ["token", "sequence"],
    "mask_truncated_completions": [False, True],
    "dynamic_sampling": [False, True],
    "top_k": [0, 20],
    "top_p": [1.0, 0.9],
    "min_p": [0.0, 0.05],
    "entropy_coeff": [0.0, 0.01],
    "max_tokens_per_microbatch": [None, 64],
    "num_iterations": [1, 2],
    "temperature": [1.0, 0.7],
}

N_CASES = 12


def _combination(case: int) -> dict[str, Any]:
    rng = random.Random(1000 + case)
    options = {name: rng.choice(values) for name, values in CHOICES.items()}
    if options["epsilon_high"] is None:
        del options["epsilon_high"]
    if options["max_tokens_per_microbatch"] is None:
        del options["max_tokens_per_microbatch"]
    if options["beta"] == 0.0:
        del options["kl_loss_estimator"]  # no KL term: the estimator is never read
    return options


@pytest.mark.parametrize("case", range(N_CASES), ids=[f"case{i}" for i in range(N_CASES)])
def test_random_valid_option_combinations_train_with_finite_metrics(kit, tmp_path, case):
    options = _combination(case)
    steps = options["num_iterations"]  # one generation: num_iterations optimizer steps
    trainer = _trainer(kit, tmp_path, max_steps=steps, learning_rate=5e-3, **options)
    before = _digest(trainer.policy)
    trainer.train()
    assert trainer.state.global_step == steps, options
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    assert logs, options
    for key, value in logs[-1].items():
        if isinstance(value, float):
            assert math.isfinite(value), (options, key, value)
    assert not torch.equal(_digest(trainer.policy), before), options
    assert torch.isfinite(_digest(trainer.policy)).all(), options


#: Invalid values (field, value): the message must start with the field as given.
INVALID: list[tuple[str, Any]] = [
    ("loss_type", "token_mean"),
    ("scale_rewards", "prompt"),
    ("advantage_estimator", "gae"),
    ("beta", -0.5),
    ("beta", float("nan")),
    ("epsilon", -0.2),
    ("epsilon_high", -0.1),
    ("importance_sampling_level", "batch"),
    ("top_k", -3),
    ("top_p", 1.5),
    ("min_p", -0.1),
    ("entropy_coeff", float("inf")),
    ("max_tokens_per_microbatch", -64),
    ("num_iterations", 0),
    ("num_generations", 1),
    ("temperature", 0.0),
    ("padding_free", "false"),  # a truthy string: on/off fields must be booleans
    ("balance_batch", 1),
    ("dynamic_sampling", "true"),
    ("use_vllm", "no"),
]


@pytest.mark.parametrize(("name", "value"), INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_values_are_refused_at_construction_naming_the_field(tmp_path, name, value):
    fields = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": 8,
        "num_generations": 4,
        "use_cpu": True,
        "report_to": "none",
    }
    fields[name] = value
    with pytest.raises(ValueError, match=rf"^{name}="):
        GRPOConfig(**fields)


#: RLOOConfig's TRL 1.x names with invalid values: the message names them, not the blog's field they set.
INVALID_RLOO: list[tuple[str, Any]] = [
    ("beta", -0.1),
    ("epsilon", 2.0),
    ("epsilon_high", 0.0),
    ("num_iterations", 0),
    ("max_completion_length", -4),
]


@pytest.mark.parametrize(("name", "value"), INVALID_RLOO, ids=[f"{n}={v!r}" for n, v in INVALID_RLOO])
def test_rloo_trl_names_with_invalid_values_are_refused_naming_them(tmp_path, name, value):
    fields = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": "none", name: value}
    with pytest.raises(ValueError, match=rf"^{name}="):
        RLOOConfig(**fields)


#: RewardConfig's on/off fields (its own and the shared reliability ones) given a non-boolean.
INVALID_REWARD_SWITCHES: list[tuple[str, Any]] = [
    ("add_eos", "false"),
    ("init_reward_head", 0),
    ("disable_dropout", "no"),
    ("save_on_interrupt", "false"),
]


@pytest.mark.parametrize(
    ("name", "value"), INVALID_REWARD_SWITCHES, ids=[f"{n}={v!r}" for n, v in INVALID_REWARD_SWITCHES]
)
def test_reward_config_switches_must_be_booleans(tmp_path, name, value):
    from rlhf_trainers import RewardConfig

    fields = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": "none", name: value}
    with pytest.raises(ValueError, match=rf"^{name}=.*expected True or False"):
        RewardConfig(**fields)
    fields[name] = not bool(value)
    RewardConfig(**fields)  # the same field as a boolean is accepted
