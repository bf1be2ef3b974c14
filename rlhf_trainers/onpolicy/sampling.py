"""Generation for the on-policy engine: :class:`PolicySampler` draws the policy's responses from the
generation backend (:mod:`rlhf_trainers.generation`, chosen once at construction) in the context it needs
(ZeRO-3), shares a failure on one process with all of them, and saves the last complete update when
generation fails."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from .. import compat
from ..cpu import decoding_speedups, keep_prepared_weights
from ..distributed import generation_context
from ..generation import GenerationError, Samples, SamplingSettings, check_samples, make_generation_backend
from .rollouts_ahead import rollouts_ahead


class PolicySampler:
    """Samples responses of the trainer ``engine``'s policy (its ``args``, ``policy``, tokenizer,
    accelerator and ``state``), with the stop tokens ``stop_ids``.

    Attributes:
        backend: the generation backend (:mod:`rlhf_trainers.generation`), chosen once; named in
            ``batch_accounting()``.
    """

    def __init__(self, engine: Any, stop_ids: list[int], cpu_options: Any = None) -> None:
        self.engine = engine
        self.stop_ids = stop_ids
        self._logprobs_from_generation: bool | None = None
        args = engine.args
        # What the backend may sample with on CPU (rlhf_trainers.cpu, per cpu_options): decided here, so
        # that rlhf_trainers.generation never imports the CPU switches. vLLM takes none of them.
        speedups = None
        if not args.use_vllm:
            speedups = decoding_speedups(
                engine.policy,
                cpu_options,
                device=engine.accelerator.device,
                deepspeed=engine.is_deepspeed_enabled,
                half_precision=bool(args.bf16 or args.fp16),
            )
        self.backend = make_generation_backend(
            engine.policy,
            args,
            speedups=speedups,
            synced_ranks=self._synced_generation(),
            context=self._generation_context,
            weights_version=self.policy_weights_version,
            process_index=engine.accelerator.process_index,
            num_processes=engine.accelerator.num_processes,
            longest_sequence=self._longest_prompt() + args.response_length,
        )

    def prepared_weights_kept(self) -> contextlib.AbstractContextManager[Any]:
        """Inside this context, what the CPU decoding steps derive from the policy's weights alone (merged
        LoRA copies, MKL-packed weights) is made once per weight version and shared by every sampling call
        (:func:`rlhf_trainers.cpu.keep_prepared_weights`); evaluation enters it."""
        return keep_prepared_weights()

    def _longest_prompt(self) -> int:
        """Tokens of the longest tokenized prompt (train and eval datasets, after truncation)."""
        stats = getattr(self.engine, "preprocessing_stats", {}).values()
        return max((min(s.longest, s.max_prompt_length or s.longest) for s in stats), default=0)

    def policy_weights_version(self) -> tuple[int, int]:
        """Changes whenever the policy's weights may have changed (a vLLM engine re-syncs then): the update
        count, and the sum of the parameters' in-place-modification counters (an optimizer step, a loaded
        checkpoint)."""
        return (int(self.engine.state.global_step), sum(p._version for p in self.engine.policy.parameters()))

    def _generation_context(self) -> contextlib.AbstractContextManager[Any]:
        """What generation needs around it under ZeRO-3 (:func:`rlhf_trainers.distributed.generation_context`:
        the policy's weights gathered with ``ds3_gather_for_generation`` or before training, the training
        engine's hooks set aside meanwhile); nothing otherwise."""
        return generation_context(
            self.engine.policy,
            self.engine.model_wrapped,
            gather_weights=self.engine.args.ds3_gather_for_generation,
        )

    def _synced_generation(self) -> bool:
        """Multi-process ZeRO-3 without gathering the weights: ranks must step generation together."""
        return bool(
            self.engine.is_deepspeed_enabled
            and not self.engine.args.ds3_gather_for_generation
            and self.engine.accelerator.num_processes > 1
        )

    @property
    def logprobs_from_generation(self) -> bool:
        """Whether the rollout takes its log-probs and entropy from the sampling loop
        (``rollout_logprobs``, with 'auto' resolved against the policy's dtype and the precision)."""
        cached = self._logprobs_from_generation
        if cached is None:
            args = self.engine.args
            if args.rollout_logprobs == "auto":
                float32 = all(
                    p.dtype == torch.float32 for p in self.engine.policy.parameters() if p.is_floating_point()
                )
                cached = bool(
                    float32
                    and not (args.bf16 or args.fp16)
                    and args.disable_dropout
                    and self.backend.logprobs_for_rollout
                    and not self.engine.needs_generation_logprobs
                )
            else:
                cached = args.rollout_logprobs == "generation"
            self._logprobs_from_generation = cached
        return cached

    @torch.no_grad()
    def generate(
        self,
        query: torch.Tensor,
        query_mask: torch.Tensor,
        with_logprobs: bool = False,
        *,
        max_new_tokens: int | None = None,
        stop_ids: list[int] | None = None,
        row_max_new_tokens: list[int] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """Sample (B, response_length) response ids from ``softmax(logits / temperature)`` with the
        :attr:`generation_backend`; rows end at a stop token only when generation may stop there (else
        fixed length, truncated afterwards).

        With ``with_logprobs`` also ``{"logprobs", "entropy"}`` (B, response_length) float32: the sampled
        tokens' log-probabilities and the entropy of each step's distribution, as the generation computed
        them (its own logits / temperature, in the generation's precision; 0 after a stop token).

        A multi-turn producer gives ``max_new_tokens`` (what is left of ``response_length``; None: all of
        it), ``stop_ids`` (the stop tokens and the end of an assistant turn; None: :attr:`stop_ids`) and
        ``row_max_new_tokens`` (each row's own limit, :attr:`SamplingSettings.row_max_new_tokens`; the
        caller cuts each row there)."""
        ahead = rollouts_ahead(self.engine)
        if ahead is not None:
            ahead.settle()  # the servers' weights may change now: nothing of theirs may be in flight
        settings = self.settings(
            with_logprobs,
            max_new_tokens=max_new_tokens,
            stop_ids=stop_ids,
            row_max_new_tokens=row_max_new_tokens,
        )
        return self.shared_result(
            lambda: self.backend.sample(query, query_mask, settings), query.shape[0], settings
        )

    def settings(
        self,
        with_logprobs: bool,
        *,
        max_new_tokens: int | None = None,
        stop_ids: list[int] | None = None,
        row_max_new_tokens: list[int] | None = None,
        seed: int | None = None,
    ) -> SamplingSettings:
        """The :class:`SamplingSettings` of a :meth:`generate` call (``seed``: see
        :attr:`SamplingSettings.seed`)."""
        args = self.engine.args
        stops = self.stop_ids if stop_ids is None else stop_ids
        stop_in_generation = stops and args.truncate_after == 0
        return SamplingSettings(
            max_new_tokens=args.response_length if max_new_tokens is None else max_new_tokens,
            pad_token_id=self.engine.processing_class.pad_token_id,
            temperature=args.temperature,
            stop_token_ids=tuple(stops) if stop_in_generation else (),
            return_logprobs=with_logprobs,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            row_max_new_tokens=None if row_max_new_tokens is None else tuple(row_max_new_tokens),
            seed=seed,
        )

    def shared_result(
        self, call: Callable[[], Samples], rows: int, settings: SamplingSettings
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """``call()`` (the backend's samples of ``rows`` prompts), checked, with its failure shared by every
        process: the response ids, and ``{"logprobs", "entropy"}`` when ``settings`` asked for them."""
        processes = self.engine.accelerator.num_processes
        failure: Exception | None = None
        try:
            compiled = getattr(self.engine, "_compiled", None)
            with compiled.paused() if compiled is not None else contextlib.nullcontext():
                samples = call()
            check_samples(samples, rows, settings)
        except GenerationError as err:
            failure = err
        except Exception as err:
            if processes == 1:
                raise
            failure = err  # under several processes every failure must reach the others (below)
        if processes > 1:
            # Every process generates the same number of times per update, so this all-reduce meets all
            # of them: a failure on one process stops them all here, together, instead of leaving the
            # others waiting in their next collective until the launcher's timeout.
            failed = self._processes_that_failed(failure is not None)
            if failed and failure is None:
                failure = GenerationError(
                    f"Generation failed on process(es) {failed} (their error says why); every process "
                    "stops with them."
                )
        if failure is not None:
            if not isinstance(failure, GenerationError):
                failure = GenerationError(
                    f"The generation backend raised {type(failure).__name__}: {failure}"
                )
            raise self._generation_failed(failure) from failure
        if not settings.return_logprobs:
            return samples.tokens, None
        return samples.tokens, {"logprobs": samples.logprobs, "entropy": samples.entropy}

    def _processes_that_failed(self, failed_here: bool) -> list[int]:
        """The indices of the processes whose generation failed (one all-reduce over all of them)."""
        flags = torch.zeros(self.engine.accelerator.num_processes, device=self.engine.accelerator.device)
        flags[self.engine.accelerator.process_index] = float(failed_here)
        flags = self.engine.accelerator.reduce(flags, reduction="sum")
        return [int(i) for i in flags.nonzero().flatten().tolist()]

    def _generation_failed(self, err: GenerationError) -> GenerationError:
        """The error to raise when the generation backend failed, after saving what can be saved: with
        ``save_on_interrupt`` (the default), once at least one update completed, a checkpoint of the last
        complete update (the weights the failed generation started from), so
        ``train(resume_from_checkpoint=True)`` continues from there. Under several processes every process
        gets here together (:meth:`generate` shares the failure), so they write the checkpoint together."""
        args = self.engine.args
        step = self.engine.state.global_step
        if not args.save_on_interrupt:
            saved = "No checkpoint was written (save_on_interrupt=False)."
        elif step == 0:
            saved = "No update had completed: there is nothing to save."
        else:
            model = getattr(self.engine, "model_wrapped", None) or self.engine.model
            compat.save_checkpoint(self.engine, model)
            saved = (
                f"The last complete update (step {step}) was saved to {args.output_dir}/checkpoint-{step}; "
                "train(resume_from_checkpoint=True) continues from it."
            )
        return GenerationError(f"{err} {saved}")
