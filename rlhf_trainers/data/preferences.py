"""Preference pairs to tokens: format detection, :func:`tokenize_preferences` and
:class:`PreferenceCollator` (the formats are described in :mod:`rlhf_trainers.data`)."""

from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    import datasets
    from transformers import PreTrainedTokenizerBase

from .common import (
    apply_chat_template,
    check_dataset_type,
    check_messages,
    check_padding_args,
    check_present,
    check_prompt_args,
    check_strings,
    check_vocabulary,
    describe,
    is_message_list,
    padded_length,
    truncate_left,
)

logger = logging.getLogger(__name__)


#: Preference formats and their required columns. Every format also accepts an optional float column
#: "margin"; "conversational" also accepts an optional "prompt" (a list of messages).
PREFERENCE_FORMATS: dict[str, tuple[str, ...]] = {
    "explicit": ("prompt", "chosen", "rejected"),
    "implicit": ("chosen", "rejected"),
    "conversational": ("chosen", "rejected"),
    "tokenized": ("input_ids_chosen", "input_ids_rejected"),
}


_FORMAT_VALUES = {
    "explicit": "strings, prompt + chosen is the full text",
    "implicit": "strings, each the full text",
    "conversational": 'lists of {"role", "content"} messages; optional "prompt" column of messages',
    "tokenized": "lists of token ids",
}


#: What :func:`tokenize_preferences` does with a pair longer than ``max_length``.
LONG_PAIR_POLICIES: tuple[str, ...] = ("truncate", "drop")


_TOKENIZED_COLUMNS = ("input_ids_chosen", "input_ids_rejected", "margin")


def _accepted_formats() -> str:
    lines = [
        f"  {name}: {', '.join(columns)} ({_FORMAT_VALUES[name]})"
        for name, columns in PREFERENCE_FORMATS.items()
    ]
    return "Accepted formats:\n" + "\n".join(lines) + '\n  any format: optional "margin" column (float).'


def _is_id_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in value)
    )


def _type_error(column: str, value: Any, expected: str) -> ValueError:
    return ValueError(
        f"column {column!r}: the first row holds {describe(value)}, but {expected} is expected."
    )


def detect_preference_format(dataset: datasets.Dataset) -> str:
    """The preference format of `dataset`: a key of :data:`PREFERENCE_FORMATS`.

    The column names pick the candidates and the type of the first row's values decides between them:
    ``input_ids_chosen``/``input_ids_rejected`` make it "tokenized" (this wins if text columns are
    present too); otherwise ``chosen``/``rejected`` holding strings make it "explicit" (with a
    ``prompt`` column) or "implicit" (without), and holding lists of messages "conversational".
    Arrow stores one type per column, so the first row stands for all rows (except for missing values,
    which :func:`tokenize_preferences` reports with their row).

    Args:
        dataset: a ``datasets.Dataset`` (one split).

    Returns:
        "explicit", "implicit", "conversational" or "tokenized".

    Raises:
        TypeError: `dataset` is a ``DatasetDict`` (pick a split) or not a ``datasets.Dataset``.
        ValueError: the dataset is empty, lacks the columns of every format, or holds values of the
            wrong type; the message names the columns and types and lists the accepted formats.
    """
    check_dataset_type(dataset)
    columns = set(dataset.column_names)
    if len(dataset) == 0:
        raise ValueError(
            f"the preference dataset has 0 rows (columns: {sorted(columns)}); nothing to train on. Pass a "
            "dataset with at least one pair (check the split you picked, or a filter that removed every row)."
        )

    if {"input_ids_chosen", "input_ids_rejected"} <= columns:
        data_format = "tokenized"
    elif {"chosen", "rejected"} <= columns:
        data_format = None  # text or conversational: decided by the values below
    else:
        raise _missing_columns_error(columns)

    row = dataset[0]
    if data_format == "tokenized":
        for column in PREFERENCE_FORMATS["tokenized"]:
            if not _is_id_list(row[column]):
                raise _type_error(column, row[column], "a non-empty list of int token ids (tokenized format)")
    else:
        chosen = row["chosen"]
        if isinstance(chosen, str):
            data_format = "explicit" if "prompt" in columns else "implicit"
            text_columns = PREFERENCE_FORMATS[data_format]
            for column in text_columns:
                if not isinstance(row[column], str):
                    raise _type_error(
                        column,
                        row[column],
                        f"a string like 'chosen' ({data_format} format: {', '.join(text_columns)})",
                    )
        elif is_message_list(chosen):
            data_format = "conversational"
            for column in ("prompt", "rejected"):
                if column in columns and not is_message_list(row[column]):
                    raise _type_error(
                        column,
                        row[column],
                        'a list of {"role", "content"} messages like \'chosen\' (conversational format)',
                    )
        else:
            raise _type_error(
                "chosen",
                chosen,
                'a string (explicit/implicit format) or a non-empty list of {"role", "content"} messages '
                "(conversational format)",
            )
    if "margin" in columns:
        margin = row["margin"]
        if not isinstance(margin, numbers.Real) or isinstance(margin, bool):
            raise _type_error("margin", margin, "a float")
    return data_format


