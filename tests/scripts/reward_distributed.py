"""RewardTrainer on N CPU ranks (DDP, or DeepSpeed ZeRO-2/3 by the accelerate config it is launched with).

Trains the offline kit's tiny Llama reward model on the synthetic preferences, evaluates on the held-out
pairs, optionally fits the reward normalization on reference-policy samples (all ranks sampling their
share, statistics all-reduced), saves, and writes ``<output_dir>/result-rank<R>.json`` per rank for
``tests/test_reward_distributed.py``: world size, distributed mode, global step, eval metrics, the
training loss log, the gain and bias each rank holds, and a digest of the full weights (gathered under
ZeRO-3).

Launched by ``distributed.run_script("reward_distributed.py", [...], deepspeed=...)``.
"""

from __future__ import annotations

import argparse

import torch
from distributed import parameter_digest, write_rank_result

from rlhf_trainers import RewardConfig, RewardTrainer
from rlhf_trainers.models import get_reward_normalization
from rlhf_trainers.testing import get_kit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--num_train_pairs", type=int, default=2048)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--normalize", action="store_true", help="fit the normalization after training")
    parser.add_argument("--evaluate_first", action="store_true", help="evaluate() before train()")
    cli = parser.parse_args()

    kit = get_kit()
    args = RewardConfig(
        output_dir=cli.output_dir,
        per_device_train_batch_size=cli.per_device_train_batch_size,
        per_device_eval_batch_size=64,
        learning_rate=cli.learning_rate,
        num_train_epochs=1,
        logging_steps=4,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        max_length=64,
        use_cpu=True,
        reward_normalization="after" if cli.normalize else "no",
        normalization_num_samples=512,
        normalization_response_length=16,
        normalization_batch_size=128,
    )
    train = kit.preference_dataset("train")
    train = train.select(range(min(cli.num_train_pairs, len(train))))
    trainer = RewardTrainer(
        model=str(kit.model_path("llama-sft")),
        args=args,
        train_dataset=train,
        eval_dataset=kit.preference_dataset("test"),
        normalization_policy=str(kit.model_path("llama-sft")) if cli.normalize else None,
        normalization_prompts=kit.prompt_dataset("train") if cli.normalize else None,
    )
    # Under ZeRO-3 (zero3_init_flag) the model, loaded after the RewardConfig, was partitioned as
    # from_pretrained read it (deepspeed.zero.Init), as for a model too big for one device.
    partitioned_at_load = all(hasattr(p, "ds_id") for p in trainer.model.parameters())
    metrics_before = trainer.evaluate() if cli.evaluate_first else {}
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(cli.output_dir)

    state = trainer.accelerator.state
    plugin = getattr(state, "deepspeed_plugin", None)
    digest, numel = parameter_digest(trainer.model)
    gain, bias = get_reward_normalization(trainer.model)
    write_rank_result(
        cli.output_dir,
        state.process_index,
        {
            "world_size": state.num_processes,
            "torch_world_size": torch.distributed.get_world_size()
            if torch.distributed.is_initialized()
            else 1,
            "distributed_type": str(state.distributed_type),
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            "deepspeed_zero_stage": plugin.zero_stage if plugin is not None else None,
            "engine": type(trainer.model_wrapped).__name__,
            "partitioned_at_load": partitioned_at_load,
            "global_step": trainer.state.global_step,
            "train_losses": [log["loss"] for log in trainer.state.log_history if "loss" in log],
            "metrics": metrics,
            "metrics_before": metrics_before,
            "gain": gain,
            "bias": bias,
            "digest": digest,
            "numel": numel,
        },
    )


if __name__ == "__main__":
    main()
