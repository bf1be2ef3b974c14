"""``rlhf-trainers rloo`` and ``examples/rloo.py``: train a policy with RLOO (:class:`~rlhf_trainers.RLOOTrainer`).

``rloo_k`` completions per prompt, each one's baseline the mean reward of the others; a reward model
and/or a reward function, KL to a reference policy, no value model. Every
:class:`~rlhf_trainers.RLOOConfig` (and ``TrainingArguments``) field is a flag, beside the script's own
(models, dataset, LoRA); ``--help`` lists them all. Without ``--model_name_or_path`` and
``--dataset_name`` the run is on the offline kit (its tiny SFT Llama, its prompts, its hidden reward) with
:data:`KIT_DEFAULTS`. The policy is saved at the root of ``--output_dir``.
"""

from __future__ import annotations

from typing import Any

from ._common import OnPolicyScriptArguments, onpolicy_main

#: RLOOConfig values for the offline kit (tiny model, short synthetic task) that learn in seconds, used
#: when the flag is not given and there is no ``--model_name_or_path``: 8 prompts x 4 completions per
#: update and process.
KIT_DEFAULTS: dict[str, Any] = {
    "rloo_k": 4,
    "learning_rate": 2e-3,
    "response_length": 12,
    "temperature": 1.0,
    "per_device_train_batch_size": 16,
    "num_mini_batches": 2,
    "num_ppo_epochs": 2,
}

DESCRIPTION = (
    "Train a policy with RLOO: rloo_k completions per prompt, each one's baseline the mean reward of the "
    "others; no value model. Without --model_name_or_path and --dataset_name it runs on the offline kit."
)


def main(argv: list[str] | None = None, prog: str | None = None) -> dict[str, Any]:
    """Parse `argv` (default ``sys.argv[1:]``), train with RLOO, save the policy, print and return the
    metrics (see :func:`rlhf_trainers.scripts._common.run_onpolicy`). `prog` names the command in
    ``--help`` and errors."""
    from ..rloo import RLOOConfig, RLOOTrainer

    return onpolicy_main(
        OnPolicyScriptArguments,
        RLOOConfig,
        RLOOTrainer,
        argv,
        prog=prog,
        description=DESCRIPTION,
        kit_defaults=KIT_DEFAULTS,
    )


if __name__ == "__main__":  # pragma: no cover
    main()
