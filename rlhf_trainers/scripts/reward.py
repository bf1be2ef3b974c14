"""``rlhf-trainers reward`` and ``examples/reward_modeling.py``: train a reward model on preference pairs
with :class:`~rlhf_trainers.RewardTrainer`.

Every :class:`~rlhf_trainers.RewardConfig` (and ``TrainingArguments``) field is a flag, beside the
script's own (model, dataset, LoRA, reward normalization); ``--help`` lists them all. Without
``--model_name_or_path`` and ``--dataset_name`` the run is on the offline kit (its tiny Llama and its
synthetic preference pairs). The reward model (with its tokenizer) is saved to ``--output_dir``, ready
for ``rlhf-trainers ppo|rloo --reward_model_name_or_path``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._common import (
    KIT_MODEL,
    DatasetArguments,
    LoraArguments,
    check_model_flags,
    flag_names,
    kit_model_path,
    load_train_test,
    parse_args,
    report,
    resume_argument,
    run_info,
    usage_errors,
)

DESCRIPTION = (
    "Train a reward model on preference pairs (prompt, chosen, rejected; or chosen, rejected as full "
    "texts). Without --model_name_or_path and --dataset_name it runs on the offline kit."
)


@dataclass
class RewardScriptArguments:
    """The model to train and what to do after training."""

    _argument_group_name = "model"

    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Model: a local folder or a Hub id (a causal LM gets a new scalar head). Default: the "
            f"offline kit's {KIT_MODEL}."
        },
    )
    normalize_with_policy: bool = field(
        default=False,
        metadata={
            "help": "After training, normalize the rewards on samples of the reference policy (the model "
            "itself as a causal LM) for the train split's prompts (needs a prompt column)."
        },
    )
    results_file: str | None = field(
        default=None, metadata={"help": "Write the final metrics as JSON here (main process)."}
    )


def main(argv: list[str] | None = None, prog: str | None = None) -> dict[str, Any]:
    """Parse `argv` (default ``sys.argv[1:]``), train the reward model, save it, print and return the
    metrics: the eval metrics (with a test split), ``reward_gain``/``reward_bias`` with
    ``--normalize_with_policy``, :func:`~rlhf_trainers.scripts._common.run_info`, ``global_step`` and the
    preprocessing counts. `prog`
    names the command in ``--help`` and errors."""
    from transformers import AutoTokenizer

    from ..cpu import CPUOptions
    from ..reward import RewardConfig, RewardTrainer

    types = (RewardScriptArguments, DatasetArguments, LoraArguments, RewardConfig, CPUOptions)
    script, data, lora, config, cpu_options = parse_args(types, argv, prog=prog, description=DESCRIPTION)
    # A bad model path, dataset or setting found while building the trainer is a usage error too.
    with usage_errors(prog, flag_names(types)):
        check_model_flags(script, config)
        if script.model_name_or_path is None:
            script.model_name_or_path = kit_model_path()
        train, test = load_train_test(data, "preferences")

        tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
        trainer = RewardTrainer(
            model=script.model_name_or_path,
            args=config,
            train_dataset=train,
            eval_dataset=test,
            processing_class=tokenizer,
            peft_config=lora.peft_config("SEQ_CLS"),
            cpu_options=cpu_options,
        )
    trainer.train(resume_from_checkpoint=resume_argument(config))
    metrics: dict[str, Any] = trainer.evaluate() if test is not None else {}
    if script.normalize_with_policy:
        from transformers import AutoModelForCausalLM

        policy = AutoModelForCausalLM.from_pretrained(script.model_name_or_path).to(
            trainer.accelerator.device
        )
        metrics["reward_gain"], metrics["reward_bias"] = trainer.normalize_rewards(policy, train, tokenizer)
    trainer.save_model(config.output_dir)
    metrics.update(run_info(trainer))
    metrics["global_step"] = trainer.state.global_step
    metrics["preprocessing"] = {k: vars(v) for k, v in trainer.preprocessing_stats.items()}
    report(trainer, metrics, script.results_file)
    return metrics


if __name__ == "__main__":  # pragma: no cover
    main()
