"""Generation for the on-policy engine: sampling responses from the policy (the builtin loop or
``transformers.generate``), the ZeRO-3 context it runs in, and the whole-weights copies of models.

:class:`OnPolicyGenerationMixin` holds the methods; :class:`~rlhf_trainers.onpolicy.trainer.OnPolicyTrainer`
inherits them and calls ``self._generate(query, query_mask, with_logprobs)``.
"""

from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import functional as F
from ..cpu_linear import OneDNNLinear, onednn_linear_available
from ..models import generation_config_set_aside
from ..sampling import sample_completions

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _zero3_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of `model` that DeepSpeed ZeRO-3 partitioned (loaded under ``zero.Init``)."""
    return [p for p in model.parameters() if hasattr(p, "ds_id")]


def _full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of `model`'s state dict with whole tensors, gathering ZeRO-3 partitions (a collective:
    every process must call it)."""
    params = _zero3_params(model)
    gather: Any = contextlib.nullcontext()
    if params:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    with gather, torch.no_grad():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> Any:
    """``model.load_state_dict(state)`` that also fills ZeRO-3 partitioned parameters (a collective)."""
    params = _zero3_params(model)
    gather: Any = contextlib.nullcontext()
    if params:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(params, modifier_rank=0)
    with gather, torch.no_grad():
        return model.load_state_dict(state, strict=strict)


def copy_model(model: PreTrainedModel) -> PreTrainedModel:
    """A deep copy of `model`. Under DeepSpeed ZeRO-3 with ``zero3_init_flag`` a model loaded from a path
    is partitioned and ``copy.deepcopy`` would copy empty shards and DeepSpeed's bookkeeping: the copy is
    then built from the config (partitioned again under ``zero.Init``) and filled with the gathered
    weights."""
    if not _zero3_params(model):
        return copy.deepcopy(model)
    state = _full_state_dict(model)
    dtype = next(iter(model.parameters())).dtype
    clone = type(model)._from_config(copy.deepcopy(model.config), dtype=dtype)
    _load_full_state_dict(clone, state)
    if getattr(model, "generation_config", None) is not None:
        clone.generation_config = copy.deepcopy(model.generation_config)
    clone.train(model.training)
    return clone


