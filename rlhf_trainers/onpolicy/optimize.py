"""Step 5 of the update: ``num_ppo_epochs`` x ``num_mini_batches`` optimizer steps over a rollout, each over
gradient-accumulated micro-batches, with the algorithm's loss (an
:class:`~rlhf_trainers.onpolicy.objective.Objective`) as an argument.

What is the same for every algorithm lives here: the shuffles, the micro-batch split (fixed sizes or a
token budget), the loss denominators of each optimizer step (so a split changes nothing but rounding),
the ratio-at-start guard, gradient sync under DDP, clipping and the optimizer and scheduler steps.

PPO's ``rollout_values='auto'`` runs here too (:meth:`OptimizationLoop.fill_values`): the first micro-batch's
training forward pass gives the rollout its values for those rows, and is kept for its backward pass.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import compat
from .. import functional as F
from .forward import column_bounds, pad_columns
from .metrics import MicroBatchReductions, sampling_mismatch_metrics
from .rollout import Advantages, FirstMicroBatch, HeldForward, LossNormalization, Rollout

if TYPE_CHECKING:
    from .trainer import OnPolicyTrainer

logger = logging.getLogger(__name__)


class OptimizationLoop:
    """The optimizer steps of an update, for the trainer ``engine`` (its args, accelerator, optimizer,
    scheduler, callbacks and the forward passes of its models)."""

    def __init__(self, engine: OnPolicyTrainer) -> None:
        self.engine = engine
        self.held: HeldForward | None = None
        self._ratio_warned = False
        #: The learning rate of the last optimizer step (what ``transformers.Trainer`` logs as
        #: ``learning_rate``); None before the first step.
        self.last_learning_rate: float | None = None

    @property
    def args(self) -> Any:
        return self.engine.args

    # ---- the shuffles and the split --------------------------------------------------------------

    def epoch_orders(self, N: int, update: int) -> list[torch.Tensor]:
        """The shuffles of the update, one per epoch (host tensors): fixed by ``seed``, the process and the
        update, so a resumed run, and :meth:`fill_values`, see the same."""
        args = self.args
        process = self.engine.accelerator.process_index
        return [
            torch.randperm(
                N,
                generator=torch.Generator().manual_seed(hash((args.seed, process, update, epoch)) % (2**63)),
            )
            for epoch in range(args.num_ppo_epochs)
        ]

    def micro_batches(
        self, rows: torch.Tensor, query_start: torch.Tensor, response_end: torch.Tensor, query_width: int
    ) -> list[torch.Tensor]:
        """How one mini-batch (``rows``, host indices into the rollout, in the shuffled order) is split
        into micro-batches: ``gradient_accumulation_steps`` of ``per_device_train_batch_size`` rows, or,
        with ``max_tokens_per_microbatch``, as few micro-batches as keep each one's padded size (rows x
        its trimmed columns; its real tokens when the policy's passes are packed, ``padding_free``) within
        the budget: rows longest first, packed greedily (a row longer than the budget alone). The loss
        denominators count the whole mini-batch, so the split changes the gradient only by rounding."""
        args = self.args
        budget = args.max_tokens_per_microbatch
        if budget is None:
            return list(rows.split(args.per_device_train_batch_size))
        prompt = (query_width - query_start[rows]).clamp_max(query_width)
        order = rows[torch.argsort(prompt + response_end[rows], descending=True, stable=True)]
        packed = (
            self.engine.passes.pack_policy
        )  # padding-free passes cost the real tokens, padded ones rows x width
        parts: list[list[int]] = []
        widest_prompt = widest_response = tokens = 0
        for row in order.tolist():
            p, r = int(query_width - query_start[row]), int(response_end[row])
            if parts:
                width = max(widest_prompt, p) + max(widest_response, r)
                cost = tokens + p + r if packed else (len(parts[-1]) + 1) * width
                if cost <= budget:
                    parts[-1].append(row)
                    widest_prompt, widest_response = max(widest_prompt, p), max(widest_response, r)
                    tokens += p + r
                    continue
            parts.append([row])
            widest_prompt, widest_response, tokens = p, r, p + r
        return [torch.tensor(part, dtype=rows.dtype) for part in parts]

    def loss_normalizations(
        self, rollout: Rollout, orders: Sequence[torch.Tensor]
    ) -> list[list[LossNormalization]]:
        """The denominators of every optimizer step of the update (per epoch, per mini-batch): the valid
        tokens and the sequences with a valid token of the mini-batch, summed over its micro-batches and
        over all processes (one collective for the whole update), divided by the number of processes
        (data-parallel gradients are averaged over them)."""
        args, accelerator = self.args, self.engine.accelerator
        mask = rollout.policy_mask.cpu()
        tokens, sequences = mask.sum(1).double(), mask.any(1).double()
        size = args.local_mini_batch_size
        counts = torch.stack(
            [
                torch.stack(
                    [tokens[order].reshape(-1, size).sum(1), sequences[order].reshape(-1, size).sum(1)]
                )
                for order in orders
            ]
        )  # (epochs, 2, mini-batches)
        world = accelerator.num_processes
        if world > 1:
            counts = self.engine.collectives.all_reduce(counts.to(accelerator.device)).cpu()
        counts = (counts / world).float()
        device = rollout.response.device
        return [
            [
                LossNormalization(
                    tokens=counts[e, 0, m].to(device),
                    sequences=counts[e, 1, m].to(device),
                    max_length=args.response_length,
                )
                for m in range(counts.shape[2])
            ]
            for e in range(counts.shape[0])
        ]

    # ---- forward passes --------------------------------------------------------------------------

    def training_forward(
        self, model: nn.Module, rollout: Rollout, rows: torch.Tensor, bounds: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Log-probs (with gradient), values (PPO) and the entropy (with gradient: ``entropy_coeff``) of
        rollout ``rows``. The pass covers only the columns some row of the micro-batch needs (``bounds``:
        first prompt column, end of the response columns; from the masks when None); the outputs are
        padded back to the rollout's response length with zeros at the (masked) positions left out."""
        engine = self.engine
        R = rollout.response.shape[1]
        ids, mask, positions, response, packing = engine.passes.inputs(
            rollout.query[rows],
            rollout.query_mask[rows],
            rollout.response[rows],
            rollout.response_mask[rows],
            bounds,
            training=True,
        )
        logprobs, values, entropy = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            with_values=engine.value_model is not None,
            response=response,
            logprob_options=engine.passes.logprob_options(),
            fused_head=engine.passes.fused_policy,
            policy_packing=packing if engine.passes.pack_policy else None,
            value_packing=packing if engine.passes.pack_values else None,
        )
        if values is not None:
            values = pad_columns(values.float(), R)
        return pad_columns(logprobs, R), values, pad_columns(entropy, R)

    def micro_batch_sync(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager[Any]:
        """The gradient-sync context of a micro-batch's forward and backward passes: accumulation without
        an all-reduce except at the mini-batch's last micro-batch (DDP's ``no_sync``; DeepSpeed and a
        single process need none)."""
        engine = self.engine
        compat.set_sync_gradients(engine.accelerator, last)
        if last or engine.is_deepspeed_enabled or engine.accelerator.num_processes == 1:
            return contextlib.nullcontext()
        return engine.accelerator.no_sync(model)

    # ---- PPO's values from the first training pass (rollout_values='auto') ---------------------------

    @property
    def values_from_training_pass(self) -> bool:
        """Whether the rollout's values of the first micro-batch come from that micro-batch's training
        forward pass (``rollout_values='auto'``, PPO) instead of a no-grad pass: where there is a value
        model, dropout is off (the training pass computes what a no-grad pass would), and the rows trained
        are the rows rolled out on this process with an engine that lets a forward pass wait for its
        backward (not DeepSpeed, no ``balance_batch`` over several processes)."""
        engine, args = self.engine, self.args
        return bool(
            engine.value_model is not None
            and getattr(args, "rollout_values", "forward") == "auto"
            and args.disable_dropout
            and not engine.is_deepspeed_enabled
            and not (args.balance_batch and engine.accelerator.num_processes > 1)
        )

    def first_micro_batch(self, rollout: Rollout, update: int) -> FirstMicroBatch:
        """The first micro-batch (epoch 0, mini-batch 0) of :meth:`run`, as it will split it."""
        query_start = F.first_true_indices(rollout.query_mask).cpu()
        response_end = (F.last_true_indices(rollout.response_mask) + 1).cpu()
        order = self.epoch_orders(rollout.response.shape[0], update)[0]
        Q = rollout.query.shape[1]
        micro_batches = self.micro_batches(
            order[: self.args.local_mini_batch_size], query_start, response_end, Q
        )
        rows = micro_batches[0]
        return FirstMicroBatch(
            rows=rows,
            bounds=column_bounds(query_start[rows], response_end[rows], Q),
            last=len(micro_batches) == 1,
        )

    def fill_values(self, model: nn.Module, rollout: Rollout, update: int, timings: dict[str, float]) -> None:
        """With :attr:`values_from_training_pass`, the rollout's values: a no-grad pass gives them to the
        rows outside the first micro-batch; that micro-batch then runs its training forward pass (before
        any optimizer step, under the gradient-sync context its backward will have), whose detached values
        are the rollout's for its rows, and is kept for :meth:`run`. The no-grad pass runs first so the
        two do not hold memory at once. Does nothing otherwise (the rollout's values, if any, came from
        the rollout's own passes)."""
        self.held = None
        if not self.values_from_training_pass:
            return
        first = self.first_micro_batch(rollout, update)
        values = self.engine.passes.values(rollout, first.rows, timings)
        began = time.perf_counter()
        with self.micro_batch_sync(model, last=first.last):
            logprobs, held_values, entropy = self.training_forward(
                model, rollout, first.rows.to(rollout.response.device), first.bounds
            )
        assert held_values is not None, "rollout_values='auto' needs the value model's values"
        timings["timing/update"] += time.perf_counter() - began
        self.held = HeldForward(first.rows, logprobs, held_values, entropy)
        rows = first.rows.to(values.device)
        values[rows] = held_values.detach().float().masked_fill(~rollout.response_mask[rows], 0.0)
        rollout.values = values

    # ---- the loop --------------------------------------------------------------------------------

    def run(
        self, model: nn.Module, rollout: Rollout, advantages: Advantages, update: int
    ) -> dict[str, float]:
        """``num_ppo_epochs`` x ``num_mini_batches`` optimizer steps over the rollout, each over
        ``gradient_accumulation_steps`` micro-batches (or those of the token budget,
        :meth:`micro_batches`); returns the mean metrics over processes (TRL's per-micro-batch names,
        where the objective logs them, reduced as TRL does: :class:`~.metrics.MicroBatchReductions`)."""
        engine, args = self.engine, self.args
        stats: dict[str, list[torch.Tensor]] = defaultdict(list)
        trl_names = engine.algorithm.trl_metric_names
        # TRL's per-micro-batch reductions need the same micro-batches on every process.
        reductions = MicroBatchReductions(
            per_micro_batch=args.max_tokens_per_microbatch is None
            and not (args.balance_batch and engine.accelerator.num_processes > 1)
        )
        optimizer_step = 0
        grad_norms: list[float] = []
        # Per row, on the host (one transfer per update, none per micro-batch): first real prompt column
        # and one past the last valid response column, from which each micro-batch's trim is read.
        query_start = F.first_true_indices(rollout.query_mask).cpu()
        response_end = (F.last_true_indices(rollout.response_mask) + 1).cpu()
        orders = self.epoch_orders(rollout.response.shape[0], update)
        normalizations = self.loss_normalizations(rollout, orders)
        # vLLM's log-probs as the old ones: the first mini-batch's pass (the weights vLLM sampled with) is
        # where the trainer's own log-probs of the rollout are seen; the mismatch metrics come from it.
        mismatch: list[torch.Tensor] = []
        Q = rollout.query.shape[1]
        micro_batch_counts: list[int] = []
        for epoch, order_on_host in enumerate(orders):
            for mini_batch in range(args.num_mini_batches):
                size = args.local_mini_batch_size
                micro_batches = self.micro_batches(
                    order_on_host[mini_batch * size : (mini_batch + 1) * size], query_start, response_end, Q
                )
                micro_batch_counts.append(len(micro_batches))
                loss_sums: dict[str, torch.Tensor] = {}
                for micro, on_host in enumerate(micro_batches):
                    first = epoch == 0 and mini_batch == 0
                    bounds = column_bounds(query_start[on_host], response_end[on_host], Q)
                    with self.micro_batch_sync(model, last=micro == len(micro_batches) - 1):
                        entropy, metrics = self._micro_batch_loss(
                            model,
                            rollout,
                            advantages,
                            on_host,
                            bounds,
                            normalizations[epoch][mini_batch],
                            ratio_stats=stats if first and micro == 0 else None,
                            mismatch=mismatch if first and engine.vllm_logprobs_are_old else None,
                        )
                    mask = rollout.policy_mask[on_host.to(entropy.device)]
                    stats["policy/entropy_avg"].append(F.masked_mean(entropy.detach(), mask))
                    if trl_names:  # TRL's entropy: the mean per token over the micro-batch on all processes
                        token_entropy = torch.where(mask, entropy.detach().float(), 0.0)
                        reductions.add(
                            "entropy", torch.stack([token_entropy.sum(), mask.sum().float()]), optimizer_step
                        )
                    for name, value in metrics.items():
                        if reductions.handles(name):
                            reductions.add(name, value, optimizer_step)
                        elif name.startswith("loss/"):  # shares of the mini-batch's loss: summed
                            loss_sums[name] = loss_sums.get(name, 0.0) + value.detach().float()
                        else:
                            stats[name].append(value.detach().float())
                for name, value in loss_sums.items():
                    stats[name].append(value)
                self._optimizer_step(model, grad_norms)
                optimizer_step += 1
        if args.max_tokens_per_microbatch is not None:
            stats["perf/micro_batches_per_step"].append(
                torch.tensor(sum(micro_batch_counts) / len(micro_batch_counts))
            )
        reduced = engine.collectives.reduce_means({name: torch.stack(v).mean() for name, v in stats.items()})
        reduced.update(reductions.reduce(engine.collectives))
        if grad_norms:
            reduced["grad_norm"] = sum(grad_norms) / len(grad_norms)
        if engine.vllm_logprobs_are_old:
            diff = torch.cat(mismatch) if mismatch else rollout.logprobs.new_zeros(0)
            reduced.update(
                sampling_mismatch_metrics(diff, None, engine.collectives, engine.weight_sync_seconds)
            )
        return reduced

    def _micro_batch_loss(
        self,
        model: nn.Module,
        rollout: Rollout,
        advantages: Advantages,
        on_host: torch.Tensor,
        bounds: tuple[int, int],
        normalization: LossNormalization,
        ratio_stats: dict[str, list[torch.Tensor]] | None,
        mismatch: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch: its forward pass (the one :meth:`fill_values` held, for the first), the
        ratio-at-start check (``ratio_stats`` given: the update's first micro-batch), the vLLM mismatch
        (``mismatch`` given), the objective's loss and its backward pass. Returns the entropy and the
        loss's metrics."""
        engine, args = self.engine, self.args
        rows = on_host.to(rollout.response.device)
        if self.held is not None:
            if not torch.equal(self.held.rows, on_host):
                raise RuntimeError(
                    "The first micro-batch is not the one whose forward pass fill_values ran "
                    f"(rows {self.held.rows.tolist()} vs {on_host.tolist()})."
                )
            logprobs, values, entropy = self.held.logprobs, self.held.values, self.held.entropy
            self.held = None
        else:
            logprobs, values, entropy = self.training_forward(model, rollout, rows, bounds)
        if ratio_stats is not None:
            self.check_ratio_at_start(logprobs.detach(), rollout, rows, ratio_stats)
        if mismatch is not None:
            mask = rollout.policy_mask[rows]
            mismatch.append((logprobs.detach() - rollout.logprobs[rows]).float()[mask])
        loss, metrics = engine.compute_policy_loss(
            rollout,
            advantages,
            rows,
            logprobs,
            values,
            normalization,
            entropy=entropy if args.entropy_coeff else None,
        )
        # The loss is already this micro-batch's share of the mini-batch's (its denominators count the
        # whole mini-batch): no division by the accumulation steps.
        engine.accelerator.backward(loss, **({"scale_wrt_gas": False} if engine.is_deepspeed_enabled else {}))
        return entropy, metrics

    def _optimizer_step(self, model: nn.Module, grad_norms: list[float]) -> None:
        """Clip, step the optimizer (and, when a Trainer step is an optimizer step, the schedule), with
        the callbacks around it, and zero the gradients."""
        engine, args = self.engine, self.args
        if args.max_grad_norm and args.max_grad_norm > 0:
            norm = compat.clip_grad_norm(engine, model)
            grad_norms.append(float(norm.item() if hasattr(norm, "item") else norm))
            # The clipping norm covers the parameters the optimizer steps: when it is finite the
            # non-finite-step guard need not scan every gradient again.
            engine._reliability.guard.note_grad_norm(grad_norms[-1])
        # (under DeepSpeed the engine stepped in the last backward; the callbacks hear it here, as in
        # Trainer's loop, and the non-finite guard counts a step the engine skipped)
        engine.control = engine.callback_handler.on_pre_optimizer_step(args, engine.state, engine.control)
        engine.optimizer.step()
        engine.control = engine.callback_handler.on_optimizer_step(args, engine.state, engine.control)
        self.last_learning_rate = compat.get_learning_rate(engine)  # (the schedule has not moved yet)
        if engine.steps_per_update > 1:
            engine.lr_scheduler.step()  # a step is an optimizer step: the schedule moves with each
        model.zero_grad()

    # ---- the numerics guard ----------------------------------------------------------------------

    def check_ratio_at_start(
        self,
        logprobs: torch.Tensor,
        rollout: Rollout,
        rows: torch.Tensor,
        stats: dict[str, list[torch.Tensor]],
    ) -> None:
        """Before any optimizer step of an update the policy is the one that produced the rollout
        log-probs, so the ratio must be 1 up to rounding: logged per token and per sequence, with a
        warning (once) above ``ratio_tolerance``."""
        args = self.args
        mask = rollout.policy_mask[rows]
        diff = (logprobs - rollout.logprobs[rows]) * mask
        deviation = (diff.exp() - 1).abs() * mask
        worst = deviation.max() if deviation.numel() else torch.zeros((), device=logprobs.device)
        stats["policy/ratio_at_start"].append(worst.float())
        # The RLOO blog's view of the same thing: the ratio of whole sequences (what a sequence-level
        # loss clips), where small per-token differences multiply.
        seq_ratio = diff.sum(1).exp()[mask.any(1)]
        if seq_ratio.numel():
            clip = args.cliprange
            stats["policy/seq_ratio_at_start_mean"].append(seq_ratio.mean().float())
            stats["policy/seq_ratio_at_start_max"].append(seq_ratio.max().float())
            stats["policy/seq_ratio_at_start_clipfrac"].append(
                ((seq_ratio < 1 - clip) | (seq_ratio > 1 + clip)).float().mean()
            )
        if float(worst) > args.ratio_tolerance and not self._ratio_warned and args.should_log:
            self._ratio_warned = True
            if self.engine.vllm_logprobs_are_old:
                logger.warning(
                    "policy ratio at the first mini-batch deviates from 1 by %.3g (> ratio_tolerance=%g): with "
                    "rollout_logprobs='generation' the ratio's denominator is vLLM's log-prob, and vLLM's "
                    "distribution differs from the trained one (see sampling/sampling_logp_difference); the clip "
                    "then acts on that difference too. Run vLLM in the policy's dtype (vllm_dtype='auto') or "
                    "use rollout_logprobs='auto' (recomputed log-probs + vllm_importance_sampling_correction).",
                    float(worst),
                    args.ratio_tolerance,
                )
                return
            logger.warning(
                "policy ratio at the first mini-batch deviates from 1 by %.3g (> ratio_tolerance=%g): the rollout "
                "log-probs and the training forward pass disagree. Keep logprobs_in_fp32=True, run both passes in "
                "the same precision, and keep dropout off (disable_dropout=True).",
                float(worst),
                args.ratio_tolerance,
            )
