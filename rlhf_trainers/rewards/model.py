"""The reward model as a reward source: scoring the policy's token ids (same tokenizer) or the
re-tokenized text (another tokenizer), and the scoring functions it uses (:func:`score_ids`,
:func:`score_texts`), which the reward trainer and the demo use too."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import functional as F
from ..data.common import Prompt
from ..distributed import gathered
from ..models import (
    align_pad_token,
    check_one_label,
    embedding_rows,
    get_reward_normalization,
    pooled_scores,
    readable_pad_id,
)
from ..packing import packed_pooled_scores, packed_score_head, packing_layout
from .base import RewardBatch

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["RewardModelSource", "join_prompt_completion", "score_ids", "score_texts"]


def join_prompt_completion(prompt: Prompt, completion: str, tokenizer: PreTrainedTokenizerBase) -> str:
    """The text a reward model scores: ``prompt + completion``, or for chat prompts the conversation
    with the completion as the assistant's message, rendered by ``tokenizer``'s chat template."""
    if isinstance(prompt, str):
        return prompt + completion
    messages = [*list(prompt), {"role": "assistant", "content": completion.strip()}]
    return tokenizer.apply_chat_template(messages, tokenize=False)


@torch.no_grad()
def score_texts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    batch_size: int = 64,
    max_length: int | None = None,
    add_eos: bool = True,
    normalize: bool = True,
    forward: Callable[..., Any] | None = None,
    padding_free: bool = False,
) -> torch.Tensor:
    """Rewards (N,) float32 of full texts (prompt + completion), read at the last real token.

    The texts are tokenized as the reward trainer tokenizes its pairs (EOS appended when missing if
    ``add_eos``, the start cut when longer than ``max_length``). With ``normalize`` the stored gain and
    bias are applied. ``forward`` replaces ``model.__call__`` (e.g. a DeepSpeed engine). A tokenizer pad id
    past the model's embedding table is replaced by 0 (:func:`rlhf_trainers.models.pooled_scores`).
    ``padding_free`` runs each batch's real tokens packed, as :func:`score_ids` does (for a model that
    passes :func:`rlhf_trainers.packing.packing_layout` and has a
    :func:`rlhf_trainers.packing.packed_score_head`; ignored with ``forward``).
    """
    device = next(model.parameters()).device
    gain, bias = get_reward_normalization(model) if normalize else (1.0, 0.0)
    call = forward or model
    gather = gathered(model) if forward is None else contextlib.nullcontext()
    packed = padding_free and forward is None
    with gather:
        scores = _score_batches(
            model, call, tokenizer, texts, batch_size, max_length, add_eos, device, packed
        )
    raw = torch.cat(scores) if scores else torch.zeros(0)
    return raw * gain + bias


def _score_batches(
    model: PreTrainedModel,
    call: Callable[..., Any],
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    batch_size: int,
    max_length: int | None,
    add_eos: bool,
    device: torch.device,
    packed: bool = False,
) -> list[torch.Tensor]:
    eos = tokenizer.eos_token_id
    scores = []
    for start in range(0, len(texts), batch_size):
        ids = tokenizer(list(texts[start : start + batch_size]), add_special_tokens=False)["input_ids"]
        if add_eos:
            ids = [x if x and x[-1] == eos else [*x, eos] for x in ids]
        if max_length is not None:
            ids = [x[-max_length:] for x in ids]
        width = max(len(x) for x in ids)
        input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(ids), width), dtype=torch.long)
        for row, x in enumerate(ids):
            input_ids[row, : len(x)] = torch.tensor(x)
            attention[row, : len(x)] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        if packed and bool(attention.any(1).all()):
            # The packed rows' free tails read id 0 (their outputs are not used).
            logits = packed_pooled_scores(model, input_ids, attention, 0)
        else:
            logits = pooled_scores(model, input_ids, attention, tokenizer.pad_token_id, call=call)
        scores.append(logits[:, 0].float().cpu())
    return scores


def _keep_last_tokens(ids: torch.Tensor, pad_token_id: int, max_length: int) -> torch.Tensor:
    """Each row cut to its last ``max_length`` tokens ending at its last non-pad token, left-padded.

    Rows whose span (first to last non-pad token) fits are kept whole; the result is at most
    ``max_length`` wide. Rows without any non-pad token become all padding.
    """
    width = ids.shape[1]
    if width <= max_length:
        return ids
    positions = torch.arange(width, device=ids.device)
    last = torch.where(ids != pad_token_id, positions, -1).max(-1).values
    end = last + 1
    start = (end - max_length).clamp(min=0)
    new_width = max(int((end - start).max()), 1)
    index = end.unsqueeze(-1) - new_width + torch.arange(new_width, device=ids.device)
    kept = index >= start.unsqueeze(-1)
    gathered = ids.gather(1, index.clamp(min=0))
    return torch.where(kept, gathered, torch.full_like(gathered, pad_token_id))


@torch.no_grad()
def score_ids(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    pad_token_id: int,
    *,
    batch_size: int = 64,
    max_length: int | None = None,
    normalize: bool = True,
    forward: Callable[..., Any] | None = None,
    padding_free: bool = False,
) -> torch.Tensor:
    """Rewards (B,) float32 on CPU of padded token ids, read at the last non-pad token of each row.

    ``input_ids`` (B, T) may be padded on both sides with ``pad_token_id`` (a rollout's left-padded
    prompt followed by its right-padded response). The attention mask is ``input_ids != pad_token_id``
    and the position ids skip the left padding (:func:`rlhf_trainers.functional.position_ids_from_mask`),
    so a row scores as it would alone. The score itself is the pooled logit of the
    sequence-classification model, which transformers reads at the rightmost token that is not
    ``config.pad_token_id``: that is the last non-pad token whatever the padding side as long as
    ``config.pad_token_id == pad_token_id``, which is checked (:func:`rlhf_trainers.models.align_pad_token`
    sets it). If the pad id is also the EOS id, a final EOS counts as padding and the score is read at
    the token before it. A pad id past the model's embedding table (a ``[PAD]`` token added without
    resizing) never reaches the model: it is replaced by 0 and the score read at the last non-pad token
    from the head's per-token output (:func:`rlhf_trainers.models.pooled_scores`).

    Args:
        model: a one-label sequence-classification model (its parameters give the device).
        input_ids: (B, T) token ids, on any device.
        pad_token_id: the id the rows are padded with.
        batch_size: rows per forward pass.
        max_length: if given, each row keeps only its last ``max_length`` tokens (up to its last
            non-pad token), as :func:`score_texts` cuts the start of long texts.
        normalize: apply the gain and bias stored in the model's config.
        forward: replaces ``model.__call__`` (e.g. a DeepSpeed engine); without it, ZeRO-3 partitioned
            weights are gathered for the forward passes.
        padding_free: run each chunk's real tokens packed (:func:`rlhf_trainers.packing.packed_pooled_scores`;
            for a model that passes :func:`rlhf_trainers.packing.packing_layout` and has a
            :func:`rlhf_trainers.packing.packed_score_head`, without ``forward``); a chunk with a row
            without any real token is scored padded.

    Raises:
        ValueError: for ids that are not (B, T), or a model that pools at another pad id.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}.")
    config_pad = getattr(model.config, "pad_token_id", None)
    # A pad id past the embedding table is read by pooled_scores at the last real token itself.
    readable = readable_pad_id(pad_token_id, embedding_rows(model)) == pad_token_id
    if readable and config_pad != pad_token_id:
        raise ValueError(
            f"The reward model pools at config.pad_token_id={config_pad}, but the ids are padded with "
            f"{pad_token_id}: the reward would be read at the wrong token. Call "
            "rlhf_trainers.models.align_pad_token(model, tokenizer) first."
        )
    ids = input_ids.long()
    if max_length is not None:
        ids = _keep_last_tokens(ids, pad_token_id, max_length)
    device = next(model.parameters()).device
    gain, bias = get_reward_normalization(model) if normalize else (1.0, 0.0)
    call = forward or model
    gather = gathered(model) if forward is None else contextlib.nullcontext()
    scores = []
    with gather:
        for start in range(0, ids.shape[0], batch_size):
            chunk = ids[start : start + batch_size].to(device)
            mask = (chunk != pad_token_id).long()
            if padding_free and forward is None and bool(mask.any(1).all()):
                # The packed rows' free tails read id 0 (their outputs are not used): the pad id may have
                # no embedding row.
                logits = packed_pooled_scores(model, chunk, mask, 0)
            else:
                logits = pooled_scores(
                    model, chunk, mask, pad_token_id, call=call, position_ids=F.position_ids_from_mask(mask)
                )
            if logits.dim() != 2 or logits.shape[-1] != 1:
                raise ValueError(
                    "The reward model must return pooled logits of shape (batch, 1), as a one-label "
                    f"sequence-classification model does; got shape {tuple(logits.shape)}."
                )
            scores.append(logits[:, 0].float().cpu())
    raw = torch.cat(scores) if scores else torch.zeros(0)
    return raw * gain + bias


