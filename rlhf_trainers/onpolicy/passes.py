"""The forward passes of the on-policy engine's models over rollout rows, without gradient (the
rollout's log-probs of policy and reference, PPO's values) and the inputs of every pass (the trimmed or
packed tokens the training pass reads too): :class:`ModelPasses`, one per trainer.

At construction it decides, once, how each model runs: the frozen models placed (ZeRO-3: inference
engines), the fused lm head where a model matches (``fused_lm_head``), and the padding-free packed
passes where a model keeps attention within packed sequences (``padding_free``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ..distributed import deepspeed_inference_engine
from ..models import readable_pad_id
from ..packing import attention_head_size, one_row_fits, packing_layout
from .forward import (
    PackedSequences,
    fused_head_matches,
    pack_sequences,
    pad_columns,
    response_logprobs,
    response_values,
    sequence_inputs,
    trim_bounds,
)
from .rollout import ForwardPasses, Rollout, SampledResponses

logger = logging.getLogger(__name__)


class ModelPasses:
    """How the trainer ``engine``'s models (policy, reference, value model; its ``args`` and
    ``accelerator``) run over rollout rows.

    Attributes:
        input_pad_id: what padding positions hold in the input of every pass: the pad id, or 0 where the
            policy has no embedding row for it (a "[PAD]" token added without resizing, as the RLOO blog's
            snippet does; the positions are masked out of attention).
        ref_forward / reward_forward: the ZeRO-3 inference engines of the frozen models, else None.
        fused_policy / fused_ref: whether the policy's and the reference's log-probs use the fused head.
        pack_policy / pack_ref / pack_values / pack_one_row: the padding-free passes (``padding_free``).
    """

    def __init__(self, engine: Any, vocab_size: int) -> None:
        self.engine = engine
        self.input_pad_id: int = readable_pad_id(engine.processing_class.pad_token_id, vocab_size)
        self._place_frozen_models()
        self._resolve_fused_head()
        self._resolve_padding_free()

    def _place_frozen_models(self) -> None:
        """Place the reference and reward models; under DeepSpeed ZeRO-3 wrap them in inference engines so
        their weights are partitioned like the trained ones. Under DeepSpeed ZeRO-1/2 also place the
        trained policy (and value model): ``transformers.Trainer`` leaves that to DeepSpeed's engine, which
        starts in ``train()``, so ``evaluate()`` before ``train()`` would generate with weights on the
        CPU and inputs on the GPU (the engine moves them to the same device anyway)."""
        device = self.engine.accelerator.device
        if self.engine.is_deepspeed_enabled and self.engine.accelerator.state.deepspeed_plugin.zero_stage < 3:
            self.engine.model.to(device)
        self.ref_forward: Callable[..., Any] | None = None
        self.reward_forward: Callable[..., Any] | None = None
        zero3 = (
            self.engine.is_deepspeed_enabled
            and self.engine.accelerator.state.deepspeed_plugin.zero_stage == 3
        )
        for name in ("ref", "reward"):
            model = getattr(self.engine, f"{name}_model")
            if model is None:
                continue
            if zero3:
                setattr(self, f"{name}_forward", deepspeed_inference_engine(model, self.engine.accelerator))
            else:
                model.to(device)

    def _resolve_fused_head(self) -> None:
        """``fused_lm_head``: use the fused log-prob head for the policy and the reference where each
        model passes :func:`fused_head_matches`; never under ZeRO-3 (partitioned lm-head weights)."""
        zero3 = (
            self.engine.is_deepspeed_enabled
            and self.engine.accelerator.state.deepspeed_plugin.zero_stage == 3
        )
        on = bool(self.engine.args.fused_lm_head) and not zero3
        self.fused_policy = on and fused_head_matches(self.engine.policy)
        if self.engine.ref_model is None:
            self.fused_ref = self.fused_policy
        else:
            self.fused_ref = on and self.ref_forward is None and fused_head_matches(self.engine.ref_model)

    def _resolve_padding_free(self) -> None:
        """``padding_free``: pack the passes of each model (policy, reference, value model) that has a
        :func:`~rlhf_trainers.packing.packing_layout`; the others keep the padded passes, with an info line
        saying so. The packed passes of a batch share one layout: a single row of all its real tokens when
        every packed model takes it, else rows of the longest sequence. Never under ZeRO-3 (its
        partitioned weights and inference engines were not tried with packing)."""
        self.pack_policy = self.pack_ref = self.pack_values = False
        self.pack_one_row = False
        if not self.engine.args.padding_free:
            return
        if (
            self.engine.is_deepspeed_enabled
            and self.engine.accelerator.state.deepspeed_plugin.zero_stage == 3
        ):
            logger.info("padding_free: not under DeepSpeed ZeRO-3; every forward pass stays padded.")
            return
        layouts: list[str] = []

        def check(name: str, model: Any) -> bool:
            layout = packing_layout(model)
            if layout is None:
                logger.info(
                    "padding_free: the %s (%s) does not keep attention within packed sequences (checked on a "
                    "probe at construction); its forward passes stay padded.",
                    name,
                    type(model).__name__,
                )
                return False
            layouts.append(layout)
            return True

        self.pack_policy = check("policy", self.engine.policy)
        if self.engine.ref_model is None:
            self.pack_ref = self.pack_policy  # the policy with its adapter disabled (PEFT), or none
        elif self.ref_forward is None:
            self.pack_ref = check("reference model", self.engine.ref_model)
        if self.engine.value_model is not None:
            self.pack_values = check("value model", self.engine.value_model)
        self.pack_one_row = bool(layouts) and all(layout == "one_row" for layout in layouts)
        if self.pack_one_row:
            dtype = (
                torch.bfloat16 if self.engine.args.bf16 else torch.float16 if self.engine.args.fp16 else None
            )
            packed = (
                (self.engine.policy, self.pack_policy),
                (self.engine.ref_model, self.pack_ref),
                (self.engine.value_model, self.pack_values),
            )
            models = [m for m, on in packed if m is not None and on]
            fits = all(
                one_row_fits(
                    self.engine.accelerator.device,
                    dtype or next(m.parameters()).dtype,
                    attention_head_size(m),
                )
                for m in models
            )
            if not fits:
                logger.info(
                    "padding_free: on %s in %s the packed passes use rows of the longest sequence (one "
                    "attention call per sequence, the one-row layout's, is slow there without PyTorch's "
                    "variable-length flash attention: torch >= 2.10, fp16/bf16, an Ampere or newer GPU).",
                    self.engine.accelerator.device,
                    dtype or next(self.engine.policy.parameters()).dtype,
                )
                self.pack_one_row = False

    # ---- the passes ----

    def logprob_options(self) -> dict[str, Any]:
        """Temperature, chunking and precision of every log-prob computation of the engine."""
        args = self.engine.args
        return {
            "temperature": args.temperature,
            "chunk_size": args.logprob_chunk_size,
            "compute_dtype": torch.float32 if args.logprobs_in_fp32 else None,
            "keep_logits_bytes": args.fused_lm_head_kept_logits_mib * 2**20,
        }

    def sequence_inputs(
        self,
        query: torch.Tensor,
        query_mask: torch.Tensor,
        response: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return sequence_inputs(query, query_mask, response, response_mask, self.input_pad_id)

    def packed(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        response_mask: torch.Tensor,
        training: bool = False,
    ) -> PackedSequences | None:
        """The inputs of :meth:`sequence_inputs` packed for the padding-free passes
        (:func:`~rlhf_trainers.onpolicy.forward.pack_sequences`); None when no model's passes are packed
        (``padding_free`` off, or no model passed the check) or no row has a valid response token.

        In one row when every packed model takes it, except for a ``training`` pass of a model under
        gradient checkpointing: its backward pass recomputes the forward outside the pass's
        :func:`~rlhf_trainers.packing.one_row_attention`, so it keeps rows of the longest sequence."""
        if not (self.pack_policy or self.pack_ref or self.pack_values):
            return None
        one_row = self.pack_one_row
        if one_row and training:
            one_row = not any(
                getattr(module, "gradient_checkpointing", False) is True
                for model in (self.engine.policy, self.engine.value_model)
                if model is not None
                for module in model.modules()
            )
        return pack_sequences(ids, mask, positions, response_mask, self.input_pad_id, one_row=one_row)

    @torch.no_grad()
    def reference_logprobs(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        response: torch.Tensor,
        packing: PackedSequences | None = None,
    ) -> torch.Tensor:
        options = self.logprob_options()
        packing = packing if self.pack_ref else None
        if self.engine.ref_model is None:
            # PEFT: the reference is the same weights with the adapter disabled (no second copy).
            forward, context = self.engine.policy, self.engine.policy.disable_adapter()
        else:
            forward, context = self.ref_forward or self.engine.ref_model, contextlib.nullcontext()
        with context:
            return response_logprobs(
                forward,
                ids,
                mask,
                positions,
                response,
                options,
                fused_head=self.fused_ref,
                with_entropy=False,
                packing=packing,
            )[0]

    def inputs(
        self,
        query: torch.Tensor,
        query_mask: torch.Tensor,
        response: torch.Tensor,
        response_mask: torch.Tensor,
        bounds: tuple[int, int] | None = None,
        training: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PackedSequences | None]:
        """The inputs of a forward pass over rows of a rollout (the no-grad passes' and the training
        pass's): the columns some row uses (``bounds``: first prompt column, end of the response columns;
        :func:`trim_bounds` of the masks when None), as ``(ids, mask, positions, response, packing)``;
        ``response`` holds the trimmed response columns as the passes read them (padding as an id the model
        has), ``packing`` the real tokens packed (:meth:`packed`, `training` passed on)."""
        first, end = trim_bounds(query_mask, response_mask) if bounds is None else bounds
        query = query[:, first:]
        ids, mask, positions = self.sequence_inputs(
            query, query_mask[:, first:], response[:, :end], response_mask[:, :end]
        )
        packing = self.packed(ids, mask, positions, response_mask[:, :end], training=training)
        return ids, mask, positions, ids[:, query.shape[1] :], packing

    def logprobs(
        self, samples: SampledResponses, timings: dict[str, float] | None = None, with_values: bool = True
    ) -> ForwardPasses:
        """The rollout's log-probs (the producer's step d): per chunk of ``local_rollout_forward_batch_size`` rows, the policy's log-probs and
        entropy (a training-mode forward pass, or the sampling loop's own where
        :attr:`logprobs_from_generation`), the reference's log-probs and the value model's values (unless
        ``with_values`` is False: the optimization loop then fills them, :meth:`~rlhf_trainers.onpolicy.optimize.OptimizationLoop.fill_values`).

        The forward passes see the prompt columns some row of the chunk uses and the response columns up
        to its longest response; what they leave out is padding in every row, and the results are padded
        back to R with zeros (at masked positions). With ``padding_free`` the passes of the models that
        allow it run on the chunk's real tokens packed (:meth:`packed`)."""
        timings = timings if timings is not None else defaultdict(float)
        R = samples.response.shape[1]
        step = self.engine.args.local_rollout_forward_batch_size
        from_generation = (
            self.engine.sampler.logprobs_from_generation and samples.generation_logprobs is not None
        )
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        for start in range(0, samples.response.shape[0], step):
            rows = slice(start, start + step)
            response_mask = samples.response_mask[rows]
            ids, mask, positions, response, packing = self.inputs(
                samples.query[rows], samples.query_mask[rows], samples.response[rows], response_mask
            )
            if from_generation:
                # The sampling loop's own log-probs (rollout_logprobs): no policy forward pass.
                parts["logprobs"].append(samples.generation_logprobs[rows].masked_fill(~response_mask, 0.0))
                if samples.generation_entropy is not None:  # vLLM gives none
                    parts["entropy"].append(samples.generation_entropy[rows].masked_fill(~response_mask, 0.0))
                timings["timing/policy"] += 0.0  # logged as 0: the pass was skipped
            else:
                began = time.perf_counter()
                logprobs, entropy = response_logprobs(
                    self.engine.policy,
                    ids,
                    mask,
                    positions,
                    response,
                    self.logprob_options(),
                    fused_head=self.fused_policy,
                    packing=packing if self.pack_policy else None,
                )
                parts["logprobs"].append(pad_columns(logprobs, R))
                parts["entropy"].append(pad_columns(entropy, R))
                timings["timing/policy"] += time.perf_counter() - began
            if self.engine.args.uses_reference_model:
                began = time.perf_counter()
                parts["ref_logprobs"].append(
                    pad_columns(self.reference_logprobs(ids, mask, positions, response, packing), R)
                )
                timings["timing/ref"] += time.perf_counter() - began
            else:
                # No KL term reads a reference: none is run; its log-probs are the policy's (KL 0).
                parts["ref_logprobs"].append(parts["logprobs"][-1])
            if with_values and self.engine.value_model is not None:
                began = time.perf_counter()
                values = response_values(
                    self.engine.value_model,
                    ids,
                    mask,
                    positions,
                    response.shape[1],
                    packing=packing if self.pack_values else None,
                )
                parts["values"].append(pad_columns(values.float(), R))
                timings["timing/values"] += time.perf_counter() - began
        joined = {name: torch.cat(values) for name, values in parts.items()}
        return ForwardPasses(values=joined.pop("values", None), entropy=joined.pop("entropy", None), **joined)

    def values(
        self,
        rollout: Rollout,
        skip_rows: torch.Tensor,
        timings: dict[str, float] | None = None,
    ) -> torch.Tensor:
        """(N, R) float32 values of the value model for the rollout rows, 0 at masked positions and in the
        rows ``skip_rows`` (indices: those whose values come from their first training pass, from their first training pass,
        :meth:`~rlhf_trainers.onpolicy.optimize.OptimizationLoop.fill_values`): a no-grad pass in chunks of ``local_rollout_forward_batch_size`` rows over the
        rollout's prompt and response tokens, trimmed and packed as :meth:`logprobs`'s value pass is."""
        timings = timings if timings is not None else defaultdict(float)
        N, R = rollout.response.shape
        values = rollout.response.new_zeros((N, R), dtype=torch.float32)
        rest = torch.ones(N, dtype=torch.bool, device=values.device)
        rest[skip_rows.to(values.device)] = False
        rest = rest.nonzero().squeeze(1)
        began = time.perf_counter()
        with torch.no_grad(), self.engine.accelerator.autocast():
            for rows in rest.split(self.engine.args.local_rollout_forward_batch_size) if rest.numel() else ():
                response_mask = rollout.response_mask[rows]
                ids, mask, positions, response, packing = self.inputs(
                    rollout.query[rows], rollout.query_mask[rows], rollout.response[rows], response_mask
                )
                part = response_values(
                    self.engine.value_model,
                    ids,
                    mask,
                    positions,
                    response.shape[1],
                    packing=packing if self.pack_values else None,
                )
                values[rows] = pad_columns(part.float(), R).masked_fill(~response_mask, 0.0)
        timings["timing/values"] += time.perf_counter() - began
        return values
