"""A plain ``transformers.Trainer`` on 2 CPU ranks: the proof that the distributed test infrastructure
(``tests/distributed.py``) works, before any trainer of ours relies on it.

It fine-tunes the offline kit's tiny ``gpt2-seqcls`` for a few steps on a synthetic regression task,
saves it, and writes ``<output_dir>/result-rank<R>.json`` per rank (``tests/test_distributed_infra.py``
checks them): the world size and distributed mode each rank saw, the loss before and after training,
and a digest of the full parameters after training (gathered under ZeRO-3).

Run it through ``distributed.run_script("plain_trainer.py", ["--output_dir", OUT], deepspeed=...)``,
which puts ``tests/`` on ``PYTHONPATH`` and launches::

    accelerate launch --config_file examples/accelerate_configs/multi_gpu.yaml tests/scripts/plain_trainer.py --output_dir OUT
"""

from __future__ import annotations

import argparse
import time

import torch
from datasets import Dataset
from distributed import gathered, parameter_digest, write_rank_result
from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments

from rlhf_trainers.testing import get_kit, true_reward


def make_dataset(tokenizer, n: int, start: int, max_length: int = 16) -> Dataset:
    """Corpus sentences `start`..`start+n`, labelled 1 + true_reward (in [0, 2]: the untrained head
    scores near 0, so the loss starts near 1 and a few steps bring it down clearly)."""
    sentences = get_kit().corpus(start + n)[start:]
    labels = [1.0 + r for r in true_reward(None, sentences)]
    enc = tokenizer(sentences, padding="max_length", truncation=True, max_length=max_length)
    return Dataset.from_dict(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}
    )


def mse(model: torch.nn.Module, dataset: Dataset) -> float:
    """Mean squared error of `model` on the whole `dataset`, computed on this rank in plain PyTorch."""
    batch = dataset.with_format("torch")[:]
    was_training = model.training
    model.eval()
    with gathered(model), torch.no_grad():
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    model.train(was_training)
    return torch.nn.functional.mse_loss(scores.squeeze(-1).float(), batch["labels"].float()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    cli = parser.parse_args()

    started = time.perf_counter()
    kit = get_kit()
    tokenizer = kit.load_tokenizer()
    args = TrainingArguments(
        output_dir=cli.output_dir,
        max_steps=cli.max_steps,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=16,
        learning_rate=cli.learning_rate,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        # On CPU the script must say so: this creates PartialState(cpu=True) (gloo) before Trainer's
        # Accelerator, which then still takes the DeepSpeed plugin from accelerate's environment.
        use_cpu=True,
        # Trainer multiplies the loss by the number of processes when the model's forward takes **kwargs
        # (assuming the model divides by the global num_items_in_batch); a sequence-classification
        # model does not, so with 2 ranks the loss, its gradient and eval_loss would all be doubled.
        average_tokens_across_devices=False,
    )
    # After TrainingArguments: under ZeRO-3 (zero3_init_flag) from_pretrained then partitions the weights
    # as it loads them (deepspeed.zero.Init), as it would for a model too big for one device.
    model = AutoModelForSequenceClassification.from_pretrained(kit.model_path("gpt2-seqcls"))
    partitioned_at_load = all(hasattr(p, "ds_id") for p in model.parameters())
    train, evaluation = make_dataset(tokenizer, 256, start=0), make_dataset(tokenizer, 64, start=10_000)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation)

    # Not trainer.evaluate(): called before train() it marks the model as prepared, train() then skips
    # the DDP wrapping, gradients are never all-reduced and the ranks drift apart without an error
    # (transformers 5.23, accelerate 1.15).
    loss_before = mse(trainer.model, evaluation)
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]  # distributed: each rank evaluates half the rows
    loss_after = mse(trainer.model, evaluation)
    digest, numel = parameter_digest(trainer.model)
    # A collective under ZeRO-3 (the shards are gathered to rank 0, which writes): every rank calls it.
    # The checkpoint is reloaded by the test, in a process of its own: here, with the ZeRO-3 config
    # alive, from_pretrained would run zero.Init, a collective that rank 0 alone cannot complete.
    trainer.save_model(cli.output_dir)

    state = trainer.accelerator.state
    dist = torch.distributed
    plugin = getattr(state, "deepspeed_plugin", None)
    write_rank_result(
        cli.output_dir,
        args.process_index,
        {
            "world_size": args.world_size,
            "torch_world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "distributed_type": state.distributed_type.value,
            "deepspeed_zero_stage": plugin.zero_stage if plugin is not None else None,
            "engine": type(trainer.model_wrapped).__name__,
            "partitioned_at_load": partitioned_at_load,
            "device": str(args.device),
            "loss_before": loss_before,
            "loss_after": loss_after,
            "eval_loss": eval_loss,
            "train_losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "global_step": trainer.state.global_step,
            "param_digest": digest,
            "param_numel": numel,
            "seconds": time.perf_counter() - started,
        },
    )


if __name__ == "__main__":
    main()