def _deepspeed_inference_engine(model: nn.Module, accelerator: Any) -> Any:
    """A ZeRO-3 inference engine for a frozen model (weights partitioned across processes)."""
    import deepspeed

    plugin = accelerator.state.deepspeed_plugin
    config = copy.deepcopy(plugin.deepspeed_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    zero = dict(config.get("zero_optimization", {}))
    zero["stage"] = 3
    for key in ("offload_optimizer",):
        zero.pop(key, None)
    config["zero_optimization"] = zero
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        if config.get(key) == "auto" or key not in config:
            config[key] = 1
    config.pop("train_batch_size", None)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


class OnPolicyGenerationMixin:
    """The engine's generation methods (mixed into :class:`~rlhf_trainers.onpolicy.trainer.OnPolicyTrainer`,
    whose ``args``, ``policy``, ``processing_class``, ``_stop_ids`` and accelerator they use)."""

    @contextlib.contextmanager
    def _generation_context(self) -> Any:
        """Under ZeRO-3, what generation needs around it. With ``ds3_gather_for_generation`` (or before
        training, when no engine's hooks would fetch the shards): the policy's weights gathered whole and
        the training engine's parameter hooks removed meanwhile, as DeepSpeed's own
        ``unwrap_model_for_generation`` does: with the hooks on, every generation step would still run
        the engine's fetch/trace bookkeeping, and ranks whose responses stop after different numbers of
        steps would then issue different collectives and deadlock at the next forward pass. Without
        gathering, the hooks fetch the shards layer by layer and ``generate(synced_gpus=True)`` keeps the
        ranks in step."""
        params = _zero3_params(self.policy)
        if not params:
            yield
            return
        optimizer = getattr(self.model_wrapped, "optimizer", None)
        offload = getattr(optimizer, "parameter_offload", None)
        if offload is not None and not self.args.ds3_gather_for_generation:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if offload is None:
                yield
                return
            for hook in offload.forward_hooks + offload.backward_hooks:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            try:
                yield
            finally:
                offload._register_deepspeed_module(offload.module)

    def _resolve_onednn_linear(self) -> None:
        """``onednn_linear``: whether generation runs the decoding steps' linear layers through oneDNN
        (:class:`~rlhf_trainers.cpu_linear.OneDNNLinear`); decided once, at construction."""
        args = self.args
        on = bool(args.onednn_linear) and self.accelerator.device.type == "cpu"
        on = on and not (args.bf16 or args.fp16) and not self.is_deepspeed_enabled
        if on:
            largest = max(
                (m.weight.numel() for m in self.policy.modules() if isinstance(m, nn.Linear)), default=0
            )
            floating = [p for p in self.policy.parameters() if p.is_floating_point()]
            on = (
                largest >= args.onednn_linear_min_weights
                and all(p.dtype == torch.float32 for p in floating)
                and onednn_linear_available()
            )
        #: True when generation runs under :class:`~rlhf_trainers.cpu_linear.OneDNNLinear`.
        self.uses_onednn_linear = on

    def _linear_backend(self) -> contextlib.AbstractContextManager[Any]:
        """The context generation runs in: oneDNN's linear for the decoding steps where
        :attr:`uses_onednn_linear`, else nothing (the mode sees every torch call made inside it, so it
        covers generation only)."""
        return OneDNNLinear() if self.uses_onednn_linear else contextlib.nullcontext()

    def _synced_generation(self) -> bool:
        """Multi-process ZeRO-3 without gathering the weights: ranks must step generation together."""
        return bool(
            self.is_deepspeed_enabled
            and not self.args.ds3_gather_for_generation
            and self.accelerator.num_processes > 1
        )

    @property
    def logprobs_from_generation(self) -> bool:
        """Whether the rollout takes its log-probs and entropy from the sampling loop
        (``rollout_logprobs``, with 'auto' resolved against the policy's dtype and the precision)."""
        cached = getattr(self, "_logprobs_from_generation", None)
        if cached is None:
            args = self.args
            if args.rollout_logprobs == "auto":
                float32 = all(
                    p.dtype == torch.float32 for p in self.policy.parameters() if p.is_floating_point()
                )
                cached = bool(
                    float32
                    and not (args.bf16 or args.fp16)
                    and args.disable_dropout
                    and args.generation_loop == "builtin"
                    and not self._synced_generation()
                    and not self.needs_generation_logprobs
                )
            else:
                cached = args.rollout_logprobs == "generation"
            self._logprobs_from_generation = cached
        return cached

    @torch.no_grad()
    def _generate(
        self, query: torch.Tensor, query_mask: torch.Tensor, with_logprobs: bool = False
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """Sample (B, response_length) response ids from ``softmax(logits / temperature)``; rows end at a
        stop token only when generation may stop there (else fixed length, truncated afterwards).

        With ``with_logprobs`` also ``{"logprobs", "entropy"}`` (B, response_length) float32: the sampled
        tokens' log-probabilities and the entropy of each step's distribution, as the generation computed
        them (its own logits / temperature, in the generation's precision; 0 after a stop token)."""
        args = self.args
        stop_in_generation = self._stop_ids and args.truncate_after == 0
        stop_ids = list(self._stop_ids) if stop_in_generation else []
        pad_id = self.processing_class.pad_token_id
        policy = self.policy
        was_training = policy.training
        policy.eval()
        synced = self._synced_generation()
        extras: dict[str, torch.Tensor] | None = None
        try:
            with self._generation_context(), self._linear_backend():
                if args.generation_loop == "builtin" and not synced:
                    samples = sample_completions(
                        policy,
                        query,
                        query_mask,
                        max_new_tokens=args.response_length,
                        temperature=args.temperature,
                        pad_token_id=pad_id,
                        stop_token_ids=stop_ids,
                        return_logprobs=with_logprobs,
                        lean_decoding=args.lean_decoding,
                    )
                    response = samples.tokens
                    if with_logprobs:
                        extras = {"logprobs": samples.logprobs, "entropy": samples.entropy}
                else:
                    response, extras = self._hf_generate(
                        policy, query, query_mask, stop_ids, with_logprobs, synced
                    )
        finally:
            policy.train(was_training)
        missing = args.response_length - response.shape[1]
        if missing > 0:
            pad = torch.full(
                (response.shape[0], missing), pad_id, dtype=response.dtype, device=response.device
            )
            response = torch.cat([response, pad], dim=1)
            if extras is not None:
                extras = {
                    k: torch.cat([v, torch.zeros_like(pad, dtype=v.dtype)], dim=1) for k, v in extras.items()
                }
        return response, extras

    def _hf_generate(
        self,
        policy: nn.Module,
        query: torch.Tensor,
        query_mask: torch.Tensor,
        stop_ids: list[int],
        with_logprobs: bool,
        synced: bool,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """``generate()`` with top-k 0 / top-p 1 and nothing from the model's ``generation_config``."""
        from transformers import GenerationConfig

        args = self.args
        config = GenerationConfig(
            max_new_tokens=args.response_length,
            do_sample=True,
            temperature=args.temperature,
            top_k=0,
            top_p=1.0,
            pad_token_id=self.processing_class.pad_token_id,
            # [] (not None, which generate() would fill from the model's generation config): sample the
            # full length, with EOS a token like any other (the seed's fixed-length responses).
            eos_token_id=stop_ids,
            use_cache=True,
            return_dict_in_generate=with_logprobs,
            output_logits=with_logprobs,
        )
        # generate() fills what `config` leaves unset (repetition_penalty, no_repeat_ngram_size,
        # suppress_tokens, ...) from the model's own generation_config: set a blank one aside meanwhile.
        with generation_config_set_aside(policy):
            out = policy.generate(
                input_ids=query, attention_mask=query_mask, generation_config=config, synced_gpus=synced
            )
        sequences = out.sequences if with_logprobs else out
        response = sequences[:, query.shape[1] :]
        if not with_logprobs:
            return response, None
        logits = torch.stack(out.logits, dim=1)
        logprobs, entropy = F.logprobs_and_entropy_from_logits(
            logits, response, args.temperature, compute_dtype=logits.dtype, entropy_dtype=torch.float32
        )
        done = torch.zeros_like(response, dtype=torch.bool)
        if stop_ids:
            # Positions after a row's stop token (generate pads them): 0, as the builtin loop.
            hits = torch.isin(response, torch.tensor(stop_ids, device=response.device))
            done[:, 1:] = hits.cumsum(1)[:, :-1] > 0
        return response, {
            "logprobs": logprobs.float().masked_fill(done, 0.0),
            "entropy": entropy.masked_fill(done, 0.0),
        }
