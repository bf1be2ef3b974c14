"""The checks of :class:`~rlhf_trainers.onpolicy.config.OnPolicyConfig`'s fields (called from its
``__post_init__``), and the values its choice fields accept. Each check adds what it finds to a
:class:`~rlhf_trainers.config_problems.ConfigProblems` and goes on, so that a config reports every
problem at once."""

from __future__ import annotations

import math
from typing import Any

from ..config_problems import ConfigProblems
from ..functional import IMPORTANCE_SAMPLING_MODES, KL_ESTIMATORS, LOSS_AGG_MODES, get_policy_loss
from ..generation.factory import GENERATION_LOOPS

STOP_TOKENS = ("eos",)
ROLLOUT_LOGPROBS = ("auto", "forward", "generation")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
VLLM_MODES = ("colocate", "server")
VLLM_IS_MODES = IMPORTANCE_SAMPLING_MODES


def _valid_length(config: Any) -> bool:
    """Whether ``response_length`` is a valid length (the checks that compare with it need one)."""
    value = config.response_length
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_counts(config: Any, problems: ConfigProblems) -> None:
    """Counts and sizes: integers in their ranges."""
    for name in (
        "num_ppo_epochs",
        "num_mini_batches",
        "local_rollout_forward_batch_size",
        "response_length",
        "reward_batch_size",
        "kl_horizon",
        "dynamic_sampling_max_rounds",
        "sample_table_size",
    ):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.add(f"{name}={value!r}: expected an integer >= 1.")
    for name in (
        "total_episodes",
        "max_prompt_length",
        "logprob_chunk_size",
        "overlong_buffer_length",
        "max_tokens_per_microbatch",
    ):
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            problems.add(f"{name}={value!r}: expected an integer >= 1, or None.")
    value = config.fused_lm_head_kept_logits_mib
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        problems.add(
            f"fused_lm_head_kept_logits_mib={value!r}: expected an integer >= 0 (MiB; 0: the fused lm "
            "head always rebuilds the logits in its backward pass)."
        )
    if config.num_sample_generations < 0 or config.truncate_after < 0:
        problems.add(
            f"num_sample_generations={config.num_sample_generations}, truncate_after={config.truncate_after}: "
            "both must be >= 0."
        )


def check_sampling_fields(config: Any, problems: ConfigProblems) -> None:
    """Temperature, stop token, generation loop and where the rollout log-probs come from."""
    if not (config.temperature > 0 and math.isfinite(config.temperature)):
        problems.add(f"temperature={config.temperature}: expected a finite number > 0 (1.0 samples as is).")
    if isinstance(config.top_k, bool) or not isinstance(config.top_k, int) or config.top_k < 0:
        problems.add(f"top_k={config.top_k!r}: expected an integer >= 0 (0: no top-k restriction).")
    if not 0 < config.top_p <= 1:
        problems.add(f"top_p={config.top_p}: expected a number in (0, 1] (1.0: no nucleus restriction).")
    if not 0 <= config.min_p <= 1:
        problems.add(f"min_p={config.min_p}: expected a number in [0, 1] (0.0: no min-p restriction).")
    if config.stop_token is not None and config.stop_token not in STOP_TOKENS:
        problems.add(
            f"stop_token={config.stop_token!r}: expected 'eos' or None (for another token, set stop_token_id)."
        )
    if _valid_length(config) and config.truncate_after >= config.response_length:
        problems.add(
            f"truncate_after={config.truncate_after} must be < response_length={config.response_length}: no stop "
            "token could ever count."
        )
    if config.generation_loop not in GENERATION_LOOPS:
        problems.add(f"generation_loop={config.generation_loop!r}: expected one of {GENERATION_LOOPS}.")
    if config.rollout_logprobs not in ROLLOUT_LOGPROBS:
        problems.add(f"rollout_logprobs={config.rollout_logprobs!r}: expected one of {ROLLOUT_LOGPROBS}.")
    if config.rollout_logprobs == "generation" and not config.disable_dropout:
        problems.add(
            "rollout_logprobs='generation' with disable_dropout=False: generation runs without dropout "
            "and the training pass with it, so the rollout log-probs would not be the training policy's. "
            "Use rollout_logprobs='forward' (or 'auto'), or disable_dropout=True."
        )


