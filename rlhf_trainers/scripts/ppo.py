"""``rlhf-trainers ppo`` and ``examples/ppo.py``: train a policy with PPO (:class:`~rlhf_trainers.PPOTrainer`).

A reward model and/or a reward function, a value model, KL to a reference policy. Every
:class:`~rlhf_trainers.PPOConfig` (and ``TrainingArguments``) field is a flag, beside the script's own
(models, dataset, LoRA); ``--help`` lists them all. Without ``--model_name_or_path`` and
``--dataset_name`` the run is on the offline kit (its tiny SFT Llama, its prompts, its hidden reward) with
:data:`KIT_DEFAULTS`. The policy is saved at the root of ``--output_dir``, the value model in
``value_model/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._common import OnPolicyScriptArguments, onpolicy_main

#: PPOConfig values for the offline kit (tiny model, short synthetic task) that learn in seconds, used
#: when the flag is not given and there is no ``--model_name_or_path``.
KIT_DEFAULTS: dict[str, Any] = {
    "learning_rate": 2e-3,
    "response_length": 12,
    "temperature": 1.0,
    "per_device_train_batch_size": 16,
    "num_mini_batches": 2,
    "num_ppo_epochs": 2,
}

DESCRIPTION = (
    "Train a policy with PPO: a reward model and/or a reward function, a value model, KL to a reference "
    "policy. Without --model_name_or_path and --dataset_name it runs on the offline kit."
)


@dataclass
class PPOScriptArguments(OnPolicyScriptArguments):
    """The models and reward sources of a PPO run (the value model beside the policy's)."""

    value_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Value model: a local folder or a Hub id (a causal LM gets a new scalar head). None: "
            "built as --value_model_init says (default: the policy's weights with a zero head)."
        },
    )

    def trainer_kwargs(self) -> dict[str, Any]:
        """PPOTrainer's ``value_model``: this flag's value (None: built by the trainer)."""
        return {"value_model": self.value_model_name_or_path}


def main(argv: list[str] | None = None, prog: str | None = None) -> dict[str, Any]:
    """Parse `argv` (default ``sys.argv[1:]``), train with PPO, save the models, print and return the
    metrics (see :func:`rlhf_trainers.scripts._common.run_onpolicy`). `prog` names the command in
    ``--help`` and errors."""
    from ..ppo import PPOConfig, PPOTrainer

    return onpolicy_main(
        PPOScriptArguments,
        PPOConfig,
        PPOTrainer,
        argv,
        prog=prog,
        description=DESCRIPTION,
        kit_defaults=KIT_DEFAULTS,
    )


if __name__ == "__main__":  # pragma: no cover
    main()