class RewardModelSource:
    """A one-label sequence-classification reward model as a :class:`~rlhf_trainers.rewards.RewardSource`.

    ``same_tokenizer`` is true when ``reward_tokenizer`` is None or has the policy tokenizer's vocabulary
    (``get_vocab()``) and pad id. Then the batch's ``query_response_ids`` are scored as they are
    (:func:`score_ids`: attention mask ``ids != pad``, position ids that skip the left padding, the score
    read at the last non-pad token). A response that did not stop (no EOS) is scored as it is, without
    an EOS. Otherwise each prompt and completion are joined into a text (:func:`join_prompt_completion`,
    chat prompts through the reward tokenizer's chat template) and scored by :func:`score_texts` with the
    reward trainer's tokenization (EOS appended when missing). Both paths apply the normalization gain
    and bias stored in the model, run without gradients, in eval mode (the previous mode is restored), on
    the model's device, through the batch's ``reward_model_forward`` when given (a DeepSpeed engine) and
    else gathering ZeRO-3 partitioned weights. At construction the model's ``config.pad_token_id`` is set
    to the pad id it will see (:func:`rlhf_trainers.models.align_pad_token`): transformers pools at the
    rightmost token that is not ``config.pad_token_id``, which is the last real token with left and right
    padding alike only if the two ids agree.

    Under ZeRO-3 every process must score the same number of rows (the same number of forward passes).

    Args:
        model: a one-label sequence-classification model.
        policy_tokenizer: the policy's tokenizer; its pad id pads the batch's ``query_response_ids``.
        reward_tokenizer: the reward model's tokenizer; None means the policy's.
        batch_size: rows per forward pass.
        max_length: if given, the model sees at most the last ``max_length`` tokens of each sequence (its
            end, where the score is read).
        padding_free: score with the real tokens packed when the model allows it (checked once, at the
            first scoring); scoring through ``reward_model_forward`` stays padded.
        name: the source's name in metrics.

    Raises:
        ValueError: a model that is not a one-label sequence-classification model; a reward tokenizer
            (or, with the policy's ids, a policy tokenizer) without a pad token.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        policy_tokenizer: PreTrainedTokenizerBase,
        reward_tokenizer: PreTrainedTokenizerBase | None = None,
        batch_size: int = 64,
        max_length: int | None = None,
        padding_free: bool = False,
        name: str = "reward_model",
    ) -> None:
        self.name = name
        self.model = model
        self.policy_tokenizer = policy_tokenizer
        self.reward_tokenizer = reward_tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.padding_free = padding_free
        #: Whether the scoring runs packed; resolved at the first scoring (on the model's device), see
        #: :meth:`packs`.
        self._pack_reward: bool | None = None
        self.same_tokenizer: bool = same_tokenizer(policy_tokenizer, reward_tokenizer)
        self._check(model, policy_tokenizer, reward_tokenizer)

    def _check(
        self,
        model: PreTrainedModel,
        policy_tokenizer: PreTrainedTokenizerBase,
        reward_tokenizer: PreTrainedTokenizerBase | None,
    ) -> None:
        check_one_label(model)
        if reward_tokenizer is not None and reward_tokenizer.pad_token_id is None:
            raise ValueError(
                "reward_tokenizer has no pad token, which batched scoring needs. Give it one, e.g. "
                "reward_tokenizer.pad_token = reward_tokenizer.eos_token (or add a dedicated '<|pad|>' "
                "token and resize the reward model's embeddings), or pass the tokenizer saved with the "
                "reward model."
            )
        if self.same_tokenizer and policy_tokenizer.pad_token_id is None:
            raise ValueError(
                "policy_tokenizer has no pad token, but the reward model scores the policy's padded token "
                "ids with it. Give the policy tokenizer a pad token (a dedicated one, distinct from EOS, "
                "as the lm-human-preferences reference implementation does) before training."
            )
        align_pad_token(model, policy_tokenizer if self.same_tokenizer else reward_tokenizer)

    def score(self, batch: RewardBatch) -> torch.Tensor:
        """The model's (normalized) score of each row of ``batch``: float32 (B,) on CPU."""
        model = self.model
        forward = batch.reward_model_forward
        was_training = model.training
        model.eval()
        try:
            packed = forward is None and self.packs()
            if self.same_tokenizer:
                if batch.query_response_ids is None:
                    raise ValueError(
                        "the reward model shares the policy's tokenizer and scores its token ids, but the "
                        "batch carries none (query_response_ids)."
                    )
                return score_ids(
                    model,
                    batch.query_response_ids,
                    self.policy_tokenizer.pad_token_id,
                    batch_size=self.batch_size,
                    max_length=self.max_length,
                    forward=forward,
                    padding_free=packed,
                )
            texts = [
                join_prompt_completion(p, c, self.reward_tokenizer)
                for p, c in zip(batch.prompts, batch.completions, strict=True)
            ]
            return score_texts(
                model,
                self.reward_tokenizer,
                texts,
                batch_size=self.batch_size,
                max_length=self.max_length,
                add_eos=True,
                forward=forward,
                padding_free=packed,
            )
        finally:
            model.train(was_training)

    def packs(self) -> bool:
        """``padding_free`` and a model that passes :func:`rlhf_trainers.packing.packing_layout` with a
        per-token linear head (:func:`rlhf_trainers.packing.packed_score_head`); checked once, with an info
        line when it does not."""
        if not self.padding_free:
            return False
        if self._pack_reward is None:
            model = self.model
            self._pack_reward = packed_score_head(model) is not None and packing_layout(model) is not None
            if not self._pack_reward:
                logger.info(
                    "padding_free: the reward model (%s) does not keep attention within packed sequences or "
                    "has no per-token linear score head; its scoring stays padded.",
                    type(model).__name__,
                )
        return self._pack_reward

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, same_tokenizer={self.same_tokenizer})"


def same_tokenizer(
    policy_tokenizer: PreTrainedTokenizerBase, reward_tokenizer: PreTrainedTokenizerBase | None
) -> bool:
    """Whether a reward model with ``reward_tokenizer`` (None: the policy's) can score the policy's token
    ids as they are: the same vocabulary (``get_vocab()``) and pad id."""
    if reward_tokenizer is None or reward_tokenizer is policy_tokenizer:
        return True
    return (
        reward_tokenizer.pad_token_id == policy_tokenizer.pad_token_id
        and reward_tokenizer.get_vocab() == policy_tokenizer.get_vocab()
    )
