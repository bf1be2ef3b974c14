"""Datasets to tokens: preference pairs for the reward model, prompts for the on-policy trainers.

Preference data
---------------
A preference dataset holds, per row, a *chosen* and a *rejected* version of the same text. Four layouts
(:data:`PREFERENCE_FORMATS`) are accepted; :func:`detect_preference_format` tells them apart from the
column names and the type of the first row's values:

=================  ===========================================  ============================================
format             columns                                      values
=================  ===========================================  ============================================
``explicit``       prompt, chosen, rejected                     strings; ``prompt + chosen`` is the full text
``implicit``       chosen, rejected                             strings, each the full text
``conversational`` chosen, rejected (+ optional prompt)         lists of ``{"role", "content"}`` messages
``tokenized``      input_ids_chosen, input_ids_rejected         lists of token ids, used as given
=================  ===========================================  ============================================

Every format may also have a numeric ``margin`` column (how much better chosen is than rejected), used
by the margin variant of the pairwise loss. Other columns are ignored.

:func:`tokenize_preferences` turns any of them into ``input_ids_chosen``, ``input_ids_rejected`` (unpadded)
and ``margin``, and :class:`PreferenceCollator` pads a list of such rows into one batch holding the chosen
sequences and then the rejected ones, so that a single forward pass scores both.

Prompt data
-----------
PPO and RLOO generate their own completions, so they only need prompts. Three layouts
(:data:`PROMPT_FORMATS`) are accepted; :func:`detect_prompt_format` looks at the column ``prompt``, else
``messages``, else ``input_ids``:

=================  ==========================  ===============================================================
format             column                      values
=================  ==========================  ===============================================================
``text``           prompt                      strings
``conversational`` prompt (or messages)        lists of ``{"role", "content"}`` messages, not ending with an
                                               assistant turn
``tokenized``      input_ids                   lists of token ids, used as given
=================  ==========================  ===============================================================

:func:`tokenize_prompts` adds (or, for ``tokenized``, validates) an ``input_ids`` column and keeps every
other column, so reward functions still see the prompt text and any extra columns (e.g. a reference
answer). :class:`PromptCollator` left-pads ``input_ids`` for generation and passes the other columns
through as lists.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    import datasets
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = [
    "LONG_PAIR_POLICIES",
    "PREFERENCE_FORMATS",
    "PROMPT_FORMATS",
    "PreferenceCollator",
    "PreferenceTokenizationStats",
    "PromptCollator",
    "PromptTokenizationStats",
    "detect_preference_format",
    "detect_prompt_format",
    "first_row_with_token",
    "longest_sequence",
    "tokenize_preferences",
    "tokenize_prompts",
]

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


# --------------------------------------------------------------------------------------------------
# Format detection
# --------------------------------------------------------------------------------------------------


def _accepted_formats() -> str:
    lines = [
        f"  {name}: {', '.join(columns)} ({_FORMAT_VALUES[name]})"
        for name, columns in PREFERENCE_FORMATS.items()
    ]
    return "Accepted formats:\n" + "\n".join(lines) + '\n  any format: optional "margin" column (float).'


def _describe(value: Any) -> str:
    """Type of `value` for error messages, with a short preview: "int (3)", "list of int ([1, 2, ...])"."""
    preview = repr(value)
    if len(preview) > 60:
        preview = preview[:57] + "..."
    kind = type(value).__name__
    if isinstance(value, list) and value:
        kind = f"list of {type(value[0]).__name__}"
    return f"{kind} ({preview})"


def _is_message_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def _is_id_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in value)
    )


def _type_error(column: str, value: Any, expected: str) -> ValueError:
    return ValueError(
        f"column {column!r}: the first row holds {_describe(value)}, but {expected} is expected."
    )


def _check_dataset_type(dataset: Any) -> None:
    """TypeError unless `dataset` is one split (a ``datasets.Dataset``)."""
    import datasets

    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        splits = list(dataset.keys())
        example = splits[0] if splits else "train"
        raise TypeError(
            f"expected one split (a datasets.Dataset), got a {type(dataset).__name__} with splits {splits}; "
            f'pick one, e.g. dataset["{example}"].'
        )
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(
            f"expected a datasets.Dataset, got {type(dataset).__name__}. Build one with "
            "datasets.Dataset.from_dict / from_list (an IterableDataset is not supported here)."
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
    _check_dataset_type(dataset)
    columns = set(dataset.column_names)
    if len(dataset) == 0:
        raise ValueError(
            f"the preference dataset has 0 rows (columns: {sorted(columns)}); nothing to train on. Pass a "
            "dataset with at least one pair (check the split you picked, or a filter that removed every row)."
        )

    if {"input_ids_chosen", "input_ids_rejected"} <= columns:
        fmt = "tokenized"
    elif {"chosen", "rejected"} <= columns:
        fmt = None  # text or conversational: decided by the values below
    else:
        raise _missing_columns_error(columns)

    row = dataset[0]
    if fmt == "tokenized":
        for column in PREFERENCE_FORMATS["tokenized"]:
            if not _is_id_list(row[column]):
                raise _type_error(column, row[column], "a non-empty list of int token ids (tokenized format)")
    else:
        chosen = row["chosen"]
        if isinstance(chosen, str):
            fmt = "explicit" if "prompt" in columns else "implicit"
            text_columns = PREFERENCE_FORMATS[fmt]
            for column in text_columns:
                if not isinstance(row[column], str):
                    raise _type_error(
                        column,
                        row[column],
                        f"a string like 'chosen' ({fmt} format: {', '.join(text_columns)})",
                    )
        elif _is_message_list(chosen):
            fmt = "conversational"
            for column in ("prompt", "rejected"):
                if column in columns and not _is_message_list(row[column]):
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
    return fmt


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


# --------------------------------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------------------------------


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
        num_proc: processes for ``dataset.map`` (None: this process). An in-memory dataset with
            ``num_proc=None`` is tokenized in this process without ``map`` (no cache file to write).
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
    import datasets

    _check_tokenize_args(tokenizer, max_length, long_pairs, add_eos, num_proc)
    _check_prompt_args(None, vocab_size, None)
    fmt = detect_preference_format(dataset)
    if fmt == "conversational" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the dataset is conversational (lists of messages) but the tokenizer has no chat template. "
            "Set tokenizer.chat_template to a Jinja template (e.g. the one of the model's instruct version), "
            "or pass text columns (explicit: prompt/chosen/rejected strings; implicit: chosen/rejected)."
        )

    has_prompt = "prompt" in dataset.column_names
    has_margin = "margin" in dataset.column_names
    eos_id = tokenizer.eos_token_id if add_eos and fmt != "tokenized" else None
    bos_id = tokenizer.bos_token_id
    drop = long_pairs == "drop"

    def ids_of(batch: dict[str, list[Any]], side: str, indices: list[int]) -> list[list[int]]:
        """Token ids of one side ("chosen"/"rejected") of the batch, EOS appended where asked."""
        if fmt == "tokenized":
            column = f"input_ids_{side}"
            _check_present(batch[column], column, indices)
            ids = [list(seq) for seq in batch[column]]
        elif fmt == "conversational":
            _check_present(batch[side], side, indices)
            if has_prompt:
                _check_present(batch["prompt"], "prompt", indices)
                conversations = [p + c for p, c in zip(batch["prompt"], batch[side], strict=True)]
            else:
                conversations = batch[side]
            for conversation, index in zip(conversations, indices, strict=True):
                _check_messages(conversation, index, f"prompt + {side}" if has_prompt else side)
            texts = _apply_chat_template(tokenizer, conversations, indices, tokenize=False)
            ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        else:
            _check_strings(batch[side], side, indices)
            if fmt == "explicit":
                _check_strings(batch["prompt"], "prompt", indices)
                texts = [p + c for p, c in zip(batch["prompt"], batch[side], strict=True)]
            else:
                texts = batch[side]
            ids = tokenizer(texts, return_attention_mask=False)["input_ids"]
        if eos_id is not None:
            for seq in ids:
                if not seq or seq[-1] != eos_id:
                    seq.append(eos_id)
        for seq, index in zip(ids, indices, strict=True):
            if not seq:
                raise ValueError(
                    f"row {index}: {side} has 0 tokens; every side needs at least one. Remove such rows first, "
                    "e.g. with dataset.filter."
                )
            column = f"input_ids_{side}" if fmt == "tokenized" else side
            _check_vocabulary(seq, index, column, vocab_size, "reward model")
        return ids

    def process(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        chosen = ids_of(batch, "chosen", indices)
        rejected = ids_of(batch, "rejected", indices)
        if has_margin:
            _check_present(batch["margin"], "margin", indices)
            margins = [float(m) for m in batch["margin"]]
        else:
            margins = [0.0] * len(chosen)
        out: dict[str, list[Any]] = {name: [] for name in (*_TOKENIZED_COLUMNS, "_truncated")}
        for c, r, m in zip(chosen, rejected, margins, strict=True):
            long = max_length is not None and max(len(c), len(r)) > max_length
            if long and drop:
                continue
            if long:
                c, r = _truncate_left(c, max_length, bos_id), _truncate_left(r, max_length, bos_id)
            out["input_ids_chosen"].append(c)
            out["input_ids_rejected"].append(r)
            out["margin"].append(m)
            out["_truncated"].append(long)
        return out

    features = datasets.Features(
        {
            "input_ids_chosen": datasets.List(datasets.Value("int64")),
            "input_ids_rejected": datasets.List(datasets.Value("int64")),
            "margin": datasets.Value("float64"),
            "_truncated": datasets.Value("bool"),
        }
    )
    tokenized = dataset.map(
        process,
        batched=True,
        with_indices=True,
        remove_columns=dataset.column_names,  # all of them, so the batch may shrink (dropped pairs)
        features=features,
        num_proc=num_proc,
        desc=f"Tokenizing preference pairs ({fmt})",
    )
    # The map's output has no indices mapping, so its Arrow table is the rows as they are; counting there
    # avoids iterating a datasets 5 Column (one formatted row at a time, ~100x slower).
    num_truncated = tokenized.data.column("_truncated").to_pylist().count(True)
    tokenized = tokenized.remove_columns("_truncated")
    stats = PreferenceTokenizationStats(
        num_rows=len(dataset),
        num_kept=len(tokenized),
        num_truncated=num_truncated,
        num_dropped=len(dataset) - len(tokenized),
        max_length=max_length,
    )
    return tokenized, stats


def _truncate_left(ids: list[int], max_length: int, bos_id: int | None) -> list[int]:
    """The last `max_length` ids of `ids`; a leading BOS stays in front of the last ``max_length - 1``."""
    if len(ids) <= max_length:
        return ids
    if bos_id is not None and ids[0] == bos_id:
        return [bos_id, *ids[len(ids) - max_length + 1 :]]
    return ids[len(ids) - max_length :]


def _check_present(values: Sequence[Any], column: str, indices: list[int]) -> None:
    for value, index in zip(values, indices, strict=True):
        if value is None:
            raise ValueError(
                f"row {index}: column {column!r} is missing (None). Remove or fill such rows first, e.g. "
                f"dataset.filter(lambda row: row[{column!r}] is not None)."
            )


def _check_strings(values: Sequence[Any], column: str, indices: list[int]) -> None:
    for value, index in zip(values, indices, strict=True):
        if not isinstance(value, str):
            raise ValueError(
                f"row {index}: column {column!r} holds {_describe(value)}, expected a string. Convert or "
                "remove that row, e.g. with dataset.map or dataset.filter."
            )


# --------------------------------------------------------------------------------------------------
# Collation
# --------------------------------------------------------------------------------------------------


def _check_padding_args(pad_token_id: Any, pad_to_multiple_of: Any) -> None:
    if (
        pad_token_id is None
        or not isinstance(pad_token_id, numbers.Integral)
        or isinstance(pad_token_id, bool)
    ):
        raise ValueError(
            f"pad_token_id={pad_token_id!r}: must be an int (tokenizer.pad_token_id). If the tokenizer has no "
            "pad token, add one: tokenizer.add_special_tokens({'pad_token': '<|pad|>'})."
        )
    if pad_to_multiple_of is not None and (
        not isinstance(pad_to_multiple_of, numbers.Integral) or pad_to_multiple_of < 1
    ):
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of!r}: must be a positive integer or None.")


def _padded_length(lengths: list[int], pad_to_multiple_of: int | None) -> int:
    length = max(lengths)
    if pad_to_multiple_of is not None:
        length = math.ceil(length / pad_to_multiple_of) * pad_to_multiple_of
    return length


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
        _check_padding_args(pad_token_id, pad_to_multiple_of)
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
        length = _padded_length(lengths, self.pad_to_multiple_of)
        input_ids = torch.full((len(sequences), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
        for row, (seq, n) in enumerate(zip(sequences, lengths, strict=True)):
            span = slice(0, n) if self.padding_side == "right" else slice(length - n, length)
            input_ids[row, span] = seq
            attention_mask[row, span] = 1
        margin = torch.tensor([float(f.get("margin", 0.0)) for f in features], dtype=torch.float32)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "margin": margin}


# --------------------------------------------------------------------------------------------------
# Prompt data (PPO / RLOO)
# --------------------------------------------------------------------------------------------------

#: Prompt formats (see the module docstring): strings, chat messages, or token ids.
PROMPT_FORMATS: tuple[str, ...] = ("text", "conversational", "tokenized")

# The column that holds the prompts: the first of these that the dataset has.
_PROMPT_COLUMNS = ("prompt", "messages", "input_ids")

# Per-row prompt length before truncation, carried through ``dataset.map`` and removed afterwards.
_LENGTH_COLUMN = "__rlhf_trainers_prompt_length__"
#: Rows per tokenizer call when an in-memory dataset is tokenized without ``map`` (map's default batch).
_TOKENIZE_BATCH = 1000

_ACCEPTED_PROMPT_FORMATS = (
    "Accepted prompt formats (the first of the columns 'prompt', 'messages', 'input_ids' is used):\n"
    "  text: column 'prompt' of strings\n"
    "  conversational: column 'prompt' or 'messages' of lists of {\"role\", \"content\"} messages, ending "
    "with a user or system turn\n"
    "  tokenized: column 'input_ids' of lists of int token ids"
)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _prompt_column(dataset: datasets.Dataset, fmt: str) -> str:
    """The column that holds the prompts of a dataset in format `fmt`."""
    if fmt == "tokenized":
        return "input_ids"
    return "prompt" if "prompt" in dataset.column_names else "messages"


def detect_prompt_format(dataset: datasets.Dataset) -> str:
    """The prompt format of `dataset`: one of :data:`PROMPT_FORMATS`.

    The prompts are read from the column ``prompt`` if there is one, else ``messages``, else
    ``input_ids`` (so a dataset with both text prompts and ids is "text", and its ids are replaced by
    :func:`tokenize_prompts`). The type of the first row's value then decides: a string is "text"
    (``prompt`` only), a non-empty list of ``{"role", "content"}`` dicts is "conversational", a list of
    ints is "tokenized" (``input_ids`` only). Arrow stores one type per column, so the first row stands for
    all rows; :func:`tokenize_prompts` checks every row and reports bad ones with their index.

    Args:
        dataset: a ``datasets.Dataset`` (one split).

    Returns:
        "text", "conversational" or "tokenized".

    Raises:
        TypeError: `dataset` is a ``DatasetDict`` (pick a split) or not a ``datasets.Dataset``.
        ValueError: the dataset is empty, has none of the prompt columns, or its prompt column holds
            values of another type; the message names the columns and lists the accepted formats.
    """
    _check_dataset_type(dataset)
    columns = sorted(dataset.column_names)
    if len(dataset) == 0:
        raise ValueError(
            f"the prompt dataset has 0 rows (columns: {columns}); nothing to generate from. Pass a dataset "
            "with at least one prompt (check the split you picked, or a filter that removed every row)."
        )
    column = next((c for c in _PROMPT_COLUMNS if c in columns), None)
    if column is None:
        raise ValueError(
            f"the dataset's columns {columns} hold no prompts: none of 'prompt', 'messages', 'input_ids' is "
            "present.\n" + _ACCEPTED_PROMPT_FORMATS + "\nRename the prompt column with "
            "dataset.rename_column(old, 'prompt')."
        )
    value = dataset[0][column]
    if column == "input_ids":
        if isinstance(value, list) and all(_is_token_id(i) for i in value):
            return "tokenized"
        expected = "a list of int token ids (tokenized format)"
    elif column == "prompt" and isinstance(value, str):
        return "text"
    elif _is_message_list(value):
        return "conversational"
    elif column == "prompt":
        expected = (
            'a string (text format) or a non-empty list of {"role", "content"} messages (conversational '
            "format); token ids go in a column 'input_ids'"
        )
    else:
        expected = 'a non-empty list of {"role", "content"} messages (conversational format)'
    raise ValueError(
        f"column {column!r} (of columns {columns}): the first row holds {_describe(value)}, but {expected} "
        "is expected.\n" + _ACCEPTED_PROMPT_FORMATS
    )


@dataclass
class PromptTokenizationStats:
    """What :func:`tokenize_prompts` did.

    Attributes:
        format: the detected format, one of :data:`PROMPT_FORMATS`.
        num_rows: rows in the dataset (the output has the same rows).
        num_truncated: prompts longer than `max_prompt_length` whose start was cut.
        max_prompt_length: the limit applied (None: no limit).
        longest: tokens in the longest prompt, before truncation.
    """

    format: str
    num_rows: int
    num_truncated: int
    max_prompt_length: int | None
    longest: int


def _check_prompt_args(max_prompt_length: Any, vocab_size: Any, num_proc: Any) -> None:
    if max_prompt_length is not None and (not _is_token_id(max_prompt_length) or max_prompt_length < 1):
        raise ValueError(
            f"max_prompt_length={max_prompt_length!r}: must be a positive integer (longer prompts keep their "
            "last max_prompt_length tokens), or None for no limit."
        )
    if vocab_size is not None and (not _is_token_id(vocab_size) or vocab_size < 1):
        raise ValueError(
            f"vocab_size={vocab_size!r}: must be a positive integer (e.g. the policy's "
            "model.get_input_embeddings().num_embeddings), or None to skip the id check."
        )
    if num_proc is not None and (not _is_token_id(num_proc) or num_proc < 1):
        raise ValueError(f"num_proc={num_proc!r}: must be a positive integer or None.")


def _check_prompt_conversations(values: Sequence[Any], column: str, indices: list[int]) -> None:
    for value, index in zip(values, indices, strict=True):
        if not _is_message_list(value):
            raise ValueError(
                f"row {index}: column {column!r} holds {_describe(value)}, expected a non-empty list of "
                '{"role", "content"} messages.'
            )
        _check_messages(value, index, column)
        if value[-1]["role"] == "assistant":
            raise ValueError(
                f"row {index}: the conversation in column {column!r} ends with an assistant message, but a "
                "prompt must end with a user or system turn (the policy writes the assistant's answer; "
                "add_generation_prompt=True opens it). If the rows are full conversations, drop the last "
                f"turn: dataset.map(lambda row: {{{column!r}: row[{column!r}][:-1]}})."
            )


def _check_messages(messages: list[dict[str, Any]], index: int, column: str) -> None:
    """ValueError naming the row and message unless each message has a role (a non-empty string) and a
    content (a string, or a list of parts such as ``{"type": "text", "text": ...}``).

    Arrow stores a column of messages as structs with the union of the keys of all rows, so a message
    that lacks "content" (or "role") in one row reads as None there; a chat template would render it
    as "None" or as nothing, without a word.
    """
    for position, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(
                f"row {index}: message {position} of column {column!r} has role {role!r}; every message needs "
                "a role, a non-empty string such as 'system', 'user' or 'assistant'. Fix or remove that row."
            )
        if not isinstance(content, (str, list)):
            raise ValueError(
                f"row {index}: message {position} (role {role!r}) of column {column!r} has content "
                f"{_describe(content)}; every message needs a content: a string (may be empty), or a list of "
                'parts like {"type": "text", "text": "..."}. Fix or remove that row.'
            )


def _apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, conversations: list[Any], indices: list[int], **kwargs: Any
) -> Any:
    """``tokenizer.apply_chat_template`` over a batch; when the template fails, a ValueError names the
    first row it fails on (templates raise on roles or orders they do not accept)."""
    try:
        return tokenizer.apply_chat_template(conversations, **kwargs)
    except Exception:  # jinja2 TemplateError, or whatever the template's filters raise
        for conversation, index in zip(conversations, indices, strict=True):
            try:
                tokenizer.apply_chat_template([conversation], **kwargs)
            except Exception as row_err:
                raise ValueError(
                    f"row {index}: the tokenizer's chat template fails on this conversation "
                    f"({type(row_err).__name__}: {row_err}); roles: {[m.get('role') for m in conversation]}. "
                    "Fix or remove that row, or use a chat template that accepts these messages."
                ) from row_err
        raise


def _chat_template_ids(result: Any) -> list[list[int]]:
    """The ids of a batched ``apply_chat_template(..., tokenize=True)`` call, whatever it returned.

    transformers 5 returns a ``BatchEncoding`` (``return_dict=True`` is its default), older versions a
    list of id lists.
    """
    if isinstance(result, Mapping):
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    return [list(seq) for seq in result]


def _checked_prompt_ids(ids: Any, index: int, column: str, vocab_size: int | None) -> list[int]:
    """`ids` as a list of ints; ValueError naming row `index` if it is not one, is empty or leaves the vocab."""
    if not isinstance(ids, (list, tuple)) or not all(_is_token_id(i) for i in ids):
        raise ValueError(
            f"row {index}: the token ids of column {column!r} are {_describe(ids)}, expected a list of ints."
        )
    if len(ids) == 0:
        what = (
            "column 'input_ids' is an empty list"
            if column == "input_ids"
            else f"{column!r} tokenizes to nothing"
        )
        raise ValueError(
            f"row {index}: the prompt has 0 tokens ({what}); every prompt needs at least one. "
            "Remove empty prompts first, e.g. with dataset.filter."
        )
    _check_vocabulary(ids, index, column, vocab_size, "policy")
    return [int(i) for i in ids]


def _check_vocabulary(
    ids: Sequence[int], index: int, column: str, vocab_size: int | None, model: str
) -> None:
    """ValueError naming row `index` if an id of `ids` is outside ``[0, vocab_size)`` (None: no check)."""
    if vocab_size is None:
        return
    for i in ids:
        if not 0 <= i < vocab_size:
            raise ValueError(
                f"row {index}: token id {i} is outside the vocabulary (vocab_size={vocab_size}, valid ids "
                f"0..{vocab_size - 1}) of the {model}, in column {column!r}: the text was tokenized with another "
                f"tokenizer than the {model}'s. Tokenize it with the {model}'s tokenizer, or, if tokens were "
                "added to that tokenizer, call model.resize_token_embeddings(len(tokenizer))."
            )


def tokenize_prompts(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase | None,
    *,
    max_prompt_length: int | None = None,
    vocab_size: int | None = None,
    num_proc: int | None = None,
) -> tuple[datasets.Dataset, PromptTokenizationStats]:
    """Token ids for the prompts of a PPO/RLOO dataset in any of :data:`PROMPT_FORMATS`.

    Per format (:func:`detect_prompt_format`):

    - text: ``tokenizer(prompt, add_special_tokens=True)``, i.e. exactly ``tokenizer(prompt)``, so a
      tokenizer that adds BOS adds it here too.
    - conversational: ``tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)``:
      the template's text plus the opening of the assistant turn, which the policy then completes. A
      conversation that already ends with an assistant message is an error.
    - tokenized: the ``input_ids`` as given (checked).

    A prompt longer than `max_prompt_length` keeps its last `max_prompt_length` tokens (the end of a prompt,
    next to where generation starts, matters most); if it started with ``tokenizer.bos_token_id`` that
    token stays in front of the last ``max_prompt_length - 1``. Without a tokenizer (tokenized format
    only) no BOS is known and the cut is plain.

    Args:
        dataset: one split, in any of :data:`PROMPT_FORMATS`.
        tokenizer: the policy's tokenizer (with a chat template for conversational prompts). May be None
            for the tokenized format.
        max_prompt_length: most tokens per prompt (>= 1), or None for no limit.
        vocab_size: if given, every id must be in ``[0, vocab_size)`` (e.g. the size of the policy's
            input embeddings), which catches prompts tokenized with another tokenizer.
        num_proc: processes for ``dataset.map`` (None: this process).

    Returns:
        ``(tokenized, stats)``. `tokenized` has the rows of `dataset` in the same order and all its columns
        (the ``prompt``/``messages`` column too, for reward functions that want the prompt text), plus
        ``input_ids``: lists of int64 ids, unpadded (for "text" and "conversational" a column of that name
        is replaced). `stats` gives the format, counts and the longest prompt.

    Raises:
        ValueError: bad arguments, no tokenizer (or no chat template) where one is needed, a missing value,
            a prompt of 0 tokens, non-int ids, ids outside `vocab_size`, a conversation ending with an
            assistant message (all with the row index), and everything :func:`detect_prompt_format` raises.
    """
    import datasets

    _check_prompt_args(max_prompt_length, vocab_size, num_proc)
    fmt = detect_prompt_format(dataset)
    column = _prompt_column(dataset, fmt)
    if fmt != "tokenized" and tokenizer is None:
        raise ValueError(
            f"tokenizer=None, but the prompts are {fmt} (column {column!r}) and must be tokenized. Pass the "
            "policy's tokenizer, or give the dataset a column 'input_ids' of token ids (and no 'prompt' or "
            "'messages' column)."
        )
    if fmt == "conversational" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the prompts are conversational (column {column!r} holds lists of messages) but the tokenizer has "
            "no chat template. Set tokenizer.chat_template to a Jinja template (e.g. the one of the model's "
            "instruct version), or give the prompts as strings in a column 'prompt'."
        )
    if _LENGTH_COLUMN in dataset.column_names:
        raise ValueError(f"the dataset has a column {_LENGTH_COLUMN!r}, a name reserved here; rename it.")
    bos_id = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None

    def process(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        values = batch[column]
        _check_present(values, column, indices)
        if fmt == "text":
            _check_strings(values, column, indices)
            ids = tokenizer(values, add_special_tokens=True, return_attention_mask=False)["input_ids"]
        elif fmt == "conversational":
            _check_prompt_conversations(values, column, indices)
            ids = _chat_template_ids(
                _apply_chat_template(tokenizer, values, indices, tokenize=True, add_generation_prompt=True)
            )
        else:
            ids = values
        out: dict[str, list[Any]] = {"input_ids": [], _LENGTH_COLUMN: []}
        for seq, index in zip(ids, indices, strict=True):
            seq = _checked_prompt_ids(seq, index, column, vocab_size)
            out[_LENGTH_COLUMN].append(len(seq))
            if max_prompt_length is not None:
                seq = _truncate_left(seq, max_prompt_length, bos_id)
            out["input_ids"].append(seq)
        return out

    ids_feature = datasets.List(datasets.Value("int64"))
    if num_proc is None and not dataset.cache_files:
        # An in-memory dataset (from_dict, from_list, ...): the same batches through `process`, the ids added
        # as a column. map's function fingerprinting and Arrow writer cost ~3 MiB of resident memory and
        # buy nothing here (no cache file is written for an in-memory dataset).
        source = dataset.with_format(None).select_columns([column])
        ids_column: list[list[int]] = []
        lengths = []
        for start in range(0, len(dataset), _TOKENIZE_BATCH):
            stop = min(start + _TOKENIZE_BATCH, len(dataset))
            out = process(source[start:stop], list(range(start, stop)))
            ids_column += out["input_ids"]
            lengths += out[_LENGTH_COLUMN]
        others = [name for name in dataset.column_names if name != "input_ids"]
        if others:
            base = dataset.select_columns(others)
            tokenized = base.add_column("input_ids", ids_column, feature=ids_feature)
        else:  # a table without columns has no rows to add a column to
            features = datasets.Features({"input_ids": ids_feature})
            tokenized = datasets.Dataset.from_dict({"input_ids": ids_column}, features=features)
    else:
        features = dataset.features.copy()
        features["input_ids"] = ids_feature
        features[_LENGTH_COLUMN] = datasets.Value("int64")
        tokenized = dataset.map(
            process,
            batched=True,
            with_indices=True,
            features=features,
            num_proc=num_proc,
            desc=f"Tokenizing prompts ({fmt})",
        )
        # map writes a new table without indices mapping: its Arrow column is the rows in order (see above).
        lengths = tokenized.data.column(_LENGTH_COLUMN).to_pylist()
        tokenized = tokenized.remove_columns(_LENGTH_COLUMN)
    stats = PromptTokenizationStats(
        format=fmt,
        num_rows=len(dataset),
        num_truncated=0 if max_prompt_length is None else sum(n > max_prompt_length for n in lengths),
        max_prompt_length=max_prompt_length,
        longest=max(lengths),
    )
    return tokenized, stats


class PromptCollator:
    """Left-pads tokenized prompts for generation, passing the other columns through.

    Generation appends to the right of every row, so prompts are padded on the left: the last prompt
    token of every row sits in the last column and the completions line up.

    Args:
        pad_token_id: the id written into padding positions (``tokenizer.pad_token_id``).
        pad_to_multiple_of: round the padded length T up to a multiple of this (e.g. 8 for tensor cores).

    Calling it on a list of B rows (dicts with the same keys, each with ``input_ids``: a list or 1-D tensor
    of ids, as :func:`tokenize_prompts` makes them) returns:

    - ``input_ids``: (B, T) long, each row's ids at the right end, `pad_token_id` before them.
    - ``attention_mask``: (B, T) long, 1 on real tokens, 0 on padding.
    - every other key of the rows (``prompt``, ``messages``, extra columns for reward functions): a Python
      list of the B values, in row order. An ``attention_mask`` key of the rows is replaced, not passed on.

    T is the longest prompt of the batch (rounded up to `pad_to_multiple_of`).
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        _check_padding_args(pad_token_id, pad_to_multiple_of)
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(pad_token_id={self.pad_token_id}, "
            f"pad_to_multiple_of={self.pad_to_multiple_of})"
        )

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        """Left-pad `features` (B rows) into ``input_ids`` and ``attention_mask`` (B, T); other keys as lists."""
        if len(features) == 0:
            raise ValueError("PromptCollator got an empty list of rows.")
        keys = list(features[0])
        if "input_ids" not in keys:
            raise ValueError(
                f"PromptCollator: the rows have keys {keys} but no 'input_ids'; tokenize the dataset first "
                "with rlhf_trainers.data.tokenize_prompts."
            )
        for row, feature in enumerate(features):
            if set(feature) != set(keys):
                raise ValueError(
                    f"PromptCollator: row {row} has keys {sorted(feature)}, but row 0 has {sorted(keys)}; "
                    "all rows of a batch need the same keys."
                )
        sequences = [torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features]
        for row, seq in enumerate(sequences):
            if seq.dim() != 1 or len(seq) == 0:
                raise ValueError(
                    f"PromptCollator: row {row} has input_ids of shape {tuple(seq.shape)}; each row needs a "
                    "non-empty 1-D sequence of ids."
                )
        lengths = [len(s) for s in sequences]
        length = _padded_length(lengths, self.pad_to_multiple_of)
        input_ids = torch.full((len(sequences), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
        for row, (seq, n) in enumerate(zip(sequences, lengths, strict=True)):
            input_ids[row, length - n :] = seq
            attention_mask[row, length - n :] = 1
        batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        for key in keys:
            if key not in batch:
                batch[key] = [f[key] for f in features]
        return batch


# --------------------------------------------------------------------------------------------------
# Inspecting tokenized datasets (for the trainers' checks at construction)
# --------------------------------------------------------------------------------------------------


def _token_column(dataset: datasets.Dataset, column: str) -> Any:
    """The Arrow list array of `column` over the dataset's rows, in order (honours select/shuffle)."""
    if column not in dataset.column_names:
        raise ValueError(f"the dataset has no column {column!r} (columns: {dataset.column_names}).")
    return dataset.with_format("arrow")[column].combine_chunks()


def longest_sequence(dataset: datasets.Dataset, *columns: str) -> int:
    """Tokens in the longest sequence of the list-of-ids `columns` (e.g. ``"input_ids"``); 0 when empty.

    Reads the Arrow lengths, without decoding any row, so it costs little on large datasets.
    """
    import pyarrow.compute as pc

    longest = 0
    for column in columns:
        value = pc.max(pc.list_value_length(_token_column(dataset, column))).as_py()
        longest = max(longest, value or 0)
    return longest


def first_row_with_token(dataset: datasets.Dataset, column: str, token_id: int) -> int | None:
    """Index of the first row whose list of ids in `column` contains `token_id`, or None.

    Used to find prompts that already hold the pad token (padded by the user, or an EOS that is also
    the pad token), which batching could not tell from padding.
    """
    import pyarrow.compute as pc

    ids = _token_column(dataset, column)
    hit = pc.index(pc.equal(pc.list_flatten(ids), token_id), True).as_py()
    if hit < 0:
        return None
    return int(pc.list_parent_indices(ids)[hit].as_py())
