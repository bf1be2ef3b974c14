"""``transformers``' ``generate()`` as a generation backend, for architectures the builtin loop cannot drive
and for multi-process ZeRO-3 without gathered weights (``synced_gpus``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .. import functional as F
from ..models import _base, embedding_rows, readable_ids, readable_pad_id
from .base import ContextFactory, Samples, SamplingSettings, entered, eval_mode, padded_to

__all__ = ["TransformersGenerate", "generation_config_set_aside"]


@contextlib.contextmanager
def generation_config_set_aside(model: Any) -> Iterator[None]:
    """Inside the context, the model's own ``generation_config`` is replaced by a blank one.

    ``generate()`` fills every setting its ``generation_config=`` argument leaves unset (a
    ``repetition_penalty``, ``no_repeat_ngram_size``, ``suppress_tokens``... from a Hub checkpoint's
    ``generation_config.json``) from the model's own, so sampling could silently follow another
    distribution than ``softmax(logits / T)``. The original is restored on exit.
    """
    from transformers import GenerationConfig

    base = _base(model)
    saved = getattr(base, "generation_config", None)
    if saved is not None:
        base.generation_config = GenerationConfig()
    try:
        yield
    finally:
        if saved is not None:
            base.generation_config = saved


class TransformersGenerate:
    """``model.generate()`` with top-k 0, top-p 1 and nothing from the model's ``generation_config``, as a
    :class:`~rlhf_trainers.generation.GenerationBackend`.

    Args:
        model: the causal LM to sample from.
        synced_ranks: ``generate(synced_gpus=True)``: every process runs as many steps as the slowest,
            which ZeRO-3 needs when the layers fetch their shards from the other processes.
        contexts: factories of the contexts every ``sample`` call runs in, entered in order.
        name: what the batch accounting prints.
    """

    # Log-probs from generate's own logits, in the generation's code path: the rollout keeps the policy
    # forward pass unless told otherwise (rollout_logprobs='generation').
    logprobs_for_rollout = False
    batches_internally = False

    def __init__(
        self,
        model: nn.Module,
        *,
        synced_ranks: bool = False,
        contexts: tuple[ContextFactory | None, ...] = (),
        name: str | None = None,
    ) -> None:
        self.model = model
        self.synced_ranks = synced_ranks
        self.contexts = contexts
        self.name = name or (
            "transformers.generate(synced_gpus)" if synced_ranks else "transformers.generate"
        )

    @torch.no_grad()
    def sample(
        self, query_ids: torch.Tensor, query_mask: torch.Tensor, settings: SamplingSettings
    ) -> Samples:
        """See :meth:`GenerationBackend.sample`. A ``settings.pad_token_id`` past the model's embedding
        table never reaches it: ``generate`` gets 0 at the prompt's padding and writes 0 after a row's stop
        token (it feeds that token back), replaced by the pad id in what is returned."""
        from transformers import GenerationConfig

        stop_ids = list(settings.stop_token_ids)
        rows = embedding_rows(self.model)
        pad = settings.pad_token_id
        generate_pad = readable_pad_id(pad, rows)
        config = GenerationConfig(
            max_new_tokens=settings.max_new_tokens,
            do_sample=True,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            min_p=settings.min_p or None,
            pad_token_id=generate_pad,
            # [] (not None, which generate() would fill from the model's generation config): sample the
            # full length, with EOS a token like any other (LHPD's fixed-length responses).
            eos_token_id=stop_ids,
            use_cache=True,
            return_dict_in_generate=settings.return_logprobs,
            output_logits=settings.return_logprobs,
        )
        model = self.model
        # generate() fills what `config` leaves unset (repetition_penalty, no_repeat_ngram_size,
        # suppress_tokens, ...) from the model's own generation_config: set a blank one aside meanwhile.
        with entered(self.contexts), eval_mode(model), generation_config_set_aside(model):
            out = model.generate(
                input_ids=readable_ids(query_ids, pad, rows),
                attention_mask=query_mask,
                generation_config=config,
                synced_gpus=self.synced_ranks,
            )
        sequences = out.sequences if settings.return_logprobs else out
        generated = sequences[:, query_ids.shape[1] :]
        # Positions after a row's stop token (generate pads them with generate_pad): the pad id.
        done = torch.zeros_like(generated, dtype=torch.bool)
        if stop_ids:
            hits = torch.isin(generated, torch.tensor(stop_ids, device=generated.device))
            done[:, 1:] = hits.cumsum(1)[:, :-1] > 0
        tokens = generated.masked_fill(done, pad) if generate_pad != pad else generated
        samples = Samples(tokens)
        if settings.return_logprobs:
            logits = torch.stack(out.logits, dim=1)
            logprobs, entropy = F.logprobs_and_entropy_from_logits(
                logits,
                generated,
                settings.temperature,
                compute_dtype=logits.dtype,
                entropy_dtype=torch.float32,
            )
            # 0 after a row's stop token, as the builtin loop.
            samples = Samples(tokens, logprobs.float().masked_fill(done, 0.0), entropy.masked_fill(done, 0.0))
        return padded_to(samples, settings.max_new_tokens, pad)