def _missing_columns_error(columns: set[str]) -> ValueError:
    """Name what is missing for the format(s) the dataset comes closest to."""
    missing = {
        name: [c for c in required if c not in columns] for name, required in PREFERENCE_FORMATS.items()
    }
    fewest = min(len(m) for m in missing.values())
    closest = [
        f"{', '.join(repr(c) for c in m)} for {name}" for name, m in missing.items() if len(m) == fewest
    ]
    return ValueError(
        f"the dataset's columns {sorted(columns)} match no preference format: missing "
        + "; or ".join(closest)
        + ".\n"
        + _accepted_formats()
        + "\nRename columns with dataset.rename_column(old, new)."
    )


@dataclass
class PreferenceTokenizationStats:
    """What :func:`tokenize_preferences` did.

    Attributes:
        num_rows: rows in the input dataset.
        num_kept: rows in the output (``num_rows - num_dropped``).
        num_truncated: pairs longer than `max_length` that were truncated (``long_pairs="truncate"``).
        num_dropped: pairs longer than `max_length` that were removed (``long_pairs="drop"``).
        max_length: the limit applied (None: no limit).
    """

    num_rows: int
    num_kept: int
    num_truncated: int
    num_dropped: int
    max_length: int | None


def _check_tokenize_args(
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None,
    long_pairs: str,
    add_eos: bool,
    num_proc: int | None,
) -> None:
    if long_pairs not in LONG_PAIR_POLICIES:
        raise ValueError(
            f"long_pairs={long_pairs!r}: must be 'truncate' (cut the start of the prompt) or 'drop' "
            "(remove pairs longer than max_length)."
        )
    if max_length is not None and (
        not isinstance(max_length, numbers.Integral) or isinstance(max_length, bool) or max_length < 2
    ):
        raise ValueError(
            f"max_length={max_length!r}: must be an integer >= 2 (a token plus EOS), or None for no limit."
        )
    if num_proc is not None and (not isinstance(num_proc, numbers.Integral) or num_proc < 1):
        raise ValueError(f"num_proc={num_proc!r}: must be a positive integer or None.")
    if tokenizer.pad_token_id is None:
        raise ValueError(
            "the tokenizer has no pad token, which batching needs. Add a dedicated one: "
            "tokenizer.add_special_tokens({'pad_token': '<|pad|>'}), then model.resize_token_embeddings"
            "(len(tokenizer)) and model.config.pad_token_id = tokenizer.pad_token_id. "
            "(tokenizer.pad_token = tokenizer.eos_token also works, but then the reward is read at the last "
            "token before the EOS, so the EOS itself is never scored.)"
        )
    if add_eos and tokenizer.eos_token_id is None:
        raise ValueError(
            "add_eos=True but the tokenizer has no eos token; set tokenizer.eos_token or pass add_eos=False."
        )
    if tokenizer.eos_token_id is not None and tokenizer.pad_token_id == tokenizer.eos_token_id:
        # Works, so a warning: the collator's attention mask comes from the lengths, and only the pooling
        # position moves (the same way when PPO/RLOO score with this tokenizer).
        logger.warning(
            "The tokenizer's pad token is its EOS token (id %d). Sequence-classification models read the "
            "score at the last token that is not padding, so a sequence ending with EOS is scored at the token "
            "before that EOS, and the EOS itself is never scored. To score it, add a dedicated pad token: "
            "tokenizer.add_special_tokens({'pad_token': '<|pad|>'}) and model.resize_token_embeddings("
            "len(tokenizer)).",
            tokenizer.eos_token_id,
        )