def check_vllm_fields(config: Any, problems: ConfigProblems) -> None:
    """use_vllm and its settings (vLLM itself is looked for when the trainer is built), and
    async_rollouts."""
    if config.async_rollouts and not config.use_vllm:
        problems.add(
            "async_rollouts=True needs use_vllm=True (generation on vLLM servers, vllm_mode='server', overlaps "
            "training; a colocated engine generates ahead without overlap)."
        )
    if config.max_staleness != 1:
        problems.add(
            f"max_staleness={config.max_staleness!r}: only 1 is implemented (the next update's responses are "
            "generated while this one trains)."
        )
    if not config.use_vllm:
        return
    if config.vllm_lora_sync not in ("merged", "adapter"):
        problems.add(
            f"vllm_lora_sync={config.vllm_lora_sync!r}: expected 'merged' (the adapter merged into the weights "
            "sent) or 'adapter' (only the adapter, loaded by vLLM servers started with --enable_lora)."
        )
    elif config.vllm_lora_sync == "adapter" and config.vllm_mode != "server":
        problems.add(
            "vllm_lora_sync='adapter' is for vllm_mode='server' (servers load the adapter from a shared folder); "
            "a colocated engine takes the merged weights in memory: leave vllm_lora_sync='merged'."
        )
    if config.vllm_mode not in VLLM_MODES:
        problems.add(
            f"vllm_mode={config.vllm_mode!r}: expected 'colocate' (an engine inside each training process) or "
            "'server' (separate vLLM servers, rlhf-trainers vllm-serve)."
        )
    if config.vllm_mode == "server":
        if not config.vllm_server_timeout > 0:
            problems.add(f"vllm_server_timeout={config.vllm_server_timeout}: expected seconds > 0, e.g. 240.")
        port = config.vllm_group_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            problems.add(f"vllm_group_port={port!r}: expected a TCP port (0: any free one).")
        try:
            from ..generation.vllm_server import server_urls

            server_urls(config.vllm_server_base_url, config.vllm_server_host, config.vllm_server_port)
        except ValueError as err:
            problems.add(str(err))
    if not 0 < config.vllm_gpu_memory_utilization <= 1:
        problems.add(
            f"vllm_gpu_memory_utilization={config.vllm_gpu_memory_utilization}: expected a fraction in (0, 1], "
            "e.g. 0.3."
        )
    value = config.vllm_kv_cache_space_gib
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.add(f"vllm_kv_cache_space_gib={value!r}: expected a whole number of GiB >= 1.")
    if config.vllm_tensor_parallel_size != 1 and config.vllm_mode == "colocate":
        problems.add(
            f"vllm_tensor_parallel_size={config.vllm_tensor_parallel_size}: colocated engines run with "
            "tensor-parallel size 1 so far; set vllm_tensor_parallel_size=1."
        )
    if config.vllm_dtype not in VLLM_DTYPES:
        problems.add(f"vllm_dtype={config.vllm_dtype!r}: expected one of {VLLM_DTYPES}.")
    value = config.vllm_max_model_length
    if value is not None and (
        isinstance(value, bool)
        or not isinstance(value, int)
        or (_valid_length(config) and value <= config.response_length)
    ):
        problems.add(
            f"vllm_max_model_length={value!r}: expected an integer > response_length={config.response_length} "
            "(it holds prompt and response), or None."
        )
    if config.vllm_importance_sampling_mode not in VLLM_IS_MODES:
        problems.add(
            f"vllm_importance_sampling_mode={config.vllm_importance_sampling_mode!r}: expected one of "
            f"{VLLM_IS_MODES}."
        )
    if not (config.vllm_importance_sampling_cap > 0 and math.isfinite(config.vllm_importance_sampling_cap)):
        problems.add(
            f"vllm_importance_sampling_cap={config.vllm_importance_sampling_cap}: expected a finite number > 0 "
            "(e.g. 3.0)."
        )
    if config.generation_loop != "builtin":
        problems.add(
            f"generation_loop={config.generation_loop!r} with use_vllm=True: vLLM replaces the generation "
            "loop; leave generation_loop at its default."
        )


