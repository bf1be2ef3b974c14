"""``rlhf-trainers grpo`` and ``examples/grpo.py``: train a policy with GRPO (:class:`~rlhf_trainers.GRPOTrainer`).

``num_generations`` completions per prompt, each one's advantage its reward minus its group's mean
(divided by the group's std); a reward model and/or a reward function; TRL's GRPOConfig names and batch
semantics (a step is an optimizer step). Every :class:`~rlhf_trainers.GRPOConfig` (and
``TrainingArguments``) field is a flag, beside the script's own (models, dataset, LoRA); ``--help`` lists
them all. Without ``--model_name_or_path`` and ``--dataset_name`` the run is on the offline kit (its tiny
SFT Llama, its prompts, its hidden reward) with :data:`KIT_DEFAULTS`. The policy is saved at the root of
``--output_dir``.
"""

from __future__ import annotations

from typing import Any

from ._common import OnPolicyScriptArguments, onpolicy_main

#: GRPOConfig values for the offline kit (tiny model, short synthetic task) that learn in seconds, used
#: when the flag is not given and there is no ``--model_name_or_path``: 8 prompts x 4 completions per
#: generation and process, 2 passes of 2 optimizer steps each.
KIT_DEFAULTS: dict[str, Any] = {
    "num_generations": 4,
    "learning_rate": 2e-3,
    "max_completion_length": 12,
    "per_device_train_batch_size": 16,
    "steps_per_generation": 2,
    "num_iterations": 2,
    "logging_steps": 4,
}

DESCRIPTION = (
    "Train a policy with GRPO: num_generations completions per prompt, advantages relative to the group; "
    "TRL's GRPOConfig names (a step is an optimizer step). Without --model_name_or_path and --dataset_name "
    "it runs on the offline kit."
)


def main(argv: list[str] | None = None, prog: str | None = None) -> dict[str, Any]:
    """Parse `argv` (default ``sys.argv[1:]``), train with GRPO, save the policy, print and return the
    metrics (see :func:`rlhf_trainers.scripts._common.run_onpolicy`). `prog` names the command in
    ``--help`` and errors."""
    from ..grpo import GRPOConfig, GRPOTrainer

    return onpolicy_main(
        OnPolicyScriptArguments,
        GRPOConfig,
        GRPOTrainer,
        argv,
        prog=prog,
        description=DESCRIPTION,
        kit_defaults=KIT_DEFAULTS,
    )


if __name__ == "__main__":  # pragma: no cover
    main()