def _check_chat_template(data_format: str, tokenizer: PreTrainedTokenizerBase) -> None:
    if data_format == "conversational" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the dataset is conversational (lists of messages) but the tokenizer has no chat template. "
            "Set tokenizer.chat_template to a Jinja template (e.g. the one of the model's instruct version), "
            "or pass text columns (explicit: prompt/chosen/rejected strings; implicit: chosen/rejected)."
        )


@dataclass
class _PairTokenizer:
    """The ``dataset.map`` function of :func:`tokenize_preferences`: a batch of rows to token id pairs.

    A module-level class rather than a closure, so that ``num_proc > 1`` can pickle it.
    """

    data_format: str
    tokenizer: Any
    has_prompt: bool
    has_margin: bool
    eos_id: int | None  # None: no EOS appended (add_eos=False, or the tokenized format)
    bos_id: int | None
    max_length: int | None
    drop: bool
    vocab_size: int | None

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        chosen = self.side_ids(batch, "chosen", indices)
        rejected = self.side_ids(batch, "rejected", indices)
        if self.has_margin:
            check_present(batch["margin"], "margin", indices)
            margins = [float(margin) for margin in batch["margin"]]
        else:
            margins = [0.0] * len(chosen)
        out: dict[str, list[Any]] = {name: [] for name in (*_TOKENIZED_COLUMNS, "_truncated")}
        for chosen_ids, rejected_ids, margin in zip(chosen, rejected, margins, strict=True):
            long = self.max_length is not None and max(len(chosen_ids), len(rejected_ids)) > self.max_length
            if long and self.drop:
                continue
            if long:
                chosen_ids = truncate_left(chosen_ids, self.max_length, self.bos_id)
                rejected_ids = truncate_left(rejected_ids, self.max_length, self.bos_id)
            out["input_ids_chosen"].append(chosen_ids)
            out["input_ids_rejected"].append(rejected_ids)
            out["margin"].append(margin)
            out["_truncated"].append(long)
        return out

    def side_ids(self, batch: dict[str, list[Any]], side: str, indices: list[int]) -> list[list[int]]:
        """Token ids of one side ("chosen"/"rejected") of the batch, EOS appended where asked, checked."""
        if self.data_format == "tokenized":
            ids = self._given_ids(batch, side, indices)
        elif self.data_format == "conversational":
            ids = self._conversation_ids(batch, side, indices)
        else:
            ids = self._text_ids(batch, side, indices)
        if self.eos_id is not None:
            for sequence in ids:
                if not sequence or sequence[-1] != self.eos_id:
                    sequence.append(self.eos_id)
        column = f"input_ids_{side}" if self.data_format == "tokenized" else side
        for sequence, index in zip(ids, indices, strict=True):
            if not sequence:
                raise ValueError(
                    f"row {index}: {side} has 0 tokens; every side needs at least one. Remove such rows first, "
                    "e.g. with dataset.filter."
                )
            check_vocabulary(sequence, index, column, self.vocab_size, "reward model")
        return ids

    def _given_ids(self, batch: dict[str, list[Any]], side: str, indices: list[int]) -> list[list[int]]:
        column = f"input_ids_{side}"
        check_present(batch[column], column, indices)
        return [list(sequence) for sequence in batch[column]]

    def _conversation_ids(
        self, batch: dict[str, list[Any]], side: str, indices: list[int]
    ) -> list[list[int]]:
        # The template writes its own special tokens, so the tokenizer must not add more.
        check_present(batch[side], side, indices)
        if self.has_prompt:
            check_present(batch["prompt"], "prompt", indices)
            conversations = [
                prompt + completion for prompt, completion in zip(batch["prompt"], batch[side], strict=True)
            ]
        else:
            conversations = batch[side]
        for conversation, index in zip(conversations, indices, strict=True):
            check_messages(conversation, index, f"prompt + {side}" if self.has_prompt else side)
        texts = apply_chat_template(self.tokenizer, conversations, indices, tokenize=False)
        return self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    def _text_ids(self, batch: dict[str, list[Any]], side: str, indices: list[int]) -> list[list[int]]:
        check_strings(batch[side], side, indices)
        if self.data_format == "explicit":
            check_strings(batch["prompt"], "prompt", indices)
            texts = [
                prompt + completion for prompt, completion in zip(batch["prompt"], batch[side], strict=True)
            ]
        else:
            texts = batch[side]
        return self.tokenizer(texts, return_attention_mask=False)["input_ids"]


