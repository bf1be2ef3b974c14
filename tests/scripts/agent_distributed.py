"""GRPOTrainer with a tool on N CPU ranks (DDP or DeepSpeed, by the accelerate config it is launched with):
the episodes of rank 0 take 3 assistant turns (every turn of every row is scripted to call ``add`` while
the call fits: twice, then the policy writes the last turn), those of the other ranks one (the kit's
policy never calls a tool), so
rank 0 runs more rounds of generation than the others, in 2 chunks per round
(``local_rollout_forward_batch_size=4`` for 8 rows). With ``--environment`` the tool is the method of an
environment per episode (``environment_factory``), whose ``get_reward`` counts its calls. Trains ``--max_steps`` (2) steps and evaluates; writes
``result-rank<R>.json`` (the policy's digest, the logged tool metrics, the eval's) for
``tests/test_agent_distributed.py``. A deadlock dumps every rank's stacks and exits after
``--dump_stacks_after`` seconds.
"""

from __future__ import annotations

import argparse
import faulthandler

import torch
from distributed import parameter_digest, write_rank_result

from rlhf_trainers import GRPOConfig, GRPOTrainer
from rlhf_trainers.agents import install_tool_chat_template
from rlhf_trainers.testing import get_kit

ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: A.
        b: B.
    """
    return a + b


class AddEnv:
    """``add`` as an environment's method (``--environment``): counts its calls, which ``get_reward`` pays."""

    def reset(self, **row) -> None:
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """Add.

        Args:
            a: A.
            b: B.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.calls)


def reward(completions, **kwargs):
    """Differs between the episodes of a group (so the advantages, and the update, are not 0)."""
    return [float(len(str(c)) % 7) for c in completions]


def script_every_turn(trainer) -> None:
    """Every row of every assistant turn (but the idle calls) writes ADD_CALL and the end of the turn."""
    tokenizer = trainer.processing_class
    ids = [*tokenizer(ADD_CALL, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    real = trainer.sampler.generate

    def generate(query, query_mask, with_logprobs=False, *, max_new_tokens=None, stop_ids=None):
        out, extras = real(query, query_mask, with_logprobs, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
        if max_new_tokens is not None and max_new_tokens < len(ids):
            return out, extras  # no room for the call (or an idle call): as sampled
        scripted = torch.full((out.shape[0], max(out.shape[1], len(ids))), tokenizer.pad_token_id)
        scripted[:, : len(ids)] = torch.tensor(ids)
        return scripted.to(out.device), extras

    trainer.sampler.generate = generate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--no_gather_for_generation", action="store_true")
    parser.add_argument("--max_steps", type=int, default=2)
    parser.add_argument("--environment", action="store_true", help="environment_factory=AddEnv, not tools")
    parser.add_argument("--dump_stacks_after", type=float, default=480)
    cli = parser.parse_args()
    faulthandler.dump_traceback_later(cli.dump_stacks_after, exit=True)
    kit = get_kit()
    tokenizer = install_tool_chat_template(kit.load_tokenizer(), tools_instruction="Tools:")
    args = GRPOConfig(
        output_dir=cli.output_dir,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=200,
        max_prompt_length=48,
        max_tool_calling_iterations=2,
        local_rollout_forward_batch_size=4,
        learning_rate=1e-3,
        max_steps=cli.max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        num_sample_generations=0,
        disable_tqdm=True,
        rollout_logprobs="forward",
        ds3_gather_for_generation=not cli.no_gather_for_generation,
    )
    trainer = GRPOTrainer(
        model=kit.load_model("llama-sft"),
        reward_funcs=reward,
        args=args,
        train_dataset=kit.prompt_dataset("train", n=64, chat=True),
        eval_dataset=kit.prompt_dataset("test", n=8, chat=True),
        processing_class=tokenizer,
        **({"environment_factory": AddEnv} if cli.environment else {"tools": [add]}),
    )
    if trainer.accelerator.process_index == 0:
        script_every_turn(trainer)
    before = parameter_digest(trainer.policy)[0]
    trainer.train()
    metrics = trainer.evaluate()
    logged = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
    state = trainer.accelerator.state
    write_rank_result(
        cli.output_dir,
        trainer.accelerator.process_index,
        {
            "world_size": trainer.accelerator.num_processes,
            "zero_stage": state.deepspeed_plugin.zero_stage if state.deepspeed_plugin else None,
            "before": before,
            "digest": parameter_digest(trainer.policy)[0],
            "global_step": trainer.state.global_step,
            "logged": [
                {k: v for k, v in h.items() if k.startswith(("tools/", "rewards/AddEnv/"))} for h in logged
            ],
            "eval": {k: v for k, v in metrics.items() if k.startswith("eval_tools/")},
        },
    )


if __name__ == "__main__":
    main()