def check_reward_and_loss_fields(config: Any, problems: ConfigProblems) -> None:
    """Reward shaping, KL and the clipped loss."""
    if config.missing_eos_penalty is not None and config.rejection_penalty is not None:
        problems.add(
            "missing_eos_penalty and rejection_penalty are two ways to penalise a response without a stop "
            "token (subtract vs replace); set one of them."
        )
    if config.kl_estimator not in KL_ESTIMATORS:
        problems.add(f"kl_estimator={config.kl_estimator!r}: expected one of {KL_ESTIMATORS}.")
    if config.kl_coef < 0 or not math.isfinite(config.kl_coef):
        problems.add(f"kl_coef={config.kl_coef}: expected a finite number >= 0.")
    if config.kl_loss_coef < 0 or not math.isfinite(config.kl_loss_coef):
        problems.add(f"kl_loss_coef={config.kl_loss_coef}: expected a finite number >= 0 (0: no KL loss).")
    if not math.isfinite(config.entropy_coeff) or config.entropy_coeff < 0:
        problems.add(f"entropy_coeff={config.entropy_coeff}: expected a finite number >= 0 (0: no bonus).")
    if config.kl_loss_estimator not in KL_ESTIMATORS:
        problems.add(f"kl_loss_estimator={config.kl_loss_estimator!r}: expected one of {KL_ESTIMATORS}.")
    if config.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        problems.add(
            f"importance_sampling_level={config.importance_sampling_level!r}: expected one of "
            f"{IMPORTANCE_SAMPLING_LEVELS}."
        )
    if config.adaptive_kl and not config.kl_target > 0:
        problems.add(f"kl_target={config.kl_target}: the adaptive controller needs a target > 0.")
    with problems.collect():
        get_policy_loss(config.policy_loss)  # a ValueError naming the registered losses
    if not 0 < config.cliprange < 1:
        problems.add(f"cliprange={config.cliprange}: expected a number in (0, 1), e.g. 0.2.")
    if config.cliprange_high is not None and not config.cliprange_high > 0:
        problems.add(f"cliprange_high={config.cliprange_high}: expected a number > 0, or None.")
    if config.dual_clip is not None and not config.dual_clip > 1:
        problems.add(f"dual_clip={config.dual_clip}: expected a constant > 1 (e.g. 3.0), or None.")
    if config.loss_agg_mode not in LOSS_AGG_MODES:
        problems.add(f"loss_agg_mode={config.loss_agg_mode!r}: expected one of {LOSS_AGG_MODES}.")
    if config.reward_clip is not None and not config.reward_clip > 0:
        problems.add(f"reward_clip={config.reward_clip}: expected a number > 0, or None.")
    if config.reward_scaling is not None:
        if len(config.reward_scaling) != 4:
            problems.add(
                f"reward_scaling={config.reward_scaling}: expected four numbers "
                "[source_min, source_max, target_min, target_max], e.g. [0, 1, -1, 1]."
            )
        elif not (
            config.reward_scaling[1] > config.reward_scaling[0]
            and config.reward_scaling[3] >= config.reward_scaling[2]
        ):
            problems.add(
                f"reward_scaling={config.reward_scaling}: needs source_max > source_min and "
                "target_max >= target_min."
            )
    if (
        _valid_length(config)
        and isinstance(config.overlong_buffer_length, int)
        and config.overlong_buffer_length > config.response_length
    ):
        problems.add(
            f"overlong_buffer_length={config.overlong_buffer_length} must be <= response_length="
            f"{config.response_length}."
        )
    if config.mask_truncated_completions and config.stop_token is None and config.stop_token_id is None:
        problems.add(
            "mask_truncated_completions=True without a stop token (stop_token=None, stop_token_id=None): "
            "every completion runs to response_length and all would be masked. Set stop_token='eos'."
        )
    if config.overlong_penalty < 0:
        problems.add(f"overlong_penalty={config.overlong_penalty}: expected a number >= 0.")


def check_agent_fields(config: Any, problems: ConfigProblems) -> None:
    """``max_tool_calling_iterations`` (an int >= 0 or None) and ``tool_timeout`` (seconds > 0 or None)."""
    iterations = config.max_tool_calling_iterations
    if iterations is not None and (
        isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0
    ):
        problems.add(
            f"max_tool_calling_iterations={iterations!r}: give the most tool turns per episode as an int >= 0, "
            "or None for no limit but the completion length."
        )
    timeout = config.tool_timeout
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        problems.add(
            f"tool_timeout={timeout!r}: give the seconds one tool call may run as a number > 0, or None for no limit."
        )