def _map_pairs(
    dataset: datasets.Dataset, pair_tokenizer: _PairTokenizer, num_proc: int | None
) -> tuple[datasets.Dataset, int]:
    """`dataset` mapped through `pair_tokenizer`, and how many of its pairs were truncated."""
    import datasets

    features = datasets.Features(
        {
            "input_ids_chosen": datasets.List(datasets.Value("int64")),
            "input_ids_rejected": datasets.List(datasets.Value("int64")),
            "margin": datasets.Value("float64"),
            "_truncated": datasets.Value("bool"),
        }
    )
    tokenized = dataset.map(
        pair_tokenizer,
        batched=True,
        with_indices=True,
        remove_columns=dataset.column_names,  # all of them, so the batch may shrink (dropped pairs)
        features=features,
        num_proc=num_proc,
        desc=f"Tokenizing preference pairs ({pair_tokenizer.data_format})",
    )
    # The map's output has no indices mapping, so its Arrow table is the rows as they are; counting there
    # avoids iterating a datasets 5 Column (one formatted row at a time, ~100x slower).
    num_truncated = tokenized.data.column("_truncated").to_pylist().count(True)
    tokenized = tokenized.remove_columns("_truncated")
    return tokenized, num_truncated


def tokenize_preferences(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int | None = 512,
    long_pairs: str = "truncate",
    add_eos: bool = True,
    num_proc: int | None = None,
    *,
    vocab_size: int | None = None,
) -> tuple[datasets.Dataset, PreferenceTokenizationStats]:
    """Tokenize a preference dataset of any format (:func:`detect_preference_format`) into unpadded ids.

    The text of each side is built per format, then tokenized:

    - explicit: ``prompt + chosen`` (plain string concatenation; completions usually start with a
      space); implicit: ``chosen`` as is. Tokenized with the tokenizer's default special tokens
      (``add_special_tokens=True``), i.e. exactly as ``tokenizer(text)`` would, so a tokenizer that adds
      BOS adds it here too.
    - conversational: ``tokenizer.apply_chat_template(prompt + chosen, tokenize=False)`` (prompt messages
      first when the column exists), then tokenized with ``add_special_tokens=False``, since the template
      writes its own special tokens.
    - tokenized: the ids as given (no EOS added).

    Then, for the text formats with `add_eos`, ``tokenizer.eos_token_id`` is appended to a side that does
    not already end with it: the reward is read at the last real token, and PPO/RLOO responses end with
    EOS, so the reward model must learn on sequences that end the same way.

    A pair is *long* if either side has more than `max_length` tokens. With ``long_pairs="truncate"`` a
    long side keeps its last `max_length` tokens (the start of the prompt is cut, the end of the response,
    where the reward is read, is kept); a leading BOS (``tokenizer.bos_token_id``) is kept in front of
    the last ``max_length - 1`` tokens, as models expect it. With ``"drop"`` the pair is removed.

    Args:
        dataset: one split, in any of :data:`PREFERENCE_FORMATS`.
        tokenizer: with a pad token (needed later by :class:`PreferenceCollator`), a chat template for
            conversational data, and an eos token if `add_eos`.
        max_length: limit on tokens per side (>= 2), or None for no limit.
        long_pairs: "truncate" or "drop" (see above).
        add_eos: append EOS to text-format sides that lack it.
        num_proc: processes for ``dataset.map`` (None: this process).
        vocab_size: if given, every id must be in ``[0, vocab_size)`` (e.g. the size of the reward model's
            input embeddings), which catches pairs tokenized with another tokenizer.

    Returns:
        ``(tokenized, stats)``. `tokenized` has the columns ``input_ids_chosen`` and
        ``input_ids_rejected`` (lists of ints of varying length, no padding) and ``margin`` (float;
        0.0 where the input has no margin column), one row per kept input row, in the input order.
        All other columns are removed. `stats` counts truncated and dropped pairs.

    Raises:
        ValueError: bad arguments, a tokenizer without pad token (or without chat template for
            conversational data, or without eos with `add_eos`), missing values, empty sequences, ids
            outside `vocab_size` (with the row index), and everything :func:`detect_preference_format`
            raises.
    """
    _check_tokenize_args(tokenizer, max_length, long_pairs, add_eos, num_proc)
    check_prompt_args(None, vocab_size, None)
    data_format = detect_preference_format(dataset)
    _check_chat_template(data_format, tokenizer)
    pair_tokenizer = _PairTokenizer(
        data_format=data_format,
        tokenizer=tokenizer,
        has_prompt="prompt" in dataset.column_names,
        has_margin="margin" in dataset.column_names,
        eos_id=tokenizer.eos_token_id if add_eos and data_format != "tokenized" else None,
        bos_id=tokenizer.bos_token_id,
        max_length=max_length,
        drop=long_pairs == "drop",
        vocab_size=vocab_size,
    )
    tokenized, num_truncated = _map_pairs(dataset, pair_tokenizer, num_proc)
    stats = PreferenceTokenizationStats(
        num_rows=len(dataset),
        num_kept=len(tokenized),
        num_truncated=num_truncated,
        num_dropped=len(dataset) - len(tokenized),
        max_length=max_length,
    )
    return tokenized, stats


class PreferenceCollator:
    """Pads tokenized preference rows into one batch: the chosen sequences, then the rejected ones.

    One forward pass of the reward model then scores both halves: ``rewards[:B]`` are the chosen
    rewards and ``rewards[B:]`` the rejected ones, for a batch of B rows.

    Right padding suits the reward model: Hugging Face sequence-classification models read the score at
    the rightmost token that is not ``model.config.pad_token_id`` (either padding side works). So the
    model's ``config.pad_token_id`` must equal `pad_token_id`, and the pad id must differ from every real
    token of the sequences (in particular from EOS, or the reward is read before the EOS).

    Args:
        pad_token_id: the id written into padding positions (``tokenizer.pad_token_id``).
        padding_side: "right" (pads after the sequence) or "left".
        pad_to_multiple_of: round the padded length T up to a multiple of this (e.g. 8 for tensor cores).

    Calling it on a list of B rows, each with ``input_ids_chosen`` and ``input_ids_rejected`` (lists or
    1-D tensors of ids) and optionally ``margin`` (default 0.0), returns:

    - ``input_ids``: (2B, T) long; rows 0..B-1 the chosen sequences, rows B..2B-1 the rejected ones,
      row i and row B+i from the same pair.
    - ``attention_mask``: (2B, T) long, 1 on real tokens, 0 on padding.
    - ``margin``: (B,) float32.

    T is the longest sequence of either side (rounded up to `pad_to_multiple_of`).
    """

    def __init__(
        self, pad_token_id: int, padding_side: str = "right", pad_to_multiple_of: int | None = None
    ) -> None:
        check_padding_args(pad_token_id, pad_to_multiple_of)
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side={padding_side!r}: must be 'right' or 'left'.")
        self.pad_token_id = int(pad_token_id)
        self.padding_side = padding_side
        self.pad_to_multiple_of = pad_to_multiple_of

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(pad_token_id={self.pad_token_id}, padding_side={self.padding_side!r}, "
            f"pad_to_multiple_of={self.pad_to_multiple_of})"
        )

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Pad `features` (B rows) into ``input_ids`` (2B, T), ``attention_mask`` (2B, T), ``margin`` (B,)."""
        if len(features) == 0:
            raise ValueError("PreferenceCollator got an empty list of rows.")
        sequences = [torch.as_tensor(f["input_ids_chosen"], dtype=torch.long) for f in features]
        sequences += [torch.as_tensor(f["input_ids_rejected"], dtype=torch.long) for f in features]
        lengths = [len(s) for s in sequences]
        if min(lengths) == 0:
            raise ValueError("PreferenceCollator got an empty sequence; every side needs at least one token.")
        length = padded_length(lengths, self.pad_to_multiple_of)
        input_ids = torch.full((len(sequences), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
        for row, (seq, n) in enumerate(zip(sequences, lengths, strict=True)):
            span = slice(0, n) if self.padding_side == "right" else slice(length - n, length)
            input_ids[row, span] = seq
            attention_mask[row, span] = 1
        margin = torch.tensor([float(f.get("margin", 0.0)) for f in features], dtype=torch.float32)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "margin": margin}
